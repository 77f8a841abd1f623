"""The ES step: rebuild each member's noise from its seed, leaf by leaf, and apply an optax update.

    estimate g = -(1/N) * sum_i z_i eps_i        (or / (N sigma) with divide_by_sigma)
    theta     <- theta + optax(g)                (optax minimises, hence the minus sign)
With the default optax.sgd(alpha) this is theta + alpha/N * sum_i z_i eps_i, the paper's rule.

Memory: for each leaf one jitted call scans the members and accumulates sum z_i eps_i in float32 (a large
unsharded leaf's noise is drawn in blocks of rows, bit-identical to the whole draw), so beyond the parameters
(and the optimiser state) only about one leaf's worth of buffers is alive at a time. With
donate=True the old parameter and optimiser-state buffers are reused for the new ones. In lowrank mode a
matrix's sum is one product of the stacked factors, sum_i z_i A_i B_i^T = [z_i A_i]_i [B_i]_i^T, contracted
by noise.outer_sum in a fixed order so that it is bit-identical on every mesh.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from asyncres_jax.errors import UserError
from asyncres_jax.es.config import ESConfig
from asyncres_jax.es.noise import (
    check_seed,
    constrain,
    is_lowrank_leaf,
    leaf_factors,
    leaf_ids,
    leaf_key,
    leaf_noise,
    named_shardings,
    normal_rows,
    outer_sum,
)
from asyncres_jax.es.shaping import check_fitness, shape_fitness


class ESState(NamedTuple):
    opt: Any  # the params' tree with every leaf replaced by that leaf's optax state
    init_params: Any  # float32 copy of the initial parameters when weight_decay > 0 (the decay's anchor), else None


def optimizer(cfg: ESConfig) -> optax.GradientTransformation:
    if cfg.optimizer == "adam":
        return optax.adam(cfg.alpha, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps)
    return optax.sgd(cfg.alpha)


def init(params, cfg: ESConfig) -> ESState:
    """Optimiser state for `params` (float32 master parameters: a bf16 master rounds most ES steps away)."""
    tx = optimizer(cfg)
    opt = jax.tree.map(tx.init, params)
    anchor = jax.tree.map(lambda x: jnp.array(x, jnp.float32, copy=True), params) if cfg.weight_decay > 0 else None
    return ESState(opt=opt, init_params=anchor)


def member_coefficients(shaped_n: np.ndarray, cfg: ESConfig) -> np.ndarray:
    """One coefficient per seed: z_i, or z_2k - z_2k+1 for the antithetic pair (+eps_k, -eps_k)."""
    return shaped_n[0::2] - shaped_n[1::2] if cfg.antithetic else shaped_n


def _check_seeds(seeds, cfg: ESConfig) -> np.ndarray:
    seeds_s = np.asarray(seeds)
    if seeds_s.shape != (cfg.num_seeds,) or not np.issubdtype(seeds_s.dtype, np.integer):
        what = "N/2 seeds (one per antithetic pair)" if cfg.antithetic else "N seeds (one per member)"
        raise UserError(f"got seeds of shape {seeds_s.shape} and dtype {seeds_s.dtype}; pass {what}: "
                        f"{cfg.num_seeds} integers for population={cfg.population}")
    for s in seeds_s.tolist():
        check_seed(s)
    return seeds_s.astype(np.int32)


def leaf_estimate(seeds_s, coeffs_s, leaf_id, shape, cfg: ESConfig, sharding, chunk: int = 2**20) -> jax.Array:
    """sum_s coeffs_s * eps_s of one leaf, float32, members rebuilt from their seeds."""
    if is_lowrank_leaf(shape, cfg):
        f = jax.vmap(lambda s: leaf_factors(leaf_key(s, leaf_id), shape, cfg.rank))(seeds_s)  # a: [S, ..., m, r]
        a_smr = f.a * coeffs_s.reshape((-1,) + (1,) * len(shape))

        def stack(x):  # [S, ..., k, r] -> [..., k, S*r]
            x = jnp.moveaxis(x, 0, -2)
            return x.reshape(*x.shape[:-2], -1)

        return outer_sum(stack(a_smr), stack(f.b), sharding) / np.float32(math.sqrt(cfg.rank))

    def add_member(acc, seed_coeff):
        seed, coeff = seed_coeff
        return add_noise(acc, leaf_key(seed, leaf_id), coeff, cfg, sharding, chunk), None

    acc = constrain(jnp.zeros(shape, jnp.float32), sharding)
    return jax.lax.scan(add_member, acc, (seeds_s, coeffs_s))[0]


def add_noise(acc, key, coeff, cfg: ESConfig, sharding, chunk: int) -> jax.Array:
    """acc + coeff * eps(key), updating a large unsharded leaf in place block by block (see normal_rows).

    Sharded leaves draw whole: each device then only holds its shard's temporaries.
    """
    shape = acc.shape
    size = math.prod(shape)
    if sharding is not None or len(shape) == 0 or size <= chunk or size >= 2**32:
        return acc + coeff * leaf_noise(key, shape, cfg, sharding)
    rows = max(1, chunk // math.prod(shape[1:]))
    blocks, tail = divmod(shape[0], rows)

    def add_block(j, acc):
        row0 = j * rows
        old = jax.lax.dynamic_slice_in_dim(acc, row0, rows)
        return jax.lax.dynamic_update_slice_in_dim(acc, old + coeff * normal_rows(key, shape, row0, rows), row0, 0)

    acc = jax.lax.fori_loop(0, blocks, add_block, acc)
    if tail:
        acc = acc.at[blocks * rows :].add(coeff * normal_rows(key, shape, blocks * rows, tail))
    return acc


def _leaf_step(param, opt_state, anchor, seeds_s, coeffs_s, leaf_id, cfg: ESConfig, sharding, chunk: int):
    est = leaf_estimate(seeds_s, coeffs_s, leaf_id, param.shape, cfg, sharding, chunk)
    scale = cfg.population * (cfg.sigma if cfg.divide_by_sigma else 1.0)
    updates, opt_state = optimizer(cfg).update(est * np.float32(-1.0 / scale), opt_state, param)
    theta = param.astype(jnp.float32)
    new = theta + updates
    if anchor is not None:
        new = new - np.float32(cfg.alpha * cfg.weight_decay) * (theta - anchor)
    return constrain(new.astype(param.dtype), sharding), opt_state


CHUNK = 2**20  # elements of noise drawn at a time in a large unsharded leaf
_step = jax.jit(_leaf_step, static_argnums=(6, 7, 8))
_step_donating = jax.jit(_leaf_step, static_argnums=(6, 7, 8), donate_argnums=(0, 1))


@functools.lru_cache(maxsize=64)
def _state_structure(treedef, shapes_dtypes, cfg: ESConfig):
    shapes = treedef.unflatten([jax.ShapeDtypeStruct(s, d) for s, d in shapes_dtypes])
    return jax.tree.structure(jax.eval_shape(lambda p: init(p, cfg), shapes))


def apply_logged_update(params, opt_state: ESState, seeds, shaped_fitness, cfg: ESConfig, *, donate: bool = False):
    """One ES step from already shaped fitness z [N] (what a replay log stores next to the seeds).

    Deterministic: two copies applying the same (seeds, shaped_fitness) log stay bit-identical, on any mesh.
    donate=True lets XLA reuse the old parameter and optimiser-state buffers (the caller's `params` and
    `opt_state` are then invalid); the default leaves them untouched.
    """
    seeds_s = _check_seeds(seeds, cfg)
    coeffs_s = member_coefficients(check_fitness(shaped_fitness, cfg).astype(np.float32), cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [x for _, x in flat]
    for kp, x in flat:
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise UserError(f"parameter {jax.tree_util.keystr(kp)} has dtype {x.dtype}; "
                            "ES perturbs floating leaves only")
    expected = _state_structure(treedef, tuple((x.shape, x.dtype) for x in leaves), cfg)
    if not isinstance(opt_state, ESState) or jax.tree.structure(opt_state) != expected:
        raise UserError("opt_state does not match the parameters or the ES config; build it with es.init(params, cfg)")
    opt_leaves = treedef.flatten_up_to(opt_state.opt)
    anchors = treedef.flatten_up_to(opt_state.init_params) if cfg.weight_decay > 0 else [None] * len(leaves)
    step = _step_donating if donate else _step
    new_params, new_opt = [], []
    for x, s, anchor, lid, sharding in zip(leaves, opt_leaves, anchors, leaf_ids(params, cfg), named_shardings(leaves)):
        if new_params:  # at most two leaves in flight: independent steps would otherwise run concurrently,
            new_params[-1].block_until_ready()  # each with its own leaf-sized temporaries
        p, s = step(x, s, anchor, seeds_s, coeffs_s, np.uint32(lid), cfg, sharding, CHUNK)
        new_params.append(p)
        new_opt.append(s)
    return treedef.unflatten(new_params), ESState(opt=treedef.unflatten(new_opt), init_params=opt_state.init_params)


def update(params, opt_state: ESState, seeds, fitness, cfg: ESConfig, *, donate: bool = False):
    """One ES step from raw member fitness [N]: shape_fitness, then apply_logged_update.

    `seeds` are the members' seeds (N of them, or N/2 with antithetic pairs; fitness is then in member order
    +k, -k). Log (seeds, es.shape_fitness(fitness, cfg)) to replay this step elsewhere with apply_logged_update.
    """
    return apply_logged_update(params, opt_state, seeds, shape_fitness(fitness, cfg), cfg, donate=donate)
