#!/usr/bin/env bash
# The CPU replication study (docs/results.md), from configs/study/: every row's training run (running this again
# continues unfinished runs from their checkpoints and skips finished ones), then each run's small metrics files
# into docs/results/RUN/ and the table and curves regenerated from those copies.
#   bash scripts/study.sh [ROW[:SEED] ...]   # rows: es_sync es_async1 es_delay4 es_delay8 grpo (default: all)
# ROW:SEED trains the row again with another training seed (runs/study/ROW_seedSEED); the table then gives the
# row's mean over its seeds. Extra key=value overrides for every run go in STUDY_OVERRIDES.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ALL=(es_sync es_async1 es_delay4 es_delay8 grpo)
LABELS=("ES sync" "ES async K=1" "ES delay 4" "ES delay 8" "GRPO")
ROWS=("${@:-${ALL[@]}}")
read -r -a OVERRIDES <<< "${STUDY_OVERRIDES:-}"
for spec in "${ROWS[@]}"; do
  row=${spec%%:*} run=${spec%%:*} extra=()
  [[ -f configs/study/$row.yaml ]] || { echo "error: no configs/study/$row.yaml; rows are: ${ALL[*]}" >&2; exit 2; }
  if [[ $spec == *:* ]]; then
    seed=${spec#*:}
    [[ $seed =~ ^[0-9]+$ ]] || { echo "error: '$spec': the seed after ':' must be a whole number" >&2; exit 2; }
    run=${row}_seed$seed extra=("seed=$seed" "run_dir=runs/study/$run")
  fi
  "$PY" -m asyncres_jax.train --config "configs/study/$row.yaml" "${extra[@]}" "${OVERRIDES[@]}"
  mkdir -p "docs/results/$run"
  cp "runs/study/$run/metrics.jsonl" "runs/study/$run/eval.jsonl" "runs/study/$run/config.yaml" "docs/results/$run/"
done
dirs=() labels=()
for i in "${!ALL[@]}"; do
  for d in "docs/results/${ALL[$i]}" "docs/results/${ALL[$i]}"_seed*; do
    if [[ -f $d/eval.jsonl ]]; then dirs+=("$d"); labels+=("${LABELS[$i]}"); fi
  done
done
"$PY" -m asyncres_jax.plot "${dirs[@]}" --labels "${labels[@]}" --out docs/results --table docs/results.md
