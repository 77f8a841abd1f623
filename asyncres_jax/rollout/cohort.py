"""A cohort's episodes as one batch: several members of one version play their task batch together, members x
tasks rows, through one generation over one copy of the weights (low-rank ES: es/population.py).

- `play_cohort(engine, params, jobs, tasks, ...)`: the jobs' members x tasks episodes in one `run_episodes`
  call with a `PopulationPolicy`; `run_cohort` summarises them as one JobResult per job (fitness = that
  member's mean reward, as rollout.jobs.episode_job_fn computes it for one member). With `streams` > 1 the
  members are played as that many smaller batches at once, one thread each, and still reported together.
- `JobBatcher(batch_fn)`: the glue to the pool. The pool gives each worker thread one job at a time and stays
  as it is; a JobBatcher is a plain `job_fn(job, params)` that gathers the jobs its worker threads hold for
  the same weights (same dispatch version on the same replica) and runs them as ONE `batch_fn(jobs, params)`
  call. With W worker threads per replica a batch holds up to W members (the pool needs N > W, so a cohort
  of N takes ceil(N / W) batches); each job is still its own attempt for the coordinator (staleness, drops,
  deadlines, re-issues and utilisation are accounted per member, unchanged).

The trainer wires them (es.batched_population: JobBatcher over run_cohort on the version's task batch, with
max_batch = pool.workers_per_replica, or es.members_per_batch, and streams = es.streams_per_batch).

Common random numbers: every member of a cohort must see the same tasks and the same sampling randomness as
when its job runs alone. The tasks are the version's; the engine keys a row's sampling by (seed, row id), so
PopulationPolicy gives row (member i, task j) the row id j, as in member i's own batch.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextvars
import dataclasses
import functools
import itertools
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from asyncres_jax.errors import UserError
from asyncres_jax.es.config import ESConfig
from asyncres_jax.es.population import LowRankPopulation
from asyncres_jax.rollout import cancel
from asyncres_jax.rollout.coordinator import Job, JobResult
from asyncres_jax.rollout.episodes import (COUNTS, PHASES, EpisodeConfig, EpisodeResult, ModelPolicy, add_phases,
                                           fitness_of, format_transcript, played, run_episodes)

Params = Any


class PopulationPolicy(ModelPolicy):
    """A ModelPolicy over member-major rows (row = member * tasks_per_member + task) of a low-rank population.

    `population` holds one row per episode; as episodes end, the engine gets the population of the rows left.
    """

    def __init__(self, engine, params, *, population: LowRankPopulation, tasks_per_member: int, **kw):
        if population.num_rows % tasks_per_member:
            raise ValueError(f"{population.num_rows} population rows are not whole members of {tasks_per_member}")
        super().__init__(engine, params, perturbation_fn=population.take_rows, **kw)
        self.population, self.tasks_per_member = population, tasks_per_member

    def begin(self, conversations, seed):
        if len(conversations) != self.population.num_rows:
            raise ValueError(f"{len(conversations)} episodes for a population of {self.population.num_rows} rows")
        batch = super().begin(conversations, seed)
        for row in batch.conv.rows:  # sampling key of (member i, task j) = that of row j in member i's own batch
            row.row_id %= self.tasks_per_member
        return batch


def _member_result(job: Job, results: Sequence[EpisodeResult], fitness: str, seconds: float,
                   batch_members: int, work: dict[str, float]) -> JobResult:
    """The JobResult rollout.jobs.episode_job_fn reports for one member, from this member's share of the batch.

    Its phases are the whole batch's (the member's worker waited for all of it: they are worker-seconds); its
    token counts are its share of the batch's."""
    return JobResult(fitness_of(results, fitness), {
        "episodes": len(results),
        "start_errors": len(results) - len(played(results)),  # not played, left out of the fitness
        "tokens": sum(int(np.sum(r.tokens.generated_mask)) for r in results if r.tokens is not None),
        "successes": int(sum(r.reward for r in results)),
        "partial_sum": float(sum(r.partial for r in results)),
        "turns": int(sum(r.turns for r in results)),
        "timeouts": int(sum(r.timed_out for r in results)),
        "seconds": seconds,  # the whole batch's wall time: its members share it
        "batch_members": batch_members,
        "phases": {k: work.get(k, 0.0) for k in PHASES},
        **{k: work.get(k, 0) / batch_members for k in COUNTS},
        # a sample of what the agent did, for RUN_DIR/transcripts (members 0 and 1 only, like episode_job_fn)
        **({"transcript": format_transcript(results[0])} if job.member_index < 2 and results else {}),
    })


def play_cohort(engine, params, jobs: Sequence[Job], tasks: Sequence[Any], backend, episode_cfg: EpisodeConfig,
                es_cfg: ESConfig, *, contraction: str = "select", streams: int = 1,
                work: dict[str, float] | None = None) -> list[list[EpisodeResult]]:
    """Play `tasks` once per job's member, all members x tasks episodes in one batch; episodes per job.

    The jobs must be of one task version (same task batch and sampling seed). ModelPolicy options (first_reply_prefix,
    command_per_line) come with episode_cfg. `work`: as run_episodes', plus the population's set-up as host time.

    streams > 1 splits the members into that many groups (in order, as equal as can be), each played as its own
    batch in its own thread, all at once: one XLA program keeps a 2-core CPU only partly busy, two use it better. A
    row's numbers do not depend on its batch mates, so every episode is the one the whole batch plays. `work`
    then gets the groups' mean phases; the time a group waits for a slower one is in no phase (it is waiting).
    A group that fails stops the others at their next turn boundary, and its error is the one raised.
    """
    if es_cfg.noise != "lowrank":
        raise UserError(f"cohort batching needs low-rank noise (es.noise=lowrank), got es.noise={es_cfg.noise!r}")
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise UserError(f"streams={streams!r} must be a positive integer (1: the whole batch in one generation)")
    if not jobs:
        return []
    if len({(j.task_version, j.task_batch_id, j.sampling_seed) for j in jobs}) != 1:
        raise ValueError("play_cohort: the jobs are not of one task version (task batch and sampling seed differ)")
    play = functools.partial(_play_members, engine, params, tasks=tasks, backend=backend, episode_cfg=episode_cfg,
                             es_cfg=es_cfg, contraction=contraction)
    groups = [list(g) for g in np.array_split(np.arange(len(jobs)), min(streams, len(jobs)))]
    if len(groups) == 1:
        return play(list(jobs), work=work)
    works = [dict.fromkeys(PHASES, 0.0) for _ in groups]
    failed = threading.Event()  # a group that fails stops the others at their next turn boundary

    def play_group(group_jobs, work):
        with cancel.scope(failed):
            try:
                return play(group_jobs, work=work)
            except BaseException as e:
                if not isinstance(e, cancel.Cancelled):
                    failed.set()
                raise

    with cf.ThreadPoolExecutor(len(groups), thread_name_prefix="cohort-stream") as pool:
        # each thread runs in a copy of this context, so a cancelled job (rollout.cancel) stops every group
        futures = [pool.submit(contextvars.copy_context().run, play_group, [jobs[i] for i in g], w)
                   for g, w in zip(groups, works)]
        errors = [e for e in (f.exception() for f in futures) if e is not None]
    if errors:  # the failure itself before the cancellations it caused
        raise next((e for e in errors if not isinstance(e, cancel.Cancelled)), errors[0])
    members = [m for f in futures for m in f.result()]
    if work is not None:
        add_phases(work, {k: sum(w[k] for w in works) / len(works) for k in PHASES})
        add_phases(work, {k: sum(w.get(k, 0) for w in works) for k in COUNTS})
    return members


def _play_members(engine, params, jobs: list[Job], *, tasks, backend, episode_cfg, es_cfg, contraction,
                  work: dict[str, float] | None) -> list[list[EpisodeResult]]:
    """The jobs' members x tasks episodes as one batch (play_cohort without streams)."""
    t, own = time.monotonic(), dict.fromkeys(PHASES, 0.0)
    n_tasks = len(tasks)
    population = LowRankPopulation.create(params, es_cfg, [j.member_seed for j in jobs],
                                          [es_cfg.member_sign(j.member_index) for j in jobs], rows_per_member=n_tasks,
                                          contraction=contraction)
    policy = PopulationPolicy.from_config(engine, params, episode_cfg, population=population,
                                          tasks_per_member=n_tasks)
    results = run_episodes(policy, list(tasks) * len(jobs), backend, episode_cfg, seed=jobs[0].sampling_seed,
                           work=own)
    own["host"] += max(0.0, time.monotonic() - t - sum(own[k] for k in PHASES))  # the population's, the policy's set-up
    if work is not None:
        add_phases(work, own)
    return [results[i * n_tasks:(i + 1) * n_tasks] for i in range(len(jobs))]


def run_cohort(engine, params, jobs: Sequence[Job], tasks: Sequence[Any], backend, episode_cfg: EpisodeConfig,
               es_cfg: ESConfig, *, fitness: str = "binary", **kw) -> list[JobResult]:
    """play_cohort, summarised: one JobResult per job (fitness = its member's mean reward, or mean partial)."""
    if fitness not in ("binary", "partial"):
        raise UserError(f"fitness={fitness!r} is not one of binary, partial")
    t, work = time.monotonic(), dict.fromkeys(PHASES, 0.0)
    episodes = play_cohort(engine, params, jobs, tasks, backend, episode_cfg, es_cfg, work=work, **kw)
    seconds = time.monotonic() - t
    return [_member_result(job, member, fitness, seconds, len(jobs), work) for job, member in zip(jobs, episodes)]


class _Group:
    def __init__(self, params: Params, serial: int):
        self.params, self.serial, self.jobs, self.closed, self.done = params, serial, [], False, threading.Event()
        self.results: list[JobResult] | None = None
        self.error: BaseException | None = None


class JobBatcher:
    """A job_fn that runs the jobs held at the same time by worker threads, for the same weights, as one batch.

    The first job of a group leads: it waits until `max_batch` jobs joined or none joined for `linger_s`
    seconds, then calls batch_fn(jobs, params) -> list[JobResult] (one per job, in order) while the others
    wait for their result. If batch_fn raises, every job of the group raises it (and is re-issued by the pool).
    Groups are keyed by (dispatch version, task version, the params object): a replica's workers share one
    params object per version, so jobs never mix weights or devices, and a batch's jobs share their tasks.

    Each result's stats name its batch (`batch_id`, unique per batcher and batch; `batch_members`), so the pool
    can wait for a whole batch to be reported before its workers take new jobs (rollout/pool.py).
    """

    def __init__(self, batch_fn: Callable[[list[Job], Params], list[JobResult]], max_batch: int,
                 linger_s: float = 0.05):
        if max_batch < 1:
            raise UserError(f"max_batch={max_batch} must be at least 1")
        self.batch_fn, self.max_batch, self.linger_s = batch_fn, max_batch, linger_s
        self._cond = threading.Condition()
        self._open: dict[tuple[int, int, int], _Group] = {}
        self.batch_sizes: list[int] = []  # of every batch run, in order (for tests and stats)
        self._serials = itertools.count()

    def __call__(self, job: Job, params: Params) -> JobResult:
        key = (job.dispatch_version, job.task_version, id(params))  # one batch plays one task batch
        with self._cond:
            group = self._open.get(key)
            lead = group is None
            if lead:
                group = self._open[key] = _Group(params, next(self._serials))
            group.jobs.append(job)
            index = len(group.jobs) - 1
            if len(group.jobs) >= self.max_batch:
                self._close(key, group)
            self._cond.notify_all()
            if lead:  # wait for company: until the group is full or nobody joined for linger_s
                seen, quiet_since = len(group.jobs), time.monotonic()
                while not group.closed:
                    left = quiet_since + self.linger_s - time.monotonic()
                    if left <= 0:
                        self._close(key, group)
                        break
                    self._cond.wait(left)
                    if len(group.jobs) != seen:
                        seen, quiet_since = len(group.jobs), time.monotonic()
        if lead:
            try:
                results = list(self.batch_fn(list(group.jobs), group.params))
                if len(results) != len(group.jobs):
                    raise RuntimeError(f"batch_fn returned {len(results)} results for {len(group.jobs)} jobs")
                group.results = results
            except BaseException as e:  # every job of the batch fails with it; the pool re-issues them
                group.error = e
            finally:
                self.batch_sizes.append(len(group.jobs))
                group.done.set()
        else:
            group.done.wait()
        if group.error is not None:
            raise group.error
        result = group.results[index]
        batch = {"batch_id": f"{id(self):x}.{group.serial}", "batch_members": len(group.jobs)}
        return dataclasses.replace(result, stats={**result.stats, **batch})

    def _close(self, key, group: _Group) -> None:
        group.closed = True
        if self._open.get(key) is group:
            del self._open[key]
