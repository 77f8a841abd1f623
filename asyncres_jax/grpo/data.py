"""Episodes -> training sequences: what the model saw, which tokens it wrote, and their old log-probs.

An episode whose conversation only grew (the usual case) is one sequence: the whole conversation, trained on
every token the model generated. When the engine's rolling context dropped old turns, a later turn was written
in a context that no longer holds the earlier ones, so no single sequence reproduces every turn's context.
Such an episode becomes several segments: a run of turns whose snapshots extend each other is one segment (the
last snapshot of the run), trained only on the replies written within that run. Once the context stays full
every turn drops history, so segments become single turns ("per turn when the rolling context dropped history").
All segments of an episode share its advantage and its token mean (loss.sequence_weights).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A conversation's token state right after one generated reply."""

    ids: np.ndarray  # [T] int32
    generated: np.ndarray  # [T] bool
    logprobs: np.ndarray  # [T] float32, the sampling distribution's log-prob of each generated token


@dataclasses.dataclass(frozen=True)
class Segment:
    """One training sequence: ids, the tokens whose loss counts, and their recorded log-probs."""

    ids: np.ndarray  # [T] int32
    loss_mask: np.ndarray  # [T] bool, True on the model's tokens trained in this segment
    logprobs: np.ndarray  # [T] float32

    def __len__(self) -> int:
        return len(self.ids)


def _extends(new: Snapshot, old: Snapshot) -> bool:
    n = len(old.ids)
    return (len(new.ids) >= n and np.array_equal(new.ids[:n], old.ids)
            and np.array_equal(new.generated[:n], old.generated))


def _last_reply_start(s: Snapshot) -> int:
    """Index of the first token of the trailing run of generated tokens (the reply just written)."""
    not_gen = np.flatnonzero(~s.generated)
    return int(not_gen[-1]) + 1 if not_gen.size else 0


class SegmentBuilder:
    """Builds an episode's segments turn by turn, keeping only the last snapshot of each run."""

    def __init__(self):
        self.done: list[Segment] = []
        self.cur: Snapshot | None = None
        self.start = 0

    def add(self, snap: Snapshot) -> None:
        if self.cur is not None and _extends(snap, self.cur):
            self.cur = snap
            return
        if self.cur is not None:
            self.done.append(_segment(self.cur, self.start))
        # A new run: its earlier generated tokens were written in another context and are trained elsewhere.
        self.cur, self.start = snap, _last_reply_start(snap)

    def segments(self) -> list[Segment]:
        return self.done + ([] if self.cur is None else [_segment(self.cur, self.start)])


def segments_from_snapshots(snapshots: Sequence[Snapshot]) -> list[Segment]:
    """Split an episode's per-turn snapshots into segments of turns that extend each other (see module doc)."""
    builder = SegmentBuilder()
    for snap in snapshots:
        builder.add(snap)
    return builder.segments()


def _segment(s: Snapshot, start: int) -> Segment:
    mask = s.generated.copy()
    mask[:start] = False
    return Segment(np.asarray(s.ids, np.int32), mask, np.asarray(s.logprobs, np.float32))


def whole_conversation(ids, generated, logprobs) -> Segment:
    """An episode whose context never dropped history: one segment, every generated token trained."""
    return Segment(np.asarray(ids, np.int32), np.asarray(generated, bool), np.asarray(logprobs, np.float32))


@dataclasses.dataclass(frozen=True)
class Batch:
    """A GRPO batch: segments, the episode each belongs to, and each episode's advantage."""

    segments: list[Segment]
    episode: np.ndarray  # [S] episode index of each segment, 0..E-1
    advantage: np.ndarray  # [E] float32
    skipped: int = 0  # segments left out for being longer than build_batch's max_tokens

    @property
    def n_episodes(self) -> int:
        return len(self.advantage)


def build_batch(episode_segments: Sequence[Sequence[Segment]], rewards_pg, max_tokens: int = 0) -> Batch:
    """Episodes in group order (group p's G episodes are p*G .. p*G+G-1) -> a Batch with group advantages.

    Episodes without a trained token (none generated) are left out; their group still counts their reward.
    Segments longer than max_tokens (> 0) are left out too, and counted: a backward pass keeps every layer's
    [heads, T, T] attention weights, so one long observation (up to 50,000 characters) could take more memory
    than the machine has.
    """
    from asyncres_jax.grpo.loss import group_advantages

    adv = group_advantages(rewards_pg).reshape(-1)
    if len(adv) != len(episode_segments):
        raise ValueError(f"{len(episode_segments)} episodes for {len(adv)} rewards")
    segments, episode, skipped = [], [], 0
    for e, segs in enumerate(episode_segments):
        for s in segs:
            if max_tokens and len(s) > max_tokens:
                skipped += 1
            elif s.loss_mask[1:].any():
                segments.append(s)
                episode.append(e)
    return Batch(segments, np.asarray(episode, np.int64), adv, skipped)


@dataclasses.dataclass(frozen=True)
class Rows:
    """A padded block of segments, right-padded (causal attention never sees the pads).

    Position t holds the prediction of token t + 1: targets, old log-probs and the loss mask are shifted.
    """

    tokens_bt: np.ndarray  # [B, T] int32 inputs (segment ids, right-padded with 0)
    old_logp_bt: np.ndarray  # [B, T - 1] float32 recorded log-prob of token t + 1
    mask_bt: np.ndarray  # [B, T - 1] bool, token t + 1 is trained
    episode_b: np.ndarray  # [B] int64 episode index of each row (-1: padding row)
    lengths_b: np.ndarray  # [B] int64 real length of each row


def length_bucket(n: int, minimum: int = 16) -> int:
    """Padded sequence length: a power of two, or a multiple of 512 beyond 2048 (bounded compiles and waste)."""
    if n <= 2048:
        return max(minimum, 1 << max(0, math.ceil(math.log2(max(1, n)))))
    return -(-n // 512) * 512


def pack(segments: Sequence[Segment], episodes: Sequence[int], rows: int, length: int | None = None) -> Rows:
    """Pad `segments` into `rows` rows (>= len(segments)) of one bucketed length."""
    if len(segments) > rows:
        raise ValueError(f"{len(segments)} segments do not fit {rows} rows")
    T = length or length_bucket(max((len(s) for s in segments), default=1))
    tokens = np.zeros((rows, T), np.int32)
    old = np.zeros((rows, T - 1), np.float32)
    mask = np.zeros((rows, T - 1), bool)
    episode = np.full(rows, -1, np.int64)
    lengths = np.zeros(rows, np.int64)
    for b, (s, e) in enumerate(zip(segments, episodes)):
        n = len(s)
        if n > T:
            raise ValueError(f"segment of {n} tokens does not fit length {T}")
        tokens[b, :n] = s.ids
        old[b, :n - 1] = s.logprobs[1:]
        mask[b, :n - 1] = s.loss_mask[1:]
        episode[b], lengths[b] = e, n
    return Rows(tokens, old, mask, episode, lengths)
