"""ES noise: the seed rule, the three noise modes, perturb, member seeds."""

import importlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncres_jax import es
from asyncres_jax.errors import UserError


def tiny_params(dtype=jnp.float32):
    k = jax.random.split(jax.random.key(0), 4)
    return {
        "embed": {"embedding": jax.random.normal(k[0], (12, 6), dtype)},
        "layers": {
            0: {"mlp": {"kernel": jax.random.normal(k[1], (6, 8), dtype)}, "norm": {"scale": jnp.ones(6, dtype)}},
            1: {"mlp": {"kernel": jax.random.normal(k[2], (6, 8), dtype)}, "norm": {"scale": jnp.ones(6, dtype)}},
        },
    }


def test_iid_noise_is_fold_in_of_the_leaf_path_hash():
    params, seed = tiny_params(), 1234
    eps = es.noise(params, seed, es.ESConfig())
    for path, leaf in zip(es.leaf_paths(params), jax.tree.leaves(eps)):
        key = jax.random.fold_in(jax.random.key(seed), es.stable_hash(path))
        np.testing.assert_array_equal(leaf, jax.random.normal(key, leaf.shape, jnp.float32))
    assert "layers/1/mlp/kernel" in es.leaf_paths(params)


def test_adding_leaves_does_not_shift_other_leaves_noise():
    small = tiny_params()
    big = {**small, "lm_head": {"kernel": jnp.zeros((6, 12))}, "layers": {**small["layers"], 2: small["layers"][0]}}
    eps_small, eps_big = es.noise(small, 7, es.ESConfig()), es.noise(big, 7, es.ESConfig())
    np.testing.assert_array_equal(eps_small["layers"][1]["mlp"]["kernel"], eps_big["layers"][1]["mlp"]["kernel"])
    np.testing.assert_array_equal(eps_small["embed"]["embedding"], eps_big["embed"]["embedding"])


def test_stable_hash_does_not_depend_on_the_python_process():
    code = "from asyncres_jax.es import stable_hash; print(stable_hash('layers/3/attn/q_proj/kernel'))"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "JAX_PLATFORMS": "cpu"}  # Python's own hash() would change
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.strip() == str(es.stable_hash("layers/3/attn/q_proj/kernel"))
    assert 0 <= es.stable_hash("x") < 2**32 and es.stable_hash("a") != es.stable_hash("b")


def test_member_seed_is_deterministic_distinct_and_int32_safe():
    seeds = {es.member_seed(g, v, i) for g in range(3) for v in range(20) for i in range(30)}
    assert len(seeds) == 3 * 20 * 30
    assert all(0 <= s < 2**31 for s in seeds)
    assert es.member_seed(5, 6, 7) == es.member_seed(5, 6, 7)
    jax.random.key(es.member_seed(2**40, 2**33, 29))  # a large global seed still gives a valid key
    for bad in ((-1, 0, 0), (0, 1.5, 0), (0, 0, "3")):
        with pytest.raises(UserError):
            es.member_seed(*bad)


def test_iid_mode_gives_equal_shaped_leaves_different_noise_shared_mode_the_same():
    params = tiny_params()
    iid = es.noise(params, 3, es.ESConfig(noise="iid"))
    shared = es.noise(params, 3, es.ESConfig(noise="shared"))
    assert not np.array_equal(iid["layers"][0]["mlp"]["kernel"], iid["layers"][1]["mlp"]["kernel"])
    np.testing.assert_array_equal(shared["layers"][0]["mlp"]["kernel"], shared["layers"][1]["mlp"]["kernel"])
    np.testing.assert_array_equal(shared["layers"][0]["norm"]["scale"], shared["layers"][1]["norm"]["scale"])
    other = es.noise(params, 4, es.ESConfig(noise="shared"))
    assert not np.array_equal(shared["layers"][0]["mlp"]["kernel"], other["layers"][0]["mlp"]["kernel"])


@pytest.mark.parametrize("rank", [1, 3])
def test_lowrank_noise_is_a_b_transpose_over_sqrt_rank_and_vectors_are_full_rank(rank):
    params, cfg = tiny_params(), es.ESConfig(noise="lowrank", rank=rank)
    eps = es.noise(params, 11, cfg)
    factors = es.lowrank_factors(params, 11, cfg)
    f = factors["layers"][0]["mlp"]["kernel"]
    assert isinstance(f, es.LowRank) and f.a.shape == (6, rank) and f.b.shape == (8, rank)
    w = eps["layers"][0]["mlp"]["kernel"]
    np.testing.assert_allclose(w, np.asarray(f.a) @ np.asarray(f.b).T / np.sqrt(rank), rtol=1e-5, atol=1e-6)
    assert np.linalg.matrix_rank(np.asarray(w)) == rank
    iid = es.noise(params, 11, es.ESConfig())
    np.testing.assert_array_equal(eps["layers"][0]["norm"]["scale"], iid["layers"][0]["norm"]["scale"])
    np.testing.assert_array_equal(factors["layers"][0]["norm"]["scale"], iid["layers"][0]["norm"]["scale"])


def test_lowrank_factors_take_shapes_and_vmap_over_seeds():
    params, cfg = tiny_params(), es.ESConfig(noise="lowrank", rank=2)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    seeds = jnp.array([3, 9, 27], jnp.int32)
    stacked = jax.vmap(lambda s: es.lowrank_factors(shapes, s, cfg))(seeds)
    for j, s in enumerate([3, 9, 27]):
        one = es.lowrank_factors(params, s, cfg)
        np.testing.assert_array_equal(stacked["embed"]["embedding"].a[j], one["embed"]["embedding"].a)
        np.testing.assert_array_equal(stacked["layers"][1]["mlp"]["kernel"].b[j], one["layers"][1]["mlp"]["kernel"].b)
    with pytest.raises(UserError):
        es.lowrank_factors(params, 3, es.ESConfig())


@pytest.mark.parametrize("noise", ["iid", "shared", "lowrank"])
def test_perturb_adds_sign_sigma_eps_and_antithetic_mirrors(noise):
    params, cfg = tiny_params(), es.ESConfig(sigma=0.1, noise=noise, rank=2)
    eps = es.noise(params, 5, cfg)
    plus, minus = es.perturb(params, 5, cfg, sign=1), es.perturb(params, 5, cfg, sign=-1)
    for p, e, a, b in zip(*(jax.tree.leaves(t) for t in (params, eps, plus, minus))):
        np.testing.assert_allclose(a, p + 0.1 * e, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(b, p - 0.1 * e, rtol=1e-6, atol=1e-7)
    assert jax.tree.structure(plus) == jax.tree.structure(params)


def test_perturb_keeps_bfloat16_and_rounds_once():
    params, cfg = tiny_params(jnp.bfloat16), es.ESConfig(sigma=0.01)
    out = es.perturb(params, 2, cfg)
    eps = es.noise(params, 2, cfg)
    for p, e, o in zip(*(jax.tree.leaves(t) for t in (params, eps, out))):
        assert o.dtype == jnp.bfloat16
        np.testing.assert_array_equal(o, (p.astype(jnp.float32) + np.float32(0.01) * e).astype(jnp.bfloat16))


def test_layout_fingerprint_changes_with_layout_only():
    params = tiny_params()
    same = jax.tree.map(lambda x: x + 1, params)
    assert es.layout_fingerprint(params) == es.layout_fingerprint(same)
    assert es.layout_fingerprint(params) != es.layout_fingerprint({**params, "extra": jnp.zeros(3)})
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    assert es.layout_fingerprint(params) != es.layout_fingerprint(bf16)


@pytest.mark.parametrize("seed", [-1, 2**31, 1.0])
def test_bad_seed_is_a_user_error(seed):
    with pytest.raises(UserError):
        es.perturb(tiny_params(), seed, es.ESConfig())


def test_blocks_of_rows_are_bit_identical_to_the_whole_draw():
    noise_mod = importlib.import_module("asyncres_jax.es.noise")
    key = jax.random.fold_in(jax.random.key(123), es.stable_hash("embed/embedding"))
    for shape in [(10, 7), (9, 3, 5), (1000,)]:
        whole = np.asarray(jax.random.normal(key, shape, jnp.float32))
        for row0, rows in [(0, shape[0]), (3, 4), (shape[0] - 2, 2)]:
            block = jax.jit(noise_mod.normal_rows, static_argnums=(1, 3))(key, shape, row0, rows)
            np.testing.assert_array_equal(block, whole[row0 : row0 + rows])
