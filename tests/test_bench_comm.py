"""bench comm: the communication model's volumes follow from N, P and R, and the replay timing runs (tiny tree)."""

import json

import pytest

from asyncres_jax.benchmarks import comm

pytestmark = pytest.mark.timeout(120)


def test_comm_reports_seed_and_weight_volumes_and_replay_time(capsys):
    assert comm.main(["--json", "--trees", "tiny", "--population", "4", "--repeats", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    tiny = out["measured_replay"]["tiny"]
    assert tiny["population"] == 4 and tiny["update_seconds"] > 0 and tiny["params"] == 81_728
    qwen = out["models"]["qwen2.5-7b"]
    assert [r["population"] for r in qwen["rows"]] == [8, 16, 32, 64, 128, 256]
    for row in qwen["rows"]:
        n, p = row["population"], qwen["params"]
        assert row["seeds_bytes_per_replica"] == n * 12 and row["weights_bytes_per_replica_f32"] == 4 * p
        assert row["per_update_total_bytes"]["64"] == {"seeds": 64 * n * 12, "weights_f32": 64 * 4 * p}
        # replay regenerates N members' noise over P weights: linear in N, so break-even speed falls as 1/N
        assert row["replay_seconds_this_cpu"] == pytest.approx(n * p * tiny["ns_per_member_param"] * 1e-9, rel=1e-2)
    speeds = [r["break_even_gbit_s"] for r in qwen["rows"]]
    assert speeds == sorted(speeds, reverse=True)
