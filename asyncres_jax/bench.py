"""python -m asyncres_jax.bench NAME [options] --json

Each benchmark lives in asyncres_jax/benchmarks/NAME.py and exposes `main(argv) -> int`; results are JSON
on stdout with --json. Benchmarks compare alternatives side by side in one run, as ratios, because shared
CPU machines are noisy.
"""

from __future__ import annotations

import importlib
import sys

from asyncres_jax.errors import UserError, cli_main

BENCHMARKS = {
    "generate": "tokens/s of KV-cached generation vs transformers' generate",
    "es": "time and memory of one ES update vs bare noise draws",
    "population": "low-rank population batched generation vs full-rank members one by one",
    "pool": "the async rollout pool with sleeping fake jobs: sync vs async vs controlled schedules",
    "sandbox": "sandbox start + command + teardown latency and parallel throughput",
    "docker": "docker sandbox latency and image build time",
    "episodes": "throughput of parallel scripted episodes",
    "grpo": "memory and time of one GRPO learner step (SmolLM2), XLA's estimate for Qwen2.5-7B",
    "smoke": "one accelerator, random model-shaped weights: decode tokens/s, an ES update, peak memory vs the plan",
    "comm": "keeping rollout replicas current: seeds+fitness bytes vs weight broadcast, replay time per member",
    "update": "seconds per ES update of a config, by phase, vs a plain generation of the same tokens (the floor)",
}


@cli_main
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        for name, what in BENCHMARKS.items():
            print(f"  {name:12s} {what}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        raise UserError(f"unknown benchmark {name!r}; choose one of: {', '.join(BENCHMARKS)}")
    return importlib.import_module(f"asyncres_jax.benchmarks.{name}").main(rest)


if __name__ == "__main__":
    sys.exit(main())
