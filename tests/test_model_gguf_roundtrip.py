"""GGUF files written the way llama.cpp's converter writes them load to exactly the HF-directory weights."""

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from asyncres_jax.errors import UserError
from asyncres_jax.model import ModelConfig, init_params, load_model
from asyncres_jax.model.loading import save_hf

gguf = pytest.importorskip("gguf")

_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
          "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
          "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
          "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def _llama_cpp_permute(w, n_head):
    """convert_hf_to_gguf's LlamaModel.permute: rotary pairs interleaved within each head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path, cfg: ModelConfig, hf_tensors):
    arch = "qwen2" if cfg.architecture == "Qwen2ForCausalLM" else "llama"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_eos_token_id(cfg.eos_token_ids[0])
    for name, x in hf_tensors.items():
        if name in _GLOBAL:
            gname = _GLOBAL[name]
        else:
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{_LAYER[rest]}"
        if arch == "llama" and (".attn_q." in gname or ".attn_k." in gname):
            x = _llama_cpp_permute(x, cfg.num_heads if ".attn_q." in gname else cfg.num_kv_heads)
        w.add_tensor(gname, np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("cfg", [
    ModelConfig.tiny(),  # Qwen2: QKV bias, untied, stored unpermuted
    ModelConfig.tiny(architecture="LlamaForCausalLM", attention_bias=False, tie_word_embeddings=True,
                     rope_theta=5e5, head_dim=8, num_heads=8, num_kv_heads=2),  # Llama: Q/K permuted, tied
], ids=["qwen2", "llama"])
def test_gguf_loads_the_same_weights_as_the_hf_directory(cfg, tmp_path):
    params = init_params(cfg, jax.random.key(0))
    params = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(1), x.shape) if x.ndim == 1 else x,
                          params)
    save_hf(tmp_path / "hf", cfg, params)
    _write_gguf(tmp_path / "m.gguf", cfg, load_file(tmp_path / "hf" / "model.safetensors"))
    ref, m = load_model(tmp_path / "hf"), load_model(tmp_path / "m.gguf")
    assert ref.config == cfg
    assert m.config.rms_norm_eps == pytest.approx(cfg.rms_norm_eps, rel=1e-6)  # GGUF stores it as float32
    assert m.config.replace(rms_norm_eps=cfg.rms_norm_eps) == cfg
    assert m.tokenizer is None  # a weights-only GGUF
    jax.tree.map(np.testing.assert_array_equal, m.params, ref.params)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 7))
    np.testing.assert_allclose(np.asarray(m.logits(tokens)), np.asarray(ref.logits(tokens)), atol=1e-5)


def test_gguf_truncated_inside_the_tensor_data_is_a_user_error(tmp_path):
    cfg = ModelConfig.tiny()
    save_hf(tmp_path / "hf", cfg, init_params(cfg, jax.random.key(0)))
    _write_gguf(tmp_path / "m.gguf", cfg, load_file(tmp_path / "hf" / "model.safetensors"))
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) * 3 // 4])
    with pytest.raises(UserError, match=r"cut.gguf is not a readable GGUF file .*truncated or corrupt$"):
        load_model(tmp_path / "cut.gguf")
