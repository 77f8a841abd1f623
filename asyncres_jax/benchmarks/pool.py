"""bench pool: the real threaded rollout pool with sleeping fake jobs, sync vs async vs controlled schedules.

Scenarios (job durations depend only on the member seed, so every schedule sees the same jobs):
  paper  N = 30, 4 workers, uniform 5.1-11.9 "minutes" per perturbation (the paper's spread)
  heavy  N = 16, 8 workers, lognormal durations with sigma 1.0 (the long tail of agentic rollouts)
  correlated  as `heavy`, but a job's duration is correlated with its fitness (simulator only, see below)
Each schedule also runs on the event simulator (same coordinator, simulated clock, many more updates):
backend "threads" is the measurement, backend "sim" the scheduling-theory reference. Jobs run in turns
(`turn_units` each) and a cancelled job stops at its next turn boundary, as the episode runner does.

Async schedules come in three admission variants: `-drop` runs stale jobs to the end and drops their results
(cancel_stale=False), the plain name cancels them at the commit that makes them stale, `-paced` accepts every
job it starts (cohorts in dispatch order). Work is split into useful (accepted results), cancelled, dropped
and idle worker time. Async rows also carry `best_async_vs_ideal`, the model of the best schedule that keeps
its workers busy without knowing job durations (rollout.simulate.best_useful_fraction).

Bias (scenario `correlated`): each member's perturbation eps_i is a D-dimensional normal vector (from its seed),
its fitness g . eps_i + noise, and its log-duration leans on low fitness (failing episodes run all their
turns) and on another direction h of eps (say, verbosity). A schedule's ES update direction is
sum_i z_i eps_i / N over its cohort (z = the project's z-score shaping). Over many cohorts the mean update of
a schedule that keeps fast results preferentially gains a component along h (among the fast members, the
ones leaning on h are those with high fitness); sync with the same seeds is the reference.

    python -m asyncres_jax.bench pool --json
    python -m asyncres_jax.bench pool --real docs/pilot --json     # duration vs fitness in committed runs
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
import types

import numpy as np

from asyncres_jax.errors import UserError, cli_main
from asyncres_jax.es import ESConfig, shape_fitness
from asyncres_jax.rollout import (Coordinator, JobResult, ParamStore, PoolConfig, RolloutPool, UpdateMetrics,
                                  best_useful_fraction, simulate)
from asyncres_jax.rollout import cancel


@dataclasses.dataclass(frozen=True)
class Scenario:
    population: int
    workers: int
    seconds_per_unit: float  # wall seconds per unit of simulated duration (a "minute" in `paper`)
    mean_units: float  # expected job duration in units
    turn_units: float  # a job's turn: a cancelled job stops at the end of the turn it is in

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

        def correlated(job, attempt):
            return float(np.exp(log_duration(job.member_seed)))

        return {"paper": paper, "heavy": heavy, "correlated": correlated}[name]


SCENARIOS = {"paper": Scenario(30, 4, 0.002, (5.1 + 11.9) / 2, 1.0),
             "heavy": Scenario(16, 8, 0.010, float(np.exp(0.5)), 0.1),
             "correlated": Scenario(16, 8, 0.010, float(np.exp(0.5)), 0.1)}
SIM_ONLY = ("correlated",)
SCHEDULES = {
    "sync": dict(mode="sync"),
    "async-1-drop": dict(mode="async", max_staleness=1, cancel_stale=False),
    "async-1": dict(mode="async", max_staleness=1),
    "async-1-paced": dict(mode="async", max_staleness=1, paced=True),
    "async-4-drop": dict(mode="async", max_staleness=4, cancel_stale=False),
    "async-4": dict(mode="async", max_staleness=4),
    "async-4-paced": dict(mode="async", max_staleness=4, paced=True),
    "delay-4": dict(mode="controlled", held_back=3, delay=4),
    "delay-8": dict(mode="controlled", held_back=3, delay=8),
}

# The correlated scenario: eps_i in R^D, fitness along G, duration along -fitness and H (unit vectors).
DIM, G, H = 32, 0, 1
RHO = 0.6  # weight of -fitness in the log-duration (the rest is the h direction); log-duration std is 1


def eps_of(seed: int) -> np.ndarray:
    return np.random.default_rng([seed, 0xE5]).standard_normal(DIM)


def fitness_of(seed: int) -> float:
    return float(eps_of(seed)[G] + 0.5 * np.random.default_rng([seed, 0xF1]).standard_normal())


def log_duration(seed: int) -> float:
    fitness_z = fitness_of(seed) / np.sqrt(1.25)
    return float(-RHO * fitness_z + np.sqrt(1 - RHO ** 2) * eps_of(seed)[H])


def member_seed(global_seed: int, version: int, member: int) -> int:
    return int(np.random.SeedSequence([global_seed, version, member]).generate_state(1)[0])


@functools.cache  # one per scenario and bound, however many schedules and backends share them
def best_vs_ideal(name: str, sc: Scenario, max_staleness: int, samples: int = 20_000) -> float:
    """The least seconds per update against the ideal that an async schedule can reach on this scenario's job
    durations (rollout.simulate.best_useful_fraction: no idle worker, durations unknown until a job ends)."""
    duration = sc.duration(name)
    seconds = [duration(types.SimpleNamespace(member_seed=member_seed(0, i // sc.population, i % sc.population)), 0)
               for i in range(samples)]
    return 1.0 / best_useful_fraction(seconds, sc.population, sc.workers, max_staleness)


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
    capacity = workers * wall
    return {
        "updates": n,
        "seconds_per_update": spu,
        "ideal_seconds_per_update": ideal,
        "slowdown_vs_ideal": spu / ideal,
        "utilization": busy / capacity,
        # worker time: useful (behind accepted results) + cancelled + dropped + idle = 1, up to the jobs still
        # running at either end of the measured window
        "useful_fraction": accepted / capacity,
        "cancelled_fraction": sum(m.cancelled_seconds for m in metrics) / capacity,
        "dropped_fraction": sum(m.dropped_seconds for m in metrics) / capacity,
        "idle_fraction": 1.0 - busy / capacity,
        "stale_fraction": sum(c for s, c in hist.items() if s > 0) / (n * population),
        "wasted_fraction": sum(m.wasted_seconds for m in metrics) / busy,
        "dropped_per_update": sum(m.dropped for m in metrics) / n,
        "cancelled_per_update": sum(m.cancelled for m in metrics) / n,
        "max_accepted_staleness": max(hist),
        "staleness_hist": {str(k): v for k, v in sorted(hist.items())},
        "result_wait_mean": scale * float(np.mean([m.result_wait_mean for m in metrics])),
    }


def run_threads(name: str, sc: Scenario, cfg: PoolConfig, warmup: int, updates: int) -> dict:
    duration = sc.duration(name)

    def job_fn(job, params):
        left = duration(job, 0)
        while left > 0:  # in turns, checking for cancellation between them as the episode runner does
            cancel.check()
            time.sleep(min(left, sc.turn_units) * sc.seconds_per_unit)
            left -= sc.turn_units
        return JobResult(float(job.member_seed % 1000) / 1000.0)

    store = ParamStore({"w": np.zeros(8, np.float32)}, apply_update=lambda p, o, s, z: (p, o),
                       shape=lambda f: f - f.mean())
    pool = RolloutPool(Coordinator(cfg, member_seed=member_seed), store, job_fn, poll_seconds=0.01)
    with pool:
        metrics = pool.run_until(warmup + updates, timeout=600)
    return summarize(metrics[warmup: warmup + updates], sc.workers, sc.population)


def run_sim(name: str, sc: Scenario, cfg: PoolConfig, warmup: int, updates: int) -> dict:
    cohorts = []
    run = simulate(cfg, sc.duration(name), warmup + updates, member_seed=member_seed, turn_seconds=sc.turn_units,
                   on_commit=cohorts.append)
    row = summarize(run.metrics[warmup:], sc.workers, sc.population, scale=sc.seconds_per_unit)
    if name == "correlated":
        row["_updates"] = update_directions(cohorts[warmup:], sc.population)
    return row


def update_directions(cohorts, population: int) -> np.ndarray:
    """The ES update direction sum_i z_i eps_i / N of each cohort (z: z-score shaping of the cohort's fitness)."""
    cfg = ESConfig(population=population)
    out = []
    for c in cohorts:
        seeds = [int(r.job.member_seed) for r in c.results]
        z = shape_fitness([fitness_of(s) for s in seeds], cfg)
        out.append(np.einsum("n,nd->d", z, np.stack([eps_of(s) for s in seeds])) / population)
    return np.stack(out)


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def bias_columns(updates: np.ndarray, sync_updates: np.ndarray) -> dict:
    """How a schedule's update directions differ from sync's with the same seeds (over many cohorts)."""
    mean, ref = updates.mean(0), sync_updates.mean(0)
    m = min(len(updates), len(sync_updates))
    return {
        "update_cosine_vs_sync": _cos(mean, ref),  # of the mean update directions
        "update_norm_vs_sync": float(np.linalg.norm(mean) / np.linalg.norm(ref)),
        "mean_cohort_cosine_vs_sync": float(np.mean([_cos(a, b) for a, b in zip(updates[:m], sync_updates[:m])])),
        "cosine_to_fitness_direction": _cos(mean, np.eye(DIM)[G]),
        # != 0: which results a cohort keeps depends on duration, so the duration direction leaks into the update
        "duration_direction_component": float(mean[H] / np.linalg.norm(mean)),
        "mean_cohort_cosine_to_fitness_direction": float(np.mean([_cos(u, np.eye(DIM)[G]) for u in updates])),
    }


def duration_fitness_correlation(n: int = 20_000) -> float:
    seeds = [member_seed(0, v, i) for v in range(n // 16) for i in range(16)]
    return float(np.corrcoef([np.exp(log_duration(s)) for s in seeds], [fitness_of(s) for s in seeds])[0, 1])


def real_correlation(results_dir: str) -> list[dict]:
    """Duration vs fitness in committed ES runs (RUN_DIR/metrics.jsonl): the metrics are per update, so per
    update: generated tokens per episode (the episodes' length) and wall seconds, each against the cohort's
    mean fitness. Pearson r within each run, and pooled per schedule over runs (each run's means removed)."""
    import glob
    import os

    runs: dict[str, list] = {}
    for path in sorted(glob.glob(os.path.join(results_dir, "*", "metrics.jsonl"))):
        rows = [json.loads(line) for line in open(path) if line.strip()]
        if not rows or "fitness_mean" not in rows[0]:
            continue  # not an ES run (GRPO logs per step, not per cohort)
        name = os.path.basename(os.path.dirname(path))
        cols = np.array([[r["tokens"] / max(r["episodes"], 1), r["update_seconds"], r["fitness_mean"]] for r in rows])
        runs.setdefault(name.split("_seed")[0], []).append(cols - cols.mean(0))
    if not runs:
        raise UserError(f"no ES run with metrics.jsonl under {results_dir}; pass a directory of run directories")
    out = []
    for schedule, parts in list(runs.items()) + [("all", [p for ps in runs.values() for p in ps])]:
        x = np.concatenate(parts)
        out.append({"runs": schedule, "updates": len(x),
                    "r_tokens_per_episode_vs_fitness": float(np.corrcoef(x[:, 0], x[:, 2])[0, 1]),
                    "r_update_seconds_vs_fitness": float(np.corrcoef(x[:, 1], x[:, 2])[0, 1])})
    return out


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
    p.add_argument("--real", metavar="DIR", help="instead: duration vs fitness in the ES runs under DIR")
    args = p.parse_args(argv)
    if args.real:
        rows = real_correlation(args.real)
        print(json.dumps(rows, indent=1) if args.json else "\n".join(map(str, rows)))
        return 0
    for s in args.scenarios:
        if s not in SCENARIOS:
            raise UserError(f"unknown scenario {s!r}; choose from {', '.join(SCENARIOS)}")
    for s in args.schedules:
        if s not in SCHEDULES:
            raise UserError(f"unknown schedule {s!r}; choose from {', '.join(SCHEDULES)}")

    rows = []
    for name in args.scenarios:
        sc = SCENARIOS[name]
        sync_updates = None
        schedules = args.schedules
        if name == "correlated" and "sync" in schedules:  # the reference first
            schedules = ["sync"] + [s for s in schedules if s != "sync"]
        for sched in schedules:
            cfg = PoolConfig(population=sc.population, num_workers=sc.workers, **SCHEDULES[sched])
            base = {"scenario": name, "mode": cfg.mode, "schedule": sched, "max_staleness": cfg.staleness_bound,
                    "population": sc.population, "workers": sc.workers}
            backends = [("sim", run_sim, args.sim_updates)]
            if not args.no_threads and name not in SIM_ONLY:
                backends.insert(0, ("threads", run_threads, args.updates or (20 if name == "paper" else 40)))
            for backend, fn, n in backends:
                t0 = time.perf_counter()
                row = {**base, "backend": backend, **fn(name, sc, cfg, args.warmup, n)}
                row["expected_ideal_seconds_per_update"] = sc.expected_ideal
                row["slowdown_vs_expected_ideal"] = row["seconds_per_update"] / sc.expected_ideal
                if cfg.mode == "async":
                    row["best_async_vs_ideal"] = best_vs_ideal(name, sc, cfg.staleness_bound)
                updates = row.pop("_updates", None)
                if updates is not None:
                    sync_updates = updates if sched == "sync" else sync_updates
                    row["duration_fitness_correlation"] = duration_fitness_correlation()
                    if sync_updates is not None:
                        row.update(bias_columns(updates, sync_updates))
                row["bench_seconds"] = time.perf_counter() - t0
                rows.append(row)
                if not args.json:
                    best = f"best-async x{row['best_async_vs_ideal']:.3f} " if "best_async_vs_ideal" in row else ""
                    bias = (f" cos-vs-sync {row['update_cosine_vs_sync']:.3f} "
                            f"h {row['duration_direction_component']:+.3f}" if "update_cosine_vs_sync" in row else "")
                    print(f"{name:6s} {sched:8s} {backend:7s} s/update {row['seconds_per_update']:.4f} "
                          f"ideal {row['ideal_seconds_per_update']:.4f} (x{row['slowdown_vs_ideal']:.3f}) "
                          f"E-ideal x{row['slowdown_vs_expected_ideal']:.3f} {best}"
                          f"useful {row['useful_fraction']:.3f} cancelled {row['cancelled_fraction']:.3f} "
                          f"dropped {row['dropped_fraction']:.3f} idle {row['idle_fraction']:.3f} "
                          f"stale {row['stale_fraction']:.3f} max-stale {row['max_accepted_staleness']}{bias}",
                          flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0
