"""The CPU default's first ES update, pinned bit for bit: SmolLM2-135M-Instruct, generated `basics/easy` tasks in
bwrap sandboxes, 8 low-rank members x 8 tasks (sync, so that the cohort does not depend on thread timing).

The expected values were recorded on the commit that added this test. A change that claims to keep what an
update computes (a faster update, a refactoring) must leave them unchanged: the same members and seeds, the same
fitness, the same shaped coefficients and the same new parameters, byte for byte.
"""

import hashlib
import pathlib

import jax
import numpy as np
import pytest
from bwrap_support import bwrap_or_skip

from asyncres_jax import metrics
from asyncres_jax.config import load_config
from asyncres_jax.trainer import ESTrainer

# big_memory: a SmolLM2 run, never beside the 9-12 GB tests of that group on a 24 GB machine
pytestmark = [pytest.mark.xdist_group("big_memory"), pytest.mark.bwrap, pytest.mark.slow]

CONFIG = pathlib.Path(__file__).resolve().parent.parent / "configs" / "smollm2_cpu.yaml"

SEEDS = [112113195, 1803422166, 1482280882, 428557657, 115182511, 1016678258, 22927178, 1473710169]
SHAPED = [0.16012811660766602, -1.120896816253662, -1.120896816253662, 0.16012811660766602, 1.4411530494689941,
          0.16012811660766602, 1.4411530494689941, -1.120896816253662]
FITNESS = [0.3671875, 0.04878904686248749, 0.3125, 0.4375]  # mean, std, min, max of the 8 members
PARAMS_SHA256 = "a60980c77cc6b79ee2e2b1bce34c10b37341f26fc28c0bfe7f9e311815b0070e"


def params_sha256(params) -> str:
    digest = hashlib.sha256()
    for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(params), key=lambda kv: jax.tree_util.keystr(kv[0])):
        leaf = np.asarray(leaf)
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(str(leaf.dtype).encode() + str(leaf.shape).encode())
        digest.update(np.ascontiguousarray(leaf).tobytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def first_update(tmp_path_factory):
    bwrap_or_skip()
    tmp = tmp_path_factory.mktemp("pinned")
    # the system prompt the values were recorded with, explicit so that a change of the default cannot move them
    cfg = load_config(CONFIG, [f"run_dir={tmp / 'run'}", f"tasks.dataset={tmp / 'tasks'}", "pool.mode=sync",
                               "es.updates=1", "eval.every=0", "episode.system_prompt=full"])
    trainer = ESTrainer(cfg, devices=jax.devices()[:1])
    try:
        trainer.run()
        (entry,) = trainer.store.entries(0, 1)
        params = jax.tree.map(np.asarray, trainer.store.params)
    finally:
        trainer.close()
    (record,) = metrics.read(tmp / "run")
    return dict(seeds=[int(s) for s in entry.seeds], shaped=[float(z) for z in np.asarray(entry.shaped)],
                fitness=[record["fitness_mean"], record["fitness_std"], record["fitness_min"], record["fitness_max"]],
                sha256=params_sha256(params), record=record)


def test_first_update_plays_the_same_episodes(first_update):
    assert first_update["record"]["episodes"] == 8 * 8
    assert first_update["seeds"] == SEEDS
    assert first_update["fitness"] == FITNESS


def test_first_update_makes_the_same_step(first_update):
    assert first_update["shaped"] == SHAPED
    assert first_update["sha256"] == PARAMS_SHA256
