"""ES pool jobs: what one member's evaluation is. A job function is `job_fn(job, params) -> JobResult`.

- `episode_job_fn`: the real one. Perturb the replica's weights with the member's seed, play the version's
  task batch as multi-turn episodes (one batched generation per turn, commands in sandboxes), fitness = mean
  reward (binary) or mean fraction of tests passed (partial).
- `fake_job_fn` (tasks.dataset = "fake"): a deterministic stand-in for tests and for timing the learner. The
  fitness is the mean log-probability the perturbed model gives fixed token sequences (drawn from the
  version's sampling seed), a smooth function of the parameters that ES can climb. No sandboxes.

Task batches walk a per-epoch permutation of the train split: the batch of version v is the v-th slice of
`tasks_per_member` tasks, so every member of a cohort sees the same tasks (common random numbers) and the data
cursor is a function of the version alone.
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

from asyncres_jax import es
from asyncres_jax.model import decoder
from asyncres_jax.model.config import ModelConfig
from asyncres_jax.rollout.coordinator import Job, JobResult

FAKE = "fake"
FAKE_SEQUENCES, FAKE_LENGTH = 4, 16


def member_sign(job: Job, cfg: es.ESConfig) -> int:
    """Antithetic members come in pairs sharing a seed: member 2k is +eps, member 2k+1 is -eps."""
    return -1 if cfg.antithetic and job.member_index % 2 else 1


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
        perturbed = es.perturb(params, job.member_seed, es_cfg, sign=member_sign(job, es_cfg))
        tokens = fake_tokens(job.sampling_seed, model_cfg.vocab_size)
        mesh = _replica_mesh(params)
        tokens = jax.device_put(tokens, NamedSharding(mesh, P()) if mesh is not None else None)
        fitness = float(_mean_logprob(perturbed, tokens, cfg=model_cfg))
        return JobResult(fitness, {"episodes": FAKE_SEQUENCES, "tokens": int(tokens.size),
                                   "seconds": time.monotonic() - t})
    return job_fn


# ------------------------------------------------------------------------------------------- real episodes


def episode_job_fn(model, tasks: Sequence[Any], backend, episode_cfg, es_cfg: es.ESConfig, *, global_seed: int,
                   tasks_per_member: int, fitness: str = "binary",
                   policy_factory: Callable[..., Any] | None = None) -> Callable[[Job, Any], JobResult]:
    """Members play `tasks_per_member` episodes of the version's batch; fitness = mean reward or partial credit.

    Each replica gets its own generation engine, placed on the replica's sub-mesh (found from the params).
    policy_factory(engine, params, episode_cfg) -> Policy; default: rollout.episodes.ModelPolicy.from_config.
    """
    from asyncres_jax.rollout.episodes import COUNTS, PHASES, ModelPolicy, format_transcript, run_episodes

    policy_factory = policy_factory or ModelPolicy.from_config
    engine_for = engines_per_mesh(model, episode_cfg.context_limit)

    def job_fn(job: Job, params) -> JobResult:
        t, work = time.monotonic(), dict.fromkeys(PHASES, 0.0)
        perturbed = es.perturb(params, job.member_seed, es_cfg, sign=member_sign(job, es_cfg))
        batch = task_batch(tasks, global_seed, job.dispatch_version, tasks_per_member)
        policy = policy_factory(engine_for(params), perturbed, episode_cfg)
        results = run_episodes(policy, batch, backend, episode_cfg, seed=job.sampling_seed, work=work)
        seconds = time.monotonic() - t
        work["host"] += max(0.0, seconds - sum(work[k] for k in PHASES))  # the perturbation, the policy's set-up
        scores = [r.partial if fitness == "partial" else r.reward for r in results]
        generated = sum(int(np.sum(r.tokens.generated_mask)) for r in results if r.tokens is not None)
        return JobResult(float(np.mean(scores)), {
            "episodes": len(results),
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
