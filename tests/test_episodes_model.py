"""ModelPolicy: episodes played by a (tiny, random) language model through the real generation engine."""

from __future__ import annotations

import numpy as np
import pytest

from asyncres_jax.model.generate import Engine
from asyncres_jax.model.tiny import tiny_model
from asyncres_jax.rollout.episodes import EpisodeConfig, ModelPolicy, Policy, PolicyBatch, run_episodes
from test_episodes import FakeBackend, tasks


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


class EndsEarly(Policy):
    """The model writes every reply, but episode 0's first reply is replaced by done (so it leaves the batch)."""

    def __init__(self, inner: ModelPolicy):
        self.inner, self.perturbation_calls = inner, []

    def begin(self, conversations, seed):
        batch = self.inner.begin(conversations, seed)

        class Batch(PolicyBatch):
            turn = 0

            def step(self, rows, new_messages):
                replies = batch.step(rows, new_messages)
                self.turn += 1
                return ["<action>done</action>" if (r, self.turn) == (0, 1) else t for r, t in zip(rows, replies)]

            def token_states(self):
                return batch.token_states()

        return Batch()


def test_model_episodes_carry_token_state_and_finished_rows_leave(model):
    engine = Engine(model, context_limit=2048)
    calls = []
    policy = ModelPolicy(engine, model.params, max_new_tokens=6, sampling={"temperature": 1.0}, stop=(),
                         perturbation_fn=calls.append)  # records the rows; no perturbation
    cfg = EpisodeConfig(max_turns=3, max_new_tokens=6)
    results = run_episodes(EndsEarly(policy), tasks(3), FakeBackend(), cfg, seed=3)

    assert [r.turns for r in results] == [1, 3, 3] and results[0].end == "done"
    assert calls == [[0, 1, 2], [0, 1, 2], [1, 2]]  # the hook is asked again when episode 0 leaves
    for r in results:
        ids, mask, logprobs = r.tokens.ids, r.tokens.generated_mask, r.tokens.logprobs
        assert ids.shape == mask.shape == logprobs.shape and ids.dtype == np.int32
        # every reply generated exactly its tokens, each with a log-prob; prompt and observations have none
        assert 0 < mask.sum() <= 6 * r.turns
        assert np.all(logprobs[mask] <= 0) and np.all(logprobs[~mask] == 0)
        assert ids[0] == engine.encode("<|im_start|>")[0]
    # episode 0 left after one reply; the others' conversations hold three replies and two observations
    assert results[0].tokens.generated_mask.sum() <= 6
    assert len(results[1].tokens.ids) > len(results[0].tokens.ids)


def test_same_seed_same_episodes(model):
    engine = Engine(model, context_limit=2048)
    policy = ModelPolicy(engine, model.params, max_new_tokens=6, sampling={"temperature": 1.0}, stop=())
    cfg = EpisodeConfig(max_turns=2, max_new_tokens=6)
    a, b = (run_episodes(policy, tasks(3), FakeBackend(), cfg, seed=11) for _ in range(2))
    assert [r.transcript for r in a] == [r.transcript for r in b]
    assert all(np.array_equal(x.tokens.ids, y.tokens.ids) for x, y in zip(a, b))


def test_from_config_uses_the_episode_sampling(model):
    policy = ModelPolicy.from_config(Engine(model), model.params, EpisodeConfig(temperature=0.6, top_p=0.9,
                                                                               max_new_tokens=7))
    assert (policy.sampling.temperature, policy.sampling.top_p, policy.max_new_tokens) == (0.6, 0.9, 7)
    assert policy.stop == ("</command>", "</action>")


def test_first_reply_prefix_is_prompt_not_generation(model):
    engine = Engine(model, context_limit=2048)
    policy = ModelPolicy(engine, model.params, max_new_tokens=6, sampling={"temperature": 1.0}, stop=(),
                         first_reply_prefix="<command>")
    results = run_episodes(policy, tasks(3), FakeBackend(), EpisodeConfig(max_turns=2, max_new_tokens=6), seed=5)
    prefix = engine.encode("<command>")
    for r in results:
        replies = [m["content"] for m in r.transcript if m["role"] == "assistant"]
        assert replies[0].startswith("<command>")
        ids, mask = r.tokens.ids, r.tokens.generated_mask
        first = int(np.argmax(mask))  # where the first reply's generated tokens begin
        assert list(ids[first - len(prefix):first]) == prefix and not mask[:first].any()


class Floods(Policy):
    """The model writes every reply, but the runner is told each one was `<command>flood</command>`, so every
    observation is long and the engine's rolling context has to drop old turns."""

    def __init__(self, inner: ModelPolicy):
        self.inner = inner

    def begin(self, conversations, seed):
        batch = self.inner.begin(conversations, seed)

        class Batch(PolicyBatch):
            def step(self, rows, new_messages):
                return ["<command>flood</command>" for _ in batch.step(rows, new_messages)]

            def token_states(self):
                return batch.token_states()

        return Batch()


def test_long_episodes_stay_within_the_engines_rolling_context(model):
    engine = Engine(model, context_limit=1536)  # the prompt alone is about 900 tokens, an observation 350
    policy = ModelPolicy(engine, model.params, max_new_tokens=6, sampling={"temperature": 1.0}, stop=())
    cfg = EpisodeConfig(max_turns=4, max_new_tokens=6, output_cap=300)
    results = run_episodes(Floods(policy), tasks(3), FakeBackend(), cfg, seed=2)
    for r in results:
        assert (r.turns, r.end, len(r.commands)) == (4, "max_turns", 4)
        assert len(r.transcript) == 2 + 2 * 4  # the runner's transcript keeps every turn
        # all four turns would need over 2,000 tokens: the model's conversation dropped old turns, kept its prompt
        prompt = engine.encode(model.chat_prompt(r.transcript[:2]))
        assert len(r.tokens.ids) < 1536 and r.tokens.ids[:len(prompt)].tolist() == prompt
        assert r.tokens.generated_mask.sum() > 0


def test_command_per_line_gives_every_reply_one_command_and_its_opening_tag(model):
    engine = Engine(model, context_limit=2048)
    cfg = EpisodeConfig(max_turns=3, max_new_tokens=6, command_per_line=True)
    policy = ModelPolicy.from_config(engine, model.params, cfg)
    assert policy.command_per_line and "\n" in policy.stop and policy.first_reply_prefix == "<command>"
    results = run_episodes(policy, tasks(3), FakeBackend(), cfg, seed=5)
    opener = engine.encode("<command>")
    for r in results:
        replies = [m["content"] for m in r.transcript if m["role"] == "assistant"]
        assert len(replies) == r.turns == 3
        for reply in replies:  # the harness closed the tag: one line, one command
            assert reply == "<action>done</action>" or (
                reply.startswith("<command>") and reply.endswith("</command>") and "\n" not in reply)
        # every reply's generated tokens follow the opening tag, which is prompt, not generation
        ids, mask = r.tokens.ids, r.tokens.generated_mask
        starts = [k for k in range(1, len(mask)) if mask[k] and not mask[k - 1]]
        assert len(starts) == 3
        for k in starts:
            assert list(ids[k - len(opener):k]) == opener and not mask[k - len(opener):k].any()
