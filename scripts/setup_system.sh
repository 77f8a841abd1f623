#!/usr/bin/env bash
# Installs the system packages the sandboxes need (as root, via apt-get), once. Idempotent.
set -euo pipefail
need=()
command -v bwrap >/dev/null || need+=(bubblewrap)
command -v setpriv >/dev/null || need+=(util-linux)
# the sandboxes grade with the host's own python3 + pytest (no network inside them)
/usr/bin/python3 -c "import pytest" 2>/dev/null || need+=(python3 python3-pytest)
if ((${#need[@]})); then
  if [ "$(id -u)" != 0 ]; then
    echo "error: missing system packages: ${need[*]}; install them with: sudo apt-get install ${need[*]}" >&2
    exit 2
  fi
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
