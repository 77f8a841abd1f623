"""Ray actors as rollout replicas (pool.backend=ray) on a local Ray cluster: 2 actors, the tiny model, the fake
environment. One actor process dies mid-job; its job is re-issued and a replacement actor catches up from the
log. Every update completes with exactly N results, none lost or counted twice, and the learner's parameters
equal the threaded pool's under the same seeds and config.

Without ray installed these tests skip, except under CI=true, where they fail (CI must run them).
"""

import json
import os
import sys

import jax
import numpy as np
import pytest
from bwrap_support import bwrap_or_skip

try:
    import ray
except ImportError:
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("ray is not installed (pip install 'ray>=2.60')", allow_module_level=True)

from asyncres_jax import es, train
from asyncres_jax.config import load_config, to_yaml
from asyncres_jax.errors import UserError
from asyncres_jax.rollout.jobs import fake_job_fn
from asyncres_jax.model.tiny import tiny_model
from asyncres_jax.rollout import Coordinator, Job, PoolConfig, Replica, RolloutPool, es_param_store
from asyncres_jax.rollout import ray_pool
from asyncres_jax.rollout.ray_pool import ActorSpec, RayRolloutPool, ReplicaState, driver_jax_config
from asyncres_jax.run import CONFIG_FILE, ensure_tasks
from asyncres_jax.trainer import build_replica

pytestmark = [pytest.mark.timeout(180), pytest.mark.xdist_group("ray")]

N, UPDATES = 6, 3
CRASH_JOB = N + 1  # version 1, member 1: the replacement actor must replay update 0 before running anything


@pytest.fixture(scope="module")
def cluster():
    # Actors unpickle this module's build function by value: tests/ is not importable in a Ray worker.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    assert ray_pool.connect(num_cpus=4)  # a local cluster: 2 actors, a replacement, room to spare
    try:
        yield
    finally:
        ray.shutdown()


def tiny_replica(es_cfg, crash_job_id=None, marker=None) -> ReplicaState:
    """Inside an actor: tiny model (seed 0) at version 0, the fake job; crashes the process once on one job."""
    params = jax.tree.map(np.asarray, tiny_model(0).params)
    job_fn = fake_job_fn(tiny_model(0).config, es_cfg)

    def crashing(job, p):
        if job.job_id == crash_job_id and not os.path.exists(marker):
            open(marker, "w").close()
            job_fn(job, p)  # mid-job: the work is done, the result never leaves the process
            os._exit(1)
        return job_fn(job, p)

    def replay(p, seeds, shaped):
        return es.apply_logged_update(p, es.init(p, es_cfg), seeds, shaped, es_cfg)[0]

    place = lambda tree: jax.tree.map(jax.numpy.asarray, tree)  # noqa: E731
    return ReplicaState(0, place(params), crashing, replay if es_cfg.optimizer == "sgd" else None, place)


def es_cfg(optimizer="sgd"):
    return es.ESConfig(population=N, sigma=0.02, alpha=0.01, optimizer=optimizer)


def learner(cfg, pool_cfg):
    store = es_param_store(tiny_model(0).params, cfg)
    return store, Coordinator(pool_cfg, es.member_seed)


def run_threads(cfg, pool_cfg):
    store, coord = learner(cfg, pool_cfg)
    cohorts = []
    pool = RolloutPool(coord, store, fake_job_fn(tiny_model(0).config, cfg), replicas=[Replica(0), Replica(1)],
                       on_commit=cohorts.append)
    with pool:
        pool.run_until(UPDATES, timeout=120)
    return store, cohorts


def run_ray(cfg, pool_cfg, **build_kw):
    import functools

    store, coord = learner(cfg, pool_cfg)
    cohorts = []
    # The actors see the driver's CPU devices (conftest: 8 simulated), so XLA splits its work the same way and
    # the fitness values are bit-identical to the thread pool's, not only close.
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ["XLA_FLAGS"]}
    spec = ActorSpec(functools.partial(tiny_replica, cfg, **build_kw), num_cpus=1, env=env,
                     jax_config=driver_jax_config())
    pool = RayRolloutPool(coord, store, spec, on_commit=cohorts.append)
    try:
        pool.run_until(UPDATES, timeout=150)
        pool.drain(timeout=60)
        # A drained coordinator no longer waits for attempts it cancelled, but their actors still run them, and
        # one of them may be the crashing job (a slow actor's, cancelled as too stale): let every actor report.
        pool._wait_for(lambda: all(s.attempt is None for s in pool.slots), 60, "every actor's report")
    finally:
        pool.shutdown()
    return store, coord, pool, cohorts


def assert_each_job_counted_once(cohorts, coord, n=N):
    job_ids = [r.job.job_id for c in cohorts for r in c.results]
    assert [len(c.results) for c in cohorts] == [n] * len(cohorts)
    assert len(job_ids) == len(set(job_ids))  # none counted twice
    accepted = [a for a, o in coord.outcomes.items() if o == "accepted"]
    assert len(accepted) == len(job_ids) + len(coord._cohort)  # every accepted result is in a cohort (or waits)


def test_an_actor_killed_mid_job_loses_nothing_and_params_equal_the_thread_pool(cluster, tmp_path):
    cfg, pool_cfg = es_cfg(), PoolConfig(population=N, num_workers=2, mode="sync", global_seed=7)
    ref_store, ref_cohorts = run_threads(cfg, pool_cfg)
    store, coord, pool, cohorts = run_ray(cfg, pool_cfg, crash_job_id=CRASH_JOB, marker=str(tmp_path / "crashed"))

    assert (tmp_path / "crashed").exists() and pool.restarts == 1
    assert sorted(s.started for s in pool.slots) == [1, 2]  # one slot got a replacement actor
    assert sorted(coord.outcomes.values()).count("failed") == 1
    assert store.version == UPDATES and len(pool.metrics) == UPDATES
    assert sum(m.reissued for m in pool.metrics) == 1
    assert_each_job_counted_once(cohorts, coord)
    # sync: every (version, member) exactly once, all fresh
    assert [sorted((r.job.dispatch_version, r.job.member_index) for r in c.results) for c in cohorts] == [
        [(v, i) for i in range(N)] for v in range(UPDATES)]
    for c, ref in zip(cohorts, ref_cohorts):
        np.testing.assert_array_equal(c.seeds, ref.seeds)
        np.testing.assert_array_equal(c.fitness, ref.fitness)  # the actors computed the same fitness, bit for bit
    for a, b in zip(jax.tree.leaves(store.params), jax.tree.leaves(ref_store.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # SGD: only seeds and shaped fitness crossed to the actors, never weights
    syncs = pool.sync_counts()
    assert syncs["replay"] >= UPDATES - 1 and syncs["copy"] == 0 and pool.bytes_sent["copy"] == 0
    assert 0 < pool.bytes_sent["replay"] <= (UPDATES * 2 + 1) * UPDATES * N * (8 + 4)


def test_a_stateful_optimiser_sends_weights_through_the_object_store(cluster):
    cfg, pool_cfg = es_cfg("adam"), PoolConfig(population=N, num_workers=2, mode="sync", global_seed=3)
    ref_store, _ = run_threads(cfg, pool_cfg)
    store, coord, pool, cohorts = run_ray(cfg, pool_cfg)

    assert_each_job_counted_once(cohorts, coord)
    syncs = pool.sync_counts()
    # each new version reaches one or both actors (an actor that got none of a version's jobs skips it)
    assert syncs["replay"] == 0 and syncs["copy"] >= UPDATES - 1
    n_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(store.params))
    # a version's weights go into the object store once, however many actors fetch them (both, or only one when
    # the other got none of its jobs)
    assert pool.bytes_sent["copy"] == pool.puts * n_bytes and UPDATES - 1 <= pool.puts <= min(UPDATES, syncs["copy"])
    for a, b in zip(jax.tree.leaves(store.params), jax.tree.leaves(ref_store.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_async_k1_with_a_killed_actor_keeps_the_staleness_bound(cluster, tmp_path):
    cfg, pool_cfg = es_cfg(), PoolConfig(population=N, num_workers=2, mode="async", max_staleness=1, global_seed=5)
    store, coord, pool, cohorts = run_ray(cfg, pool_cfg, crash_job_id=CRASH_JOB, marker=str(tmp_path / "crashed"))

    assert pool.restarts == 1 and store.version >= UPDATES
    assert_each_job_counted_once(cohorts, coord)
    assert all(0 <= s <= 1 for c in cohorts for s in c.staleness)


def test_train_cli_with_the_ray_backend_matches_the_thread_backend(cluster, tmp_path):
    common = ["model.name=tiny", "tasks.dataset=fake", "es.population=6", "es.updates=2", "pool.mode=sync",
              "eval.every=0"]
    assert train.main([f"run_dir={tmp_path / 'threads'}", *common]) == 0
    assert train.main([f"run_dir={tmp_path / 'ray'}", *common, "pool.backend=ray", "pool.ray_actors=2"]) == 0

    def fitness(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["fitness_mean"] for line in lines]
    # The actors see one CPU device, the threads' replica is one of 8 simulated ones: XLA may sum in another order.
    assert len(fitness("ray")) == 2 and fitness("ray") == pytest.approx(fitness("threads"), rel=1e-6)

    # What a replacement actor of each run starts from: its latest checkpoint (update 2), not the initial weights.
    replicas = [build_replica(to_yaml(load_config(tmp_path / run / CONFIG_FILE)))
                for run in ("ray", "threads")]
    assert [r.version for r in replicas] == [2, 2]
    initial = jax.tree.leaves(tiny_model(0).params)
    for a, b, x0 in zip(*(jax.tree.leaves(r.params) for r in replicas), initial):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert any(not np.array_equal(np.asarray(a), np.asarray(x0)) for a, x0 in zip(jax.tree.leaves(replicas[0].params),
                                                                                   initial))


def test_bad_backend_is_one_line(capsys, tmp_path):
    code = train.main([f"run_dir={tmp_path / 'run'}", "model.name=tiny", "tasks.dataset=fake", "pool.backend=mpi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: ") and "pool.backend='mpi' is not valid" in err[-1]
    assert not (tmp_path / "run").exists()


def test_missing_or_unreachable_ray_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(UserError, match="needs the ray package"):
        ray_pool.import_ray()
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)

    def refuse(**kw):
        raise ConnectionError("Could not find any running Ray instance.\nmore detail")
    monkeypatch.setattr(ray, "init", refuse)
    with pytest.raises(UserError, match=r"cannot start or reach the Ray cluster at 10.0.0.9:6379: Could not find") as e:
        ray_pool.connect("10.0.0.9:6379")
    assert "\n" not in str(e.value)


def broken_build():
    raise UserError("model 'nope' not found; check model.name")


def test_a_config_mistake_in_an_actor_is_the_same_one_line_error(cluster):
    store, coord = learner(es_cfg(), PoolConfig(population=N, num_workers=1, mode="sync"))
    pool = RayRolloutPool(coord, store, ActorSpec(broken_build, num_cpus=1))
    try:
        with pytest.raises(UserError, match="^model 'nope' not found; check model.name$"):
            pool.run_until(1, timeout=60)
        assert pool.restarts == 0  # a mistake is not a crash: no replacement actors
    finally:
        pool.shutdown()


@pytest.mark.bwrap
def test_an_actor_built_for_real_tasks_plays_episodes_in_its_own_sandboxes(tmp_path):
    """What each actor runs for tasks.dataset=DIR, here in-process: the config's model, its own sandbox backend."""
    bwrap_or_skip()
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", "model.name=tiny", f"tasks.dataset={tmp_path / 'tasks'}",
                             "tasks.generate_n=8", "episode.max_turns=1", "episode.max_new_tokens=4",
                             "episode.context_limit=4096", "es.population=3", "es.tasks_per_member=2"])
    ensure_tasks(cfg)
    replica = build_replica(to_yaml(cfg))
    try:
        assert replica.version == 0 and replica.replay is not None  # no checkpoint yet; SGD on float32 replays
        result = replica.job_fn(Job(0, 0, 0, es.member_seed(0, 0, 0), 1, 7), replica.params)
    finally:
        replica.close()
    assert result.stats["episodes"] == 2 and result.stats["turns"] == 2 and 0.0 <= result.fitness <= 1.0


def crashing_replica() -> ReplicaState:
    return ReplicaState(0, {}, job_fn=lambda job, params: os._exit(1), replay=None)


def test_actors_that_keep_dying_stop_the_pool_with_the_error(cluster):
    store, coord = learner(es_cfg(), PoolConfig(population=N, num_workers=1, mode="sync", max_attempts=5))
    pool = RayRolloutPool(coord, store, ActorSpec(crashing_replica, num_cpus=1), max_restarts=2)
    try:
        with pytest.raises(RuntimeError, match="3 actors died"):
            pool.run_until(1, timeout=60)
        assert pool.slots[0].started == 3 and list(coord.outcomes.values()) == ["failed"] * 3
    finally:
        pool.shutdown()
    assert pool.slots[0].handle is None


def test_actors_the_cluster_cannot_hold_are_refused_not_left_pending(cluster, capsys, tmp_path):
    code = train.main([f"run_dir={tmp_path / 'run'}", "model.name=tiny", "tasks.dataset=fake", "es.population=6",
                       "pool.backend=ray", "pool.ray_actors=2", "pool.ray_gpus_per_actor=1"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    assert last.startswith("error: 2 rollout actors need 2 GPUs but the Ray cluster has 4 CPUs and 0 GPUs")
    assert ray.is_initialized()  # the cluster the trainer did not start is left running


def straggler_replica() -> ReplicaState:
    """Inside an actor: job 0 would run a minute in 10 ms turns, checking for cancellation; the rest are quick."""
    import time

    from asyncres_jax.rollout import JobResult, cancel

    def job_fn(job, params):
        if job.job_id == 0:
            t = time.monotonic()
            while time.monotonic() - t < 60:
                cancel.check()
                time.sleep(0.01)
            return JobResult(-1.0)
        time.sleep(0.05)
        return JobResult(float(job.member_index))

    return ReplicaState(0, {"w": np.zeros(2, np.float32)}, job_fn, None)


def test_a_job_cancelled_by_a_commit_stops_in_its_actor_which_takes_new_jobs(cluster):
    from asyncres_jax.rollout import ParamStore

    store = ParamStore({"w": np.zeros(2, np.float32)}, apply_update=lambda p, o, s, z: (p, o),
                       shape=lambda f: f - f.mean())
    coord = Coordinator(PoolConfig(population=3, num_workers=2, mode="async", max_staleness=1), es.member_seed)
    cohorts = []
    pool = RayRolloutPool(coord, store, ActorSpec(straggler_replica, num_cpus=1), on_commit=cohorts.append,
                          poll_seconds=0.01)
    try:
        metrics = pool.run_until(5, timeout=50)  # job 0 alone would hold its actor for 60 s
    finally:
        pool.shutdown()
    first = next(a for a, o in coord.outcomes.items() if o == "cancelled")
    assert coord.cancelled == 1 and coord.dropped == 0 and first == 0  # job 0's only attempt
    assert sum(m.cancelled for m in metrics) == 1 and all(max(m.staleness_hist) <= 1 for m in metrics)
    assert all(sum(s.syncs.values()) >= 2 for s in pool.slots)  # both actors ran jobs after the cancellation
    assert 0 not in {r.job.job_id for c in cohorts for r in c.results}
    assert_each_job_counted_once(cohorts, coord, n=3)


def test_batch_shaping_gets_each_results_task_batch_as_in_the_thread_pool(cluster):
    # Controlled, delay 1, held-back jobs on their own version's tasks: from update 1 on each cohort holds one
    # result of another task batch, which es.shaping_groups=batch leaves alone (z = 0: nothing to compare it with).
    import dataclasses

    cfg = dataclasses.replace(es_cfg(), shaping_groups="batch")
    pool_cfg = PoolConfig(population=N, num_workers=2, mode="controlled", held_back=1, delay=1, global_seed=2)
    ref_store, ref_cohorts = run_threads(cfg, pool_cfg)
    store, coord, pool, cohorts = run_ray(cfg, pool_cfg)

    assert [c.task_versions.tolist() for c in cohorts] == [c.task_versions.tolist() for c in ref_cohorts]
    for c in cohorts:
        (entry,) = store.entries(c.version, c.version + 1)
        np.testing.assert_array_equal(entry.shaped, es.shape_fitness(c.fitness, cfg, c.task_versions))
        assert entry.shaped[c.task_versions != c.version].tolist() == [0.0] * (c.version > 0)
    for a, b in zip(jax.tree.leaves(store.params), jax.tree.leaves(ref_store.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
