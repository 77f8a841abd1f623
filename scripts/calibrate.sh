#!/usr/bin/env bash
# The calibration sweep of the replication study (docs/calibration.md): synchronous ES from
# configs/calibration/sync.yaml, one run per setting, each continued from its checkpoint when run again and
# skipped when finished; each run's small metrics files go to docs/calibration/NAME/ and the table in
# docs/calibration.md is regenerated from those copies.
#   bash scripts/calibrate.sh ALPHA:SIGMA[:UPDATES[:SEED]] ...   # e.g. 0.004:0.002 0.001:0.002:48
#   bash scripts/calibrate.sh --probe SIGMA ...                  # 2 updates, no evaluation: member spread per sigma
# Every run reuses the base model's held-out evaluations of the first earlier run that has them (the settings are
# checked to match), so the base model is evaluated once per sweep.
set -euo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
usage="give settings ALPHA:SIGMA[:UPDATES[:SEED]] (e.g. 0.004:0.002) or --probe SIGMA... (e.g. --probe 0.002 0.005)"
[[ $# -gt 0 ]] || { echo "error: no settings; $usage" >&2; exit 2; }
num='^[0-9]*\.?[0-9]+([eE]-?[0-9]+)?$'
if [[ $1 == --probe ]]; then
  shift
  [[ $# -gt 0 ]] || { echo "error: --probe without a sigma; $usage" >&2; exit 2; }
  for sigma in "$@"; do
    [[ $sigma =~ $num ]] || { echo "error: sigma '$sigma' is not a number; $usage" >&2; exit 2; }
  done
  for sigma in "$@"; do
    # the same seed plays the same two task batches at every sigma (common random numbers across the probe)
    run=runs/probe/s$sigma
    "$PY" -m asyncres_jax.train --config configs/calibration/sync.yaml "es.sigma=$sigma" "es.alpha=$sigma" \
      es.updates=2 eval.every=0 eval.test_tasks=0 checkpoint.every=100 "run_dir=$run"
    mkdir -p "docs/calibration/probe/s$sigma"
    cp "$run/metrics.jsonl" "$run/config.yaml" "docs/calibration/probe/s$sigma/"
  done
  exit 0
fi
for spec in "$@"; do
  IFS=: read -r alpha sigma updates seed extra <<< "$spec"
  if [[ -n ${extra:-} || ! $alpha =~ $num || ! $sigma =~ $num || ! ${updates:-1} =~ ^[0-9]+$ || ! ${seed:-0} =~ ^[0-9]+$ ]]; then
    echo "error: '$spec' is not ALPHA:SIGMA[:UPDATES[:SEED]] with numbers; $usage" >&2
    exit 2
  fi
done
for spec in "$@"; do
  IFS=: read -r alpha sigma updates seed extra <<< "$spec"
  name=a$alpha-s$sigma${updates:+-u$updates}${seed:+-seed$seed} run=runs/calibration/$name
  bases=(runs/calibration/*/evals/test_00000.json)
  base=${bases[0]:-$run/evals/test_00000.json}
  args=("es.alpha=$alpha" "es.sigma=$sigma" "run_dir=$run" "eval.base_from=${base%/evals/test_00000.json}")
  [[ -z ${updates:-} ]] || args+=("es.updates=$updates")
  [[ -z ${seed:-} ]] || args+=("seed=$seed")
  "$PY" -m asyncres_jax.train --config configs/calibration/sync.yaml "${args[@]}"
  mkdir -p "docs/calibration/$name"
  cp "$run/metrics.jsonl" "$run/eval.jsonl" "$run/config.yaml" "docs/calibration/$name/"
done
dirs=(docs/calibration/a*/) labels=()
for d in "${dirs[@]}"; do n=$(basename "$d"); labels+=("${n%-seed*}"); done  # a setting's training seeds: one row
"$PY" -m asyncres_jax.plot "${dirs[@]%/}" --labels "${labels[@]}" --out docs/calibration --table docs/calibration.md
