"""The ES training loop behind `python -m asyncres_jax.train`: run directory, model, pool, checkpoints, signals.

    trainer = ESTrainer(cfg)            # loads or resumes RUN_DIR; builds mesh, model, store, coordinator, pool
    trainer.run()                       # until es.updates, a signal, or trainer.request_stop()
    trainer.close()

State that a checkpoint holds (after a drain, so nothing is in flight): the float32 master parameters and
optimiser state (Orbax arrays, sharded), and in the JSON record the version, the update log, the coordinator's
counters and accepted-but-uncommitted results, the data cursor, the metrics step and elapsed time. All
randomness is counter-based: member seeds, task batches and sampling seeds derive from (seed, version, member),
so the global seed and the version are the whole RNG state.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import hashlib
import importlib.metadata
import json
import os
import pathlib
import platform
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from omegaconf import OmegaConf

from asyncres_jax import distributed, es, metrics
from asyncres_jax.checkpoint import Checkpointer, flatten, unflatten_like
from asyncres_jax.config import TrainConfig, load_config, to_yaml
from asyncres_jax.errors import UserError
from asyncres_jax.jobs import FAKE, engines_per_mesh, episode_job_fn, fake_job_fn, task_batch
from asyncres_jax.mesh import make_mesh, param_shardings
from asyncres_jax.rollout import Cohort, Coordinator, ParamStore, PoolConfig, Replica, RolloutPool

CONFIG_FILE, MANIFEST_FILE, CHECKPOINTS, LOCK_FILE = "config.yaml", "manifest.json", "checkpoints", ".lock"
# Keys that may change between sessions of one run: where it runs and how long it goes on.
SESSION_KEYS = ("mesh", "run_dir", "es.updates", "grpo.steps", "pool.backend", "pool.ray_address", "pool.ray_actors",
                "pool.ray_cpus_per_actor", "pool.ray_gpus_per_actor", "eval.base_from")
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "transformers", "tokenizers",
            "safetensors", "omegaconf", "asyncres-jax")


def log(msg: str) -> None:
    if not distributed.is_main_process():  # one log per run, from process 0
        return
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- run directory


def identity(cfg: TrainConfig) -> dict:
    """The config minus SESSION_KEYS: a run directory belongs to exactly one identity."""
    d = OmegaConf.to_container(OmegaConf.structured(cfg))
    for key in SESSION_KEYS:
        *parents, last = key.split(".")
        node = d
        for p in parents:
            node = node[p]
        node.pop(last, None)
    return d


def fingerprint(cfg: TrainConfig) -> str:
    return hashlib.sha256(json.dumps(identity(cfg), sort_keys=True).encode()).hexdigest()[:16]


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _differences(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [f"{prefix[:-1]} ({a!r} there, {b!r} here)"]


def prepare_run_dir(cfg: TrainConfig, resume: bool, overwrite: bool) -> bool:
    """Create RUN_DIR or check it belongs to this config, and lock it for this process (release_run_dir lets
    go). Returns True when an existing run continues."""
    run = pathlib.Path(cfg.run_dir)
    is_run = (run / CONFIG_FILE).is_file()
    if run.exists() and not run.is_dir():
        raise UserError(f"run_dir {run} is a file; choose another run_dir=")
    if run.is_dir() and not is_run and any(p.name != LOCK_FILE for p in run.iterdir()):
        raise UserError(f"run_dir {run} exists and is not a training run (no {CONFIG_FILE}); "
                        "choose another run_dir= (it is never deleted)")
    if is_run and overwrite and resume:
        raise UserError("--resume and --overwrite contradict each other; pass one of them")
    if not is_run and resume:
        raise UserError(f"--resume: there is no run in {run} to resume; drop --resume to start one")
    run.mkdir(parents=True, exist_ok=True)
    _lock_run_dir(run)
    try:
        if is_run and overwrite:
            log(f"--overwrite: deleting the run in {run}")
            for p in run.iterdir():  # all but the lock this process holds
                if p.name != LOCK_FILE:
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            is_run = False
        if is_run:
            diff = _differences(identity(load_config(run / CONFIG_FILE)), identity(cfg))
            if diff:
                raise UserError(f"run_dir {run} holds a run of a different config (differs in "
                                f"{'; '.join(diff[:4])}); use another run_dir=, or --overwrite to replace it")
    except BaseException:
        release_run_dir(run)
        raise
    (run / CONFIG_FILE).write_text(to_yaml(cfg))
    return is_run


_LOCKS: dict[pathlib.Path, Any] = {}  # the run directories this process holds, to their open lock files


def _lock_run_dir(run: pathlib.Path) -> None:
    """Take RUN_DIR/.lock (an advisory flock) for this process: a second training started into a run directory
    in use (say, a restart while the first still finishes an evaluation after SIGTERM) stops with an error
    instead of both writing checkpoints and metrics there. The kernel drops the lock when the process ends,
    however it ends, so a crash leaves nothing to clean up."""
    key = run.resolve()
    if key in _LOCKS:  # this process holds it already (a trainer rebuilt in the same process)
        return
    f = open(run / LOCK_FILE, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise UserError(f"run_dir {run} is in use by a training process ({holder}); wait for it to end or stop "
                        "it, or choose another run_dir=") from None
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}")
    f.flush()
    _LOCKS[key] = f


def release_run_dir(run: str | pathlib.Path) -> None:
    """Let go of the run directory's lock (idempotent)."""
    f = _LOCKS.pop(pathlib.Path(run).resolve(), None)
    if f is not None:
        f.close()


def _git_revision() -> str | None:
    root = pathlib.Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + ("-dirty" if dirty else "")) if rev else None


def _versions() -> dict[str, str | None]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def write_manifest(run: pathlib.Path, cfg: TrainConfig, mesh, argv: list[str] | None, resumed_at: int | None) -> None:
    """manifest.json: the resolved config, and per session the git revision, packages, mesh and devices."""
    path = run / MANIFEST_FILE
    manifest = json.loads(path.read_text()) if path.is_file() else {"sessions": []}
    manifest["config"] = OmegaConf.to_container(OmegaConf.structured(cfg))
    manifest["config_fingerprint"] = fingerprint(cfg)
    manifest["sessions"].append({
        "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": argv,
        "resumed_at_update": resumed_at,
        "git_revision": _git_revision(),
        "python": platform.python_version(),
        "host": platform.node(),
        "packages": _versions(),
        "mesh": {"data": int(mesh.shape["data"]), "model": int(mesh.shape["model"])},
        "devices": [str(d) for d in mesh.devices.flat],
        "platform": jax.default_backend(),
    })
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(path)


# ------------------------------------------------------------------------------------------- model and tasks


def load_policy_model(name: str, dtype: str, mesh):
    """load_model, plus "tiny" / "tiny:SEED": the random-weight test model (asyncres_jax.model.tiny)."""
    if name == "tiny" or name.startswith("tiny:"):
        import jax.numpy as jnp

        from asyncres_jax.model.tiny import tiny_model

        seed = int(name.partition(":")[2] or 0)
        m = tiny_model(seed)
        make_mesh(mesh, cfg=m.config)  # the same fit checks as load_model
        params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), m.params)
        m.params = jax.device_put(params, param_shardings(params, m.config, mesh))
        m.mesh = mesh
        return m
    from asyncres_jax.model import load_model

    return load_model(name, dtype=dtype, mesh=mesh)


def ensure_tasks(cfg: TrainConfig) -> pathlib.Path:
    """The dataset folder; generated offline on first use when tasks.generate_n > 0."""
    path = pathlib.Path(cfg.tasks.dataset)
    if path.is_dir():
        return path
    if cfg.tasks.generate_n <= 0:
        raise UserError(f"task folder {path} does not exist; point tasks.dataset= at a task dataset, or set "
                        "tasks.generate_n=N to generate one offline")
    log(f"generating {cfg.tasks.generate_n} tasks into {path} (seed {cfg.tasks.generate_seed})")
    cmd = [sys.executable, "-m", "asyncres_jax.tasks", "generate", "--out", str(path),
           "--n", str(cfg.tasks.generate_n), "--seed", str(cfg.tasks.generate_seed)]
    if cfg.tasks.families:  # only the families the run uses
        cmd += ["--families", *cfg.tasks.families]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UserError(f"generating tasks into {path} failed: {tail}")
    return path


def make_backend(cfg: TrainConfig):
    if cfg.sandbox.backend == "docker":
        from asyncres_jax.envs.docker_backend import DockerBackend, DockerConfig

        return DockerBackend(DockerConfig(command_timeout_s=cfg.episode.command_timeout_s))
    from asyncres_jax.envs.bwrap import BwrapBackend, BwrapConfig

    return BwrapBackend(BwrapConfig(command_timeout_s=cfg.episode.command_timeout_s))


# ------------------------------------------------------------------------------------------- the trainer


def es_config(cfg: TrainConfig) -> es.ESConfig:
    e = cfg.es
    return es.ESConfig(population=e.population, sigma=e.sigma, alpha=e.alpha, noise=e.noise, rank=e.rank,
                       shaping=e.shaping, antithetic=e.antithetic, optimizer=e.optimizer)


def pool_config(cfg: TrainConfig, num_workers: int) -> PoolConfig:
    p = cfg.pool
    controlled = p.mode == "controlled"
    return PoolConfig(
        population=cfg.es.population, num_workers=num_workers, mode=p.mode,
        max_staleness={"async": p.max_staleness, "sync": 0, "controlled": None}[p.mode],
        held_back=p.held_back if controlled else 0, delay=p.delay if controlled else 0,
        global_seed=cfg.seed, deadline_seconds=p.job_deadline_s)


def check_supported(cfg: TrainConfig) -> None:
    if cfg.algo != "es":
        raise UserError(f"algo={cfg.algo}: only algo=es is available in this version of the training program")
    distributed.check_schedule(cfg.pool.mode)
    if cfg.pool.backend == "ray":
        from asyncres_jax.rollout.ray_pool import check_config

        check_config(cfg)
    if cfg.es.antithetic and cfg.pool.mode != "sync":
        raise UserError("es.antithetic=true needs pool.mode=sync: a pair's two results must land in one cohort")


def on_mesh(tree, mesh):
    """Leaves not yet placed on the mesh (optimiser counters, made on the default device) replicated over it,
    so a restored checkpoint puts every leaf on the same devices as the parameters."""
    replicated = NamedSharding(mesh, P())

    def place(x):
        return x if isinstance(getattr(x, "sharding", None), NamedSharding) else jax.device_put(x, replicated)
    return jax.tree.map(place, tree)


def to_submesh(x: jax.Array, sharding) -> jax.Array:
    """x (on the whole mesh) as an array with `sharding` (on a sub-mesh of it).

    A replica's devices already hold exactly the shards it needs (the data axis replicates the weights), so
    the new array is assembled from those buffers without a copy; other layouts go through device_put.
    """
    shape = x.shape
    have = {s.device: s for s in x.addressable_shards}
    want = sharding.devices_indices_map(shape)
    source = x.sharding.devices_indices_map(shape)
    if all(d in have and source[d] == idx for d, idx in want.items()):
        return jax.make_array_from_single_device_arrays(shape, sharding, [have[d].data for d in want])
    return jax.device_put(np.asarray(x), sharding)


class ESTrainer:
    def __init__(self, cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, devices=None,
                 argv: list[str] | None = None, job_fn: Callable | None = None):
        check_supported(cfg)
        self.cfg = cfg
        self.run_dir = pathlib.Path(cfg.run_dir)
        self._stop = threading.Event()
        self._learner_s = 0.0  # the learner step within the current update's wall clock (see metrics.PHASES)
        self._pause_at = cfg.es.updates
        self.backend = None
        self.drained_hooks: list[Callable[["ESTrainer"], None]] = []  # e.g. validation every eval.every updates
        self.before_run_hooks: list[Callable[["ESTrainer"], None]] = []  # e.g. validation of the base model
        self.total_updates = cfg.es.updates  # what evaluation calls the end of the run
        fake = cfg.tasks.dataset == FAKE
        # Everything that can be wrong with the input fails here, before the run directory is touched.
        dataset = None if fake else pathlib.Path(distributed.on_main(lambda: str(ensure_tasks(cfg))))
        self.model = load_policy_model(cfg.model.name, cfg.model.dtype, make_mesh(cfg.mesh, devices))
        self.mesh = self.model.mesh
        continuing = distributed.on_main(prepare_run_dir, cfg, resume, overwrite)  # process 0 writes RUN_DIR
        self.es_cfg = es_config(cfg)

        # Learner: float32 masters on the whole mesh; the store applies the ES step and keeps the update log.
        params = self.model.params
        self.store = ParamStore(params, on_mesh(es.init(params, self.es_cfg), self.mesh), apply_update=self._apply_update,
                                shape=lambda f: es.shape_fitness(f, self.es_cfg), replay=self._replay_fn())
        pseeds = (lambda g, v, i: es.member_seed(g, v, i // 2)) if cfg.es.antithetic else es.member_seed
        replicas = self._replicas()
        ray = cfg.pool.backend == "ray"  # one actor per replica, or pool.ray_actors of them
        n_workers = (cfg.pool.ray_actors or len(replicas)) if ray else len(replicas) * cfg.pool.workers_per_replica
        self.coordinator = Coordinator(pool_config(cfg, n_workers), pseeds)
        self.checkpointer = Checkpointer(self.run_dir / CHECKPOINTS, cfg.checkpoint.keep, report=log)
        self.elapsed0, self.ckpt_step, metrics_step = 0.0, 0, 0
        restored = self._restore() if continuing else None
        if restored is not None:
            metrics_step = restored
        elif resume:
            raise UserError(f"--resume: {self.run_dir} has no readable checkpoint; drop --resume to start over")
        main = distributed.is_main_process()  # processes > 0 keep their own record in RUN_DIR/processes/I
        self.metrics = metrics.MetricsWriter(distributed.process_dir(self.run_dir), metrics_step, total=cfg.es.updates,
                                             tensorboard=main, progress=main,
                                             initial=self.store.version)
        if main:
            write_manifest(self.run_dir, cfg, self.mesh, argv, self.store.version if continuing else None)

        try:
            if ray:  # each actor builds its own model and job function from the config (rollout/ray_pool.py)
                if job_fn is not None:
                    raise ValueError("pool.backend=ray builds the job function inside each actor; pass no job_fn")
                from asyncres_jax.rollout.ray_pool import trainer_pool

                self.pool = trainer_pool(cfg, self.coordinator, self.store, on_commit=self._on_commit)
                return
            if job_fn is None:
                job_fn = fake_job_fn(self.model.config, self.es_cfg) if fake else self._episode_job(dataset)
            job_fn = distributed.share_results(job_fn)  # across processes: each job runs in one, all get its result
            self.pool = RolloutPool(self.coordinator, self.store, job_fn, replicas=replicas,
                                    workers_per_replica=cfg.pool.workers_per_replica, on_commit=self._on_commit)
        except BaseException:  # nothing may stay behind: the sandbox backend's folders, open files
            if self.backend is not None:
                self.backend.close()
            self.metrics.close()
            self.checkpointer.close()
            if distributed.is_main_process():
                release_run_dir(self.run_dir)
            raise

    # -- ES plumbing -----------------------------------------------------------------------------------

    def _update_seeds(self, seeds: np.ndarray) -> np.ndarray:
        return seeds[0::2] if self.es_cfg.antithetic else seeds  # pairs share a seed (sync cohorts, in order)

    def _apply_update(self, params, opt_state, seeds, shaped):
        return es.apply_logged_update(params, opt_state, self._update_seeds(seeds), shaped, self.es_cfg)

    def _replay_fn(self):
        # Replaying (seeds, z) on a replica's copy moves N integers instead of the weights, and is exact only for
        # the stateless SGD rule on float32 copies: a bf16 copy would round away most of each ~1e-4 step.
        if self.cfg.es.optimizer != "sgd" or self.cfg.model.rollout_dtype != "float32":
            return None

        def replay(params, seeds, shaped):
            return es.apply_logged_update(params, es.init(params, self.es_cfg), self._update_seeds(seeds), shaped,
                                          self.es_cfg)[0]
        return replay

    def _replicas(self) -> list[Replica]:
        import jax.numpy as jnp

        dtype = jnp.dtype(self.cfg.model.rollout_dtype)
        out = []
        for i, sub in distributed.local_replica_meshes(self.mesh):  # all of them in a single process
            shardings = param_shardings(self.model.params, self.model.config, sub)

            def place(p, shardings=shardings):
                return jax.tree.map(lambda x, s: to_submesh(x, s).astype(dtype), p, shardings)  # local ops only
            out.append(Replica(i, sub, place=place))
        return out

    def _episode_job(self, dataset: pathlib.Path):
        from asyncres_jax.envs.task import load_split
        from asyncres_jax.rollout.episodes import EpisodeConfig

        from asyncres_jax.evaluate import filter_tasks

        tasks = filter_tasks(load_split(dataset, self.cfg.tasks.train_split), self.cfg.tasks.families,
                             self.cfg.tasks.difficulties)
        if not tasks:
            raise UserError(f"{dataset}/splits/{self.cfg.tasks.train_split}.txt lists no tasks")
        self.backend = make_backend(self.cfg)
        episode_cfg = EpisodeConfig.from_sections(self.cfg.episode, self.cfg.sandbox)  # with the policy's options
        if self.cfg.es.batched_population:
            return self._cohort_job(tasks, episode_cfg)
        return episode_job_fn(self.model, tasks, self.backend, episode_cfg, self.es_cfg, global_seed=self.cfg.seed,
                              tasks_per_member=self.cfg.es.tasks_per_member, fitness=self.cfg.episode.fitness)

    def _cohort_job(self, tasks, episode_cfg):
        """Low-rank ES with the members a replica's workers hold played as one batch over one copy of W."""
        from asyncres_jax.rollout.cohort import JobBatcher, run_cohort

        engine_for, cfg = engines_per_mesh(self.model, episode_cfg.context_limit), self.cfg

        def batch_fn(jobs, params):
            batch = task_batch(tasks, cfg.seed, jobs[0].dispatch_version, cfg.es.tasks_per_member)
            return run_cohort(engine_for(params), params, jobs, batch, self.backend, episode_cfg, self.es_cfg,
                              fitness=cfg.episode.fitness)
        return JobBatcher(batch_fn, max_batch=cfg.pool.workers_per_replica)

    # -- checkpoints -----------------------------------------------------------------------------------

    def _arrays(self) -> dict:
        return {**flatten(self.store.params, "params"), **flatten(self.store.opt_state, "opt")}

    def save_checkpoint(self) -> None:
        """Only while the pool is drained (the coordinator refuses otherwise)."""
        state = self.store.state_dict()
        meta = {
            "version": int(state["version"]), "log_start": int(state["log_start"]),
            "log_seeds": np.asarray(state["log_seeds"]).tolist(),
            "log_shaped": np.asarray(state["log_shaped"], np.float32).tolist(),
            "coordinator": self.coordinator.state_dict(),
            "data_cursor": int(state["version"]) * self.cfg.es.tasks_per_member,
            "metrics_step": self.metrics.step,
            "elapsed_seconds": self.elapsed(),
            "rng": {"global_seed": self.cfg.seed, "counter": int(state["version"])},
            "config_fingerprint": fingerprint(self.cfg),
            "layout": es.layout_fingerprint(self.store.params),
            "saved": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        }
        self.ckpt_step += 1
        self.checkpointer.save(self.ckpt_step, self._arrays(), meta)
        log(f"checkpoint {self.ckpt_step} at update {meta['version']} "
            f"({len(meta['coordinator']['cohort'])} results waiting for the next update)")

    def _restore(self) -> int | None:
        check = self.checkpointer.same_run(fingerprint(self.cfg), es.layout_fingerprint(self.store.params),
                                           self.cfg.model.name)
        restored = self.checkpointer.restore_latest(self._arrays(), check)
        if restored is None:
            return None
        meta, arrays = restored.meta, restored.arrays
        seeds = np.asarray(meta["log_seeds"], np.int64).reshape(-1, self.cfg.es.population)
        shaped = np.asarray(meta["log_shaped"], np.float32).reshape(seeds.shape)
        self.store.load_state_dict({
            "version": meta["version"], "log_start": meta["log_start"],
            "params": unflatten_like(self.store.params, arrays, "params"),
            "opt_state": unflatten_like(self.store.opt_state, arrays, "opt"),
            "log_seeds": seeds, "log_shaped": shaped,
        })
        self.coordinator.load_state_dict(meta["coordinator"])
        self.ckpt_step, self.elapsed0 = restored.step, float(meta["elapsed_seconds"])
        log(f"resuming {self.run_dir} at update {self.store.version} (checkpoint {restored.step})")
        return int(meta["metrics_step"])

    # -- the loop --------------------------------------------------------------------------------------

    def elapsed(self) -> float:
        return self.elapsed0 + (time.monotonic() - self._t0 if hasattr(self, "_t0") else 0.0)

    def _on_commit(self, cohort: Cohort) -> None:
        """Under the pool's lock, right after the store published cohort.version + 1."""
        version = cohort.version + 1
        if version >= self._pause_at:
            self.coordinator.drain()  # atomically with the commit: no job of the next version starts
        record = metrics.update_record(version, cohort.fitness, cohort.staleness, cohort.metrics,
                                       [r.stats for r in cohort.results], self.elapsed(),
                                       num_workers=self.coordinator.config.num_workers,
                                       learner_seconds=self._learner_s)
        self._learner_s = self.pool.learner_seconds  # this step runs within the next update's wall clock
        self.metrics.write(record, samples=[r.stats.get("transcript") for r in cohort.results])
        log(f"update {version}/{self.cfg.es.updates}: fitness {record['fitness_mean']:.4f} "
            f"± {record['fitness_std']:.4f}, staleness {record['staleness_hist']}, dropped {record['dropped']}, "
            f"utilisation {record['utilization']:.2f}, {record['update_seconds']:.1f} s")

    def request_stop(self) -> None:
        """Finish in-flight jobs, checkpoint and return from run() (what the first SIGINT/SIGTERM does)."""
        self._stop.set()

    def run(self) -> int:
        """Train until es.updates (or a stop request). Returns the version reached."""
        cfg, every = self.cfg, self.cfg.checkpoint.every
        self._t0 = time.monotonic()
        if self.store.version >= cfg.es.updates:
            log(f"{self.run_dir} already holds {self.store.version} updates (es.updates={cfg.es.updates})")
            return self.store.version
        log(f"training {self.model!r} on mesh {self.mesh.shape['data']}x{self.mesh.shape['model']}: "
            f"{len(self.pool.replicas)} replicas x {cfg.pool.workers_per_replica} workers, "
            f"update {self.store.version} -> {cfg.es.updates}")
        for hook in self.before_run_hooks:
            hook(self)
        while self.store.version < cfg.es.updates and not self._stop.is_set():
            self._pause_at = min((self.store.version // every + 1) * every, cfg.es.updates)
            self._learner_s = 0.0  # the last learner step fell in the pause, which no update's wall clock counts
            self.pool.resume()
            while self.coordinator.version < self._pause_at and not self._stop.is_set():
                try:  # short waits, so a signal's stop request is seen promptly
                    self.pool.run_until(self._pause_at, timeout=0.2)
                except TimeoutError:
                    pass
                except RuntimeError as e:  # a job failed max_attempts times; a user's mistake stays one line
                    if isinstance(e.__cause__, UserError):
                        raise UserError(f"a rollout job failed: {e.__cause__}") from None
                    raise
            self.pool.drain()
            if not self._stop.is_set():  # a stop request ends the session quickly: no evaluation now
                for hook in self.drained_hooks:
                    hook(self)
            self.save_checkpoint()
        if self._stop.is_set():
            log(f"stopped at update {self.store.version}; resume with the same command")
        return self.store.version

    def close(self) -> None:
        """Stop the pool's threads and remove every sandbox (idempotent)."""
        try:
            self.pool.shutdown(timeout=None)
        finally:
            if self.backend is not None:
                self.backend.close()
                self.backend = None
            self.metrics.close()
            self.checkpointer.close()
            if distributed.is_main_process():
                release_run_dir(self.run_dir)


# ------------------------------------------------------------------------------------------- entry points


class _Signals:
    """First SIGINT/SIGTERM: graceful stop. Second: remove sandboxes and exit at once."""

    def __init__(self, trainer: ESTrainer):
        self.trainer, self.count, self.old = trainer, 0, {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.count += 1
        name = signal.Signals(signum).name
        if self.count == 1:
            log(f"{name}: finishing in-flight jobs, then checkpoint and exit (again to exit at once)")
            self.trainer.request_stop()
            return
        log(f"{name} again: removing sandboxes and exiting now")
        try:
            backend = self.trainer.backend
            if backend is not None:
                backend.close()
                # Episode threads may still be copying a sandbox's files into the backend's folder while it is
                # deleted; a reaper deletes it again once this process (and so every thread) is gone.
                if getattr(backend, "_own_root", False):
                    subprocess.Popen(["sh", "-c", 'while kill -0 "$0" 2>/dev/null; do sleep 0.02; done; rm -rf "$1"',
                                      str(os.getpid()), str(backend.root)], start_new_session=True,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        finally:
            os._exit(128 + signum)  # daemon worker threads and --die-with-parent sandboxes end with us

    def __exit__(self, *exc):
        for sig, handler in self.old.items():
            signal.signal(sig, handler)


def train(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, handle_signals: bool = False,
          argv: list[str] | None = None, devices=None) -> int:
    if cfg.algo == "grpo":
        from asyncres_jax.grpo.trainer import train as train_grpo

        return train_grpo(cfg, resume=resume, overwrite=overwrite, handle_signals=handle_signals, argv=argv,
                          devices=devices)
    trainer = ESTrainer(cfg, resume=resume, overwrite=overwrite, argv=argv, devices=devices)
    try:
        from asyncres_jax.evaluate import attach

        distributed.attach_on_main(trainer, attach)  # validation every eval.every updates, test at the end
        run_to_end(trainer, handle_signals)
    finally:
        trainer.close()
    return 0


def run_to_end(trainer, handle_signals: bool) -> None:
    """trainer.run(), with SIGINT/SIGTERM turned into a drain-and-checkpoint stop when asked (the CLI does)."""
    if handle_signals:
        with _Signals(trainer):
            trainer.run()
    else:
        trainer.run()


def _find_checkpoint(path: pathlib.Path) -> tuple[pathlib.Path, int | None]:
    """(run dir, step or None for the latest) from a run dir, its checkpoints/ folder or one step folder."""
    path = path.absolute()
    for run, step in ((path, None), (path.parent, None), (path.parent.parent, path.name)):
        if (run / CONFIG_FILE).is_file() and (run / CHECKPOINTS).is_dir():
            if step is not None and not step.isdigit():
                break
            return run, None if step is None else int(step)
    raise UserError(f"{path} is not a run directory or one of its checkpoints "
                    f"(expected RUN_DIR/{CONFIG_FILE} and RUN_DIR/{CHECKPOINTS}/)")


def restore_params(run: pathlib.Path, step: int | None, cfg: TrainConfig, model):
    """(parameters, the Restored checkpoint) of RUN_DIR's latest checkpoint, or of checkpoint `step`."""
    if cfg.algo == "grpo":
        from asyncres_jax.grpo.trainer import opt_template

        opt_state = opt_template(model.params, cfg)
    else:
        opt_state = es.init(model.params, es_config(cfg))
    template = {**flatten(model.params, "params"), **flatten(opt_state, "opt")}
    ckpt = Checkpointer(run / CHECKPOINTS, cfg.checkpoint.keep, report=log)
    try:
        if step is not None and step not in ckpt.steps():
            raise UserError(f"{run / CHECKPOINTS} has no checkpoint {step}; it has {ckpt.steps()}")
        restored = ckpt.restore_latest(template, steps=None if step is None else [step])
    finally:
        ckpt.close()
    if restored is None:
        raise UserError(f"{run / CHECKPOINTS} holds no readable checkpoint")
    return unflatten_like(model.params, restored.arrays, "params"), restored


def export(checkpoint: str, out: str, *, dtype: str = "float32", overwrite: bool = False) -> pathlib.Path:
    """A checkpoint's parameters as a Hugging Face folder: config.json (the original model's when it had one,
    else derived: Qwen2/Llama style), model.safetensors and the tokenizer files when the model has them."""
    import jax.numpy as jnp

    from asyncres_jax.model.loading import save_hf

    run, step = _find_checkpoint(pathlib.Path(checkpoint))
    out_dir = pathlib.Path(out)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise UserError(f"{out_dir} exists and is not empty; choose another --out or pass --overwrite")
    cfg = load_config(run / CONFIG_FILE)
    mesh = make_mesh("1x1", jax.devices()[:1])
    model = load_policy_model(cfg.model.name, cfg.model.dtype, mesh)
    params, restored = restore_params(run, step, cfg, model)
    params = jax.tree.map(lambda x: np.asarray(x.astype(jnp.dtype(dtype))), params)
    if out_dir.exists() and overwrite:
        shutil.rmtree(out_dir)
    save_hf(out_dir, model.config, params)
    source = pathlib.Path(cfg.model.name)
    if source.is_dir() and (source / "config.json").is_file():
        original = json.loads((source / "config.json").read_text())
        original["torch_dtype" if "torch_dtype" in original else "dtype"] = dtype
        (out_dir / "config.json").write_text(json.dumps(original, indent=2))
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(out_dir))
    version = restored.meta["version"]
    (out_dir / "asyncres_export.json").write_text(json.dumps(
        {"run_dir": str(run), "checkpoint": restored.step, "update": version, "model": cfg.model.name}, indent=2))
    log(f"exported update {version} of {run} to {out_dir}")
    return out_dir
