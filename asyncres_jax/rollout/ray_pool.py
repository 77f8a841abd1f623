"""Rollout replicas as Ray actors: the same Coordinator and ParamStore as the threaded pool, replicas on a cluster.

    pool = RayRolloutPool(coordinator, store, ActorSpec(build=...), num_actors=4, on_commit=...)
    pool.run_until(10); pool.drain(); pool.resume(); pool.shutdown()     # RolloutPool's surface

Each actor is one process that owns its devices and its copy of the weights. `ActorSpec.build()` runs inside
the actor and returns a ReplicaState (version, params, job function, replay rule), so no driver array or
closure over one ever crosses the network. The driver keeps the Coordinator, the only judge of staleness and
acceptance, and one loop thread that dispatches attempts to idle actors, waits on their ObjectRefs (ray.wait),
reports results and failures to the coordinator and commits cohorts to the store.

Weight sync, per job: an actor at version a running a job dispatched at version d gets
- "replay": the store's logged (seeds, shaped fitness) for a..d, N int64 + N float32 per update, when the
  update rule is replayable (the paper's SGD) and the log reaches back to a (store.plan decides, as for
  threads);
- "copy": the master parameters of version d through Ray's object store (ray.put once per version, numpy).
An actor that dies (RayActorError) has its attempt re-issued by the coordinator (same seed), and a
replacement actor starts from `build()` (the trainer's restores the run's latest checkpoint) and is brought
to each job's version from the log like any other actor. A job the coordinator cancels (too stale to be
accepted) is told so through the actor's cancel() (actors run two threads: the job and that call); the
episode runner stops at its next turn boundary and the actor is free for a new job.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from typing import Any, Callable, Mapping

import numpy as np

from asyncres_jax.errors import UserError
from asyncres_jax.rollout import cancel
from asyncres_jax.rollout.coordinator import Attempt, Cohort, Coordinator, Job, JobResult, UpdateMetrics
from asyncres_jax.rollout.pool import RolloutPool
from asyncres_jax.rollout.store import ParamStore

Params = Any
# An actor process sees one CPU device; the test conftest's 8 simulated devices are the driver's business.
CPU_ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
# jax.config options an actor copies from the driver, so noise and forward passes draw the same bits.
JAX_OPTIONS = ("jax_threefry_partitionable", "jax_enable_x64", "jax_default_matmul_precision",
               "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
MAX_RESTARTS = 8  # replacement actors per pool before a dying cluster stops the run


@dataclasses.dataclass
class ReplicaState:
    """What an actor holds, made inside the actor by ActorSpec.build."""

    version: int  # the version `params` are at (0 for fresh weights, a checkpoint's version after a restore)
    params: Params
    job_fn: Callable[[Job, Params], JobResult]
    replay: Callable[[Params, np.ndarray, np.ndarray], Params] | None  # None: copies only
    place: Callable[[Params], Params] = lambda p: p  # numpy master params -> this actor's rollout copy
    close: Callable[[], None] = lambda: None


@dataclasses.dataclass(frozen=True)
class ActorSpec:
    """How to make one replica: a picklable `build() -> ReplicaState` and the actor's resources.

    `env` is the actor process's environment, set before it starts (JAX reads it at import)."""

    build: Callable[[], ReplicaState]
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    env: Mapping[str, str] = dataclasses.field(default_factory=lambda: dict(CPU_ENV))
    jax_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def driver_jax_config() -> dict[str, Any]:
    import jax

    return {k: getattr(jax.config, k) for k in JAX_OPTIONS if getattr(jax.config, k, None) is not None}


def import_ray():
    try:
        import ray
    except ImportError:
        raise UserError("pool.backend=ray needs the ray package; install it with `pip install 'ray>=2.60'`, "
                        "or use pool.backend=threads") from None
    return ray


def connect(address: str | None = None, num_cpus: int | None = None, object_store_mb: int = 200) -> bool:
    """ray.init unless already connected: a local cluster (address None) or an existing one ("auto", host:port).
    Returns True when this call started the connection (the caller then owns ray.shutdown)."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a training run does not report usage (set 1 to allow)
    kw: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
    if not address:
        kw.update(num_cpus=num_cpus, object_store_memory=object_store_mb * 2**20)
    try:
        ray.init(address=address or None, **kw)
    except Exception as e:  # Ray raises many kinds; the user needs one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
        raise UserError(f"cannot start or reach {where}: {first}; check pool.ray_address or use "
                        "pool.backend=threads") from None
    return True


class ReplicaActor:
    """The actor body (wrapped by ray.remote at first use, so importing this module does not need Ray)."""

    def __init__(self, spec: ActorSpec):
        if spec.jax_config:
            import jax

            for k, v in spec.jax_config.items():
                jax.config.update(k, v)
        self._state, self.version, self.params, self._error = None, None, None, None
        self._running_job, self._cancel = None, threading.Event()
        try:  # kept, not raised: Ray would report only a traceback's text, and a UserError must stay one line
            s = spec.build()
            self._state, self.version, self.params = s, s.version, s.params
        except Exception as e:
            self._error = e if _picklable(e) else RuntimeError(repr(e))

    def ready(self) -> tuple[int | None, int, BaseException | None]:
        return self.version, os.getpid(), self._error

    def run(self, job: Job, kind: str, payload) -> tuple[int, JobResult | None, BaseException | None]:
        """Sync to the job's version, run it. Returns (version held afterwards, result, job error); a job
        error is returned, not raised, so the driver always learns the version the actor holds."""
        s, v = self._state, job.dispatch_version
        if kind == "none":
            if self.version != v:
                raise RuntimeError(f"actor holds version {self.version}, driver thought {v}")
            params = self.params
        elif kind == "replay":
            start, seeds_us, shaped_us = payload
            if s.replay is None:
                raise RuntimeError("the driver's store replays updates but this replica's build() gave no replay")
            if self.version != start:
                raise RuntimeError(f"actor holds version {self.version}, replay starts at {start}")
            params = self.params
            for seeds, shaped in zip(seeds_us, shaped_us):
                params = s.replay(params, seeds, shaped)
            self.params, self.version = params, v
        else:  # "copy": payload is the master tree of version v (Ray resolved the ObjectRef argument)
            params = s.place(payload)
            if v >= self.version:  # an older version (a re-issued stale job) is used once, not kept
                self.params, self.version = params, v
        self._running_job, self._cancel = job.job_id, threading.Event()
        try:
            with cancel.scope(self._cancel):
                return self.version, s.job_fn(job, params), None
        except Exception as e:  # reported to the coordinator (re-issued, or counted as cancelled)
            return self.version, None, e if _picklable(e) else RuntimeError(repr(e))
        finally:
            self._running_job = None

    def cancel(self, job_id: int) -> None:
        """Stop the running job at its next turn boundary, if it is still `job_id` (runs beside run())."""
        if self._running_job == job_id:
            self._cancel.set()

    def close(self) -> None:
        if self._state is not None:
            self._state.close()


def _picklable(e: BaseException) -> bool:
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return True
    except Exception:
        return False


_REMOTE = None


def _remote_actor_class():
    global _REMOTE
    if _REMOTE is None:
        _REMOTE = import_ray().remote(max_restarts=0, max_concurrency=2)(ReplicaActor)
    return _REMOTE


@dataclasses.dataclass
class ActorSlot:
    """The driver's view of one replica slot; `handle` changes when a replacement actor takes the slot."""

    index: int
    handle: Any = None
    ready_ref: Any = None  # set while the actor starts
    version: int | None = None  # the version the actor holds (known from ready()/run() returns)
    pid: int | None = None
    attempt: Attempt | None = None  # the running attempt (or an abandoned one whose result is still owed)
    started: int = 0  # actors started for this slot (1 + replacements)
    syncs: dict = dataclasses.field(default_factory=lambda: {"none": 0, "replay": 0, "copy": 0})


class RayRolloutPool:
    def __init__(
        self,
        coordinator: Coordinator,
        store: ParamStore,
        spec: ActorSpec,
        *,
        num_actors: int | None = None,
        on_commit: Callable[[Cohort], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        poll_seconds: float = 0.05,
        owns_ray: bool = False,
        max_restarts: int = MAX_RESTARTS,
    ):
        """owns_ray: shutdown() also ends the Ray connection (the pool started it). max_restarts: replacement
        actors started over the pool's life before it stops with the last death's error."""
        self._ray, self.owns_ray, self.max_restarts = import_ray(), owns_ray, max_restarts
        n = coordinator.config.num_workers if num_actors is None else num_actors
        if n != coordinator.config.num_workers:
            raise ValueError(f"{n} actors != num_workers={coordinator.config.num_workers} (one job per actor)")
        if store.version != coordinator.version:
            raise ValueError(f"store is at version {store.version}, coordinator at {coordinator.version}")
        self.coordinator, self.store, self.spec = coordinator, store, spec
        self.on_commit, self.clock, self.poll_seconds = on_commit, clock, poll_seconds
        self.learner_seconds = 0.0  # how long the last learner step (store.commit) took; on_commit may read it
        self.slots = [ActorSlot(i) for i in range(n)]
        self.metrics: list[UpdateMetrics] = []
        self.bytes_sent = {"replay": 0, "copy": 0}  # payload bytes driver -> actors
        self.puts = 0  # master trees put in the object store (at most once per version, shared by the actors)
        self.restarts = 0
        self._cond = threading.Condition()
        self._published_version = store.version
        self._thread: threading.Thread | None = None
        self._stop = False
        self._error: BaseException | None = None
        self._running: dict[Any, ActorSlot] = {}  # ObjectRef of a run() call -> its slot
        self._params_at: dict[int, Params] = {}  # master params of versions with unresolved jobs
        self._refs_at: dict[int, Any] = {}  # their object-store copies, made on the first copy sync

    @property
    def replicas(self) -> list[ActorSlot]:
        return self.slots

    # ---------------------------------------------------------------- lifecycle (as RolloutPool)
    def start(self) -> "RayRolloutPool":
        if self._thread is not None:
            return self
        self._stop = False
        for slot in self.slots:
            if slot.handle is None:
                self._start_actor(slot)
        self._thread = threading.Thread(target=self._loop, name="rollout-ray", daemon=True)
        self._thread.start()
        return self

    def __enter__(self) -> "RayRolloutPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # Waiting, draining and resuming are RolloutPool's own code: they only touch the coordinator, the condition
    # variable and the published version, which this pool keeps under the same names.
    _wait_for = RolloutPool._wait_for
    run_until = RolloutPool.run_until
    drain = RolloutPool.drain
    resume = RolloutPool.resume

    def shutdown(self, timeout: float | None = 60.0) -> None:
        """Drain, stop the loop, close and kill every actor (a job past its deadline is not waited for)."""
        with self._cond:
            self.coordinator.drain()
            self._stop = True
            self._cond.notify_all()
        alive = False
        if self._thread is not None:
            self._thread.join(timeout)
            alive = self._thread.is_alive()
        try:  # idle actors close their replica (sandboxes); busy ones are killed with the rest
            closing = [s.handle.close.remote() for s in self.slots
                       if s.handle is not None and s.ready_ref is None and s.attempt is None] if not alive else []
            if closing:
                self._ray.wait(closing, num_returns=len(closing), timeout=10)
        finally:
            for slot in self.slots:
                if slot.handle is not None:
                    self._ray.kill(slot.handle)
            if self.owns_ray:
                self._ray.shutdown()
                self.owns_ray = False
        if alive:
            raise TimeoutError(f"ray rollout pool: the driver loop still ran after {timeout}s; actors killed")
        self._thread = None
        for slot in self.slots:
            slot.handle, slot.ready_ref, slot.attempt = None, None, None
        self._running.clear()
        self._params_at.clear()
        self._refs_at.clear()

    # ---------------------------------------------------------------- actors
    def _start_actor(self, slot: ActorSlot) -> None:
        opts = dict(num_cpus=self.spec.num_cpus, num_gpus=self.spec.num_gpus,
                    runtime_env={"env_vars": dict(self.spec.env)})
        slot.handle = _remote_actor_class().options(**opts).remote(self.spec)
        slot.ready_ref, slot.version, slot.pid, slot.attempt = slot.handle.ready.remote(), None, None, None
        slot.started += 1

    def _replace(self, slot: ActorSlot, error: BaseException) -> None:
        self.restarts += 1
        if self.restarts > self.max_restarts:
            raise RuntimeError(f"ray rollout pool: {self.restarts} actors died; last: {error}") from error
        try:
            self._ray.kill(slot.handle)
        except Exception:  # already gone
            pass
        self._start_actor(slot)

    # ---------------------------------------------------------------- the driver loop
    _fail = RolloutPool._fail
    _published = RolloutPool._published

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    self._dispatch_idle()
                    if self.coordinator.expire(self.clock()):
                        self._cond.notify_all()
                    if self.coordinator.fatal is not None:
                        raise self.coordinator.fatal
                    if self._stop and self.coordinator.quiescent and self._published():
                        return
                waiting = list(self._running) + [s.ready_ref for s in self.slots if s.ready_ref is not None]
                if not waiting:
                    with self._cond:
                        self._cond.wait(self.poll_seconds)
                    continue
                done, _ = self._ray.wait(waiting, num_returns=1, timeout=self.poll_seconds)
                for ref in done:
                    self._on_done(ref)
        except BaseException as e:  # a bug, a dead cluster or a job failing max_attempts times: stop, report
            self._fail(e)

    def _dispatch_idle(self) -> None:
        """Hand attempts to every started, idle actor (under the lock)."""
        for slot in self.slots:
            if slot.ready_ref is not None or slot.attempt is not None:
                continue
            if not self._published() or (self._stop and not self.coordinator.reissues_pending):
                return
            attempt = self.coordinator.dispatch(self.clock())
            if attempt is None:
                return
            v = attempt.job.dispatch_version
            version, params = self.store.snapshot()
            if v == version:
                self._params_at[v] = params
            kind, payload = self._sync_payload(slot.version, v)
            slot.syncs[kind] += 1
            slot.attempt = attempt
            self._running[slot.handle.run.remote(attempt.job, kind, payload)] = slot

    def _sync_payload(self, have: int | None, want: int) -> tuple[str, Any]:
        kind = self.store.plan(have, want)
        if kind == "replay":
            entries = self.store.entries(have, want)
            seeds, shaped = [e.seeds for e in entries], [e.shaped for e in entries]
            self.bytes_sent["replay"] += sum(s.nbytes + z.nbytes for s, z in zip(seeds, shaped))
            return kind, (have, seeds, shaped)
        if kind == "copy":
            if want not in self._refs_at:
                import jax

                tree = jax.tree.map(np.asarray, self._params_at[want])
                self.bytes_sent["copy"] += sum(x.nbytes for x in jax.tree.leaves(tree))
                self._refs_at[want] = self._ray.put(tree)
                self.puts += 1
            return kind, self._refs_at[want]
        return kind, None

    def _on_done(self, ref) -> None:
        ray = self._ray
        if ref not in self._running:  # an actor's ready() call
            slot = next(s for s in self.slots if s.ready_ref == ref)
            slot.ready_ref = None
            try:
                slot.version, slot.pid, error = ray.get(ref)
            except ray.exceptions.RayActorError as e:  # the process died while starting: try another
                with self._cond:
                    self._replace(slot, e)
            else:
                if isinstance(error, UserError):  # a mistake in the config: the same in every actor
                    raise error
                if error is not None:
                    raise RuntimeError(f"a rollout actor failed to start: {error!r}") from error
            with self._cond:
                self._cond.notify_all()
            return
        slot = self._running.pop(ref)
        attempt, slot.attempt = slot.attempt, None
        try:
            slot.version, result, error = ray.get(ref)
        except ray.exceptions.RayActorError as e:  # the actor process died mid-job: re-issue, replace it
            with self._cond:
                self.coordinator.on_failure(attempt.attempt_id, e, self.clock())
                self._replace(slot, e)
                self._cond.notify_all()
            return
        except ray.exceptions.RayTaskError as e:  # the sync raised (a bug): the actor's state is unknown
            with self._cond:
                self.coordinator.on_failure(attempt.attempt_id, e.as_instanceof_cause(), self.clock())
                self._replace(slot, e)
                self._cond.notify_all()
            return
        with self._cond:
            if error is not None:
                self.coordinator.on_failure(attempt.attempt_id, error, self.clock())
                cohort = None
            else:
                cohort = self.coordinator.on_result(attempt.attempt_id, result, self.clock())
            cohorts = []
            while cohort is not None:  # paced admission can complete the next cohort as well
                cohorts.append(cohort)
                cohort = self.coordinator.commit_ready(self.clock())
            self._signal_cancelled()
            self._cond.notify_all()
        for cohort in cohorts:
            self._commit(cohort)

    def _signal_cancelled(self) -> None:
        """Tell the actors running cancelled attempts to stop (fire and forget: the run() call still returns)."""
        for stale in self.coordinator.take_cancelled():
            slot = next((s for s in self.slots if s.attempt is not None
                         and s.attempt.attempt_id == stale.attempt_id), None)
            if slot is not None:
                slot.handle.cancel.remote(stale.job.job_id)

    def _commit(self, cohort: Cohort) -> None:
        """The learner step; no job of the new version starts before it is published (the loop is one thread)."""
        t = self.clock()
        self.store.commit(cohort.seeds, cohort.fitness, cohort.task_versions)
        self.learner_seconds = self.clock() - t
        with self._cond:
            if self.on_commit is not None:
                self.on_commit(cohort)
            self.metrics.append(cohort.metrics)
            self._published_version = self.store.version
            live = self.coordinator.unresolved_versions() | {self.store.version}
            for v in [v for v in self._params_at if v not in live]:
                del self._params_at[v]
            for v in [v for v in self._refs_at if v not in live]:
                del self._refs_at[v]  # the object store frees it once no task holds it
            self._cond.notify_all()

    def sync_counts(self) -> dict[str, int]:
        return {k: sum(s.syncs[k] for s in self.slots) for k in ("none", "replay", "copy")}


# ------------------------------------------------------------------------------------------- the cluster


def cluster(num_actors: int, address: str = "", cpus_per_actor: float = 1.0, gpus_per_actor: float = 0.0, *,
            hint: str = "start fewer actors or add nodes") -> tuple[bool, dict[str, str]]:
    """Connect to (or start) the cluster for `num_actors` actors and check it can hold them all.

    Returns (whether this call started the connection, the actors' environment: CPU_ENV unless they take GPUs).
    """
    need = {"CPU": num_actors * cpus_per_actor, "GPU": num_actors * gpus_per_actor}
    # A local cluster's CPUs are logical: give it at least one per actor, so no actor waits for a free one.
    owns = connect(address or None, num_cpus=max(os.cpu_count() or 1, math.ceil(need["CPU"])))
    have = import_ray().cluster_resources()
    short = [f"{need[k]:g} {k}s" for k in need if need[k] > have.get(k, 0)]
    if short:  # Ray would leave the actors pending forever: say so now
        if owns:
            import_ray().shutdown()
        raise UserError(f"{num_actors} rollout actors need {' and '.join(short)} but the Ray cluster has "
                        f"{have.get('CPU', 0):g} CPUs and {have.get('GPU', 0):g} GPUs; {hint}")
    return owns, (dict(CPU_ENV) if gpus_per_actor == 0 else {})
