"""A whole low-rank ES population in one batch over one copy of the weights (EGGROLL).

With low-rank noise a member's weight matrix is W + s * sigma * A B^T / sqrt(r), so its matmul is

    x W + s * sigma * ((x A) B^T) / sqrt(r)

and rows of one batch can belong to different members while sharing W. `LowRankPopulation` is the decoder's
`perturbation` (model/decoder.py, `Perturbation`): it holds, per weight leaf, the factors of every distinct
noise seed stacked on a leading axis (drawn by es.noise's per-leaf rule, bit for bit es.lowrank_factors,
the factors behind es.perturb in `lowrank` mode), and per batch row which seed and which sign (times sigma)
the row uses. Vectors (norm scales, biases) take their full-rank noise per row.

It lives in es/ because it is the ES noise rule applied inside the forward instead of to the weights; it
imports nothing from the model (the decoder only calls `dense`, `embed` and `vector`).

    pop = LowRankPopulation.create(params, cfg, member_seeds, member_signs, rows_per_member=len(tasks))
    logits, _ = decoder.forward(params, model_cfg, tokens, positions, perturbation=pop)
    pop.take_rows(idx)        # rows leave or are reordered (the generation engine calls this)

Two ways to contract a batch whose rows use different factors (`contraction`, static):
  * "select" (default): project x on every seed's factors at once, x [B, m] @ A [m, S r], zero the columns
    of other seeds (one-hot times sign * sigma), then contract (seed, rank) against B [S r, n]. Two dense
    matmuls whose extra cost is S r / n of the main one; no per-row copy of the factors.
  * "gather": gather each row's factors [B, m, r], [B, n, r] and do batched mat-vecs: B (m + n) r numbers
    copied per matrix per step instead of S (m + n) r read, and B small matmuls instead of two large ones.
    A cohort batch has B = members x tasks > S, so this is the slower one (docs/performance.md); it is
    kept as the straightforward reference the tests and the benchmark compare against.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from asyncres_jax.errors import UserError
from asyncres_jax.es.config import ESConfig
from asyncres_jax.es.noise import (LowRank, check_seed, is_lowrank_leaf, leaf_factors, leaf_ids, leaf_key, leaf_noise,
                                   leaf_paths, shape_of)

Array = jax.Array
CONTRACTIONS = ("select", "gather")


@functools.partial(jax.jit, static_argnames=("shape", "cfg"))
def _draw_group(seed, lids_g, *, shape: tuple[int, ...], cfg: ESConfig):
    """One seed's noise for the G leaves of one shape: es.noise's per-leaf rule, vmapped over the leaf ids."""
    def one(lid):
        key = leaf_key(seed, lid)
        return leaf_factors(key, shape, cfg.rank) if is_lowrank_leaf(shape, cfg) else leaf_noise(key, shape, cfg)
    return jax.vmap(one)(lids_g)


def _stacked_factors(shapes, seeds: Sequence[int], cfg: ESConfig) -> list:
    """Per leaf (flattening order), every seed's noise stacked on a leading seed axis: LowRank(a [S, m, r],
    b [S, n, r]) for matrices, [S, n] for vectors; bit for bit what es.lowrank_factors draws.

    Leaves of one shape (a model's layers) are drawn by one vmapped program (vmap over keys draws what a loop
    would), so a model compiles one small program per distinct shape instead of one holding every leaf's draw
    (SmolLM2's 272 leaves have 6 shapes). Seeds go one at a time, so no program depends on their number, and
    only the parts of cfg the noise depends on reach the compile key.
    """
    noise_cfg = ESConfig(noise="lowrank", rank=cfg.rank)
    leaves = jax.tree.leaves(shapes)
    ids = leaf_ids(shapes, noise_cfg)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault(shape_of(x), []).append(i)
    out: list = [None] * len(leaves)
    for shape, members in groups.items():
        lids_g = np.asarray([ids[i] for i in members], np.uint32)
        drawn = [_draw_group(np.int32(s), lids_g, shape=shape, cfg=noise_cfg) for s in seeds]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *drawn)  # [S, G, ...]
        for g, i in enumerate(members):
            out[i] = jax.tree.map(lambda x: x[:, g], stacked)
    return out


def _place(stacked, param):
    """Put a leaf's stacked factors (or vector noise) next to the parameter: same mesh, matching axes."""
    sharding = getattr(param, "sharding", None)
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (param.ndim - len(sharding.spec))
        mesh = sharding.mesh
        if isinstance(stacked, LowRank):  # a [S, m, r] follows axis 0 of W [m, n], b [S, n, r] axis 1
            return LowRank(jax.device_put(stacked.a, NamedSharding(mesh, P(None, spec[-2], None))),
                           jax.device_put(stacked.b, NamedSharding(mesh, P(None, spec[-1], None))))
        return jax.device_put(stacked, NamedSharding(mesh, P(None, *spec)))
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return jax.device_put(stacked, sharding)
    return stacked


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LowRankPopulation:
    """Per leaf path the stacked noise of S seeds; per batch row its seed index and sign * sigma.

    factors: {leaf path: es.LowRank(a [S, m, r], b [S, n, r])} for matrices, {leaf path: [S, n]} for vectors.
    seed_b:  [B] int32, the row's index into the seed axis.
    scale_b: [B] float32, the row's sign * sigma.
    """

    factors: dict[str, Any]
    seed_b: Array
    scale_b: Array
    rank: int = dataclasses.field(metadata=dict(static=True))
    contraction: str = dataclasses.field(default="select", metadata=dict(static=True))

    # ------------------------------------------------------------------------------------------ building

    @classmethod
    def create(cls, params, cfg: ESConfig, member_seeds: Sequence[int], member_signs: Sequence[int] | None = None,
               *, rows_per_member: int = 1, contraction: str = "select") -> "LowRankPopulation":
        """The population of members (member_seeds[i], member_signs[i]), each on `rows_per_member` consecutive
        rows (member-major: row b is member b // rows_per_member).

        Members sharing a seed (antithetic pairs) share one set of factors. `params` gives shapes, dtypes and
        shardings (arrays, or jax.ShapeDtypeStruct for an unplaced population); factors are cast to each
        leaf's dtype and placed on its mesh, split like the leaf.
        """
        if cfg.noise != "lowrank":
            raise UserError(f"a low-rank population needs ESConfig(noise='lowrank'), got noise={cfg.noise!r}")
        if contraction not in CONTRACTIONS:
            raise UserError(f"contraction={contraction!r} is not one of {', '.join(CONTRACTIONS)}")
        member_seeds = [int(s) for s in member_seeds]
        if not member_seeds:
            raise UserError("a population needs at least one member seed")
        for s in member_seeds:
            check_seed(s)
        signs = [1] * len(member_seeds) if member_signs is None else [int(s) for s in member_signs]
        if len(signs) != len(member_seeds) or any(s not in (1, -1) for s in signs):
            raise UserError(f"member_signs must be one +1/-1 per member seed ({len(member_seeds)}), got {signs}")
        if isinstance(rows_per_member, bool) or not isinstance(rows_per_member, int) or rows_per_member < 1:
            raise UserError(f"rows_per_member={rows_per_member!r} must be an integer >= 1")
        seeds, seed_of_member = np.unique(np.asarray(member_seeds, np.int64), return_inverse=True)
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        flat_noise = _stacked_factors(shapes, seeds, cfg)
        flat_params = jax.tree.leaves(params)
        factors = {}
        for path, param, f in zip(leaf_paths(params), flat_params, flat_noise):
            if isinstance(f, LowRank):  # matmul factors in the activation dtype; vector noise stays float32
                f = LowRank(f.a.astype(param.dtype), f.b.astype(param.dtype))
            factors[path] = _place(f, param)
        rows = np.repeat(np.arange(len(member_seeds)), rows_per_member)
        scale = np.asarray(signs, np.float32)[rows] * np.float32(cfg.sigma)
        return cls(factors, jnp.asarray(seed_of_member[rows], jnp.int32), jnp.asarray(scale), cfg.rank, contraction)

    @property
    def num_rows(self) -> int:
        return int(self.seed_b.shape[0])

    @property
    def num_seeds(self) -> int:
        f = next(iter(self.factors.values()))
        return int((f.a if isinstance(f, LowRank) else f).shape[0])

    def take_rows(self, rows_idx) -> "LowRankPopulation":
        """The population for the batch rows `rows_idx` (in that order; repeats allowed, e.g. padding rows)."""
        rows_idx = np.asarray(rows_idx, np.int32)
        if rows_idx.ndim != 1 or (rows_idx.size and not 0 <= rows_idx.min() <= rows_idx.max() < self.num_rows):
            raise ValueError(f"take_rows: indices {rows_idx.tolist()} out of range for {self.num_rows} rows")
        return dataclasses.replace(self, seed_b=jnp.take(self.seed_b, rows_idx),
                                   scale_b=jnp.take(self.scale_b, rows_idx))

    def row_groups(self) -> np.ndarray:
        """[B] a group id per row: rows with the same seed and sign * sigma run the same weights (the
        generation engine computes a prompt prefix they share once per group)."""
        keys = np.stack([np.asarray(self.seed_b, np.float64), np.asarray(self.scale_b, np.float64)], axis=1)
        return np.unique(keys, axis=0, return_inverse=True)[1].reshape(-1)

    def with_contraction(self, contraction: str) -> "LowRankPopulation":
        if contraction not in CONTRACTIONS:
            raise UserError(f"contraction={contraction!r} is not one of {', '.join(CONTRACTIONS)}")
        return dataclasses.replace(self, contraction=contraction)

    # ------------------------------------------------------------------------------------------ the decoder's hooks

    def _get(self, path: str, kind):
        try:
            f = self.factors[path]
        except KeyError:
            raise KeyError(f"the population has no noise for parameter {path!r}; build it from these params") from None
        if not isinstance(f, kind):
            raise TypeError(f"parameter {path!r}: expected {kind.__name__} noise, got {type(f).__name__}")
        return f

    def _row_scale(self, dtype) -> Array:
        """[B]: sign * sigma / sqrt(r) per row (the 1/sqrt(r) of eps = A B^T / sqrt(r) folded in)."""
        return (self.scale_b / np.float32(math.sqrt(self.rank))).astype(dtype)

    def dense(self, path: str, x_btd: Array, transpose: bool) -> Array:
        """Each row's extra term of x @ W: (x A) B^T * scale, or (x B) A^T * scale for x @ W^T (tied logits)."""
        f = self._get(path, LowRank)
        # in-side factor [S, d, r] contracts with x; out-side factor [S, f, r] spans the output.
        in_sdr, out_sfr = (f.b, f.a) if transpose else (f.a, f.b)
        x_btd = x_btd.astype(in_sdr.dtype)
        scale_b = self._row_scale(x_btd.dtype)
        if self.contraction == "gather":
            xa_btr = jnp.einsum("btd,bdr->btr", x_btd, in_sdr[self.seed_b])
            return jnp.einsum("btr,bfr->btf", xa_btr * scale_b[:, None, None], out_sfr[self.seed_b])
        sel_bs = jax.nn.one_hot(self.seed_b, in_sdr.shape[0], dtype=x_btd.dtype) * scale_b[:, None]
        xa_btsr = jnp.einsum("btd,sdr->btsr", x_btd, in_sdr)
        return jnp.einsum("btsr,sfr->btf", xa_btsr * sel_bs[:, None, :, None], out_sfr)

    def embed(self, path: str, tokens_bt: Array) -> Array:
        """The noise rows of an embedding lookup: eps[tok] = A[tok] B^T / sqrt(r), per row's seed and sign."""
        f = self._get(path, LowRank)
        a_btr = f.a[self.seed_b[:, None], tokens_bt]
        b_bdr = f.b[self.seed_b]
        return jnp.einsum("btr,bdr->btd", a_btr * self._row_scale(a_btr.dtype)[:, None, None], b_bdr)

    def vector(self, path: str, value: Array) -> Array:
        """Per row [B, 1, n]: value + sign * sigma * eps, summed in float32 and rounded once (like es.perturb)."""
        eps_bn = self._get(path, jax.Array)[self.seed_b]
        out_bn = value.astype(jnp.float32)[None, :] + self.scale_b[:, None] * eps_bn
        return out_bn.astype(value.dtype)[:, None, :]

