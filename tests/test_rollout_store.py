"""The versioned parameter store: commits, the update log, replay vs copy, compaction, serialisation.

The ES math is a tiny fake: params are a dict of float32 arrays and an update adds
alpha * sum_i shaped_i * noise(seed_i), a deterministic function of the seeds (the SGD rule).
"""

import numpy as np
import pytest

from asyncres_jax.rollout import ParamStore


def noise(seed, shape):
    return np.random.default_rng(int(seed)).standard_normal(shape).astype(np.float32)


def sgd(params, seeds, shaped):
    return {k: v + np.float32(0.01) * sum(z * noise(s, v.shape) for s, z in zip(seeds, shaped))
            for k, v in params.items()}


def zscore(fitness):
    return (fitness - fitness.mean()) / (fitness.std() + 1e-8)


def make_store(stateful=False, **kw):
    params = {"w": np.zeros((3, 2), np.float32), "b": np.ones(2, np.float32)}
    if stateful:  # a momentum-like optimiser: replay from (seeds, fitness) alone is impossible
        def apply(p, m, seeds, z):
            m = {k: 0.9 * m[k] + (sgd(p, seeds, z)[k] - p[k]) for k in p}
            return {k: p[k] + m[k] for k in p}, m
        return ParamStore(params, {k: np.zeros_like(v) for k, v in params.items()}, apply_update=apply, shape=zscore,
                          **kw)
    return ParamStore(params, apply_update=lambda p, o, s, z: (sgd(p, s, z), o), shape=zscore, replay=sgd, **kw)


def commit_some(store, n_updates, n=6, start=0):
    for v in range(start, start + n_updates):
        seeds = np.arange(n) + 100 * v
        store.commit(seeds, np.random.default_rng(v).uniform(size=n))


def test_commit_shapes_fitness_logs_the_update_and_publishes_the_next_version():
    store = make_store()
    entry = store.commit([1, 2, 3], [0.0, 0.5, 1.0])
    assert store.version == 1 and entry.version == 0
    np.testing.assert_allclose(entry.shaped, zscore(np.array([0.0, 0.5, 1.0])), rtol=1e-6)
    assert entry.shaped.dtype == np.float32
    np.testing.assert_array_equal(store.params["b"], sgd({"b": np.ones(2, np.float32)}, [1, 2, 3], entry.shaped)["b"])
    assert store.snapshot() == (1, store.params)


def test_replaying_the_log_reproduces_the_master_parameters_exactly():
    store = make_store(max_replay=10)
    v0 = store.params
    commit_some(store, 5)
    assert store.plan(0, 5) == "replay"
    replayed = store.bring_up(v0, 0, 5)
    for k in v0:
        np.testing.assert_array_equal(replayed[k], store.params[k])


def test_a_copy_is_planned_when_replay_cannot_or_should_not_be_used():
    store = make_store(max_replay=2)
    commit_some(store, 4)
    assert store.plan(4, 4) == "none"
    assert store.plan(2, 4) == "replay"
    assert store.plan(1, 4) == "copy"  # 3 updates behind: longer than a copy is worth
    assert store.plan(None, 4) == "copy"  # the replica holds nothing yet
    assert store.plan(4, 3) == "copy"  # ahead of the target: the log only goes forward
    stateful = make_store(stateful=True)
    commit_some(stateful, 2)
    assert stateful.plan(1, 2) == "copy"  # with optimiser state only a copy is exact


def test_compaction_forgets_old_updates_and_replicas_behind_it_copy():
    store = make_store(max_replay=10)
    commit_some(store, 6)
    store.compact(keep_last=2)
    assert store.log_start == 4
    assert store.plan(3, 6) == "copy" and store.plan(4, 6) == "replay"
    with pytest.raises(KeyError):
        store.entries(3, 6)
    store.compact()
    assert store.plan(5, 6) == "copy"


@pytest.mark.parametrize("stateful", [False, True])
def test_state_dict_round_trip_restores_params_optimiser_and_log(stateful):
    store = make_store(stateful=stateful, max_replay=10)
    commit_some(store, 3)
    store.compact(keep_last=1)
    state = store.state_dict()
    assert state["log_seeds"].shape == (1, 6) and state["log_shaped"].dtype == np.float32

    fresh = make_store(stateful=stateful, max_replay=10)
    fresh.load_state_dict(state)
    assert (fresh.version, fresh.log_start) == (3, 2)
    commit_some(store, 2, start=3)
    commit_some(fresh, 2, start=3)
    for k in store.params:  # the restored store continues exactly like the original
        np.testing.assert_array_equal(fresh.params[k], store.params[k])
    if not stateful:
        np.testing.assert_array_equal(fresh.bring_up(state["params"], 3, 5)["w"], store.params["w"])


def test_empty_log_serialises():
    store = make_store()
    state = store.state_dict()
    other = make_store()
    other.load_state_dict(state)
    assert other.version == 0 and other.plan(0, 0) == "none"


def test_the_es_store_replays_real_es_updates_bit_identically():
    import jax.numpy as jnp

    from asyncres_jax import es
    from asyncres_jax.rollout.es_store import es_param_store

    cfg = es.ESConfig(population=6, sigma=0.01, alpha=0.01)
    params = {"w": jnp.zeros((4, 3), jnp.float32), "b": jnp.ones((3,), jnp.float32)}
    store = es_param_store(params, cfg, max_replay=4)
    for v in range(3):
        seeds = [es.member_seed(0, v, i) for i in range(6)]
        store.commit(seeds, np.linspace(0.0, 1.0, 6) ** (v + 1))
    assert store.plan(0, 3) == "replay"
    replayed = store.bring_up(params, 0, 3)
    for k in params:
        assert not np.array_equal(np.asarray(store.params[k]), np.asarray(params[k]))
        np.testing.assert_array_equal(np.asarray(replayed[k]), np.asarray(store.params[k]))
    adam = es_param_store(params, es.ESConfig(population=6, optimizer="adam"))
    adam.commit([es.member_seed(0, 0, i) for i in range(6)], np.linspace(0.0, 1.0, 6))
    assert adam.plan(0, 1) == "copy"  # Adam's moments are not in the log: only a copy is exact


def test_state_dict_survives_an_orbax_checkpoint(tmp_path):
    import orbax.checkpoint as ocp

    updates = 3
    store = make_store(stateful=True)
    commit_some(store, updates)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "store", store.state_dict())
    with ocp.StandardCheckpointer() as ckpt:
        state = ckpt.restore(tmp_path / "store")
    back = make_store(stateful=True)
    back.load_state_dict(state)
    assert (back.version, back.log_start) == (updates, 0)
    for v in range(updates):
        np.testing.assert_array_equal(back.entries(v, v + 1)[0].seeds, store.entries(v, v + 1)[0].seeds)
    np.testing.assert_array_equal(np.asarray(back.params["w"]), store.params["w"])
