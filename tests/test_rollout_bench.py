"""`bench pool` on the simulator only (the threaded measurement is the benchmark's job, not a test's)."""

import json

from asyncres_jax.benchmarks import pool as bench


def test_bench_pool_json_rows_have_the_promised_fields(capsys):
    assert bench.main(["--json", "--no-threads", "--sim-updates", "40", "--warmup", "8",
                       "--schedules", "sync", "async-1", "delay-4"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["scenario"], r["schedule"]) for r in rows} == {
        (s, m) for s in ("paper", "heavy") for m in ("sync", "async-1", "delay-4")}
    for r in rows:
        for key in ("scenario", "mode", "max_staleness", "seconds_per_update", "ideal_seconds_per_update",
                    "utilization", "stale_fraction", "max_accepted_staleness", "wasted_fraction"):
            assert key in r
        assert r["max_accepted_staleness"] <= r["max_staleness"]
    by = {(r["scenario"], r["schedule"]): r for r in rows}
    assert by["heavy", "sync"]["seconds_per_update"] > 1.5 * by["heavy", "async-1"]["seconds_per_update"]
    assert by["paper", "delay-4"]["max_accepted_staleness"] == 4


def test_bench_pool_rejects_unknown_schedule(capsys):
    assert bench.main(["--schedules", "async-9"]) == 2
    assert "unknown schedule" in capsys.readouterr().err
