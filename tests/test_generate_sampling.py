"""Sampling: greedy, temperature, top-k, top-p draw from the right distribution, reproducibly, with its log-probs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncres_jax.errors import UserError
from asyncres_jax.model.sampling import Sampling, row_keys, sample

LOGITS = jnp.asarray([[2.0, 1.0, 0.5, -1.0, 0.0, 1.5]], jnp.float32)


def _draw(logits, n, sampling: Sampling, seed=0):
    """n independent draws (one per row of a batch made of copies of logits[0])."""
    greedy, top_k, use_top_p = sampling.static(logits.shape[-1])
    logits_bv = jnp.broadcast_to(logits, (n, logits.shape[-1]))
    keys = row_keys(seed, np.arange(n))
    return sample(logits_bv, keys, jnp.zeros(n, jnp.int32), jnp.float32(max(sampling.temperature, 1e-6)),
                  jnp.float32(sampling.top_p), greedy=greedy, top_k=top_k, use_top_p=use_top_p)


def test_greedy_is_argmax_with_untempered_logprob():
    tok, lp = _draw(LOGITS, 3, Sampling())
    assert np.all(np.asarray(tok) == 0)
    np.testing.assert_allclose(lp, jax.nn.log_softmax(LOGITS[0])[0], rtol=1e-6)


@pytest.mark.parametrize("sampling, support", [
    (Sampling(temperature=0.7), [0, 1, 2, 3, 4, 5]),
    (Sampling(temperature=1.3, top_k=2), [0, 5]),
    (Sampling(temperature=1.0, top_p=0.6), [0, 5]),  # p = .37, .22, .14, ...: the first two reach 0.6
    (Sampling(temperature=1.0, top_k=3, top_p=0.6), [0, 5]),  # top-3 renormalised: .51, .31, .19
])
def test_draws_follow_the_filtered_tempered_distribution(sampling, support):
    n = 20000
    tok, lp = _draw(LOGITS, n, sampling)
    tok, lp = np.asarray(tok), np.asarray(lp)
    scaled = np.asarray(LOGITS[0]) / sampling.temperature
    masked = np.full_like(scaled, -np.inf)
    masked[support] = scaled[support]
    p = np.exp(masked - masked.max())
    p /= p.sum()
    freq = np.bincount(tok, minlength=len(p)) / n
    assert set(np.unique(tok)) <= set(support)
    np.testing.assert_allclose(freq, p, atol=4 * np.sqrt(0.25 / n))
    np.testing.assert_allclose(lp, np.log(p[tok]), rtol=1e-5)  # log-prob under the distribution drawn from


def test_same_keys_same_tokens_and_counters_give_fresh_draws():
    s = Sampling(temperature=1.0)
    a, _ = _draw(LOGITS, 64, s, seed=7)
    b, _ = _draw(LOGITS, 64, s, seed=7)
    c, _ = _draw(LOGITS, 64, s, seed=8)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    keys = row_keys(7, np.arange(64))
    d, _ = sample(jnp.broadcast_to(LOGITS, (64, 6)), keys, jnp.ones(64, jnp.int32), jnp.float32(1.0),
                  jnp.float32(1.0), greedy=False, top_k=0, use_top_p=False)
    assert not np.array_equal(a, d)


def test_top_k_one_and_tiny_top_p_are_argmax():
    for s in (Sampling(temperature=2.0, top_k=1), Sampling(temperature=2.0, top_p=1e-6)):
        tok, lp = _draw(LOGITS, 50, s)
        assert np.all(np.asarray(tok) == 0)
        np.testing.assert_allclose(lp, 0.0, atol=1e-6)


def test_sampling_options_are_checked():
    assert Sampling.of({"temperature": 0.6, "top_p": 1.0}) == Sampling(0.6, 1.0, 0)
    assert Sampling.of(None).greedy
    with pytest.raises(UserError, match="unknown sampling option"):
        Sampling.of({"temperature": 0.6, "top_q": 0.9})
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2}, {"top_k": 1.5}):
        with pytest.raises(UserError):
            Sampling.of(bad)
    with pytest.raises(UserError):
        Sampling.of("greedy")
