#!/usr/bin/env bash
# The CPU replication study (docs/results.md), from configs/study/: every row's training run (running this again
# continues unfinished runs from their checkpoints and skips finished ones), then each run's small metrics files
# into docs/results/ROW/ and the table and curves regenerated from those copies.
#   bash scripts/study.sh [ROW ...]        # rows: es_sync es_async1 es_delay4 es_delay8 grpo (default: all)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ALL=(es_sync es_async1 es_delay4 es_delay8 grpo)
LABELS=("ES sync" "ES async K=1" "ES delay 4" "ES delay 8" "GRPO")
ROWS=("${@:-${ALL[@]}}")
for row in "${ROWS[@]}"; do
  [[ -f configs/study/$row.yaml ]] || { echo "error: no configs/study/$row.yaml; rows are: ${ALL[*]}" >&2; exit 2; }
  "$PY" -m asyncres_jax.train --config "configs/study/$row.yaml"
  mkdir -p "docs/results/$row"
  cp "runs/study/$row/metrics.jsonl" "runs/study/$row/eval.jsonl" "runs/study/$row/config.yaml" "docs/results/$row/"
done
dirs=() labels=()
for i in "${!ALL[@]}"; do
  if [[ -f docs/results/${ALL[$i]}/eval.jsonl ]]; then dirs+=("docs/results/${ALL[$i]}"); labels+=("${LABELS[$i]}"); fi
done
"$PY" -m asyncres_jax.plot "${dirs[@]}" --labels "${labels[@]}" --out docs/results --table docs/results.md
