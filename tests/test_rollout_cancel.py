"""Cancellation of jobs whose results can no longer be accepted, and paced admission, in the real threaded pool
and in the episode runner: the job stops at a turn boundary, its sandboxes are closed, its worker takes a new
job, and it is counted as cancelled (never dropped, never lost, never counted twice)."""

import threading
import time

import numpy as np
import pytest
from test_episodes import FakeBackend, ScriptedPolicy, tasks

from asyncres_jax.rollout import Coordinator, EpisodeConfig, JobResult, ParamStore, PoolConfig, RolloutPool
from asyncres_jax.rollout import cancel
from asyncres_jax.rollout.episodes import run_episodes

pytestmark = pytest.mark.timeout(60)


class StepClock:
    """A fake clock that moves only when a job says so (one unit per turn), shared by the threads."""

    def __init__(self):
        self.now, self.lock = 0.0, threading.Lock()

    def __call__(self) -> float:
        with self.lock:
            return self.now

    def tick(self, units: float = 1.0) -> None:
        with self.lock:
            self.now += units


def make_pool(cfg, job_fn, clock):
    store = ParamStore({"w": np.zeros(2, np.float32)}, apply_update=lambda p, o, s, z: (p, o),
                       shape=lambda f: f - f.mean())
    coord = Coordinator(cfg, member_seed=lambda g, v, i: 1000 * v + i)
    return RolloutPool(coord, store, job_fn, clock=clock, poll_seconds=0.005), store, coord


def test_scopes_nest_and_either_event_cancels_the_inner_block():
    job, batch = threading.Event(), threading.Event()
    assert not cancel.requested()  # outside any job: never cancelled
    with cancel.scope(job):
        with cancel.scope(batch):
            cancel.check()
            job.set()
            assert cancel.requested()
            with pytest.raises(cancel.Cancelled, match="no longer be accepted"):
                cancel.check()
        job.clear()
        batch.set()  # the inner scope is gone: its event no longer counts
        assert not cancel.requested()
    assert not cancel.requested()


def test_the_episode_runner_stops_at_the_next_turn_boundary_and_closes_every_sandbox():
    backend, event, calls = FakeBackend(), threading.Event(), []

    class CancelAfterTwoTurns(ScriptedPolicy):
        def begin(self, conversations, seed):
            inner = super().begin(conversations, seed)
            step = inner.step

            def counted(rows, messages):
                calls.append(list(rows))
                if len(calls) == 2:
                    event.set()  # the commit happens while turn 2 runs: turn 2 completes, turn 3 never starts
                return step(rows, messages)

            inner.step = counted
            return inner

    with cancel.scope(event), pytest.raises(cancel.Cancelled, match="can no longer be accepted"):
        run_episodes(CancelAfterTwoTurns(["echo"] * 10), tasks(3), backend, EpisodeConfig(max_turns=10))
    assert len(calls) == 2 and len(backend.sandboxes) == 3 and backend.all_closed()
    assert backend.graded == []  # a cancelled episode is not graded: its result is never used
    # Outside a cancelled scope (or with no scope at all) the same episodes play to the end.
    assert len(run_episodes(ScriptedPolicy(["echo"] * 10), tasks(3), FakeBackend(), EpisodeConfig(max_turns=4))) == 3


def test_a_straggler_is_cancelled_when_a_commit_makes_it_too_stale_and_its_worker_moves_on():
    clock, turns, lock, seen = StepClock(), {}, threading.Lock(), []

    def job_fn(job, params):
        with lock:
            seen.append(job.job_id)
        if job.job_id == 0:  # the long tail: would run 10,000 turns, but is cancelled at a turn boundary
            for turn in range(10_000):
                cancel.check()
                turns[0] = turn + 1
                time.sleep(0.001)
                clock.tick(0.01)
            return JobResult(99.0)
        time.sleep(0.005)  # let the straggler's thread run its turns
        clock.tick(1.0)
        return JobResult(float(job.member_seed % 7))

    cfg = PoolConfig(population=3, num_workers=2, mode="async", max_staleness=1)
    pool, store, coord = make_pool(cfg, job_fn, clock)
    with pool:
        metrics = pool.run_until(8, timeout=30)
    assert not [t for t in threading.enumerate() if t.name.startswith("rollout-")]
    assert coord.cancelled == 1 and coord.outcomes[0] == "cancelled" and coord.dropped == 0
    assert turns[0] < 10_000 and seen.count(0) == 1  # stopped early, not re-issued
    assert sum(m.cancelled for m in metrics) == 1 and sum(m.cancelled_seconds for m in metrics) > 0
    committed = [s for v in range(store.version) for s in store.entries(v, v + 1)[0].seeds]
    assert 0 not in committed and len(committed) == len(set(committed)) == 3 * store.version
    # The worker that held the straggler took new jobs after it stopped: every job is accounted exactly once.
    accepted = sum(o == "accepted" for o in coord.outcomes.values())
    assert accepted == len([r for r in committed]) + len(coord._cohort) + sum(len(r) for r in coord._held.values())
    assert coord.dispatched == accepted + coord.cancelled + coord.in_flight
    assert all(max(m.staleness_hist) <= 1 for m in metrics)


def test_paced_admission_in_the_threaded_pool_accepts_every_job_in_dispatch_order():
    clock, seeds, lock = StepClock(), {}, threading.Lock()

    def job_fn(job, params):
        with lock:
            seeds[job.job_id] = job.member_seed
        time.sleep(0.001 * (1 + (job.job_id * 7) % 5))  # finish out of order
        clock.tick(1.0)
        return JobResult(float(job.job_id))

    cfg = PoolConfig(population=4, num_workers=3, mode="async", max_staleness=1, paced=True)
    pool, store, coord = make_pool(cfg, job_fn, clock)
    with pool:
        metrics = pool.run_until(6, timeout=30)
    assert coord.dropped == 0 and coord.cancelled == 0
    for v in range(6):  # cohort v is jobs 4v .. 4v + 3, whatever order they finished in
        assert sorted(store.entries(v, v + 1)[0].seeds) == sorted(seeds[j] for j in range(4 * v, 4 * v + 4))
    assert all(max(m.staleness_hist) <= 1 for m in metrics)


def test_a_cancelled_cohort_batch_stops_every_job_it_holds():
    from asyncres_jax.rollout.cohort import JobBatcher
    from asyncres_jax.rollout.coordinator import Job

    played = []

    def batch_fn(jobs, params):  # stands in for run_cohort: run_episodes checks between turns
        for turn in range(100):
            cancel.check()
            played.append(turn)
            if turn == 2:
                stale.set()  # a commit makes the version (all jobs of a batch share it) too stale
        return [JobResult(1.0) for _ in jobs]

    stale, errors, params = threading.Event(), [], {"w": 0}  # one replica's weights: the jobs batch together
    batcher = JobBatcher(batch_fn, max_batch=2, linger_s=5.0)

    def worker(i):
        with cancel.scope(stale):  # the pool sets every cancelled attempt's event at once
            try:
                batcher(Job(i, 0, i, 100 + i, 0, 0), params)
            except cancel.Cancelled as e:
                errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert played == [0, 1, 2] and len(errors) == 2 and batcher.batch_sizes == [2]
