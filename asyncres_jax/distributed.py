"""Several JAX processes as one trainer: jax.distributed set-up, the global mesh, process-0 duties.

    python -m asyncres_jax.train ... --coordinator HOST:PORT --num-processes P --process-id I
    # or under a launcher: JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, SLURM (srun), OpenMPI

Every process runs the same training program (multi-controller JAX). The learner's float32 masters live on the
global DxM mesh over all processes' devices; each process drives the rollout replicas (1xM rows of the mesh)
whose devices it owns, so M must divide the devices of one process. The coordinator runs in every process: in
the barrier schedules (sync, controlled) its job ids, member seeds and cohorts are a function of the version
alone, so each job is run by one process (job_id mod P) and only its (fitness, stats) crosses the network,
through the jax.distributed key-value store; every process then commits the same cohort and applies the same
(seeds, shaped fitness) update to its shards of the masters. Weights never travel. The async schedule accepts
results by arrival time, which differs between processes, so it is refused here (rollout replicas on other
machines are Ray actors instead: docs/scaling.md).

Process 0 alone logs, evaluates (on its first replica), writes the run directory's manifest and metrics and
prepares the run directory; Orbax writes checkpoints of the sharded masters from all processes (each its own
shards) into one shared folder.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import pathlib
import re
from typing import Any, Callable, Mapping, TypeVar

import numpy as np

from asyncres_jax.errors import UserError

T = TypeVar("T")
KEY_PREFIX = "asyncres"
# A process waiting for another's job result, or for process 0's run-directory set-up: generous, since a job
# is a batch of multi-turn episodes (the paper's took up to 12 minutes); the pool's own deadline re-issues.
WAIT_S = 6 * 3600


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    coordinator: str | None  # HOST:PORT of process 0's coordination service; None: the launcher's (auto-detect)
    num_processes: int
    process_id: int | None  # None: auto-detected by jax from the launcher
    source: str  # where the values came from, for messages

    @property
    def distributed(self) -> bool:
        return self.num_processes > 1


_SPEC = ClusterSpec(None, 1, 0, "default")  # the process's cluster, once initialize() has run


def _int(value: str | int | None, what: str, source: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"{what}={value!r} ({source}) is not an integer") from None


def resolve(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
            environ: Mapping[str, str] | None = None) -> ClusterSpec:
    """The cluster from flags, else JAX_* variables, else SLURM / OpenMPI variables, else one process.

    Flags and JAX_* must name all three values (or only the address, with P=1); launchers are detected by jax.
    """
    env = os.environ if environ is None else environ
    if coordinator is not None or num_processes is not None or process_id is not None:
        source = "--coordinator/--num-processes/--process-id"
    else:
        source = "JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID"
        coordinator = env.get("JAX_COORDINATOR_ADDRESS") or None
        num_processes = _int(env.get("JAX_NUM_PROCESSES"), "JAX_NUM_PROCESSES", "environment")
        process_id = _int(env.get("JAX_PROCESS_ID"), "JAX_PROCESS_ID", "environment")
    if coordinator is None and num_processes is None and process_id is None:
        return _from_launcher(env)
    if num_processes is not None and num_processes < 1:
        raise UserError(f"{num_processes} processes ({source}); give at least 1")
    if num_processes == 1 and process_id in (None, 0):
        return ClusterSpec(coordinator, 1, 0, source)
    missing = [n for n, v in zip(("coordinator", "number of processes", "process id"),
                                 (coordinator, num_processes, process_id)) if v is None]
    if missing:
        raise UserError(f"{source}: the {' and '.join(missing)} is missing; a multi-process run names all three "
                        "(e.g. --coordinator host0:1234 --num-processes 2 --process-id 0)")
    if not re.fullmatch(r"\[?[\w.\-:]+\]?:\d{1,5}", coordinator) or not 0 < int(coordinator.rsplit(":", 1)[1]) < 65536:
        raise UserError(f"coordinator {coordinator!r} ({source}) is not HOST:PORT (e.g. 10.0.0.1:1234)")
    if not 0 <= process_id < num_processes:
        raise UserError(f"process id {process_id} is outside 0..{num_processes - 1} for {num_processes} "
                        f"processes ({source})")
    return ClusterSpec(coordinator, num_processes, process_id, source)


def _from_launcher(env: Mapping[str, str]) -> ClusterSpec:
    """SLURM (srun) and OpenMPI (mpirun) set a rank and a size; jax.distributed finds the coordinator itself."""
    for name, size_key, rank_key in (("SLURM", "SLURM_NTASKS", "SLURM_PROCID"),
                                     ("OpenMPI", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")):
        if size_key not in env:
            continue
        if name == "SLURM" and "SLURM_STEP_ID" not in env:
            continue  # inside an allocation (salloc, sbatch script) but not an srun step: one process
        size, rank = _int(env.get(size_key), size_key, name), _int(env.get(rank_key), rank_key, name)
        if size is None or size < 1 or rank is None or not 0 <= rank < size:
            raise UserError(f"{name} says rank {env.get(rank_key)!r} of {env.get(size_key)!r} processes "
                            f"({rank_key}, {size_key}); expected 0 <= rank < size")
        if size > 1:
            return ClusterSpec(None, size, rank, name)
    return ClusterSpec(None, 1, 0, "default")


def initialize(spec: ClusterSpec, *, timeout_s: int = 300) -> ClusterSpec:
    """jax.distributed.initialize for a multi-process spec (before anything touches a device); a no-op for one.

    On CPUs the cross-process collectives are gloo's (jax's default today; set explicitly, MPI stays if chosen).
    """
    global _SPEC
    if not spec.distributed:
        _SPEC = spec
        return spec
    import jax

    if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs: dict[str, Any] = {"initialization_timeout": timeout_s}
    if spec.coordinator is not None:
        kwargs.update(coordinator_address=spec.coordinator, num_processes=spec.num_processes,
                      process_id=spec.process_id)
    try:
        jax.distributed.initialize(**kwargs)
    except Exception as e:  # a coordinator that never answers is the user's cluster, not a bug
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise UserError(f"jax.distributed could not start process {spec.process_id} of {spec.num_processes} "
                        f"(coordinator {spec.coordinator or 'from ' + spec.source}): {first}; check the address "
                        "is reachable from every host and every process was started") from None
    _SPEC = dataclasses.replace(spec, process_id=jax.process_index(), num_processes=jax.process_count())
    return _SPEC


def process_id() -> int:
    return _SPEC.process_id or 0


def num_processes() -> int:
    return _SPEC.num_processes


def is_main_process() -> bool:
    """Process 0 logs, evaluates and writes the run directory (True in a single-process run)."""
    return process_id() == 0


def _client():
    from jax._src import distributed as jd  # the coordination service's key-value store (also what Orbax uses)

    if jd.global_state.client is None:
        raise RuntimeError("jax.distributed is not initialised")
    return jd.global_state.client


# ------------------------------------------------------------------------------------------- the global mesh


def check_mesh(mesh) -> None:
    """Each replica (a row of the data axis) must sit inside one process: its worker threads drive it alone."""
    d, m = mesh.devices.shape
    per_process = sum(dev.process_index == mesh.devices.flat[0].process_index for dev in mesh.devices.flat)
    for i, row in enumerate(mesh.devices):
        owners = sorted({dev.process_index for dev in row})
        if len(owners) > 1:
            fits = [k for k in range(1, per_process + 1) if per_process % k == 0]
            raise UserError(f"mesh {d}x{m}: replica {i} spans processes {owners}; the model axis must divide the "
                            f"{per_process} devices of one process (model-axis sizes {', '.join(map(str, fits))}, "
                            f"e.g. --mesh {d * m // fits[-1]}x{fits[-1]})")


def is_local(mesh) -> bool:
    """Whether every device of `mesh` belongs to this process."""
    return all(d.process_index == process_id() for d in mesh.devices.flat)


def check_config(cfg) -> None:
    """What a multi-process run supports: ES in a barrier schedule."""
    if num_processes() > 1 and cfg.algo != "es":
        raise UserError(f"algo={cfg.algo} runs in one process; drop --num-processes/--coordinator (or the "
                        "launcher's) for it")
    check_schedule(cfg.pool.mode)


def check_schedule(mode: str) -> None:
    if num_processes() > 1 and mode == "async":
        raise UserError("pool.mode=async across processes: its cohorts depend on when results arrive in each "
                        "process; use pool.mode=sync or controlled with --num-processes > 1 (see docs/scaling.md)")


# ------------------------------------------------------------------------------------------- coordination

_counter = itertools.count()


def barrier(name: str, timeout_s: float = WAIT_S) -> None:
    """All processes reach this point (a no-op in one process). Names must be called in the same order."""
    if num_processes() > 1:
        _client().wait_at_barrier(f"{KEY_PREFIX}/barrier/{name}/{next(_counter)}", int(timeout_s * 1000))


def on_main(fn: Callable[..., T], *args, timeout_s: float = WAIT_S, **kwargs) -> T:
    """fn(*args) on process 0; the others wait for its (JSON) result, or raise its UserError."""
    if num_processes() == 1:
        return fn(*args, **kwargs)
    name = re.sub(r"\W", "_", getattr(fn, "__name__", "fn"))  # "<lambda>" -> "_lambda_"
    key = f"{KEY_PREFIX}/on_main/{name}/{next(_counter)}"
    if is_main_process():
        try:
            out = fn(*args, **kwargs)
        except BaseException as e:
            _client().key_value_set(key, json.dumps({"error": str(e) if isinstance(e, UserError) else
                                                     f"{type(e).__name__} on process 0 (see its log)"}))
            raise
        _client().key_value_set(key, json.dumps({"ok": out}))
        return out
    got = json.loads(_client().blocking_key_value_get(key, int(timeout_s * 1000)))
    if "error" in got:
        raise UserError(f"process 0: {got['error']}")
    return got["ok"]


def process_dir(run_dir: pathlib.Path) -> pathlib.Path:
    """Where process I > 0 keeps its own copy of per-process records (RUN_DIR/processes/I); RUN_DIR for 0."""
    if is_main_process():
        return pathlib.Path(run_dir)
    d = pathlib.Path(run_dir) / "processes" / str(process_id())
    d.mkdir(parents=True, exist_ok=True)
    return d


def _plain(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def owner(job) -> int:
    """The process that runs a job (the others take its result)."""
    return job.job_id % num_processes()


def share_results(job_fn: Callable, timeout_s: float = WAIT_S) -> Callable:
    """job_fn(job, params) -> JobResult, run by the job's owner process only; the others wait for its result.

    Only (fitness, stats) travel; every process then accepts the same results into the same cohorts. An owner
    that fails leaves the key unset: the waiters' attempts time out and are re-issued like any failed job.
    """
    if num_processes() == 1:
        return job_fn
    from asyncres_jax.rollout.coordinator import JobResult

    def shared(job, params):
        key = f"{KEY_PREFIX}/result/{job.job_id}"
        if owner(job) == process_id():
            result = job_fn(job, params)
            # float repr round-trips exactly through JSON, so every process commits bit-identical fitness
            value = json.dumps({"fitness": float(result.fitness), "stats": dict(result.stats)}, default=_plain)
            _client().key_value_set(key, value, allow_overwrite=True)  # a re-issued attempt may finish too
            return result
        got = json.loads(_client().blocking_key_value_get(key, int(timeout_s * 1000)))
        return JobResult(got["fitness"], got["stats"])
    return shared


class _Replica0View:
    """The trainer as evaluation sees it on process 0: its first replica's model and the masters placed there
    (float32, as in one process; no copy: that replica's devices hold the shards), so evaluating runs no
    computation over the global mesh, which the other processes would have to join."""

    def __init__(self, trainer):
        from asyncres_jax.model.sharding import param_shardings
        from asyncres_jax.model import Model

        self._trainer = trainer
        mesh = trainer.pool.replicas[0].mesh
        m = trainer.model
        self.model = Model(m.config, None, m.tokenizer, mesh, m.source)
        self._shardings = param_shardings(m.params, m.config, mesh)
        self.store = self  # evaluation reads trainer.store.version and trainer.store.params

    def __getattr__(self, name):
        return getattr(self._trainer, name)

    @property
    def version(self) -> int:
        return self._trainer.store.version

    @property
    def params(self):
        import jax

        from asyncres_jax.rollout.replicas import to_submesh

        return jax.tree.map(to_submesh, self._trainer.store.params, self._shardings)


def attach_on_main(trainer, attach: Callable[[Any], None]) -> None:
    """attach(trainer)'s evaluation hooks on process 0 only, over its first replica; every process then meets
    the others after each evaluation point, so none races ahead to the next checkpoint while process 0 plays."""
    if num_processes() == 1:
        attach(trainer)
        return
    if is_main_process():
        attach(_Replica0View(trainer))
    trainer.before_run_hooks.append(lambda t: barrier("evaluated", WAIT_S))
    trainer.drained_hooks.append(lambda t: barrier("evaluated", WAIT_S))


def shutdown() -> None:
    """Leave the cluster cleanly (every process calls it at the end)."""
    if num_processes() > 1:
        import jax

        jax.distributed.shutdown()
