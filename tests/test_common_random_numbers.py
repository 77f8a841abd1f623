"""Common random numbers with stale results: es.shaping_groups=batch shapes each task batch's results apart
(the paper's rule, `none`, stays the default bit for bit), pool.held_back_tasks=landing makes a held-back job
play the tasks of the cohort it lands in, the store and pool pass each result's task version as its group, and
every update's record says how many task batches its cohort held and the fitness spread within them."""

import dataclasses
import json
import math
import pathlib
import threading

import numpy as np
import pytest

from asyncres_jax import es, metrics, train
from asyncres_jax.config import load_config
from asyncres_jax.errors import UserError
from asyncres_jax.es.shaping import shape_within_groups
from asyncres_jax.rollout import Coordinator, Job, JobResult, ParamStore, PoolConfig, batch_seeds, es_param_store
from asyncres_jax.rollout.cohort import JobBatcher, play_cohort
from asyncres_jax.run import fingerprint

# Six results played on three task batches: 7 (three results), 8 (two) and 9 (one).
FITNESS = np.array([0.1, 0.3, 0.5, 0.9, 0.2, 0.6])
GROUPS = np.array([7, 7, 7, 8, 8, 9])


def cfg(**kw):
    return es.ESConfig(population=6, **kw)


# ---------------------------------------------------------------------------------------------- shaping


def test_zscore_by_batch_standardises_each_batch_on_its_own_and_a_lone_result_gets_zero():
    z = es.shape_fitness(FITNESS, cfg(shaping_groups="batch"), GROUPS)
    # batch 7: mean 0.3, population std sqrt(0.08 / 3); batch 8: +-0.35 around 0.55; batch 9: nothing to compare
    r = math.sqrt(1.5)
    np.testing.assert_allclose(z, [-r, 0, r, 1, -1, 0], rtol=1e-6, atol=1e-7)
    assert z.dtype == np.float32


def test_centered_ranks_by_batch_are_rescaled_to_a_whole_cohorts_rank_variance():
    z = es.shape_fitness(FITNESS, cfg(shaping="centered_rank", shaping_groups="batch"), GROUPS)
    s3, s2 = math.sqrt(7 * 2 / (5 * 4)), math.sqrt(7 * 1 / (5 * 3))  # sqrt((N+1)(k-1) / ((N-1)(k+1))), N = 6
    np.testing.assert_allclose(z, [-0.5 * s3, 0, 0.5 * s3, 0.5 * s2, -0.5 * s2, 0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("k", [2, 3, 5, 8])
def test_a_rescaled_groups_ranks_have_the_variance_of_the_whole_cohorts(k):
    n = 8
    r_n = np.arange(n, dtype=float)
    whole = shape_within_groups(r_n, np.zeros(n), "centered_rank")
    groups = np.where(np.arange(n) < k, 0, np.arange(n) + 1)  # one group of k, the rest alone
    part = shape_within_groups(r_n, groups, "centered_rank")[:k]
    assert part.var() == pytest.approx(whole.var())


def test_the_default_is_the_papers_rule_bit_for_bit_and_one_batch_shapes_like_it():
    for shaping in ("zscore", "centered_rank"):
        whole = es.shape_fitness(FITNESS, cfg(shaping=shaping))
        assert cfg().shaping_groups == "none"
        assert es.shape_fitness(FITNESS, cfg(shaping=shaping), GROUPS).tobytes() == whole.tobytes()  # ignored
        one_batch = es.shape_fitness(FITNESS, cfg(shaping=shaping, shaping_groups="batch"), np.full(6, 3))
        assert one_batch.tobytes() == whole.tobytes()  # a sync cohort (one task batch) is shaped the paper's way
    equal = es.shape_fitness(np.full(6, 0.5), cfg(shaping_groups="batch"), GROUPS)
    assert equal.tolist() == [0.0] * 6  # no spread within any batch: no update


def test_bad_groups_and_raw_with_groups_are_one_line_user_errors():
    with pytest.raises(UserError, match="group labels"):
        es.shape_fitness(FITNESS, cfg(shaping_groups="batch"), GROUPS[:5])
    with pytest.raises(UserError, match="shaping_groups"):
        cfg(shaping="raw", shaping_groups="batch")
    with pytest.raises(UserError, match="shaping_groups"):
        cfg(shaping_groups="version")


# ---------------------------------------------------------------------------------------------- store


def test_the_store_shapes_with_the_groups_and_keeps_its_old_signature():
    calls = []
    store = ParamStore({"w": np.zeros(2, np.float32)}, apply_update=lambda p, o, s, z: (p, o),
                       shape=lambda f: calls.append("plain") or f - f.mean(),
                       shape_grouped=lambda f, g: calls.append(("grouped", g.tolist())) or f * 0)
    store.commit(np.arange(6), FITNESS)
    entry = store.commit(np.arange(6), FITNESS, GROUPS)
    assert calls == ["plain", ("grouped", GROUPS.tolist())] and entry.shaped.tolist() == [0.0] * 6
    stub = ParamStore({}, apply_update=lambda p, o, s, z: (p, o), shape=lambda f: f)  # knows no groups: ignores them
    assert stub.commit(np.arange(6), FITNESS, GROUPS).shaped.tolist() == FITNESS.astype(np.float32).tolist()


def test_the_es_store_logs_the_batch_shaped_fitness():
    import jax.numpy as jnp

    c = cfg(shaping_groups="batch")
    store = es_param_store({"w": jnp.zeros(4)}, c)
    entry = store.commit(np.arange(6), FITNESS, GROUPS)
    expected = es.shape_fitness(FITNESS.astype(np.float32), c, GROUPS)  # the store takes float32 fitness
    assert entry.shaped.tobytes() == expected.tobytes() and entry.shaped[5] == 0


# ---------------------------------------------------------------------------------------------- held-back tasks


def seed_of(g, v, i):
    return g * 10_000 + v * 100 + i


def controlled_cohorts(held_back_tasks, updates=6, **kw):
    """One worker through `updates` cohorts of N=4, one result held back for exactly 2 updates."""
    c = Coordinator(PoolConfig(population=4, num_workers=1, mode="controlled", held_back=1, delay=2, global_seed=5,
                               held_back_tasks=held_back_tasks, **kw), member_seed=seed_of)
    t, cohorts = 0.0, []
    while len(cohorts) < updates:
        a = c.dispatch(t)
        t += 1.0
        cohort = c.on_result(a.attempt_id, JobResult(float(a.job.member_index)), t)
        cohorts += [cohort] if cohort else []
    return c, cohorts


def test_a_held_back_job_plays_the_tasks_of_the_cohort_it_lands_in():
    _, cohorts = controlled_cohorts("landing")
    for ch in cohorts:
        assert ch.task_versions.tolist() == [ch.version] * 4  # one task batch per cohort, stale results included
        assert {(r.job.task_batch_id, r.job.sampling_seed) for r in ch.results} == {batch_seeds(5, ch.version)}
    stale = [r.job for ch in cohorts for r in ch.results if r.job.dispatch_version < ch.version]
    assert len(stale) == 4 and all(j.task_version == j.dispatch_version + 2 for j in stale)
    assert all(j.member_seed == seed_of(5, j.dispatch_version, j.member_index) for j in stale)  # noise unchanged


def test_by_default_a_held_back_job_plays_its_own_versions_tasks():
    _, cohorts = controlled_cohorts("dispatch")
    assert [ch.task_versions.tolist() for ch in cohorts[2:]] == [[v - 2, v, v, v] for v in range(2, 6)]
    assert all(r.job.task_version == r.job.dispatch_version for ch in cohorts for r in ch.results)


def test_task_versions_survive_a_checkpoint_and_old_checkpoints_load_as_dispatch():
    c, _ = controlled_cohorts("landing", updates=3)
    c.drain()
    t = 100.0
    while not c.quiescent:
        a = c.dispatch(t)
        t += 1.0
        c.on_result(a.attempt_id, JobResult(0.0), t)
    state = json.loads(json.dumps(c.state_dict()))
    held = [d["job"] for rs in state["held"].values() for d in rs]
    assert held and all(j["task_version"] == j["dispatch_version"] + 2 for j in held)
    c2 = Coordinator(c.config, member_seed=seed_of)
    c2.load_state_dict(state)
    assert [r.job for rs in c2._held.values() for r in rs] == [r.job for rs in c._held.values() for r in rs]
    old = {k: v for k, v in held[0].items() if k != "task_version"}  # written before jobs had a task version
    assert Job(**old).task_version == old["dispatch_version"]


def test_landing_is_a_controlled_option():
    with pytest.raises(UserError, match="mode=controlled"):
        PoolConfig(population=4, num_workers=1, mode="async", held_back_tasks="landing")
    with pytest.raises(UserError, match="pool.held_back_tasks=landing needs pool.mode=controlled"):
        load_config(None, ["pool.mode=async", "pool.held_back_tasks=landing"])
    with pytest.raises(UserError, match="not valid"):
        load_config(None, ["pool.mode=controlled", "pool.held_back_tasks=early"])


def test_the_new_options_leave_existing_fingerprints_alone():
    base = load_config(None, [])
    assert fingerprint(load_config(None, ["es.shaping_groups=none"])) == fingerprint(base)
    assert fingerprint(load_config(None, ["es.shaping_groups=batch"])) != fingerprint(base)
    landing = load_config(None, ["pool.mode=controlled", "pool.held_back_tasks=landing"])
    assert fingerprint(landing) != fingerprint(load_config(None, ["pool.mode=controlled"]))


def test_the_study_rows_keep_common_random_numbers():
    """Sync: one task batch per cohort (the paper's rule is the CRN one). Async: stale results are shaped with
    their own task batch. Delays: the held-back result plays the tasks of the cohort it lands in."""
    study = pathlib.Path(__file__).resolve().parent.parent / "configs" / "study"
    rows = {row: load_config(study / f"{row}.yaml") for row in ("es_sync", "es_async1", "es_delay4", "es_delay8")}
    assert rows["es_sync"].pool.mode == "sync" and rows["es_sync"].es.shaping_groups == "none"
    assert (rows["es_async1"].es.shaping_groups, rows["es_async1"].pool.held_back_tasks) == ("batch", "dispatch")
    for row in ("es_delay4", "es_delay8"):
        assert (rows[row].es.shaping_groups, rows[row].pool.held_back_tasks) == ("batch", "landing")
    # every row differs from sync only in its schedule, shaping groups and (async) batch size
    sync = rows["es_sync"]
    for row, cfg in rows.items():
        assert dataclasses.replace(cfg, run_dir=sync.run_dir, pool=sync.pool, es=dataclasses.replace(
            cfg.es, shaping_groups="none", members_per_batch=0)) == sync, row


def test_real_episodes_play_the_task_batch_of_the_jobs_task_version(monkeypatch):
    from asyncres_jax.rollout import episodes, jobs

    class Played(Exception):
        pass

    def capture(policy, tasks, *a, **kw):
        raise Played(tasks)

    monkeypatch.setattr(episodes, "run_episodes", capture)
    monkeypatch.setattr(jobs.es, "perturb", lambda params, *a, **kw: params)
    monkeypatch.setattr(jobs, "engines_per_mesh", lambda model, limit: lambda params: None)
    tasks = [f"t{i}" for i in range(40)]
    job_fn = jobs.episode_job_fn(None, tasks, None, dataclasses.make_dataclass("E", ["context_limit"])(16),
                                 cfg(), global_seed=5, tasks_per_member=4, policy_factory=lambda *a: None)
    held = Job(0, 1, 3, 11, *batch_seeds(5, 3), task_version=3)  # dispatched at 1, lands in (and plays) 3
    with pytest.raises(Played) as played:
        job_fn(held, {})
    assert played.value.args[0] == jobs.task_batch(tasks, 5, 3, 4) != jobs.task_batch(tasks, 5, 1, 4)


def test_a_population_batch_never_mixes_task_versions():
    batches = []
    batcher = JobBatcher(lambda js, p: batches.append(js) or [JobResult(0.0)] * len(js), max_batch=2, linger_s=0.3)
    params = object()
    pair = [Job(0, 1, 0, 10, *batch_seeds(5, 1)), Job(1, 1, 3, 13, *batch_seeds(5, 3), task_version=3)]
    threads = [threading.Thread(target=batcher, args=(j, params)) for j in pair]
    [t.start() for t in threads], [t.join() for t in threads]
    assert sorted(len(b) for b in batches) == [1, 1] and all(len({j.task_version for j in b}) == 1 for b in batches)
    with pytest.raises(ValueError, match="not of one task version"):
        play_cohort(None, None, pair, [], None, None, es.ESConfig(population=4, noise="lowrank"))


# ---------------------------------------------------------------------------------------------- metrics


def test_every_record_counts_its_task_batches_and_the_spread_within_them():
    m = dataclasses.make_dataclass("M", ["staleness_hist", "dropped", "cancelled", "reissued", "wasted_seconds",
                                         "utilization", "wall_seconds"])({0: 6}, 0, 0, 0, 0.0, 1.0, 1.0)
    r = metrics.update_record(1, FITNESS, np.zeros(6), m, [{}] * 6, 1.0, task_versions=GROUPS)
    # batch 7: std sqrt(0.08 / 3); batch 8: 0.35; batch 9 (one result) has no spread to count
    assert r["task_batches"] == 3
    assert r["fitness_std_within_batch"] == pytest.approx((math.sqrt(0.08 / 3) + 0.35) / 2)
    one = metrics.update_record(1, FITNESS, np.zeros(6), m, [{}] * 6, 1.0)
    assert one["task_batches"] == 1 and one["fitness_std_within_batch"] == pytest.approx(FITNESS.std())


@pytest.mark.parametrize("tasks, batches", [("landing", [1, 1, 1]), ("dispatch", [1, 2, 2])])
def test_a_controlled_training_run_records_its_cohorts_task_batches(tmp_path, tasks, batches):
    run = tmp_path / "run"
    assert train.main([f"run_dir={run}", "model.name=tiny", "tasks.dataset=fake", "es.population=4",
                       "es.updates=3", "es.sigma=0.02", "eval.every=0", "pool.mode=controlled", "pool.held_back=1",
                       "pool.delay=1", f"pool.held_back_tasks={tasks}", "es.shaping_groups=batch"]) == 0
    records = metrics.read(run)
    assert [r["task_batches"] for r in records] == batches
    assert all(r["fitness_std_within_batch"] is not None for r in records)
