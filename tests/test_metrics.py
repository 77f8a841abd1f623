"""The metrics sinks: metrics.jsonl lines, TensorBoard event files a reader can parse, transcript samples,
the progress bar, and the cut-back of all of it on resume."""

from __future__ import annotations

import pathlib
import struct
from types import SimpleNamespace

import numpy as np
import pytest

from asyncres_jax import metrics


def read_events(folder: pathlib.Path) -> list:
    """Every Event in the TFRecord files under `folder` (length, crc, payload, crc), with the CRCs checked."""
    from tensorboardX.crc32c import crc32c
    from tensorboardX.proto.event_pb2 import Event

    def masked(data: bytes) -> int:
        c = crc32c(data)
        return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    events = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        buf, pos = path.read_bytes(), 0
        while pos < len(buf):
            header = buf[pos:pos + 8]
            (length,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", buf[pos + 8:pos + 12])[0] == masked(header)
            payload = buf[pos + 12:pos + 12 + length]
            assert struct.unpack("<I", buf[pos + 12 + length:pos + 16 + length])[0] == masked(payload)
            events.append(Event.FromString(payload))
            pos += 16 + length
    return events


def scalars(events) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for e in events:
        for v in e.summary.value:
            if v.HasField("simple_value"):
                out.setdefault(v.tag, {})[e.step] = v.simple_value
    return out


def record(update: int, fitness, stale=(0, 0, 1)) -> dict:
    m = SimpleNamespace(staleness_hist={0: stale.count(0), 1: stale.count(1)}, dropped=1, cancelled=0, reissued=0,
                        wasted_seconds=0.5, utilization=0.8, wall_seconds=2.0)
    stats = [{"tokens": 100, "episodes": 2, "successes": 1, "start_errors": 1, "transcript": "x"}] * len(fitness)
    return metrics.update_record(update, np.array(fitness), np.array(stale), m, stats, elapsed_s=10.0 * update)


def test_update_record_sums_job_stats_and_derives_rates():
    r = record(3, [0.0, 0.5, 1.0])
    assert r["update"] == 3 and r["fitness_mean"] == 0.5 and r["fitness_min"] == 0 and r["fitness_max"] == 1
    assert r["staleness_hist"] == {"0": 2, "1": 1} and r["stale_fraction"] == pytest.approx(1 / 3)
    assert r["tokens"] == 300 and r["episodes"] == 6 and r["successes"] == 3 and r["tokens_per_second"] == 150
    assert r["start_errors"] == 3  # episodes that never started, counted though not scored
    assert "transcript" not in r  # strings in job stats are samples, not metrics


def test_phases_are_worker_seconds_over_workers_and_waiting_is_the_rest_of_the_wall_clock():
    m = SimpleNamespace(staleness_hist={0: 2}, dropped=0, cancelled=0, reissued=0, wasted_seconds=0.0, utilization=0.9,
                        wall_seconds=10.0)
    # two members played as one batch by two of four workers: each worker waited for the whole batch
    batch = {"sandbox_start": 1.0, "prefill": 6.0, "decode": 4.0, "commands": 2.0, "grading": 1.0}
    stats = [{"phases": batch, "sync_seconds": 0.5, "prefill_tokens": 300.0, "prefill_slots": 512.0}] * 2
    r = metrics.update_record(1, np.array([0.1, 0.2]), np.array([0, 0]), m, stats, 5.0, num_workers=4,
                              learner_seconds=0.75)
    p = r["phases"]
    assert list(p) == list(metrics.PHASES)
    assert p["prefill"] == 3.0 and p["decode"] == 2.0 and p["sandbox_start"] == 0.5 and p["replica_sync"] == 0.25
    assert p["es_step"] == 0.75 and p["teardown"] == 0.0
    assert sum(p.values()) == pytest.approx(10.0) and p["waiting"] == pytest.approx(10.0 - 7.0 - 0.25 - 0.75)
    assert r["prefill_tokens"] == 600 and r["prefill_slots"] == 1024
    assert metrics.phases_line(p) == "start 0.5|prefill 3.0|decode 2.0|cmd 1.0|grade 0.5|sync 0.2|es 0.8|wait 2.0"


def test_jsonl_tensorboard_transcripts_and_progress(tmp_path, capsys):
    w = metrics.MetricsWriter(tmp_path, 0, total=4)
    w.write(record(1, [0.1, 0.3, 0.2]), samples=["first episode", None, "second episode", "third"])
    w.write(record(2, [0.4, 0.6, 0.5]))
    w.write_eval({"update": 2, "split": "val", "success": 0.25, "ci": [0.1, 0.4], "partial": 0.5,
                  "per_family": {"files": {"success": 0.5}}})
    w.close()

    assert [r["update"] for r in metrics.read(tmp_path)] == [1, 2] and w.step == 2
    assert metrics.read(tmp_path)[1]["fitness_mean"] == pytest.approx(0.5)
    tb = scalars(read_events(tmp_path / metrics.TB_DIR))
    assert tb["train/fitness_mean"] == pytest.approx({1: 0.2, 2: 0.5})
    assert tb["train/tokens_per_second"] == {1: 150.0, 2: 150.0}
    assert tb["eval/val/success"] == {2: 0.25} and tb["eval/val/family/files"] == {2: 0.5}
    hist = [v for e in read_events(tmp_path / metrics.TB_DIR) for v in e.summary.value if v.HasField("histo")]
    assert len(hist) == 2 and hist[0].tag == "train/staleness" and hist[0].histo.num == 3
    # a sample of at most two transcripts per update; none written when the update has none
    assert (tmp_path / "transcripts" / "update_00001.txt").read_text() == "first episode\n\nsecond episode\n"
    assert not (tmp_path / "transcripts" / "update_00002.txt").exists()
    err = capsys.readouterr().err
    assert "ES updates" in err and "2/4" in err and "fitness=0.500" in err and "val=25.0%" in err
    assert "s=wait 2.0" in err  # where the update's wall clock went (here: no phases in the stats, all waiting)

    (tmp_path / "grpo").mkdir()
    grpo = metrics.MetricsWriter(tmp_path / "grpo", 0, total=3, label="GRPO steps", unit="step")  # GRPO's bar
    grpo.write({"step": 1, "reward_mean": 0.5})
    grpo.close()
    err = capsys.readouterr().err
    assert "GRPO steps" in err and "1/3" in err and "reward=0.500" in err and "fitness" not in err


def test_resume_cuts_metrics_back_to_the_checkpointed_step(tmp_path):
    w = metrics.MetricsWriter(tmp_path, 0, progress=False, tensorboard=False)
    for u in (1, 2, 3):
        w.write(record(u, [0.0, 1.0]))
    w.close()
    w = metrics.MetricsWriter(tmp_path, 2, total=5, initial=2, progress=False)  # the checkpoint was at update 2
    w.write(record(3, [0.5, 0.5]))
    w.close()
    assert [(r["update"], r["fitness_mean"]) for r in metrics.read(tmp_path)] == [(1, 0.5), (2, 0.5), (3, 0.5)]
