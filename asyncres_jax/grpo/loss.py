"""The GRPO objective: group-normalised advantages, the PPO-clipped ratio loss and the k3 KL penalty.

Per trained token t of an episode with advantage A (DeepSeekMath's GRPO, as in the paper):

    ratio_t = exp(logp_t - old_logp_t)                      old: the sampling distribution's log-prob
    pg_t    = -min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps) * A)
    k3_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1    >= 0, zero iff logp_t == ref_t
    loss    = sum_t w_t * (pg_t + kl_coef * k3_t)

The weights carry the reduction: w_t = 1 / (tokens trained in the episode * episodes in the minibatch) on the
model's own tokens and 0 elsewhere (prompt, observations, padding) gives "token mean within a sequence, then
mean over sequences". Because the loss is a fixed-weight sum, gradients of micro-batches simply add up.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def group_advantages(rewards_pg, eps: float = 1e-8) -> np.ndarray:
    """[P, G] rewards (P groups of G episodes of one task) -> advantages (r - group mean) / (group std + eps).

    Population std, as in the ES shaping. A group whose rewards are all equal gets exactly zero advantage.
    """
    r_pg = np.asarray(rewards_pg, np.float64)
    if r_pg.ndim != 2:
        raise ValueError(f"rewards must be [groups, group_size], got shape {r_pg.shape}")
    centred_pg = r_pg - r_pg.mean(axis=1, keepdims=True)
    flat_g = (r_pg.max(axis=1) == r_pg.min(axis=1))[:, None]
    adv_pg = np.where(flat_g, 0.0, centred_pg / (r_pg.std(axis=1, keepdims=True) + eps))
    return adv_pg.astype(np.float32)


def tokens_per_episode(loss_masks: Sequence[np.ndarray], episodes: Sequence[int]) -> dict[int, int]:
    """Trained tokens of each episode, summed over its rows (an episode may span several segments)."""
    out: dict[int, int] = {}
    for m, e in zip(loss_masks, episodes):
        out[int(e)] = out.get(int(e), 0) + int(np.sum(m))
    return out


def sequence_weights(loss_mask_bt, episode_b, tokens_of: Mapping[int, int], n_episodes: int) -> np.ndarray:
    """Token weights 1 / (episode's trained tokens * E) on trained tokens, 0 elsewhere (and on padding rows).

    loss_mask_bt: [B, T] bool; episode_b: [B] episode of each row (-1: padding); tokens_of: tokens_per_episode
    over the whole minibatch (not just these rows); n_episodes: E, the episodes in the minibatch.
    """
    mask_bt = np.asarray(loss_mask_bt, bool) & (np.asarray(episode_b) >= 0)[:, None]
    denom_b = np.asarray([max(tokens_of.get(int(e), 0), 1) for e in episode_b], np.float64) * n_episodes
    return (mask_bt / denom_b[:, None]).astype(np.float32)


def token_logprobs(logits_btv: Array, targets_bt: Array, temperature) -> Array:
    """log softmax(logits / temperature)[target]: the sampling distribution's log-prob of each target token."""
    scaled_btv = logits_btv.astype(jnp.float32) / temperature
    picked_bt = jnp.take_along_axis(scaled_btv, targets_bt[..., None], axis=-1)[..., 0]
    return picked_bt - jax.nn.logsumexp(scaled_btv, axis=-1)


def k3_kl(logp_bt: Array, ref_logp_bt: Array) -> Array:
    """Schulman's k3 estimator of KL(current || reference) per sampled token: non-negative, unbiased."""
    d_bt = ref_logp_bt - logp_bt
    return jnp.exp(d_bt) - d_bt - 1.0


def grpo_loss(logp_bt: Array, old_logp_bt: Array, ref_logp_bt: Array, adv_b: Array, weight_bt: Array, *,
              clip_eps: float, kl_coef: float) -> tuple[Array, dict[str, Array]]:
    """The weighted GRPO loss and weighted sums of diagnostics (they add across micro-batches like the loss).

    Tokens with weight 0 contribute nothing, not even NaN: their terms are masked before the sum.
    """
    live_bt = weight_bt > 0
    # Masked tokens may hold arbitrary old/ref values (pads); zero their log-ratio so exp stays finite.
    log_ratio_bt = jnp.where(live_bt, logp_bt - old_logp_bt, 0.0)
    ratio_bt = jnp.exp(log_ratio_bt)
    adv_bt = adv_b[:, None]
    unclipped_bt = ratio_bt * adv_bt
    clipped_bt = jnp.clip(ratio_bt, 1.0 - clip_eps, 1.0 + clip_eps) * adv_bt
    pg_bt = -jnp.minimum(unclipped_bt, clipped_bt)
    kl_bt = k3_kl(jnp.where(live_bt, logp_bt, 0.0), jnp.where(live_bt, ref_logp_bt, 0.0))
    per_token_bt = jnp.where(live_bt, pg_bt + kl_coef * kl_bt, 0.0)
    loss = jnp.sum(weight_bt * per_token_bt)
    w_bt = jnp.where(live_bt, weight_bt, 0.0)
    aux = {
        "pg_loss": jnp.sum(w_bt * pg_bt),
        "kl": jnp.sum(w_bt * kl_bt),
        "clip_fraction": jnp.sum(w_bt * (clipped_bt < unclipped_bt)),  # tokens where the clip was active
        "ratio": jnp.sum(w_bt * ratio_bt),
        "abs_log_ratio": jnp.sum(w_bt * jnp.abs(log_ratio_bt)),
        "tokens": jnp.sum(live_bt.astype(jnp.float32)),
    }
    return loss, aux
