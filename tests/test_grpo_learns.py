"""GRPO end to end on a tiny random model: engine samples, recorded log-probs, sharded learner."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from asyncres_jax.grpo.data import build_batch, whole_conversation
from asyncres_jax.grpo.step import GRPOHyper, Learner
from asyncres_jax.mesh import make_mesh
from asyncres_jax.model.generate import Engine
from asyncres_jax.model.tiny import tiny_model

TEMPERATURE = 1.0
PROMPTS = [[3, 4, 5], [10, 11], [20, 21, 22, 23]]
GROUP = 8


def rollout(engine, params, seed):
    """G samples of 3 tokens per prompt; returns each episode's segments and its first generated token."""
    prompts = [p for p in PROMPTS for _ in range(GROUP)]
    conv = engine.start_tokens(params, prompts, seed)
    conv, _ = engine.generate(params, conv, 3, {"temperature": TEMPERATURE})
    firsts = np.asarray([row.tokens[len(p)] for row, p in zip(conv.rows, prompts)])
    segments = [[whole_conversation(t, g, lp)] for t, g, lp in zip(conv.tokens, conv.generated_mask, conv.logprobs)]
    return segments, firsts


@pytest.fixture(scope="module")
def setup():
    """The tiny model and, per prompt, a target first token the model draws with probability about 0.15."""
    model = tiny_model(seed=0)
    targets = []
    for p in PROMPTS:
        probs = np.asarray(jax.nn.softmax(model.logits([p])[0, -1] / TEMPERATURE))
        targets.append(int(np.argmin(np.abs(probs - 0.15))))
    return model, Engine(model, context_limit=64), np.repeat(targets, GROUP)


def test_tiny_model_learns_a_one_turn_task(setup):
    model, engine, targets = setup
    mesh = make_mesh("2x2", jax.devices()[:4], cfg=model.config)  # data-parallel batch, model-parallel weights
    hp = GRPOHyper(lr=3e-3, weight_decay=0.0, epochs=2, minibatch_size=12, micro_batch_size=8,
                   temperature=TEMPERATURE, kl_coef=1e-3)
    learner = Learner(model.params, model.config, hp, mesh=mesh)
    rewards = []
    for step in range(16):
        segments, firsts = rollout(engine, learner.params, seed=step)
        r = (firsts == targets).astype(np.float32)
        rewards.append(r.mean())
        stats = learner.train(build_batch(segments, r.reshape(len(PROMPTS), GROUP)), seed=step)
        # on-policy first minibatch: the learner's recomputed log-probs are the engine's sampling log-probs
        assert abs(stats["first_ratio"] - 1) < 1e-3 and stats["first_abs_log_ratio"] < 1e-3
    early, late = np.mean(rewards[:4]), np.mean(rewards[-4:])
    assert late > early + 0.5 and late > 0.75, rewards
    # the reference stayed put and the policy drifted from it
    assert stats["kl"] > 0
