"""bench update on a tiny model playing real episodes in bwrap: the measured updates' median, their phases (which
add up to the wall clock), the token counts, and a floor generation of the same counts, as JSON; bad input is one
line."""

import json

import pytest
from bwrap_support import bwrap_or_skip

from asyncres_jax import metrics
from asyncres_jax.bench import main as bench_main
from asyncres_jax.errors import UserError
from asyncres_jax.benchmarks import update

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(600)]


@pytest.mark.parametrize("streams", [1, 2])
def test_bench_update_reports_seconds_phases_tokens_and_the_floor(tmp_path, capsys, streams):
    bwrap_or_skip()
    config = tmp_path / "tiny.yaml"
    config.write_text("model: {name: tiny}\nmesh: 1x1\n")
    sets = [f"tasks.dataset={tmp_path / 'tasks'}", "tasks.generate_n=8", "episode.max_turns=2",
            "episode.max_new_tokens=4", "episode.context_limit=4096", "episode.command_per_line=true",
            "es.noise=lowrank", "es.batched_population=true", "es.population=3", "es.tasks_per_member=2",
            "pool.mode=sync", "pool.workers_per_replica=2", f"es.streams_per_batch={streams}"]
    assert bench_main(["update", "--config", str(config), "--updates", "2", "--floor-repeats", "1", "--json",
                       "--run-dir", str(tmp_path / "run"), "--set", *sets]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["benchmark"] == "update" and out["updates"] == 2 and len(out["update_seconds"]) == 2
    assert out["seconds_per_update"] == pytest.approx(sum(out["update_seconds"]) / 2)  # the median of two
    assert list(out["phases"]) == list(metrics.PHASES)
    assert sum(out["phases"].values()) == pytest.approx(sum(out["update_seconds"]) / 2, rel=0.05)
    assert out["episodes"] == 3 * 2 and out["generated_tokens"] > 0 and out["prefill_tokens"] > 0
    # the floor generates what the updates generated (EOS off), in one generation per batch of rows
    assert out["floor_generated_tokens"] == 6 * round(out["generated_tokens"] / 6)
    assert len(metrics.read(tmp_path / "run")) == 3  # --run-dir keeps the run: the warm-up and the two measured
    assert out["floor_seconds"] > 0 and out["floor_ratio"] == pytest.approx(out["seconds_per_update"] /
                                                                            out["floor_seconds"])


def test_the_floor_generates_the_same_tokens_when_a_batch_is_split_into_streams():
    from asyncres_jax.model.tiny import tiny_model

    model = tiny_model(seed=0)
    one = update.floor_seconds(model, 6, 5, 3, 4, repeats=1)
    two = update.floor_seconds(model, 6, 5, 3, 4, repeats=1, streams=2)  # batches of 4 and 2 rows, each in two
    assert one[1] == two[1] == 6 * 3 and one[0] > 0 and two[0] > 0


def test_bad_input_is_one_line(tmp_path):
    with pytest.raises(UserError, match="--config .* does not exist"):
        update.main(["--config", str(tmp_path / "missing.yaml")])
    with pytest.raises(UserError, match="--updates and --floor-repeats must be at least 1"):
        update.main(["--updates", "0"])
    with pytest.raises(UserError, match="--run-dir .* exists; give a new directory"):
        update.main(["--run-dir", str(tmp_path)])
