"""Hugging Face checkpoint directories -> (ModelConfig, params), streamed tensor by tensor into shardings.

The converter is strict: every parameter of the decoder is filled exactly once from a tensor of the right
shape, and a tensor it does not know, or a parameter no tensor fills, is a UserError. Tensors are read
lazily (safetensors slices) and each device reads only its own shard, so a 7B model never exists as one
host copy.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding, SingleDeviceSharding

from asyncres_jax.errors import UserError
from asyncres_jax.model.config import ModelConfig
from asyncres_jax.model.decoder import abstract_params

# HF tensor name (layer index as {i}) -> (our leaf path, transpose). HF linear weights are [out, in].
_HF_LAYER = {
    "input_layernorm.weight": ("input_norm/scale", False),
    "post_attention_layernorm.weight": ("post_attn_norm/scale", False),
    **{f"self_attn.{p}_proj.weight": (f"attn/{p}_proj/kernel", True) for p in "qkvo"},
    **{f"self_attn.{p}_proj.bias": (f"attn/{p}_proj/bias", False) for p in "qkv"},
    **{f"mlp.{p}_proj.weight": (f"mlp/{p}_proj/kernel", True) for p in ("gate", "up", "down")},
}
_HF_GLOBAL = {
    "model.embed_tokens.weight": ("embed/embedding", False),
    "model.norm.weight": ("final_norm/scale", False),
    "lm_head.weight": ("lm_head/kernel", True),
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")

# Reads the part `index` (a tuple of slices in OUR layout) of one tensor as a host numpy array.
SliceReader = Callable[[tuple], np.ndarray]


def hf_name_to_path(name: str) -> tuple[str, bool] | None:
    """'model.layers.3.self_attn.q_proj.weight' -> ('layers/3/attn/q_proj/kernel', True); None if unknown."""
    if name in _HF_GLOBAL:
        return _HF_GLOBAL[name]
    m = _LAYER_RE.fullmatch(name)
    if m and m.group(2) in _HF_LAYER:
        path, transpose = _HF_LAYER[m.group(2)]
        return f"layers/{int(m.group(1))}/{path}", transpose
    return None


def flat_leaves(tree) -> dict[str, object]:
    return {"/".join(str(k.key) for k in path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def unflatten(flat: dict[str, object]) -> dict:
    out: dict = {}
    for name, leaf in flat.items():
        node = out
        *parents, last = [int(k) if k.isdigit() else k for k in name.split("/")]
        for k in parents:
            node = node.setdefault(k, {})
        node[last] = leaf
    return out


def place(shape: tuple[int, ...], dtype, sharding: Sharding, read: SliceReader) -> jax.Array:
    """Build one sharded array; each distinct shard is read once (replicas over "data" reuse it)."""
    np_dtype = np.dtype(jnp.dtype(dtype))
    shards: dict = {}

    def shard(idx):
        key = tuple((s.start, s.stop, s.step) for s in idx)
        if key not in shards:
            shards[key] = np.asarray(read(idx), dtype=np_dtype)
        return shards[key]

    return jax.make_array_from_callback(shape, sharding, shard)


def read_hf_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise UserError(f"{model_dir} has no config.json; expected a Hugging Face model directory")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); re-download or fix the file") from None
    try:
        return ModelConfig.from_hf(raw)
    except KeyError as e:
        raise UserError(f"{path} lacks the field {e.args[0]!r}; is this a Qwen2/Llama config?") from None


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise UserError(f"{index} is not a valid safetensors index ({e!r}); re-download it") from None
        files = [model_dir / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise UserError(f"{index} names weight files that are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_dir} has no *.safetensors weights (PyTorch .bin checkpoints are not supported; "
                        "convert with save_pretrained(safe_serialization=True))")
    return files


def load_hf_params(model_dir: Path, cfg: ModelConfig, dtype, shardings=None) -> dict:
    """Stream the safetensors weights of `model_dir` into a params dict (shardings: pytree or None)."""
    from safetensors import SafetensorError, safe_open

    want = flat_leaves(abstract_params(cfg, dtype))
    shard_of = flat_leaves(shardings) if shardings is not None else {}
    default = SingleDeviceSharding(jax.devices()[0])
    filled: dict[str, jax.Array] = {}
    for file in _weight_files(model_dir):
        try:
            with safe_open(str(file), framework="numpy") as f:
                for name in f.keys():
                    target = hf_name_to_path(name)
                    if target is None:
                        raise UserError(f"{file.name}: unexpected tensor {name!r} for {cfg.architecture}")
                    path, transpose = target
                    if path == "lm_head/kernel" and cfg.tie_word_embeddings:
                        continue  # some tied checkpoints also store the (identical) output embedding
                    if path not in want:
                        raise UserError(f"{file.name}: tensor {name!r} does not fit the config "
                                        f"({cfg.num_layers} layers, attention_bias={cfg.attention_bias})")
                    if path in filled:
                        raise UserError(f"{file.name}: tensor {name!r} appears more than once in the checkpoint")
                    sl = f.get_slice(name)
                    shape = tuple(sl.get_shape())
                    expect = want[path].shape
                    if (shape[::-1] if transpose else shape) != expect:
                        raise UserError(f"{file.name}: tensor {name!r} has shape {shape}, expected "
                                        f"{expect[::-1] if transpose else expect} from config.json")
                    read = (lambda idx, sl=sl: sl[idx[::-1]].T) if transpose else (lambda idx, sl=sl: sl[idx])
                    filled[path] = place(expect, dtype, shard_of.get(path, default), read)
        except SafetensorError as e:
            raise UserError(f"{file} is not a readable safetensors file ({e}); it may be truncated or corrupt, "
                            "re-download it") from None
    missing = sorted(set(want) - set(filled))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise UserError(f"{model_dir}: checkpoint lacks {', '.join(missing[:3])}{more}")
    return unflatten(filled)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_hf_tokenizer(model_dir: Path):
    """transformers' tokenizer (with its chat template) when the directory has tokenizer files, else None."""
    if not any((model_dir / n).is_file() for n in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the tokenizer in {model_dir}: {e}") from None


def hf_config_dict(cfg: ModelConfig, dtype="float32") -> dict:
    """config.json for `cfg` (readable by transformers v4 and v5, and by read_hf_config)."""
    return {
        "architectures": [cfg.architecture],
        "model_type": "qwen2" if cfg.architecture == "Qwen2ForCausalLM" else "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rms_norm_eps": cfg.rms_norm_eps, "attention_bias": cfg.attention_bias,
        "tie_word_embeddings": cfg.tie_word_embeddings, "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids), "dtype": str(np.dtype(dtype)),
    }


def save_hf(model_dir: Path, cfg: ModelConfig, params: dict) -> None:
    """Write config.json and model.safetensors in Hugging Face layout (the inverse of load_hf_params)."""
    from safetensors.numpy import save_file

    to_hf = {}
    for name in list(_HF_GLOBAL) + [f"model.layers.{i}.{k}" for i in range(cfg.num_layers) for k in _HF_LAYER]:
        path, transpose = hf_name_to_path(name)
        to_hf[path] = (name, transpose)
    tensors = {}
    for path, leaf in flat_leaves(params).items():
        name, transpose = to_hf[path]
        x = np.asarray(jax.device_get(leaf))
        tensors[name] = np.ascontiguousarray(x.T if transpose else x)
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    dtype = next(iter(tensors.values())).dtype
    (model_dir / "config.json").write_text(json.dumps(hf_config_dict(cfg, dtype), indent=2))
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
