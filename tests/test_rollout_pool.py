"""The threaded pool with short fake jobs: weight sync to each job's version, faults, drain, shutdown.

Jobs sleep a few milliseconds only to make threads interleave; timing itself is tested on the simulator.
"""

import threading
import time

import numpy as np
import pytest

from asyncres_jax.rollout import (Coordinator, JobResult, ParamStore, PoolConfig, Replica, RolloutPool,
                                  replicas_from_mesh)

pytestmark = pytest.mark.timeout(60)


def noise(seed):
    return np.random.default_rng(int(seed)).standard_normal(4).astype(np.float32)


def sgd(params, seeds, shaped):
    return {"w": params["w"] + np.float32(0.01) * sum(z * noise(s) for s, z in zip(seeds, shaped))}


def make(config, job_fn, *, history=None, **pool_kw):
    store = ParamStore({"w": np.zeros(4, np.float32)}, apply_update=lambda p, o, s, z: (sgd(p, s, z), o),
                       shape=lambda f: f - f.mean(), replay=sgd, max_replay=3)
    coord = Coordinator(config, member_seed=lambda g, v, i: 1000 * v + i)
    if history is not None:
        history[0] = store.params
        pool_kw["on_commit"] = lambda cohort: history.__setitem__(store.version, store.params)
    return RolloutPool(coord, store, job_fn, **pool_kw), store, coord


def pool_threads():
    return [t for t in threading.enumerate() if t.name.startswith("rollout-")]


def sleepy(job, params):
    time.sleep(0.001 * (1 + job.member_seed % 4))
    return JobResult(float(job.member_seed % 7), {"steps": 1})


def test_every_job_runs_on_the_weights_of_its_dispatch_version():
    history, seen, lock = {}, [], threading.Lock()

    def job_fn(job, params):
        with lock:
            seen.append((job.dispatch_version, params["w"].copy()))
        return sleepy(job, params)

    cfg = PoolConfig(population=6, num_workers=4, mode="async", max_staleness=2)
    replicas = [Replica(0), Replica(1)]
    pool, store, coord = make(cfg, job_fn, history=history, replicas=replicas, workers_per_replica=2)
    with pool:
        metrics = pool.run_until(8, timeout=30)
    assert not pool_threads()
    assert len(metrics) >= 8 and store.version == coord.version
    for v, w in seen:
        np.testing.assert_array_equal(w, history[v]["w"])
    syncs = {k: sum(r.syncs[k] for r in replicas) for k in ("none", "replay", "copy")}
    assert syncs["replay"] > 0 and syncs["copy"] >= 2  # first load is a copy; later updates are replayed
    assert all(m.staleness_hist and max(m.staleness_hist) <= 2 for m in metrics)


def test_failed_and_hung_jobs_are_reissued_and_nothing_is_lost_or_double_counted():
    tries, lock = {}, threading.Lock()

    def flaky(job, params):
        with lock:
            tries[job.job_id] = n = tries.get(job.job_id, 0) + 1
        if n == 1 and job.member_seed % 5 == 1:
            raise RuntimeError("sandbox crashed")
        if n == 1 and job.member_seed % 5 == 3:
            time.sleep(0.3)  # past the 0.1 s deadline: re-issued elsewhere, this late result is ignored
        return sleepy(job, params)

    cfg = PoolConfig(population=5, num_workers=3, mode="sync", deadline_seconds=0.1)
    pool, store, coord = make(cfg, flaky)
    with pool:
        metrics = pool.run_until(4, timeout=30)
    assert not pool_threads()  # the hung workers rejoined and were joined at shutdown
    outcomes = list(coord.outcomes.values())
    assert outcomes.count("failed") >= 4 and outcomes.count("expired") >= 4
    assert coord.late == {a for a, o in coord.outcomes.items() if o == "expired"}
    assert sum(m.reissued for m in metrics) >= 8 and sum(m.wasted_seconds for m in metrics) > 0
    for v in range(4):  # each sync cohort is exactly its version's N members, once each
        assert sorted(store.entries(v, v + 1)[0].seeds) == [1000 * v + i for i in range(5)]


def test_drain_accounts_every_running_job_and_resume_continues():
    cfg = PoolConfig(population=6, num_workers=3, mode="async", max_staleness=1)
    hours = [0.0]  # a clock that jumps an hour while drained, as if a long evaluation ran
    pool, store, coord = make(cfg, sleepy, clock=lambda: time.monotonic() + 3600 * hours[0])
    with pool:
        pool.run_until(3, timeout=30)
        pool.drain(timeout=30)
        assert coord.quiescent and coord.in_flight == 0
        frozen = (coord.version, coord.dispatched, store.version)
        time.sleep(0.02)
        assert (coord.version, coord.dispatched, store.version) == frozen  # nothing moves while drained
        state = coord.state_dict(), store.state_dict()
        assert int(state[1]["version"]) == frozen[0]
        hours[0] = 1.0
        pool.resume()
        metrics = pool.run_until(frozen[0] + 2, timeout=30)
    assert not pool_threads()
    # the drained hour is the trainer's, not idle workers': the next update's clock leaves it out
    after = next(m for m in metrics if m.version == frozen[0])  # the update from version 3 to 4
    assert after.wall_seconds < 60 and after.utilization > 0.1


def test_an_error_in_the_learner_stops_the_pool_and_surfaces():
    def broken_update(p, o, s, z):
        raise FloatingPointError("nan in update")

    cfg = PoolConfig(population=4, num_workers=2, mode="sync")
    store = ParamStore({"w": np.zeros(4, np.float32)}, apply_update=broken_update, shape=lambda f: f)
    pool = RolloutPool(Coordinator(cfg, member_seed=lambda g, v, i: i), store, sleepy)
    with pytest.raises(FloatingPointError):
        with pool:
            pool.run_until(2, timeout=30)
    assert not pool_threads()


def test_a_job_that_always_fails_is_fatal_not_an_endless_loop():
    def always(job, params):
        raise ValueError("bad task")

    cfg = PoolConfig(population=4, num_workers=2, mode="async", max_attempts=2)
    pool, _, _ = make(cfg, always)
    with pytest.raises(RuntimeError, match="failed 2 times"):
        with pool:
            pool.run_until(1, timeout=30)
    assert not pool_threads()


def test_replicas_come_from_the_data_axis_of_the_mesh():
    import jax
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    replicas = replicas_from_mesh(mesh)
    assert len(replicas) == 4
    assert [tuple(r.mesh.shape.values()) for r in replicas] == [(1, 2)] * 4  # 1xM, as the engine needs
    assert set(replicas[1].mesh.devices.flat) == set(mesh.devices[1])
    placed = replicas[2].place({"w": np.ones(4, np.float32)})
    assert placed["w"].sharding.device_set == set(mesh.devices[2])

    devices_seen, lock = set(), threading.Lock()

    def job_fn(job, params):
        with lock:
            devices_seen.update(params["w"].sharding.device_set)
        return JobResult(float(job.member_index))

    cfg = PoolConfig(population=8, num_workers=4, mode="sync")
    store = ParamStore({"w": np.zeros(4, np.float32)}, apply_update=lambda p, o, s, z: (p, o), shape=lambda f: f)
    with RolloutPool(Coordinator(cfg, member_seed=lambda g, v, i: i), store, job_fn, replicas=replicas) as pool:
        pool.run_until(2, timeout=30)
    assert devices_seen <= set(mesh.devices.flat) and len(devices_seen) >= 2


def test_workers_must_match_the_configuration():
    cfg = PoolConfig(population=8, num_workers=4)
    store = ParamStore({}, apply_update=lambda p, o, s, z: (p, o), shape=lambda f: f)
    with pytest.raises(ValueError, match="num_workers=4"):
        RolloutPool(Coordinator(cfg, member_seed=lambda g, v, i: i), store, sleepy, replicas=[Replica(0)])


def test_workers_keep_reporting_while_the_learner_applies_an_update():
    windows, history = [], {}

    def slow_update(p, o, s, z):  # a learner step that takes much longer than one job
        t0 = time.monotonic()
        time.sleep(0.03)
        windows.append((t0, time.monotonic()))
        return sgd(p, s, z), o

    seen = []

    def job_fn(job, params):
        seen.append((job.dispatch_version, params["w"].copy()))
        return sleepy(job, params)

    cfg = PoolConfig(population=6, num_workers=3, mode="async", max_staleness=2)
    store = ParamStore({"w": np.zeros(4, np.float32)}, apply_update=slow_update, shape=lambda f: f - f.mean(),
                       replay=sgd, max_replay=3)
    coord = Coordinator(cfg, member_seed=lambda g, v, i: 1000 * v + i)
    history[0] = store.params
    arrivals = []

    def on_commit(cohort):
        history[store.version] = store.params
        arrivals.extend(r.arrived for r in cohort.results)

    pool = RolloutPool(coord, store, job_fn, on_commit=on_commit)
    with pool:
        pool.run_until(5, timeout=30)
        pool.drain(timeout=30)
    for v, w in seen:  # no job ever ran on weights that were not yet published
        np.testing.assert_array_equal(w, history[v]["w"])
    # Results keep arriving during learner steps (they are accepted against the new version).
    during = [t for t in arrivals if any(t0 < t < t1 for t0, t1 in windows)]
    assert len(during) >= 3


def test_on_commit_can_pause_the_pool_before_any_job_of_the_new_version_starts():
    versions, lock = [], threading.Lock()

    def job_fn(job, params):
        with lock:
            versions.append(job.dispatch_version)
        return sleepy(job, params)

    cfg = PoolConfig(population=6, num_workers=3, mode="async", max_staleness=1)
    pool, store, coord = make(cfg, job_fn)
    pool.on_commit = lambda cohort: coord.drain() if cohort.version + 1 >= 3 else None
    with pool:
        pool.run_until(3, timeout=30)
        pool.drain(timeout=30)
        assert store.version == 3 and max(versions) == 2
