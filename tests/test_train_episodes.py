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
