#!/usr/bin/env bash
# GPU smoke test, one accelerator: random Qwen2.5-7B-shaped weights (float32 masters, a bfloat16 rollout copy),
# a batch-32 decode of 256 tokens and one N=30 ES update, printed next to the compile-only plan's numbers for the
# same shapes on this device (tokens/s against the roofline, peak memory against the plan's bytes). Designed to
# finish in under 8 minutes on an H100-class GPU (about 60 GB of its memory); the limit below stops it otherwise.
#
#   bash scripts/gpu_smoke.sh                      # plan for an H100 (ACCELERATOR=h200 or v5e for the others)
#   bash scripts/gpu_smoke.sh --json               # the same as JSON
#   bash scripts/gpu_smoke.sh --tiny               # a tiny Qwen2 config: runs anywhere, CPU included (tests)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exec timeout "${SMOKE_TIMEOUT_S:-480}" "$PYTHON" -m asyncres_jax.bench smoke --accelerator "${ACCELERATOR:-h100}" "$@"
