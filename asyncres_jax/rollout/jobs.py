"""ES pool jobs: what one member's evaluation is. A job function is `job_fn(job, params) -> JobResult`; the
threaded pool and every Ray actor build theirs with `es_job_fn` (or `fake_job_fn`) and replay with `replay_fn`.

- `episode_job_fn`: the real one. Perturb the replica's weights with the member's seed, play the version's
  task batch as multi-turn episodes (one batched generation per turn, commands in sandboxes), fitness = mean
  reward (binary) or mean fraction of tests passed (partial).
- `cohort_job_fn`: low-rank ES with the members a replica's workers hold played as one batch over one copy of
  the weights (rollout/cohort.py).
- `fake_job_fn` (tasks.dataset = "fake"): a deterministic stand-in for tests and for timing the learner. The
  fitness is the mean log-probability the perturbed model gives fixed token sequences (drawn from the
  version's sampling seed), a smooth function of the parameters that ES can climb. No sandboxes.

Task batches walk a per-epoch permutation of the train split: the batch of version v is the v-th slice of
`tasks_per_member` tasks, so every member of a cohort sees the same tasks (common random numbers) and the data
cursor is a function of the version alone. A job plays the batch of its task version (job.task_version: its
dispatch version, or for a held-back job of pool.held_back_tasks=landing, the version of the cohort it lands in).
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from asyncres_jax import es, hostmem
from asyncres_jax.model import decoder
from asyncres_jax.model.config import ModelConfig
from asyncres_jax.rollout.coordinator import Job, JobResult

FAKE = "fake"
FAKE_SEQUENCES, FAKE_LENGTH = 4, 16


def task_batch(tasks: Sequence[Any], global_seed: int, version: int, size: int) -> list[Any]:
    """The tasks of `version`: slice `version` of an endless walk over per-epoch permutations of `tasks`."""
    n = len(tasks)
    start = version * size
    out = []
    for pos in range(start, start + size):
        epoch, i = divmod(pos, n)
        perm = _permutation(n, global_seed, epoch)
        out.append(tasks[perm[i]])
    return out


@functools.lru_cache(maxsize=8)
def _permutation(n: int, global_seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([global_seed, epoch, 0x7A5B]).permutation(n)


def _replica_mesh(params):
    sharding = getattr(jax.tree.leaves(params)[0], "sharding", None)
    return sharding.mesh if isinstance(sharding, NamedSharding) else None


# ------------------------------------------------------------------------------------------- fake environment


@functools.partial(jax.jit, static_argnames="cfg")
def _mean_logprob(params, tokens_bt, *, cfg: ModelConfig):
    positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    logits_btv, _ = decoder.forward(params, cfg, tokens_bt, positions_bt)
    logp_btv = jax.nn.log_softmax(logits_btv[:, :-1], axis=-1)
    target_bt = tokens_bt[:, 1:]
    return jnp.take_along_axis(logp_btv, target_bt[..., None], axis=-1).mean()


def fake_tokens(sampling_seed: int, vocab_size: int) -> np.ndarray:
    return np.random.default_rng(sampling_seed).integers(0, vocab_size, (FAKE_SEQUENCES, FAKE_LENGTH), np.int32)


def fake_job_fn(model_cfg: ModelConfig, es_cfg: es.ESConfig) -> Callable[[Job, Any], JobResult]:
    def job_fn(job: Job, params) -> JobResult:
        t = time.monotonic()
        perturbed = es.perturb(params, job.member_seed, es_cfg, sign=es_cfg.member_sign(job.member_index))
        tokens = fake_tokens(job.sampling_seed, model_cfg.vocab_size)
        mesh = _replica_mesh(params)
        tokens = jax.device_put(tokens, NamedSharding(mesh, P()) if mesh is not None else None)
        fitness = float(_mean_logprob(perturbed, tokens, cfg=model_cfg))
        return JobResult(fitness, {"episodes": FAKE_SEQUENCES, "tokens": int(tokens.size),
                                   "seconds": time.monotonic() - t})
    return job_fn


# ------------------------------------------------------------------------------------------- real episodes


def es_job_fn(model, tasks: Sequence[Any], backend, episode_cfg, es_cfg: es.ESConfig, *, global_seed: int,
              tasks_per_member: int, fitness: str = "binary", batched_population: bool = False,
              max_batch: int = 1, streams: int = 1) -> Callable[[Job, Any], JobResult]:
    """The ES pool's job over real episodes: one member per call, or (batched_population) up to `max_batch` of
    the members a replica's workers hold at once, batched into one cohort (played as `streams` groups at once)."""
    kw = dict(global_seed=global_seed, tasks_per_member=tasks_per_member, fitness=fitness)
    if batched_population:
        return cohort_job_fn(model, tasks, backend, episode_cfg, es_cfg, max_batch=max_batch, streams=streams, **kw)
    return episode_job_fn(model, tasks, backend, episode_cfg, es_cfg, **kw)


def cohort_job_fn(model, tasks: Sequence[Any], backend, episode_cfg, es_cfg: es.ESConfig, *, global_seed: int,
                  tasks_per_member: int, fitness: str = "binary", max_batch: int = 1, streams: int = 1):
    """Low-rank ES with up to `max_batch` members played as one batch over one copy of W (a JobBatcher), split
    into `streams` groups played at once (rollout.cohort.play_cohort)."""
    from asyncres_jax.rollout.cohort import JobBatcher, run_cohort

    engine_for = engines_per_mesh(model, episode_cfg.context_limit)

    def batch_fn(jobs, params):
        batch = task_batch(tasks, global_seed, jobs[0].task_version, tasks_per_member)
        results = run_cohort(engine_for(params), params, jobs, batch, backend, episode_cfg, es_cfg, fitness=fitness,
                             streams=streams)
        hostmem.release_free_memory()  # once per batch, by its lead: the batch's host buffers are free now
        return results
    return JobBatcher(batch_fn, max_batch=max_batch)


def episode_job_fn(model, tasks: Sequence[Any], backend, episode_cfg, es_cfg: es.ESConfig, *, global_seed: int,
                   tasks_per_member: int, fitness: str = "binary",
                   policy_factory: Callable[..., Any] | None = None) -> Callable[[Job, Any], JobResult]:
    """Members play `tasks_per_member` episodes of the version's batch; fitness = mean reward or partial credit.

    Each replica gets its own generation engine, placed on the replica's sub-mesh (found from the params).
    policy_factory(engine, params, episode_cfg) -> Policy; default: rollout.episodes.ModelPolicy.from_config.
    """
    from asyncres_jax.rollout.episodes import (COUNTS, PHASES, ModelPolicy, fitness_of, format_transcript, played,
                                               run_episodes)

    policy_factory = policy_factory or ModelPolicy.from_config
    engine_for = engines_per_mesh(model, episode_cfg.context_limit)

    def job_fn(job: Job, params) -> JobResult:
        t, work = time.monotonic(), dict.fromkeys(PHASES, 0.0)
        perturbed = es.perturb(params, job.member_seed, es_cfg, sign=es_cfg.member_sign(job.member_index))
        batch = task_batch(tasks, global_seed, job.task_version, tasks_per_member)
        policy = policy_factory(engine_for(params), perturbed, episode_cfg)
        results = run_episodes(policy, batch, backend, episode_cfg, seed=job.sampling_seed, work=work)
        seconds = time.monotonic() - t
        hostmem.release_free_memory()  # the episodes' host buffers are free now (see hostmem)
        work["host"] += max(0.0, seconds - sum(work[k] for k in PHASES))  # the perturbation, the policy's set-up
        generated = sum(int(np.sum(r.tokens.generated_mask)) for r in results if r.tokens is not None)
        return JobResult(fitness_of(results, fitness), {
            "episodes": len(results),
            "start_errors": len(results) - len(played(results)),  # not played, left out of the fitness
            "tokens": generated,
            "successes": int(sum(r.reward for r in results)),
            "partial_sum": float(sum(r.partial for r in results)),
            "turns": int(sum(r.turns for r in results)),
            "timeouts": int(sum(r.timed_out for r in results)),
            "seconds": seconds,
            "phases": {k: work[k] for k in PHASES},  # this worker's seconds
            **{k: work.get(k, 0) for k in COUNTS},
            # a sample of what the agent did, for RUN_DIR/transcripts (members 0 and 1 only: they travel in JSON)
            **({"transcript": format_transcript(results[0])} if job.member_index < 2 and results else {}),
        })
    return job_fn


def engines_per_mesh(model, context_limit: int) -> Callable[[Any], Any]:
    """engine_for(params): one generation engine per replica, placed on the sub-mesh the params live on."""
    from asyncres_jax.model import Model
    from asyncres_jax.model.generate import Engine

    engines: dict[Any, Engine] = {}
    lock = threading.Lock()

    def engine_for(params) -> Engine:
        mesh = _replica_mesh(params)
        with lock:
            if mesh not in engines:
                engines[mesh] = Engine(Model(model.config, None, model.tokenizer, mesh, model.source),
                                       context_limit=context_limit)
            return engines[mesh]
    return engine_for


# ------------------------------------------------------------------------------------------- replay


def replay_fn(es_cfg: es.ESConfig, rollout_dtype: str = "float32") -> Callable[[Any, Any, Any], Any] | None:
    """replay(params, seeds, shaped) -> params one update later, or None where only a copy is exact.

    Replaying (seeds, z) on a replica's copy moves N integers instead of the weights. It is exact only for the
    stateless SGD rule without weight decay (whose anchor, the initial weights, a replica does not hold) on
    float32 copies: a bf16 copy would round away most of each ~1e-4 step."""
    if es_cfg.optimizer != "sgd" or es_cfg.weight_decay > 0 or rollout_dtype != "float32":
        return None

    def replay(params, seeds, shaped):
        return es.apply_logged_update(params, es.init(params, es_cfg), es_cfg.update_seeds(seeds), shaped, es_cfg)[0]
    return replay
