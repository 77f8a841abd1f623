"""Token sampling: greedy, temperature, top-k, top-p; reproducible per sequence; log-probs of what was drawn.

Randomness is per sequence and per token: the key of the n-th token a sequence generates is
fold_in(fold_in(key(seed), row_id), n). A sequence's samples therefore do not depend on which other
sequences share its batch, on where it sits in the batch, or on how decoding is chunked.

Drawing uses the inverse CDF with one uniform per row (cheaper on CPU than Gumbel-max, which needs a
uniform per vocabulary entry). The log-prob returned is that of the drawn token under the distribution
it was actually drawn from: softmax(logits / temperature) restricted to the top-k / top-p set and
renormalised. Greedy decoding reports log_softmax(logits) of the argmax (temperature 1, no filter).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from asyncres_jax.errors import UserError

Array = jax.Array


@dataclass(frozen=True)
class Sampling:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 mean no filter."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if not self.temperature >= 0.0:
            raise UserError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise UserError(f"top_k must be a non-negative integer (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def of(cls, sampling: "Sampling | Mapping[str, Any] | None") -> "Sampling":
        """Accept a Sampling, a dict of its fields (unknown keys are an error) or None (greedy)."""
        if sampling is None:
            return cls()
        if isinstance(sampling, cls):
            return sampling
        if isinstance(sampling, Mapping):
            names = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(sampling) - names)
            if unknown:
                raise UserError(f"unknown sampling option(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
            return cls(**sampling)
        raise UserError(f"sampling must be a Sampling or a dict of {{temperature, top_p, top_k}}, got {sampling!r}")

    def static(self, vocab_size: int) -> tuple[bool, int, bool]:
        """The part that selects a program (greedy, top_k, whether top_p filters); the rest stays dynamic."""
        k = 0 if self.greedy or self.top_k >= vocab_size else int(self.top_k)
        return self.greedy, k, (not self.greedy and self.top_p < 1.0)


def seed_key(seed: int) -> Array:
    """A PRNG key from any Python integer (both 32-bit halves count)."""
    seed = int(seed)
    return jax.random.fold_in(jax.random.key(seed & 0xFFFFFFFF), (seed >> 32) & 0xFFFFFFFF)


def row_keys(seed: int, row_ids) -> Array:
    """Per-sequence keys [B] from the conversation seed and each row's stable id."""
    base = seed_key(seed)
    return jax.vmap(lambda r: jax.random.fold_in(base, r))(jnp.asarray(row_ids, jnp.uint32))


def _inverse_cdf(u_b: Array, logp_bn: Array) -> Array:
    """Index drawn from each row's (log-)distribution with one uniform per row; zero-mass entries never win."""
    p_bn = jnp.exp(logp_bn)
    cdf_bn = jnp.cumsum(p_bn, axis=-1)
    t_b = u_b * cdf_bn[:, -1]
    idx_b = jnp.sum(cdf_bn <= t_b[:, None], axis=-1)
    return jnp.minimum(idx_b, logp_bn.shape[-1] - 1)


def _top_p_mask(logp_bn: Array, top_p: Array) -> Array:
    """Keep the smallest prefix of a descending-sorted distribution whose mass reaches top_p (at least one)."""
    p_bn = jnp.exp(logp_bn)
    before_bn = jnp.cumsum(p_bn, axis=-1) - p_bn
    return before_bn < top_p


def sample(logits_bv: Array, keys_b: Array, counters_b: Array, temperature: Array, top_p: Array, *,
           greedy: bool, top_k: int, use_top_p: bool) -> tuple[Array, Array]:
    """Draw one token per row. Returns (tokens [B] int32, log-probs [B] float32).

    keys_b: per-row keys (see row_keys); counters_b: how many tokens each row has drawn so far, folded in
    so every draw gets fresh randomness. greedy/top_k/use_top_p are static (they change the program);
    temperature and top_p are traced scalars.
    """
    logits_bv = logits_bv.astype(jnp.float32)
    if greedy:
        # argmax (its first maximum) from two plain reductions: XLA CPU ran argmax's (value, index) reduction
        # ~2.5x slower, a few % of a decode step at SmolLM2's 49k vocabulary. A NaN row gives the last token.
        V = logits_bv.shape[-1]
        max_b1 = jnp.max(logits_bv, axis=-1, keepdims=True)
        tok_b = jnp.min(jnp.where(logits_bv == max_b1, jnp.arange(V, dtype=jnp.int32), V - 1), axis=-1)
        # log_softmax at the maximum, without materialising it: -log(sum(exp(logits - max)))
        logp_b = -jnp.log(jnp.sum(jnp.exp(logits_bv - max_b1), axis=-1))
        return tok_b, logp_b
    step_keys = jax.vmap(jax.random.fold_in)(keys_b, counters_b.astype(jnp.uint32))
    u_b = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(step_keys)
    scaled_bv = logits_bv / temperature
    if top_k or use_top_p:
        # Work on the candidates in descending order: the top-k, or the whole vocabulary sorted for top-p.
        vals_bn, idx_bn = jax.lax.top_k(scaled_bv, top_k or scaled_bv.shape[-1])
        logp_bn = jax.nn.log_softmax(vals_bn, axis=-1)
        if use_top_p:
            logp_bn = jax.nn.log_softmax(jnp.where(_top_p_mask(logp_bn, top_p), vals_bn, -jnp.inf), axis=-1)
        j_b = _inverse_cdf(u_b, logp_bn)
        tok_b = jnp.take_along_axis(idx_bn, j_b[:, None], axis=-1)[:, 0]
        logp_b = jnp.take_along_axis(logp_bn, j_b[:, None], axis=-1)[:, 0]
        return tok_b.astype(jnp.int32), logp_b
    logp_bv = jax.nn.log_softmax(scaled_bv, axis=-1)
    tok_b = _inverse_cdf(u_b, logp_bv).astype(jnp.int32)
    return tok_b, jnp.take_along_axis(logp_bv, tok_b[:, None], axis=-1)[:, 0]
