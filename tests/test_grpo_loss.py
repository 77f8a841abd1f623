"""The GRPO objective against a NumPy reference; masking, KL and segment rules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from asyncres_jax.grpo.data import Snapshot, build_batch, pack, segments_from_snapshots, whole_conversation
from asyncres_jax.grpo.loss import (
    group_advantages,
    grpo_loss,
    k3_kl,
    sequence_weights,
    token_logprobs,
    tokens_per_episode,
)


def np_advantages(r_pg):
    r = np.asarray(r_pg, np.float64)
    out = np.zeros_like(r)
    for p in range(r.shape[0]):
        if r[p].max() > r[p].min():
            out[p] = (r[p] - r[p].mean()) / (r[p].std() + 1e-8)
    return out


def np_loss(logp, old, ref, adv, mask, eps, beta):
    """Token mean within each sequence, then mean over sequences, of the clipped surrogate plus beta * k3."""
    per_seq = []
    for b in range(logp.shape[0]):
        m = mask[b]
        ratio = np.exp(logp[b, m] - old[b, m])
        pg = -np.minimum(ratio * adv[b], np.clip(ratio, 1 - eps, 1 + eps) * adv[b])
        d = ref[b, m] - logp[b, m]
        kl = np.exp(d) - d - 1
        per_seq.append(np.mean(pg + beta * kl))
    return np.mean(per_seq)


def test_group_advantages_match_numpy_and_flat_groups_are_zero():
    r = np.array([[1, 0, 0, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1], [0.2, 0.9, 0.4, 0.4, 0.0, 1.0, 0.3, 0.7]])
    adv = group_advantages(r)
    np.testing.assert_allclose(adv, np_advantages(r), rtol=1e-6, atol=1e-6)
    assert np.all(adv[1] == 0)
    np.testing.assert_allclose(adv.mean(axis=1), 0, atol=1e-6)
    np.testing.assert_allclose(adv[[0, 2]].std(axis=1), 1, atol=1e-5)


def test_clipped_loss_matches_numpy_reference():
    rng = np.random.default_rng(0)
    B, T = 5, 12
    old = np.log(rng.uniform(0.05, 1, (B, T))).astype(np.float32)
    logp = (old + rng.normal(0, 0.4, (B, T))).astype(np.float32)  # ratios well outside [0.8, 1.2] too
    ref = (old + rng.normal(0, 0.3, (B, T))).astype(np.float32)
    adv = rng.normal(0, 1, B).astype(np.float32)
    mask = rng.uniform(size=(B, T)) < 0.6
    mask[:, 0] = True
    episode = np.arange(B)
    w = sequence_weights(mask, episode, tokens_per_episode(mask, episode), B)
    loss, aux = grpo_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(ref), jnp.asarray(adv), jnp.asarray(w),
                          clip_eps=0.2, kl_coef=1e-3)
    np.testing.assert_allclose(float(loss), np_loss(logp, old, ref, adv, mask, 0.2, 1e-3), rtol=1e-5)
    assert 0 < float(aux["clip_fraction"]) < 1
    np.testing.assert_allclose(float(aux["pg_loss"]) + 1e-3 * float(aux["kl"]), float(loss), rtol=1e-5)


def test_rows_of_one_episode_share_its_token_mean():
    """Two segments of one episode weigh like one sequence holding both: each token 1 / (tokens of episode * E)."""
    mask = np.array([[1, 1, 0, 0], [0, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]], bool)
    episode = np.array([0, 0, 1, -1])
    w = sequence_weights(mask, episode, tokens_per_episode(mask[:3], episode[:3]), 2)
    np.testing.assert_allclose(w[0], [0.1, 0.1, 0, 0])
    np.testing.assert_allclose(w[1], [0, 0.1, 0.1, 0.1])
    np.testing.assert_allclose(w[2], [0.5, 0, 0, 0])
    assert w.sum() == np.float32(1.0) and not w[3].any()


def test_gradient_is_zero_on_observation_and_padding_tokens():
    rng = np.random.default_rng(1)
    B, T, V = 3, 10, 17
    logits = jnp.asarray(rng.normal(0, 2, (B, T, V)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    generated = rng.uniform(size=(B, T)) < 0.5
    generated[:, 2] = True
    episode = np.arange(B)
    w = jnp.asarray(sequence_weights(generated, episode, tokens_per_episode(generated, episode), B))
    # Observation positions hold garbage old/ref values (the engine records 0; pads may be anything).
    old = jnp.where(generated, jnp.log(0.3), 1e4)
    ref = jnp.where(generated, jnp.log(0.2), -1e4)
    adv = jnp.asarray([1.0, -0.5, 2.0])

    def loss_of(logits_btv):
        logp = token_logprobs(logits_btv, targets, 0.6)
        return grpo_loss(logp, old, ref, adv, w, clip_eps=0.2, kl_coef=1e-3)[0]

    loss, g = jax.value_and_grad(loss_of)(logits)
    g = np.asarray(g)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(g))
    assert np.all(g[~generated] == 0.0)
    assert np.all(np.abs(g[generated]).sum(-1) > 0)


def test_token_logprobs_use_the_sampling_temperature():
    logits = jnp.asarray([[[2.0, 0.0, -1.0]]])
    target = jnp.asarray([[1]])
    for t in (0.6, 1.0):
        expect = np.log(np.exp(np.array([2.0, 0, -1]) / t) / np.exp(np.array([2.0, 0, -1]) / t).sum())[1]
        np.testing.assert_allclose(float(token_logprobs(logits, target, t)[0, 0]), expect, rtol=1e-6)


def test_k3_is_zero_at_the_reference_and_positive_elsewhere():
    ref = jnp.log(jnp.asarray([0.1, 0.5, 0.9]))
    np.testing.assert_array_equal(np.asarray(k3_kl(ref, ref)), 0.0)
    for delta in (-1.0, -0.1, 0.05, 2.0):
        assert np.all(np.asarray(k3_kl(ref + delta, ref)) > 0)
    # k3 is unbiased: E_p[k3] = KL(p || q) for token samples from p (exact expectation over a small vocab)
    p, q = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.5, 0.3])
    k3 = np.asarray(k3_kl(jnp.log(p), jnp.log(q)))
    np.testing.assert_allclose((p * k3).sum(), (p * np.log(p / q)).sum(), rtol=1e-5)


def snap(ids, gen):
    ids, gen = np.asarray(ids, np.int32), np.asarray(gen, bool)
    return Snapshot(ids, gen, np.where(gen, -0.5, 0.0).astype(np.float32))


def test_a_growing_conversation_is_one_segment_and_a_dropped_history_splits_it():
    p, r1, o1, r2, o2, r3 = [1, 2], [3, 4], [5], [6, 7], [8], [9]
    s1 = snap(p + r1, [0, 0, 1, 1])
    s2 = snap(p + r1 + o1 + r2, [0, 0, 1, 1, 0, 1, 1])
    # turn 3: the rolling context dropped (r1, o1), so reply 3 was written without them
    s3 = snap(p + r2 + o2 + r3, [0, 0, 1, 1, 0, 1])
    whole = segments_from_snapshots([s1, s2])
    assert len(whole) == 1 and np.array_equal(whole[0].loss_mask, s2.generated)
    split = segments_from_snapshots([s1, s2, s3])
    assert len(split) == 2
    assert np.array_equal(split[0].ids, s2.ids) and np.array_equal(split[0].loss_mask, s2.generated)
    # r2 was already trained in its own context: only r3 counts in the second segment
    assert np.array_equal(split[1].loss_mask, [0, 0, 0, 0, 0, 1])


def test_segments_over_the_token_limit_leave_the_loss_but_not_the_group():
    short = whole_conversation([1, 2, 3], [0, 1, 1], [0, -0.1, -0.2])
    long = whole_conversation(list(range(1, 9)), [0] * 6 + [1, 1], [0] * 6 + [-0.1, -0.2])
    rewards = np.array([[1.0, 0.0]])
    full = build_batch([[short], [long]], rewards)
    capped = build_batch([[short], [long]], rewards, max_tokens=4)
    assert len(full.segments) == 2 and full.skipped == 0
    assert capped.segments == [short] and capped.episode.tolist() == [0] and capped.skipped == 1
    np.testing.assert_array_equal(capped.advantage, full.advantage)  # the long episode still counts in its group
    assert capped.advantage[0] > 0 > capped.advantage[1]


def test_pack_shifts_targets_and_pads_on_the_right():
    seg = whole_conversation([5, 6, 7, 8], [0, 0, 1, 1], [0, 0, -0.1, -0.2])
    rows = pack([seg], [3], rows=2)
    assert rows.tokens_bt.shape == (2, 16)
    assert rows.tokens_bt[0, :4].tolist() == [5, 6, 7, 8] and not rows.tokens_bt[0, 4:].any()
    assert rows.mask_bt[0, :3].tolist() == [False, True, True] and not rows.mask_bt[0, 3:].any()
    np.testing.assert_allclose(rows.old_logp_bt[0, :3], [0, -0.1, -0.2])
    assert rows.episode_b.tolist() == [3, -1] and not rows.mask_bt[1].any()


def test_an_episode_that_never_started_gets_its_groups_mean_not_a_zero():
    import types

    from asyncres_jax.grpo.trainer import _without_start_errors

    results = [types.SimpleNamespace(error=e) for e in (None, "no image", None, None, "no image", "no image")]
    rewards = np.asarray([1.0, 0.0, 0.0, 0.0, 0.0, 0.0], np.float32)
    fixed, n = _without_start_errors(rewards, results, group_size=3)
    assert n == 3 and fixed.tolist() == [1.0, 0.5, 0.0, 0.0, 0.0, 0.0]
    assert _without_start_errors(rewards, [types.SimpleNamespace(error=None)] * 6, 3)[1] == 0
