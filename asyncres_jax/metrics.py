"""Per-update training metrics: one JSON object per line in RUN_DIR/metrics.jsonl.

`MetricsWriter.write(record)` is the one place every update's numbers go through, so other sinks (TensorBoard,
a progress display) can be added as extra writers without touching the training loop. The line count is the
"metrics step" that checkpoints record: on resume the file is cut back to it, so updates that are redone after
a crash are not logged twice.
"""

from __future__ import annotations

import json
import math
import pathlib
import threading
from typing import Any, Iterable

import numpy as np

FILENAME = "metrics.jsonl"


def _plain(x: Any) -> Any:
    """numpy scalars/arrays and non-finite floats -> JSON-safe values (NaN/inf become null)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.ndarray):
        return _plain(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def update_record(update: int, fitness: np.ndarray, staleness: np.ndarray, metrics: Any, stats: Iterable[dict],
                  elapsed_s: float) -> dict:
    """The record of one committed ES update.

    update: the version this update published; fitness/staleness: the cohort's values; metrics: the
    coordinator's UpdateMetrics; stats: each result's JobResult.stats (summed where numeric: tokens, episodes).
    """
    fitness = np.asarray(fitness, np.float64)
    totals: dict[str, float] = {}
    for s in stats:
        for k, v in s.items():
            if isinstance(v, (int, float, np.number)) and not isinstance(v, bool):
                totals[k] = totals.get(k, 0) + v
    hist = {str(k): int(v) for k, v in metrics.staleness_hist.items()}
    return {
        "update": int(update),
        "fitness_mean": float(fitness.mean()),
        "fitness_std": float(fitness.std()),
        "fitness_min": float(fitness.min()),
        "fitness_max": float(fitness.max()),
        "staleness_hist": hist,
        "stale_fraction": float(np.mean(np.asarray(staleness) > 0)),
        "dropped": int(metrics.dropped),
        "reissued": int(metrics.reissued),
        "wasted_seconds": float(metrics.wasted_seconds),
        "utilization": float(metrics.utilization),
        "update_seconds": float(metrics.wall_seconds),
        "elapsed_seconds": float(elapsed_s),
        "tokens": int(totals.get("tokens", 0)),
        "episodes": int(totals.get("episodes", 0)),
    }


class MetricsWriter:
    """Appends records to RUN_DIR/metrics.jsonl (flushed per line); thread-safe."""

    def __init__(self, run_dir: str | pathlib.Path, step: int = 0):
        self.path = pathlib.Path(run_dir) / FILENAME
        self.step = step
        self._lock = threading.Lock()
        truncate(self.path, step)
        self._file = open(self.path, "a")

    def write(self, record: dict) -> None:
        with self._lock:
            self._file.write(json.dumps(_plain(record)) + "\n")
            self._file.flush()
            self.step += 1

    def close(self) -> None:
        with self._lock:
            self._file.close()


def truncate(path: pathlib.Path, lines: int) -> None:
    """Keep the first `lines` lines of `path` (create it empty when missing)."""
    kept = path.read_text().splitlines(keepends=True)[:lines] if path.exists() else []
    path.write_text("".join(kept))


def read(run_dir: str | pathlib.Path) -> list[dict]:
    path = pathlib.Path(run_dir) / FILENAME
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
