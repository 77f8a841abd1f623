"""bench comm: what keeping rollout replicas current costs per ES update, seeds + fitness vs the weights.

    python -m asyncres_jax.bench comm --json [--trees tiny smollm2] [--population 8]

Measured here: replaying one logged update (es.apply_logged_update: N members' noise regenerated over every
weight) on the tiny tree and on SmolLM2-135M's tree (shapes from its GGUF header, random values), per member.
Computed: per update, the bytes the driver sends to R replicas, N * (8 + 4) each with the SGD rule (int64 seed,
float32 shaped fitness per member) against 4 * P (float32) or 2 * P (bfloat16) each for a weight broadcast,
for SmolLM2-135M and Qwen2.5-7B, N = 8..256 and R = 8..64; the replay time per update (N members over P
weights, scaled linearly in P from the SmolLM2 measurement) and the link speed below which replay beats a copy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from asyncres_jax.errors import UserError, cli_main

MODELS = {"smollm2-135m": 134_515_008, "qwen2.5-7b": 7_615_616_512}  # parameters (Qwen2.5-7B: untied lm_head)
POPULATIONS = (8, 16, 32, 64, 128, 256)
REPLICAS = (8, 16, 32, 64)
SEED_BYTES, FITNESS_BYTES = 8, 4


def tree(name: str):
    import jax

    if name == "tiny":
        from asyncres_jax.model.tiny import tiny_model

        return tiny_model(0).params
    if name == "smollm2":
        from asyncres_jax.benchmarks.es import smollm2_params

        return jax.block_until_ready(smollm2_params())
    raise UserError(f"unknown tree {name!r}; choose tiny or smollm2")


def replay_seconds_per_member(params, population: int, repeats: int) -> dict:
    """Best-of-`repeats` wall time of replaying one logged update of `population` members, per member."""
    import jax
    import numpy as np

    from asyncres_jax import es
    from asyncres_jax.benchmarks.es import one_leaf_per_shape

    cfg = es.ESConfig(population=population)
    seeds = np.asarray([es.member_seed(0, 0, i) for i in range(population)], np.int64)
    shaped = es.shape_fitness(np.random.default_rng(0).random(population).astype(np.float32), cfg)
    small = one_leaf_per_shape(params)  # compiles every leaf shape without a full-size warm-up run
    jax.block_until_ready(es.apply_logged_update(small, es.init(small, cfg), seeds, shaped, cfg))
    state = es.init(params, cfg)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(es.apply_logged_update(params, state, seeds, shaped, cfg))
        best = min(best, time.perf_counter() - t)
    count = sum(x.size for x in jax.tree.leaves(params))
    return {"params": int(count), "population": population, "update_seconds": round(best, 4),
            "seconds_per_member": round(best / population, 5),
            "ns_per_member_param": round(best / population / count * 1e9, 4)}


def volumes(ns_per_member_param: float | None) -> dict:
    """Bytes per update to R replicas, replay seconds per update, and the break-even link speed."""
    out = {}
    for model, p in MODELS.items():
        rows = []
        for n in POPULATIONS:
            seeds = n * (SEED_BYTES + FITNESS_BYTES)
            replay_s = None if ns_per_member_param is None else n * p * ns_per_member_param * 1e-9
            rows.append({
                "population": n,
                "seeds_bytes_per_replica": seeds,
                "weights_bytes_per_replica_f32": 4 * p,
                "weights_bytes_per_replica_bf16": 2 * p,
                "weights_over_seeds": round(4 * p / seeds),
                "per_update_total_bytes": {str(r): {"seeds": r * seeds, "weights_f32": r * 4 * p} for r in REPLICAS},
                "replay_seconds_this_cpu": None if replay_s is None else round(replay_s, 2),
                # a copy of 4P bytes takes 4P / B seconds: replay wins on links slower than this
                "break_even_gbit_s": None if replay_s is None else round(4 * p * 8 / replay_s / 1e9, 3),
            })
        out[model] = {"params": p, "rows": rows}
    return out


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncres_jax.bench comm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--trees", nargs="+", default=["tiny", "smollm2"], help="trees to time replay on")
    parser.add_argument("--population", type=int, default=8, help="members in the timed update (default 8)")
    parser.add_argument("--repeats", type=int, default=2, help="timed replays per tree, best kept (default 2)")
    args = parser.parse_args(argv)
    if args.population < 1 or args.repeats < 1:
        raise UserError("--population and --repeats must be >= 1")
    import jax

    measured = {}
    for name in args.trees:
        measured[name] = replay_seconds_per_member(tree(name), args.population, args.repeats)
        if not args.json:
            print(f"{name:8s} replay {measured[name]['seconds_per_member']:.4f} s/member "
                  f"({measured[name]['params']:,} params)", flush=True)
    basis = measured.get("smollm2") or next(iter(measured.values()), None)
    result = {"benchmark": "comm", "backend": jax.default_backend(), "measured_replay": measured,
              "replay_basis": "smollm2" if "smollm2" in measured else (args.trees[0] if measured else None),
              "models": volumes(basis["ns_per_member_param"] if basis else None)}
    print(json.dumps(result, indent=2 if args.json else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
