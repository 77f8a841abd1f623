#!/usr/bin/env bash
# Runs a command with the services the tests use started, and stops them afterwards (also on failure).
#
# Docker-API engine: when DOCKER_HOST is unset, there is no Docker socket and podman is installed, starts
# `podman system service` on a private unix socket and exports DOCKER_HOST for the command; where
# scripts/setup_system.sh built the offline Debian base image, task Dockerfiles' `FROM ubuntu:22.04` is then
# aliased to it (ASYNCRES_DOCKER_BASE_ALIASES; set it yourself to override).
set -euo pipefail
base_image=localhost/asyncres-base:bookworm
service_pid=""
service_dir=""
stop_services() {
  if [ -n "$service_pid" ]; then
    kill "$service_pid" 2>/dev/null || true
    wait "$service_pid" 2>/dev/null || true
  fi
  if [ -n "$service_dir" ]; then rm -rf "$service_dir"; fi
}
trap stop_services EXIT

if [ -z "${DOCKER_HOST:-}" ] && [ ! -S /var/run/docker.sock ] && command -v podman >/dev/null; then
  service_dir=$(mktemp -d /tmp/asyncres-podman.XXXXXX)
  podman system service --time=0 "unix://$service_dir/podman.sock" >"$service_dir/service.log" 2>&1 &
  service_pid=$!
  for _ in $(seq 100); do
    [ -S "$service_dir/podman.sock" ] && break
    kill -0 "$service_pid" 2>/dev/null || { cat "$service_dir/service.log" >&2; echo "error: podman system service did not start" >&2; exit 1; }
    sleep 0.1
  done
  [ -S "$service_dir/podman.sock" ] || { echo "error: podman system service made no socket in 10 s" >&2; exit 1; }
  export DOCKER_HOST="unix://$service_dir/podman.sock"
  # the base image lives in podman's storage, so the alias is only right for the engine started here
  if [ -z "${ASYNCRES_DOCKER_BASE_ALIASES:-}" ] && podman image exists "$base_image" 2>/dev/null; then
    export ASYNCRES_DOCKER_BASE_ALIASES="ubuntu:22.04=$base_image"
  fi
fi

# In the background, so that a signal to this script is handled now (a foreground child would delay the
# trap until it ends): the command gets the signal as TERM, its exit status is ours, the EXIT trap cleans up.
"$@" <&0 &
child=$!
trap 'kill -TERM "$child" 2>/dev/null || true' INT TERM
status=0
wait "$child" || status=$?
while kill -0 "$child" 2>/dev/null; do wait "$child" || status=$?; done
exit "$status"
