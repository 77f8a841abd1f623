"""The real ES job in-process: a tiny random model plays generated tasks in bwrap sandboxes, with low-rank noise
and the members a replica's two workers hold played as one batch (es.batched_population); tasks are generated
offline on first use."""

import jax
import pytest
from bwrap_support import bwrap_or_skip

from asyncres_jax import metrics
from asyncres_jax.config import load_config
from asyncres_jax.trainer import ESTrainer

pytestmark = [pytest.mark.xdist_group("train_episodes"), pytest.mark.bwrap]


def test_one_update_of_batched_lowrank_members_on_real_episodes(tmp_path):
    bwrap_or_skip()
    cfg = load_config(None, [
        f"run_dir={tmp_path / 'run'}", "mesh=1x2", "model.name=tiny", f"tasks.dataset={tmp_path / 'tasks'}",
        "tasks.generate_n=8", "episode.max_turns=1", "episode.max_new_tokens=4", "episode.context_limit=4096",
        "episode.fitness=partial", "es.noise=lowrank", "es.batched_population=true", "es.population=3",
        "es.tasks_per_member=2", "es.updates=1", "pool.workers_per_replica=2", "eval.every=0"])
    trainer = ESTrainer(cfg, devices=jax.devices()[:2])
    try:
        trainer.run()
        assert trainer.store.version == 1
    finally:
        trainer.close()
    assert (tmp_path / "tasks" / "splits" / "train.txt").is_file()  # generated on first use
    (record,) = metrics.read(tmp_path / "run")
    assert record["episodes"] == 3 * 2 and record["tokens"] > 0
    assert 0.0 <= record["fitness_min"] <= record["fitness_max"] <= 1.0


def test_every_update_says_where_its_wall_clock_went(tmp_path):
    """Sync updates of batched members: the phases (worker-seconds per worker, the learner step, waiting) add up
    to the update's wall clock, and the work phases (not waiting) account for most of it."""
    bwrap_or_skip()
    cfg = load_config(None, [
        f"run_dir={tmp_path / 'run'}", "mesh=1x1", "model.name=tiny", f"tasks.dataset={tmp_path / 'tasks'}",
        "tasks.generate_n=8", "episode.max_turns=2", "episode.max_new_tokens=4", "episode.context_limit=4096",
        "episode.command_per_line=true",
        "es.noise=lowrank", "es.batched_population=true", "es.population=4", "es.tasks_per_member=2",
        "es.updates=2", "pool.mode=sync", "pool.workers_per_replica=2", "eval.every=0"])
    trainer = ESTrainer(cfg, devices=jax.devices()[:1])
    try:
        trainer.run()
    finally:
        trainer.close()
    records = metrics.read(tmp_path / "run")
    assert len(records) == 2
    for r in records:
        phases = r["phases"]
        assert list(phases) == list(metrics.PHASES)
        assert sum(phases.values()) == pytest.approx(r["update_seconds"], rel=0.05)
        assert sum(v for k, v in phases.items() if k != "waiting") <= 1.05 * r["update_seconds"]
        assert min(phases.values()) >= 0
        for k in ("sandbox_start", "prefill", "decode", "commands", "host"):
            assert phases[k] > 0, k
        assert phases["grading"] + phases["teardown"] > 0
        assert phases["waiting"] < 0.5 * r["update_seconds"]
        # A member's 2 rows share their prompt prefix, computed once for both: every token is computed in at least
        # one cell per member, and the prefix in fewer cells than the rows hold (it is shared, not repeated).
        assert r["prefill_tokens"] > 0 and r["prefill_tokens"] / 2 <= r["prefill_slots"] < r["prefill_tokens"]
    assert records[0]["phases"]["es_step"] == 0 < records[1]["phases"]["es_step"]  # the first update's step
