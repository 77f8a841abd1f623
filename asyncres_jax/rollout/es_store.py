"""A ParamStore wired to asyncres_jax.es (kept apart so store.py and its tests never import the ES code)."""

from __future__ import annotations

from asyncres_jax.errors import UserError
from asyncres_jax.rollout.store import ParamStore


def es_param_store(params, cfg, *, max_replay: int = 4, version: int = 0) -> ParamStore:
    """Float32 master `params` updated by es.apply_logged_update with ES config `cfg`.

    With the paper's SGD rule the optimiser state never changes (optax.sgd has none; the weight-decay anchor
    is the initial parameters), so workers may replay logged (seeds, shaped fitness) updates bit-identically.
    With Adam they copy the master parameters instead.
    """
    from asyncres_jax import es

    if cfg.antithetic:
        raise UserError("the rollout pool cannot keep antithetic pairs in one cohort; use antithetic=False")
    store: ParamStore

    def replay(p, seeds, shaped):
        return es.apply_logged_update(p, store.opt_state, seeds, shaped, cfg)[0]

    store = ParamStore(
        params,
        es.init(params, cfg),
        apply_update=lambda p, o, seeds, shaped: es.apply_logged_update(p, o, seeds, shaped, cfg),
        shape=lambda fitness: es.shape_fitness(fitness, cfg),
        replay=replay if cfg.optimizer == "sgd" else None,
        max_replay=max_replay,
        version=version,
    )
    return store
