"""Parity with transformers' PyTorch Qwen2 and Llama after a save_pretrained -> load_model round trip."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from asyncres_jax.model import load_model  # noqa: E402

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def _random_hf_model(kind: str):
    torch.manual_seed(0 if kind == "qwen2" else 1)
    if kind == "qwen2":  # QKV bias, untied output embedding
        cfg = transformers.Qwen2Config(**SMALL, rope_theta=1e4, tie_word_embeddings=False, eos_token_id=[1, 2])
        model = transformers.Qwen2ForCausalLM(cfg)
    else:  # Llama/SmolLM2 style: no bias, tied, another theta and an explicit head_dim
        cfg = transformers.LlamaConfig(**SMALL, rope_theta=5e5, tie_word_embeddings=True, attention_bias=False,
                                       bos_token_id=1, eos_token_id=2, head_dim=16)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # every weight random, so a mixed-up norm or a dropped bias cannot hide
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model.eval()


def _left_padded_batch():
    rng = np.random.default_rng(0)
    lengths = [11, 7, 3]
    tokens = np.zeros((3, 11), np.int64)
    mask = np.zeros((3, 11), np.int64)
    for b, n in enumerate(lengths):
        tokens[b, 11 - n:] = rng.integers(3, SMALL["vocab_size"], n)
        mask[b, 11 - n:] = 1
    return tokens, mask


def _reference(model, tokens, mask):
    positions = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(positions))
    return out.logits.float().numpy()


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def hf_model(request):
    model = _random_hf_model(request.param)
    model.config._attn_implementation = "eager"
    return request.param, model


@pytest.mark.parametrize("shard", [None, "20KB"], ids=["single-file", "sharded"])
def test_logits_match_transformers(hf_model, shard, tmp_path):
    kind, model = hf_model
    kw = {} if shard is None else {"max_shard_size": shard}
    model.save_pretrained(tmp_path, **kw)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard is not None)
    m = load_model(tmp_path)
    assert m.tokenizer is None  # a weights-only directory loads too
    assert m.config.architecture == ("Qwen2ForCausalLM" if kind == "qwen2" else "LlamaForCausalLM")
    assert m.config.attention_bias == (kind == "qwen2") and m.config.tie_word_embeddings == (kind == "llama")
    assert m.config.rope_theta == (1e4 if kind == "qwen2" else 5e5)
    tokens, mask = _left_padded_batch()
    want = _reference(model, tokens, mask)
    got = np.asarray(m.logits(tokens, mask))
    real = mask.astype(bool)
    assert np.abs(got[real] - want[real]).max() <= 1e-4


def test_bfloat16_load_is_close_to_float32(hf_model, tmp_path):
    _, model = hf_model
    model.save_pretrained(tmp_path)
    tokens, mask = _left_padded_batch()
    m32, m16 = load_model(tmp_path), load_model(tmp_path, dtype="bfloat16")
    assert all(x.dtype == np.dtype("bfloat16") for x in __import__("jax").tree.leaves(m16.params))
    real = mask.astype(bool)
    l32, l16 = np.asarray(m32.logits(tokens, mask))[real], np.asarray(m16.logits(tokens, mask))[real]
    assert l16.dtype == np.float32
    # bf16 keeps ~3 significant digits; the logits here have scale ~10.
    assert np.abs(l32 - l16).max() < 0.05 * np.abs(l32).max()


def test_v4_style_config_with_top_level_rope_theta(hf_model, tmp_path):
    _, model = hf_model
    model.save_pretrained(tmp_path)
    cj = json.loads((tmp_path / "config.json").read_text())
    theta = cj.pop("rope_parameters")["rope_theta"]
    cj["rope_theta"] = theta
    (tmp_path / "config.json").write_text(json.dumps(cj))
    assert load_model(tmp_path).config.rope_theta == theta
