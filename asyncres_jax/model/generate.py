"""KV-cached batched generation for multi-turn agent episodes: the engine under `Model.generate`.

Token-level state lives in a `Conversation`: per row, the context's token ids, which of them the model
generated and their log-probs (what GRPO trains on), plus a KV cache shared by all rows. The invariant
is that the cache holds each row's tokens except the ones still to prefill; the last token of a row is
always "pending" (not in the cache): the next decode step feeds it and samples the token after it.
That way a prefill never computes the vocabulary projection (XLA drops the unused logits).

Layout of the cache (all rows share slot indices):
  * A batch of new tokens (prompt, observation) is written left-padded as one block at the next free
    slots; long blocks are prefilled in chunks of PREFILL_CHUNK. Pads and the tails of rows that
    stopped early are holes that kv_valid masks; positions are counted per row, never from slots.
    A chunk computes only the rows with tokens in it (in their batch bucket): left padding leaves a
    block's first chunks to its longest rows.
  * A fresh cache whose rows run the same weights (no perturbation, or a population's rows of one
    member) and share a prompt prefix (the system prompt) prefills it once per group of such rows
    on a small batch and copies it to the rows; the rest follows as the usual block.
  * Slots grow in buckets (slot_bucket), rows in power-of-two buckets, blocks in power-of-two buckets,
    so an episode compiles a bounded number of programs whatever its turn lengths.
  * Decoding runs DECODE_CHUNK tokens per jitted call (a lax.while_loop that ends early once every row
    is done: at EOS, its budget, or a token whose own text holds a stop string). Between chunks the
    host checks stop strings on the decoded tail of each row (exact: the token that completes a stop
    string is kept, later ones are rolled back; a row stopped on a token that completes none resumes),
    and rows that finished leave the working batch when it can shrink to a smaller bucket. A step at
    batch 32 costs ~0.2 s on CPU (a cohort batch), the host round trip well under 1 ms.
  * Over the context limit (default 16,384 tokens) the oldest turns after the first prompt (system and
    task) are dropped and the cache is rebuilt; the same rebuild compacts the slots when holes have used
    them up.

Calls consume the conversation they are given (its cache buffers are donated to the next step) and
return the new one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from asyncres_jax.errors import UserError
from asyncres_jax.model import decoder
from asyncres_jax.model.config import ModelConfig
from asyncres_jax.model.decoder import KVCache
from asyncres_jax.model.sampling import Sampling, sample, seed_key
from asyncres_jax.model.sharding import cache_spec

DEFAULT_CONTEXT_LIMIT = 16384
PREFILL_CHUNK = 128
SHORT_CHUNK = 16  # the chunk of short blocks (observations) and of a shared prefix's tail
MIN_WORK_BATCH = 8  # below this a decode step costs about the same (weight reads dominate)
DECODE_CHUNK = 8  # short: finished rows leave the working batch at the next chunk boundary
STATS = ("prefill_seconds", "prefill_tokens", "prefill_slots", "decode_seconds", "decode_steps")


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def block_length(n: int) -> int:
    """Slots for a left-padded block of up to n new tokens: a multiple of the chunk it is prefilled in."""
    c = prefill_chunk(n)
    return max(c, -(-n // c) * c)


def prefill_chunk(n: int) -> int:
    """Short blocks (observations) go in chunks of 16, long ones in chunks of 128: only two prefill shapes
    per cache size, so compiles stay few whatever the observation lengths."""
    return SHORT_CHUNK if n <= 64 else PREFILL_CHUNK


def slot_bucket(n: int) -> int:
    """Cache length for n slots: 64, 128, 256, 384, 512, 768, 1024, 1536, ... (powers of two, and from 384 on
    three quarters of the next one). Decode attention reads every slot of the bucket, about half of a batch-32
    step at 512 slots on CPU, so at most a third of it is spare; two buckets per doubling keep the number of
    compiled programs per episode small."""
    b = max(64, _pow2(n))
    return 3 * b // 4 if b >= 512 and n <= 3 * b // 4 else b


# ----------------------------------------------------------------------------------------------------
# Jitted programs. cfg and the sampling mode are static; everything that varies per call is traced.


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _prefill(params, cache, kv_valid_bs, tokens_bt, positions_bt, write_index, perturbation, *, cfg):
    """Write a block of tokens into the cache. The logits are unused, so XLA drops the vocab projection."""
    _, cache = decoder.forward(params, cfg, tokens_bt, positions_bt, cache=cache, write_index=write_index,
                               kv_valid_bs=kv_valid_bs, perturbation=perturbation)
    return cache


@functools.partial(jax.jit, static_argnames=("cfg", "mode", "chunk", "eos"), donate_argnames=("cache",))
def _decode(params, cache, kv_valid_bs, tok_b, pos_b, drawn_b, budget_b, done_b, row_ids_b, base_key,
            length, steps, temperature, top_p, perturbation, *, cfg, mode, chunk, eos):
    """Up to `steps` (<= chunk) decode steps for the whole batch; stops early when every row is done.

    Step i feeds each row's pending token at slot length + i and samples the next one. Rows that are
    done keep running (fixed shapes) but write holes (kv_valid false) and emit -1.
    """
    greedy, top_k, use_top_p = mode
    B = tok_b.shape[0]
    keys_b = jax.vmap(lambda r: jax.random.fold_in(base_key, r))(row_ids_b)
    eos_v = jnp.asarray(eos if eos else (-2,), jnp.int32)

    def cond(c):
        i, done_b = c[0], c[6]
        return (i < steps) & ~jnp.all(done_b)

    def body(c):
        i, cache, kv_valid_bs, tok_b, pos_b, drawn_b, done_b, budget_b, out_tok_bk, out_lp_bk = c
        slot = length + i
        live_b = ~done_b
        kv_valid_bs = jax.lax.dynamic_update_slice(kv_valid_bs, live_b[:, None], (0, slot))
        logits_btv, cache = decoder.forward(params, cfg, tok_b[:, None], pos_b[:, None], cache=cache,
                                            write_index=slot, kv_valid_bs=kv_valid_bs, perturbation=perturbation)
        new_b, lp_b = sample(logits_btv[:, -1], keys_b, drawn_b, temperature, top_p,
                             greedy=greedy, top_k=top_k, use_top_p=use_top_p)
        new_b = jnp.where(live_b, new_b, -1)
        out_tok_bk = jax.lax.dynamic_update_slice(out_tok_bk, new_b[:, None], (0, i))
        out_lp_bk = jax.lax.dynamic_update_slice(out_lp_bk, jnp.where(live_b, lp_b, 0.0)[:, None], (0, i))
        step_b = live_b.astype(jnp.int32)
        budget_b = budget_b - step_b
        done_b = done_b | (live_b & (jnp.isin(new_b, eos_v) | (budget_b <= 0)))
        tok_b = jnp.where(live_b, new_b, tok_b)
        return (i + 1, cache, kv_valid_bs, tok_b, pos_b + step_b, drawn_b + step_b, done_b, budget_b,
                out_tok_bk, out_lp_bk)

    init = (jnp.int32(0), cache, kv_valid_bs, tok_b, pos_b, drawn_b, done_b, budget_b,
            jnp.full((B, chunk), -1, jnp.int32), jnp.zeros((B, chunk), jnp.float32))
    out = jax.lax.while_loop(cond, body, init)
    n, cache, kv_valid_bs = out[0], out[1], out[2]
    return cache, kv_valid_bs, out[8], out[9], n


@jax.jit
def _take_rows(cache, rows_idx):
    return decoder.take_rows(cache, rows_idx)


def _perturbation_rows(perturbation, rows_idx):
    """The perturbation of the cache's batch rows (population batching). A population perturbation
    (es/population.py) holds one entry per conversation row, and the cache's rows are those rows padded to a
    bucket, or a decode's working subset: re-index it like the cache. Others pass through unchanged."""
    if perturbation is None or not hasattr(perturbation, "take_rows"):
        return perturbation
    return perturbation.take_rows(np.asarray(rows_idx, np.int32))


@functools.partial(jax.jit, donate_argnames=("master",))
def _put_rows(master, work, dest_idx):
    """master[dest_idx[w]] = work[w]; dest_idx out of range (padding rows) is dropped."""
    return jax.tree.map(lambda m, w: m.at[dest_idx].set(w, mode="drop"), master, work)


@functools.partial(jax.jit, static_argnames=("new_length",))
def _grow(cache, *, new_length):
    return decoder.grow_cache(cache, new_length)


def _common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix every sequence shares."""
    first, n = seqs[0], min(len(t) for t in seqs)
    for t in seqs[1:]:
        diff = np.flatnonzero(np.asarray(t[:n]) != np.asarray(first[:n]))
        n = int(diff[0]) if diff.size else n
    return n


def _row_groups(perturbation, n: int) -> np.ndarray | None:
    """[n] group ids: rows of one group run the same weights, so they may share a prefix's KV. None: unknown
    (a perturbation that does not say which rows share one), share nothing."""
    if perturbation is None:
        return np.zeros(n, np.int64)
    groups = getattr(perturbation, "row_groups", None)
    return None if groups is None else np.asarray(groups())[:n]


def compiled_programs() -> dict[str, int]:
    """How many programs each jitted function holds: "model" (prefill + decode, the costly compiles of
    the whole network) and "small" (row gathers, scatters, cache growth)."""
    return {"model": _prefill._cache_size() + _decode._cache_size(),
            "small": _take_rows._cache_size() + _put_rows._cache_size() + _grow._cache_size()}


# ----------------------------------------------------------------------------------------------------
# Host-side conversation state.


@dataclass
class Row:
    """One conversation's context. spans: (kind, start, end) over tokens, kind in prompt|generated|appended."""

    row_id: int
    tokens: list[int]
    generated: list[bool]
    logprobs: list[float]
    spans: list[tuple[str, int, int]]
    messages: list[dict] | None = None
    drawn: int = 0  # tokens sampled so far (folded into the sampling key)

    def copy(self) -> "Row":
        return Row(self.row_id, list(self.tokens), list(self.generated), list(self.logprobs), list(self.spans),
                   None if self.messages is None else list(self.messages), self.drawn)

    def append(self, kind: str, tokens: Sequence[int], logprobs: Sequence[float] | None = None) -> None:
        start = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens)
        self.generated.extend([kind == "generated"] * len(tokens))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(tokens))
        if kind == "generated" and self.spans and self.spans[-1][0] == "generated":  # continue the same reply
            self.spans[-1] = ("generated", self.spans[-1][1], len(self.tokens))
        else:
            self.spans.append((kind, start, len(self.tokens)))

    def truncate(self, n: int) -> None:
        """Keep the first n tokens."""
        del self.tokens[n:], self.generated[n:], self.logprobs[n:]
        self.spans = [(k, s, min(e, n)) for k, s, e in self.spans if s < n]

    def drop_oldest_turn(self) -> bool:
        """Remove the oldest (reply, observation) pair after the first prompt; False when none is left.

        Only whole turns go: the last span (the observation just appended) is never dropped.
        """
        if len(self.spans) < 4:  # prompt, reply, observation, and at least the newest observation after it
            return False
        _, s, _ = self.spans[1]
        _, _, e = self.spans[2]
        n = e - s
        del self.tokens[s:e], self.generated[s:e], self.logprobs[s:e]
        self.spans = [self.spans[0]] + [(k, a - n, b - n) for k, a, b in self.spans[3:]]
        if self.messages is not None and len(self.messages) > 3:
            # messages: [system, task, ...]: the dropped reply and observation follow the first prompt.
            first = next(i for i, m in enumerate(self.messages) if m["role"] == "assistant")
            del self.messages[first:first + 2]
        return True


@dataclass
class Conversation:
    """A batch of conversations: host token state per row plus the shared KV cache.

    cache rows [0, len(rows)) hold the rows in order; further rows (up to the batch bucket) are padding.
    n_cached[r]: how many of row r's tokens are in the cache; length: slots used so far.
    """

    rows: list[Row]
    seed: int
    cache: KVCache | None = None
    kv_valid: np.ndarray | None = None  # [Bb, S] bool
    n_cached: np.ndarray | None = None  # [len(rows)] int
    length: int = 0
    rebuild: bool = False
    last_texts: list[str] = field(default_factory=list)
    # Work done on this batch so far, for per-phase timing: seconds and tokens of prefill (the prompts and
    # observations; `prefill_slots` counts the padded block cells computed) and of decoding. Shared by the
    # conversations that `extend`/`generate` derive from this one.
    stats: dict = field(default_factory=lambda: dict.fromkeys(STATS, 0))

    @property
    def tokens(self) -> list[np.ndarray]:
        return [np.asarray(r.tokens, np.int32) for r in self.rows]

    @property
    def generated_mask(self) -> list[np.ndarray]:
        return [np.asarray(r.generated, bool) for r in self.rows]

    @property
    def logprobs(self) -> list[np.ndarray]:
        return [np.asarray(r.logprobs, np.float32) for r in self.rows]

    @property
    def row_ids(self) -> list[int]:
        return [r.row_id for r in self.rows]

    def __len__(self) -> int:
        return len(self.rows)


# ----------------------------------------------------------------------------------------------------


@dataclass
class _Progress:
    """Where one generate() call stands, per conversation row."""

    start_len: list[int]  # tokens before the reply
    budget: np.ndarray  # reply tokens allowed (max_new_tokens, or what the context has left)
    finished: np.ndarray
    scanned: list[int]  # reply tokens already searched for stop strings
    stopped_at: dict[int, int] = field(default_factory=dict)  # row -> end of the stop string in the reply text

    @classmethod
    def start(cls, conv: "Conversation", max_new_tokens: int, context_limit: int) -> "_Progress":
        budget = np.array([min(max_new_tokens, context_limit - len(r.tokens)) for r in conv.rows])
        return cls([len(r.tokens) for r in conv.rows], budget, budget <= 0, [0] * len(conv.rows))

    def decode_inputs(self, conv: "Conversation", work_map) -> tuple[np.ndarray, ...]:
        """Per working-batch slot: last token, its position, tokens drawn so far, budget left, done, row id."""
        bw = len(work_map)
        tok, pos, drawn, bud = (np.zeros(bw, np.int32) for _ in range(4))
        done, rid = np.ones(bw, bool), np.zeros(bw, np.uint32)
        for w, r in enumerate(work_map):
            if r < 0 or self.finished[r]:
                continue
            row = conv.rows[r]
            tok[w], pos[w], drawn[w] = row.tokens[-1], len(row.tokens) - 1, row.drawn
            bud[w] = self.budget[r] - (len(row.tokens) - self.start_len[r])
            done[w] = False
            rid[w] = row.row_id
        return tok, pos, drawn, bud, done, rid


class Engine:
    """Generation for one model: `start`, `extend`, `generate` on conversations; `generate_text` for prompts."""

    def __init__(self, model, context_limit: int = DEFAULT_CONTEXT_LIMIT, decode_chunk: int = DECODE_CHUNK):
        self.model = model
        self.cfg: ModelConfig = model.config
        self.tokenizer = getattr(model, "tokenizer", None)
        self.mesh = getattr(model, "mesh", None)
        self.context_limit = int(context_limit)
        self.decode_chunk = int(decode_chunk)
        eos = set(self.cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_ids = tuple(sorted(eos))
        self._data = 1 if self.mesh is None else self.mesh.shape["data"]
        # The most slots a cache ever has: a full context prefilled as one block, plus one decode chunk.
        self.max_slots = block_length(self.context_limit) + self.decode_chunk
        self._stop_ids: dict[tuple[str, ...], set[int]] = {}  # stop strings -> the tokens holding one

    # -- placement -----------------------------------------------------------------------------------

    def _put(self, x, spec=P()):
        if self.mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    def _cache_spec(self) -> P:
        return cache_spec(self.cfg, self.mesh)

    def _batch_bucket(self, n: int, current: int | None = None) -> int:
        """Rows for n sequences: a power of two (times the data-axis size). When shrinking from `current`,
        never below MIN_WORK_BATCH: a smaller batch would save little and compile one more program."""
        d = self._data
        b = d * _pow2(-(-n // d))
        return b if current is None else min(current, max(b, d * _pow2(-(-MIN_WORK_BATCH // d))))

    def _slots(self, n: int) -> int:
        """Cache length for n slots: the bucket, capped at what the context limit can ever need."""
        return min(slot_bucket(n), self.max_slots)

    def _new_cache(self, params, batch: int, length: int) -> KVCache:
        dtype = params["embed"]["embedding"].dtype
        cache = decoder.init_cache(self.cfg, batch, length, dtype)
        return cache if self.mesh is None else jax.device_put(cache, NamedSharding(self.mesh, self._cache_spec()))

    # -- text <-> tokens -----------------------------------------------------------------------------

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise UserError("this model has no tokenizer; use the token-level start_tokens/extend_tokens instead")
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._need_tokenizer()(text, add_special_tokens=False)["input_ids"])

    def decode(self, tokens: Sequence[int]) -> str:
        return self._need_tokenizer().decode(list(tokens), skip_special_tokens=True)

    def _template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self._need_tokenizer().apply_chat_template(messages, tokenize=False,
                                                          add_generation_prompt=add_generation_prompt)

    # -- conversation API ----------------------------------------------------------------------------

    def start(self, params, messages_batch: Sequence[Sequence[dict]], seed: int = 0,
              perturbation=None) -> Conversation:
        """New conversations from chat messages (one list per row); prefills them."""
        if not messages_batch:
            raise UserError("start needs at least one conversation (messages_batch is empty)")
        prompts = [self.encode(self._template(list(msgs))) for msgs in messages_batch]
        conv = self.start_tokens(params, prompts, seed, perturbation)
        for row, msgs in zip(conv.rows, messages_batch):
            row.messages = [dict(m) for m in msgs]
        return conv

    def start_tokens(self, params, prompts: Sequence[Sequence[int]], seed: int = 0, perturbation=None,
                     prefill: bool = True) -> Conversation:
        """New conversations from token ids (one list per row)."""
        if len(prompts) == 0:
            raise UserError("no prompts given; pass at least one prompt")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise UserError(f"prompt {i} is empty; every prompt needs at least one token")
            if len(p) >= self.context_limit:
                raise UserError(f"prompt {i} has {len(p)} tokens, more than the context limit "
                                f"{self.context_limit} allows (it must leave room to generate); shorten it")
        rows = []
        for i, p in enumerate(prompts):
            row = Row(i, [], [], [], [])
            row.append("prompt", p)
            rows.append(row)
        conv = Conversation(rows, int(seed), n_cached=np.zeros(len(rows), np.int64))
        if prefill:
            conv = self._prefill_pending(params if params is not None else self.model.params, conv, perturbation)
        return conv

    def extend(self, conv: Conversation, new_messages: Sequence[Any]) -> Conversation:
        """Append messages (usually an observation) to each row; None for a row removes it from the batch.

        Each entry is a message dict, a list of them, or None. The history already in the cache is not
        re-run; the new tokens are prefilled by the next `generate`.
        """
        if len(new_messages) != len(conv.rows):
            raise UserError(f"extend got {len(new_messages)} entries for {len(conv.rows)} conversations")
        new_tokens = []
        for row, new in zip(conv.rows, new_messages):
            if new is None:
                new_tokens.append(None)
                continue
            msgs = [new] if isinstance(new, dict) else list(new)
            if row.messages is None:
                raise UserError("extend with messages needs a conversation started from messages (engine.start)")
            new_tokens.append(self._turn_suffix(row, msgs))
        conv = self.extend_tokens(conv, new_tokens)
        kept = [m for m in new_messages if m is not None]
        for row, new in zip(conv.rows, kept):
            row.messages.extend([new] if isinstance(new, dict) else list(new))
        return conv

    def _turn_suffix(self, row: Row, new_msgs: list[dict]) -> list[int]:
        """Tokens that close the last reply and open the next one, by the chat template itself."""
        marker = "\ue000asyncres-reply\ue000"
        text = self._template(row.messages + [{"role": "assistant", "content": marker}] + new_msgs)
        suffix = text[text.index(marker) + len(marker):]
        ids = self.encode(suffix)
        # A reply that ended with the end-of-turn token already holds what the template puts first.
        if row.generated and row.generated[-1] and row.tokens[-1] in self.eos_ids and ids and ids[0] == row.tokens[-1]:
            ids = ids[1:]
        return ids

    def extend_tokens(self, conv: Conversation, new_tokens: Sequence[Sequence[int] | None]) -> Conversation:
        """Token-level extend: append ids per row (None: the row leaves the batch)."""
        if len(new_tokens) != len(conv.rows):
            raise UserError(f"extend got {len(new_tokens)} entries for {len(conv.rows)} conversations")
        keep = [i for i, t in enumerate(new_tokens) if t is not None]
        if not keep:
            raise UserError("extend would leave no conversation in the batch; stop the episode instead")
        conv = self._keep_rows(conv, keep)
        rebuild = conv.rebuild
        for row, toks in zip(conv.rows, [new_tokens[i] for i in keep]):
            if len(toks) == 0:
                continue
            row.append("appended", toks)
            # Rolling context: drop the oldest turns after the first prompt until the row fits again.
            while len(row.tokens) >= self.context_limit:
                if not row.drop_oldest_turn():
                    raise UserError(
                        f"conversation {row.row_id} needs {len(row.tokens)} tokens even after dropping every "
                        f"earlier turn, over the context limit {self.context_limit}; cap the observation length")
                rebuild = True
        return dataclasses.replace(conv, rebuild=rebuild)

    def keep(self, conv: Conversation, rows: Sequence[int]) -> Conversation:
        """Only the given rows (indices into conv.rows) stay; finished episodes leave the batch."""
        return self._keep_rows(conv, list(rows))

    def _keep_rows(self, conv: Conversation, keep: list[int]) -> Conversation:
        rows = [conv.rows[i].copy() for i in keep]
        n_cached = conv.n_cached[keep] if conv.n_cached is not None else None
        if keep == list(range(len(conv.rows))) or conv.cache is None:
            return dataclasses.replace(conv, rows=rows, n_cached=n_cached)
        bb = self._batch_bucket(len(keep), conv.kv_valid.shape[0])
        idx = np.asarray(keep + [keep[0]] * (bb - len(keep)), np.int32)
        cache = _take_rows(conv.cache, self._put(idx))
        return dataclasses.replace(conv, rows=rows, n_cached=n_cached, cache=cache, kv_valid=conv.kv_valid[idx])

    def generate(self, params, conv: Conversation, max_new_tokens: int, sampling=None, stop: Sequence[str] = (),
                 perturbation=None) -> tuple[Conversation, list[str]]:
        """Continue every row by up to max_new_tokens; returns the new conversation and each row's reply text.

        A reply ends at an EOS token, at the end of the first stop string (kept; nothing after it), at
        max_new_tokens, or when the context is full.
        """
        if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens or max_new_tokens <= 0:
            raise UserError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        sampling = Sampling.of(sampling)
        stop = self._check_stop(stop)
        params = self.model.params if params is None else params
        t_start, prefilled = time.monotonic(), conv.stats["prefill_seconds"]
        conv = dataclasses.replace(conv, rows=[r.copy() for r in conv.rows])
        conv = self._prefill_pending(params, conv, perturbation)
        n = len(conv.rows)
        progress = _Progress.start(conv, int(max_new_tokens), self.context_limit)
        greedy, top_k, use_top_p = sampling.static(self.cfg.vocab_size)
        temperature = jnp.float32(sampling.temperature if not greedy else 1.0)
        top_p = jnp.float32(sampling.top_p)
        base_key = seed_key(conv.seed)
        chunk = self.decode_chunk
        ends = self._stop_token_ids(stop)

        # The working batch: rows of the conversation cache that are still generating (plus padding).
        work_map = np.arange(conv.kv_valid.shape[0])
        work_map = np.where(work_map < n, work_map, -1)
        work_cache, work_kv = conv.cache, conv.kv_valid
        master = None  # the full conversation cache, once the working batch is a subset
        length = conv.length
        while not progress.finished.all():
            live_rows = [r for r in range(n) if not progress.finished[r]]
            bw = self._batch_bucket(len(live_rows), len(work_map))
            if bw < len(work_map):  # shrink the working batch: finished rows go back to the full cache
                if master is None:
                    master = (work_cache, work_kv)
                    idx_old = np.asarray(live_rows)
                else:
                    master = self._put_back(master, work_cache, work_kv, work_map)
                    pos_of = {int(r): w for w, r in enumerate(work_map) if r >= 0}
                    idx_old = np.asarray([pos_of[r] for r in live_rows])
                idx_old = np.concatenate([idx_old, np.full(bw - len(live_rows), idx_old[0])]).astype(np.int32)
                work_cache = _take_rows(work_cache, self._put(idx_old))
                work_kv = work_kv[idx_old]
                work_map = np.asarray(live_rows + [-1] * (bw - len(live_rows)))
            # Room for one more chunk: grow the slot bucket, or compact when the slots have run out.
            if length + chunk > work_kv.shape[1]:
                if length + chunk > self.max_slots:
                    if master is not None:
                        master = self._put_back(master, work_cache, work_kv, work_map)
                        work_cache, work_kv = master
                        master = None
                    conv = dataclasses.replace(conv, cache=work_cache, kv_valid=work_kv, length=length, rebuild=True)
                    conv = self._prefill_pending(params, conv, perturbation)
                    work_cache, work_kv, length = conv.cache, conv.kv_valid, conv.length
                    work_map = np.where(np.arange(work_kv.shape[0]) < n, np.arange(work_kv.shape[0]), -1)
                    continue
                new_s = self._slots(length + chunk)
                work_cache = _grow(work_cache, new_length=new_s)
                work_kv = np.pad(work_kv, ((0, 0), (0, new_s - work_kv.shape[1])))
            tok, pos, drawn, bud, done, rid = (self._put(x, P("data")) for x in progress.decode_inputs(conv, work_map))
            work_cache, kv_dev, out_tok, out_lp, steps = _decode(
                params, work_cache, self._put(work_kv, P("data")), tok, pos, drawn, bud, done, rid, base_key,
                jnp.int32(length), jnp.int32(chunk), temperature, top_p,
                _perturbation_rows(perturbation, np.maximum(work_map, 0)),
                cfg=self.cfg, mode=(greedy, top_k, use_top_p), chunk=chunk, eos=ends)
            work_kv = np.array(kv_dev)
            self._accept_chunk(conv, work_map, np.asarray(out_tok), np.asarray(out_lp), int(steps), length, work_kv,
                               stop, progress)
            length += int(steps)
            conv.stats["decode_steps"] += int(steps)
        if master is not None:
            work_cache, work_kv = self._put_back(master, work_cache, work_kv, work_map)
        conv = dataclasses.replace(conv, cache=work_cache, kv_valid=work_kv, length=length)
        # everything of this call but its prefills (the one above, and any rebuild of an overfull cache)
        conv.stats["decode_seconds"] += time.monotonic() - t_start - (conv.stats["prefill_seconds"] - prefilled)
        return conv, self._replies(conv, progress)

    def _accept_chunk(self, conv: Conversation, work_map, out_tok, out_lp, steps: int, length: int, work_kv,
                      stop: Sequence[str], progress: "_Progress") -> None:
        """Append one decoded chunk to the working rows; a row that reached EOS, its budget or a stop string
        finishes (tokens past a stop string are rolled back, and their cache slots invalidated in work_kv)."""
        for w, r in enumerate(work_map):
            if r < 0 or progress.finished[r]:
                continue
            row = conv.rows[r]
            new = out_tok[w, :steps]
            m = int(np.sum(new >= 0))
            row.append("generated", new[:m].tolist(), out_lp[w, :m].tolist())
            row.drawn += m
            conv.n_cached[r] += m
            reply = row.tokens[progress.start_len[r]:]
            if m and (new[m - 1] in self.eos_ids or len(reply) >= progress.budget[r]):
                progress.finished[r] = True
            if not stop:
                continue
            hit = self._find_stop(reply, progress.scanned[r], stop)
            progress.scanned[r] = len(reply)
            if hit is None:
                continue
            k, end = hit  # reply[k] completes the stop string; end: its end in the text
            extra = len(reply) - (k + 1)
            if extra:
                row.truncate(progress.start_len[r] + k + 1)
                row.drawn -= extra
                conv.n_cached[r] -= extra
                # Step i of this chunk wrote its input at slot length + i; the token now pending
                # and the rolled-back ones after it were the inputs of the last `extra` live steps.
                work_kv[w, length + m - extra:length + m] = False
            progress.stopped_at[r] = end
            progress.finished[r] = True

    def _replies(self, conv: Conversation, progress: "_Progress") -> list[str]:
        """Each row's reply text (cut at its stop string), also appended to the row's chat messages."""
        texts = []
        for r, row in enumerate(conv.rows):
            reply = row.tokens[progress.start_len[r]:]
            text = self.decode(reply) if self.tokenizer is not None else ""
            if r in progress.stopped_at:
                text = text[:progress.stopped_at[r]]
            texts.append(text)
            if row.messages is not None:
                row.messages.append({"role": "assistant", "content": text})
        conv.last_texts = texts
        return texts

    # -- internals -----------------------------------------------------------------------------------

    def _put_back(self, master, work_cache, work_kv, work_map):
        """Write the working rows into the full conversation cache (grown to the working slot count)."""
        m_cache, m_kv = master
        if m_kv.shape[1] < work_kv.shape[1]:
            m_cache = _grow(m_cache, new_length=work_kv.shape[1])
            m_kv = np.pad(m_kv, ((0, 0), (0, work_kv.shape[1] - m_kv.shape[1])))
        dest = np.where(work_map >= 0, work_map, m_kv.shape[0]).astype(np.int32)
        m_cache = _put_rows(m_cache, work_cache, self._put(dest))
        m_kv = m_kv.copy()
        ok = work_map >= 0
        m_kv[work_map[ok]] = work_kv[ok]
        return m_cache, m_kv

    def _check_stop(self, stop) -> tuple[str, ...]:
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise UserError(f"stop strings must be non-empty strings, got {stop!r}")
        if stop and self.tokenizer is None:
            raise UserError("stop strings need a tokenizer to decode text; this model has none")
        return stop

    def _stop_token_ids(self, stop: tuple[str, ...]) -> tuple[int, ...]:
        """EOS ids plus every token whose own text holds a stop string: the decode loop marks a row done at
        one, so a chunk ends as soon as every row has stopped instead of running its remaining steps. The host
        still finds the exact stop (_find_stop); a token that does not complete one just resumes next chunk."""
        if not stop:
            return self.eos_ids
        if stop not in self._stop_ids:
            texts = self.tokenizer.batch_decode([[i] for i in range(len(self.tokenizer))], skip_special_tokens=True)
            self._stop_ids[stop] = {i for i, text in enumerate(texts) if any(s in text for s in stop)}
        return tuple(sorted(self._stop_ids[stop] | set(self.eos_ids)))

    def _find_stop(self, reply: list[int], scanned: int, stop: tuple[str, ...]) -> tuple[int, int] | None:
        """(index of the token that completes the first stop string, end of it in the text) or None.

        Only the tail that can hold a new match is decoded: a stop string of c characters spans at most
        4c byte-level tokens, so the search window starts that far before the tokens already scanned.
        """
        if len(reply) <= scanned:
            return None
        back = 4 * max(len(s) for s in stop) + 2
        lo = max(0, scanned - back)
        window = self.decode(reply[lo:])
        if not any(s in window for s in stop):
            return None
        # The completing token: the first prefix of the reply whose text contains a stop string.
        def first_end(text):
            ends = [text.index(s) + len(s) for s in stop if s in text]
            return min(ends) if ends else None
        a, b = lo, len(reply) - 1  # smallest k with a stop in decode(reply[:k + 1])
        while a < b:
            mid = (a + b) // 2
            if first_end(self.decode(reply[:mid + 1])) is not None:
                b = mid
            else:
                a = mid + 1
        return a, first_end(self.decode(reply[:a + 1]))

    def _prefill_pending(self, params, conv: Conversation, perturbation) -> Conversation:
        """Bring the cache up to date: every row's tokens except the last go in (one left-padded block)."""
        n = len(conv.rows)
        fresh = conv.cache is None or conv.rebuild
        if fresh:
            bb = self._batch_bucket(n)
            conv = dataclasses.replace(conv, cache=None, kv_valid=np.zeros((bb, 0), bool),
                                       n_cached=np.zeros(n, np.int64), length=0, rebuild=False)
            conv = self._prefill_shared(params, conv, perturbation)
        todo = [r.tokens[c:len(r.tokens) - 1] for r, c in zip(conv.rows, conv.n_cached)]
        t_max = max(len(t) for t in todo)
        if t_max == 0 and conv.cache is not None:
            return conv
        block = block_length(max(t_max, 1))
        if not fresh and conv.length + block + self.decode_chunk > self.max_slots:
            return self._prefill_pending(params, dataclasses.replace(conv, rebuild=True), perturbation)
        bb = conv.kv_valid.shape[0]
        need = self._slots(conv.length + block + self.decode_chunk)
        if conv.cache is None:
            cache = self._new_cache(params, bb, need)
            kv_valid = np.zeros((bb, need), bool)
        else:
            cache, kv_valid = conv.cache, conv.kv_valid
            if kv_valid.shape[1] < need:
                cache = _grow(cache, new_length=need)
                kv_valid = np.pad(kv_valid, ((0, 0), (0, need - kv_valid.shape[1])))
        tokens = np.zeros((bb, block), np.int32)
        positions = np.zeros((bb, block), np.int32)
        valid = np.zeros((bb, block), bool)
        for b in range(bb):
            r = b if b < n else 0  # padding rows repeat row 0
            t = todo[r]
            if not t:
                continue
            tokens[b, block - len(t):] = t
            positions[b, block - len(t):] = np.arange(conv.n_cached[r], conv.n_cached[r] + len(t))
            valid[b, block - len(t):] = True
        if block <= 0 or t_max == 0:
            return dataclasses.replace(conv, cache=cache, kv_valid=kv_valid)
        L = conv.length
        kv_valid = kv_valid.copy()
        kv_valid[:, L:L + block] = valid
        conv_row = np.where(np.arange(bb) < n, np.arange(bb), 0)  # padding rows: row 0
        step, t, slots = prefill_chunk(block), time.monotonic(), 0
        if valid[:n].mean() < 0.75:  # mostly padding (one long observation): short chunks skip the padding rows
            step = SHORT_CHUNK
        for chunks, rows in self._chunk_rows(valid, step):
            run_rows = None if rows is None else self._put(rows)
            sub = cache if rows is None else _take_rows(cache, run_rows)
            idx = slice(None) if rows is None else rows
            kv_sub = self._put(kv_valid[idx], P("data"))
            pert = _perturbation_rows(perturbation, conv_row[idx])
            for c0 in chunks:
                c1 = c0 + step
                sub = _prefill(params, sub, kv_sub, self._put(tokens[idx, c0:c1], P("data")),
                               self._put(positions[idx, c0:c1], P("data")), jnp.int32(L + c0), pert, cfg=self.cfg)
            slots += len(chunks) * step * (bb if rows is None else len(rows))
            if rows is None:
                cache = sub
            else:  # back into the cache; the bucket's padding rows (index bb) are dropped
                dest = np.where(np.arange(len(rows)) < np.unique(rows).size, rows, bb).astype(np.int32)
                cache = _put_rows(cache, sub, self._put(dest))
        jax.block_until_ready(cache)  # so that the prefill's time is counted here, not in the next decode
        stats = conv.stats
        stats["prefill_seconds"] += time.monotonic() - t
        stats["prefill_tokens"] += int(valid[:n].sum())
        stats["prefill_slots"] += slots
        n_cached = np.asarray([len(r.tokens) - 1 for r in conv.rows], np.int64)
        return dataclasses.replace(conv, cache=cache, kv_valid=kv_valid, n_cached=n_cached, length=L + block)

    def _chunk_rows(self, valid_bt: np.ndarray, step: int) -> list[tuple[list[int], np.ndarray | None]]:
        """The block's chunks in runs, each with the rows it computes: None for all of them, else the rows with
        tokens in the run's chunks, padded to their batch bucket by repeating the first (dropped on the way back).

        Left padding puts only the longest rows' tokens in a block's first chunks (one long observation makes
        every row's block long); computing the padding rows there would cost as much as real tokens."""
        bb, block = valid_bt.shape
        runs: list[tuple[list[int], np.ndarray | None]] = []
        for c0 in range(0, block, step):
            active = np.flatnonzero(valid_bt[:, c0:c0 + step].any(1))
            if active.size == 0:  # all padding (a block rounded up to whole long chunks): nothing to compute
                continue
            bucket = self._batch_bucket(active.size, bb)
            if bucket >= bb:
                rows = None
            else:
                rows = np.concatenate([active, np.full(bucket - active.size, active[0])])
            if runs and (runs[-1][1] is None) == (rows is None) and (rows is None or runs[-1][1].size == rows.size):
                runs[-1] = (runs[-1][0] + [c0], rows)  # the same bucket: this chunk's rows hold the earlier ones'
            else:
                runs.append(([c0], rows))
        return [(chunks, None if rows is None else rows.astype(np.int32)) for chunks, rows in runs]

    def _prefill_shared(self, params, conv: Conversation, perturbation) -> Conversation:
        """Into a fresh cache, the prompt prefix (in whole short chunks) that rows of one weight group share.

        A cohort's rows are members x tasks under one system prompt: each member's rows share the prompt's
        first hundreds of tokens. Their keys and values are computed once per group (member) on a small batch
        and copied to the group's rows; the rest of each row follows as the usual left-padded block. Rows keep
        the same positions and masks, so attention sees the same keys and values.
        """
        n = len(conv.rows)
        todo = [r.tokens[:len(r.tokens) - 1] for r in conv.rows]
        shared = _common_prefix(todo) // SHORT_CHUNK * SHORT_CHUNK
        groups = _row_groups(perturbation, n)
        if shared == 0 or groups is None:
            return conv
        _, first_row, group_of_row = np.unique(groups, return_index=True, return_inverse=True)
        bb = conv.kv_valid.shape[0]
        # One row per group (in its batch bucket): the prefix is most of a prompt and prefill costs per row, so
        # padding 4 members to the smallest work batch (8) would double it. Where that is the whole batch, there
        # is nothing to save.
        gb = self._batch_bucket(len(first_row))
        if gb >= bb:
            return conv
        rest = max(len(t) for t in todo) - shared
        need = self._slots(shared + block_length(max(rest, 1)) + self.decode_chunk)
        leaders = np.resize(first_row, gb)  # padding rows repeat the first groups
        tokens = np.tile(np.asarray(todo[0][:shared], np.int32), (gb, 1))
        positions = np.tile(np.arange(shared, dtype=np.int32), (gb, 1))
        kv_valid = np.zeros((bb, need), bool)
        kv_valid[:, :shared] = True
        kv_dev = self._put(kv_valid[:1].repeat(gb, 0), P("data"))
        group_pert = _perturbation_rows(perturbation, leaders)
        t = time.monotonic()
        cache = self._new_cache(params, gb, need)
        long_part = shared // PREFILL_CHUNK * PREFILL_CHUNK  # whole long chunks, then short ones up to `shared`
        bounds = list(range(0, long_part, PREFILL_CHUNK)) + list(range(long_part, shared + 1, SHORT_CHUNK))
        for c0, c1 in zip(bounds, bounds[1:]):
            cache = _prefill(params, cache, kv_dev, self._put(tokens[:, c0:c1], P("data")),
                             self._put(positions[:, c0:c1], P("data")), jnp.int32(c0), group_pert, cfg=self.cfg)
        rows_idx = np.concatenate([group_of_row, np.zeros(bb - n, np.int64)]).astype(np.int32)  # padding: row 0's
        cache = _take_rows(cache, self._put(rows_idx))
        jax.block_until_ready(cache)
        stats = conv.stats
        stats["prefill_seconds"] += time.monotonic() - t
        stats["prefill_tokens"] += n * shared  # the rows' tokens, as if each row had been prefilled alone
        stats["prefill_slots"] += gb * shared  # the cells computed
        return dataclasses.replace(conv, cache=cache, kv_valid=kv_valid, n_cached=np.full(n, shared, np.int64),
                                   length=shared)

    # -- text API ------------------------------------------------------------------------------------

    def generate_text(self, prompts: Sequence[str], max_new_tokens: int = 256, temperature: float = 0.0,
                      top_p: float = 1.0, top_k: int = 0, stop: Sequence[str] = (), seed: int = 0,
                      params=None, **unknown) -> list[str]:
        """Chat-formatted prompt strings -> reply strings."""
        if unknown:
            raise UserError(f"unknown generate option(s) {', '.join(sorted(unknown))}; known: max_new_tokens, "
                            "temperature, top_p, top_k, stop, seed, params")
        if isinstance(prompts, str):
            prompts = [prompts]
        if len(prompts) == 0:
            raise UserError("no prompts given; pass a non-empty list of prompt strings")
        sampling = Sampling(temperature=temperature, top_p=top_p, top_k=top_k)
        if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens or max_new_tokens <= 0:
            raise UserError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        stop = self._check_stop(stop)
        params = self.model.params if params is None else params
        conv = self.start_tokens(params, [self.encode(p) for p in prompts], seed)
        _, texts = self.generate(params, conv, max_new_tokens, sampling, stop)
        return texts
