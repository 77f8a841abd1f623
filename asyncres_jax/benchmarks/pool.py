"""bench pool: the real threaded rollout pool with sleeping fake jobs, sync vs async vs controlled schedules.

Scenarios (job durations depend only on the member seed, so every schedule sees the same jobs):
  paper  N = 30, 4 workers, uniform 5.1-11.9 "minutes" per perturbation (the paper's spread)
  heavy  N = 16, 8 workers, lognormal durations with sigma 1.0 (the long tail of agentic rollouts)
Each schedule also runs on the event simulator (same coordinator, simulated clock, many more updates):
backend "threads" is the measurement, backend "sim" the scheduling-theory reference.

    python -m asyncres_jax.bench pool --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np

from asyncres_jax.errors import UserError, cli_main
from asyncres_jax.rollout import Coordinator, JobResult, ParamStore, PoolConfig, RolloutPool, UpdateMetrics, simulate


@dataclasses.dataclass(frozen=True)
class Scenario:
    population: int
    workers: int
    seconds_per_unit: float  # wall seconds per unit of simulated duration (a "minute" in `paper`)
    mean_units: float  # expected job duration in units

    @property
    def expected_ideal(self) -> float:
        """Seconds per update with no idle worker and no wasted job, for jobs drawn from the distribution
        (unlike accepted work / workers, not biased by which jobs a schedule drops)."""
        return self.population * self.mean_units * self.seconds_per_unit / self.workers

    def duration(self, name: str):
        def paper(job, attempt):
            return float(np.random.default_rng([job.member_seed, attempt]).uniform(5.1, 11.9))

        def heavy(job, attempt):
            return float(np.random.default_rng([job.member_seed, attempt]).lognormal(0.0, 1.0))

        return {"paper": paper, "heavy": heavy}[name]


SCENARIOS = {"paper": Scenario(30, 4, 0.002, (5.1 + 11.9) / 2), "heavy": Scenario(16, 8, 0.010, float(np.exp(0.5)))}
SCHEDULES = {
    "sync": dict(mode="sync"),
    "async-1": dict(mode="async", max_staleness=1),
    "async-4": dict(mode="async", max_staleness=4),
    "delay-4": dict(mode="controlled", held_back=3, delay=4),
    "delay-8": dict(mode="controlled", held_back=3, delay=8),
}


def member_seed(global_seed: int, version: int, member: int) -> int:
    return int(np.random.SeedSequence([global_seed, version, member]).generate_state(1)[0])


def summarize(metrics: list[UpdateMetrics], workers: int, population: int, scale: float = 1.0) -> dict:
    """Steady-state numbers over `metrics` (warm-up already cut); times multiplied by `scale`."""
    n = len(metrics)
    wall = sum(m.wall_seconds for m in metrics)
    accepted = sum(m.accepted_seconds for m in metrics)
    busy = sum(m.busy_seconds for m in metrics)
    hist: dict[int, int] = {}
    for m in metrics:
        for s, c in m.staleness_hist.items():
            hist[s] = hist.get(s, 0) + c
    spu, ideal = scale * wall / n, scale * accepted / workers / n
    return {
        "updates": n,
        "seconds_per_update": spu,
        "ideal_seconds_per_update": ideal,
        "slowdown_vs_ideal": spu / ideal,
        "utilization": busy / (workers * wall),
        "stale_fraction": sum(c for s, c in hist.items() if s > 0) / (n * population),
        "wasted_fraction": sum(m.wasted_seconds for m in metrics) / busy,
        "dropped_per_update": sum(m.dropped for m in metrics) / n,
        "max_accepted_staleness": max(hist),
        "staleness_hist": {str(k): v for k, v in sorted(hist.items())},
        "result_wait_mean": scale * float(np.mean([m.result_wait_mean for m in metrics])),
    }


def run_threads(name: str, sc: Scenario, cfg: PoolConfig, warmup: int, updates: int) -> dict:
    duration = sc.duration(name)

    def job_fn(job, params):
        time.sleep(duration(job, 0) * sc.seconds_per_unit)
        return JobResult(float(job.member_seed % 1000) / 1000.0)

    store = ParamStore({"w": np.zeros(8, np.float32)}, apply_update=lambda p, o, s, z: (p, o),
                       shape=lambda f: f - f.mean())
    pool = RolloutPool(Coordinator(cfg, member_seed=member_seed), store, job_fn, poll_seconds=0.01)
    with pool:
        metrics = pool.run_until(warmup + updates, timeout=600)
    return summarize(metrics[warmup: warmup + updates], sc.workers, sc.population)


def run_sim(name: str, sc: Scenario, cfg: PoolConfig, warmup: int, updates: int) -> dict:
    run = simulate(cfg, sc.duration(name), warmup + updates, member_seed=member_seed)
    return summarize(run.metrics[warmup:], sc.workers, sc.population, scale=sc.seconds_per_unit)


@cli_main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m asyncres_jax.bench pool", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print a JSON list of rows")
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), help=f"of {list(SCENARIOS)}")
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), help=f"of {list(SCHEDULES)}")
    p.add_argument("--updates", type=int, default=0, help="measured updates per run (0: 20 paper / 40 heavy)")
    p.add_argument("--warmup", type=int, default=10, help="updates cut from the start (>= the largest delay)")
    p.add_argument("--sim-updates", type=int, default=1000, help="measured updates of the simulator reference")
    p.add_argument("--no-threads", action="store_true", help="simulator only (seconds, no real pool)")
    args = p.parse_args(argv)
    for s in args.scenarios:
        if s not in SCENARIOS:
            raise UserError(f"unknown scenario {s!r}; choose from {', '.join(SCENARIOS)}")
    for s in args.schedules:
        if s not in SCHEDULES:
            raise UserError(f"unknown schedule {s!r}; choose from {', '.join(SCHEDULES)}")

    rows = []
    for name in args.scenarios:
        sc = SCENARIOS[name]
        for sched in args.schedules:
            cfg = PoolConfig(population=sc.population, num_workers=sc.workers, **SCHEDULES[sched])
            base = {"scenario": name, "mode": cfg.mode, "schedule": sched, "max_staleness": cfg.staleness_bound,
                    "population": sc.population, "workers": sc.workers}
            backends = [("sim", run_sim, args.sim_updates)]
            if not args.no_threads:
                backends.insert(0, ("threads", run_threads, args.updates or (20 if name == "paper" else 40)))
            for backend, fn, n in backends:
                t0 = time.perf_counter()
                row = {**base, "backend": backend, **fn(name, sc, cfg, args.warmup, n)}
                row["expected_ideal_seconds_per_update"] = sc.expected_ideal
                row["slowdown_vs_expected_ideal"] = row["seconds_per_update"] / sc.expected_ideal
                row["bench_seconds"] = time.perf_counter() - t0
                rows.append(row)
                if not args.json:
                    print(f"{name:6s} {sched:8s} {backend:7s} s/update {row['seconds_per_update']:.4f} "
                          f"ideal {row['ideal_seconds_per_update']:.4f} (x{row['slowdown_vs_ideal']:.3f}) "
                          f"E-ideal x{row['slowdown_vs_expected_ideal']:.3f} "
                          f"util {row['utilization']:.3f} stale {row['stale_fraction']:.3f} "
                          f"wasted {row['wasted_fraction']:.3f} max-stale {row['max_accepted_staleness']}",
                          flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0
