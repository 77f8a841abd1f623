"""The Qwen2/Llama decoder: a Flax NNX module inside, a pure function of a params dict outside.

`init_params` builds the module and returns its parameters as a nested dict of plain arrays (keys: embed,
layers/I/{input_norm,attn,post_attn_norm,mlp}, final_norm, lm_head); `forward` merges that dict back into the
module graph inside the caller's trace (nnx.merge is trace-time only), so ES, generation and GRPO all work on
plain pytrees. Every dense matmul goes through `_dense`, the single place a population perturbation is applied.
Each parameter names its logical axes where it is defined (`axes=`, read by `param_axes`); model/sharding.py
maps them onto the mesh.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from asyncres_jax.model.config import ModelConfig

Array = jax.Array
Params = dict


class Perturbation(Protocol):
    """Per-row additive change to the weights, applied without materialising perturbed weights.

    `dense(path, x, transpose)` returns the extra term of x @ W (x @ W.T when transpose) for the
    2-D leaf at `path`; `embed(path, tokens_bt)` the extra rows for an embedding lookup;
    `vector(path, value)` the (possibly per-row, [B, 1, n]) value to use for the 1-D leaf at `path`.
    Paths are the params leaf paths ("layers/3/attn/q_proj/kernel"). To cross a jit boundary the object
    must be a pytree (e.g. a flax.struct dataclass holding the factors and each row's member and sign).
    """

    def dense(self, path: str, x: Array, transpose: bool) -> Array: ...
    def embed(self, path: str, tokens_bt: Array) -> Array: ...
    def vector(self, path: str, value: Array) -> Array: ...


def _vector(value: Array, path: str, perturbation: Perturbation | None) -> Array:
    return value if perturbation is None else perturbation.vector(path, value)


def _dense(x: Array, kernel: Array, path: str, perturbation: Perturbation | None, *, transpose=False) -> Array:
    """x @ kernel (kernel.T when transpose), plus the perturbation's term for the leaf `path`."""
    # As a 2-D product over the flattened (b, t) rows: XLA CPU ran the 3-D einsum ~20% slower (decode, T = 1).
    B, T, _ = x.shape
    x_nd = x.astype(kernel.dtype).reshape(B * T, -1)
    y = (x_nd @ kernel.T if transpose else x_nd @ kernel).reshape(B, T, -1)
    if perturbation is not None:
        y = y + perturbation.dense(path, x, transpose).astype(y.dtype)
    return y


_init = nnx.initializers.normal(0.02)


class Dense(nnx.Module):
    def __init__(self, d_in: int, d_out: int, *, path: str, axes: tuple[str, str], use_bias: bool, dtype,
                 rngs: nnx.Rngs):
        self.kernel = nnx.Param(_init(rngs.params(), (d_in, d_out), dtype), axes=axes)
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype), axes=axes[1:]) if use_bias else None
        self.path = path

    def __call__(self, x: Array, perturbation: Perturbation | None) -> Array:
        y = _dense(x, self.kernel[...], f"{self.path}/kernel", perturbation)
        if self.bias is not None:
            y = y + _vector(self.bias[...], f"{self.path}/bias", perturbation).astype(y.dtype)
        return y


class RMSNorm(nnx.Module):
    def __init__(self, d: int, eps: float, *, path: str, dtype):
        self.scale = nnx.Param(jnp.ones((d,), dtype), axes=("embed",))
        self.eps = eps
        self.path = path

    def __call__(self, x: Array, perturbation: Perturbation | None) -> Array:
        # Like transformers: normalise in float32, cast back, then scale in the activation dtype.
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return _vector(self.scale[...], f"{self.path}/scale", perturbation) * x32.astype(x.dtype)


def _rope(x_btnh: Array, positions_bt: Array, theta: float) -> Array:
    """Rotary embedding in transformers' rotate-half layout (first half / second half of each head)."""
    hd = x_btnh.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    ang_bth = positions_bt.astype(jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(ang_bth)[:, :, None, :], jnp.sin(ang_bth)[:, :, None, :]
    x1, x2 = jnp.split(x_btnh.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_btnh.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, path: str, dtype, rngs: nnx.Rngs):
        d, hd, nq, nkv, b = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.attention_bias
        kw = dict(dtype=dtype, rngs=rngs)
        self.q_proj = Dense(d, nq * hd, path=f"{path}/q_proj", axes=("embed", "heads"), use_bias=b, **kw)
        self.k_proj = Dense(d, nkv * hd, path=f"{path}/k_proj", axes=("embed", "kv_heads"), use_bias=b, **kw)
        self.v_proj = Dense(d, nkv * hd, path=f"{path}/v_proj", axes=("embed", "kv_heads"), use_bias=b, **kw)
        self.o_proj = Dense(nq * hd, d, path=f"{path}/o_proj", axes=("heads", "embed"), use_bias=False, **kw)
        self.nq, self.nkv, self.hd, self.theta = nq, nkv, hd, cfg.rope_theta

    def __call__(self, x_btd, positions_bt, mask_bts, kv, write_index, perturbation):
        B, T, _ = x_btd.shape
        q_btnh = self.q_proj(x_btd, perturbation).reshape(B, T, self.nq, self.hd)
        k_btkh = self.k_proj(x_btd, perturbation).reshape(B, T, self.nkv, self.hd)
        v_btkh = self.v_proj(x_btd, perturbation).reshape(B, T, self.nkv, self.hd)
        q_btnh, k_btkh = _rope(q_btnh, positions_bt, self.theta), _rope(k_btkh, positions_bt, self.theta)
        # The cache is head-major, keys [B, nkv, hd, S] and values [B, nkv, S, hd]: each attention product is
        # then a plain matmul whose long axis S is contiguous (with [B, S, nkv, hd] XLA CPU copied the whole cache
        # every decode step, ~2.5x slower; keys as [B, nkv, S, hd] made the score product ~1.5x slower).
        k_bkhs, v_bksh = k_btkh.transpose(0, 2, 3, 1), v_btkh.transpose(0, 2, 1, 3)
        if kv is not None:  # write the new keys/values at slots [write_index, write_index + T), attend over all S
            k_cache, v_cache = kv
            k_bkhs = jax.lax.dynamic_update_slice(k_cache, k_bkhs.astype(k_cache.dtype), (0, 0, 0, write_index))
            v_bksh = jax.lax.dynamic_update_slice(v_cache, v_bksh.astype(v_cache.dtype), (0, 0, write_index, 0))
            kv = (k_bkhs, v_bksh)
        # Grouped-query attention: query heads n = k * g share key/value head k. The (t, g) pairs of one kv head
        # form a single query axis q, so each product is one batched matmul [q, h] x [h, s] per (b, k): XLA CPU
        # ran the 5-D "btkgh,bksh" form as many tiny dots, 3-4x slower (docs/performance.md).
        g = self.nq // self.nkv
        q_bkqh = q_btnh.reshape(B, T, self.nkv, g, self.hd).transpose(0, 2, 1, 3, 4)
        q_bkqh = q_bkqh.reshape(B, self.nkv, T * g, self.hd)
        s_bkqs = jnp.einsum("bkqh,bkhs->bkqs", q_bkqh, k_bkhs.astype(q_bkqh.dtype)).astype(jnp.float32)
        s_bkqs = s_bkqs / math.sqrt(self.hd)
        mask_bqs = jnp.broadcast_to(mask_bts[:, :, None, :], (B, T, g, mask_bts.shape[-1])).reshape(B, 1, T * g, -1)
        # A finite fill keeps rows with no valid key (pad queries) NaN-free; their output is never used.
        s_bkqs = jnp.where(mask_bqs, s_bkqs, jnp.finfo(jnp.float32).min)
        p_bkqs = jax.nn.softmax(s_bkqs, axis=-1).astype(v_bksh.dtype)
        o_bkqh = jnp.einsum("bkqs,bksh->bkqh", p_bkqs, v_bksh)
        o_btkgh = o_bkqh.reshape(B, self.nkv, T, g, self.hd).transpose(0, 2, 1, 3, 4)
        return self.o_proj(o_btkgh.reshape(B, T, self.nq * self.hd).astype(x_btd.dtype), perturbation), kv


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, path: str, dtype, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        kw = dict(use_bias=False, dtype=dtype, rngs=rngs)
        self.gate_proj = Dense(d, f, path=f"{path}/gate_proj", axes=("embed", "mlp"), **kw)
        self.up_proj = Dense(d, f, path=f"{path}/up_proj", axes=("embed", "mlp"), **kw)
        self.down_proj = Dense(f, d, path=f"{path}/down_proj", axes=("mlp", "embed"), **kw)

    def __call__(self, x_btd, perturbation):
        h_btf = jax.nn.silu(self.gate_proj(x_btd, perturbation)) * self.up_proj(x_btd, perturbation)
        return self.down_proj(h_btf, perturbation)


class Layer(nnx.Module):
    def __init__(self, cfg: ModelConfig, i: int, *, dtype, rngs: nnx.Rngs):
        p = f"layers/{i}"
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, path=f"{p}/input_norm", dtype=dtype)
        self.attn = Attention(cfg, path=f"{p}/attn", dtype=dtype, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, path=f"{p}/post_attn_norm", dtype=dtype)
        self.mlp = MLP(cfg, path=f"{p}/mlp", dtype=dtype, rngs=rngs)

    def __call__(self, x_btd, positions_bt, mask_bts, kv, write_index, perturbation):
        a_btd, kv = self.attn(self.input_norm(x_btd, perturbation), positions_bt, mask_bts, kv, write_index,
                              perturbation)
        x_btd = x_btd + a_btd
        x_btd = x_btd + self.mlp(self.post_attn_norm(x_btd, perturbation), perturbation)
        return x_btd, kv


class Decoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype,
                               embedding_init=_init, rngs=rngs)
        self.embed.embedding.set_metadata(axes=("vocab", "embed"))
        self.layers = nnx.List([Layer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, path="final_norm", dtype=dtype)
        self.lm_head = (None if cfg.tie_word_embeddings else
                        Dense(cfg.hidden_size, cfg.vocab_size, path="lm_head", axes=("embed", "vocab"), use_bias=False,
                              dtype=dtype, rngs=rngs))

    def __call__(self, tokens_bt, positions_bt, mask_bts, cache, write_index, perturbation):
        emb_vd = self.embed.embedding[...]
        x_btd = emb_vd[tokens_bt]
        if perturbation is not None:
            x_btd = x_btd + perturbation.embed("embed/embedding", tokens_bt).astype(x_btd.dtype)
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            kv = None if cache is None else (cache.k[i], cache.v[i])
            x_btd, kv = layer(x_btd, positions_bt, mask_bts, kv, write_index, perturbation)
            if kv is not None:
                new_k.append(kv[0])
                new_v.append(kv[1])
        x_btd = self.final_norm(x_btd, perturbation)
        if self.lm_head is None:  # tied: logits against the embedding matrix
            logits_btv = _dense(x_btd, emb_vd, "embed/embedding", perturbation, transpose=True)
        else:
            logits_btv = self.lm_head(x_btd, perturbation)
        return logits_btv.astype(jnp.float32), (None if cache is None else KVCache(tuple(new_k), tuple(new_v)))


class KVCache(NamedTuple):
    k: tuple  # per layer [B, nkv, hd, S] (head-major, slots last: see Attention)
    v: tuple  # per layer [B, nkv, S, hd]

    @property
    def length(self) -> int:
        """Slots S."""
        return self.v[0].shape[2]


def init_params(cfg: ModelConfig, key: Array, dtype=jnp.float32) -> Params:
    """Random parameters (normal(0.02) matrices, unit norm scales, zero biases) as a nested dict."""
    return nnx.to_pure_dict(nnx.state(Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(params=key)), nnx.Param))


def abstract_params(cfg: ModelConfig, dtype=jnp.float32) -> Params:
    """The params dict as jax.ShapeDtypeStruct leaves, without allocating anything."""
    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), dtype))


def param_axes(cfg: ModelConfig) -> Params:
    """Each parameter's logical axes (a tuple of names per leaf), in the params dict's layout."""
    state = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    return nnx.to_pure_dict(jax.tree.map(lambda v: v.get_metadata()["axes"], state,
                                         is_leaf=lambda x: isinstance(x, nnx.Variable)))


@functools.lru_cache(maxsize=32)
def _graphdef(cfg: ModelConfig) -> nnx.GraphDef:
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    return graphdef


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=jnp.float32) -> KVCache:
    k_shape = (batch, cfg.num_kv_heads, cfg.head_dim, length)
    v_shape = (batch, cfg.num_kv_heads, length, cfg.head_dim)
    return KVCache(tuple(jnp.zeros(k_shape, dtype) for _ in range(cfg.num_layers)),
                   tuple(jnp.zeros(v_shape, dtype) for _ in range(cfg.num_layers)))


def grow_cache(cache: KVCache, new_length: int) -> KVCache:
    """Zero-pad the slot axis to `new_length` (bucket growth; existing slots keep their index)."""
    extra = new_length - cache.length
    if extra < 0:
        raise ValueError(f"grow_cache cannot shrink a cache of {cache.length} slots to {new_length}")
    return KVCache(tuple(jnp.pad(k, ((0, 0), (0, 0), (0, 0), (0, extra))) for k in cache.k),
                   tuple(jnp.pad(v, ((0, 0), (0, 0), (0, extra), (0, 0))) for v in cache.v))


def take_rows(cache: KVCache, rows_idx) -> KVCache:
    """Keep the batch rows `rows_idx` (in that order)."""
    rows_idx = jnp.asarray(rows_idx)
    return jax.tree.map(lambda x: jnp.take(x, rows_idx, axis=0), cache)


def forward(params: Params, cfg: ModelConfig, tokens_bt, positions_bt, *, cache: KVCache | None = None,
            write_index=None, kv_valid_bs=None, attn_mask_bt=None, perturbation: Perturbation | None = None):
    """Logits [B, T, vocab] (float32) and the updated cache (None without one). See the module contract.

    Without cache: causal attention over the T tokens; attn_mask_bt (1 real, 0 pad) masks keys.
    With cache: the tokens go to slots [write_index, write_index + T); a query at slot s attends to the
    slots s' <= s where kv_valid_bs[b, s'] (defaults to all slots before write_index + T).
    """
    tokens_bt = jnp.asarray(tokens_bt)
    positions_bt = jnp.asarray(positions_bt)
    B, T = tokens_bt.shape
    if cache is None:
        t = jnp.arange(T)
        mask_bts = jnp.broadcast_to(t[None, :, None] >= t[None, None, :], (B, T, T))
        if attn_mask_bt is not None:
            mask_bts = mask_bts & (jnp.asarray(attn_mask_bt)[:, None, :] > 0)
    else:
        S = cache.length
        write_index = jnp.asarray(0 if write_index is None else write_index, jnp.int32)
        q_slot_t = write_index + jnp.arange(T)
        s = jnp.arange(S)
        mask_bts = jnp.broadcast_to(s[None, None, :] <= q_slot_t[None, :, None], (B, T, S))
        if kv_valid_bs is not None:
            mask_bts = mask_bts & (jnp.asarray(kv_valid_bs)[:, None, :] > 0)
    model = nnx.merge(_graphdef(cfg), params)
    return model(tokens_bt, positions_bt, mask_bts, cache, write_index, perturbation)
