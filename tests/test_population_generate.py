"""Population batching through the generation engine and the episode runner: a mixed batch of low-rank members
generates, row by row, what each member's materialised model generates on its own (greedy), also after rows
leave the batch; a cohort's members x tasks episodes in one batch are each member's own episodes, also when the
batch is played as several smaller generations at once."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from asyncres_jax import es
from asyncres_jax.errors import UserError
from asyncres_jax.es.population import LowRankPopulation
from asyncres_jax.model.generate import Engine
from asyncres_jax.model.tiny import tiny_model
from asyncres_jax.rollout import cancel
from asyncres_jax.rollout.cohort import play_cohort, run_cohort
from asyncres_jax.rollout.coordinator import Job
from asyncres_jax.rollout.episodes import COUNTS, PHASES, EpisodeConfig, ModelPolicy, run_episodes
from test_episodes import FakeBackend, tasks

# One config for every test here (one compiled noise program); members differ visibly at this sigma.
ES = es.ESConfig(population=4, sigma=0.05, noise="lowrank", rank=2, antithetic=True)
SEEDS = [es.member_seed(5, 0, k) for k in range(2)]
# (seed, sign) of members 0..2: an antithetic pair on seed 0, then seed 1
MEMBERS = [(SEEDS[0], 1), (SEEDS[0], -1), (SEEDS[1], 1)]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, context_limit=2048)


@pytest.fixture(scope="module")
def materialised(model):
    return [es.perturb(model.params, s, ES, sign=g) for s, g in MEMBERS]


def test_mixed_batch_greedy_generation_is_each_members_own_even_as_rows_leave(model, engine, materialised):
    prompts = [engine.encode(t) for t in ("list the files", "hi", "count the lines and sort them")]
    # (member, prompt) per row, mixed; 5 rows fill a bucket of 8, so the padding rows are mapped too
    rows = [(2, 0), (0, 1), (1, 0), (0, 2), (2, 1)]
    pop = LowRankPopulation.create(model.params, ES, [s for s, _ in MEMBERS], [g for _, g in MEMBERS])
    pop = pop.take_rows([m for m, _ in rows])
    observation = engine.encode("ok then")
    conv = engine.start_tokens(model.params, [prompts[p] for _, p in rows], seed=0, perturbation=pop)
    conv, _ = engine.generate(model.params, conv, 8, perturbation=pop)
    leave = {1, 3}  # two rows leave; the rest get an observation and a second reply
    conv = engine.extend_tokens(conv, [None if b in leave else observation for b in range(len(rows))])
    kept = [b for b in range(len(rows)) if b not in leave]
    conv, _ = engine.generate(model.params, conv, 8, perturbation=pop.take_rows(kept))
    batched = dict(zip(kept, conv.tokens))

    outputs = {}
    for m in range(len(MEMBERS)):  # each member alone, on its materialised weights, same turns
        mine = [b for b, (mm, _) in enumerate(rows) if mm == m]
        own = engine.start_tokens(materialised[m], [prompts[rows[b][1]] for b in mine], seed=0)
        own, _ = engine.generate(materialised[m], own, 8)
        first = dict(zip(mine, own.tokens))
        still = [b for b in mine if b not in leave]
        if still:
            own = engine.extend_tokens(own, [None if b in leave else observation for b in mine])
            own, _ = engine.generate(materialised[m], own, 8)
            first.update(zip(still, own.tokens))
        outputs.update(first)
    for b in kept:
        np.testing.assert_array_equal(batched[b], outputs[b], err_msg=f"row {b} (member, prompt) = {rows[b]}")
    replies = {m: [outputs[b][len(prompts[p]):].tolist() for b, (mm, p) in enumerate(rows) if mm == m and p == 0]
               for m in (1, 2)}
    assert replies[1] != replies[2]  # members really generate different tokens


def same_episode(a, b) -> bool:
    return a.transcript == b.transcript and np.array_equal(a.tokens.ids, b.tokens.ids) and a.turns == b.turns


PREFIX = dict(first_reply_prefix="<command>")  # so the random model's first reply runs as a command (EpisodeConfig)


def test_a_cohort_batch_plays_each_members_own_episodes(model, engine, materialised):
    cfg = EpisodeConfig(max_turns=2, max_new_tokens=6, temperature=0.0, **PREFIX)
    jobs = [Job(i, 3, i, s, 0, 17) for i, (s, _) in enumerate(MEMBERS)]  # member index 1 is the minus side
    batch = tasks(2)
    cohort = play_cohort(engine, model.params, jobs, batch, FakeBackend(), cfg, ES)
    assert [len(m) for m in cohort] == [2, 2, 2]
    for i in range(len(MEMBERS)):
        policy = ModelPolicy.from_config(engine, materialised[i], cfg)
        alone = run_episodes(policy, batch, FakeBackend(), cfg, seed=17)
        for together, own in zip(cohort[i], alone):
            assert same_episode(together, own), (i, together.transcript, own.transcript)
    assert not same_episode(cohort[1][0], cohort[2][0])  # members really play differently

    results = run_cohort(engine, model.params, jobs, batch, FakeBackend(), cfg, ES)
    for member, r in zip(cohort, results):
        assert r.fitness == np.mean([e.reward for e in member]) and r.stats["batch_members"] == 3
        assert r.stats["tokens"] == sum(int(e.tokens.generated_mask.sum()) for e in member)
    assert ["transcript" in r.stats for r in results] == [True, True, False]  # a sample, like episode_job_fn


def test_cohort_members_share_the_sampling_randomness_of_each_task(model, engine):
    """Common random numbers: members with the same noise play identical sampled episodes, and each task is
    sampled as when the member plays alone, while different tasks get different randomness."""
    cfg = EpisodeConfig(max_turns=1, max_new_tokens=8, temperature=1.0, **PREFIX)
    twins = [Job(0, 0, 0, SEEDS[1], 0, 23), Job(2, 0, 2, SEEDS[1], 0, 23)]
    batch = tasks(2)  # same instruction: only the sampling randomness can tell the tasks apart
    together = play_cohort(engine, model.params, twins, batch, FakeBackend(), cfg, ES)
    alone = play_cohort(engine, model.params, twins[:1], batch, FakeBackend(), cfg, ES)
    for j in range(2):
        assert same_episode(together[0][j], together[1][j]) and same_episode(together[0][j], alone[0][j])
    assert not same_episode(together[0][0], together[0][1])


def test_a_cohort_played_as_streams_plays_the_same_episodes_and_counts_each_streams_work(model, engine):
    """es.streams_per_batch: members 0-1 and member 2 play as two generations at once, one thread each."""
    cfg = EpisodeConfig(max_turns=2, max_new_tokens=6, temperature=0.0, **PREFIX)
    jobs = [Job(i, 3, i, s, 0, 17) for i, (s, _) in enumerate(MEMBERS)]
    batch = tasks(2)
    whole = play_cohort(engine, model.params, jobs, batch, FakeBackend(), cfg, ES)
    apart = [dict.fromkeys(PHASES, 0.0) for _ in range(2)]
    play_cohort(engine, model.params, jobs[:2], batch, FakeBackend(), cfg, ES, work=apart[0])
    play_cohort(engine, model.params, jobs[2:], batch, FakeBackend(), cfg, ES, work=apart[1])

    work, t = dict.fromkeys(PHASES, 0.0), time.monotonic()
    streamed = play_cohort(engine, model.params, jobs, batch, FakeBackend(), cfg, ES, streams=2, work=work)
    wall = time.monotonic() - t
    assert [len(m) for m in streamed] == [2, 2, 2]
    for member_whole, member_streamed in zip(whole, streamed):
        for a, b in zip(member_whole, member_streamed):
            assert same_episode(a, b), (a.transcript, b.transcript)
    for k in COUNTS:  # the engine's token counts add up over the streams
        assert work[k] == apart[0][k] + apart[1][k] > 0, k
    # the phases are the streams' mean: a batch's worker-seconds cover its wall clock once, not once per stream
    assert 0 < sum(work[k] for k in PHASES) <= wall
    # more streams than members: one member each
    one_each = play_cohort(engine, model.params, jobs, batch, FakeBackend(), cfg, ES, streams=8)
    assert [[e.transcript for e in m] for m in one_each] == [[e.transcript for e in m] for m in whole]


def test_streams_must_be_a_positive_integer():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(UserError, match=r"^streams=.* must be a positive integer"):
            play_cohort(None, None, [Job(0, 0, 0, 1, 0, 0)], tasks(1), None, EpisodeConfig(), ES, streams=bad)


def test_a_cancelled_job_stops_every_stream_and_closes_their_sandboxes(model, engine):
    """The cancellation event lives in a context variable; each stream's thread runs in a copy of the context."""
    cfg = EpisodeConfig(max_turns=5, max_new_tokens=4, temperature=0.0, **PREFIX)
    jobs = [Job(i, 3, i, s, 0, 17) for i, (s, _) in enumerate(MEMBERS)]
    backend, stale = FakeBackend(), threading.Event()
    stale.set()  # the commit that makes the batch's version too stale came before the first turn boundary
    with cancel.scope(stale), pytest.raises(cancel.Cancelled):
        play_cohort(engine, model.params, jobs, tasks(2), backend, cfg, ES, streams=2)
    assert len(backend.sandboxes) == 6 and backend.all_closed() and backend.graded == []


class OneCommandBreaks(FakeBackend):
    """The first command of the whole batch raises: the stream that runs it fails in its first turn."""

    broke = False

    def start(self, task):
        sandbox, backend = super().start(task), self
        run = sandbox.run

        def run_or_break(command, timeout=None):
            with backend.lock:
                first, backend.broke = not backend.broke, True
            if first:
                raise OSError("the sandbox broke")
            return run(command, timeout)  # logs it

        sandbox.run = run_or_break
        return sandbox


def test_a_stream_that_fails_stops_the_others_and_its_error_is_raised(model, engine):
    # every reply's first line runs as a command (command_per_line), so each turn runs one per episode
    cfg = EpisodeConfig(max_turns=5, max_new_tokens=4, temperature=0.0, command_per_line=True, **PREFIX)
    jobs = [Job(i, 3, i, SEEDS[i // 2], 0, 17) for i in range(4)]  # two streams of 2 members x 2 tasks
    played = FakeBackend()
    play_cohort(engine, model.params, jobs, tasks(2), played, cfg, ES, streams=2)
    assert len(played.log) == 5 * 8  # left alone, every episode runs its 5 turns

    backend = OneCommandBreaks()
    with pytest.raises(OSError, match="the sandbox broke"):  # not the Cancelled it causes in the other stream
        play_cohort(engine, model.params, jobs, tasks(2), backend, cfg, ES, streams=2)
    # The other stream stops at a turn boundary soon after, instead of playing its 4 episodes x 5 turns.
    assert len(backend.log) < 4 * 5
    assert len(backend.sandboxes) == 8 and backend.all_closed()
