"""A low-rank population in one batch: every row computes exactly what its member's materialised model does.

Member i of a population is es.perturb(params, seed_i, lowrank cfg, sign_i); a batch mixes rows of different
members (in any order, repeated, with antithetic pairs sharing a seed) over one copy of the weights.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from asyncres_jax import es
from asyncres_jax.errors import UserError
from asyncres_jax.es.population import LowRankPopulation
from asyncres_jax.model import decoder
from asyncres_jax.model.config import ModelConfig

# Large sigma, so members differ from each other by far more than the tolerance (the test can fail).
SIGMA, RANK, TOL = 0.05, 2, 1e-5
CONFIGS = {
    "qwen2-bias-untied": ModelConfig.tiny(),
    "llama-tied": ModelConfig.tiny(attention_bias=False, tie_word_embeddings=True, architecture="LlamaForCausalLM"),
}
# A mixed batch: rows of different members, out of order, some repeated.
ROW_MEMBERS = [2, 0, 3, 1, 0, 2, 3, 1]


@functools.partial(jax.jit, static_argnames="cfg")
def _forward(params, tokens_bt, perturbation=None, *, cfg):
    positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    return decoder.forward(params, cfg, tokens_bt, positions_bt, perturbation=perturbation)[0]


ES = es.ESConfig(population=4, sigma=SIGMA, noise="lowrank", rank=RANK)


def members(antithetic: bool):
    """(es config, member seeds, member signs) of a 4-member population.

    Antithetic: member 2k = (+, seed k), member 2k+1 = (-, seed k). es.perturb takes the
    sign explicitly, so one config serves both layouts (and one compiled perturb serves every test).
    """
    seeds = [es.member_seed(7, 3, k) for k in range(4)]
    if antithetic:
        return ES, [seeds[i // 2] for i in range(4)], [1, -1, 1, -1]
    return ES, seeds, [1, 1, 1, 1]


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request):
    cfg = CONFIGS[request.param]
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (len(ROW_MEMBERS), 9)).astype(np.int32)
    return cfg, decoder.init_params(cfg, jax.random.key(1)), tokens


@pytest.mark.parametrize("antithetic", [False, True], ids=["plain", "antithetic"])
def test_every_row_of_a_mixed_batch_equals_its_members_materialised_forward(model, antithetic):
    cfg, params, tokens = model
    es_cfg, seeds, signs = members(antithetic)
    pop = LowRankPopulation.create(params, es_cfg, seeds, signs).take_rows(ROW_MEMBERS)
    assert pop.num_seeds == (2 if antithetic else 4)
    batched = np.asarray(_forward(params, tokens, pop, cfg=cfg))
    gathered = np.asarray(_forward(params, tokens, pop.with_contraction("gather"), cfg=cfg))
    reference = {}
    for m in range(4):
        perturbed = es.perturb(params, seeds[m], es_cfg, sign=signs[m])
        reference[m] = np.asarray(_forward(perturbed, tokens, cfg=cfg))
    for b, m in enumerate(ROW_MEMBERS):
        np.testing.assert_allclose(batched[b], reference[m][b], rtol=0, atol=TOL)
        np.testing.assert_allclose(gathered[b], reference[m][b], rtol=0, atol=TOL)
        for other in set(range(4)) - {m}:  # the rows really differ by member (and by sign within a pair)
            assert np.abs(reference[other][b] - reference[m][b]).max() > 100 * TOL


def test_rows_per_member_is_member_major_and_take_rows_follows():
    cfg = es.ESConfig(population=3, sigma=0.1, noise="lowrank", rank=RANK)  # RANK: shares the compiled noise
    params = decoder.abstract_params(CONFIGS["qwen2-bias-untied"])
    pop = LowRankPopulation.create(params, cfg, [5, 9, 5], [1, 1, -1], rows_per_member=2)
    assert pop.num_rows == 6 and pop.num_seeds == 2  # the repeated seed is stored once
    np.testing.assert_array_equal(pop.seed_b, [0, 0, 1, 1, 0, 0])
    np.testing.assert_allclose(pop.scale_b, [0.1, 0.1, 0.1, 0.1, -0.1, -0.1])
    taken = pop.take_rows([5, 2, 2])
    np.testing.assert_array_equal(taken.seed_b, [0, 1, 1])
    np.testing.assert_allclose(taken.scale_b, [-0.1, 0.1, 0.1])
    assert taken.factors is pop.factors  # rows move, the factors are shared
    with pytest.raises(ValueError, match="out of range"):
        pop.take_rows([6])


def test_population_factors_are_es_lowrank_factors_bit_for_bit(model):
    _, params, _ = model
    pop = LowRankPopulation.create(params, ES, [11, 12])
    for k, seed in enumerate([11, 12]):
        own = es.lowrank_factors(params, seed, ES)
        flat = jax.tree.leaves(own, is_leaf=lambda x: isinstance(x, es.LowRank))
        for path, f in zip(es.leaf_paths(params), flat):
            for got, want in zip(jax.tree.leaves(pop.factors[path]), jax.tree.leaves(f)):
                np.testing.assert_array_equal(np.asarray(got)[k], np.asarray(want), err_msg=path)


@pytest.mark.parametrize("bad", [
    dict(cfg=es.ESConfig(noise="iid")), dict(seeds=[]), dict(seeds=[-1]), dict(signs=[1, 0]), dict(signs=[1]),
    dict(rows_per_member=0), dict(contraction="loop"),
])
def test_bad_population_arguments_are_user_errors(bad):
    args = dict(cfg=es.ESConfig(noise="lowrank"), seeds=[1, 2], signs=None, rows_per_member=1, contraction="select")
    args.update(bad)
    params = decoder.abstract_params(CONFIGS["qwen2-bias-untied"])
    with pytest.raises(UserError):
        LowRankPopulation.create(params, args["cfg"], args["seeds"], args["signs"],
                                 rows_per_member=args["rows_per_member"], contraction=args["contraction"])


def test_population_on_a_4x2_mesh_matches_one_device():
    """Tiny model sharded over 8 simulated devices (data 4 x model 2): factors follow their weights'
    shardings and the batched forward equals the single-device one."""
    from asyncres_jax.model.sharding import param_shardings

    cfg = CONFIGS["qwen2-bias-untied"]
    params = decoder.init_params(cfg, jax.random.key(1))
    es_cfg, seeds, signs = members(antithetic=True)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (8, 9)).astype(np.int32)
    local = LowRankPopulation.create(params, es_cfg, seeds, signs, rows_per_member=2)
    expected = np.asarray(_forward(params, tokens, local, cfg=cfg))

    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    shardings = param_shardings(params, cfg, mesh)
    sharded = jax.device_put(params, shardings)
    pop = LowRankPopulation.create(sharded, es_cfg, seeds, signs, rows_per_member=2)
    for path, s in zip(es.leaf_paths(sharded), jax.tree.leaves(shardings)):
        f, spec = pop.factors[path], tuple(s.spec) + (None,) * 2
        if isinstance(f, es.LowRank):
            assert f.a.sharding.spec[1] == spec[0] and f.b.sharding.spec[1] == spec[1], path
        else:
            assert f.sharding.spec[1] == spec[0], path
    assert any(s.spec != P() for s in jax.tree.leaves(shardings))  # the model axis really splits something
    out = _forward(sharded, jax.device_put(tokens, NamedSharding(mesh, P("data"))), pop, cfg=cfg)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=0, atol=TOL)
