"""The generation engine on a tiny random model: what it generates is what a full forward pass says, from
the cache or not, in any chunking; stops, multi-turn, rolling context, compile budget, bad input."""

import dataclasses

import jax
import numpy as np
import pytest

from asyncres_jax.errors import UserError
from asyncres_jax.model.decoder import forward
from asyncres_jax.model.generate import Engine, compiled_programs, slot_bucket
from asyncres_jax.model.tiny import tiny_model

_forward = jax.jit(forward, static_argnames="cfg")


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model)


PROMPTS = [[{"role": "system", "content": "you are terse"}, {"role": "user", "content": "list the files"}],
           [{"role": "user", "content": "hi"}],
           [{"role": "user", "content": "count the lines in the log and then sort them"}]]


def _full_logits(model, tokens):
    """Uncached forward over one row's whole token list."""
    t = np.asarray(tokens, np.int32)[None]
    logits, _ = _forward(model.params, model.config, t, np.arange(t.shape[1])[None])
    return np.asarray(logits[0])


def _reply(conv, r):
    g = conv.generated_mask[r]
    return conv.tokens[r][g], conv.logprobs[r][g]


def test_greedy_is_the_argmax_of_a_full_forward_and_logprobs_match(model, engine):
    conv = engine.start(model.params, PROMPTS, seed=0)
    conv, texts = engine.generate(model.params, conv, 20)
    for r in range(len(PROMPTS)):
        toks, gen, lps = conv.tokens[r], conv.generated_mask[r], conv.logprobs[r]
        logits = _full_logits(model, toks)
        idx = np.flatnonzero(gen)
        assert len(idx) > 0 and gen[idx[0]:].all()  # the reply follows the prompt
        np.testing.assert_array_equal(toks[idx], np.argmax(logits[idx - 1], axis=-1))
        np.testing.assert_allclose(lps[idx], jax.nn.log_softmax(logits[idx - 1])[np.arange(len(idx)), toks[idx]],
                                   atol=2e-4)
        assert texts[r] == model.tokenizer.decode(toks[idx], skip_special_tokens=True)


def test_sampled_logprobs_are_under_the_tempered_distribution(model, engine):
    T = 0.7
    conv = engine.start(model.params, PROMPTS, seed=3)
    conv, _ = engine.generate(model.params, conv, 16, {"temperature": T})
    for r in range(len(PROMPTS)):
        toks, gen, lps = conv.tokens[r], conv.generated_mask[r], conv.logprobs[r]
        idx = np.flatnonzero(gen)
        logp = jax.nn.log_softmax(_full_logits(model, toks)[idx - 1] / T)
        np.testing.assert_allclose(lps[idx], logp[np.arange(len(idx)), toks[idx]], atol=2e-4)


def test_same_seed_same_samples_in_any_chunking_other_seed_differs(model):
    def run(seed, chunk):
        e = Engine(model, decode_chunk=chunk)
        conv = e.start(model.params, PROMPTS, seed=seed)
        conv, texts = e.generate(model.params, conv, 24, {"temperature": 1.0, "top_k": 20})
        return [t.tolist() for t in conv.tokens], texts

    a, b, c = run(5, 16), run(5, 5), run(6, 16)
    assert a == b
    assert a[0] != c[0]


def test_multi_turn_continuation_equals_reprefilling_the_same_tokens(model, engine):
    conv = engine.start(model.params, PROMPTS, seed=1)
    conv, _ = engine.generate(model.params, conv, 12, {"temperature": 1.0})
    conv = engine.extend(conv, [{"role": "user", "content": "output: a b c"}, {"role": "user", "content": "ok"},
                                {"role": "user", "content": "command failed"}])
    fresh = dataclasses.replace(conv, rebuild=True)  # the same token state, cache rebuilt from scratch
    cont, _ = engine.generate(model.params, conv, 12, {"temperature": 1.0})
    ref, _ = engine.generate(model.params, fresh, 12, {"temperature": 1.0})
    assert [t.tolist() for t in cont.tokens] == [t.tolist() for t in ref.tokens]
    np.testing.assert_allclose(np.concatenate(cont.logprobs), np.concatenate(ref.logprobs), atol=1e-4)
    # The appended turn is exactly what the chat template renders for the whole conversation.
    text = model.tokenizer.decode(cont.tokens[1])
    assert text.startswith(model.tokenizer.apply_chat_template(cont.rows[1].messages[:3], tokenize=False)
                           .split("<|im_start|>assistant\n")[0])
    assert "<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n" in text


def test_stop_string_is_kept_and_nothing_after_it(model, engine):
    conv = engine.start(model.params, PROMPTS, seed=2)
    full, texts = engine.generate(model.params, conv, 30, {"temperature": 1.0})
    r = max(range(len(texts)), key=lambda i: len(texts[i]))
    text = texts[r]
    assert len(text) > 12
    tok = model.tokenizer
    for stop in (text[4:7], text[8:12]):
        conv = engine.start(model.params, PROMPTS, seed=2)
        got, got_texts = engine.generate(model.params, conv, 30, {"temperature": 1.0}, stop=(stop, "\x00never"))
        end = text.index(stop) + len(stop)
        assert got_texts[r] == text[:end]
        gen, lps = _reply(got, r)
        ref_gen, ref_lps = _reply(full, r)
        # The reply's tokens are the unstopped run's, up to the token that completes the stop string.
        k = next(i for i in range(len(ref_gen)) if stop in tok.decode(ref_gen[:i + 1], skip_special_tokens=True))
        np.testing.assert_array_equal(gen, ref_gen[:k + 1])
        np.testing.assert_allclose(lps, ref_lps[:k + 1], atol=1e-5)
        # The rolled-back tokens left no trace in the cache: continuing equals a rebuilt cache.
        nxt = engine.extend(got, [{"role": "user", "content": "next"}] * len(PROMPTS))
        a, _ = engine.generate(model.params, nxt, 6)
        b, _ = engine.generate(model.params, dataclasses.replace(nxt, rebuild=True), 6)
        assert [t.tolist() for t in a.tokens] == [t.tolist() for t in b.tokens]


def test_eos_ends_the_reply_on_that_token(model):
    e = Engine(model)
    conv = e.start(model.params, PROMPTS, seed=0)
    full, _ = e.generate(model.params, conv, 20)
    r = max(range(len(PROMPTS)), key=lambda i: len(_reply(full, i)[0]))
    gen0, _ = _reply(full, r)
    assert len(gen0) > 6
    e.eos_ids = (int(gen0[4]),)  # pretend the 5th token of the longest greedy reply is end-of-sequence
    conv = e.start(model.params, PROMPTS, seed=0)
    got, _ = e.generate(model.params, conv, 20)
    gen, _ = _reply(got, r)
    first = int(np.flatnonzero(gen0 == gen0[4])[0])
    np.testing.assert_array_equal(gen, gen0[:first + 1])


def test_rows_leave_the_batch_and_the_rest_continue_unchanged(model, engine):
    conv = engine.start(model.params, PROMPTS, seed=4)
    conv, _ = engine.generate(model.params, conv, 8)
    obs = [{"role": "user", "content": "done"}, None, {"role": "user", "content": "more"}]
    kept = engine.extend(conv, obs)
    assert kept.row_ids == [0, 2] and len(kept) == 2 and kept.cache.k[0].shape[0] == 4  # bucket kept
    a, _ = engine.generate(model.params, kept, 10)
    b, _ = engine.generate(model.params, dataclasses.replace(kept, rebuild=True), 10)
    assert [t.tolist() for t in a.tokens] == [t.tolist() for t in b.tokens]


def test_rolling_context_drops_the_oldest_turns_after_the_task(model):
    e = Engine(model, context_limit=160)
    conv = e.start(model.params, [PROMPTS[0]], seed=0)
    prompt_len = len(conv.tokens[0])
    turns = []
    for t in range(6):
        conv, _ = e.generate(model.params, conv, 12)
        obs = {"role": "user", "content": f"observation {t} " + "x" * 10}
        before = conv.rows[0].copy()
        conv = e.extend(conv, [obs])
        turns.append(before)
        assert len(conv.tokens[0]) < 160
    row = conv.rows[0]
    # The prompt (system + task) is intact; what follows is the newest whole turns, in order.
    assert conv.tokens[0][:prompt_len].tolist() == turns[0].tokens[:prompt_len]
    assert [m["role"] for m in row.messages[:2]] == ["system", "user"] and "observation 0" not in str(row.messages)
    assert "observation 5" in model.tokenizer.decode(conv.tokens[0])
    assert "observation 0" not in model.tokenizer.decode(conv.tokens[0])
    assert row.spans[0] == ("prompt", 0, prompt_len) and [k for k, _, _ in row.spans[1:3]] == ["generated", "appended"]
    # After the rebuild, generation equals a fresh start on the same tokens (greedy).
    a, _ = e.generate(model.params, conv, 8)
    fresh = e.start_tokens(model.params, [conv.tokens[0].tolist()], seed=0)
    b, _ = e.generate(model.params, fresh, 8)
    assert a.tokens[0].tolist() == b.tokens[0].tolist()


def test_slot_buckets_are_powers_of_two_and_three_quarters_of_the_next_one_from_384():
    assert sorted({slot_bucket(n) for n in range(1, 3073)}) == [64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072]
    assert [slot_bucket(n) for n in (64, 65, 384, 385, 512, 513, 769)] == [64, 128, 384, 512, 512, 768, 1024]
    assert all(n <= slot_bucket(n) < 1.5 * n for n in range(257, 5000))  # at most a third of a bucket is spare


def test_a_16_turn_episode_compiles_a_bounded_number_of_programs(model):
    e = Engine(model, context_limit=4096)
    prompts = [[{"role": "user", "content": f"task {i}"}] for i in range(6)]
    conv = e.start(model.params, prompts, seed=0)
    before = compiled_programs()
    rng = np.random.default_rng(0)
    for turn in range(16):
        conv, _ = e.generate(model.params, conv, int(rng.integers(4, 40)), {"temperature": 0.6},
                             stop=("</command>",))
        # Observations grow over the episode; one row finishes its episode every few turns.
        obs = [{"role": "user", "content": "y" * int(rng.integers(1, 10 * (turn + 1)))} for _ in conv.rows]
        if turn % 5 == 4 and len(conv.rows) > 1:
            obs[0] = None
        conv = e.extend(conv, obs)
    after = compiled_programs()
    model_programs = after["model"] - before["model"]
    small_programs = after["small"] - before["small"]
    # One row bucket (8: it never shrinks below), the slot buckets the cache went through (64 up to 3072 for
    # ~2100 slots: two per doubling): a decode and at most two prefill shapes per slot bucket, whatever the 16
    # different observation and reply lengths were.
    assert len(conv.rows) == 3 and conv.length > 256
    slot_buckets = len({slot_bucket(n) for n in range(1, conv.kv_valid.shape[1] + 1)})  # up to the final size
    assert slot_buckets <= 10 and model_programs <= 3 * slot_buckets, (model_programs, slot_buckets)
    assert small_programs <= slot_buckets + 3, (small_programs, slot_buckets)  # a growth per bucket, a few gathers


def test_bad_input_is_a_user_error(model, engine):
    with pytest.raises(UserError, match="no prompts"):
        engine.generate_text([], max_new_tokens=4)
    with pytest.raises(UserError, match="max_new_tokens"):
        engine.generate_text(["hi"], max_new_tokens=0)
    with pytest.raises(UserError, match="unknown generate option"):
        engine.generate_text(["hi"], max_new_tokens=4, temprature=0.5)
    with pytest.raises(UserError, match="unknown sampling option"):
        conv = engine.start(model.params, PROMPTS[:1])
        engine.generate(model.params, conv, 4, {"temp": 1.0})
    small = Engine(model, context_limit=32)
    with pytest.raises(UserError, match="context limit"):
        small.start_tokens(model.params, [[3] * 40])
    with pytest.raises(UserError, match="empty"):
        engine.start_tokens(model.params, [[3], []])
    with pytest.raises(UserError, match="stop strings"):
        engine.generate_text(["hi"], max_new_tokens=4, stop=("",))


def test_generate_text_through_the_model(model):
    prompt = model.chat_prompt(PROMPTS[1])
    a = model.generate([prompt, prompt], max_new_tokens=10)
    assert a[0] == a[1] and len(a[0]) > 0
    b = model.generate([prompt], max_new_tokens=10, temperature=1.0, seed=1)
    c = model.generate([prompt], max_new_tokens=10, temperature=1.0, seed=1)
    assert b == c
