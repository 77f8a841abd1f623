"""Bit-exact resume: 4 updates in one go equal, bit for bit, 2 updates, a stop, and 2 more after resuming.

Fixed job order: one worker on a 1x2 mesh (2 of the 8 simulated devices), async K=1, the fake environment,
whose fitness is a deterministic function of the perturbed parameters."""

import jax
import numpy as np
import pytest

from asyncres_jax import metrics
from asyncres_jax.config import load_config
from asyncres_jax.trainer import ESTrainer

pytestmark = pytest.mark.xdist_group("train_resume")


def config(run_dir, updates, optimizer):
    return load_config(None, [f"run_dir={run_dir}", "mesh=1x2", "model.name=tiny", "tasks.dataset=fake",
                              "es.population=4", "es.sigma=0.02", "es.alpha=0.05", f"es.optimizer={optimizer}",
                              "pool.mode=async", "pool.max_staleness=1", "checkpoint.every=3",
                              f"es.updates={updates}"])


def train(run_dir, updates, optimizer):
    trainer = ESTrainer(config(run_dir, updates, optimizer), devices=jax.devices()[:2])
    try:
        trainer.run()
        syncs = trainer.pool.replicas[0].syncs
        return (jax.tree.map(np.asarray, trainer.store.params), jax.tree.map(np.asarray, trainer.store.opt_state),
                trainer.store.state_dict(), syncs)
    finally:
        trainer.close()


# sgd: the replica follows the learner by replaying (seeds, z) from the log, and starts from a copy after the
# resume; adam: a stateful optimiser, so replicas always copy, and its moments must survive the checkpoint.
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_two_plus_two_equals_four_bit_for_bit(tmp_path, optimizer):
    params4, opt4, store4, syncs = train(tmp_path / "straight", 4, optimizer)
    assert syncs["replay"] == (3 if optimizer == "sgd" else 0)
    train(tmp_path / "stopped", 2, optimizer)
    params22, opt22, store22, _ = train(tmp_path / "stopped", 4, optimizer)  # resumes the run at update 2
    assert jax.tree.all(jax.tree.map(np.array_equal, params4, params22))
    assert jax.tree.all(jax.tree.map(np.array_equal, opt4, opt22))  # Adam's moments and count too
    assert store4["version"] == store22["version"] == 4
    np.testing.assert_array_equal(store4["log_seeds"], store22["log_seeds"])
    np.testing.assert_array_equal(store4["log_shaped"], store22["log_shaped"])
    straight, stopped = metrics.read(tmp_path / "straight"), metrics.read(tmp_path / "stopped")
    assert [r["update"] for r in stopped] == [1, 2, 3, 4]
    assert [r["fitness_mean"] for r in straight] == [r["fitness_mean"] for r in stopped]
