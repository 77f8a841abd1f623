"""Per-update training metrics: one JSON object per line in RUN_DIR/metrics.jsonl, and the sinks around it.

`MetricsWriter.write(record, samples)` is the one place every update's numbers go through:
- RUN_DIR/metrics.jsonl: the record (the line count is the "metrics step" that checkpoints record: on resume
  the file is cut back to it, so updates that are redone after a crash are not logged twice);
- RUN_DIR/tb/: TensorBoard event files (tensorboardX, no TensorFlow): train/* scalars, the staleness histogram,
  and eval/<split>/* from `write_eval`;
- a live progress bar on stderr (tqdm): update, fitness, validation success, staleness, tokens/s, where the
  update's wall clock went (the phases below) and the ETA;
- RUN_DIR/transcripts/update_NNNNN.txt: a sample of episode transcripts of the update.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import threading
from typing import Any, Iterable

import numpy as np

from asyncres_jax.rollout.episodes import PHASES as EPISODE_PHASES

FILENAME = "metrics.jsonl"
TB_DIR, TRANSCRIPTS_DIR = "tb", "transcripts"
TB_SCALARS = ("fitness_mean", "fitness_std", "fitness_min", "fitness_max", "stale_fraction", "dropped", "reissued",
              "wasted_seconds", "utilization", "update_seconds", "elapsed_seconds", "tokens", "tokens_per_second")


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


# Where an ES update's wall clock went, in seconds that add up to it (`phases` of a record). The episode phases
# (rollout.episodes.PHASES) and replica_sync (a worker bringing its replica's weights to the job's version) are
# worker-seconds of the cohort's results divided by the number of workers: with W workers, W seconds of work in a
# phase count as one second of the update's wall clock. es_step is the learner's step that ran within this update's
# wall clock (the previous cohort's: an update's clock runs from one commit to the next). waiting is the rest:
# workers idle or queued (for the learner step, for company in a batch, on dropped or failed attempts).
PHASES = EPISODE_PHASES + ("replica_sync", "es_step", "waiting")
PHASE_LABELS = dict(zip(PHASES, ("start", "prefill", "decode", "host", "cmd", "grade", "teardown", "sync", "es",
                                 "wait")))


def update_phases(stats: Iterable[dict], wall_seconds: float, num_workers: int, learner_seconds: float) -> dict:
    """Seconds per PHASES of one update's wall clock, from its results' stats (see PHASES)."""
    out = dict.fromkeys(PHASES, 0.0)
    for s in stats:
        for k, v in (s.get("phases") or {}).items():
            out[k] += v / num_workers
        out["replica_sync"] += s.get("sync_seconds", 0.0) / num_workers
    out["es_step"] = float(learner_seconds)
    out["waiting"] = max(0.0, wall_seconds - sum(out.values()))
    return out


def update_record(update: int, fitness: np.ndarray, staleness: np.ndarray, metrics: Any, stats: Iterable[dict],
                  elapsed_s: float, *, num_workers: int = 1, learner_seconds: float = 0.0,
                  task_versions: np.ndarray | None = None) -> dict:
    """The record of one committed ES update.

    update: the version this update published; fitness/staleness: the cohort's values; metrics: the
    coordinator's UpdateMetrics; stats: each result's JobResult.stats (summed where numeric: tokens, episodes);
    num_workers: the pool's worker threads; learner_seconds: the learner step within this update (see PHASES);
    task_versions: the task batch each result was played on (None: one batch).
    """
    fitness = np.asarray(fitness, np.float64)
    stats = list(stats)
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
        **batch_spread(fitness, task_versions),
        "stale_fraction": float(np.mean(np.asarray(staleness) > 0)),
        "dropped": int(metrics.dropped),
        "cancelled": int(metrics.cancelled),  # running jobs stopped because a commit made them too stale
        "reissued": int(metrics.reissued),
        "wasted_seconds": float(metrics.wasted_seconds),
        "utilization": float(metrics.utilization),
        "update_seconds": float(metrics.wall_seconds),
        "elapsed_seconds": float(elapsed_s),
        "tokens": int(totals.get("tokens", 0)),
        "episodes": int(totals.get("episodes", 0)),
        # generated tokens of the cohort per second of the update's wall clock (all workers together)
        "tokens_per_second": float(totals.get("tokens", 0) / metrics.wall_seconds) if metrics.wall_seconds else 0.0,
        "successes": int(totals.get("successes", 0)),
        "start_errors": int(totals.get("start_errors", 0)),  # episodes whose sandbox never started: not scored
        # prompt and observation tokens the generation engine prefilled (and the padded block cells it computed)
        "prefill_tokens": int(round(totals.get("prefill_tokens", 0))),
        "prefill_slots": int(round(totals.get("prefill_slots", 0))),
        "phases": update_phases(stats, float(metrics.wall_seconds), num_workers, learner_seconds),
    }


def batch_spread(fitness: np.ndarray, task_versions: np.ndarray | None) -> dict:
    """How many task batches a cohort's results were played on, and the mean over batches (of two results or more:
    one result has no spread) of the raw fitness std within a batch (None when no batch has two): the spread that
    the members' perturbations make, without the batches' difficulty."""
    groups = np.zeros(len(fitness), int) if task_versions is None else np.asarray(task_versions)
    stds = [float(fitness[groups == g].std()) for g in np.unique(groups) if np.sum(groups == g) > 1]
    return {"task_batches": int(len(np.unique(groups))),
            "fitness_std_within_batch": float(np.mean(stds)) if stds else None}


def phases_line(phases: dict) -> str:
    """The progress bar's detail: seconds per phase over 2% of the total (e.g. "prefill 61|decode 22|wait 3.5")."""
    total = sum(phases.values()) or 1.0
    return "|".join(f"{PHASE_LABELS.get(k, k)} {v:.{0 if v >= 10 else 1}f}" for k, v in phases.items()
                    if v >= 0.02 * total)


# progress-bar fields: name -> (record key, format); a record shows those it has (ES updates, GRPO steps)
BAR_FIELDS = {"fitness": ("fitness_mean", ".3f"), "reward": ("reward_mean", ".3f"), "stale": ("stale_fraction", ".2f"),
              "tok_s": ("tokens_per_second", ".0f")}


class MetricsWriter:
    """Appends records to RUN_DIR/metrics.jsonl (flushed per line) and feeds TensorBoard and the progress bar;
    thread-safe. total: the run's updates (for the bar and its ETA); initial: the update it starts at; unit:
    what one record is ("update" of ES, "step" of GRPO)."""

    def __init__(self, run_dir: str | pathlib.Path, step: int = 0, *, total: int | None = None, initial: int = 0,
                 tensorboard: bool = True, progress: bool = True, max_samples: int = 2, label: str = "ES updates",
                 unit: str = "update"):
        self.run_dir = pathlib.Path(run_dir)
        self.path = self.run_dir / FILENAME
        self.step, self.max_samples = step, max_samples
        self._lock = threading.Lock()
        truncate(self.path, step)
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            # purge_step drops events of updates that a resumed run redoes
            self._tb = SummaryWriter(str(self.run_dir / TB_DIR), purge_step=initial or None, flush_secs=10)
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=label, unit=unit, file=sys.stderr,
                             dynamic_ncols=True, mininterval=0, ascii=not sys.stderr.isatty())
        self._postfix: dict[str, str] = {}

    def write(self, record: dict, samples: Iterable[str | None] = ()) -> None:
        with self._lock:
            self._file.write(json.dumps(_plain(record)) + "\n")
            self._file.flush()
            self.step += 1
            update = int(record.get("update", self.step))
            if self._tb is not None:
                for k in TB_SCALARS:
                    if isinstance(record.get(k), (int, float)):
                        self._tb.add_scalar(f"train/{k}", record[k], update)
                hist = record.get("staleness_hist") or {}
                values = np.repeat([float(k) for k in hist], [int(v) for v in hist.values()])
                if values.size:
                    self._tb.add_histogram("train/staleness", values, update, bins=np.arange(-0.5, values.max() + 1))
            texts = [t for t in samples if t][: self.max_samples]
            if texts:
                folder = self.run_dir / TRANSCRIPTS_DIR
                folder.mkdir(exist_ok=True)
                (folder / f"update_{update:05d}.txt").write_text("\n\n".join(texts) + "\n")
            if self._bar is not None:
                self._postfix.update({name: f"{record[key]:{fmt}}" for name, (key, fmt) in BAR_FIELDS.items()
                                      if key in record})
                if record.get("phases"):
                    self._postfix["s"] = phases_line(record["phases"])
                self._bar.set_postfix(self._postfix, refresh=False)
                self._bar.update(update - self._bar.n)

    def write_eval(self, r: dict) -> None:
        """An evaluation summary (asyncres_jax.evaluate): eval/<split>/* scalars, and val success on the bar."""
        with self._lock:
            update, split = int(r["update"]), r["split"]
            if self._tb is not None:
                self._tb.add_scalar(f"eval/{split}/success", r["success"], update)
                self._tb.add_scalar(f"eval/{split}/ci_low", r["ci"][0], update)
                self._tb.add_scalar(f"eval/{split}/ci_high", r["ci"][1], update)
                self._tb.add_scalar(f"eval/{split}/partial", r["partial"], update)
                for fam, g in r.get("per_family", {}).items():
                    self._tb.add_scalar(f"eval/{split}/family/{fam}", g["success"], update)
                self._tb.flush()
            if self._bar is not None:
                self._postfix[split] = f"{100 * r['success']:.1f}%"
                self._bar.set_postfix(self._postfix)

    def close(self) -> None:
        with self._lock:
            self._file.close()
            if self._tb is not None:
                self._tb.close()
            if self._bar is not None:
                self._bar.close()


def truncate(path: pathlib.Path, lines: int) -> None:
    """Keep the first `lines` lines of `path` (create it empty when missing)."""
    kept = path.read_text().splitlines(keepends=True)[:lines] if path.exists() else []
    path.write_text("".join(kept))


def read(run_dir: str | pathlib.Path) -> list[dict]:
    path = pathlib.Path(run_dir) / FILENAME
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
