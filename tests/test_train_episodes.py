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


def test_a_run_stopped_before_its_final_evaluation_does_it_when_run_again(tmp_path, monkeypatch):
    """A stop request during the last update skips the evaluations (the session ends quickly) and checkpoints;
    running the finished run again does the final validation and test instead of only saying it is done."""
    from asyncres_jax.evaluate import attach, read_evals

    bwrap_or_skip()
    cfg = load_config(None, [
        f"run_dir={tmp_path / 'run'}", "mesh=1x1", "model.name=tiny", f"tasks.dataset={tmp_path / 'tasks'}",
        "tasks.generate_n=40", "episode.max_turns=1", "episode.max_new_tokens=4", "episode.context_limit=4096",
        "es.noise=lowrank", "es.batched_population=true", "es.population=3", "es.tasks_per_member=2",
        "es.updates=1", "pool.mode=sync", "pool.workers_per_replica=2", "eval.every=1", "eval.val_tasks=2",
        "eval.test_tasks=2"])
    commit = ESTrainer._on_commit

    def commit_then_stop(self, cohort):
        commit(self, cohort)
        self.request_stop()

    def evaluated(**kw) -> set:  # train (as asyncres_jax.trainer.train does, evaluations attached) and list the evals
        trainer = ESTrainer(cfg, devices=jax.devices()[:1], **kw)
        attach(trainer)
        try:
            assert trainer.run() == 1
        finally:
            trainer.close()
        return {(e["split"], e["update"]) for e in read_evals(tmp_path / "run")}

    monkeypatch.setattr(ESTrainer, "_on_commit", commit_then_stop)
    assert evaluated() == {("val", 0), ("test", 0)}
    monkeypatch.undo()
    assert evaluated(resume=True) == {("val", 0), ("test", 0), ("val", 1), ("test", 1)}
