"""The decoder's hyper-parameters, read from a checkpoint's own config.json (Qwen2 and Llama families)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from asyncres_jax.errors import UserError

# architectures[0] in config.json -> default for attention_bias (Qwen2 always has QKV bias).
SUPPORTED_ARCHITECTURES = {"Qwen2ForCausalLM": True, "LlamaForCausalLM": False}
_MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    architecture: str

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise UserError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "grouped-query attention needs whole groups"
            )

    @classmethod
    def from_hf(cls, cj: dict[str, Any]) -> "ModelConfig":
        """Build from a raw config.json dict (transformers v4 or v5 layout)."""
        archs = cj.get("architectures") or [_MODEL_TYPES.get(cj.get("model_type", ""), "")]
        arch = archs[0] if archs else ""
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UserError(
                f"unsupported architecture {arch or cj.get('model_type')!r} in config.json; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = cj.get("hidden_act", "silu")
        if act != "silu":
            raise UserError(f"unsupported hidden_act {act!r} in config.json; only 'silu' (SwiGLU) is implemented")
        if cj.get("mlp_bias"):
            raise UserError("config.json has mlp_bias=true, which this decoder does not implement")
        if cj.get("use_sliding_window") or any(t != "full_attention" for t in cj.get("layer_types") or ()):
            raise UserError("config.json has use_sliding_window=true, which this decoder does not implement")
        # transformers v5 moved rope_theta (and rope_scaling) into rope_parameters.
        rope = cj.get("rope_parameters") or {}
        scaling = cj.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise UserError(f"unsupported rope scaling {rope_type!r} in config.json; only plain RoPE is implemented")
        theta = cj.get("rope_theta", rope.get("rope_theta", 10000.0))
        heads = cj["num_attention_heads"]
        eos = cj.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        return cls(
            vocab_size=cj["vocab_size"],
            hidden_size=cj["hidden_size"],
            intermediate_size=cj["intermediate_size"],
            num_layers=cj["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cj.get("num_key_value_heads") or heads,
            head_dim=cj.get("head_dim") or cj["hidden_size"] // heads,
            rope_theta=float(theta),
            rms_norm_eps=float(cj.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(cj.get("attention_bias", SUPPORTED_ARCHITECTURES[arch])),
            tie_word_embeddings=bool(cj.get("tie_word_embeddings", False)),
            max_position_embeddings=cj.get("max_position_embeddings", 32768),
            bos_token_id=cj.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
        )

    @classmethod
    def tiny(cls, **overrides) -> "ModelConfig":
        """A small config for random-weight tests: heads divide 2 and 4, so it shards on every test mesh."""
        base = dict(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6, attention_bias=True, tie_word_embeddings=False,
            max_position_embeddings=512, bos_token_id=None, eos_token_ids=(1,), architecture="Qwen2ForCausalLM",
        )
        base.update(overrides)
        return cls(**base)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
