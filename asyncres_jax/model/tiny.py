"""A tiny character-level chat tokenizer and random-weight model, for fast tests of generation and episodes.

The vocabulary is lowercase letters, digits, a few symbols and some multi-character merges (so a stop
string can end in the middle of a token), plus ChatML's <|im_start|> and <|im_end|> (= EOS).
"""

from __future__ import annotations

import functools

import jax

from asyncres_jax.model.config import ModelConfig

_CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 <>/\n.=_-")
_MERGES = [("<", "/"), ("c", "o"), ("m", "m"), ("a", "n"), ("d", ">"), ("co", "mm"), ("an", "d>"), ("e", " "),
           ("t", "h"), ("th", "e "), ("</", "comm")]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@functools.lru_cache(maxsize=1)
def tiny_tokenizer():
    """A transformers fast tokenizer (character BPE with a few merges) with a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(_CHARS)}
    for a, b in _MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_MERGES))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHATML
    return fast


def tiny_config(**overrides) -> ModelConfig:
    tok = tiny_tokenizer()
    base = dict(vocab_size=len(tok), eos_token_ids=(tok.eos_token_id,), max_position_embeddings=4096)
    base.update(overrides)
    return ModelConfig.tiny(**base)


def tiny_model(seed: int = 0, mesh=None, **overrides):
    """A Model with random weights (normal(0.02) scaled up, so greedy outputs vary) and the tiny tokenizer."""
    from asyncres_jax.model import Model
    from asyncres_jax.model.decoder import init_params

    cfg = tiny_config(**overrides)
    params = init_params(cfg, jax.random.key(seed))
    # Larger weights than the default init give peaked, input-dependent next-token distributions.
    params = jax.tree.map(lambda x: x * 10.0 if x.ndim == 2 else x, params)
    if mesh is not None:
        from asyncres_jax.model.sharding import param_shardings

        params = jax.device_put(params, param_shardings(params, cfg, mesh))
    return Model(cfg, params, tiny_tokenizer(), mesh, "tiny")
