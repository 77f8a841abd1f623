"""Pure, jitted Evolution Strategies over parameter pytrees; noise lives only as integer seeds.

    from asyncres_jax import es
    cfg = es.ESConfig()                                    # the paper's ES
    state = es.init(params, cfg)
    p_i = es.perturb(params, es.member_seed(g, version, i), cfg, sign=1)
    params, state = es.update(params, state, seeds, fitness, cfg)
    # replay elsewhere, bit-identically: log (seeds, z = es.shape_fitness(fitness, cfg)) and call
    params, state = es.apply_logged_update(params, state, seeds, z, cfg)
"""

from asyncres_jax.es.config import ESConfig
from asyncres_jax.es.noise import (
    LowRank,
    layout_fingerprint,
    leaf_paths,
    lowrank_factors,
    member_seed,
    noise,
    perturb,
    stable_hash,
)
from asyncres_jax.es.shaping import shape_fitness
from asyncres_jax.es.update import ESState, apply_logged_update, init, member_coefficients, update

__all__ = [
    "ESConfig",
    "ESState",
    "LowRank",
    "apply_logged_update",
    "init",
    "layout_fingerprint",
    "leaf_paths",
    "lowrank_factors",
    "member_coefficients",
    "member_seed",
    "noise",
    "perturb",
    "shape_fitness",
    "stable_hash",
    "update",
]
