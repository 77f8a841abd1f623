"""JobBatcher: the pool's worker threads hand their jobs of one version to ONE batched call (a cohort batch),
and every job still gets its own result, accounting and re-issue."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from asyncres_jax.rollout import Coordinator, JobResult, ParamStore, PoolConfig, Replica, RolloutPool
from asyncres_jax.rollout.cohort import JobBatcher
from asyncres_jax.rollout.coordinator import Job

pytestmark = pytest.mark.timeout(60)


def fitness_of(job):  # what member `job` would score alone
    return float(job.member_seed % 7)


def make_pool(config, job_fn, replicas, workers_per_replica, history, cohorts=None, learner_seconds=0.0):
    def apply_update(p, o, s, z):
        time.sleep(learner_seconds)
        return {"w": p["w"] + np.float32(np.sum(z))}, o

    store = ParamStore({"w": np.zeros(2, np.float32)}, apply_update=apply_update,
                       shape=lambda f: f - f.mean(), replay=lambda p, s, z: {"w": p["w"] + np.float32(np.sum(z))},
                       max_replay=2)
    coord = Coordinator(config, member_seed=lambda g, v, i: 100 * v + i)
    history[0] = store.params

    def on_commit(cohort):
        history[store.version] = store.params
        if cohorts is not None:
            cohorts.append(cohort)

    return RolloutPool(coord, store, job_fn, replicas=replicas, workers_per_replica=workers_per_replica,
                       on_commit=on_commit), store


def recording_batch_fn(batches, lock, fail_first=False):
    def batch_fn(jobs, params):
        with lock:
            batches.append(([j.dispatch_version for j in jobs], [j.member_seed for j in jobs], params))
            if fail_first and len(batches) == 1:
                raise RuntimeError("the whole batch broke")
        return [JobResult(fitness_of(j), {"batch": len(jobs)}) for j in jobs]
    return batch_fn


def test_sync_pool_runs_each_version_as_full_batches_and_results_reach_their_members():
    batches, lock, history, cohorts = [], threading.Lock(), {}, []
    batcher = JobBatcher(recording_batch_fn(batches, lock), max_batch=4, linger_s=0.5)
    cfg = PoolConfig(population=8, num_workers=4, mode="sync")
    pool, store = make_pool(cfg, batcher, [Replica(0)], 4, history, cohorts)
    with pool:
        pool.run_until(3, timeout=30)
    # 8 members per version, 4 workers holding a job each: every version is two batches of 4
    # (jobs of version 3 may have started before the pool stopped)
    assert batcher.batch_sizes[:6] == [4] * 6 and [b[0][0] for b in batches[:6]] == [0, 0, 1, 1, 2, 2]
    for versions, _, params in batches:
        assert len(set(versions)) == 1
        np.testing.assert_array_equal(params["w"], history[versions[0]]["w"])  # the weights of that version
    # each cohort holds every member once, with exactly the fitness that member scores alone
    for v, cohort in enumerate(cohorts[:3]):
        assert [r.job.member_index for r in cohort.results] == list(range(8))
        assert [r.fitness for r in cohort.results] == [fitness_of(r.job) for r in cohort.results]
        assert all(r.stats["batch"] == 4 for r in cohort.results)


def test_async_pool_batches_never_mix_versions_or_replicas_and_failed_batches_are_reissued():
    batches, lock, history = [], threading.Lock(), {}
    batcher = JobBatcher(recording_batch_fn(batches, lock, fail_first=True), max_batch=3, linger_s=0.02)
    cfg = PoolConfig(population=8, num_workers=6, mode="async", max_staleness=1)
    pool, store = make_pool(cfg, batcher, [Replica(0), Replica(1)], 3, history)
    with pool:
        metrics = pool.run_until(4, timeout=30)
    assert len(metrics) >= 4 and max(batcher.batch_sizes) > 1
    for versions, seeds, params in batches:
        assert len(set(versions)) == 1 and len(set(seeds)) == len(seeds)
        np.testing.assert_array_equal(params["w"], history[versions[0]]["w"])
    assert sum(m.reissued for m in metrics) >= batcher.batch_sizes[0]  # every job of the failed batch came back


def test_batcher_groups_concurrent_jobs_by_version_and_weights():
    calls = []
    release = threading.Event()

    def batch_fn(jobs, params):
        calls.append(([j.job_id for j in jobs], params["name"]))
        return [JobResult(float(j.job_id)) for j in jobs]

    batcher = JobBatcher(batch_fn, max_batch=3, linger_s=0.3)
    a, b = {"name": "a"}, {"name": "b"}
    work = [(Job(0, 0, 0, 5, 0, 0), a), (Job(1, 0, 1, 6, 0, 0), a), (Job(2, 0, 2, 7, 0, 0), b),
            (Job(3, 1, 0, 8, 0, 0), a)]
    out = {}

    def worker(job, params):
        release.wait()
        out[job.job_id] = batcher(job, params).fitness

    threads = [threading.Thread(target=worker, args=w) for w in work]
    for t in threads:
        t.start()
    release.set()
    for t in threads:
        t.join(10)
    assert out == {0: 0.0, 1: 1.0, 2: 2.0, 3: 3.0}
    assert sorted((sorted(ids), name) for ids, name in calls) == [([0, 1], "a"), ([2], "b"), ([3], "a")]


def test_async_pool_on_one_replica_keeps_every_batch_whole():
    """The workers of a batch get their results together; the one that completes a cohort commits it (a learner
    step) while the others report. None of them takes a new job before its whole batch is reported, so the next
    batch starts with every worker in it, not split into a part of the old version and a part of the new."""
    batches, lock, history = [], threading.Lock(), {}
    record = recording_batch_fn(batches, lock)

    def batch_fn(jobs, params):  # a batch takes time, the same whatever its size (as a cohort batch roughly does)
        time.sleep(0.15)
        return record(jobs, params)

    batcher = JobBatcher(batch_fn, max_batch=4, linger_s=0.05)
    cfg = PoolConfig(population=8, num_workers=4, mode="async", max_staleness=1)
    pool, store = make_pool(cfg, batcher, [Replica(0)], 4, history, learner_seconds=0.1)
    with pool:
        metrics = pool.run_until(5, timeout=30)
    assert len(metrics) >= 5
    assert batcher.batch_sizes[:10] == [4] * 10


def test_async_pool_with_smaller_batches_than_workers_lands_some_results_one_update_stale():
    """es.members_per_batch < pool.workers_per_replica: a replica's 4 workers play two batches of 2 at once, so a
    batch that ends before the cohort is complete takes new jobs of the old version, which land in the next
    cohort one update old (as the paper's engines do); none staler than K is accepted and every batch stays on
    one version's weights."""
    batches, lock, history, cohorts = [], threading.Lock(), {}, []
    record = recording_batch_fn(batches, lock)

    def batch_fn(jobs, params):
        time.sleep(0.05 + 0.1 * (jobs[0].member_index % 3))  # batches of unequal length, as real episodes are
        return record(jobs, params)

    batcher = JobBatcher(batch_fn, max_batch=2, linger_s=0.02)
    cfg = PoolConfig(population=8, num_workers=4, mode="async", max_staleness=1)
    pool, store = make_pool(cfg, batcher, [Replica(0)], 4, history, cohorts)
    with pool:
        metrics = pool.run_until(6, timeout=30)
    assert max(batcher.batch_sizes) == 2
    stale = sum(m.staleness_hist.get(1, 0) for m in metrics)
    assert stale > 0 and all(set(m.staleness_hist) <= {0, 1} for m in metrics)
    for versions, _, params in batches:
        assert len(set(versions)) == 1
        np.testing.assert_array_equal(params["w"], history[versions[0]]["w"])
    for cohort in cohorts:  # each accepted result is what its member scores alone, whatever batch it was in
        assert [r.fitness for r in cohort.results] == [fitness_of(r.job) for r in cohort.results]
