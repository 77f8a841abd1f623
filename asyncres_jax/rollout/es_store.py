"""The ES learner's ParamStore: float32 masters updated by asyncres_jax.es (kept apart from store.py, whose tests
never import the ES code)."""

from __future__ import annotations

from typing import Any, Callable

from asyncres_jax import es
from asyncres_jax.rollout.jobs import replay_fn
from asyncres_jax.rollout.store import ParamStore


def es_param_store(params, cfg: es.ESConfig, *, rollout_dtype: str = "float32",
                   place_state: Callable[[Any], Any] = lambda s: s, max_replay: int = 4,
                   version: int = 0) -> ParamStore:
    """Master `params` updated by es.apply_logged_update with ES config `cfg`.

    Antithetic pairs share a seed, so an update applies one seed per pair (cohorts must keep pairs in order: the
    sync schedule). Replicas replay logged (seeds, shaped fitness) updates bit-identically where `replay_fn`
    allows it (the paper's SGD on float32 copies); otherwise they copy the master parameters. `place_state`
    puts the optimiser state where the parameters are (e.g. replicated over the learner's mesh).
    """
    return ParamStore(
        params,
        place_state(es.init(params, cfg)),
        apply_update=lambda p, o, seeds, shaped: es.apply_logged_update(p, o, cfg.update_seeds(seeds), shaped, cfg),
        shape=lambda fitness: es.shape_fitness(fitness, cfg),
        shape_grouped=lambda fitness, groups: es.shape_fitness(fitness, cfg, groups),
        replay=replay_fn(cfg, rollout_dtype),
        max_replay=max_replay,
        version=version,
    )
