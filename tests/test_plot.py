"""`python -m asyncres_jax.plot` on two tiny fake runs: every PNG is written and decodes, the table holds the
runs' numbers (runs sharing a label as one method's seeds), and bad input is one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from asyncres_jax import plot
from asyncres_jax.evaluate import wilson


def fake_run(root, name, n_updates, stale_share, val, test):
    run = root / name
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as f:
        for u in range(1, n_updates + 1):
            stale = 1 if u % stale_share == 0 else 0
            f.write(json.dumps({"update": u, "fitness_mean": 0.1 * u, "fitness_std": 0.05, "fitness_min": 0.05 * u,
                                "fitness_max": 0.2 * u, "staleness_hist": {"0": 4 - stale, "1": stale},
                                "utilization": 0.7 + 0.01 * u, "update_seconds": 30.0, "elapsed_seconds": 30.0 * u,
                                "tokens": 3000, "episodes": 8,
                                "phases": {"prefill": 18.0, "decode": 6.0, "commands": 2.0, "waiting": 4.0}}) + "\n")
    with open(run / "eval.jsonl", "w") as f:
        for split, rows in (("val", val), ("test", test)):
            for u, s in rows:
                compare = {"difference": s - 0.1, "p_value": 0.04} if split == "test" and u else None
                f.write(json.dumps({"split": split, "update": u, "success": s, "ci": [s - 0.1, s + 0.1],
                                    "wilson": [s - 0.12, s + 0.12], "per_seed": {"42": s - 0.02, "43": s + 0.02},
                                    "elapsed_seconds": 30.0 * u, **({"compare": compare} if compare else {})}) + "\n")
    return run


@pytest.fixture
def runs(tmp_path):
    a = fake_run(tmp_path, "sync", 4, 99, [(0, 0.2), (2, 0.25), (4, 0.3)], [(0, 0.1), (4, 0.28)])
    b = fake_run(tmp_path, "async1", 4, 2, [(0, 0.2), (2, 0.3), (4, 0.35)], [(0, 0.1), (4, 0.33)])
    return a, b


def test_plot_writes_every_chart_for_several_runs(runs, tmp_path, capsys):
    out = tmp_path / "plots"
    results = tmp_path / "results.md"  # a document with a table to regenerate between the markers
    results.write_text(f"# Results\n\ntext before\n{plot.TABLE_BEGIN}\nold table\n{plot.TABLE_END}\ntext after\n")
    assert plot.main([str(runs[0]), str(runs[1]), "--out", str(out), "--labels", "Sync", "Async-1",
                      "--table", str(results)]) == 0
    import matplotlib.image as mpimg

    for name in plot.FILES:
        png = out / name
        assert png.stat().st_size > 5000, name
        assert mpimg.imread(png).shape[0] > 100  # decodes as an image
    table = results.read_text()
    assert table.startswith("# Results\n\ntext before\n") and table.endswith("text after\n")
    assert "old table" not in table
    # one run's CI is its report's bootstrap over tasks ("ci"), not the Wilson interval beside it
    assert "| base model | 0 | 0 | 10.0% [0.0%, 20.0%] | 8.0% / 12.0% | - |" in table
    assert ("| Sync | 4 | 32 | 28.0% [18.0%, 38.0%] | 26.0% / 30.0% | +18.0 pts (p = 0.04) | - | 20.0% -> 30.0% | "
            "2.0 min | 100 |") in table
    assert "| Async-1 | 4 | 32 | 33.0% [23.0%, 43.0%] |" in table
    assert "| +23.0 pts (p = 0.04) | n/a |" in table  # summaries without per-episode outcomes: no pairing
    assert str(out / "fitness.png") in capsys.readouterr().out


def test_a_grpo_run_plots_beside_es_runs(runs, tmp_path):
    grpo = tmp_path / "grpo"
    grpo.mkdir()
    (grpo / "metrics.jsonl").write_text("".join(json.dumps(
        {"update": u, "reward_mean": 0.2 * u, "episodes": 16, "tokens": 400, "rollout_seconds": 30.0,
         "train_seconds": 80.0, "elapsed_seconds": 110.0 * u}) + "\n" for u in (1, 2)))
    (grpo / "eval.jsonl").write_text(json.dumps({"split": "test", "update": 2, "success": 0.3, "ci": [0.2, 0.4],
                                                 "wilson": [0.2, 0.4], "elapsed_seconds": 220.0}) + "\n")
    results = tmp_path / "t.md"
    assert plot.main([str(runs[0]), str(grpo), "--out", str(tmp_path / "p"), "--table", str(results)]) == 0
    assert all((tmp_path / "p" / f).stat().st_size > 5000 for f in plot.FILES)
    assert "| grpo | 2 | 32 | 30.0% [20.0%, 40.0%] |" in results.read_text()


def test_phases_are_a_stacked_bar_per_update_and_runs_without_them_are_left_out(runs, tmp_path):
    import matplotlib.image as mpimg

    (runs[1] / "metrics.jsonl").write_text("".join(  # a run from before phases were recorded
        json.dumps({k: v for k, v in json.loads(line).items() if k != "phases"}) + "\n"
        for line in (runs[1] / "metrics.jsonl").read_text().splitlines()))
    one = plot.plot([plot.load_run(runs[0])], tmp_path / "one")[-1]
    both = plot.plot([plot.load_run(r) for r in runs], tmp_path / "both")[-1]
    assert one.name == both.name == "phases.png"
    assert mpimg.imread(both).shape == mpimg.imread(one).shape  # one panel: the run without phases has none
    none = plot.plot([plot.load_run(runs[1])], tmp_path / "none")[-1]
    assert none.stat().st_size > 5000


def test_staleness_counts_sum_over_updates(runs):
    assert plot.staleness_counts(plot.load_run(runs[1])["updates"]) == {0: 14, 1: 2}


def test_default_out_is_inside_the_first_run_and_errors_are_one_line(runs, tmp_path, capsys):
    assert plot.main([str(runs[0])]) == 0
    assert (runs[0] / "plots" / "success_vs_time.png").is_file()
    assert plot.main([str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert plot.main([str(tmp_path / "empty")]) == 2
    assert plot.main([str(runs[0]), "--labels", "a", "b"]) == 2
    assert "one per run" in capsys.readouterr().err


def test_training_time_leaves_out_held_out_evaluations_but_not_reused_ones(runs, tmp_path):
    run = plot.load_run(runs[0])
    run["evals"] = [{"split": "test", "update": 0, "seconds": 50.0, "elapsed_seconds": 50.0},
                    {"split": "val", "update": 0, "seconds": 10.0, "elapsed_seconds": 60.0, "reused_from": "x"},
                    {"split": "val", "update": 2, "seconds": 20.0, "elapsed_seconds": 140.0}]
    assert plot.training_seconds(run, 100.0) == 50.0  # the update-0 test evaluation took 50 of the 100 s
    assert plot.training_seconds(run, 200.0) == 130.0  # and validation at update 2 another 20; the reused one 0
    assert plot.training_seconds(run, 30.0) == 30.0


def test_runs_sharing_a_label_are_one_method_over_training_seeds(runs, tmp_path):
    a, b = runs
    for run, seed in ((a, 0), (b, 1)):
        (run / "config.yaml").write_text(f"seed: {seed}\nrun_dir: {run}\n")
        lines = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
        (run / "eval.jsonl").write_text("".join(json.dumps(e | {"episodes": 50}) + "\n" for e in lines))
    loaded = [plot.load_run(a), plot.load_run(b)]
    for run in loaded:
        run["name"] = "ES"
    md = plot.table(loaded)
    rows = [line for line in md.splitlines() if line.startswith("| ES |")]
    assert len(rows) == 1  # one method, one row
    # mean of 28% and 33%; the Wilson CI pools the 100 episodes (30.5 successes); each seed's value beside it
    lo, hi = wilson(0.28 * 50 + 0.33 * 50, 100)
    assert f"| ES | 4 | 32 | 30.5% [{100 * lo:.1f}%, {100 * hi:.1f}%] | 28.0% (seed 0) / 33.0% (seed 1) |" in rows[0]
    assert "+20.5 pts (p = 0.04, 0.04) | - | 20.0% -> 32.5% | 2.0 min | 100 |" in rows[0]  # no method before it
    # the charts draw the method once: the mean over its seeds, the test bar the table's pooled CI
    assert plot._label("ES", loaded) == "ES (mean of 2 seeds)"
    assert plot._test_points(loaded, "update") == [(0, pytest.approx(0.1), *wilson(0.1 * 100, 100)),
                                                   (4, pytest.approx(0.305), lo, hi)]
    val = plot._val_points(loaded, "update")
    assert val[:, 0].tolist() == [0, 2, 4] and val[:, 1] == pytest.approx([0.2, 0.275, 0.325])
    x, mean, low, high = plot.mean_over_seeds([([1, 2, 3], [0.1, 0.2, 0.3]), ([2, 3], [0.4, 0.5])])
    assert x.tolist() == [2, 3] and mean == pytest.approx([0.3, 0.4]) and low.tolist() == [0.2, 0.3]
    assert len(plot.plot(loaded, tmp_path / "plots")) == len(plot.FILES)


def test_methods_are_compared_task_by_task_with_the_first_one(runs, tmp_path):
    """With per-episode outcomes in eval.jsonl, a method's CI is the bootstrap over the per-task means of its seeds,
    and each later method is paired with the first one task by task (the study's question: async vs sync)."""
    from asyncres_jax.evaluate import task_bootstrap_ci

    tasks = [f"t{i:02d}" for i in range(20)]

    def seed_run(name, seed, solved):
        run = tmp_path / f"{name}_{seed}"
        run.mkdir()
        (run / "config.yaml").write_text(f"seed: {seed}\n")
        (run / "metrics.jsonl").write_text(json.dumps({"update": 4, "elapsed_seconds": 60.0, "episodes": 32}) + "\n")
        out = [[t, 42, float(t in solved)] for t in tasks]
        (run / "eval.jsonl").write_text(json.dumps({"split": "test", "update": 4, "success": len(solved) / 20,
                                                    "outcomes": out, "per_seed": {"42": len(solved) / 20}}) + "\n")
        return plot.load_run(run)

    # sync solves t00-t04 in both seeds; async t00-t14 in one seed and t00-t09 in the other
    sync = [seed_run("sync", s, tasks[:5]) for s in (0, 1)]
    async1 = [seed_run("async", 0, tasks[:15]), seed_run("async", 1, tasks[:10])]
    for run in sync:
        run["name"] = "ES sync"
    for run in async1:
        run["name"] = "ES async"
    md = plot.table(sync + async1).splitlines()
    assert "| vs ES sync (paired) |" in md[0]
    sync_row, async_row = md[2], md[3]
    lo, hi = task_bootstrap_ci(np.array([1.0] * 10 + [0.5] * 5 + [0.0] * 5))  # async's per-task means
    assert f"| 62.5% [{100 * lo:.1f}%, {100 * hi:.1f}%] | 75.0% (seed 0) / 50.0% (seed 1) |" in async_row
    assert sync_row.split(" | ")[6] == "-"  # the reference itself
    # per task: +1 on t05-t09, +0.5 on t10-t14, 0 elsewhere: +37.5 points; 10 tasks moved, all the same way, so
    # only the sign flips that keep all 10 (2 in 2^10) reach it: p ~ 0.002
    c = plot.versus([r["evals"][0] for r in async1], [r["evals"][0] for r in sync])
    assert c["tasks"] == 20 and c["difference"] == pytest.approx(0.375) and 0.001 < c["p_value"] < 0.004
    cell = async_row.split(" | ")[6]
    assert cell.startswith("+37.5 pts [+") and cell.endswith(f"(p = {c['p_value']:.3f})")
