"""Simulated CPU devices share one host memory: there the learner's masters are split over "data" and every
replica (and the whole-mesh copy that evaluation runs) aliases one host buffer per version, instead of holding a
copy per device. Values and the ES update stay what they are on accelerators' layout."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from asyncres_jax import es
from asyncres_jax.mesh import make_mesh
from asyncres_jax.model.sharding import learner_shardings, param_shardings, shares_host_memory, splits_masters
from asyncres_jax.model.tiny import tiny_model
from asyncres_jax.rollout.replicas import for_inference, replicas_from_mesh

pytestmark = pytest.mark.xdist_group("mesh")


def nbytes_on(tree, device) -> int:
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device)


def buffers(x) -> set[int]:
    return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


@pytest.mark.parametrize("spec", ["8x1", "4x2"])
def test_masters_are_split_over_data_on_simulated_devices(model, spec):
    mesh = make_mesh(spec)
    assert shares_host_memory(mesh) and splits_masters(mesh)
    masters = jax.device_put(model.params, learner_shardings(model.params, model.config, mesh))
    replicated = jax.device_put(model.params, param_shardings(model.params, model.config, mesh))
    total = sum(x.nbytes for x in jax.tree.leaves(model.params))
    per_device = nbytes_on(masters, jax.devices()[0])
    assert per_device <= 1.05 * total / mesh.size  # one copy over all devices, not one per replica
    assert nbytes_on(replicated, jax.devices()[0]) >= total / mesh.shape["model"] * 0.95
    for x, s in zip(jax.tree.leaves(model.params), jax.tree.leaves(
            learner_shardings(model.params, model.config, mesh), is_leaf=lambda s: isinstance(s, NamedSharding))):
        splittable = any(n % mesh.shape["data"] == 0 and ax is None
                         for n, ax in zip(x.shape, tuple(s.spec) + (None,) * x.ndim))
        assert ("data" in s.spec) == splittable or "data" in s.spec, (x.shape, s.spec)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), masters, model.params)


def test_a_one_device_mesh_keeps_the_rollout_layout(model):
    mesh = make_mesh("1x1")
    assert shares_host_memory(mesh) and not splits_masters(mesh)  # one replica: nothing to share
    assert learner_shardings(model.params, model.config, mesh) == param_shardings(model.params, model.config, mesh)


def test_replicas_and_the_whole_mesh_alias_one_host_copy_of_a_version(model):
    mesh = make_mesh("8x1")
    masters = jax.device_put(model.params, learner_shardings(model.params, model.config, mesh))
    replicas = replicas_from_mesh(mesh, lambda sub: param_shardings(model.params, model.config, sub))
    placed = [r.place(masters) for r in replicas]
    for leaves in zip(*(jax.tree.leaves(p) for p in placed), jax.tree.leaves(masters)):
        *copies, master = leaves
        held = set.union(*(buffers(c) for c in copies))
        # 8 replicas, one buffer; a leaf the data axis does not split reuses the masters' own (no copy either)
        assert len(held) == 1 or held <= buffers(master), (master.shape, master.sharding.spec)
        for c in copies:
            np.testing.assert_array_equal(np.asarray(c), np.asarray(master))
    whole = for_inference(masters, param_shardings(model.params, model.config, mesh))
    for x, s, master in zip(jax.tree.leaves(whole), jax.tree.leaves(param_shardings(model.params, model.config, mesh)),
                            jax.tree.leaves(masters)):
        assert x.sharding == s and (len(buffers(x)) == 1 or buffers(x) == buffers(master))
    # the next version gets its own copy; the replicas of the first keep theirs
    cfg = es.ESConfig(population=2, sigma=0.01, alpha=0.01, noise="lowrank")
    seeds = [es.member_seed(0, 0, i) for i in range(2)]
    newer, _ = es.update(masters, es.init(masters, cfg), seeds, np.array([1.0, 0.0]), cfg)
    again = replicas[0].place(newer)
    leaf = jax.tree.leaves(again)[0]
    assert buffers(leaf) != buffers(jax.tree.leaves(placed[0])[0])
    np.testing.assert_array_equal(np.asarray(leaf), np.asarray(jax.tree.leaves(newer)[0]))


def test_the_es_update_of_split_masters_is_the_update_of_replicated_ones(model):
    mesh = make_mesh("8x1")
    cfg = es.ESConfig(population=4, sigma=0.01, alpha=0.01, noise="lowrank", rank=1)
    seeds = [es.member_seed(1, 0, i) for i in range(4)]
    fitness = np.array([0.5, 0.25, 0.0, 1.0])
    out = []
    for shardings in (learner_shardings, param_shardings):
        p = jax.device_put(model.params, shardings(model.params, model.config, mesh))
        out.append(es.update(p, es.init(p, cfg), seeds, fitness, cfg)[0])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), *out)
