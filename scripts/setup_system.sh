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

# --- podman: the Docker-API engine the docker backend's tests use, and an offline Debian base image -------
# Skipped where an engine is already configured (DOCKER_HOST or a Docker socket) or ASYNCRES_NO_PODMAN=1.
base_image=localhost/asyncres-base:bookworm
setup_podman() {
  local pneed=() p nofile root
  for p in podman runc debootstrap catatonit; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || pneed+=("$p")
  done
  if ((${#pneed[@]})); then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${pneed[@]}" >/dev/null
  fi
  # runc + cgroupfs work on these machines (no systemd, cgroup v1). podman's default nofile limit (1048576)
  # cannot be set without CAP_SYS_RESOURCE, so ask for what the current hard limit allows.
  nofile=$(ulimit -Hn)
  if [ "$nofile" = unlimited ] || [ "$nofile" -gt 65536 ]; then nofile=65536; fi
  mkdir -p /etc/containers/containers.conf.d
  cat >/etc/containers/containers.conf.d/50-asyncres.conf <<CONF
# written by asyncres-jax scripts/setup_system.sh
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=4096:4096"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
  podman image exists "$base_image" && return 0
  # The base that task Dockerfiles' `FROM ubuntu:22.04` is aliased to (ASYNCRES_DOCKER_BASE_ALIASES, set by
  # scripts/with_services.sh): Debian with python3, pip and pytest, so a task's apt-get/pip lines are cheap.
  root=$(mktemp -d /var/tmp/asyncres-base.XXXXXX)
  debootstrap --variant=minbase --include=python3,python3-pytest,python3-pip,ca-certificates \
    bookworm "$root" http://deb.debian.org/debian >/dev/null
  # Package lists in the image make a Dockerfile's `apt-get update` a quick "Hit"; no recommends keeps
  # `apt-get install python3-pip` from pulling in a compiler tool chain.
  printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' >"$root/etc/apt/apt.conf.d/99asyncres"
  cp /etc/resolv.conf "$root/etc/resolv.conf"
  chroot "$root" apt-get -o APT::Sandbox::User=root update -qq
  chroot "$root" apt-get clean
  : >"$root/etc/resolv.conf"
  tar -C "$root" -c . | podman import --change 'ENV PIP_BREAK_SYSTEM_PACKAGES=1' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'LABEL asyncres=1' - "$base_image" >/dev/null
  rm -rf "$root"
}
if [ -z "${DOCKER_HOST:-}" ] && [ ! -S /var/run/docker.sock ] && [ "${ASYNCRES_NO_PODMAN:-0}" != 1 ]; then
  if [ "$(id -u)" = 0 ]; then
    setup_podman
  elif ! podman image exists "$base_image" 2>/dev/null; then
    echo "warning: the docker backend's tests need podman and a base image; run as root: sudo bash $0" >&2
  fi
fi
