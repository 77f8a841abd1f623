"""The coordinator state machine, driven by hand: configuration errors, job identity, admission control,
faults, drain and checkpoints."""

import pytest

from asyncres_jax.errors import UserError
from asyncres_jax.rollout import Coordinator, JobResult, PoolConfig, batch_seeds


def seed_of(g, v, i):
    return g * 10_000 + v * 100 + i


def coordinator(**kw):
    kw = {"population": 4, "num_workers": 2, **kw}
    return Coordinator(PoolConfig(**kw), member_seed=seed_of)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(population=4, num_workers=4), "larger than the number of workers"),
        (dict(population=4, num_workers=6), "larger than the number of workers"),
        (dict(population=8, num_workers=2, max_staleness=-1), "negative"),
        (dict(population=8, num_workers=2, mode="sync", max_staleness=2), "mode=sync means max_staleness=0"),
        (dict(population=8, num_workers=2, mode="controlled", held_back=8, delay=4), "does not fit a cohort"),
        (dict(population=8, num_workers=2, mode="controlled", held_back=0, delay=4), "does not fit a cohort"),
        (dict(population=8, num_workers=2, mode="controlled", held_back=2, delay=0), "delay >= 1"),
        (dict(population=8, num_workers=2, mode="async", held_back=2), "only apply to mode=controlled"),
        (dict(population=8, num_workers=2, mode="lockstep"), "not one of"),
        (dict(population=8, num_workers=2, deadline_seconds=0), "must be positive"),
        (dict(population=8, num_workers=2, mode="sync", paced=True), "paced admission applies to mode=async"),
    ],
)
def test_bad_configuration_is_a_user_error_at_start_up(kw, words):
    with pytest.raises(UserError, match=words) as e:
        PoolConfig(**kw)
    assert "\n" not in str(e.value)


def test_jobs_carry_version_member_seed_and_common_random_numbers():
    c = coordinator(global_seed=3)
    jobs = [c.dispatch(0.0).job for _ in range(3)]
    assert [j.job_id for j in jobs] == [0, 1, 2]
    assert [(j.dispatch_version, j.member_index, j.member_seed) for j in jobs] == [
        (0, i, seed_of(3, 0, i)) for i in range(3)]
    assert {(j.task_batch_id, j.sampling_seed) for j in jobs} == {batch_seeds(3, 0)}
    assert batch_seeds(3, 0) != batch_seeds(3, 1) and batch_seeds(3, 0) != batch_seeds(4, 0)


def test_admission_allows_K_plus_v_plus_1_cohorts_plus_dropped():
    c = coordinator(mode="async", max_staleness=1, cancel_stale=False)  # the stale job runs to the end
    attempts = [c.dispatch(0.0) for _ in range(8)]  # (K + 0 + 1) * N = 8
    assert all(attempts) and c.dispatch(0.0) is None
    for a in attempts[1:5]:  # four results complete cohort 0 -> version 1, four more slots
        cohort = c.on_result(a.attempt_id, JobResult(1.0), 1.0)
    assert cohort is not None and c.version == 1
    more = [c.dispatch(1.0) for _ in range(4)]
    assert all(more) and c.dispatch(1.0) is None
    for a in attempts[5:8] + more[:1]:  # cohort 1: three 1-stale results and one fresh
        cohort = c.on_result(a.attempt_id, JobResult(0.5), 2.0)
    assert c.version == 2 and cohort.metrics.staleness_hist == {0: 1, 1: 3}
    # attempts[0] comes back 2 updates late: dropped, counted, and its slot refunded.
    assert c.on_result(attempts[0].attempt_id, JobResult(0.0), 3.0) is None
    assert c.dropped == 1 and c.outcomes[attempts[0].attempt_id] == "dropped"
    assert c.dispatched == 12 and c.dispatch(3.0) is not None  # cap (1 + 2 + 1) * 4 + 1 = 17 > 12


def test_a_commit_cancels_the_running_jobs_it_made_too_stale_and_refunds_their_slots():
    c = coordinator(mode="async", max_staleness=1)
    attempts = [c.dispatch(0.0) for _ in range(8)]
    for a in attempts[1:5]:
        c.on_result(a.attempt_id, JobResult(1.0), 1.0)
    assert c.take_cancelled() == []  # version 1: every version-0 job can still be accepted
    more = [c.dispatch(1.0) for _ in range(4)]
    for a in attempts[5:8]:
        c.on_result(a.attempt_id, JobResult(0.5), 2.0)
    busy = c.busy_workers
    cohort = c.on_result(more[0].attempt_id, JobResult(0.5), 2.0)  # commits cohort 1 -> version 2
    assert cohort is not None and cohort.metrics.cancelled == 0
    # attempts[0] (version 0) can no longer be accepted: cancelled at the commit, not dropped later.
    assert c.take_cancelled() == [attempts[0]] and c.take_cancelled() == []
    assert c.outcomes[attempts[0].attempt_id] == "cancelled" and (c.cancelled, c.dropped) == (1, 0)
    assert c.in_flight == 3 and c.stopping == 1 and c.busy_workers == busy - 1  # still busy until it stops
    extra = c.dispatch(2.0)
    assert c.dispatched == 13 and extra is not None  # cap (1 + 2 + 1) * 4 + 1 cancelled = 17
    # The worker stops (or finishes anyway): its time is cancelled work, the result is never counted.
    assert c.on_result(attempts[0].attempt_id, JobResult(9.0), 2.5) is None
    assert c.stopping == 0 and c.outcomes[attempts[0].attempt_id] == "cancelled"
    for a in more[1:] + [extra]:
        cohort = c.on_result(a.attempt_id, JobResult(0.0), 3.0)
    assert cohort.version == 2 and cohort.metrics.cancelled == 1 and cohort.metrics.cancelled_seconds == 2.5
    assert cohort.metrics.dropped == 0 and 0 not in {r.job.job_id for r in cohort.results}
    with pytest.raises(ValueError, match="not running"):
        c.on_result(attempts[0].attempt_id, JobResult(0.0), 3.0)


def test_paced_admission_commits_cohorts_in_dispatch_order_and_accepts_every_job():
    c = coordinator(mode="async", max_staleness=1, paced=True)
    attempts = [c.dispatch(0.0) for _ in range(8)]  # (K + 0 + 1) * N = 8, never more: nothing is refunded
    assert c.dispatch(0.0) is None
    # Jobs 1..7 finish, job 0 (a straggler) does not: cohort 0 (jobs 0..3) waits for it; cohort 1 is complete.
    assert all(c.on_result(a.attempt_id, JobResult(1.0), 1.0) is None for a in attempts[1:])
    assert c.version == 0 and c.dispatch(1.0) is None
    cohort = c.on_result(attempts[0].attempt_id, JobResult(0.0), 5.0)
    assert [r.job.job_id for r in cohort.results] == [0, 1, 2, 3]
    nxt = c.commit_ready(5.0)  # cohort 1 was already complete: jobs 4..7, all dispatched at version 0
    assert [r.job.job_id for r in nxt.results] == [4, 5, 6, 7] and nxt.metrics.staleness_hist == {1: 4}
    assert c.version == 2 and c.commit_ready(5.0) is None
    assert (c.dropped, c.cancelled, c.take_cancelled()) == (0, 0, [])
    assert [c.dispatch(5.0).job.job_id for _ in range(8)] == list(range(8, 16)) and c.dispatch(5.0) is None


def test_sync_dispatches_nothing_of_the_next_version_before_the_barrier():
    c = coordinator(mode="sync")
    attempts = [c.dispatch(0.0) for _ in range(4)]
    assert c.dispatch(0.0) is None
    for t, a in enumerate(attempts[:3]):
        assert c.on_result(a.attempt_id, JobResult(t), 1.0 + t) is None
        assert c.dispatch(1.0 + t) is None  # idle worker waits for the straggler
    cohort = c.on_result(attempts[3].attempt_id, JobResult(3.0), 10.0)
    assert cohort.version == 0 and list(cohort.fitness) == [0, 1, 2, 3]
    assert c.dispatch(10.0).job.dispatch_version == 1


def test_controlled_held_back_jobs_still_run_when_the_cohort_commits_first():
    # One worker, N=4 held_back=1 delay=1: version 0 commits after its 4 fresh results, before its held-back
    # job started; that job keeps version 0 and joins cohort 1 exactly one update late.
    c = Coordinator(PoolConfig(population=4, num_workers=1, mode="controlled", held_back=1, delay=1),
                    member_seed=seed_of)
    t, cohorts = 0.0, []
    while len(cohorts) < 3:
        a = c.dispatch(t)
        t += 1.0
        cohort = c.on_result(a.attempt_id, JobResult(float(a.job.member_index)), t)
        cohorts += [cohort] if cohort else []
    assert [ch.metrics.staleness_hist for ch in cohorts] == [{0: 4}, {0: 3, 1: 1}, {0: 3, 1: 1}]
    assert [(r.job.dispatch_version, r.job.member_index) for r in cohorts[1].results][0] == (0, 4)


def test_a_failed_job_is_reissued_with_the_same_seed_and_counted_once():
    c = coordinator(mode="sync", max_attempts=2)
    a = c.dispatch(0.0)
    c.on_failure(a.attempt_id, RuntimeError("sandbox died"), 1.0)
    b = c.dispatch(1.0)
    assert b.job == a.job and b.number == 1 and c.dispatched == 1
    c.on_result(b.attempt_id, JobResult(1.0), 2.0)
    assert c.outcomes == {a.attempt_id: "failed", b.attempt_id: "accepted"}
    # Failing max_attempts times is fatal: the error surfaces instead of looping forever.
    d = c.dispatch(2.0)
    c.on_failure(d.attempt_id, RuntimeError("boom"), 3.0)
    e = c.dispatch(3.0)
    c.on_failure(e.attempt_id, RuntimeError("boom again"), 4.0)
    assert isinstance(c.fatal, RuntimeError) and "failed 2 times" in str(c.fatal)
    assert c.dispatch(4.0) is None


def test_a_job_past_its_deadline_is_reissued_and_its_late_result_ignored():
    c = coordinator(mode="sync", deadline_seconds=5.0)
    a = c.dispatch(0.0)
    assert c.next_deadline() == 5.0
    assert c.expire(4.9) == [] and c.expire(5.0) == [a]
    assert c.busy_workers == 1  # the hung worker is still occupied
    b = c.dispatch(5.0)
    assert b.job == a.job and b.number == 1
    assert c.on_result(a.attempt_id, JobResult(9.0), 7.0) is None  # late copy: not counted
    assert c.late == {a.attempt_id} and c.busy_workers == 1
    c.on_result(b.attempt_id, JobResult(1.0), 8.0)
    assert c.outcomes[b.attempt_id] == "accepted" and len(c._cohort) == 1
    with pytest.raises(ValueError, match="not running"):
        c.on_result(b.attempt_id, JobResult(1.0), 9.0)


def test_drain_stops_new_jobs_but_finishes_owed_ones():
    c = coordinator(mode="async", max_staleness=1)
    a, _ = c.dispatch(0.0), c.dispatch(0.0)
    c.drain()
    assert c.dispatch(0.0) is None and not c.quiescent
    c.on_failure(a.attempt_id, RuntimeError("x"), 1.0)
    assert c.dispatch(1.0).job == a.job  # a re-issue is owed work, even while draining
    c.resume()
    assert c.dispatch(1.0).job.member_index == 2


def test_metrics_report_utilisation_waits_drops_and_wasted_work():
    c = coordinator(population=3, num_workers=2, mode="async", max_staleness=0)
    a, b = c.dispatch(0.0), c.dispatch(0.0)
    c.on_result(a.attempt_id, JobResult(1.0), 2.0)
    d = c.dispatch(2.0)
    c.on_result(b.attempt_id, JobResult(1.0), 3.0)
    cohort = c.on_result(d.attempt_id, JobResult(1.0), 4.0)
    m = cohort.metrics
    # Busy: worker 1 for [0, 4], worker 2 for [0, 3] -> 7 of 2 * 4 worker-seconds.
    assert (m.wall_seconds, m.busy_seconds, m.utilization) == (4.0, 7.0, 7.0 / 8.0)
    assert m.accepted_seconds == 2.0 + 3.0 + 2.0
    assert (m.result_wait_mean, m.result_wait_max) == ((2.0 + 1.0 + 0.0) / 3, 2.0)


def test_a_drained_pause_is_not_counted_as_idle_workers():
    c = coordinator(population=2, num_workers=1, mode="sync")

    def update(t):  # one worker runs the cohort's two jobs back to back, a second each
        for k in range(2):
            a = c.dispatch(t + k)
            cohort = c.on_result(a.attempt_id, JobResult(1.0), t + k + 1)
        return cohort.metrics

    update(0.0)  # update 1 commits at t = 2
    c.drain()
    c.resume(now=60.0)  # 58 s of checkpoint and held-out evaluation while nothing ran
    m = update(60.0)
    assert (m.wall_seconds, m.busy_seconds, m.utilization) == (2.0, 2.0, 1.0)
    c.drain()
    c.resume()  # without a time (a simulation that does not pause) nothing is left out
    m = update(70.0)
    assert (m.wall_seconds, m.busy_seconds, m.utilization) == (10.0, 2.0, 0.2)


def test_state_dict_round_trip_continues_the_same_schedule():
    def drive(c, until_version, t=0.0):
        while c.version < until_version:
            a = c.dispatch(t)
            t += 1.0
            c.on_result(a.attempt_id, JobResult(a.job.member_index), t)
        return t

    kw = dict(population=4, num_workers=1, mode="controlled", held_back=1, delay=2)
    c1 = Coordinator(PoolConfig(**kw), member_seed=seed_of)
    t = drive(c1, 3)
    c1.drain()
    while not c1.quiescent:  # the held-back job carried over from version 2 still runs
        a = c1.dispatch(t)
        t += 1.0
        c1.on_result(a.attempt_id, JobResult(a.job.member_index), t)
    state = c1.state_dict()
    assert state["held"]  # results waiting for their cohort are part of the checkpoint
    c2 = Coordinator(PoolConfig(**kw), member_seed=seed_of)
    c2.load_state_dict(state)
    c1.resume(), c2.resume()
    jobs1 = [c1.dispatch(100.0).job for _ in range(3)]
    jobs2 = [c2.dispatch(100.0).job for _ in range(3)]
    assert jobs1 == jobs2
    with pytest.raises(RuntimeError, match="drain"):
        c1.state_dict()


def test_a_reissue_that_could_only_be_dropped_is_not_rerun():
    c = coordinator(mode="async", max_staleness=1, cancel_stale=False)  # (with it, first[0] is cancelled)
    first = [c.dispatch(0.0) for _ in range(8)]
    for a in first[1:5]:
        c.on_result(a.attempt_id, JobResult(1.0), 1.0)
    extra = c.dispatch(1.0)
    for a in first[5:] + [extra]:
        c.on_result(a.attempt_id, JobResult(1.0), 2.0)
    assert c.version == 2
    c.on_failure(first[0].attempt_id, RuntimeError("crash"), 3.0)  # version 0: two updates old by now
    nxt = c.dispatch(3.0)
    assert nxt.job.job_id != first[0].job.job_id and nxt.job.dispatch_version == 2
    assert c.dropped_unrun == {first[0].job.job_id} and c.dropped == 1
