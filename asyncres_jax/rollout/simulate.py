"""An event-driven simulation of the rollout pool on a simulated clock: the same Coordinator as the threaded
pool, with job durations from a function instead of real work. Deterministic: events are ordered by
(time, sequence number) and durations depend only on the job and attempt number.

A cancelled attempt (its result can no longer be accepted) frees its worker at its next turn boundary: at once
when `turn_seconds` is None, else at the next multiple of `turn_seconds` after its start (or when it would have
ended anyway, if that is sooner).

Used by the property tests and by `bench pool` as the scheduling-theory reference; `best_useful_fraction` is the
model that bounds what an async schedule can reach on a given spread of job durations.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Callable

import numpy as np

from asyncres_jax.rollout.cancel import Cancelled
from asyncres_jax.rollout.coordinator import Attempt, Cohort, Coordinator, Job, JobResult, PoolConfig


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one attempt does: run for `seconds`, then return a result ("ok") or raise ("raise"); "stop" is a
    cancelled attempt stopping at a turn boundary."""

    seconds: float
    kind: str = "ok"


@dataclasses.dataclass
class SimRun:
    coordinator: Coordinator
    cohorts: list[Cohort]
    dispatches: list[Attempt]  # in dispatch order, with their (simulated) start times
    end_time: float
    stalled: bool  # nothing left to happen before num_updates were committed

    @property
    def metrics(self):
        return [c.metrics for c in self.cohorts]


def _default_fitness(job: Job) -> float:
    return (job.member_seed % 1000) / 1000.0


def simulate(
    config: PoolConfig,
    duration: Callable[[Job, int], float | Outcome],
    num_updates: int,
    *,
    member_seed: Callable[[int, int, int], int] | None = None,
    fitness: Callable[[Job], float] = _default_fitness,
    on_commit: Callable[[Cohort], None] | None = None,
    max_events: int = 1_000_000,
    turn_seconds: float | None = None,
) -> SimRun:
    coord = Coordinator(config, member_seed=member_seed or (lambda g, v, i: (g * 1_000_003 + v) * 10_007 + i))
    events: list[tuple[float, int, int, Attempt, Outcome]] = []  # (time, seq, worker, attempt, outcome)
    idle = list(range(config.num_workers))
    seq, now = 0, 0.0
    cohorts: list[Cohort] = []
    dispatches: list[Attempt] = []
    ends: dict[int, float] = {}  # attempt id -> when its scheduled event fires
    stopped: set[int] = set()  # cancelled attempts whose original event was replaced by a "stop" event

    def stop_cancelled():
        nonlocal seq
        for attempt in coord.take_cancelled():
            t = now
            if turn_seconds is not None:
                t = attempt.start + math.ceil((now - attempt.start) / turn_seconds) * turn_seconds
            if t < ends[attempt.attempt_id]:
                worker = next(e[2] for e in events if e[3].attempt_id == attempt.attempt_id)
                heapq.heappush(events, (t, seq, worker, attempt, Outcome(t - attempt.start, "stop")))
                seq += 1
                stopped.add(attempt.attempt_id)

    def fill():
        nonlocal seq
        while idle:
            attempt = coord.dispatch(now)
            if attempt is None:
                return
            out = duration(attempt.job, attempt.number)
            out = out if isinstance(out, Outcome) else Outcome(float(out))
            heapq.heappush(events, (now + out.seconds, seq, idle.pop(0), attempt, out))
            ends[attempt.attempt_id] = now + out.seconds
            seq += 1
            dispatches.append(attempt)

    fill()
    for _ in range(max_events):
        if coord.version >= num_updates or coord.fatal is not None:
            break
        deadline = coord.next_deadline()
        if deadline is not None and (not events or deadline < events[0][0]):
            now = deadline
            coord.expire(now)
            fill()
            continue
        if not events:
            return SimRun(coord, cohorts, dispatches, now, stalled=True)
        now, _, worker, attempt, out = heapq.heappop(events)
        if attempt.attempt_id in stopped and out.kind != "stop":
            continue  # the cancelled attempt already stopped; its worker is busy with another job
        if out.kind == "raise":
            coord.on_failure(attempt.attempt_id, RuntimeError("simulated worker failure"), now)
        elif out.kind == "stop":
            coord.on_failure(attempt.attempt_id, Cancelled("simulated cancellation"), now)
        else:
            cohort = coord.on_result(attempt.attempt_id, JobResult(fitness(attempt.job)), now)
            while cohort is not None:
                cohorts.append(cohort)
                if on_commit is not None:
                    on_commit(cohort)
                cohort = coord.commit_ready(now) if coord.version < num_updates else None
            stop_cancelled()
        idle.append(worker)
        idle.sort()  # the lowest free worker takes the next job: deterministic
        fill()
    else:
        raise RuntimeError(f"simulation did not finish within {max_events} events")
    if coord.fatal is not None:
        raise coord.fatal
    return SimRun(coord, cohorts, dispatches, now, stalled=False)


def best_useful_fraction(durations, population: int, workers: int, max_staleness: int) -> float:
    """The largest share of worker time that accepted results can take under a staleness bound K, for a schedule
    that lets no worker idle and does not know a job's duration before it ends (a model; `durations` are
    samples of the job durations).

    A job dispatched while version d is current is acceptable until version d + K + 1 is committed: at most
    K + 1 commit intervals I. Not knowing its duration, a schedule can only give up on a job at some age tau (at
    the latest, that deadline), so the job costs min(X, tau) of worker time and is accepted iff X <= tau. Over
    many jobs, accepted / spent is at most the best E[X; X <= tau] / E[min(X, tau)] of any single tau (a ratio
    of sums is at most its largest term), and with steady commits I = N E[min(X, tau)] / (W P(X <= tau)): each
    commit takes N accepted results from W workers. The bound is the best ratio over the tau that fit their
    window, tau <= (K + 1) I(tau). Its inverse is the least seconds per update against the ideal (accepted
    work / workers) that such a schedule reaches; a schedule that idles or holds commits is outside the model.
    """
    if population < 1 or workers < 1 or max_staleness < 0:
        raise ValueError(f"need population, workers >= 1 and max_staleness >= 0, got {population}, {workers}, "
                         f"{max_staleness}")
    x = np.sort(np.asarray(durations, np.float64))
    if x.ndim != 1 or len(x) == 0 or not np.all(np.isfinite(x)) or x[0] < 0:
        raise ValueError("durations must be a non-empty 1-D array of finite non-negative numbers")
    n = len(x)
    # The ratio only falls between two sample values (the cost grows, the accepted work does not), so the
    # candidates for tau are the samples themselves: tau = x[i] accepts the i + 1 shortest.
    accepted = np.cumsum(x)
    shorter = np.arange(1, n + 1)
    spent = accepted + x * (n - shorter)
    interval = population * (spent / n) / (workers * (shorter / n))
    fits = x <= (max_staleness + 1) * interval
    return float(np.max(accepted[fits] / spent[fits])) if fits.any() else 0.0
