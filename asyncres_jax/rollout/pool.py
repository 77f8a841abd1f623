"""The threaded rollout pool: worker threads over replicas, driving the Coordinator with the wall clock.

Each replica (a sub-mesh of M devices from the mesh's data axis) keeps one copy of the weights and a version;
one or more worker threads share it. A worker takes an attempt from the coordinator, brings the replica's
weights to the job's dispatch version (replay of the store's log, or a copy), runs job_fn(job, params) and
reports the result. A completed cohort is committed to the store by the worker that completed it, outside the
pool lock: other workers keep reporting results meanwhile (judged against the new version), but no job of the
new version starts before its parameters are published.

Python cannot kill a thread: a job that passes its deadline is re-issued to another worker, and its own
worker rejoins the pool when job_fn finally returns (episodes have their own wall-clock limits). A job the
coordinator cancels (a commit made its result unacceptable) gets its cancel event set: job_fn runs inside
rollout.cancel.scope, the episode runner stops at its next turn boundary, and the worker takes a new job.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any, Callable, Sequence

from asyncres_jax.rollout import cancel
from asyncres_jax.rollout.coordinator import Attempt, Cohort, Coordinator, Job, JobResult, UpdateMetrics
from asyncres_jax.rollout.store import ParamStore

Params = Any
BATCH_WAIT_S = 2.0  # how long a worker waits for the rest of its batch to be reported before taking a new job


@dataclasses.dataclass
class Replica:
    """One copy of the rollout weights. `place` moves master params onto the replica's devices."""

    index: int
    mesh: Any = None
    place: Callable[[Params], Params] = lambda p: p
    params: Params = None
    version: int | None = None
    syncs: dict = dataclasses.field(default_factory=lambda: {"none": 0, "replay": 0, "copy": 0})
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)


class RolloutPool:
    def __init__(
        self,
        coordinator: Coordinator,
        store: ParamStore,
        job_fn: Callable[[Job, Params], JobResult],
        *,
        replicas: Sequence[Replica] | None = None,
        workers_per_replica: int = 1,
        on_commit: Callable[[Cohort], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        poll_seconds: float = 0.05,
    ):
        n_workers = coordinator.config.num_workers
        if replicas is None:
            replicas = [Replica(i) for i in range(n_workers // workers_per_replica)]
        if len(replicas) * workers_per_replica != n_workers:
            raise ValueError(
                f"{len(replicas)} replicas x {workers_per_replica} workers != num_workers={n_workers} in the config"
            )
        if store.version != coordinator.version:
            raise ValueError(f"store is at version {store.version}, coordinator at {coordinator.version}")
        self.coordinator, self.store, self.job_fn = coordinator, store, job_fn
        self.replicas = list(replicas)
        self.workers_per_replica = workers_per_replica
        self.on_commit, self.clock, self.poll_seconds = on_commit, clock, poll_seconds
        self.metrics: list[UpdateMetrics] = []
        self.learner_seconds = 0.0  # how long the last learner step (store.commit) took; on_commit may read it
        self._cond = threading.Condition()
        self._commit_lock = threading.Lock()  # one learner step at a time, cohorts in order
        self._pending: collections.deque[Cohort] = collections.deque()
        self._published_version = store.version
        self._threads: list[threading.Thread] = []
        self._stop = False
        self._error: BaseException | None = None
        # Master params of every version that still has unresolved jobs: a re-issued job runs on the weights
        # of its dispatch version, which may no longer be the store's current one.
        self._params_at: dict[int, Params] = {}
        self._cancel_events: dict[int, threading.Event] = {}  # attempt id -> set when the coordinator cancels it
        self._batch_left: dict[str, int] = {}  # batch id (JobBatcher) -> its results not yet reported

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> "RolloutPool":
        if self._threads:
            return self
        self._stop = False
        for r in self.replicas:
            for k in range(self.workers_per_replica):
                t = threading.Thread(target=self._worker, args=(r,), name=f"rollout-r{r.index}w{k}", daemon=True)
                self._threads.append(t)
        if self.coordinator.config.deadline_seconds is not None:
            self._threads.append(threading.Thread(target=self._watchdog, name="rollout-watchdog", daemon=True))
        for t in self._threads:
            t.start()
        return self

    def __enter__(self) -> "RolloutPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _wait_for(self, predicate: Callable[[], bool], timeout: float | None, what: str) -> None:
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not predicate():
                if self._error is not None:
                    raise self._error
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"rollout pool: {what} did not happen within {timeout}s")
                self._cond.wait(self.poll_seconds if left is None else min(left, self.poll_seconds))
            if self._error is not None:
                raise self._error

    def run_until(self, version: int, timeout: float | None = None) -> list[UpdateMetrics]:
        """Start if needed and block until the store has published `version`; returns all metrics so far."""
        self.start()
        self._wait_for(lambda: self._published_version >= version, timeout, f"version {version}")
        return list(self.metrics)

    def drain(self, timeout: float | None = None) -> None:
        """Stop dispatching and wait until every running job is accounted (before checkpoints/evals)."""
        with self._cond:
            self.coordinator.drain()
        self._wait_for(lambda: self.coordinator.quiescent and self._published(), timeout, "drain")

    def resume(self) -> None:
        with self._cond:
            self.coordinator.resume(self.clock())
            self._cond.notify_all()

    def shutdown(self, timeout: float | None = 60.0) -> None:
        """Drain, stop and join every thread (including workers of timed-out jobs, once job_fn returns)."""
        with self._cond:
            self.coordinator.drain()
            self._stop = True
            self._cond.notify_all()
        end = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if end is None else max(0.0, end - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        self._threads = []
        if alive:
            raise TimeoutError(f"rollout pool: threads still running after {timeout}s: {alive}")

    # ---------------------------------------------------------------- workers
    def _fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._stop = True
            self._cond.notify_all()

    def _next_attempt(self) -> tuple[Attempt, Params] | None:
        with self._cond:
            while True:
                if self._stop and not self.coordinator.reissues_pending:
                    return None  # shutting down: only owed re-issues still run
                attempt = self.coordinator.dispatch(self.clock()) if self._published() else None
                if attempt is not None:
                    v = attempt.job.dispatch_version
                    version, params = self.store.snapshot()
                    if v == version:
                        self._params_at[v] = params
                    self._cancel_events[attempt.attempt_id] = threading.Event()
                    return attempt, self._params_at[v]
                if self.coordinator.fatal is not None:
                    self._error = self._error or self.coordinator.fatal
                    self._stop = True
                    self._cond.notify_all()
                    return None
                self._cond.wait(self.poll_seconds)

    def _sync(self, replica: Replica, version: int, master: Params) -> Params:
        with replica.lock:
            kind = self.store.plan(replica.version, version)
            if kind == "none":
                params = replica.params
            elif kind == "replay":
                params = self.store.bring_up(replica.params, replica.version, version)
            else:
                params = replica.place(master)
            replica.syncs[kind] += 1
            if replica.version is None or version >= replica.version:
                replica.params, replica.version = params, version
            return params

    def _worker(self, replica: Replica) -> None:
        try:
            while True:
                got = self._next_attempt()
                if got is None:
                    return
                attempt, master = got
                try:
                    t = self.clock()
                    params = self._sync(replica, attempt.job.dispatch_version, master)
                    sync_s = self.clock() - t
                    with cancel.scope(self._cancel_events[attempt.attempt_id]):
                        result = self.job_fn(attempt.job, params)
                    # the worker's time bringing its replica to the job's version (a replay or a copy)
                    result = dataclasses.replace(result, stats={**result.stats, "sync_seconds": sync_s})
                except Exception as e:  # failed (re-issued) or cancelled (accounted as such); keep the worker
                    with self._cond:
                        del self._cancel_events[attempt.attempt_id]
                        self.coordinator.on_failure(attempt.attempt_id, e, self.clock())
                        self._cond.notify_all()
                    continue
                with self._cond:
                    del self._cancel_events[attempt.attempt_id]
                    now = self.clock()
                    cohort = self.coordinator.on_result(attempt.attempt_id, result, now)
                    self._count_batch(result.stats)
                    committed = cohort is not None
                    while cohort is not None:  # paced admission can complete the next cohort as well
                        self._pending.append(cohort)
                        cohort = self.coordinator.commit_ready(now)
                    for stale in self.coordinator.take_cancelled():
                        self._cancel_events[stale.attempt_id].set()
                    self._cond.notify_all()
                if committed:
                    self._publish()
                self._await_batch(result.stats)
        except BaseException as e:  # a bug in the pool, store or on_commit: stop everything, report it
            self._fail(e)

    def _count_batch(self, stats) -> None:
        """One more result of its batch reported (call under the pool lock)."""
        batch = stats.get("batch_id")
        if batch is not None:
            left = self._batch_left.get(batch, int(stats.get("batch_members", 1))) - 1
            if left > 0:
                self._batch_left[batch] = left
            else:
                self._batch_left.pop(batch, None)

    def _await_batch(self, stats) -> None:
        """Wait (at most BATCH_WAIT_S) until every result of this worker's batch is reported.

        The workers of a batch get their results at once. Without this, the first to report (often the one
        completing a cohort) takes a new job and, after the batcher's short linger, plays it in a batch of one
        or two while its batch mates are still reporting: async runs on one replica split every cohort into
        small batches of old and new versions, each costing nearly a full batch's time."""
        batch = stats.get("batch_id")
        if batch is None:
            return
        end = time.monotonic() + BATCH_WAIT_S
        with self._cond:
            while batch in self._batch_left and not self._stop:
                left = end - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(min(left, self.poll_seconds))

    def _published(self) -> bool:
        """Every cohort the coordinator formed is applied and announced (call under the pool lock)."""
        return self._published_version == self.coordinator.version

    def _publish(self) -> None:
        """Apply pending cohorts in order (the learner step), without holding the pool lock."""
        with self._commit_lock:
            while True:
                with self._cond:
                    if not self._pending:
                        return
                    cohort = self._pending[0]
                t = self.clock()
                self.store.commit(cohort.seeds, cohort.fitness, cohort.task_versions)
                self.learner_seconds = self.clock() - t
                with self._cond:  # on_commit sees the new version before any job of it can start
                    if self.on_commit is not None:
                        self.on_commit(cohort)
                    self._pending.popleft()
                    self.metrics.append(cohort.metrics)
                    self._published_version = self.store.version
                    self._forget_old_params()
                    self._cond.notify_all()

    def _forget_old_params(self) -> None:
        live = self.coordinator.unresolved_versions()
        for v in [v for v in self._params_at if v not in live and v != self.store.version]:
            del self._params_at[v]

    def _watchdog(self) -> None:
        with self._cond:
            while not (self._stop and self.coordinator.in_flight == 0):
                deadline = self.coordinator.next_deadline()
                wait = (self.poll_seconds if deadline is None
                        else max(0.0, min(self.poll_seconds, deadline - self.clock())))
                self._cond.wait(wait)
                if self.coordinator.expire(self.clock()):
                    self._cond.notify_all()
