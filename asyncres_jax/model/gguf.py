"""GGUF files (llama.cpp) -> (ModelConfig, params): dequantised with the `gguf` package, Q/K un-permuted.

llama.cpp's converter reorders the rows of Llama's q_proj/k_proj within each head (interleaved rotary
pairs instead of transformers' first-half/second-half); `_unpermute` puts them back so the decoder's
rotate-half RoPE applies. Qwen2 GGUFs are stored unpermuted (llama.cpp runs them with NeoX RoPE).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np

from asyncres_jax.errors import UserError
from asyncres_jax.model.config import ModelConfig
from asyncres_jax.model.decoder import abstract_params
from asyncres_jax.model.loading import flat_leaves, place, unflatten

_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_GLOBAL = {"token_embd.weight": ("embed/embedding", False), "output_norm.weight": ("final_norm/scale", False),
           "output.weight": ("lm_head/kernel", True)}
_LAYER = {
    "attn_norm.weight": ("input_norm/scale", False), "ffn_norm.weight": ("post_attn_norm/scale", False),
    "attn_q.weight": ("attn/q_proj/kernel", True), "attn_k.weight": ("attn/k_proj/kernel", True),
    "attn_v.weight": ("attn/v_proj/kernel", True), "attn_output.weight": ("attn/o_proj/kernel", True),
    "attn_q.bias": ("attn/q_proj/bias", False), "attn_k.bias": ("attn/k_proj/bias", False),
    "attn_v.bias": ("attn/v_proj/bias", False),
    "ffn_gate.weight": ("mlp/gate_proj/kernel", True), "ffn_up.weight": ("mlp/up_proj/kernel", True),
    "ffn_down.weight": ("mlp/down_proj/kernel", True),
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def _open(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise UserError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); "
                        "it may be truncated or corrupt") from None


_REQUIRED = object()


def _field(reader, key: str, default=_REQUIRED):
    f = reader.fields.get(key)
    if f is None and default is _REQUIRED:
        raise UserError(f"GGUF metadata lacks {key!r}; is this a llama.cpp model file?")
    return default if f is None else f.contents()


def gguf_config(reader, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture", None)
    if arch not in _ARCHS:
        raise UserError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHS)}")
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise UserError(f"{path} has no token_embd.weight tensor")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    d = int(_field(reader, f"{arch}.embedding_length"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id", None)
    return ModelConfig(
        vocab_size=int(embd.shape[1]),  # GGUF shapes are innermost-first: [d, vocab]
        hidden_size=d,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.rope.dimension_count", d // heads)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        attention_bias=any(t.name == "blk.0.attn_q.bias" for t in reader.tensors),
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 32768)),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=() if eos is None else (int(eos),),
        architecture=_ARCHS[arch],
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's permute: rows of each head go from (hd/2, 2) interleaved back to (2, hd/2)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: Path):
    """(reader, config) of a GGUF file; the tensors are read later, by load_gguf_params."""
    reader = _open(path)
    return reader, gguf_config(reader, path)


def load_gguf_params(reader, cfg: ModelConfig, path: Path, dtype, shardings=None) -> dict:
    """Dequantise every tensor into a params dict (shardings: params-shaped pytree of shardings, or None)."""
    import jax
    from gguf.quants import dequantize
    from jax.sharding import SingleDeviceSharding

    want = flat_leaves(abstract_params(cfg, dtype))
    shard_of = flat_leaves(shardings) if shardings is not None else {}
    default = SingleDeviceSharding(jax.devices()[0])
    filled = {}
    for t in reader.tensors:
        m = _LAYER_RE.fullmatch(t.name)
        target = _GLOBAL.get(t.name) or (m and m.group(2) in _LAYER and
                                         (f"layers/{int(m.group(1))}/{_LAYER[m.group(2)][0]}", _LAYER[m.group(2)][1]))
        if not target:
            raise UserError(f"{path}: unexpected GGUF tensor {t.name!r}")
        name, transpose = target
        if name not in want or name in filled:
            raise UserError(f"{path}: tensor {t.name!r} does not fit the model described by its metadata")
        w = dequantize(t.data, t.tensor_type).reshape(tuple(int(s) for s in reversed(t.shape)))
        if cfg.architecture == "LlamaForCausalLM" and re.search(r"attn_[qk]\.", t.name):
            w = _unpermute(w, cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads)
        if transpose:
            w = w.T
        if w.shape != want[name].shape:
            raise UserError(f"{path}: tensor {t.name!r} has shape {w.shape}, expected {want[name].shape}")
        filled[name] = place(w.shape, dtype, shard_of.get(name, default), lambda idx, w=w: w[idx])
    missing = sorted(set(want) - set(filled))
    if missing:
        raise UserError(f"{path}: GGUF file lacks {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else ""))
    return unflatten(filled)


def _tokenizer_cache_dir(path: Path) -> Path:
    root = Path(os.environ.get("ASYNCRES_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                / "asyncres_jax")
    st = path.stat()
    return root / "tokenizers" / f"{path.stem}-{st.st_size}-{st.st_mtime_ns}"


def load_gguf_tokenizer(path: Path, use_cache: bool = True):
    """transformers' tokenizer (with chat template) read from the GGUF file.

    Converting a GGUF vocabulary takes seconds, so the result is saved once in the user's cache
    (keyed by file name, size and mtime; ASYNCRES_CACHE overrides the place) and reloaded from there.
    """
    from transformers import AutoTokenizer

    cached = _tokenizer_cache_dir(path)
    if use_cache and (cached / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache entry: rebuild it below
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"cannot read the tokenizer in {path}: {e}") from None
    if use_cache:
        tmp = None
        try:  # write aside, then rename: concurrent loaders never see a half-written entry
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=cached.parent))
            tok.save_pretrained(str(tmp))
            shutil.rmtree(cached, ignore_errors=True)
            os.replace(tmp, cached)
        except OSError:  # read-only or full cache, or another process won the race: only costs time
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    return tok
