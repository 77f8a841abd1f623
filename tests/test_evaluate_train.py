"""Evaluation inside training, for real: a tiny random model plays generated tasks in bwrap sandboxes; the base
model is evaluated on validation and test before the first update, validation after every update, both splits
after the last, the final test report is compared pairwise with the base one, and the plot command draws it; a
second run pointed at the first (eval.base_from) reuses its base-model reports instead of playing them again."""

import os

import pytest

from asyncres_jax import evaluate as ev
from asyncres_jax import metrics, plot
from asyncres_jax.config import load_config
from asyncres_jax.envs.bwrap import host_problem
from asyncres_jax.envs.generator import generate
from asyncres_jax.trainer import train

pytestmark = [pytest.mark.xdist_group("train"), pytest.mark.bwrap, pytest.mark.slow]


@pytest.fixture(autouse=True)
def need_bwrap():
    problem = host_problem(430_000 if os.geteuid() == 0 else os.geteuid())
    if problem:
        pytest.skip(problem)


def test_training_evaluates_base_periodic_validation_and_final_test(tmp_path):
    generate(tmp_path / "tasks", n=40, seed=3)  # 2 val and 5 test tasks
    run = tmp_path / "run"
    overrides = [f"run_dir={run}", "model.name=tiny", f"tasks.dataset={tmp_path / 'tasks'}", "episode.max_turns=1",
                 "episode.max_new_tokens=4", "episode.context_limit=4096", "es.population=2",
                 "es.tasks_per_member=1", "es.updates=2", "checkpoint.every=1", "eval.every=1", "eval.val_tasks=1",
                 "eval.test_tasks=2", "eval.seeds=[42,43]", "eval.val_seeds=[42]"]
    assert train(load_config(None, overrides)) == 0

    evals = ev.read_evals(run)
    assert [(e["split"], e["update"]) for e in evals] == [("test", 0), ("test", 2), ("val", 0), ("val", 1),
                                                         ("val", 2)]
    for e in evals:
        assert e["episodes"] == (4 if e["split"] == "test" else 1) and 0 <= e["ci"][0] <= e["success"] <= e["ci"][1]
        assert e["tokens_per_second"] > 0 and e["source"] == str(run)
    final = evals[1]
    assert "compare" not in evals[0] and final["compare"]["tasks"] == 2 and final["compare"]["episodes"] == 4
    _, episodes = ev.load_report(run / "evals" / "test_00002.json")
    # the small summary keeps every episode's reward, so that committed eval.jsonl files compare runs task by task
    assert sorted(map(tuple, final["outcomes"])) == sorted((e.task_id, e.seed, e.reward) for e in episodes)
    assert sorted({(e.seed, e.task_id) for e in episodes}) == sorted({(s, e.task_id) for e in episodes
                                                                       for s in (42, 43)})
    assert (run / "evals" / "test_00000_transcripts.txt").read_text().startswith("--- system")
    assert [r["update"] for r in metrics.read(run)] == [1, 2]
    assert any((run / metrics.TB_DIR).glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (run / metrics.TRANSCRIPTS_DIR).iterdir()) == ["update_00001.txt",
                                                                                 "update_00002.txt"]

    assert plot.main([str(run), "--out", str(tmp_path / "plots")]) == 0
    assert all((tmp_path / "plots" / f).stat().st_size > 5000 for f in plot.FILES)

    # another row of a study, the same base model and evaluation: its update-0 reports are the first run's
    again = tmp_path / "again"
    cfg2 = load_config(None, [*(o for o in overrides if not o.startswith(("run_dir=", "es.updates="))),
                              f"run_dir={again}", "es.updates=1", f"eval.base_from={run}"])
    assert train(cfg2) == 0
    evals2 = {(e["split"], e["update"]): e for e in ev.read_evals(again)}
    for split in ("val", "test"):
        assert evals2[(split, 0)]["reused_from"] == str(run) and evals2[(split, 0)]["source"] == str(again)
        assert evals2[(split, 0)]["success"] == {(e["split"], e["update"]): e for e in evals}[(split, 0)]["success"]
    assert not (again / "evals" / "test_00000_transcripts.txt").exists()  # nothing played for update 0
    assert evals2[("test", 1)]["compare"]["episodes"] == 4  # paired with the reused base report
