"""The versioned parameter store: float32 master parameters, the log of committed updates, weight sync.

The ES math is injected, so this module does not depend on asyncres_jax.es:
    shape(fitness_n) -> shaped_n
    shape_grouped(fitness_n, groups_n) -> shaped_n   # optional: shaping that knows each result's task batch
    apply_update(params, opt_state, seeds, shaped_n) -> (params, opt_state)   # the learner's step
    replay(params, seeds, shaped_n) -> params                                # the same step without state
`replay` exists only for the paper's SGD rule, where an update is a pure function of (seeds, shaped fitness):
a worker then brings old weights up to date from the log and only integers and N floats per update travel.
With a stateful optimiser (Adam) pass replay=None and workers copy the master parameters instead.
apply_update must not donate (reuse) the old parameter buffers: workers may still be reading them.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Literal

import numpy as np

Params = Any
SyncKind = Literal["none", "replay", "copy"]


@dataclasses.dataclass(frozen=True)
class LogEntry:
    version: int  # the update applied to this version and published version + 1
    seeds: np.ndarray
    shaped: np.ndarray  # float32 shaped fitness, in the order of seeds' members


class ParamStore:
    def __init__(
        self,
        params: Params,
        opt_state: Any = None,
        *,
        apply_update: Callable[[Params, Any, np.ndarray, np.ndarray], tuple[Params, Any]],
        shape: Callable[[np.ndarray], np.ndarray],
        shape_grouped: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
        replay: Callable[[Params, np.ndarray, np.ndarray], Params] | None = None,
        max_replay: int = 4,
        version: int = 0,
    ):
        # max_replay: replaying one update regenerates N members' noise over every weight, a copy moves the
        # weights once; past a few updates behind, a copy is cheaper (tune for the interconnect).
        self.params, self.opt_state, self.version = params, opt_state, version
        self._apply_update, self._shape, self._replay = apply_update, shape, replay
        self._shape_grouped = shape_grouped
        self.max_replay = max_replay
        self._log: dict[int, LogEntry] = {}
        self.log_start = version  # the oldest version the log can bring forward
        self._lock = threading.RLock()
        self._commit_lock = threading.Lock()

    def snapshot(self) -> tuple[int, Params]:
        """(version, master params) as one consistent pair; params are immutable arrays, so this is O(1)."""
        with self._lock:
            return self.version, self.params

    def commit(self, seeds, fitness, groups=None) -> LogEntry:
        """One ES update from a cohort: shape, apply, log, publish version + 1.

        groups: each result's task batch (its task version), for shape_grouped; without either, shape()."""
        seeds, fitness = np.asarray(seeds), np.asarray(fitness, np.float32)
        if groups is not None and self._shape_grouped is not None:
            shaped = np.asarray(self._shape_grouped(fitness, np.asarray(groups)), np.float32)
        else:
            shaped = np.asarray(self._shape(fitness), np.float32)
        with self._commit_lock:  # readers (snapshot, plan, entries) are not blocked by the learner step
            params, opt_state = self._apply_update(self.params, self.opt_state, seeds, shaped)
            with self._lock:
                self.params, self.opt_state = params, opt_state
                entry = LogEntry(self.version, seeds, shaped)
                self._log[self.version] = entry
                self.version += 1
                return entry

    def entries(self, from_version: int, to_version: int) -> list[LogEntry]:
        with self._lock:
            if from_version < self.log_start or to_version > self.version:
                raise KeyError(f"log holds versions {self.log_start}..{self.version}, "
                               f"asked {from_version}..{to_version}")
            return [self._log[v] for v in range(from_version, to_version)]

    def plan(self, from_version: int | None, to_version: int) -> SyncKind:
        """How a replica at `from_version` (None: holds nothing) gets to `to_version`."""
        if from_version == to_version:
            return "none"
        with self._lock:
            replayable = (
                self._replay is not None
                and from_version is not None
                and self.log_start <= from_version < to_version <= self.version
                and to_version - from_version <= self.max_replay
            )
        return "replay" if replayable else "copy"

    def bring_up(self, params: Params, from_version: int, to_version: int) -> Params:
        """Replay the logged updates from_version -> to_version on a replica's float32 copy."""
        for e in self.entries(from_version, to_version):
            params = self._replay(params, e.seeds, e.shaped)
        return params

    def compact(self, keep_last: int = 0) -> None:
        """Forget updates older than version - keep_last (at checkpoints); replicas behind that copy."""
        with self._lock:
            self.log_start = max(self.log_start, self.version - keep_last)
            for v in [v for v in self._log if v < self.log_start]:
                del self._log[v]

    def state_dict(self) -> dict:
        """A pytree of arrays (Orbax-friendly): params, optimiser state, version and the log."""
        with self._lock:
            entries = [self._log[v] for v in range(self.log_start, self.version)]
            return {
                "version": np.int64(self.version),
                "log_start": np.int64(self.log_start),
                "params": self.params,
                "opt_state": self.opt_state,
                # An empty log gives zero-size arrays, which Orbax refuses to save: keep the log in a
                # checkpoint's JSON metadata then (it is small: N integers and N floats per update).
                "log_seeds": np.stack([e.seeds for e in entries]) if entries else np.zeros((0, 0), np.int64),
                "log_shaped": np.stack([e.shaped for e in entries]) if entries else np.zeros((0, 0), np.float32),
            }

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self.params, self.opt_state = state["params"], state["opt_state"]
            self.version, self.log_start = int(state["version"]), int(state["log_start"])
            n = self.version - self.log_start
            seeds, shaped = np.asarray(state["log_seeds"])[:n], np.asarray(state["log_shaped"], np.float32)[:n]
            if len(seeds) != n or len(shaped) != n:
                raise ValueError(f"log has {len(seeds)} entries for versions {self.log_start}..{self.version}")
            self._log = {self.log_start + i: LogEntry(self.log_start + i, s, z)
                         for i, (s, z) in enumerate(zip(seeds, shaped))}
