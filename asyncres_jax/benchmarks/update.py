"""python -m asyncres_jax.bench update [--config FILE] [--updates N] [--set KEY=VALUE ...] [--json]

What one ES update of a config costs, and where its wall clock goes: trains a fresh run of the config (default:
the CPU default, configs/smollm2_cpu.yaml) for --warmup + --updates updates in a temporary run directory (no
held-out evaluation, one checkpoint at the end) and reports, over the updates after the warm-up (which compiles):
  seconds_per_update   the median update wall clock (metrics.jsonl `update_seconds`)
  phases               seconds per phase (metrics.PHASES), the mean over those updates (they add up to the wall clock)
  episodes, generated_tokens, prefill_tokens   per update (means)
  floor_seconds        in the same process: one plain batched generation of the same prompt and generated token
                       counts per update (each episode one row with the mean prompt+observation tokens of an
                       episode, generating the mean tokens of an episode, EOS disabled; rows batched as the update
                       batches them, and split into es.streams_per_batch generations at once as the update splits
                       them), no sandboxes, no ES: what an update would cost if all but the model were free
  floor_ratio          seconds_per_update / floor_seconds
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

from asyncres_jax.errors import UserError

DEFAULT_CONFIG = "configs/smollm2_cpu.yaml"


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m asyncres_jax.bench update", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=DEFAULT_CONFIG, help=f"run config (default {DEFAULT_CONFIG})")
    ap.add_argument("--updates", type=int, default=3, help="updates measured after the warm-up (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="updates run first and not measured (default 1)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides, e.g. tasks.dataset=DIR pool.mode=sync")
    ap.add_argument("--floor-repeats", type=int, default=2, help="timed floor generations after one to compile")
    ap.add_argument("--run-dir", help="train into this new directory and keep it (its metrics.jsonl holds every "
                                      "update's phases even if the benchmark is stopped); default: a temporary one")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.updates < 1 or args.warmup < 0 or args.floor_repeats < 1:
        raise UserError("--updates and --floor-repeats must be at least 1 and --warmup at least 0")
    if args.run_dir and pathlib.Path(args.run_dir).exists():
        raise UserError(f"--run-dir {args.run_dir} exists; give a new directory")
    if not pathlib.Path(args.config).is_file():
        raise UserError(f"--config {args.config} does not exist; give a run config such as {DEFAULT_CONFIG}")
    return args


def floor_seconds(model, episodes: int, prompt_tokens: int, new_tokens: int, batch_rows: int,
                  repeats: int, streams: int = 1) -> tuple[float, int]:
    """Median seconds of `episodes` rows (`prompt_tokens` random prompt tokens each, `new_tokens` generated,
    greedy, EOS disabled) in batches of `batch_rows`, each split into `streams` generations run at once (as
    es.streams_per_batch plays a batch), after one untimed run; and the tokens generated per run."""
    from asyncres_jax.model import Model
    from asyncres_jax.model.generate import Engine
    from asyncres_jax.model.sampling import Sampling

    engine = Engine(Model(model.config.replace(eos_token_ids=()), model.params, None, model.mesh, model.source))
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, model.config.vocab_size, (episodes, max(1, prompt_tokens)), np.int32).tolist()

    def play(rows: list[list[int]]) -> int:
        conv = engine.start_tokens(model.params, rows, seed=0)
        conv, _ = engine.generate(model.params, conv, max(1, new_tokens), Sampling(temperature=0.0))
        return sum(int(np.sum(g)) for g in conv.generated_mask)

    def run() -> int:
        generated = 0
        with cf.ThreadPoolExecutor(streams) as pool:
            for b0 in range(0, episodes, batch_rows):
                batch = prompts[b0:b0 + batch_rows]
                parts = np.array_split(np.arange(len(batch)), min(streams, len(batch)))
                generated += sum(pool.map(lambda part: play([batch[i] for i in part]), parts))
        return generated

    generated = run()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times), generated


def main(argv: list[str]) -> int:
    import jax

    from asyncres_jax import metrics
    from asyncres_jax.config import load_config
    from asyncres_jax.trainer import ESTrainer, members_per_batch

    args = _parse(argv)
    total = args.warmup + args.updates
    with tempfile.TemporaryDirectory(prefix="bench_update_") as tmp:
        run_dir = pathlib.Path(args.run_dir or pathlib.Path(tmp) / "run")
        cfg = load_config(args.config, [f"run_dir={run_dir}", f"es.updates={total}", "eval.every=0",
                                        f"checkpoint.every={total}", *args.set])
        if cfg.algo != "es":
            raise UserError(f"bench update times ES updates; {args.config} has algo={cfg.algo}")
        trainer = ESTrainer(cfg)
        try:
            trainer.run()
            records = metrics.read(run_dir)[args.warmup:]
            if len(records) < args.updates:
                raise RuntimeError(f"the run logged {len(records)} measured updates, expected {args.updates}")
            mean = {k: float(np.mean([r[k] for r in records])) for k in ("episodes", "tokens", "prefill_tokens")}
            episodes = int(round(mean["episodes"]))
            batch_rows = cfg.es.tasks_per_member * (members_per_batch(cfg, cfg.pool.workers_per_replica)
                                                    if cfg.es.batched_population else 1)
            floor, floor_generated = floor_seconds(
                trainer.model, episodes, int(round(mean["prefill_tokens"] / episodes)),
                int(round(mean["tokens"] / episodes)), min(batch_rows, episodes), args.floor_repeats,
                streams=cfg.es.streams_per_batch)  # 1 unless the population is batched (ESSection checks)
        finally:
            trainer.close()
    seconds = statistics.median(r["update_seconds"] for r in records)
    out = {
        "benchmark": "update", "config": args.config, "overrides": args.set, "mode": cfg.pool.mode,
        "devices": f"{jax.device_count()} x {jax.devices()[0].platform}", "warmup": args.warmup,
        "updates": args.updates,
        "seconds_per_update": seconds,
        "update_seconds": [r["update_seconds"] for r in records],
        "phases": {k: float(np.mean([r["phases"][k] for r in records])) for k in metrics.PHASES},
        "episodes": mean["episodes"], "generated_tokens": mean["tokens"], "prefill_tokens": mean["prefill_tokens"],
        "prefill_slots": float(np.mean([r["prefill_slots"] for r in records])),
        "fitness_mean": [r["fitness_mean"] for r in records],
        "floor_seconds": floor, "floor_generated_tokens": floor_generated,
        "floor_ratio": seconds / floor if floor > 0 else math.inf,
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{seconds:.1f} s per update (median of {args.updates}; floor {floor:.1f} s, "
              f"ratio {out['floor_ratio']:.2f}); phases: {metrics.phases_line(out['phases'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
