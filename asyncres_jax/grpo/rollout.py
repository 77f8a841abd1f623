"""GRPO rollouts: a ModelPolicy that also records each episode's training segments turn by turn.

`EpisodeResult.tokens` holds the conversation as it ended; when the rolling context dropped old turns, the
turns written before the drop are no longer in it. This wrapper snapshots every live row after each generated
reply (the engine's token state: ids, generated mask, sampling log-probs) and keeps, per episode, the segments
of data.SegmentBuilder, so every reply is trained in the context it was written in.
"""

from __future__ import annotations

from typing import Sequence

from asyncres_jax.grpo.data import Segment, SegmentBuilder, Snapshot
from asyncres_jax.rollout.episodes import ModelPolicy, Policy, PolicyBatch


class RecordingPolicy(Policy):
    """Plays like `inner`; after `run_episodes`, `segments()` gives each episode's training segments."""

    def __init__(self, inner: ModelPolicy):
        self.inner = inner
        self._batch: _RecordingBatch | None = None

    def begin(self, conversations, seed):
        self._batch = _RecordingBatch(self.inner.begin(conversations, seed), len(conversations))
        return self._batch

    def segments(self) -> list[list[Segment]]:
        if self._batch is None:
            raise RuntimeError("no episodes were played with this policy")
        return [b.segments() for b in self._batch.builders]


class _RecordingBatch(PolicyBatch):
    def __init__(self, inner: PolicyBatch, n: int):
        # The model batch exposes its engine conversation (`conv`) and which episode each row is (`rows`).
        self.inner, self.builders = inner, [SegmentBuilder() for _ in range(n)]

    def step(self, rows: Sequence[int], new_messages):
        replies = self.inner.step(rows, new_messages)
        conv = self.inner.conv
        for episode, ids, gen, lp in zip(self.inner.rows, conv.tokens, conv.generated_mask, conv.logprobs):
            self.builders[episode].add(Snapshot(ids, gen, lp))
        return replies

    def token_states(self):
        return self.inner.token_states()
