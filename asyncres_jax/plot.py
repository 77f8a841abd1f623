"""Learning curves and pool statistics of training runs as PNG files, and a markdown results table.

    python -m asyncres_jax.plot RUN_DIR [RUN_DIR ...] [--out DIR] [--labels A B ...] [--table FILE.md]

Reads each run's metrics.jsonl (one record per ES update) and eval.jsonl (held-out evaluations) and draws,
several runs on one chart:
    success_vs_update.png   validation success (95% CI band) and test success (CI bar) vs update
    success_vs_time.png     the same vs training wall-clock minutes (held-out evaluations excluded)
    fitness.png             cohort fitness (mean, min-max band) vs update
    staleness.png           histogram of the staleness of the accepted results, per run
    utilization.png         worker utilisation per update
--table FILE writes (and prints) a markdown table in the paper's form: the base model, then per run its updates,
rollouts, test success with its CI and per-seed values, the paired difference from the base model, first/last
validation success, training wall time (without the held-out evaluations) and tokens/s. In a FILE that has the
lines `<!-- plot --table: begin -->` and `<!-- plot --table: end -->`, only the table between them is replaced
(docs/results.md). Runs given the same label are one method trained with different seeds: one table row (the mean
over its runs, each training seed's value beside it) and one colour in the charts.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

from asyncres_jax import metrics
from asyncres_jax.errors import UserError

FILES = ("success_vs_update.png", "success_vs_time.png", "fitness.png", "staleness.png", "utilization.png")


def load_run(path: str | pathlib.Path) -> dict:
    """{'name', 'updates': [metrics records], 'evals': [eval summaries]} of one run directory."""
    from asyncres_jax.evaluate import read_evals

    run = pathlib.Path(path)
    if not run.is_dir():
        raise UserError(f"{run} is not a directory; give training run directories (they hold metrics.jsonl)")
    updates, evals = metrics.read(run), read_evals(run)
    if not updates and not evals:
        raise UserError(f"{run} holds neither {metrics.FILENAME} nor eval.jsonl; is it a training run directory?")
    return {"name": run.name, "path": run, "updates": updates, "evals": evals, "seed": _training_seed(run)}


def _training_seed(run: pathlib.Path) -> int | None:
    import yaml

    path = run / "config.yaml"
    cfg = yaml.safe_load(path.read_text()) if path.is_file() else None
    return cfg.get("seed") if isinstance(cfg, dict) else None


def groups(runs: list[dict]) -> list[tuple[str, list[dict]]]:
    """Runs by name, in order of first appearance: runs sharing a label are seeds of one method."""
    by_name: dict[str, list[dict]] = {}
    for run in runs:
        by_name.setdefault(run["name"], []).append(run)
    return list(by_name.items())


def _colors(runs: list[dict]) -> list[str]:
    index = {name: i for i, (name, _) in enumerate(groups(runs))}
    return [f"C{index[run['name']]}" for run in runs]


def _label(run: dict, runs: list[dict]) -> str:
    """The run's name, with its training seed when other runs share the name."""
    shared = sum(r["name"] == run["name"] for r in runs) > 1
    return f"{run['name']} (seed {run.get('seed')})" if shared else run["name"]


def training_seconds(run: dict, elapsed: float) -> float:
    """Wall-clock seconds of training up to `elapsed` (a run's clock), without the held-out evaluations done by
    then: runs compare by what training cost, whether or not they evaluated (or reused) the base model."""
    evals = [e.get("seconds", 0.0) for e in run["evals"]
             if not e.get("reused_from") and e.get("elapsed_seconds", 0.0) <= elapsed]
    return max(0.0, elapsed - sum(evals))


def _evals(run: dict, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rows = [e for e in run["evals"] if e["split"] == split]
    upd = np.array([e["update"] for e in rows], float)
    t = np.array([training_seconds(run, e.get("elapsed_seconds", 0.0)) / 60 for e in rows], float)
    s = np.array([e["success"] for e in rows], float)
    ci = np.array([e["ci"] for e in rows], float).reshape(-1, 2)
    return upd, t, s, ci


def _finish(fig, ax, out: pathlib.Path, plt, xlabel: str, ylabel: str, title: str, axis: str = "both") -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis=axis)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _success_chart(runs: list[dict], x: str, out: pathlib.Path, plt) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for color, run in zip(_colors(runs), runs):
        name = _label(run, runs)
        upd, t, s, ci = _evals(run, "val")
        xs = upd if x == "update" else t
        if len(s):
            ax.plot(xs, 100 * s, "o-", color=color, label=f"{name} validation")
            ax.fill_between(xs, 100 * ci[:, 0], 100 * ci[:, 1], color=color, alpha=0.15)
            partial = [100 * e.get("partial", np.nan) for e in run["evals"] if e["split"] == "val"]
            ax.plot(xs, partial, "x:", color=color, label=f"{name} validation, partial credit")
        upd, t, s, ci = _evals(run, "test")
        xs = upd if x == "update" else t
        if len(s):
            err = 100 * np.abs(ci - s[:, None]).T
            ax.errorbar(xs, 100 * s, yerr=err, fmt="s", color=color, capsize=4, label=f"{name} test")
    # a flat zero curve still gets a readable frame: success from 0, the x axis at least one unit wide
    ax.set_ylim(0, max(5.0, ax.get_ylim()[1]))
    lo, hi = ax.get_xlim()
    ax.set_xlim(min(lo, -0.5), max(hi, 1.5))
    xlabel = "ES update / GRPO step" if x == "update" else "training wall clock (minutes, evaluations excluded)"
    _finish(fig, ax, out, plt, xlabel, "held-out success (%)", "Held-out success (95% CI: bootstrap over tasks)")


def _fitness_chart(runs: list[dict], out: pathlib.Path, plt) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for color, run in zip(_colors(runs), runs):
        u = run["updates"]
        if not u:
            continue
        x = [r["update"] for r in u]
        if "fitness_mean" in u[0]:
            ax.plot(x, [r["fitness_mean"] for r in u], color=color, label=_label(run, runs))
            ax.fill_between(x, [r["fitness_min"] for r in u], [r["fitness_max"] for r in u], color=color,
                            alpha=0.15)
        elif "reward_mean" in u[0]:  # a GRPO run: the mean reward of each step's episodes
            ax.plot(x, [r["reward_mean"] for r in u], "--", color=color, label=f"{_label(run, runs)} (episode reward)")
    _finish(fig, ax, out, plt, "ES update / GRPO step", "cohort fitness (mean; band: min-max)", "Training fitness")


def staleness_counts(updates: list[dict]) -> dict[int, int]:
    """Accepted results per staleness value, summed over the run's updates."""
    total: dict[int, int] = {}
    for r in updates:
        for k, v in (r.get("staleness_hist") or {}).items():
            total[int(k)] = total.get(int(k), 0) + int(v)
    return dict(sorted(total.items()))


def _staleness_chart(runs: list[dict], out: pathlib.Path, plt) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.8 / max(1, len(runs))
    for i, (color, run) in enumerate(zip(_colors(runs), runs)):
        counts = staleness_counts(run["updates"])
        if counts:
            n = sum(counts.values())
            ax.bar(np.array(list(counts)) + (i - (len(runs) - 1) / 2) * width, [100 * v / n for v in counts.values()],
                   width=width, color=color, label=f"{_label(run, runs)} ({n})")
    ax.xaxis.get_major_locator().set_params(integer=True)
    _finish(fig, ax, out, plt, "staleness of an accepted result (updates)", "share of accepted results (%)",
            "Staleness histogram", axis="y")


def _utilization_chart(runs: list[dict], out: pathlib.Path, plt) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for color, run in zip(_colors(runs), runs):
        u = [r for r in run["updates"] if "utilization" in r]  # ES pools only
        if u:
            ax.plot([r["update"] for r in u], [100 * r["utilization"] for r in u], ".-", color=color,
                    label=f"{_label(run, runs)} (mean {100 * np.mean([r['utilization'] for r in u]):.0f}%)")
    ax.set_ylim(0, 105)
    _finish(fig, ax, out, plt, "ES update", "worker utilisation (%)", "Worker utilisation per update")


def plot(runs: list[dict], out_dir: str | pathlib.Path) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f for f in FILES]
    _success_chart(runs, "update", paths[0], plt)
    _success_chart(runs, "time", paths[1], plt)
    _fitness_chart(runs, paths[2], plt)
    _staleness_chart(runs, paths[3], plt)
    _utilization_chart(runs, paths[4], plt)
    return paths


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _success(e: dict) -> str:
    return f"{_pct(e['success'])} [{_pct(e['wilson'][0])}, {_pct(e['wilson'][1])}]"


def _seeds(e: dict) -> str:
    per = e.get("per_seed") or {}
    return " / ".join(_pct(v) for v in per.values()) if len(per) > 1 else "-"


def _run_stats(run: dict) -> dict:
    u, val = run["updates"], [e for e in run["evals"] if e["split"] == "val"]
    test = [e for e in run["evals"] if e["split"] == "test" and e["update"] > 0]
    busy = sum(r.get("update_seconds", r.get("rollout_seconds", 0) + r.get("train_seconds", 0)) for r in u)
    return {"updates": u[-1]["update"] if u else 0, "rollouts": sum(r.get("episodes", 0) for r in u),
            "test": test[-1] if test else None, "val": (val[0]["success"], val[-1]["success"]) if val else None,
            "seconds": training_seconds(run, max((r["elapsed_seconds"] for r in u), default=0.0)),
            "tokens": sum(r.get("tokens", 0) for r in u), "busy": busy}


def _row(name: str, runs: list[dict]) -> str:
    """One table row: a run, or the mean over the runs of one method (its training seeds)."""
    from asyncres_jax.evaluate import wilson

    st = [_run_stats(run) for run in runs]
    tests = [x["test"] for x in st]
    vals = [x["val"] for x in st if x["val"]]
    compares = [t.get("compare") for t in tests if t]
    rollouts = {x["rollouts"] for x in st}
    busy = sum(x["busy"] for x in st)
    first_last = (f"{_pct(np.mean([v[0] for v in vals]))} -> {_pct(np.mean([v[1] for v in vals]))}"
                  if vals else "n/a")
    if len(runs) == 1:
        t, c = tests[0], compares[0] if compares else None
        test_s, seeds = (_success(t), _seeds(t)) if t else ("n/a", "-")
        vs = f"{100 * c['difference']:+.1f} pts (p = {c['p_value']:.2f})" if c else "n/a"
    elif all(tests):
        mean = float(np.mean([t["success"] for t in tests]))
        n = [t.get("episodes", t.get("tasks", 0)) for t in tests]
        lo, hi = wilson(sum(t["success"] * k for t, k in zip(tests, n)), sum(n))
        test_s = f"{_pct(mean)} [{_pct(lo)}, {_pct(hi)}]"
        seeds = " / ".join(f"{_pct(t['success'])} (seed {run.get('seed')})" for t, run in zip(tests, runs))
        vs = "n/a"
        if compares and all(compares):
            ps = ", ".join(f"{c['p_value']:.2f}" for c in compares)
            vs = f"{100 * np.mean([c['difference'] for c in compares]):+.1f} pts (p = {ps})"
    else:
        test_s, seeds, vs = "n/a", "-", "n/a"
    return (f"| {name} | {st[0]['updates']} | {rollouts.pop() if len(rollouts) == 1 else np.mean(list(rollouts))} | "
            f"{test_s} | {seeds} | {vs} | {first_last} | {np.mean([x['seconds'] for x in st]) / 60:.1f} min | "
            f"{sum(x['tokens'] for x in st) / busy if busy else 0.0:.0f} |")


def table(runs: list[dict]) -> str:
    """One markdown row per method, in the paper's form: held-out test success after training (95% Wilson CI over
    episodes, the per-seed values), the paired difference from the base model on the same episodes, rollouts and
    training wall-clock (held-out evaluations excluded). A first row gives the base model (the update-0 test
    evaluation, shared by the runs). Runs sharing a name are one method's training seeds: its row gives their
    mean (the CI over all their episodes, the per-run paired p-values) and each seed's success."""
    lines = ["| run | updates | rollouts | test success [95% CI] | per seed | vs base (paired) | "
             "validation: first -> last | training time | tokens/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    base = next((e for run in runs for e in run["evals"] if e["split"] == "test" and e["update"] == 0), None)
    if base is not None:
        lines.append(f"| base model | 0 | 0 | {_success(base)} | {_seeds(base)} | - | - | - | - |")
    lines += [_row(name, group) for name, group in groups(runs)]
    return "\n".join(lines)


TABLE_BEGIN, TABLE_END = "<!-- plot --table: begin -->", "<!-- plot --table: end -->"


def write_table(path: pathlib.Path, md: str) -> None:
    """Write the table to `path`; in a file that already has the begin/end markers, replace only what is
    between them (so docs/results.md keeps its text around a regenerated table)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.read_text() if path.is_file() else ""
    if TABLE_BEGIN in old and TABLE_END in old:
        head, rest = old.split(TABLE_BEGIN, 1)
        path.write_text(f"{head}{TABLE_BEGIN}\n{md}\n{TABLE_END}{rest.split(TABLE_END, 1)[1]}")
    else:
        path.write_text(md + "\n")


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m asyncres_jax.plot", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="training run directories")
    p.add_argument("--out", help="folder for the PNG files (default: RUN_DIR/plots of the first run)")
    p.add_argument("--labels", nargs="+", help="a legend label per run (default: the directory names)")
    p.add_argument("--table", help="also write a markdown table of the runs to this file")
    ns = p.parse_args(argv)
    runs = [load_run(r) for r in ns.runs]
    if ns.labels:
        if len(ns.labels) != len(runs):
            raise UserError(f"--labels has {len(ns.labels)} names for {len(runs)} runs; give one per run")
        for run, label in zip(runs, ns.labels):
            run["name"] = label
    for path in plot(runs, ns.out or pathlib.Path(ns.runs[0]) / "plots"):
        print(path)
    if ns.table:
        md = table(runs)
        write_table(pathlib.Path(ns.table), md)
        print(md)
    return 0


def main(argv: list[str] | None = None) -> int:
    from asyncres_jax.errors import cli_main

    return cli_main(_main)(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
