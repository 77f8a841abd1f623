"""ES noise from integer seeds: never stored, rebuilt bit-identically anywhere.

The rule:
    key of a leaf = fold_in(key(member_seed), stable_hash(leaf_path))
where leaf_path is "/".join of the leaf's dict keys ("layers/3/attn/q_proj/kernel"). Noise is drawn in float32
with the partitionable threefry, so a sharded draw produces the same numbers as an unsharded one.
  - iid:     eps = N(0, 1) of the leaf's shape.
  - shared:  the key hashes the leaf's shape instead of its path, so equal-shaped leaves share one draw
             (mimics the reference code, which reseeds its generator with the same seed for every tensor).
  - lowrank: a leaf [..., m, n] gets A [..., m, r], B [..., n, r] ~ N(0, 1) from split(key) and
             eps = A B^T / sqrt(r) (EGGROLL); leaves with fewer than 2 axes get iid noise.
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

from asyncres_jax.errors import UserError
from asyncres_jax.es.config import ESConfig

# Threefry partitionable: each shard draws its own counters, so noise does not depend on the mesh.
jax.config.update("jax_threefry_partitionable", True)

SEED_LIMIT = 2**31  # seeds are non-negative int32 values: safe for jax.random.key with or without x64


class LowRank(NamedTuple):
    """Factors of one matrix leaf's low-rank noise: eps = a @ b.T / sqrt(r)."""

    a: jax.Array  # [..., m, r]
    b: jax.Array  # [..., n, r]


def stable_hash(text: str) -> int:
    """A 32-bit hash of a string that is the same in every process and Python run (unlike hash())."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")


def member_seed(global_seed: int, version: int, member_index: int) -> int:
    """The noise seed of one member of the cohort at `version`: a 31-bit mix of the three integers."""
    for name, value in (("global_seed", global_seed), ("version", version), ("member_index", member_index)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < 2**63:
            raise UserError(f"member_seed: {name}={value!r} must be a non-negative integer below 2**63")
    digest = hashlib.blake2b(struct.pack("<3Q", global_seed, version, member_index), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_LIMIT


def _key_str(k) -> str:
    for attr in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey / FlattenedIndexKey
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_string(key_path) -> str:
    return "/".join(_key_str(k) for k in key_path)


def leaf_paths(tree) -> list[str]:
    """The path strings of a pytree's leaves, in flattening order."""
    return [path_string(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def shape_of(x) -> tuple[int, ...]:
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def leaf_ids(tree, cfg: ESConfig) -> list[int]:
    """What each leaf's key folds in: the hash of its path (of its shape in `shared` mode)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    if cfg.noise == "shared":
        return [stable_hash("shape:" + "x".join(map(str, shape_of(x)))) for _, x in flat]
    return [stable_hash(path_string(kp)) for kp, _ in flat]


def layout_fingerprint(tree) -> str:
    """A short digest of the leaf layout (paths, shapes, dtypes): a checkpoint's noise is only valid for it."""
    lines = [
        f"{path_string(kp)}:{'x'.join(map(str, shape_of(x)))}:{jnp.dtype(x.dtype).name}"
        for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def check_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < SEED_LIMIT:
        raise UserError(f"seed {seed!r} must be an integer in [0, 2**31); use es.member_seed(...) to make one")


# ---- per-leaf draws (traceable: seed and leaf_id may be tracers) ----


def leaf_key(seed, leaf_id) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed), jnp.asarray(leaf_id, jnp.uint32))


def is_lowrank_leaf(shape: tuple[int, ...], cfg: ESConfig) -> bool:
    return cfg.noise == "lowrank" and len(shape) >= 2


def leaf_factors(key: jax.Array, shape: tuple[int, ...], rank: int) -> LowRank:
    *batch, m, n = shape
    key_a, key_b = jax.random.split(key)
    return LowRank(
        a=jax.random.normal(key_a, (*batch, m, rank), jnp.float32),
        b=jax.random.normal(key_b, (*batch, n, rank), jnp.float32),
    )


def normal_rows(key: jax.Array, shape: tuple[int, ...], row0, rows: int) -> jax.Array:
    """Rows [row0, row0 + rows) of jax.random.normal(key, shape, float32), bit for bit, without drawing the rest.

    The partitionable threefry's bits of element i depend only on (key, i), so a block of rows is threefry of
    its flat indices; the bits -> uniform -> normal steps repeat jax.random.normal's (tests pin the equality).
    XLA on CPU materialises several leaf-sized temporaries for one threefry draw; drawing by blocks keeps the
    update's memory near one leaf. Needs prod(shape) < 2**32 (the high counter word is then 0).
    """
    row_size = math.prod(shape[1:])
    block = (rows, *shape[1:])
    k1, k2 = jax.random.key_data(key)
    lo = jnp.asarray(row0, jnp.uint32) * np.uint32(row_size) + jax.lax.iota(jnp.uint32, rows * row_size)
    bits1, bits2 = threefry2x32_p.bind(k1, k2, jnp.zeros_like(lo), lo)
    float_bits = jax.lax.shift_right_logical(bits1 ^ bits2, np.uint32(32 - 23)) | np.float32(1.0).view(np.uint32)
    floats = jax.lax.bitcast_convert_type(float_bits, jnp.float32) - np.float32(1.0)
    lo_f = np.nextafter(np.float32(-1.0), np.float32(0.0), dtype=np.float32)
    u = jax.lax.max(lo_f, floats * (np.float32(1.0) - lo_f) + lo_f)
    return (np.float32(np.sqrt(2)) * jax.lax.erf_inv(u)).reshape(block)


def constrain(x: jax.Array, sharding) -> jax.Array:
    """Pin x to a parameter's NamedSharding (None: let XLA decide)."""
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def outer_sum(a_mk: jax.Array, b_nk: jax.Array, sharding=None) -> jax.Array:
    """sum_k a[..., m, k] b[..., n, k] (= a @ b^T), as rank-1 terms accumulated in a fixed order.

    A BLAS matmul's summation order depends on the block of the output each device computes, so its result
    changes in the last bit between meshes; this elementwise accumulation is bit-identical on every mesh
    and, on CPU, about as fast as the dot for the small k of low-rank noise.
    """
    acc = constrain(jnp.zeros(a_mk.shape[:-1] + b_nk.shape[-2:-1], jnp.float32), sharding)

    def add_rank1(acc, ab):
        a_m, b_n = ab
        return acc + a_m[..., :, None] * b_n[..., None, :], None

    acc, _ = jax.lax.scan(add_rank1, acc, (jnp.moveaxis(a_mk, -1, 0), jnp.moveaxis(b_nk, -1, 0)))
    return constrain(acc, sharding)


def leaf_noise(key: jax.Array, shape: tuple[int, ...], cfg: ESConfig, sharding=None) -> jax.Array:
    """eps of one leaf, float32."""
    if is_lowrank_leaf(shape, cfg):
        f = leaf_factors(key, shape, cfg.rank)
        return outer_sum(f.a, f.b, sharding) / np.float32(math.sqrt(cfg.rank))
    return constrain(jax.random.normal(key, shape, jnp.float32), sharding)


def named_shardings(leaves) -> tuple:
    """Each leaf's NamedSharding, or None for leaves that are not mesh-sharded jax.Arrays."""
    return tuple(
        x.sharding if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding) else None for x in leaves
    )


# ---- whole trees ----


def _flat(tree, seed, cfg: ESConfig):
    check_seed(seed)
    leaves, treedef = jax.tree.flatten(tree)
    return leaves, treedef, tuple(leaf_ids(tree, cfg)), np.int32(seed)


def _spec(shapes: tuple, ids: tuple, cfg: ESConfig) -> tuple:  # hashable static description
    return tuple(zip(shapes, ids)), cfg


def noise(params, seed: int, cfg: ESConfig):
    """The float32 noise tree eps of one member seed (lowrank: the dense A B^T / sqrt(r))."""
    leaves, treedef, ids, seed32 = _flat(params, seed, cfg)
    out = _noise_jit(seed32, _spec(tuple(shape_of(x) for x in leaves), ids, cfg), named_shardings(leaves))
    return treedef.unflatten(out)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _noise_jit(seed, spec, shardings):
    (leaf_specs, cfg) = spec
    return [
        leaf_noise(leaf_key(seed, lid), shape, cfg, s) for (shape, lid), s in zip(leaf_specs, shardings)
    ]


def perturb(params, seed: int, cfg: ESConfig, sign: float = 1):
    """theta + sign * sigma * eps(seed): pure and jitted; each leaf keeps its dtype and sharding.

    The sum is formed in float32 and rounded once to the leaf's dtype. Antithetic member 2k is
    perturb(params, seeds[k], cfg, +1) and member 2k+1 is perturb(params, seeds[k], cfg, -1).
    """
    leaves, treedef, ids, seed32 = _flat(params, seed, cfg)
    spec = _spec(tuple(shape_of(x) for x in leaves), ids, cfg)
    out = _perturb_jit(leaves, seed32, np.float32(sign * cfg.sigma), spec, named_shardings(leaves))
    return treedef.unflatten(out)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _perturb_jit(leaves, seed, scale, spec, shardings):
    (leaf_specs, cfg) = spec
    out = []
    for x, (shape, lid), s in zip(leaves, leaf_specs, shardings):
        eps = leaf_noise(leaf_key(seed, lid), shape, cfg, s)
        out.append(constrain((x.astype(jnp.float32) + scale * eps).astype(x.dtype), s))
    return out


def lowrank_factors(params_or_shapes, seed, cfg: ESConfig):
    """Low-rank noise of one member, factored: the params' tree with LowRank(a, b) for every leaf of 2+ axes
    and the dense float32 noise for the others (vectors get full-rank noise).

    Exactly the factors behind perturb/update in `lowrank` mode, so a batched forward can compute
    x W + sigma * ((x a) b^T) / sqrt(r) per member. `params_or_shapes` may hold arrays or
    jax.ShapeDtypeStruct; `seed` may be a traced int32 (vmap over a cohort's seeds to stack members).
    Walk the result with jax.tree.map(..., is_leaf=lambda x: isinstance(x, es.LowRank)).
    """
    if cfg.noise != "lowrank":
        raise UserError(f"lowrank_factors needs ESConfig(noise='lowrank'), got noise={cfg.noise!r}")
    if isinstance(seed, (int, np.integer)):
        check_seed(seed)
    leaves, treedef = jax.tree.flatten(params_or_shapes)
    spec = _spec(tuple(shape_of(x) for x in leaves), tuple(leaf_ids(params_or_shapes, cfg)), cfg)
    return treedef.unflatten(_factors_jit(jnp.asarray(seed, jnp.int32), spec))


@functools.partial(jax.jit, static_argnums=(1,))
def _factors_jit(seed, spec) -> list[Any]:
    (leaf_specs, cfg) = spec
    out = []
    for shape, lid in leaf_specs:
        key = leaf_key(seed, lid)
        out.append(leaf_factors(key, shape, cfg.rank) if is_lowrank_leaf(shape, cfg) else leaf_noise(key, shape, cfg))
    return out
