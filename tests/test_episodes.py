"""The episode runner on an in-memory sandbox and a fake clock: turn and time limits, batching, clean-up."""

from __future__ import annotations

import collections
import dataclasses
import threading

import pytest

from asyncres_jax.envs.sandbox import Backend, CommandResult, Grade, Sandbox, SandboxStartError
from asyncres_jax.errors import UserError
from asyncres_jax.rollout import protocol
from asyncres_jax.rollout.episodes import (EpisodeConfig, Policy, PolicyBatch, ScriptedPolicy, fitness_of,
                                           format_transcript, played, run_episodes)


@dataclasses.dataclass(frozen=True)
class FakeTask:
    name: str
    instruction: str = "Create /home/user/ok."


class FakeClock:
    def __init__(self):
        self.now, self.lock = 1000.0, threading.Lock()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float):
        with self.lock:
            self.now += seconds


class FakeSandbox(Sandbox):
    """A pretend shell: `touch ok` makes the task pass, `sleep N` takes N seconds of the fake clock,
    `fail` exits 1, `flood` prints 10,000 characters; `wait` blocks until `barrier` lets every episode through."""

    def __init__(self, backend: "FakeBackend", task: FakeTask):
        self.backend, self.task, self.files, self.closed = backend, task, set(), 0

    def run(self, command, timeout=None):
        self.backend.log.append((self.task.name, command, timeout))
        word, *args = command.split()
        if word == "sleep":
            seconds = float(args[0])
            self.backend.clock.advance(min(seconds, timeout))
            if seconds > timeout:
                return CommandResult("", 137, True, timeout)
            return CommandResult("", 0, False, seconds)
        if word == "wait":
            self.backend.barrier.wait(timeout=10)
        if word == "touch":
            self.files.update(args)
        if word == "boom":
            raise OSError("the sandbox broke")
        if word == "fail":
            return CommandResult("no such thing", 1, False, 0.0)
        if word == "flood":
            return CommandResult("y" * 10_000, 0, False, 0.0)
        return CommandResult(f"ran {command}", 0, False, 0.0)

    def grade(self):
        self.backend.graded.append(self.task.name)
        if self.backend.grade_error:
            raise RuntimeError("grading broke")
        ok = "ok" in self.files
        return Grade(reward=int(ok), partial=0.5 + 0.5 * ok, passed=1 + ok, total=2, log="")

    def close(self):
        self.closed += 1


class FakeBackend(Backend):
    name = "fake"

    def __init__(self, clock=None, fail_start: str | None = None, grade_error=False, parties=1):
        self.clock, self.fail_start, self.grade_error = clock or FakeClock(), fail_start, grade_error
        self.barrier = threading.Barrier(parties)
        self.sandboxes, self.log, self.graded, self.lock = [], [], [], threading.Lock()

    def start(self, task):
        if task.name == self.fail_start:
            raise RuntimeError(f"cannot start {task.name}")
        sandbox = FakeSandbox(self, task)
        with self.lock:
            self.sandboxes.append(sandbox)
        return sandbox

    def all_closed(self) -> bool:
        return all(s.closed >= 1 for s in self.sandboxes)


class RecordingPolicy(Policy):
    """Wraps a policy: records the rows and messages of each call, optionally advances the clock per call."""

    def __init__(self, inner: Policy, clock: FakeClock | None = None, step_seconds=0.0, fail_at_call=None):
        self.inner, self.clock, self.step_seconds, self.fail_at_call = inner, clock, step_seconds, fail_at_call
        self.calls = []

    def begin(self, conversations, seed):
        inner, outer = self.inner.begin(conversations, seed), self

        class Batch(PolicyBatch):
            def step(self, rows, new_messages):
                outer.calls.append((list(rows), [list(m) for m in new_messages]))
                if len(outer.calls) == outer.fail_at_call:
                    raise RuntimeError("the policy broke")
                if outer.clock:
                    outer.clock.advance(outer.step_seconds)
                return inner.step(rows, new_messages)

        return Batch()


def tasks(n):
    return [FakeTask(f"t{i}") for i in range(n)]


def test_a_solved_episode_is_graded_and_has_the_protocol_transcript():
    backend = FakeBackend()
    [r] = run_episodes(ScriptedPolicy(["touch ok", "fail"]), tasks(1), backend, EpisodeConfig(), seed=0)
    assert (r.task_id, r.reward, r.partial, r.turns, r.end, r.graded) == ("t0", 1.0, 1.0, 3, "done", True)
    assert r.commands == ["touch ok", "fail"]
    assert [m["role"] for m in r.transcript] == ["system", "user"] + ["assistant", "user"] * 2 + ["assistant"]
    assert r.transcript[0]["content"] == protocol.SYSTEM_PROMPT
    assert r.transcript[1]["content"] == "Create /home/user/ok."
    assert r.transcript[2]["content"] == "<command>touch ok</command>"
    assert r.transcript[3]["content"] == "Command executed successfully. Output: ran touch ok (exit_code=0)"
    assert r.transcript[5]["content"] == "Command failed. Output: no such thing (exit_code=1)"
    assert r.transcript[6]["content"] == "<action>done</action>"
    assert r.tokens is None and backend.all_closed() and backend.graded == ["t0"]


@pytest.mark.parametrize("name, prompt", [("compact", protocol.COMPACT_SYSTEM_PROMPT),
                                          ("short", protocol.SHORT_SYSTEM_PROMPT)])
def test_a_shorter_system_prompt_replaces_the_protocol_rules_and_unknown_names_are_refused(name, prompt):
    [r] = run_episodes(ScriptedPolicy(["touch ok"]), tasks(1), FakeBackend(), EpisodeConfig(system_prompt=name))
    assert r.transcript[0] == {"role": "system", "content": prompt}
    assert r.transcript[1]["content"] == "Create /home/user/ok." and r.reward == 1.0
    assert len(protocol.SHORT_SYSTEM_PROMPT) < len(protocol.COMPACT_SYSTEM_PROMPT) < len(protocol.SYSTEM_PROMPT) * 0.6
    with pytest.raises(UserError, match="system_prompt='terse' is not one of full, compact, short"):
        EpisodeConfig(system_prompt="terse")


def test_the_compact_prompt_fits_a_first_turn_of_the_cpu_default_in_256_cache_slots():
    """Why the CPU default uses it: prompt + "<command>" + 48 generated tokens stay in the 256-slot bucket for every
    basics/easy task, where the full prompt needs the 384-slot one for all of them."""
    from asyncres_jax.envs.generator import draw
    from asyncres_jax.envs.generator.families import FAMILIES
    from asyncres_jax.model import named_model_path
    from asyncres_jax.model.generate import slot_bucket
    from asyncres_jax.model.gguf import load_gguf_tokenizer

    tok = load_gguf_tokenizer(named_model_path("smollm2-135m-instruct"))
    instructions = [draw(0, i, split, FAMILIES["basics"], "easy")[1].instruction
                    for i in range(40) for split in ("train", "test")]

    def slots(system_prompt: str, instruction: str) -> int:
        text = tok.apply_chat_template(protocol.first_messages(instruction, system_prompt), tokenize=False,
                                       add_generation_prompt=True) + protocol.COMMAND_OPEN
        return len(tok(text, add_special_tokens=False)["input_ids"]) + 48

    assert max(slot_bucket(slots("compact", i)) for i in instructions) == 256
    assert min(slot_bucket(slots("full", i)) for i in instructions) == 384


def test_invalid_replies_get_the_nudge_and_count_as_turns():
    policy = RecordingPolicy(ScriptedPolicy(["I am not sure", "<command>touch ok</command>"], wrap=False))
    [r] = run_episodes(policy, tasks(1), FakeBackend())
    assert r.turns == 3 and r.reward == 1.0 and r.commands == ["touch ok"]
    assert r.transcript[3] == {"role": "user", "content": protocol.NUDGE}
    # what the policy was sent: nothing new on turn 1, the nudge on turn 2, the observation on turn 3
    assert [c[1][0] for c in policy.calls] == [
        [], [{"role": "user", "content": protocol.NUDGE}],
        [{"role": "user", "content": "Command executed successfully. Output: ran touch ok (exit_code=0)"}],
    ]


def test_turn_limit_ends_the_episode_and_it_is_still_graded():
    backend = FakeBackend()
    [r] = run_episodes(ScriptedPolicy(["echo"] * 40), tasks(1), backend, EpisodeConfig(max_turns=16))
    assert (r.turns, r.end, r.graded, r.reward, r.partial) == (16, "max_turns", True, 0.0, 0.5)
    assert len(r.commands) == 16 and len(backend.log) == 16
    assert r.transcript[-1]["content"].startswith("Command executed successfully")


def test_episode_time_limit_scores_zero_and_skips_grading():
    clock = FakeClock()
    backend = FakeBackend(clock)
    policy = RecordingPolicy(ScriptedPolicy(["touch ok"] + ["echo"] * 10), clock, step_seconds=100.0)
    [r] = run_episodes(policy, tasks(1), backend, EpisodeConfig(episode_timeout_s=300), clock=clock)
    # replies at t=100, 200 run; the reply finished at t=300 is over the limit and is not acted on
    assert (r.turns, r.end, r.timed_out, r.graded, r.reward, r.partial) == (3, "timeout", True, False, 0.0, 0.0)
    assert r.commands == ["touch ok", "echo"] and r.grade is None
    assert backend.graded == [] and backend.all_closed()
    assert r.timings.total == 300.0 and r.timings.generate == 300.0


def test_commands_get_the_per_command_timeout_capped_by_the_episode_budget():
    clock = FakeClock()
    backend = FakeBackend(clock)
    cfg = EpisodeConfig(command_timeout_s=30, episode_timeout_s=100)
    script = ["sleep 1000", "sleep 25", "sleep 25", "sleep 1000"]
    [r] = run_episodes(ScriptedPolicy(script), tasks(1), backend, cfg, clock=clock)
    assert [t for _, _, t in backend.log] == [30, 30, 30, 20]  # the last one has only 100 - 30 - 25 - 25 left
    assert r.transcript[3]["content"] == "Command timed out after 30 seconds and was killed. Output:  (exit_code=137)"
    assert r.transcript[5]["content"].startswith("Command executed successfully")
    assert (r.end, r.turns, r.graded, r.reward) == ("timeout", 4, False, 0.0)


def test_a_command_timeout_alone_does_not_end_the_episode():
    clock = FakeClock()
    [r] = run_episodes(ScriptedPolicy(["sleep 1000", "touch ok"]), tasks(1), FakeBackend(clock),
                       EpisodeConfig(command_timeout_s=5), clock=clock)
    assert (r.end, r.reward, r.turns) == ("done", 1.0, 3)
    assert "timed out after 5 seconds" in r.transcript[3]["content"]


def test_observations_are_capped():
    [r] = run_episodes(ScriptedPolicy(["flood"]), tasks(1), FakeBackend(), EpisodeConfig(output_cap=100))
    obs = r.transcript[3]["content"]
    assert obs.startswith("Command executed successfully. Output: " + "y" * 100 + "\n[output truncated")
    assert obs.endswith("(exit_code=0)") and len(obs) < 250


def test_a_batch_takes_one_policy_call_per_turn_and_finished_episodes_leave():
    echo, ok = "<command>echo</command>", "<command>touch ok</command>"
    scripts = [[ok], [echo, echo, echo, ok], [echo, "I forgot the tags"]]
    policy = RecordingPolicy(ScriptedPolicy(scripts=scripts, wrap=False))
    backend = FakeBackend()
    results = run_episodes(policy, tasks(3), backend, EpisodeConfig(max_turns=4), seed=7)
    assert [c[0] for c in policy.calls] == [[0, 1, 2], [0, 1, 2], [1, 2], [1]]
    assert [r.task_id for r in results] == ["t0", "t1", "t2"]
    assert [(r.turns, r.end, r.reward) for r in results] == [(2, "done", 1.0), (4, "max_turns", 1.0),
                                                             (3, "done", 0.0)]
    assert results[2].transcript[-2]["content"] == protocol.NUDGE
    assert backend.all_closed() and sorted(backend.graded) == ["t0", "t1", "t2"]
    # each episode is graded as soon as it ends: t0 before t1 (which still plays on)
    assert backend.graded.index("t0") < backend.graded.index("t1")


def test_the_commands_of_a_turn_run_in_parallel():
    # every sandbox's `wait` blocks until all 8 are inside it at once (or fails after 10 s)
    backend = FakeBackend(parties=8)
    results = run_episodes(ScriptedPolicy(["wait", "touch ok"]), tasks(8), backend, EpisodeConfig(max_workers=8))
    assert [r.reward for r in results] == [1.0] * 8
    assert all("exit_code=0" in r.transcript[3]["content"] for r in results)


@pytest.mark.parametrize("where", ["policy", "command", "grade", "start"])
def test_every_sandbox_is_closed_when_something_fails(where):
    backend = FakeBackend(grade_error=where == "grade", fail_start="t2" if where == "start" else None)
    script = ["echo", "boom" if where == "command" else "echo"]
    policy = RecordingPolicy(ScriptedPolicy(script), fail_at_call=2 if where == "policy" else None)
    with pytest.raises((RuntimeError, OSError), match="broke|cannot start"):
        run_episodes(policy, tasks(4), backend, EpisodeConfig(max_workers=2))
    assert len(backend.sandboxes) == (3 if where == "start" else 4)
    assert backend.all_closed()


def test_config_validation_and_sections():
    with pytest.raises(UserError, match="max_turns=0"):
        EpisodeConfig(max_turns=0)
    with pytest.raises(UserError, match="command_timeout_s"):
        EpisodeConfig(command_timeout_s=0)
    with pytest.raises(UserError, match="top_p"):
        EpisodeConfig(top_p=1.5)
    from asyncres_jax.config import EpisodeSection, SandboxSection

    cfg = EpisodeConfig.from_sections(EpisodeSection(max_turns=4, command_timeout_s=7.0),
                                      SandboxSection(max_parallel=3))
    assert (cfg.max_turns, cfg.command_timeout_s, cfg.max_workers, cfg.episode_timeout_s) == (4, 7.0, 3, 300.0)


def test_no_tasks_no_episodes():
    assert run_episodes(ScriptedPolicy(["ls"]), [], FakeBackend()) == []


class FlakyBackend(FakeBackend):
    """start() raises SandboxStartError for a task the first `failures[name]` times it is asked."""

    def __init__(self, failures: dict[str, int]):
        super().__init__()
        self.failures, self.tries = dict(failures), collections.Counter()

    def start(self, task):
        with self.lock:
            self.tries[task.name] += 1
            if self.tries[task.name] <= self.failures.get(task.name, 0):
                raise SandboxStartError(f"building the image of task {task.name} failed: no space left")
        return super().start(task)


def test_a_sandbox_that_does_not_start_is_retried_then_an_error_kept_out_of_fitness():
    backend = FlakyBackend({"t1": 2, "t2": 3})  # t1 starts on its third try; t2 never (1 + 2 retries)
    results = run_episodes(ScriptedPolicy(["touch ok", "<action>done</action>"]), tasks(3), backend,
                           EpisodeConfig(start_retries=2))
    assert backend.tries == {"t0": 1, "t1": 3, "t2": 3}
    assert [(r.task_id, r.end, r.error is None, r.graded) for r in results] == [
        ("t0", "done", True, True), ("t1", "done", True, True), ("t2", "error", False, False)]
    assert "t2 failed: no space left" in results[2].error and results[2].turns == 0
    assert "not played" in format_transcript(results[2])
    assert [r.task_id for r in played(results)] == ["t0", "t1"]
    assert fitness_of(results, "binary") == 1.0  # t2's missing episode is not a 0
    assert backend.all_closed()
    with pytest.raises(SandboxStartError, match="none of the member's 1 episodes could start"):
        fitness_of([results[2]], "binary")


def test_the_reward_is_the_verifiers_named_metric_when_configured():
    class MetricSandbox(FakeSandbox):
        def grade(self):
            return Grade(reward=0.5, partial=1.0, passed=2, total=2, log="", rewards={"style": 0.0, "tests": 1.0})

    class MetricBackend(FakeBackend):
        def start(self, task):
            return MetricSandbox(self, task)

    policy = ScriptedPolicy(["<action>done</action>"])
    [default] = run_episodes(policy, tasks(1), MetricBackend())
    [named] = run_episodes(policy, tasks(1), MetricBackend(), EpisodeConfig(reward_key="tests"))
    assert (default.reward, named.reward, dict(named.grade.rewards)) == (0.5, 1.0, {"style": 0.0, "tests": 1.0})
