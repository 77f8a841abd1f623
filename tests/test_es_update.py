"""es.update against a NumPy reference of the paper's rule, shaping, optimiser options, replay, bad input."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from asyncres_jax import es
from asyncres_jax.errors import UserError


def tiny_params():
    k = jax.random.split(jax.random.key(1), 3)
    return {
        "embed": {"embedding": jax.random.normal(k[0], (10, 4))},
        "layers": {
            0: {"attn": {"q_proj": {"kernel": jax.random.normal(k[1], (4, 6)), "bias": jnp.zeros(6)}}},
            1: {"attn": {"q_proj": {"kernel": jax.random.normal(k[2], (4, 6)), "bias": jnp.zeros(6)}}},
        },
        "final_norm": {"scale": jnp.ones(4)},
    }


FITNESS = np.array([0.25, 0.5, 0.0, 0.75, 0.5, 1.0])


def numpy_update(params, seeds, z, cfg, signs=None):
    """The reference formula in float64: theta + alpha / (N [sigma]) * sum_i z_i eps_i."""
    signs = np.ones(len(z)) if signs is None else signs
    members = [(seeds[i // 2], signs[i]) if cfg.antithetic else (seeds[i], 1.0) for i in range(len(z))]
    scale = cfg.alpha / (cfg.population * (cfg.sigma if cfg.divide_by_sigma else 1.0))
    total = jax.tree.map(lambda x: np.zeros(x.shape), params)
    for (seed, sign), z_i in zip(members, z):
        eps = es.noise(params, int(seed), cfg)
        total = jax.tree.map(lambda t, e: t + sign * z_i * np.asarray(e, np.float64), total, eps)
    return jax.tree.map(lambda p, t: np.asarray(p, np.float64) + scale * t, params, total)


def assert_close_tree(a, b, atol=2e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x, np.float64), y, rtol=1e-6, atol=atol)


@pytest.mark.parametrize("noise", ["iid", "shared", "lowrank"])
@pytest.mark.parametrize("divide_by_sigma", [False, True])
def test_update_matches_numpy_reference_formula(noise, divide_by_sigma):
    params = tiny_params()
    cfg = es.ESConfig(population=6, sigma=0.05, alpha=0.1, noise=noise, rank=2, divide_by_sigma=divide_by_sigma)
    seeds = [es.member_seed(0, 3, i) for i in range(6)]
    new, _ = es.update(params, es.init(params, cfg), seeds, FITNESS, cfg)
    z = (FITNESS - FITNESS.mean()) / (FITNESS.std() + 1e-8)
    assert_close_tree(new, numpy_update(params, seeds, z, cfg), atol=2e-6 * (20 if divide_by_sigma else 1))


def test_antithetic_update_uses_half_the_seeds_with_mirrored_members():
    params = tiny_params()
    cfg = es.ESConfig(population=6, sigma=0.05, alpha=0.1, antithetic=True, shaping="raw")
    seeds = [11, 22, 33]
    new, _ = es.update(params, es.init(params, cfg), seeds, FITNESS, cfg)
    assert_close_tree(new, numpy_update(params, seeds, FITNESS, cfg, signs=np.array([1, -1] * 3)))
    # the members are exactly what perturb gives for (seed k, +) and (seed k, -)
    eps = es.noise(params, 22, cfg)
    minus = es.perturb(params, 22, cfg, sign=-1)
    np.testing.assert_allclose(minus["final_norm"]["scale"],
                               params["final_norm"]["scale"] - 0.05 * eps["final_norm"]["scale"], rtol=1e-6)


def test_weight_decay_pulls_toward_the_initial_parameters():
    params = tiny_params()
    cfg = es.ESConfig(population=6, sigma=0.05, alpha=0.1, weight_decay=0.5, shaping="raw")
    state = es.init(params, cfg)
    moved = jax.tree.map(lambda x: x + 1.0, params)  # as if earlier updates had moved theta away from theta0
    new, _ = es.update(moved, state, list(range(6)), np.zeros(6), cfg)  # zero estimate: only the decay acts
    assert_close_tree(new, jax.tree.map(lambda x: np.asarray(x, np.float64) + 1.0 - 0.1 * 0.5 * 1.0, params))


def test_adam_option_applies_optax_adam_to_the_negated_estimate():
    params = tiny_params()
    cfg = es.ESConfig(population=6, sigma=0.05, alpha=0.01, optimizer="adam")
    seeds = list(range(100, 106))
    state = es.init(params, cfg)
    tx, ref_state, ref = optax.adam(0.01), optax.adam(0.01).init(params), params
    for step in range(2):
        fitness = np.roll(FITNESS, step)
        params, state = es.update(params, state, seeds, fitness, cfg)
        z = (fitness - fitness.mean()) / (fitness.std() + 1e-8)
        est = jax.tree.map(lambda r, p: (np.asarray(r) - np.asarray(p)) / 1.0,
                           numpy_update(ref, seeds, z, es.ESConfig(population=6, alpha=1.0)), ref)
        updates, ref_state = tx.update(jax.tree.map(lambda g: -jnp.asarray(g, jnp.float32), est), ref_state)
        ref = optax.apply_updates(ref, updates)
    assert_close_tree(params, jax.tree.map(np.asarray, ref), atol=1e-5)


def test_all_equal_fitness_gives_exactly_zero_update():
    params = tiny_params()
    for shaping in ("zscore", "centered_rank"):
        cfg = es.ESConfig(population=30, shaping=shaping)
        fitness = np.full(30, 0.1)  # mean(0.1 x 30) is not exactly 0.1 in floating point
        assert not np.all(fitness - fitness.mean() == 0)
        z = es.shape_fitness(fitness, cfg)
        assert np.all(z == 0) and not np.any(np.isnan(z))
        new, _ = es.update(params, es.init(params, cfg), list(range(30)), fitness, cfg)
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params)):
            np.testing.assert_array_equal(a, b)


def test_shaping_zscore_centered_rank_raw():
    r = np.array([0.2, 0.9, 0.2, 0.5])
    z = es.shape_fitness(r, es.ESConfig(population=4))
    assert z.dtype == np.float32
    np.testing.assert_allclose(z, (r - r.mean()) / (r.std() + 1e-8), rtol=1e-6)
    ranks = es.shape_fitness(r, es.ESConfig(population=4, shaping="centered_rank"))
    # ties share rank 0.5
    np.testing.assert_allclose(ranks, [-(0.5 - 0.5 / 3), 0.5, -(0.5 - 0.5 / 3), 2 / 3 - 0.5], rtol=1e-6)
    np.testing.assert_array_equal(es.shape_fitness(r, es.ESConfig(population=4, shaping="raw")), r.astype(np.float32))


def test_replayed_log_keeps_two_independent_copies_bit_identical():
    cfg = es.ESConfig(population=6, sigma=0.05, alpha=0.05, optimizer="adam", noise="lowrank", rank=2)
    learner = tiny_params()
    learner_state = es.init(learner, cfg)
    log = []
    for version in range(3):
        seeds = [es.member_seed(9, version, i) for i in range(6)]
        fitness = np.random.default_rng(version).random(6)
        log.append((seeds, es.shape_fitness(fitness, cfg)))
        learner, learner_state = es.update(learner, learner_state, seeds, fitness, cfg)
    replica = jax.tree.map(lambda x: jnp.asarray(np.array(x)), tiny_params())  # an independent copy
    replica_state = es.init(replica, cfg)
    for seeds, z in log:
        replica, replica_state = es.apply_logged_update(replica, replica_state, seeds, z, cfg, donate=True)
    for a, b in zip(jax.tree.leaves((learner, learner_state)), jax.tree.leaves((replica, replica_state))):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(learner["final_norm"]["scale"], tiny_params()["final_norm"]["scale"])


def test_update_keeps_dtype_of_bfloat16_params():
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), tiny_params())
    cfg = es.ESConfig(population=6, alpha=0.5)
    new, _ = es.update(params, es.init(params, cfg), list(range(6)), FITNESS, cfg)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(new))
    assert not np.array_equal(new["embed"]["embedding"], params["embed"]["embedding"])


@pytest.mark.parametrize(
    "make",
    [
        lambda p, c: es.update(p, es.init(p, c), list(range(6)), FITNESS[:5], c),  # fitness length != N
        lambda p, c: es.update(p, es.init(p, c), list(range(5)), FITNESS, c),  # seeds length != N
        lambda p, c: es.update(p, es.init(p, c), list(range(6)), np.where(FITNESS > 0.9, np.nan, FITNESS), c),
        lambda p, c: es.update(p, es.init(p, c), [-1, 1, 2, 3, 4, 5], FITNESS, c),  # negative seed
        lambda p, c: es.update(p, es.init(p, es.ESConfig(population=6, optimizer="adam")), list(range(6)), FITNESS, c),
        lambda p, c: es.ESConfig(sigma=0.0),
        lambda p, c: es.ESConfig(sigma=-1.0),
        lambda p, c: es.ESConfig(rank=0),
        lambda p, c: es.ESConfig(population=5, antithetic=True),
        lambda p, c: es.ESConfig(noise="gaussian"),
        lambda p, c: es.ESConfig(shaping="rank"),
    ],
    ids=["fitness-length", "seeds-length", "nan-fitness", "negative-seed", "state-mismatch", "sigma-0",
         "sigma-negative", "rank-0", "odd-antithetic", "noise-mode", "shaping-mode"],
)
def test_bad_input_is_a_clear_user_error(make):
    with pytest.raises(UserError) as info:
        make(tiny_params(), es.ESConfig(population=6))
    assert "\n" not in str(info.value) and len(str(info.value)) > 20


def test_update_drawing_noise_by_blocks_of_rows_is_bit_identical(monkeypatch):
    update_mod = importlib.import_module("asyncres_jax.es.update")
    params, cfg = tiny_params(), es.ESConfig(population=6, alpha=0.5)
    seeds = list(range(6))
    whole, _ = es.update(params, es.init(params, cfg), seeds, FITNESS, cfg)
    monkeypatch.setattr(update_mod, "CHUNK", 16)  # embedding [10, 4]: 2 blocks of 4 rows and a tail of 2
    blocked, _ = es.update(params, es.init(params, cfg), seeds, FITNESS, cfg)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(blocked)):
        np.testing.assert_array_equal(a, b)


def test_a_bfloat16_learner_would_silently_drop_most_of_an_update():
    """Why `model.dtype: bfloat16` is refused for ES: at the paper's sigma and alpha one step is below half a
    bf16 ulp of most weights, so they do not move; float32 masters take the step everywhere."""
    from asyncres_jax.model.tiny import tiny_model

    cfg = es.ESConfig()
    seeds = [es.member_seed(0, 0, i) for i in range(cfg.population)]
    fitness = np.random.default_rng(0).random(cfg.population)
    unchanged = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        params = jax.tree.map(lambda x: x.astype(dtype), tiny_model(0).params)
        new, _ = es.update(params, es.init(params, cfg), seeds, fitness, cfg)
        before, after = (np.asarray(p["layers"][0]["mlp"]["up_proj"]["kernel"], np.float32) for p in (params, new))
        unchanged[jnp.dtype(dtype).name] = float(np.mean(before == after))
    assert unchanged["float32"] < 0.01 and unchanged["bfloat16"] > 0.3
