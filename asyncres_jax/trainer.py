"""The ES training loop behind `python -m asyncres_jax.train`: learner, rollout pool, checkpoints, the loop.

    trainer = ESTrainer(cfg)            # loads or resumes RUN_DIR; builds mesh, model, store, coordinator, pool
    trainer.run()                       # until es.updates, a signal, or trainer.request_stop()
    trainer.close()

State that a checkpoint holds (after a drain, so nothing is in flight): the float32 master parameters and
optimiser state (Orbax arrays, sharded), and in the JSON record the version, the update log, the coordinator's
counters and accepted-but-uncommitted results, the data cursor, the metrics step and elapsed time. All
randomness is counter-based: member seeds, task batches and sampling seeds derive from (seed, version, member),
so the global seed and the version are the whole RNG state. The run directory, model loading and the parts
shared with the GRPO trainer and evaluation are the run layer's (asyncres_jax/run.py); what a rollout job is,
the same for the threaded pool and every Ray actor, is rollout/jobs.py's.
"""

from __future__ import annotations

import pathlib
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from asyncres_jax import distributed, es, metrics
from asyncres_jax.checkpoint import flatten, unflatten_like
from asyncres_jax.config import TrainConfig
from asyncres_jax.errors import UserError
from asyncres_jax.mesh import make_mesh
from asyncres_jax.model.sharding import learner_shardings, param_shardings, splits_masters
from asyncres_jax.rollout import Cohort, Coordinator, PoolConfig, RolloutPool, es_param_store
from asyncres_jax.rollout.episodes import EpisodeConfig
from asyncres_jax.rollout.jobs import FAKE, es_job_fn, fake_job_fn
from asyncres_jax.rollout.replicas import on_mesh, replicas_from_mesh
from asyncres_jax.run import (Trainer, ensure_tasks, load_policy_model, log, make_backend, prepare_run_dir,
                              run_to_end, train_tasks)


def rollout_workers(population: int, replicas: int, per_replica: int) -> tuple[int, int]:
    """(replicas used, workers per replica). A cohort needs more members than jobs in flight (N > workers), so
    pool.workers_per_replica is an upper bound: a large mesh gets fewer workers per replica, and with more
    replicas than N - 1 only N - 1 of them run jobs (the configured bound holds on a small mesh)."""
    per = max(1, min(per_replica, (population - 1) // replicas))
    return max(1, min(replicas, (population - 1) // per)), per


def pool_config(cfg: TrainConfig, num_workers: int) -> PoolConfig:
    p = cfg.pool
    controlled = p.mode == "controlled"
    return PoolConfig(
        population=cfg.es.population, num_workers=num_workers, mode=p.mode,
        max_staleness={"async": p.max_staleness, "sync": 0, "controlled": None}[p.mode],
        held_back=p.held_back if controlled else 0, delay=p.delay if controlled else 0,
        global_seed=cfg.seed, deadline_seconds=p.job_deadline_s, paced=p.pace_admission,
        held_back_tasks=p.held_back_tasks if controlled else "dispatch")


def check_supported(cfg: TrainConfig) -> None:
    if cfg.algo != "es":
        raise UserError(f"algo={cfg.algo}: only algo=es is available in this version of the training program")
    distributed.check_schedule(cfg.pool.mode)
    if cfg.pool.backend == "ray":
        check_ray(cfg)
    if cfg.es.antithetic and cfg.pool.mode != "sync":
        raise UserError("es.antithetic=true needs pool.mode=sync: a pair's two results must land in one cohort")


def members_per_batch(cfg: TrainConfig, workers_per_replica: int) -> int:
    """How many jobs a replica's workers play as one batch (es.batched_population): es.members_per_batch, or all
    `workers_per_replica` of them."""
    if cfg.es.members_per_batch > workers_per_replica:
        raise UserError(f"es.members_per_batch={cfg.es.members_per_batch} exceeds the {workers_per_replica} workers "
                        f"a replica has (pool.workers_per_replica): a batch could never fill; lower it or raise "
                        f"pool.workers_per_replica")
    return cfg.es.members_per_batch or workers_per_replica


def job_fn_for(cfg: TrainConfig, model, dataset: pathlib.Path | None, workers_per_replica: int = 1):
    """(the config's ES job function on `model`, its sandbox backend or None): the fake environment, or the
    train split's episodes in a new backend; a batched population plays up to `members_per_batch` jobs at once."""
    es_cfg = cfg.es.core()
    max_batch = members_per_batch(cfg, workers_per_replica)
    if dataset is None:
        return fake_job_fn(model.config, es_cfg), None
    tasks = train_tasks(cfg, dataset)
    episode_cfg = EpisodeConfig.from_sections(cfg.episode, cfg.sandbox)  # with the policy's options
    backend = make_backend(cfg)
    try:
        return es_job_fn(model, tasks, backend, episode_cfg, es_cfg, global_seed=cfg.seed,
                         tasks_per_member=cfg.es.tasks_per_member, fitness=cfg.episode.fitness,
                         batched_population=cfg.es.batched_population,
                         max_batch=max_batch, streams=cfg.es.streams_per_batch), backend
    except BaseException:
        backend.close()
        raise


class ESTrainer(Trainer):
    def __init__(self, cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, devices=None,
                 argv: list[str] | None = None, job_fn: Callable | None = None):
        check_supported(cfg)
        super().__init__(cfg, cfg.es.updates)
        self._learner_s = 0.0  # the learner step within the current update's wall clock (see metrics.PHASES)
        self._pause_at = cfg.es.updates
        fake = cfg.tasks.dataset == FAKE
        # Everything that can be wrong with the input fails here, before the run directory is touched.
        dataset = None if fake else pathlib.Path(distributed.on_main(lambda: str(ensure_tasks(cfg))))
        self.model = load_policy_model(cfg.model.name, cfg.model.dtype, make_mesh(cfg.mesh, devices))
        self.mesh = self.model.mesh
        continuing = distributed.on_main(prepare_run_dir, cfg, resume, overwrite)  # process 0 writes RUN_DIR
        self.es_cfg = cfg.es.core()

        # Learner: float32 masters on the whole mesh; the store applies the ES step and keeps the update log. On
        # devices that share host memory the masters are split over "data" and replicas alias one host copy per
        # version, which is free, so they copy it instead of replaying the update each (learner_shardings).
        split = splits_masters(self.mesh)
        if split:
            self.model.params = jax.device_put(self.model.params,
                                               learner_shardings(self.model.params, self.model.config, self.mesh))
        self.store = es_param_store(self.model.params, self.es_cfg, rollout_dtype=cfg.model.rollout_dtype,
                                    place_state=lambda s: on_mesh(s, self.mesh), max_replay=0 if split else 4)
        pseeds = (lambda g, v, i: es.member_seed(g, v, i // 2)) if cfg.es.antithetic else es.member_seed
        distributed.check_mesh(self.mesh)
        replicas = replicas_from_mesh(self.mesh, lambda sub: param_shardings(self.model.params, self.model.config, sub),
                                      jnp.dtype(cfg.model.rollout_dtype), owned=distributed.is_local)
        ray = cfg.pool.backend == "ray"  # one actor per replica, or pool.ray_actors of them
        used, self.workers_per_replica = rollout_workers(cfg.es.population, len(replicas),
                                                         cfg.pool.workers_per_replica)
        if not ray and (used, self.workers_per_replica) != (len(replicas), cfg.pool.workers_per_replica):
            log(f"population N={cfg.es.population} on {len(replicas)} replicas: {used} replicas x "
                f"{self.workers_per_replica} workers run jobs (N must exceed the workers)")
            replicas = replicas[:used]
        n_workers = (cfg.pool.ray_actors or len(replicas)) if ray else len(replicas) * self.workers_per_replica
        self.coordinator = Coordinator(pool_config(cfg, n_workers), pseeds)
        self._open_records(continuing=continuing, resume=resume, argv=argv)
        try:
            if ray:  # each actor builds its own model and job function from the config (build_replica)
                if job_fn is not None:
                    raise ValueError("pool.backend=ray builds the job function inside each actor; pass no job_fn")
                self.pool = ray_pool(cfg, self.coordinator, self.store, on_commit=self._on_commit)
                return
            if job_fn is None:
                job_fn, self.backend = job_fn_for(cfg, self.model, dataset, self.workers_per_replica)
            job_fn = distributed.share_results(job_fn)  # across processes: each job runs in one, all get its result
            self.pool = RolloutPool(self.coordinator, self.store, job_fn, replicas=replicas,
                                    workers_per_replica=self.workers_per_replica, on_commit=self._on_commit)
        except BaseException:  # nothing may stay behind: the sandbox backend's folders, open files
            Trainer.close(self)
            raise

    @property
    def version(self) -> int:
        return self.store.version

    # -- checkpoints -----------------------------------------------------------------------------------

    def _params(self):
        return self.store.params

    def _arrays(self) -> dict:
        return {**flatten(self.store.params, "params"), **flatten(self.store.opt_state, "opt")}

    def _checkpoint_meta(self) -> dict:
        """Only while the pool is drained (the coordinator refuses otherwise)."""
        state = self.store.state_dict()
        return {
            "version": int(state["version"]), "log_start": int(state["log_start"]),
            "log_seeds": np.asarray(state["log_seeds"]).tolist(),
            "log_shaped": np.asarray(state["log_shaped"], np.float32).tolist(),
            "coordinator": self.coordinator.state_dict(),
            "data_cursor": int(state["version"]) * self.cfg.es.tasks_per_member,
        }

    def _checkpoint_note(self, meta: dict) -> str:
        return f" ({len(meta['coordinator']['cohort'])} results waiting for the next update)"

    def _load_checkpoint(self, meta: dict, arrays: dict) -> None:
        seeds = np.asarray(meta["log_seeds"], np.int64).reshape(-1, self.cfg.es.population)
        shaped = np.asarray(meta["log_shaped"], np.float32).reshape(seeds.shape)
        self.store.load_state_dict({
            "version": meta["version"], "log_start": meta["log_start"],
            "params": unflatten_like(self.store.params, arrays, "params"),
            "opt_state": unflatten_like(self.store.opt_state, arrays, "opt"),
            "log_seeds": seeds, "log_shaped": shaped,
        })
        self.coordinator.load_state_dict(meta["coordinator"])

    # -- the loop --------------------------------------------------------------------------------------

    def _on_commit(self, cohort: Cohort) -> None:
        """Under the pool's lock, right after the store published cohort.version + 1."""
        version = cohort.version + 1
        if version >= self._pause_at:
            self.coordinator.drain()  # atomically with the commit: no job of the next version starts
        record = metrics.update_record(version, cohort.fitness, cohort.staleness, cohort.metrics,
                                       [r.stats for r in cohort.results], self.elapsed(),
                                       num_workers=self.coordinator.config.num_workers,
                                       learner_seconds=self._learner_s, task_versions=cohort.task_versions)
        self._learner_s = self.pool.learner_seconds  # this step runs within the next update's wall clock
        self.metrics.write(record, samples=[r.stats.get("transcript") for r in cohort.results])
        log(f"update {version}/{self.cfg.es.updates}: fitness {record['fitness_mean']:.4f} "
            f"± {record['fitness_std']:.4f}, staleness {record['staleness_hist']}, dropped {record['dropped']}, "
            f"utilisation {record['utilization']:.2f}, {record['update_seconds']:.1f} s")

    def run(self) -> int:
        """Train until es.updates (or a stop request). Returns the version reached."""
        cfg, every = self.cfg, self.cfg.checkpoint.every
        self._t0 = time.monotonic()
        if self.store.version >= cfg.es.updates:
            log(f"{self.run_dir} already holds {self.store.version} updates (es.updates={cfg.es.updates})")
            for hook in self.drained_hooks:  # the final evaluations, if a stop request came before them
                hook(self)
            return self.store.version
        log(f"training {self.model!r} on mesh {self.mesh.shape['data']}x{self.mesh.shape['model']}: "
            f"{len(self.pool.replicas)} replicas x {self.workers_per_replica} workers, "
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
        """Stop the pool's threads, remove every sandbox and close the writers (idempotent)."""
        try:
            self.pool.shutdown(timeout=None)
        finally:
            super().close()


# ------------------------------------------------------------------------------------------- Ray actors


def check_ray(cfg: TrainConfig) -> None:
    """What pool.backend=ray refuses, before anything is started or written."""
    from asyncres_jax.rollout.ray_pool import import_ray

    import_ray()
    if cfg.pool.workers_per_replica != 1:
        raise UserError(f"pool.backend=ray runs one job per actor; set pool.ray_actors= instead of "
                        f"pool.workers_per_replica={cfg.pool.workers_per_replica}")
    if distributed.num_processes() > 1:
        raise UserError("pool.backend=ray is driven by one process; start the trainer without jax.distributed")


def build_replica(cfg_yaml: str):
    """Inside a Ray actor: the training config's model on this process's first M devices (M = the mesh's model
    axis), restored from the run's latest checkpoint when there is one, and the config's job function."""
    import jax
    from omegaconf import OmegaConf

    from asyncres_jax.mesh import parse_mesh
    from asyncres_jax.rollout.jobs import replay_fn
    from asyncres_jax.rollout.ray_pool import ReplicaState
    from asyncres_jax.run import restore_params

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.create(cfg_yaml)))
    m = parse_mesh(cfg.mesh)[1]
    if len(jax.devices()) < m:
        raise UserError(f"a rollout actor sees {len(jax.devices())} devices but the mesh's model axis is {m}; "
                        "give each actor M devices (pool.ray_gpus_per_actor)")
    model = load_policy_model(cfg.model.name, cfg.model.dtype, make_mesh(f"1x{m}", jax.devices()[:m]))
    params, version = model.params, 0
    try:  # a replacement actor (or a resumed run) starts from the latest checkpoint, then replays the log
        params, restored = restore_params(pathlib.Path(cfg.run_dir), None, cfg, model)
        version = int(restored.meta["version"])
    except UserError:  # no checkpoint yet: the initial weights are version 0
        pass
    (replica,) = replicas_from_mesh(model.mesh, lambda sub: param_shardings(model.params, model.config, sub),
                                    jnp.dtype(cfg.model.rollout_dtype))
    dataset = None if cfg.tasks.dataset == FAKE else pathlib.Path(cfg.tasks.dataset)
    # with this actor's model and its own sandbox backend
    job_fn, backend = job_fn_for(cfg, model, dataset, cfg.pool.workers_per_replica)
    return ReplicaState(version, replica.place(params), job_fn, replay_fn(cfg.es.core(), cfg.model.rollout_dtype),
                        replica.place, backend.close if backend is not None else (lambda: None))


def ray_pool(cfg: TrainConfig, coordinator: Coordinator, store, *, on_commit: Callable[[Cohort], None] | None = None):
    """The RayRolloutPool of a training config (pool.backend=ray): connects to (or starts) the cluster."""
    import functools

    from asyncres_jax.config import to_yaml
    from asyncres_jax.rollout.ray_pool import ActorSpec, RayRolloutPool, cluster, driver_jax_config

    check_ray(cfg)
    p = cfg.pool
    owns, env = cluster(coordinator.config.num_workers, p.ray_address, p.ray_cpus_per_actor, p.ray_gpus_per_actor,
                        hint="lower pool.ray_actors or pool.ray_cpus_per_actor / pool.ray_gpus_per_actor, or add nodes")
    spec = ActorSpec(functools.partial(build_replica, to_yaml(cfg)), num_cpus=p.ray_cpus_per_actor,
                     num_gpus=p.ray_gpus_per_actor, env=env, jax_config=driver_jax_config())
    return RayRolloutPool(coordinator, store, spec, on_commit=on_commit, owns_ray=owns)


# ------------------------------------------------------------------------------------------- entry point


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
