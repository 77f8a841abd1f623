"""Noise, perturb and update are bit-identical on meshes 1x1 and 4x2 of the 8 simulated devices, and keep
every leaf's sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from asyncres_jax import es

SPECS = {
    "embed": {"embedding": P(None, "model")},
    "layers": {0: {"q_proj": {"kernel": P("data", "model"), "bias": P("model")},
                   "o_proj": {"kernel": P("model", "data")}}},
    "final_norm": {"scale": P()},
}


def host_params():
    k = jax.random.split(jax.random.key(3), 3)
    return {
        "embed": {"embedding": np.asarray(jax.random.normal(k[0], (16, 4)))},
        "layers": {0: {"q_proj": {"kernel": np.asarray(jax.random.normal(k[1], (8, 6))),
                                  "bias": np.zeros(6, np.float32)},
                       "o_proj": {"kernel": np.asarray(jax.random.normal(k[2], (6, 8)))}}},
        "final_norm": {"scale": np.ones(4, np.float32)},
    }


def on_mesh(shape):
    devices = np.asarray(jax.devices()[: shape[0] * shape[1]]).reshape(shape)
    mesh = Mesh(devices, ("data", "model"))
    return jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), host_params(), SPECS)


@pytest.fixture(scope="module")
def meshes():
    assert len(jax.devices()) >= 8
    return on_mesh((1, 1)), on_mesh((4, 2))


def assert_same_bits_and_shardings(results, inputs):
    for out, params in zip(results, inputs):
        for o, p in zip(jax.tree.leaves(out), jax.tree.leaves(params)):
            assert o.sharding.is_equivalent_to(p.sharding, o.ndim), (o.sharding, p.sharding)
    for a, b in zip(*(jax.tree.leaves(r) for r in results)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("noise", ["iid", "shared", "lowrank"])
def test_noise_and_perturb_are_bit_identical_on_1x1_and_4x2(meshes, noise):
    cfg = es.ESConfig(sigma=0.01, noise=noise, rank=2)
    seed = es.member_seed(0, 1, 2)
    assert_same_bits_and_shardings([es.noise(p, seed, cfg) for p in meshes], meshes)
    assert_same_bits_and_shardings([es.perturb(p, seed, cfg, sign=-1) for p in meshes], meshes)
    unsharded = es.noise(jax.tree.map(jnp.asarray, host_params()), seed, cfg)
    for a, b in zip(jax.tree.leaves(unsharded), jax.tree.leaves(es.noise(meshes[1], seed, cfg))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("noise,optimizer", [("iid", "sgd"), ("lowrank", "adam")])
def test_one_update_is_bit_identical_on_1x1_and_4x2(meshes, noise, optimizer):
    cfg = es.ESConfig(population=8, sigma=0.01, alpha=0.01, noise=noise, rank=2, optimizer=optimizer)
    seeds = [es.member_seed(0, 1, i) for i in range(8)]
    fitness = np.linspace(0.0, 1.0, 8) ** 2
    results = [es.update(p, es.init(p, cfg), seeds, fitness, cfg) for p in meshes]
    assert_same_bits_and_shardings([r[0] for r in results], meshes)
    if optimizer == "adam":  # the moments live where their parameters live
        mu = [jax.tree.map(lambda s: s[0].mu, r[1].opt, is_leaf=lambda s: isinstance(s, tuple)) for r in results]
        assert_same_bits_and_shardings(mu, meshes)
