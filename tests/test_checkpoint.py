"""Orbax checkpoints: sharded arrays and a JSON record round-trip; the last n are kept; a corrupt newest step is
reported, set aside and the previous one used; a half-written step (a crash mid-save) is never seen."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from asyncres_jax.checkpoint import Checkpointer, flatten, unflatten_like
from asyncres_jax.mesh import make_mesh


@pytest.fixture(scope="module")
def mesh():
    return make_mesh("4x2")


def state(mesh, value: float):
    w = jax.device_put(jnp.full((4, 6), value, jnp.float32), NamedSharding(mesh, P(None, "model")))
    return {"params": {"layers": {0: {"w": w}}, "b": jnp.arange(3, dtype=jnp.float32) + value}}


def test_flatten_round_trip():
    tree = {"layers": {0: {"w": np.ones(2)}, 1: {"w": np.zeros(2)}}, "opt": (np.ones(1),)}
    flat = flatten(tree, "p")
    assert sorted(flat) == ["p/layers/0/w", "p/layers/1/w", "p/opt/0"]
    back = unflatten_like(tree, flat, "p")
    assert jax.tree.structure(back) == jax.tree.structure(tree)


def test_save_restore_keeps_values_shardings_and_meta(tmp_path, mesh):
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, flatten(state(mesh, float(step)), "s"), {"version": step, "cohort": [{"fitness": 0.5}]})
    assert ckpt.steps() == [2, 3]  # the last n kept
    template = flatten(state(mesh, 0.0), "s")
    restored = ckpt.restore_latest(template)
    assert restored.step == 3 and restored.meta == {"version": 3, "cohort": [{"fitness": 0.5}]}
    w = restored.arrays["s/params/layers/0/w"]
    assert w.sharding == template["s/params/layers/0/w"].sharding
    np.testing.assert_array_equal(np.asarray(w), np.full((4, 6), 3.0))
    ckpt.close()


def test_corrupt_newest_checkpoint_is_reported_and_the_previous_used(tmp_path, mesh):
    messages = []
    ckpt = Checkpointer(tmp_path / "ckpt", keep=3, report=messages.append)
    for step in (1, 2):
        ckpt.save(step, flatten(state(mesh, float(step)), "s"), {"version": step})
    # Damage step 2: every data file of its arrays truncated.
    for f in (tmp_path / "ckpt" / "2" / "arrays").rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and "d" in f.parent.name:
            f.write_bytes(b"")
    restored = ckpt.restore_latest(flatten(state(mesh, 0.0), "s"))
    assert restored.step == 1 and restored.meta == {"version": 1}
    assert len(messages) == 1 and "checkpoint" in messages[0] and "unreadable" in messages[0]
    assert (tmp_path / "ckpt" / "corrupt-2").is_dir() and ckpt.steps() == [1]
    ckpt.save(2, flatten(state(mesh, 5.0), "s"), {"version": 2})  # the step number can be written again
    assert ckpt.restore_latest(flatten(state(mesh, 0.0), "s")).meta == {"version": 2}
    ckpt.close()


def test_half_written_step_is_invisible(tmp_path, mesh):
    ckpt = Checkpointer(tmp_path / "ckpt", keep=3)
    ckpt.save(1, flatten(state(mesh, 1.0), "s"), {"version": 1})
    # What a crash mid-save leaves: Orbax's temporary folder, never renamed to a step.
    (tmp_path / "ckpt" / "2.orbax-checkpoint-tmp-123").mkdir()
    ckpt._manager.reload()
    assert ckpt.steps() == [1]
    assert ckpt.restore_latest(flatten(state(mesh, 0.0), "s")).step == 1
    ckpt.close()


def test_no_checkpoint_gives_none(tmp_path, mesh):
    ckpt = Checkpointer(tmp_path / "ckpt", keep=1)
    assert ckpt.restore_latest(flatten(state(mesh, 0.0), "s")) is None
    ckpt.close()
