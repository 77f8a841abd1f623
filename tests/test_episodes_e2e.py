"""End to end: SmolLM2-135M-Instruct plays generated easy tasks on bwrap through run_episodes.

Rewards are whatever the model earns. SmolLM2-135M ignores the tag format when left alone (it answers in
markdown code blocks), so its first reply is started for it with a short thought and an open <command> tag
(ModelPolicy.first_reply_prefix); the command itself, and every later reply, is the model's own.
"""

from __future__ import annotations

import pytest

from asyncres_jax.envs import make_backend
from asyncres_jax.envs.generator import generate
from asyncres_jax.envs.task import load_dataset
from asyncres_jax.rollout.episodes import EpisodeConfig, ModelPolicy, run_episodes

pytestmark = [pytest.mark.slow, pytest.mark.bwrap]

PREFIX = "<think>I will look at the files first.</think>\n<command>"


@pytest.fixture(scope="module")
def easy_tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    generate(root / "ds", n=60, seed=1)
    easy = [t for t in load_dataset(root / "ds") if t.difficulty == "easy"]
    return [easy[0], easy[3], easy[6]]


def test_smollm2_plays_generated_tasks_on_bwrap(easy_tasks):
    from asyncres_jax.model import load_model
    from asyncres_jax.model.generate import Engine

    model = load_model("smollm2-135m-instruct")
    policy = ModelPolicy(Engine(model, context_limit=2048), model.params, max_new_tokens=24,
                         sampling={"temperature": 0.0}, first_reply_prefix=PREFIX)
    # No wall-clock cut: on a loaded 2-core CI machine the model's turns alone can exceed the paper's 300 s.
    cfg = EpisodeConfig(max_turns=2, max_new_tokens=24, command_timeout_s=10, episode_timeout_s=3600)
    with make_backend("bwrap") as backend:
        results = run_episodes(policy, easy_tasks, backend, cfg, seed=0)

    for r, task in zip(results, easy_tasks):
        print(f"\n{r.task_id}: reward={r.reward} partial={r.partial:.2f} end={r.end} commands={r.commands}")
        assert r.task_id == task.name and r.graded and r.reward in (0.0, 1.0) and 0 <= r.partial <= 1
        assert 1 <= r.turns <= 2 and r.transcript[1]["content"] == task.instruction
        replies = [m["content"] for m in r.transcript if m["role"] == "assistant"]
        assert len(replies) == r.turns and replies[0].startswith(PREFIX)
        assert r.tokens.generated_mask.sum() > 0 and r.timings.generate > 0 and r.timings.grade > 0
    # the model's commands really ran in the sandboxes: their observations follow them in the protocol's words
    ran = [(r, i) for r in results for i, m in enumerate(r.transcript) if m["role"] == "assistant"
           and "</command>" in m["content"] and i + 1 < len(r.transcript)]
    assert ran, "no reply of the model held a complete command"
    for r, i in ran:
        obs = r.transcript[i + 1]["content"]
        assert obs.startswith(("Command executed successfully. Output:", "Command failed. Output:",
                               "Command timed out after")) and obs.endswith(")")
    assert sum(len(r.commands) for r in results) >= 1
