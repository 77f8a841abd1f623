"""The staleness coordinator: a deterministic state machine that hands out ES jobs and collects cohorts.

No threads and no clock live here: every call takes `now`, so the same code runs under the threaded pool
(pool.py, wall clock) and under the event-driven simulator (simulate.py, simulated clock).

Schedules
- async (max staleness K): a result dispatched at version d and arriving at version v is accepted when
  v - d <= K, else dropped and counted. Admission control keeps the jobs dispatched in total at most
  (K + v + 1) * N + dropped + cancelled: without the refund every lost result would eat headroom for good and
  async would decay into sync (and finally stall).
  Cancellation (cancel_stale): when a commit makes a running job's result unacceptable (its dispatch version
  is now more than K behind), the attempt is cancelled at once: the pool tells its worker to stop (at the
  episode's next turn boundary) instead of finishing work that would only be dropped. It is counted as
  cancelled, never as dropped, and its worker time as cancelled work.
  Paced admission (paced): every job dispatched is accepted. Cohort v is the jobs numbered v*N .. v*N + N - 1
  in dispatch order, whatever order they finish in, and admission keeps the jobs dispatched at most
  (K + v + 1) * N, so each job lands in a cohort at most K updates after its dispatch: nothing is dropped or
  cancelled and which results count never depends on job time, at the price of a commit waiting for the
  stragglers among its own jobs (head-of-line blocking) while later jobs run.
- barrier schedules (no job of version v + 1 is dispatched before cohort v commits):
  - sync: N jobs per version, all fresh (K = 0).
  - controlled(m, d): members N - m .. N - 1 of every version v are held back and join cohort v + d, so once
    warmed up (v >= d) each cohort holds N - m fresh results and m results exactly d updates old. Before
    that, cohorts are filled with fresh results (N + m jobs per version). Which members are held is fixed by
    member index, never by arrival order, so the schedule does not favour fast or slow rollouts.
    held_back_tasks: a held-back job plays its own version's task batch ("dispatch", what a late result would
    have played) or that of the cohort it will land in ("landing": version + d, known at dispatch), so that it
    shares common random numbers with the fresh results it is compared with (es.shaping_groups).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Literal, Mapping

import numpy as np

from asyncres_jax.errors import UserError

Mode = Literal["sync", "async", "controlled"]
HELD_BACK_TASKS = ("dispatch", "landing")


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    population: int  # N: accepted results per update
    num_workers: int  # concurrent rollout workers (threads over all replicas)
    mode: Mode = "async"
    max_staleness: int | None = None  # K; None: 1 for async, 0 for sync, `delay` for controlled
    held_back: int = 0  # m (controlled only)
    delay: int = 0  # d (controlled only)
    global_seed: int = 0
    deadline_seconds: float | None = None  # a job running longer is re-issued (same seed) to another worker
    max_attempts: int = 3  # a job failing this often stops the pool with the worker's error
    refund_dropped: bool = True  # the "+ dropped + cancelled" in admission control (False only to show why)
    cancel_stale: bool = True  # cancel running jobs that a commit made too stale (False: run them, then drop)
    paced: bool = False  # async: cohorts in dispatch order, every dispatched job accepted (module docstring)
    held_back_tasks: str = "dispatch"  # controlled: held-back jobs play dispatch's or landing's tasks (docstring)

    def __post_init__(self):
        n, w = self.population, self.num_workers
        if self.mode not in ("sync", "async", "controlled"):
            raise UserError(f"mode {self.mode!r} is not one of sync, async, controlled")
        if w < 1:
            raise UserError(f"num_workers={w}; need at least one rollout worker")
        if n <= w:
            raise UserError(
                f"population N={n} must be larger than the number of workers ({w}); "
                "use fewer workers or a larger population"
            )
        k = self.max_staleness
        if k is not None and k < 0:
            raise UserError(f"max_staleness K={k} is negative; use K >= 0 (K = 0 is sync)")
        if self.mode == "sync" and k not in (None, 0):
            raise UserError(f"mode=sync means max_staleness=0, got {k}; use mode=async for K > 0")
        if self.mode == "controlled" and k not in (None, self.delay):
            raise UserError(f"controlled accepts results exactly delay={self.delay} old; drop max_staleness={k}")
        if self.mode == "controlled":
            if not 1 <= self.held_back < n:
                raise UserError(
                    f"held_back={self.held_back} does not fit a cohort of N={n}; use 1 <= held_back < N"
                )
            if self.delay < 1:
                raise UserError(f"controlled schedules need delay >= 1 update, got {self.delay}")
        elif self.held_back or self.delay:
            raise UserError(f"held_back/delay only apply to mode=controlled (mode is {self.mode})")
        if self.deadline_seconds is not None and not self.deadline_seconds > 0:
            raise UserError(f"deadline_seconds={self.deadline_seconds} must be positive (or None for no deadline)")
        if self.max_attempts < 1:
            raise UserError(f"max_attempts={self.max_attempts} must be at least 1")
        if self.held_back_tasks not in HELD_BACK_TASKS:
            raise UserError(f"held_back_tasks={self.held_back_tasks!r} is not one of {', '.join(HELD_BACK_TASKS)}")
        if self.held_back_tasks != "dispatch" and self.mode != "controlled":
            raise UserError(f"held_back_tasks={self.held_back_tasks} applies to mode=controlled only "
                            f"(mode is {self.mode}): other schedules hold nothing back")
        if self.paced and self.mode != "async":
            raise UserError(f"paced admission applies to mode=async only (mode is {self.mode}); "
                            "barrier schedules never drop a result")

    @property
    def staleness_bound(self) -> int:
        """The largest staleness any accepted result can have under this schedule."""
        if self.mode == "async":
            return 1 if self.max_staleness is None else self.max_staleness
        return 0 if self.mode == "sync" else self.delay

    @property
    def barrier(self) -> bool:
        return self.mode != "async"

    def fresh_per_version(self, version: int) -> int:
        """Members of `version` that join cohort `version` itself (the rest are held back)."""
        if self.mode == "controlled" and version >= self.delay:
            return self.population - self.held_back
        return self.population

    def jobs_per_version(self, version: int) -> int:
        """Jobs a barrier schedule dispatches at `version`."""
        return self.fresh_per_version(version) + (self.held_back if self.mode == "controlled" else 0)


@dataclasses.dataclass(frozen=True)
class Job:
    job_id: int
    dispatch_version: int
    member_index: int
    member_seed: int
    task_batch_id: int
    sampling_seed: int
    # The version whose task batch and sampling seed the job plays (common random numbers are shared by the jobs
    # of one task version); None: its dispatch version. Controlled schedules may give held-back jobs a later one.
    task_version: int | None = None

    def __post_init__(self):
        if self.task_version is None:
            object.__setattr__(self, "task_version", self.dispatch_version)


@dataclasses.dataclass(frozen=True)
class JobResult:
    fitness: float
    stats: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One try at running a job; a re-issued job gets a new attempt with the same Job (same seed)."""

    attempt_id: int
    job: Job
    number: int  # 0 for the first try
    start: float
    deadline: float | None


@dataclasses.dataclass(frozen=True)
class Accepted:
    job: Job
    fitness: float
    stats: Mapping[str, Any]
    arrived: float
    work_seconds: float  # how long the successful attempt ran


@dataclasses.dataclass(frozen=True)
class UpdateMetrics:
    version: int  # the cohort's version; the commit publishes version + 1
    time: float
    wall_seconds: float  # since the previous commit
    staleness_hist: dict[int, int]
    dropped: int  # results dropped as too stale since the previous commit
    wasted_seconds: float  # worker time spent on dropped, failed or timed-out attempts since the previous commit
    reissued: int
    busy_seconds: float
    utilization: float  # busy_seconds / (num_workers * wall_seconds)
    accepted_seconds: float  # worker time behind the cohort's results
    result_wait_mean: float  # seconds a cohort result waited between arriving and being committed
    result_wait_max: float
    in_flight: int
    cancelled: int = 0  # running jobs cancelled since the previous commit (their results could not be accepted)
    cancelled_seconds: float = 0.0  # worker time spent on cancelled attempts, up to their stop
    dropped_seconds: float = 0.0  # worker time spent on results dropped as too stale (part of wasted_seconds)


@dataclasses.dataclass(frozen=True)
class Cohort:
    """N accepted results ready for one ES update, in canonical (dispatch_version, member_index) order."""

    version: int
    results: tuple[Accepted, ...]
    metrics: UpdateMetrics

    @property
    def seeds(self) -> np.ndarray:
        return np.asarray([r.job.member_seed for r in self.results])

    @property
    def fitness(self) -> np.ndarray:
        return np.asarray([r.fitness for r in self.results], np.float32)

    @property
    def staleness(self) -> np.ndarray:
        return np.asarray([self.version - r.job.dispatch_version for r in self.results])

    @property
    def task_versions(self) -> np.ndarray:
        """The version whose task batch each result was played on: results of one task version are comparable."""
        return np.asarray([r.job.task_version for r in self.results])


def batch_seeds(global_seed: int, version: int) -> tuple[int, int]:
    """(task_batch_id, sampling_seed) of a version: from (global_seed, version) alone (common random numbers)."""
    a, b = np.random.SeedSequence([global_seed, version, 0x7A5C]).generate_state(2, np.uint32)
    return int(a), int(b)


def _default_member_seed() -> Callable[[int, int, int], int]:
    try:
        from asyncres_jax.es import member_seed
    except ImportError as e:  # the ES package is written alongside; tests inject their own
        raise RuntimeError("asyncres_jax.es.member_seed is not available; pass member_seed= explicitly") from e
    return member_seed


class Coordinator:
    """Jobs out, results in, cohorts out. Every method takes the current time; none blocks."""

    def __init__(self, config: PoolConfig, member_seed: Callable[[int, int, int], int] | None = None):
        self.config = config
        self._member_seed = member_seed or _default_member_seed()
        self.version = 0
        self._next_member = 0  # member index of the next new job at the current version
        self._next_job_id = 0
        self._next_attempt_id = 0
        self.dispatched = 0  # new jobs (not re-issues)
        self.dropped = 0
        self.cancelled = 0
        self.draining = False
        self.fatal: BaseException | None = None
        self._live: dict[int, Attempt] = {}  # running attempts whose result we still want
        self._abandoned: dict[int, Attempt] = {}  # timed out: re-issued, but the worker is still busy
        self._cancelled: dict[int, Attempt] = {}  # cancelled: the worker is busy until it stops
        self._to_signal: list[Attempt] = []  # cancelled attempts the pool has not told its workers about yet
        self._reissue: collections.deque[tuple[Job, int]] = collections.deque()  # (job, next attempt number)
        # Held-back jobs of a version whose cohort committed before they were started: they keep their
        # dispatch version (and so their exact delay) and go out before any new job.
        self._carry: collections.deque[Job] = collections.deque()
        self._held_jobs: set[int] = set()
        self._cohort: list[Accepted] = []
        self._held: dict[int, list[Accepted]] = collections.defaultdict(list)  # target version -> results
        # One entry per attempt: "accepted", "dropped", "cancelled", "failed" or "expired"; a timed-out attempt
        # that returns after all is added to `late`.
        self.outcomes: dict[int, str] = {}
        self.late: set[int] = set()
        self.dropped_unrun: set[int] = set()  # job ids whose re-issue came too late to be accepted: not rerun
        # Per-update accumulators.
        self._t_last = None
        self._t_commit = None
        self._busy = 0.0
        self._dropped_since = 0
        self._wasted_since = 0.0
        self._reissued_since = 0
        self._cancelled_since = 0
        self._cancelled_seconds_since = 0.0
        self._dropped_seconds_since = 0.0

    # ---------------------------------------------------------------- time and occupancy
    def _advance(self, now: float) -> None:
        if self._t_last is None:
            self._t_last = self._t_commit = now
        if now < self._t_last:
            raise ValueError(f"time went backwards: {now} < {self._t_last}")
        self._busy += self.busy_workers * (now - self._t_last)
        self._t_last = now

    @property
    def busy_workers(self) -> int:
        return len(self._live) + len(self._abandoned) + len(self._cancelled)

    @property
    def in_flight(self) -> int:
        return len(self._live)

    @property
    def reissues_pending(self) -> int:
        return len(self._reissue)

    @property
    def carried_pending(self) -> int:
        """Held-back jobs created at their version's commit and not started yet."""
        return len(self._carry)

    @property
    def abandoned(self) -> int:
        """Timed-out attempts whose worker has not returned yet."""
        return len(self._abandoned)

    @property
    def stopping(self) -> int:
        """Cancelled attempts whose worker has not stopped yet."""
        return len(self._cancelled)

    def take_cancelled(self) -> list[Attempt]:
        """Attempts cancelled since the last call: the pool tells their workers to stop."""
        out, self._to_signal = self._to_signal, []
        return out

    def unresolved_versions(self) -> set[int]:
        """Dispatch versions of jobs still running or waiting to be re-issued."""
        return ({a.job.dispatch_version for a in self._live.values()}
                | {j.dispatch_version for j, _ in self._reissue} | {j.dispatch_version for j in self._carry})

    @property
    def quiescent(self) -> bool:
        """No job running or waiting to be re-issued (timed-out attempts may still occupy a worker)."""
        return not self._live and not self._reissue and not self._carry

    # ---------------------------------------------------------------- dispatch
    def _may_dispatch_new(self) -> bool:
        c = self.config
        if c.barrier:
            return self._next_member < c.jobs_per_version(self.version)
        cap = (c.staleness_bound + self.version + 1) * c.population
        if c.refund_dropped and not c.paced:
            cap += self.dropped + self.cancelled
        return self.dispatched < cap

    def _new_job(self) -> Job:
        c, v, i = self.config, self.version, self._next_member
        held = c.mode == "controlled" and i >= c.fresh_per_version(v)
        task_version = v + c.delay if held and c.held_back_tasks == "landing" else v
        task_batch_id, sampling_seed = batch_seeds(c.global_seed, task_version)
        job = Job(
            job_id=self._next_job_id,
            dispatch_version=v,
            member_index=i,
            member_seed=int(self._member_seed(c.global_seed, v, i)),
            task_batch_id=task_batch_id,
            sampling_seed=sampling_seed,
            task_version=task_version,
        )
        if held:
            self._held_jobs.add(job.job_id)
        self._next_job_id += 1
        self._next_member += 1
        self.dispatched += 1
        return job

    def _too_stale(self, job: Job) -> bool:
        return self.version - job.dispatch_version > self.config.staleness_bound

    def dispatch(self, now: float) -> Attempt | None:
        """The next attempt to run, or None when admission control (or a drain) says wait."""
        self._advance(now)
        if self.fatal is not None:
            return None
        while self._reissue and self._too_stale(self._reissue[0][0]):
            job, _ = self._reissue.popleft()  # it could only be dropped on arrival: drop it without running it
            self.dropped_unrun.add(job.job_id)
            self.dropped += 1
            self._dropped_since += 1
        if self._reissue:  # re-issues go first and are allowed while draining: they are owed work
            job, number = self._reissue.popleft()
        elif self._carry:
            job, number = self._carry.popleft(), 0
        elif self.draining or not self._may_dispatch_new():
            return None
        else:
            job, number = self._new_job(), 0
        deadline = None if self.config.deadline_seconds is None else now + self.config.deadline_seconds
        attempt = Attempt(self._next_attempt_id, job, number, now, deadline)
        self._next_attempt_id += 1
        self._live[attempt.attempt_id] = attempt
        return attempt

    # ---------------------------------------------------------------- results and faults
    def _late_return(self, attempt_id: int, now: float) -> bool:
        """An attempt that was cancelled or timed out came back (stopped, finished or raised): free its worker."""
        attempt = self._cancelled.pop(attempt_id, None)
        if attempt is not None:
            self._cancelled_seconds_since += now - attempt.start
            return True
        attempt = self._abandoned.pop(attempt_id, None)
        if attempt is None:
            return False
        self.late.add(attempt_id)
        self._wasted_since += now - attempt.start
        return True

    def _take_live(self, attempt_id: int) -> Attempt:
        try:
            return self._live.pop(attempt_id)
        except KeyError:
            raise ValueError(f"attempt {attempt_id} is not running (already reported?)") from None

    def on_result(self, attempt_id: int, result: JobResult, now: float) -> Cohort | None:
        """Account a finished attempt; returns the cohort when this result completes one (a paced coordinator
        may then have the next one complete as well: see commit_ready)."""
        self._advance(now)
        if self._late_return(attempt_id, now):
            return None  # the job was re-issued after its deadline; this copy is not counted
        attempt = self._take_live(attempt_id)
        job, work = attempt.job, now - attempt.start
        accepted = Accepted(job, float(result.fitness), dict(result.stats), now, work)
        if job.job_id in self._held_jobs:
            self._held_jobs.discard(job.job_id)
            self._held[job.dispatch_version + self.config.delay].append(accepted)
        elif self._too_stale(job):
            self.dropped += 1
            self._dropped_since += 1
            self._wasted_since += work
            self._dropped_seconds_since += work
            self.outcomes[attempt_id] = "dropped"
            return None
        elif self.config.paced and job.job_id // self.config.population > self.version:
            self._held[job.job_id // self.config.population].append(accepted)  # a later cohort's slot
        else:
            self._cohort.append(accepted)
        self.outcomes[attempt_id] = "accepted"
        return self._maybe_commit(now)

    def _reissue_job(self, attempt: Attempt, error: BaseException | None) -> None:
        if attempt.number + 1 >= self.config.max_attempts:
            self.fatal = RuntimeError(
                f"job {attempt.job.job_id} (member seed {attempt.job.member_seed}) failed "
                f"{attempt.number + 1} times; last error: {error!r}"
            )
            self.fatal.__cause__ = error
            return
        self._reissue.append((attempt.job, attempt.number + 1))
        self._reissued_since += 1

    def on_failure(self, attempt_id: int, error: BaseException | None, now: float) -> None:
        """The worker raised: re-issue the same job (same seed) unless it has failed max_attempts times."""
        self._advance(now)
        if self._late_return(attempt_id, now):
            return
        attempt = self._take_live(attempt_id)
        self.outcomes[attempt_id] = "failed"
        self._wasted_since += now - attempt.start
        self._reissue_job(attempt, error)

    def next_deadline(self) -> float | None:
        deadlines = [a.deadline for a in self._live.values() if a.deadline is not None]
        return min(deadlines) if deadlines else None

    def expire(self, now: float) -> list[Attempt]:
        """Re-issue every attempt past its deadline; its worker stays busy until the job function returns."""
        self._advance(now)
        expired = [a for a in self._live.values() if a.deadline is not None and a.deadline <= now]
        for attempt in sorted(expired, key=lambda a: a.attempt_id):
            del self._live[attempt.attempt_id]
            self._abandoned[attempt.attempt_id] = attempt
            self.outcomes[attempt.attempt_id] = "expired"
            self._reissue_job(attempt, TimeoutError(f"deadline {self.config.deadline_seconds}s passed"))
        return expired

    # ---------------------------------------------------------------- commit
    def commit_ready(self, now: float) -> Cohort | None:
        """The next cohort if it is already complete: with paced admission the results of a later cohort can
        all be in before a straggler completes the current one. Call after every committed cohort until None."""
        self._advance(now)
        return self._maybe_commit(now)

    def _cancel_stale(self) -> None:
        """After a commit: cancel every running attempt whose result can no longer be accepted."""
        for attempt in sorted(self._live.values(), key=lambda a: a.attempt_id):
            if attempt.job.job_id not in self._held_jobs and self._too_stale(attempt.job):
                del self._live[attempt.attempt_id]
                self._cancelled[attempt.attempt_id] = attempt
                self._to_signal.append(attempt)
                self.outcomes[attempt.attempt_id] = "cancelled"
                self.cancelled += 1
                self._cancelled_since += 1

    def _maybe_commit(self, now: float) -> Cohort | None:
        c, v = self.config, self.version
        if c.barrier:
            held_due = c.held_back if (c.mode == "controlled" and v >= c.delay) else 0
            if len(self._cohort) < c.fresh_per_version(v) or len(self._held.get(v, ())) < held_due:
                return None
            results = self._cohort + self._held.pop(v, [])
            while self._next_member < c.jobs_per_version(v):
                self._carry.append(self._new_job())
        else:
            if len(self._cohort) < c.population:
                return None
            results = self._cohort
        results = sorted(results, key=lambda r: (r.job.dispatch_version, r.job.member_index))
        waits = [now - r.arrived for r in results]
        wall = now - self._t_commit
        metrics = UpdateMetrics(
            version=v,
            time=now,
            wall_seconds=wall,
            staleness_hist=dict(sorted(collections.Counter(v - r.job.dispatch_version for r in results).items())),
            dropped=self._dropped_since,
            wasted_seconds=self._wasted_since,
            reissued=self._reissued_since,
            busy_seconds=self._busy,
            # a commit at the instant of the previous one (paced: a cohort already complete) has no interval
            utilization=self._busy / (c.num_workers * wall) if wall > 0 else self.busy_workers / c.num_workers,
            accepted_seconds=sum(r.work_seconds for r in results),
            result_wait_mean=float(np.mean(waits)),
            result_wait_max=max(waits),
            in_flight=len(self._live),
            cancelled=self._cancelled_since,
            cancelled_seconds=self._cancelled_seconds_since,
            dropped_seconds=self._dropped_seconds_since,
        )
        self.version += 1
        self._next_member = 0
        self._cohort = self._held.pop(self.version, []) if c.paced else []
        self._t_commit = now
        self._busy = 0.0
        self._dropped_since, self._wasted_since, self._reissued_since = 0, 0.0, 0
        self._cancelled_since, self._cancelled_seconds_since, self._dropped_seconds_since = 0, 0.0, 0.0
        if c.cancel_stale:
            self._cancel_stale()
        return Cohort(v, tuple(results), metrics)

    # ---------------------------------------------------------------- drain and checkpoints
    def drain(self) -> None:
        """Stop handing out new jobs; running and re-issued jobs still finish and are accounted."""
        self.draining = True

    def resume(self, now: float | None = None) -> None:
        """Hand out new jobs again. Given `now`, the time the drained coordinator sat idle (the trainer's checkpoint
        and held-out evaluation) is left out of the current update's wall clock: it is not the workers' idleness."""
        self.draining = False
        if now is not None and self._t_last is not None and self.quiescent and not self._abandoned \
                and not self._cancelled:
            self._t_commit += now - self._t_last
            self._t_last = now

    def state_dict(self) -> dict:
        """Plain-Python state for a checkpoint; only valid when quiescent (drain first)."""
        if not self.quiescent:
            raise RuntimeError("drain the coordinator before saving it: jobs are still running")

        def enc(r: Accepted) -> dict:
            return {"job": dataclasses.asdict(r.job), "fitness": r.fitness, "stats": dict(r.stats),
                    "arrived": r.arrived, "work_seconds": r.work_seconds}

        return {
            "version": self.version, "next_member": self._next_member, "next_job_id": self._next_job_id,
            "next_attempt_id": self._next_attempt_id, "dispatched": self.dispatched, "dropped": self.dropped,
            "cancelled": self.cancelled,
            "cohort": [enc(r) for r in self._cohort],
            "held": {str(k): [enc(r) for r in rs] for k, rs in self._held.items() if rs},
        }

    def load_state_dict(self, state: Mapping) -> None:
        def dec(d: Mapping) -> Accepted:
            return Accepted(Job(**d["job"]), d["fitness"], d["stats"], d["arrived"], d["work_seconds"])

        self.version, self._next_member = int(state["version"]), int(state["next_member"])
        self._next_job_id, self._next_attempt_id = int(state["next_job_id"]), int(state["next_attempt_id"])
        self.dispatched, self.dropped = int(state["dispatched"]), int(state["dropped"])
        self.cancelled = int(state.get("cancelled", 0))  # absent from checkpoints written before cancellation
        self._cohort = [dec(d) for d in state["cohort"]]
        self._held = collections.defaultdict(list, {int(k): [dec(d) for d in rs] for k, rs in state["held"].items()})
        self._live.clear(), self._abandoned.clear(), self._reissue.clear(), self._carry.clear()
        self._cancelled.clear(), self._to_signal.clear()
        self._held_jobs.clear()
        self._t_last = self._t_commit = None
