"""The decoder's contract: the params layout, and cached decoding == uncached forward on the same real tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncres_jax.model.config import ModelConfig
from asyncres_jax.model.decoder import (KVCache, abstract_params, forward, grow_cache, init_cache, init_params,
                                        take_rows)

CFG = ModelConfig.tiny()
forward_jit = jax.jit(forward, static_argnames="cfg")


@pytest.fixture(scope="module")
def params():
    p = init_params(CFG, jax.random.key(0))
    # Non-trivial norms and biases, so a mistake in either cannot hide behind ones and zeros.
    leaves, tree = jax.tree.flatten(p)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [x + 0.1 * jax.random.normal(k, x.shape) if x.ndim == 1 else x for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(tree, leaves)


def _paths(tree):
    return {"/".join(str(k.key) for k in path): leaf.shape
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def test_params_layout_matches_contract():
    c = CFG
    d, f, hd = c.hidden_size, c.intermediate_size, c.head_dim
    expect = {"embed/embedding": (c.vocab_size, d), "final_norm/scale": (d,), "lm_head/kernel": (d, c.vocab_size)}
    for i in range(c.num_layers):
        p = f"layers/{i}"
        expect |= {
            f"{p}/input_norm/scale": (d,), f"{p}/post_attn_norm/scale": (d,),
            f"{p}/attn/q_proj/kernel": (d, c.num_heads * hd), f"{p}/attn/q_proj/bias": (c.num_heads * hd,),
            f"{p}/attn/k_proj/kernel": (d, c.num_kv_heads * hd), f"{p}/attn/k_proj/bias": (c.num_kv_heads * hd,),
            f"{p}/attn/v_proj/kernel": (d, c.num_kv_heads * hd), f"{p}/attn/v_proj/bias": (c.num_kv_heads * hd,),
            f"{p}/attn/o_proj/kernel": (c.num_heads * hd, d),
            f"{p}/mlp/gate_proj/kernel": (d, f), f"{p}/mlp/up_proj/kernel": (d, f), f"{p}/mlp/down_proj/kernel": (f, d),
        }
    p = init_params(c, jax.random.key(0))
    assert _paths(p) == expect
    assert all(isinstance(k, int) for k in p["layers"])
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(p))
    # Llama-style: no QKV bias, tied output embedding.
    tied = _paths(abstract_params(c.replace(attention_bias=False, tie_word_embeddings=True), jnp.bfloat16))
    assert tied == {k: v for k, v in expect.items() if not k.endswith("bias") and not k.startswith("lm_head")}


def _layout():
    """Two rows over 16 slots: left pads, a first segment, a hole of pads, a second segment (as multi-turn
    generation leaves them when rows append observations of different lengths at the same slots)."""
    valid = np.zeros((2, 16), bool)
    valid[0, 2:7] = True      # 2 left pads, 5 tokens
    valid[0, 10:16] = True    # hole of 3 pads, then 6 tokens
    valid[1, 0:9] = True      # no left pad, 9 tokens
    valid[1, 11:14] = True    # hole of 2, 3 tokens, then 2 trailing pads
    tokens = np.where(valid, np.random.default_rng(0).integers(2, CFG.vocab_size, valid.shape), 0)
    positions = np.cumsum(valid, axis=1) - 1
    return tokens, valid, positions


def _reference_logits(params, tokens, valid):
    """Uncached forward of each row's real tokens alone, scattered back to their slots."""
    out = np.zeros(tokens.shape + (CFG.vocab_size,), np.float32)
    for b in range(tokens.shape[0]):
        real = tokens[b][valid[b]][None]
        logits, _ = forward_jit(params, CFG, real, np.arange(real.shape[1])[None])
        out[b, valid[b]] = np.asarray(logits[0])
    return out


def test_uncached_mask_and_positions_handle_pads_and_holes(params):
    tokens, valid, positions = _layout()
    ref = _reference_logits(params, tokens, valid)
    logits, cache = forward_jit(params, CFG, tokens, positions, attn_mask_bt=valid)
    assert cache is None
    np.testing.assert_allclose(np.asarray(logits)[valid], ref[valid], atol=1e-5)


def test_cached_decoding_matches_uncached_forward(params):
    tokens, valid, positions = _layout()
    ref = _reference_logits(params, tokens, valid)
    step = forward_jit
    got = np.zeros_like(ref)

    # Prefill 6 slots into a short cache, grow it (bucket growth), a 3-token chunk, then one token at a time.
    cache = init_cache(CFG, 2, 8, jnp.float32)
    chunks = [(0, 6), (6, 9)] + [(s, s + 1) for s in range(9, 16)]
    for lo, hi in chunks:
        if hi > cache.length:
            cache = grow_cache(cache, 16)
        kv_valid = np.zeros((2, cache.length), bool)
        kv_valid[:, :hi] = valid[:, :hi]
        logits, cache = step(params, CFG, tokens[:, lo:hi], positions[:, lo:hi], cache=cache, write_index=lo,
                             kv_valid_bs=kv_valid)
        got[:, lo:hi] = np.asarray(logits)
    assert isinstance(cache, KVCache) and cache.length == 16
    assert cache.k[0].shape == (2, CFG.num_kv_heads, CFG.head_dim, 16)  # keys slots-last (decoder.Attention)
    assert cache.v[0].shape == (2, CFG.num_kv_heads, 16, CFG.head_dim)
    np.testing.assert_allclose(got[valid], ref[valid], atol=1e-5)


def test_take_rows_keeps_a_finished_batch_consistent(params):
    tokens, valid, positions = _layout()
    ref = _reference_logits(params, tokens, valid)
    cache = init_cache(CFG, 2, 16, jnp.float32)
    _, cache = forward_jit(params, CFG, tokens[:, :12], positions[:, :12], cache=cache, write_index=0,
                           kv_valid_bs=valid)
    cache = take_rows(cache, [1])  # row 0 finished and left the batch
    logits, _ = forward_jit(params, CFG, tokens[1:, 12:], positions[1:, 12:], cache=cache, write_index=12,
                            kv_valid_bs=valid[1:])
    np.testing.assert_allclose(np.asarray(logits)[valid[1:, 12:]], ref[1, 12:][valid[1, 12:]], atol=1e-5)
    with pytest.raises(ValueError, match="shrink"):
        grow_cache(cache, 4)


class _FullRankDelta:
    """A perturbation that adds dense deltas to some leaves: equivalent to editing the params."""

    def __init__(self, deltas):
        self.deltas = deltas

    def dense(self, path, x, transpose):
        return jnp.einsum("btd,fd->btf" if transpose else "btd,df->btf", x, self.deltas[path])

    def embed(self, path, tokens):
        return self.deltas[path][tokens]

    def vector(self, path, value):
        return value + self.deltas[path]


@pytest.mark.parametrize("tied", [False, True])
def test_perturbation_hook_equals_editing_the_weights(tied):
    cfg = CFG.replace(tie_word_embeddings=tied)
    p = init_params(cfg, jax.random.key(2))
    flat = {"/".join(str(k.key) for k in path): x for path, x in jax.tree_util.tree_leaves_with_path(p)}
    keys = iter(jax.random.split(jax.random.key(3), len(flat)))
    deltas = {k: 0.05 * jax.random.normal(next(keys), x.shape) for k, x in flat.items()}
    edited = jax.tree_util.tree_map_with_path(
        lambda path, x: x + deltas["/".join(str(k.key) for k in path)], p)
    tokens, valid, positions = _layout()
    want, _ = forward_jit(edited, cfg, tokens, positions, attn_mask_bt=valid)
    got = jax.jit(lambda p, d: forward(p, cfg, tokens, positions, attn_mask_bt=valid,
                                          perturbation=_FullRankDelta(d))[0])(p, deltas)
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=1e-5)
