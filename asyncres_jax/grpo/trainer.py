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

import time
import types
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from asyncres_jax import hostmem
from asyncres_jax.checkpoint import flatten, unflatten_like
from asyncres_jax.config import TrainConfig
from asyncres_jax.errors import UserError
from asyncres_jax.grpo.data import build_batch, whole_conversation
from asyncres_jax.grpo.rollout import RecordingPolicy
from asyncres_jax.grpo.step import GRPOHyper, Learner
from asyncres_jax.mesh import make_mesh
from asyncres_jax.model import Model
from asyncres_jax.model.generate import Engine
from asyncres_jax.rollout.episodes import EpisodeConfig, ModelPolicy, run_episodes
from asyncres_jax.rollout.jobs import task_batch
from asyncres_jax.run import (Trainer, ensure_tasks, load_policy_model, log, make_backend, prepare_run_dir,
                              run_to_end, train_tasks)

STEP_TAG = 0x6772706F  # "grpo": keeps GRPO sampling seeds apart from any other use of (seed, step)


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


class GRPOTrainer(Trainer):
    unit = "GRPO step"

    def __init__(self, cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, devices=None,
                 argv: list[str] | None = None, backend=None):
        check_supported(cfg)
        super().__init__(cfg, cfg.grpo.steps)
        self.step_hooks: list[Callable[["GRPOTrainer", dict], None]] = []  # after each step, with its record
        # Everything that can be wrong with the input fails here, before the run directory is touched.
        self.dataset = ensure_tasks(cfg)
        self.tasks = train_tasks(cfg, self.dataset)
        self.model = load_policy_model(cfg.model.name, cfg.model.dtype, make_mesh(cfg.mesh, devices))
        self.mesh = self.model.mesh
        continuing = prepare_run_dir(cfg, resume, overwrite)

        self.learner = Learner(self.model.params, self.model.config, GRPOHyper.from_config(cfg), mesh=self.mesh)
        self.model.params = None  # the learner holds the masters and the reference
        self.step = 0
        self._open_records(continuing=continuing, resume=resume, argv=argv, label="GRPO steps", unit="step")

        self.episode_cfg = EpisodeConfig.from_sections(cfg.episode, cfg.sandbox)
        self.engine = Engine(Model(self.model.config, None, self.model.tokenizer, self.mesh, self.model.source),
                             context_limit=self.episode_cfg.context_limit)
        self.backend = backend if backend is not None else make_backend(cfg)

    @property
    def version(self) -> int:
        return self.step

    # -- rollouts --------------------------------------------------------------------------------------

    def rollout_params(self):
        dtype = jnp.dtype(self.cfg.model.rollout_dtype)
        params = self.learner.params
        return params if dtype == jnp.float32 else jax.tree.map(lambda x: x.astype(dtype), params)

    def play(self, tasks, seed: int):
        """One batch of episodes with the current policy: (results, each episode's training segments)."""
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

    def _params(self):
        return self.learner.params

    def _arrays(self) -> dict:
        return {**flatten(self.learner.params, "params"), **flatten(self.learner.opt_state, "opt")}

    def _checkpoint_meta(self) -> dict:
        return {"algo": "grpo", "version": self.step, "step": self.step, "optimizer_steps": self.learner.steps,
                "data_cursor": self.step * self.cfg.grpo.prompts_per_step}

    def _load_checkpoint(self, meta: dict, arrays: dict) -> None:
        self.learner.params = unflatten_like(self.learner.params, arrays, "params")
        self.learner.opt_state = self.learner.place_state(unflatten_like(self.learner.opt_state, arrays, "opt"))
        self.learner.steps = int(meta["optimizer_steps"])
        self.step = int(meta["step"])

    # -- the loop --------------------------------------------------------------------------------------

    def train_step(self) -> dict[str, Any]:
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
            log(f"{self.run_dir} already holds {self.step} GRPO steps (grpo.steps={cfg.grpo.steps})")
            for hook in self.drained_hooks:  # the final evaluations, if a stop request came before them
                hook(self)
            return self.step
        log(f"GRPO on {self.model.source} over mesh {self.mesh.shape['data']}x{self.mesh.shape['model']}:"
            f" step {self.step} -> {cfg.grpo.steps}, {cfg.grpo.prompts_per_step} tasks x "
            f"{cfg.grpo.group_size} episodes")
        saved = self.step
        for hook in self.before_run_hooks:
            hook(self)
        while self.step < cfg.grpo.steps and not self._stop.is_set():
            record = self.train_step()
            hostmem.release_free_memory()  # the step's rollouts and backward passes freed their buffers
            self.metrics.write(record)
            for hook in self.step_hooks:
                hook(self, record)
            if not self._stop.is_set():  # a stop request ends the session quickly: no evaluation now
                for hook in self.drained_hooks:
                    hook(self)
            log(f"step {self.step}/{cfg.grpo.steps}: reward {record['reward_mean']:.3f}, "
                f"kl {record.get('kl', 0):.4f}, clip {record.get('clip_fraction', 0):.3f}, "
                f"{record['rollout_seconds']:.1f} s rollout + {record['train_seconds']:.1f} s train")
            if self.step % cfg.checkpoint.every == 0 or self.step == cfg.grpo.steps:
                self.save_checkpoint()
                saved = self.step
        if self.step != saved:
            self.save_checkpoint()
        if self._stop.is_set():
            log(f"stopped at GRPO step {self.step}; resume with the same command")
        return self.step


def train(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, handle_signals: bool = False,
          argv: list[str] | None = None, devices=None) -> int:
    """The `algo: grpo` entry point of the training program (same arguments as trainer.train)."""
    from asyncres_jax.evaluate import attach

    trainer = GRPOTrainer(cfg, resume=resume, overwrite=overwrite, argv=argv, devices=devices)
    try:
        attach(trainer)  # the same held-out evaluation as ES: base, every eval.every steps, test at the end
        run_to_end(trainer, handle_signals)
    finally:
        trainer.close()
    return 0

