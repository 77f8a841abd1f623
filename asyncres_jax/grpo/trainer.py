"""The GRPO training loop behind `python -m asyncres_jax.train` with `algo: grpo`.

    trainer = GRPOTrainer(cfg)          # loads or resumes RUN_DIR; builds mesh, model, learner, engine, sandboxes
    trainer.run()                       # until grpo.steps, a signal, or trainer.request_stop()
    trainer.close()

One step: the step's `prompts_per_step` tasks (a slice of a per-epoch permutation of the train split, a function
of (seed, step) alone), each played `group_size` times in one batch of multi-turn episodes by the current policy
(sampling seed from (seed, step)); rewards -> group-normalised advantages; `epochs` passes of minibatch AdamW
steps on the episodes' segments (grpo/step.py). Every `eval.every` steps the validation split is played with each
of `eval.seeds`; every `checkpoint.every` steps (and at the end or on a stop request) the parameters and optimiser
state are checkpointed with Orbax. The reference model is the initial model, reloaded on resume.
The run directory is the ES trainer's: config.yaml, manifest.json, metrics.jsonl (one line per step), checkpoints/.
"""

from __future__ import annotations

import datetime as dt
import pathlib
import threading
import time
import types
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from asyncres_jax import metrics
from asyncres_jax.checkpoint import Checkpointer, flatten, unflatten_like
from asyncres_jax.config import TrainConfig
from asyncres_jax.errors import UserError
from asyncres_jax.grpo.data import build_batch, whole_conversation
from asyncres_jax.grpo.rollout import RecordingPolicy
from asyncres_jax.grpo.step import GRPOHyper, Learner, make_optimizer

STEP_TAG = 0x6772706F  # "grpo": keeps GRPO sampling seeds apart from any other use of (seed, step)


def hyper(cfg: TrainConfig) -> GRPOHyper:
    g = cfg.grpo
    return GRPOHyper(lr=g.lr, weight_decay=g.weight_decay, grad_clip=g.grad_clip, clip_eps=g.clip_eps,
                     kl_coef=g.kl_coef, epochs=g.epochs, minibatch_size=g.minibatch_size,
                     micro_batch_size=g.micro_batch_size, temperature=cfg.episode.temperature)


def check_supported(cfg: TrainConfig) -> None:
    if cfg.algo != "grpo":
        raise UserError(f"algo={cfg.algo}: the GRPO trainer needs algo=grpo")
    if cfg.episode.temperature <= 0:
        raise UserError("GRPO needs sampled episodes: set episode.temperature > 0 (the paper uses 0.6)")
    if cfg.episode.top_p < 1.0:
        raise UserError("GRPO recomputes log-probs of the full softmax: set episode.top_p=1.0 (as in the paper)")
    if cfg.tasks.dataset == "fake":
        raise UserError("tasks.dataset=fake is an ES-only stand-in; GRPO needs a task folder (tasks.generate_n=N)")


def sampling_seed(global_seed: int, step: int) -> int:
    return int(np.random.SeedSequence([global_seed, step, STEP_TAG]).generate_state(1)[0])


def opt_template(params, cfg: TrainConfig):
    """The optimiser state's structure, for restoring a GRPO checkpoint (e.g. by `train export`)."""
    return jax.eval_shape(make_optimizer(hyper(cfg)).init, params)


def _without_start_errors(rewards: np.ndarray, results, group_size: int) -> tuple[np.ndarray, int]:
    """An episode whose sandbox never started gets its group's mean reward over the episodes that ran: no
    advantage of its own, and the others' advantages are not pulled by a 0 the policy did not earn."""
    failed = np.asarray([r.error is not None for r in results]).reshape(-1, group_size)
    if not failed.any():
        return rewards, 0
    groups = rewards.reshape(-1, group_size).copy()
    for row, bad in zip(groups, failed):
        row[bad] = row[~bad].mean() if (~bad).any() else 0.0
    return groups.reshape(-1), int(failed.sum())


class GRPOTrainer:
    def __init__(self, cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, devices=None,
                 argv: list[str] | None = None, backend=None):
        from asyncres_jax import trainer as common  # the run directory, model, tasks and backend helpers
        from asyncres_jax.envs.task import load_split
        from asyncres_jax.evaluate import filter_tasks
        from asyncres_jax.mesh import make_mesh
        from asyncres_jax.model import Model
        from asyncres_jax.model.generate import Engine
        from asyncres_jax.rollout.episodes import EpisodeConfig

        check_supported(cfg)
        self.cfg, self.common = cfg, common
        self.run_dir = pathlib.Path(cfg.run_dir)
        self._stop = threading.Event()
        self.backend = None
        self.step_hooks: list[Callable[["GRPOTrainer", dict], None]] = []  # after each step, with its record
        # evaluation (asyncres_jax.evaluate.attach): the base model before the first step, then after steps
        self.before_run_hooks: list[Callable[["GRPOTrainer"], None]] = []
        self.drained_hooks: list[Callable[["GRPOTrainer"], None]] = []
        self.total_updates = cfg.grpo.steps
        # Everything that can be wrong with the input fails here, before the run directory is touched.
        dataset = common.ensure_tasks(cfg)
        self.tasks = filter_tasks(load_split(dataset, cfg.tasks.train_split), cfg.tasks.families,
                                  cfg.tasks.difficulties)
        if not self.tasks:
            raise UserError(f"{dataset}/splits/{cfg.tasks.train_split}.txt lists no tasks")
        self.dataset = dataset
        self.model = common.load_policy_model(cfg.model.name, cfg.model.dtype, make_mesh(cfg.mesh, devices))
        self.mesh = self.model.mesh
        continuing = common.prepare_run_dir(cfg, resume, overwrite)

        self.learner = Learner(self.model.params, self.model.config, hyper(cfg), mesh=self.mesh)
        self.model.params = None  # the learner holds the masters and the reference
        self.step = 0
        self.checkpointer = Checkpointer(self.run_dir / common.CHECKPOINTS, cfg.checkpoint.keep, report=common.log)
        self.elapsed0, self.ckpt_step, metrics_step = 0.0, 0, 0
        restored = self._restore() if continuing else None
        if restored is not None:
            metrics_step = restored
        elif resume:
            raise UserError(f"--resume: {self.run_dir} has no readable checkpoint; drop --resume to start over")
        self.metrics = metrics.MetricsWriter(self.run_dir, metrics_step, total=cfg.grpo.steps, initial=self.step,
                                             label="GRPO steps", unit="step")
        common.write_manifest(self.run_dir, cfg, self.mesh, argv, self.step if continuing else None)

        self.episode_cfg = EpisodeConfig.from_sections(cfg.episode, cfg.sandbox)
        self.engine = Engine(Model(self.model.config, None, self.model.tokenizer, self.mesh, self.model.source),
                             context_limit=self.episode_cfg.context_limit)
        self.backend = backend if backend is not None else common.make_backend(cfg)

    # -- rollouts --------------------------------------------------------------------------------------

    def rollout_params(self):
        dtype = jnp.dtype(self.cfg.model.rollout_dtype)
        params = self.learner.params
        return params if dtype == jnp.float32 else jax.tree.map(lambda x: x.astype(dtype), params)

    def play(self, tasks, seed: int):
        """One batch of episodes with the current policy: (results, each episode's training segments)."""
        from asyncres_jax.rollout.episodes import ModelPolicy, run_episodes

        policy = RecordingPolicy(ModelPolicy.from_config(self.engine, self.rollout_params(), self.episode_cfg))
        results = run_episodes(policy, tasks, self.backend, self.episode_cfg, seed=seed)
        segments = policy.segments()
        for i, r in enumerate(results):  # a policy that wrote nothing leaves no snapshot; keep the final state
            if not segments[i] and r.tokens is not None:
                segments[i] = [whole_conversation(r.tokens.ids, r.tokens.generated_mask, r.tokens.logprobs)]
        return results, segments

    def score(self, r) -> float:
        return r.partial if self.cfg.episode.fitness == "partial" else r.reward

    @property
    def store(self):
        """What evaluation reads (asyncres_jax.evaluate.attach): the step reached as `version`, the learner's
        float32 parameters as `params` (the ES trainer's parameter store has the same two fields)."""
        return types.SimpleNamespace(version=self.step, params=self.learner.params)

    # -- checkpoints -----------------------------------------------------------------------------------

    def _arrays(self) -> dict:
        return {**flatten(self.learner.params, "params"), **flatten(self.learner.opt_state, "opt")}

    def _layout(self) -> str:
        from asyncres_jax import es

        return es.layout_fingerprint(self.learner.params)

    def save_checkpoint(self) -> None:
        meta = {
            "algo": "grpo", "version": self.step, "step": self.step, "optimizer_steps": self.learner.steps,
            "metrics_step": self.metrics.step, "elapsed_seconds": self.elapsed(),
            "data_cursor": self.step * self.cfg.grpo.prompts_per_step,
            "rng": {"global_seed": self.cfg.seed, "counter": self.step},
            "config_fingerprint": self.common.fingerprint(self.cfg), "layout": self._layout(),
            "saved": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        }
        self.ckpt_step += 1
        self.checkpointer.save(self.ckpt_step, self._arrays(), meta)
        self.common.log(f"checkpoint {self.ckpt_step} at GRPO step {self.step}")

    def _restore(self) -> int | None:
        check = self.checkpointer.same_run(self.common.fingerprint(self.cfg), self._layout(), self.cfg.model.name)
        restored = self.checkpointer.restore_latest(self._arrays(), check)
        if restored is None:
            return None
        meta, arrays = restored.meta, restored.arrays
        self.learner.params = unflatten_like(self.learner.params, arrays, "params")
        self.learner.opt_state = self.learner.place_state(unflatten_like(self.learner.opt_state, arrays, "opt"))
        self.learner.steps = int(meta["optimizer_steps"])
        self.step, self.ckpt_step, self.elapsed0 = int(meta["step"]), restored.step, float(meta["elapsed_seconds"])
        self.common.log(f"resuming {self.run_dir} at GRPO step {self.step} (checkpoint {restored.step})")
        return int(meta["metrics_step"])

    # -- the loop --------------------------------------------------------------------------------------

    def elapsed(self) -> float:
        return self.elapsed0 + (time.monotonic() - self._t0 if hasattr(self, "_t0") else 0.0)

    def request_stop(self) -> None:
        """Finish the current step, checkpoint and return from run() (what the first SIGINT/SIGTERM does)."""
        self._stop.set()

    def train_step(self) -> dict[str, Any]:
        from asyncres_jax.jobs import task_batch

        cfg, g = self.cfg, self.cfg.grpo
        t0 = time.monotonic()
        tasks = task_batch(self.tasks, cfg.seed, self.step, g.prompts_per_step)
        results, segments = self.play([t for t in tasks for _ in range(g.group_size)],
                                      sampling_seed(cfg.seed, self.step))
        rewards = np.asarray([self.score(r) for r in results], np.float32)
        rewards, start_errors = _without_start_errors(rewards, results, g.group_size)
        t1 = time.monotonic()
        batch = build_batch(segments, rewards.reshape(g.prompts_per_step, g.group_size), g.max_segment_tokens)
        stats = self.learner.train(batch, seed=sampling_seed(cfg.seed, self.step)) if batch.segments else {}
        self.step += 1
        groups = rewards.reshape(g.prompts_per_step, g.group_size)
        record = {
            "update": self.step,
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
            "success_rate": float(np.mean([r.reward for r in results])),
            "groups_with_signal": int(np.sum(groups.max(1) > groups.min(1))),
            "episodes": len(results), "start_errors": start_errors,
            "segments": len(batch.segments), "segments_skipped": batch.skipped,
            "tokens": int(sum(int(s.loss_mask.sum()) for s in batch.segments)),
            "turns": int(sum(r.turns for r in results)), "timeouts": int(sum(r.timed_out for r in results)),
            "rollout_seconds": t1 - t0, "train_seconds": time.monotonic() - t1,
            "elapsed_seconds": self.elapsed(), **stats,
        }
        return record

    def run(self) -> int:
        """Train until grpo.steps (or a stop request). Returns the step reached."""
        cfg = self.cfg
        self._t0 = time.monotonic()
        if self.step >= cfg.grpo.steps:
            self.common.log(f"{self.run_dir} already holds {self.step} GRPO steps (grpo.steps={cfg.grpo.steps})")
            return self.step
        self.common.log(f"GRPO on {self.model.source} over mesh {self.mesh.shape['data']}x{self.mesh.shape['model']}:"
                        f" step {self.step} -> {cfg.grpo.steps}, {cfg.grpo.prompts_per_step} tasks x "
                        f"{cfg.grpo.group_size} episodes")
        saved = self.step
        for hook in self.before_run_hooks:
            hook(self)
        while self.step < cfg.grpo.steps and not self._stop.is_set():
            record = self.train_step()
            self.metrics.write(record)
            for hook in self.step_hooks:
                hook(self, record)
            if not self._stop.is_set():  # a stop request ends the session quickly: no evaluation now
                for hook in self.drained_hooks:
                    hook(self)
            self.common.log(f"step {self.step}/{cfg.grpo.steps}: reward {record['reward_mean']:.3f}, "
                            f"kl {record.get('kl', 0):.4f}, clip {record.get('clip_fraction', 0):.3f}, "
                            f"{record['rollout_seconds']:.1f} s rollout + {record['train_seconds']:.1f} s train")
            if self.step % cfg.checkpoint.every == 0 or self.step == cfg.grpo.steps:
                self.save_checkpoint()
                saved = self.step
        if self.step != saved:
            self.save_checkpoint()
        if self._stop.is_set():
            self.common.log(f"stopped at GRPO step {self.step}; resume with the same command")
        return self.step

    def close(self) -> None:
        """Remove every sandbox and close the writers (idempotent)."""
        try:
            if self.backend is not None:
                self.backend.close()
                self.backend = None
        finally:
            self.metrics.close()
            self.checkpointer.close()
            self.common.release_run_dir(self.run_dir)


def train(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, handle_signals: bool = False,
          argv: list[str] | None = None, devices=None) -> int:
    """The `algo: grpo` entry point of the training program (same arguments as trainer.train)."""
    from asyncres_jax.evaluate import attach
    from asyncres_jax.trainer import run_to_end

    trainer = GRPOTrainer(cfg, resume=resume, overwrite=overwrite, argv=argv, devices=devices)
    try:
        attach(trainer)  # the same held-out evaluation as ES: base, every eval.every steps, test at the end
        run_to_end(trainer, handle_signals)
    finally:
        trainer.close()
    return 0

