"""`bench pool` on the simulator only (the threaded measurement is the benchmark's job, not a test's)."""

import json
import pathlib

import pytest

from asyncres_jax.benchmarks import pool as bench

PILOT = pathlib.Path(__file__).resolve().parents[1] / "docs" / "pilot"  # the pilot study: every ES row, three seeds


def test_bench_pool_json_rows_have_the_promised_fields(capsys):
    schedules = ("sync", "async-1-drop", "async-1", "async-1-paced", "delay-4")
    assert bench.main(["--json", "--no-threads", "--sim-updates", "40", "--warmup", "8",
                       "--schedules", *schedules]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["scenario"], r["schedule"]) for r in rows} == {
        (s, m) for s in ("paper", "heavy", "correlated") for m in schedules}
    for r in rows:
        for key in ("scenario", "mode", "max_staleness", "seconds_per_update", "ideal_seconds_per_update",
                    "utilization", "stale_fraction", "max_accepted_staleness", "wasted_fraction", "staleness_hist",
                    "cancelled_per_update", "dropped_per_update"):
            assert key in r
        assert r["max_accepted_staleness"] <= r["max_staleness"]
        split = r["useful_fraction"] + r["cancelled_fraction"] + r["dropped_fraction"] + r["idle_fraction"]
        assert split == pytest.approx(1.0, abs=0.05)  # up to the jobs running at either end of the window
    by = {(r["scenario"], r["schedule"]): r for r in rows}
    assert by["heavy", "sync"]["seconds_per_update"] > 1.5 * by["heavy", "async-1"]["seconds_per_update"]
    assert by["paper", "delay-4"]["max_accepted_staleness"] == 4
    # The variants differ as promised: drop wastes dropped work, cancel cancelled work, paced neither.
    drop, cancel, paced = (by["heavy", s] for s in ("async-1-drop", "async-1", "async-1-paced"))
    assert drop["dropped_fraction"] > 0.1 and drop["cancelled_fraction"] == 0
    assert cancel["cancelled_fraction"] > 0 and cancel["dropped_fraction"] == 0
    assert paced["cancelled_fraction"] == paced["dropped_fraction"] == 0
    # Async rows carry the model of the best async schedule on their scenario: 8% above the ideal is out of
    # reach at K = 1 with heavy-tailed jobs, nothing is lost with the paper's spread.
    assert "best_async_vs_ideal" not in by["heavy", "sync"]
    assert by["paper", "async-1"]["best_async_vs_ideal"] == 1.0
    assert 1.1 < cancel["best_async_vs_ideal"] == drop["best_async_vs_ideal"] < cancel["slowdown_vs_ideal"]
    # The correlated scenario compares each schedule's update direction with sync's (same seeds).
    sync = by["correlated", "sync"]
    assert sync["update_cosine_vs_sync"] == pytest.approx(1.0) and sync["duration_fitness_correlation"] < -0.3
    for m in schedules:
        assert -1 <= by["correlated", m]["update_cosine_vs_sync"] <= 1
        assert "duration_direction_component" in by["correlated", m]


def test_bench_pool_rejects_unknown_schedule(capsys):
    assert bench.main(["--schedules", "async-9"]) == 2
    assert "unknown schedule" in capsys.readouterr().err


def test_bench_pool_measures_duration_against_fitness_in_committed_runs(capsys, tmp_path):
    assert bench.main(["--real", str(PILOT), "--json"]) == 0
    rows = {r["runs"]: r for r in json.loads(capsys.readouterr().out)}
    assert {"es_sync", "es_async1", "all"} <= set(rows)
    assert rows["all"]["updates"] == sum(r["updates"] for k, r in rows.items() if k != "all")
    assert -1 <= rows["all"]["r_tokens_per_episode_vs_fitness"] <= 1
    assert bench.main(["--real", str(tmp_path)]) == 2
    assert "no ES run with metrics.jsonl" in capsys.readouterr().err
