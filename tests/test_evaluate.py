"""The evaluator: confidence intervals against references, per-seed/family/tier aggregation, paired comparison,
episodes played once per task and seed (a scripted policy on an in-memory sandbox), reports and the CLI's errors."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from asyncres_jax import evaluate as ev
from asyncres_jax.envs.sandbox import Backend, CommandResult, Grade, Sandbox
from asyncres_jax.evaluate import EpisodeOutcome
from asyncres_jax.rollout.episodes import EpisodeConfig, ScriptedPolicy


def outcomes(table: dict[str, list[float]], family=lambda t: t[0], difficulty=lambda t: "easy") -> list:
    """{task: [reward per seed 42, 43, ...]} -> EpisodeOutcomes."""
    return [EpisodeOutcome(t, family(t), difficulty(t), 42 + j, r, r / 2) for t, rs in table.items()
            for j, r in enumerate(rs)]


# ------------------------------------------------------------------------------------------- statistics


def test_wilson_matches_published_values():
    # statsmodels.stats.proportion.proportion_confint(k, n, method="wilson") for these
    assert ev.wilson(8, 10) == pytest.approx((0.4901625, 0.9433178), abs=1e-6)
    assert ev.wilson(0, 10) == pytest.approx((0.0, 0.2775328), abs=1e-6)
    assert ev.wilson(30, 100) == pytest.approx((0.2189489, 0.3958485), abs=1e-6)
    assert ev.wilson(1, 2, confidence=0.9)[0] < 0.5 < ev.wilson(1, 2, confidence=0.9)[1]


def test_task_bootstrap_matches_a_plain_numpy_percentile_bootstrap():
    rng = np.random.default_rng(1)
    per_task = rng.binomial(3, 0.3, size=60) / 3  # 60 tasks, mean over 3 seeds each
    idx = np.random.default_rng(2).integers(0, 60, size=(20_000, 60))
    ref = np.percentile(per_task[idx].mean(axis=1), [2.5, 97.5])
    lo, hi = ev.task_bootstrap_ci(per_task)
    assert lo == pytest.approx(ref[0], abs=0.01) and hi == pytest.approx(ref[1], abs=0.01)
    assert lo < per_task.mean() < hi
    assert ev.task_bootstrap_ci(np.zeros(5)) == (0.0, 0.0)  # degenerate: every resample is the same


def test_bootstrap_over_tasks_is_wider_than_wilson_when_a_tasks_seeds_agree():
    # 6 of 20 tasks always succeed, the rest never: 60 episodes but only 20 independent tasks
    s = ev.summarize(outcomes({f"t{i:02d}": [float(i < 6)] * 3 for i in range(20)}))
    assert s["success"] == pytest.approx(0.3)
    assert s["ci"][1] - s["ci"][0] > s["wilson"][1] - s["wilson"][0]
    assert s["ci"][0] < 0.3 < s["ci"][1]


def test_summary_per_seed_family_and_difficulty():
    table = {"a1": [1, 1, 0], "a2": [0, 0, 0], "b1": [1, 1, 1], "b2": [1, 0, 0]}
    s = ev.summarize(outcomes(table, difficulty=lambda t: "hard" if t.endswith("2") else "easy"))
    assert s["tasks"] == 4 and s["seeds"] == [42, 43, 44] and s["episodes"] == 12
    assert s["per_seed"] == {"42": 0.75, "43": 0.5, "44": 0.25}
    assert s["success"] == pytest.approx(6 / 12) == np.mean(list(s["per_seed"].values()))
    assert s["partial"] == pytest.approx(6 / 24)
    assert s["per_family"]["a"] == {**s["per_family"]["a"], "tasks": 2, "episodes": 6, "success": 2 / 6}
    assert s["per_family"]["b"]["success"] == pytest.approx(4 / 6)
    assert s["per_difficulty"]["easy"]["success"] == pytest.approx(5 / 6)
    assert s["per_difficulty"]["hard"]["success"] == pytest.approx(1 / 6)
    assert s["per_family"]["a"]["wilson"] == pytest.approx(ev.wilson(2, 6))


def test_paired_difference_finds_a_real_improvement_and_no_change():
    base = outcomes({f"t{i}": [float(i % 5 == 0)] * 3 for i in range(40)})
    same = ev.paired_difference(base, base)
    assert same["difference"] == 0 and same["p_value"] == 1.0 and same["ci"] == [0.0, 0.0]
    better = outcomes({f"t{i}": [float(i % 5 == 0 or i % 3 == 0)] * 3 for i in range(40)})
    d = ev.paired_difference(base, better)
    assert d["difference"] == pytest.approx(d["new"] - d["base"]) and d["difference"] > 0.2
    assert d["ci"][0] > 0 and d["p_value"] < 0.01 and d["tasks"] == 40 and d["episodes"] == 120
    # one task flipping is not significant
    one = outcomes({f"t{i}": [float(i % 5 == 0 or i == 1)] * 3 for i in range(40)})
    assert ev.paired_difference(base, one)["p_value"] > 0.5


# ------------------------------------------------------------------------------------------- running episodes


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    family: str
    difficulty: str
    instruction: str = "Create /home/user/ok."


class DictSandbox(Sandbox):
    """`touch ok` solves the task; grading says so."""

    def __init__(self):
        self.files = set()

    def run(self, command, timeout=None):
        if command.startswith("touch "):
            self.files.add(command.split()[1])
        return CommandResult("", 0, False, 0.0)

    def grade(self):
        ok = "ok" in self.files
        return Grade(reward=int(ok), partial=0.5 + 0.5 * ok, passed=1 + ok, total=2, log="")

    def close(self):
        pass


class DictBackend(Backend):
    name = "dict"

    def start(self, task):
        return DictSandbox()


def test_run_evaluation_plays_each_task_once_per_seed_and_writes_a_report(tmp_path):
    tasks = [Task(f"{fam}-{d}-{i}", fam, d) for i, (fam, d) in
             enumerate([("files", "easy"), ("files", "hard"), ("logs", "easy"), ("logs", "medium"), ("logs", "hard")])]
    # the files family is solved, logs is not: one script per task, the same for every seed
    scripts = [["touch ok"] if t.family == "files" else ["ls"] for t in tasks]
    episodes = ev.run_evaluation(ScriptedPolicy(scripts=scripts), tasks, DictBackend(), EpisodeConfig(max_turns=3),
                                 [42, 43], batch_size=5, transcripts=tmp_path / "tr.txt", samples=2)
    assert [(e.task_id, e.seed) for e in episodes] == [(t.name, s) for s in (42, 43) for t in tasks]
    r = ev.report(episodes, split="test", update=7, source="x")
    assert r["per_family"]["files"]["success"] == 1.0 and r["per_family"]["logs"]["success"] == 0.0
    assert r["per_seed"] == {"42": 0.4, "43": 0.4} and r["per_difficulty"]["medium"]["success"] == 0.0
    assert (tmp_path / "tr.txt").read_text().count("=== ") == 2  # two sampled transcripts

    ev.write_eval(tmp_path, r)
    ev.write_eval(tmp_path, {**r, "success": 0.5})  # the same update again (a resumed run): the last one counts
    assert [e["success"] for e in ev.read_evals(tmp_path)] == [0.5]
    data, again = ev.load_report(tmp_path / "evals" / "test_00007.json")
    assert again == episodes and data["ci"] == r["ci"]
    text = ev.format_report(r)
    assert "files" in text and "40.0%" in text and "bootstrap over tasks" in text


def test_filter_tasks_by_family_and_tier():
    tasks = [Task("a", "files", "easy"), Task("b", "logs", "hard"), Task("c", "files", "hard")]
    assert [t.name for t in ev.filter_tasks(tasks, ["files"], [])] == ["a", "c"]
    assert [t.name for t in ev.filter_tasks(tasks, [], ["hard"])] == ["b", "c"]
    assert ev.filter_tasks(tasks) == tasks
    tiered = [Task(f"{d}{i}", "f", d) for d in ("medium", "easy", "hard") for i in range(3)]
    assert [t.name for t in ev.spread(tiered, 4)] == ["medium0", "easy0", "hard0", "medium1"]
    with pytest.raises(ev.UserError, match="no task matches"):
        ev.filter_tasks(tasks, ["nope"])


def test_a_run_reuses_the_base_evaluation_of_a_run_with_the_same_settings(tmp_path):
    from asyncres_jax.config import load_config, to_yaml

    def a_run(name, *overrides):
        cfg = load_config(None, [f"run_dir={tmp_path / name}", "episode.temperature=0", *overrides])
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text(to_yaml(cfg))
        return cfg

    first = a_run("first")
    episodes = outcomes({"t1": [1.0], "t2": [0.0]})
    ev.write_eval(tmp_path / "first", ev.report(episodes, split="test", seeds=[42], update=0))

    # a GRPO row samples at 0.6 but evaluates greedily: the same evaluation as the greedy ES row's
    grpo = a_run("grpo", f"eval.base_from={tmp_path / 'first'}", "episode.temperature=0.6", "eval.temperature=0")
    r = ev.reused_base_report(grpo, tmp_path / "grpo", "test", [42])
    assert r["reused_from"] == str(tmp_path / "first") and r["episodes_detail"] == [dataclasses.asdict(e)
                                                                                   for e in episodes]
    assert ev.reused_base_report(grpo, tmp_path / "grpo", "val", [42]) is None  # not evaluated there: evaluate
    assert ev.reused_base_report(first, tmp_path / "first", "test", [42]) is None  # unset
    itself = dataclasses.replace(first, eval=dataclasses.replace(first.eval, base_from=str(tmp_path / "first")))
    assert ev.reused_base_report(itself, tmp_path / "first", "test", [42]) is None

    other = a_run("other", f"eval.base_from={tmp_path / 'first'}", "episode.max_turns=3")
    with pytest.raises(ev.UserError, match="other episode settings"):
        ev.reused_base_report(other, tmp_path / "other", "test", [42])
    seeds = a_run("seeds", f"eval.base_from={tmp_path / 'first'}")
    with pytest.raises(ev.UserError, match=r"used seeds \[42\], this run \[43\]"):
        ev.reused_base_report(seeds, tmp_path / "seeds", "test", [43])


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert ev.main(["--model", "x", "--compare", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text(json.dumps({"x": 1}))
    assert ev.main(["--model", "x", "--compare", str(tmp_path / "bad.json")]) == 2
    assert "not an evaluation report" in capsys.readouterr().err
    assert ev.main(["--model", "x", "--tasks", "-1"]) == 2
    with pytest.raises(SystemExit):
        ev.main(["--split", "test"])  # neither --checkpoint nor --model


def test_episodes_whose_sandbox_never_starts_are_left_out_of_the_evaluation(capsys):
    from asyncres_jax.envs.sandbox import SandboxStartError

    class BrokenFor(DictBackend):
        def start(self, task):
            if task.name.startswith("logs"):
                raise SandboxStartError(f"building the image of task {task.name} failed: exit 7")
            return super().start(task)

    tasks = [Task("files-0", "files", "easy"), Task("logs-1", "logs", "easy")]
    episodes = ev.run_evaluation(ScriptedPolicy(scripts=[["touch ok"], ["touch ok"]]), tasks, BrokenFor(),
                                 EpisodeConfig(max_turns=3), [42], batch_size=2, progress=False)
    assert [(e.task_id, e.reward) for e in episodes] == [("files-0", 1.0)]  # not a 0 for logs-1
    assert "1 episodes could not start and are left out" in capsys.readouterr().err
