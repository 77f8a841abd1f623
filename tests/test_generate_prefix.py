"""Two shortcuts of the generation engine that change its cost, never its output: a prompt prefix shared by rows
of the same weights is prefilled once per group of rows, and a token that holds a stop string ends the decode
loop without running the rest of its chunk."""

from __future__ import annotations

import pytest

from asyncres_jax import es
from asyncres_jax.es.population import LowRankPopulation
from asyncres_jax.model.generate import PREFILL_CHUNK, Engine, _common_prefix, block_length
from asyncres_jax.model.tiny import tiny_model

ES = es.ESConfig(population=4, sigma=0.05, noise="lowrank", rank=2)
SEEDS = [es.member_seed(3, 0, k) for k in range(2)]


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, context_limit=2048)


TAILS = ("list the files", "hi", "count the lines and sort them", "make a dir", "remove a.txt", "say done",
         "copy b to c", "sort the log")


def prompts(engine, tails=TAILS):
    """Rows with a ~300-token common prefix (two whole prefill chunks), then their own task."""
    system = engine.encode("you are a terse shell agent. answer with one command. " * 6)
    assert len(system) > 2 * PREFILL_CHUNK
    return [system + engine.encode(t) for t in tails]


def generated(conv, r):
    return conv.tokens[r][conv.generated_mask[r]].tolist()


def test_common_prefix_is_the_longest_prefix_every_row_shares():
    assert _common_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert _common_prefix([[7, 8], [7, 8, 9]]) == 2
    assert _common_prefix([[1], [2]]) == 0


def test_rows_sharing_a_prefix_generate_what_each_row_generates_alone(model, engine):
    rows = prompts(engine) * 2  # 16 rows of one group: the prefix goes in once, on one row
    conv = engine.start_tokens(model.params, rows, seed=0)
    conv, _ = engine.generate(model.params, conv, 12)
    for r, p in list(enumerate(rows))[:8]:
        alone, _ = engine.generate(model.params, engine.start_tokens(model.params, [p], seed=0), 12)
        assert generated(conv, r) == generated(alone, 0), f"row {r}"
    # the shared whole short chunks were computed on one row, the rest per row (16)
    shared = _common_prefix([p[:-1] for p in rows]) // 16 * 16
    assert shared >= 2 * PREFILL_CHUNK
    rest = block_length(max(len(p) - 1 for p in rows) - shared)
    assert shared < conv.stats["prefill_slots"] <= shared + 16 * rest  # not 16 * shared
    assert conv.stats["prefill_tokens"] == sum(len(p) - 1 for p in rows)


def test_a_population_shares_the_prefix_per_member_and_each_row_is_its_members_own(model, engine):
    rows = prompts(engine)
    signs = [1, -1]
    pop = LowRankPopulation.create(model.params, ES, SEEDS, signs, rows_per_member=len(rows))
    groups = pop.row_groups().tolist()
    assert len(set(groups[:8])) == len(set(groups[8:])) == 1 and groups[0] != groups[8]
    conv = engine.start_tokens(model.params, rows * 2, seed=0, perturbation=pop)
    conv, _ = engine.generate(model.params, conv, 10, perturbation=pop)
    shared = _common_prefix([p[:-1] for p in rows]) // 16 * 16
    rest = block_length(max(len(p) - 1 for p in rows) - shared)
    # the two members' prefix on a batch of 2 (one row each), then each row's rest (its long rows' chunks
    # possibly on fewer)
    assert 2 * shared < conv.stats["prefill_slots"] <= 2 * shared + 16 * rest
    for m, (seed, sign) in enumerate(zip(SEEDS, signs)):
        weights = es.perturb(model.params, seed, ES, sign=sign)
        for t, p in list(enumerate(rows))[::3]:
            alone, _ = engine.generate(weights, engine.start_tokens(weights, [p], seed=0), 10)
            assert generated(conv, m * len(rows) + t) == generated(alone, 0), f"member {m} task {t}"


def test_a_token_holding_a_stop_string_ends_the_decode_loop_at_once(model):
    e = Engine(model, context_limit=2048)
    e.eos_ids = ()  # only the stop string can end the reply early
    p = prompts(e)[:1]
    full, _ = e.generate(model.params, e.start_tokens(model.params, p, seed=0), 14)
    reply = generated(full, 0)
    assert full.stats["decode_steps"] == 14
    # a step k whose token's own text holds a string no earlier token's text holds
    text_of = [e.decode([t]) for t in reply]
    k, stop = next((k, s) for k, s in enumerate(text_of[:12]) if k >= 2 and s
                   and not any(s in x for x in text_of[:k]) and s not in e.decode(reply[:k]))
    got, texts = e.generate(model.params, e.start_tokens(model.params, p, seed=0), 14, stop=(stop,))
    assert generated(got, 0) == reply[:k + 1] and texts[0].endswith(stop)
    assert got.stats["decode_steps"] == k + 1  # not the whole chunk of 16


@pytest.mark.parametrize("repeats", [3, 6])  # an observation block of 64 slots (short chunks), of 128 (long ones)
def test_a_prefill_chunk_computes_only_the_rows_with_tokens_in_it(model, engine, repeats):
    """One long observation makes every row's block long; its first chunks hold that row's tokens alone, and a
    block that is mostly padding goes in short chunks so that those chunks run on a small batch."""
    rows = [engine.encode(f"task {i}") for i in range(16)]
    observations = [engine.encode("the output was long " * repeats)] + [engine.encode("ok")] * 15
    conv = engine.start_tokens(model.params, rows, seed=0)
    conv, _ = engine.generate(model.params, conv, 4)
    conv = engine.extend_tokens(conv, observations)
    before = conv.stats["prefill_slots"]
    conv, _ = engine.generate(model.params, conv, 6)
    # the pending reply token and the observation go in: the short rows fit in the last chunk of 16, the long
    # row's earlier chunks run on a batch of 8 (the smallest work batch), the last chunk on all 16 rows
    long_row = len(observations[0]) + 1
    assert max(len(o) + 1 for o in observations[1:]) <= 16 and long_row > 64 * (repeats == 6)
    assert conv.stats["prefill_slots"] - before == (-(-long_row // 16) - 1) * 8 * 16 + 16 * 16
    for r in (0, 1, 15):
        alone = engine.start_tokens(model.params, [rows[r]], seed=0)
        alone, _ = engine.generate(model.params, alone, 4)
        alone, _ = engine.generate(model.params, engine.extend_tokens(alone, [observations[r]]), 6)
        assert generated(conv, r) == generated(alone, 0), f"row {r}"
