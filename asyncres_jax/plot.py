"""Learning curves and pool statistics of training runs as PNG files, and a markdown results table.

    python -m asyncres_jax.plot RUN_DIR [RUN_DIR ...] [--out DIR] [--labels A B ...] [--table FILE.md]

Reads each run's metrics.jsonl (one record per ES update) and eval.jsonl (held-out evaluations) and draws,
several runs on one chart:
    success_vs_update.png   validation success and test success (95% Wilson CI bar) vs update
    success_vs_time.png     the same vs training wall-clock minutes (held-out evaluations excluded)
    fitness.png             cohort fitness (mean; band: the seeds' range, or one run's cohort min-max) vs update
    staleness.png           histogram of the staleness of the accepted results, per method
    utilization.png         worker utilisation per update
    phases.png              where each update's wall clock went (metrics.PHASES), a stacked bar per update, one
                            panel per run that records phases
--table FILE writes (and prints) a markdown table in the paper's form: the base model, then per run its updates,
rollouts, test success with its CI and per-seed values, the paired difference from the base model, first/last
validation success, training wall time (without the held-out evaluations) and tokens/s. In a FILE that has the
lines `<!-- plot --table: begin -->` and `<!-- plot --table: end -->`, only the table between them is replaced
(docs/results.md). Runs given the same label are one method trained with different seeds: one table row (the mean
over its runs, each training seed's value beside it) and one curve in the charts: the mean over its seeds.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

from asyncres_jax import metrics
from asyncres_jax.errors import UserError

FILES = ("success_vs_update.png", "success_vs_time.png", "fitness.png", "staleness.png", "utilization.png",
         "phases.png")


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
    """Runs by name, in order of first appearance: runs sharing a label are seeds of one method, in training-seed
    order (so a table does not depend on the order a shell glob lists their folders in)."""
    by_name: dict[str, list[dict]] = {}
    for run in runs:
        by_name.setdefault(run["name"], []).append(run)
    return [(name, sorted(group, key=_seed_order)) for name, group in by_name.items()]


def _seed_order(run: dict) -> tuple[bool, int]:
    return run.get("seed") is None, run.get("seed") or 0


def _label(name: str, runs: list[dict]) -> str:
    """A method's legend label: its name, and how many training seeds its curves average."""
    return f"{name} (mean of {len(runs)} seeds)" if len(runs) > 1 else name


def mean_over_seeds(series: list[tuple[list, list]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x, mean, min, max) over several runs' (x, y) series, at the x values every run has: seeds of one method
    share their update numbers, so the curve stays a mean of the same seeds all along."""
    common = sorted(set.intersection(*(set(x) for x, _ in series))) if series else []
    ys = np.array([[dict(zip(x, y))[c] for c in common] for x, y in series], float).reshape(len(series), -1)
    return np.array(common, float), ys.mean(0), ys.min(0), ys.max(0)


def training_seconds(run: dict, elapsed: float) -> float:
    """Wall-clock seconds of training up to `elapsed` (a run's clock), without the held-out evaluations done by
    then: runs compare by what training cost, whether or not they evaluated (or reused) the base model."""
    evals = [e.get("seconds", 0.0) for e in run["evals"]
             if not e.get("reused_from") and e.get("elapsed_seconds", 0.0) <= elapsed]
    return max(0.0, elapsed - sum(evals))


def _finish(fig, ax, out: pathlib.Path, plt, xlabel: str, ylabel: str, title: str, axis: str = "both") -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis=axis)
    # beside the axes, not on them: with a dozen curves an inside legend hides the data
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def pooled_wilson(evals: list[dict]) -> tuple[float, float]:
    """95% Wilson CI over all episodes of several evaluations (one method's seeds)."""
    from asyncres_jax.evaluate import wilson

    n = [e.get("episodes", e.get("tasks", 0)) for e in evals]
    return wilson(sum(e["success"] * k for e, k in zip(evals, n)), sum(n))


def per_task_success(evals: list[dict]) -> dict[str, float] | None:
    """Each task's success averaged over several evaluations of one split (one method's training seeds) and their
    sampling seeds, from the summaries' `outcomes`; None when a summary predates them."""
    per: dict[str, list[float]] = {}
    for e in evals:
        if "outcomes" not in e:
            return None
        for task, _, reward in e["outcomes"]:
            per.setdefault(task, []).append(reward)
    return {t: float(np.mean(v)) for t, v in per.items()} if per else None


def test_ci(evals: list[dict]) -> tuple[float, float]:
    """95% CI of a method's test success: the percentile bootstrap over tasks (one run's own, or over the per-task
    means of its seeds); the pooled Wilson CI over episodes for seeds whose summaries predate per-episode
    outcomes."""
    from asyncres_jax.evaluate import task_bootstrap_ci

    if len(evals) == 1:
        return tuple(evals[0].get("ci") or evals[0]["wilson"])
    per = per_task_success(evals)
    return task_bootstrap_ci(np.array(list(per.values()))) if per else pooled_wilson(evals)


def versus(evals: list[dict], reference: list[dict]) -> dict | None:
    """Paired difference of two methods' test success on the tasks both played: per task, the mean over the
    method's seeds minus the reference's; task-bootstrap CI and sign-flip p (evaluate.task_differences)."""
    from asyncres_jax.evaluate import task_differences

    a, b = per_task_success(evals), per_task_success(reference)
    common = sorted(set(a) & set(b)) if a and b else []
    return task_differences(np.array([a[t] - b[t] for t in common])) | {"tasks": len(common)} if common else None


def _p(p: float) -> str:
    return "< 0.001" if p < 0.001 else f"{p:.3f}" if p < 0.01 else f"{p:.2f}"


def _x(run: dict, e: dict, x: str) -> float:
    """An evaluation's place on the x axis: its update, or the run's training minutes by then."""
    return e["update"] if x == "update" else training_seconds(run, e.get("elapsed_seconds", 0.0)) / 60


def _val_points(runs: list[dict], x: str) -> np.ndarray:
    """[n, 3] (x, mean success, mean partial credit) at each update where every seed was validated; on the time
    axis at the seeds' mean time, since their clocks differ."""
    by_run = [{e["update"]: e for e in run["evals"] if e["split"] == "val"} for run in runs]
    rows = [[np.mean([_x(r, b[u], x) for r, b in zip(runs, by_run)]),
             np.mean([b[u]["success"] for b in by_run]), np.mean([b[u].get("partial", np.nan) for b in by_run])]
            for u in sorted(set.intersection(*(set(b) for b in by_run)))]
    return np.array(rows, float).reshape(-1, 3)


def _test_points(runs: list[dict], x: str) -> list[tuple[float, float, float, float]]:
    """(x, mean success, CI low, high) at each update where every seed has a test evaluation: the table's numbers
    (test_ci: the bootstrap over tasks), so the chart and docs/results.md agree."""
    by_run = [{e["update"]: e for e in run["evals"] if e["split"] == "test"} for run in runs]
    points = []
    for u in sorted(set.intersection(*(set(b) for b in by_run))):
        es = [b[u] for b in by_run]
        lo, hi = test_ci(es)
        at = float(np.mean([_x(r, e, x) for r, e in zip(runs, es)]))
        points.append((at, float(np.mean([e["success"] for e in es])), lo, hi))
    return points


def _success_chart(runs: list[dict], x: str, out: pathlib.Path, plt) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    grouped = groups(runs)
    tests = [_test_points(g, x) for _, g in grouped]
    span = max([p[0] for pts in tests for p in pts] + [1.0])
    for i, ((name, group), points) in enumerate(zip(grouped, tests)):
        color, label = f"C{i}", _label(name, group)
        val = _val_points(group, x)
        if len(val):
            ax.plot(val[:, 0], 100 * val[:, 1], "o-", color=color, label=f"{label} validation")
            ax.plot(val[:, 0], 100 * val[:, 2], "x:", color=color, label=f"{label} validation, partial credit")
        if points:
            # methods side by side, not on top of each other, at the same update
            px, ps, lo, hi = (np.array(c) for c in zip(*points))
            px = px + (i - (len(grouped) - 1) / 2) * 0.012 * span
            ax.errorbar(px, 100 * ps, yerr=100 * np.abs(np.stack([lo, hi]) - ps), fmt="s", color=color, capsize=4,
                        label=f"{label} test")
    # a flat zero curve still gets a readable frame: success from 0, the x axis at least one unit wide
    ax.set_ylim(0, max(5.0, ax.get_ylim()[1]))
    lo, hi = ax.get_xlim()
    ax.set_xlim(min(lo, -0.5), max(hi, 1.5))
    xlabel = "ES update / GRPO step" if x == "update" else "training wall clock (minutes, evaluations excluded)"
    _finish(fig, ax, out, plt, xlabel, "held-out success (%)",
            "Held-out success (test: the table's 95% CI)")


def _fitness_chart(runs: list[dict], out: pathlib.Path, plt) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (name, group) in enumerate(groups(runs)):
        color, label = f"C{i}", _label(name, group)
        if not all(run["updates"] for run in group):
            continue
        key = "fitness_mean" if "fitness_mean" in group[0]["updates"][0] else "reward_mean"  # ES or GRPO
        series = [([r["update"] for r in run["updates"]], [r.get(key, np.nan) for r in run["updates"]])
                  for run in group]
        x, mean, lo, hi = mean_over_seeds(series)
        if len(group) == 1 and key == "fitness_mean":  # one seed: the band is the cohort's spread instead
            u = group[0]["updates"]
            lo, hi = [r["fitness_min"] for r in u], [r["fitness_max"] for r in u]
        ax.plot(x, mean, "-" if key == "fitness_mean" else "--", color=color,
                label=label if key == "fitness_mean" else f"{label} (episode reward)")
        ax.fill_between(x, lo, hi, color=color, alpha=0.12)
    _finish(fig, ax, out, plt, "ES update / GRPO step", "cohort fitness (mean over seeds)",
            "Training fitness (band: the seeds' range; one seed: its cohort's min-max)")


def staleness_counts(updates: list[dict]) -> dict[int, int]:
    """Accepted results per staleness value, summed over the run's updates."""
    total: dict[int, int] = {}
    for r in updates:
        for k, v in (r.get("staleness_hist") or {}).items():
            total[int(k)] = total.get(int(k), 0) + int(v)
    return dict(sorted(total.items()))


def _staleness_chart(runs: list[dict], out: pathlib.Path, plt) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    grouped = groups(runs)
    width = 0.8 / max(1, len(grouped))
    for i, (name, group) in enumerate(grouped):
        counts = staleness_counts([r for run in group for r in run["updates"]])  # a method's seeds pooled
        if counts:
            n = sum(counts.values())
            ax.bar(np.array(sorted(counts)) + (i - (len(grouped) - 1) / 2) * width,
                   [100 * counts[k] / n for k in sorted(counts)], width=width, color=f"C{i}",
                   label=f"{name} ({n} results" + (f" of {len(group)} seeds)" if len(group) > 1 else ")"))
    ax.xaxis.get_major_locator().set_params(integer=True)
    _finish(fig, ax, out, plt, "staleness of an accepted result (updates)", "share of accepted results (%)",
            "Staleness histogram", axis="y")


def _utilization_chart(runs: list[dict], out: pathlib.Path, plt) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (name, group) in enumerate(groups(runs)):
        series = [([r["update"] for r in run["updates"] if "utilization" in r],
                   [r["utilization"] for r in run["updates"] if "utilization" in r]) for run in group]
        if all(x for x, _ in series):  # ES pools only
            x, mean, _, _ = mean_over_seeds(series)
            overall = 100 * np.mean(np.concatenate([y for _, y in series]))
            ax.plot(x, 100 * mean, ".-", color=f"C{i}", label=f"{_label(name, group)}: {overall:.0f}% overall")
    ax.set_ylim(0, 105)
    _finish(fig, ax, out, plt, "ES update", "worker utilisation (%)", "Worker utilisation per update")


def _phases_chart(runs: list[dict], out: pathlib.Path, plt) -> None:
    timed = [run for run in runs if any(r.get("phases") for r in run["updates"])]
    fig, axes = plt.subplots(max(1, len(timed)), 1, figsize=(8, 1.2 + 2.6 * max(1, len(timed))), squeeze=False)
    for ax, run in zip(axes[:, 0], timed):
        recs = [r for r in run["updates"] if r.get("phases")]
        x, bottom = [r["update"] for r in recs], np.zeros(len(recs))
        for i, k in enumerate(metrics.PHASES):
            y = np.array([r["phases"].get(k, 0.0) for r in recs])
            ax.bar(x, y, bottom=bottom, color=f"C{i}", label=k)
            bottom += y
        ax.plot(x, [r["update_seconds"] for r in recs], "k_", markersize=14, label="update wall clock")
        ax.set_title(run["name"], fontsize=9)
        ax.set_ylabel("seconds")
    if timed:
        axes[0, 0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        axes[0, 0].text(0.5, 0.5, "no run records phases", ha="center", va="center", transform=axes[0, 0].transAxes)
    axes[-1, 0].set_xlabel("ES update")
    fig.suptitle("Where each update's wall clock went")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


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
    _phases_chart(runs, paths[5], plt)
    return paths


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _success(evals: list[dict]) -> str:
    lo, hi = test_ci(evals)
    return f"{_pct(float(np.mean([e['success'] for e in evals])))} [{_pct(lo)}, {_pct(hi)}]"


def _difference(c: dict) -> str:
    return (f"{100 * c['difference']:+.1f} pts [{100 * c['ci'][0]:+.1f}, {100 * c['ci'][1]:+.1f}] "
            f"(p = {_p(c['p_value'])})")


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


def _row(name: str, runs: list[dict], reference: list[dict] | None) -> str:
    """One table row: a run, or the mean over the runs of one method (its training seeds); `reference` is the
    first method's runs, which the last column compares with (None in that method's own row)."""
    st = [_run_stats(run) for run in runs]
    tests = [x["test"] for x in st]
    vals = [x["val"] for x in st if x["val"]]
    compares = [t.get("compare") for t in tests if t]
    rollouts = {x["rollouts"] for x in st}
    busy = sum(x["busy"] for x in st)
    first_last = (f"{_pct(np.mean([v[0] for v in vals]))} -> {_pct(np.mean([v[1] for v in vals]))}"
                  if vals else "n/a")
    test_s, seeds, vs, vs_ref = "n/a", "-", "n/a", "-" if reference is None else "n/a"
    if all(tests):
        test_s = _success(tests)
        seeds = (_seeds(tests[0]) if len(runs) == 1 else
                 " / ".join(f"{_pct(t['success'])} (seed {run.get('seed')})" for t, run in zip(tests, runs)))
        if compares and all(compares):
            ps = ", ".join(_p(c["p_value"]) for c in compares)
            vs = f"{100 * np.mean([c['difference'] for c in compares]):+.1f} pts (p = {ps})"
        ref_tests = [x["test"] for x in map(_run_stats, reference or [])]
        if reference is not None and all(ref_tests) and (c := versus(tests, ref_tests)):
            vs_ref = _difference(c)
    tokens_s = sum(x["tokens"] for x in st) / busy if busy else 0.0
    return (f"| {name} | {st[0]['updates']} | {rollouts.pop() if len(rollouts) == 1 else np.mean(list(rollouts))} | "
            f"{test_s} | {seeds} | {vs} | {vs_ref} | {first_last} | "
            f"{np.mean([x['seconds'] for x in st]) / 60:.1f} min | {tokens_s:.0f} |")


def table(runs: list[dict]) -> str:
    """One markdown row per method, in the paper's form: held-out test success after training (95% CI by the
    bootstrap over tasks, the per-seed values), the paired difference from the base model on the same episodes,
    the paired difference from the first method (per task: the mean over each method's seeds; task-bootstrap CI,
    sign-flip p), rollouts and training wall-clock (held-out evaluations excluded). A first row gives the base model
    (the update-0 test evaluation, shared by the runs). Runs sharing a name are one method's training seeds: its row
    gives their mean (the CI over the per-task means of its seeds, the per-run paired p-values against the base
    model) and each seed's success."""
    grouped = groups(runs)
    first = grouped[0][0] if grouped else "-"
    lines = [f"| run | updates | rollouts | test success [95% CI] | per seed | vs base (paired) | "
             f"vs {first} (paired) | validation: first -> last | training time | tokens/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    base = next((e for run in runs for e in run["evals"] if e["split"] == "test" and e["update"] == 0), None)
    if base is not None:
        lines.append(f"| base model | 0 | 0 | {_success([base])} | {_seeds(base)} | - | - | - | - | - |")
    lines += [_row(name, group, None if k == 0 else grouped[0][1]) for k, (name, group) in enumerate(grouped)]
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
