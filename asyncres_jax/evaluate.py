"""Held-out evaluation: success per sampling seed, the mean with a confidence interval, per family and tier.

    python -m asyncres_jax.evaluate --model smollm2-135m-instruct --split test --seeds 42 43 44 --dataset DIR
    python -m asyncres_jax.evaluate --checkpoint RUN_DIR --split test --seeds 42 43 44 [--tasks N] [--json]
    python -m asyncres_jax.evaluate --checkpoint RUN_DIR --compare BASE.json     # paired difference vs another

Protocol (the paper's): every task of the split (or its first N) is played once per sampling seed with the run's
episode settings (temperature 0.6 by default); success = mean binary reward. The mean over seeds is the mean
over all task x seed episodes.

Statistics, stated because the numbers are small:
- `ci`: 95% percentile bootstrap over TASKS (a task's seeds stay together: they are not independent draws), via
  scipy.stats.bootstrap on the per-task mean over seeds, 10,000 resamples, fixed seed. This is the interval
  to quote.
- `wilson`: the Wilson score interval over all episodes as if independent; narrower when tasks are
  heterogeneous, so it is a lower bound on the uncertainty. Per family/tier groups (few tasks) report it.
- `compare`: the paired difference on common (task, seed) episodes, a task-bootstrap CI of it, and a two-sided
  sign-flip permutation p-value over per-task differences.

In training (`attach`), the validation split is evaluated after the drain of every `eval.every` updates, the
test split before the first update (the base model) and after the last one, compared pairwise; results go to
RUN_DIR/eval.jsonl (one summary per line) and RUN_DIR/evals/SPLIT_UPDATE.json (summary plus every episode).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from typing import Any, Sequence

import numpy as np

from asyncres_jax import hostmem
from asyncres_jax.errors import UserError
from asyncres_jax.run import CONFIG_FILE, filter_tasks, log

CONFIDENCE = 0.95
RESAMPLES = 10_000
EVAL_FILE, EVAL_DIR = "eval.jsonl", "evals"


@dataclasses.dataclass(frozen=True)
class EpisodeOutcome:
    """One (task, sampling seed) episode of an evaluation."""

    task_id: str
    family: str
    difficulty: str
    seed: int
    reward: float
    partial: float
    turns: int = 0
    tokens: int = 0
    end: str = ""


# ------------------------------------------------------------------------------------------- statistics


def wilson(successes: float, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (Wilson 1927); (0, 1) when n is 0."""
    from scipy.stats import norm

    if n <= 0:
        return 0.0, 1.0
    z = float(norm.ppf(0.5 + confidence / 2))
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return float(max(0.0, centre - half)), float(min(1.0, centre + half))


def task_bootstrap_ci(per_task: np.ndarray, confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
                      seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean over tasks of `per_task` (each task's mean over its seeds)."""
    from scipy.stats import bootstrap

    x = np.asarray(per_task, np.float64)
    if x.size == 0:
        return 0.0, 1.0
    if np.all(x == x[0]):  # every resample is the same: the bootstrap interval collapses to the point
        return float(x[0]), float(x[0])
    res = bootstrap((x,), np.mean, confidence_level=confidence, n_resamples=resamples, method="percentile",
                    random_state=np.random.default_rng(seed), vectorized=True)
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def _matrix(episodes: Sequence[EpisodeOutcome], field: str = "reward") -> tuple[list[str], list[int], np.ndarray]:
    """[tasks, seeds] values (NaN where an episode is missing), tasks in first-seen order, seeds sorted."""
    tasks = list(dict.fromkeys(e.task_id for e in episodes))
    seeds = sorted({e.seed for e in episodes})
    ti, si = {t: i for i, t in enumerate(tasks)}, {s: i for i, s in enumerate(seeds)}
    m = np.full((len(tasks), len(seeds)), np.nan)
    for e in episodes:
        m[ti[e.task_id], si[e.seed]] = getattr(e, field)
    return tasks, seeds, m


def _group(episodes: Sequence[EpisodeOutcome], confidence: float) -> dict:
    rewards = np.array([e.reward for e in episodes], np.float64)
    lo, hi = wilson(float(rewards.sum()), len(rewards), confidence)
    return {"tasks": len({e.task_id for e in episodes}), "episodes": len(rewards),
            "success": float(rewards.mean()) if len(rewards) else 0.0,
            "partial": float(np.mean([e.partial for e in episodes])) if episodes else 0.0, "wilson": [lo, hi]}


def summarize(episodes: Sequence[EpisodeOutcome], confidence: float = CONFIDENCE) -> dict:
    """Success per seed, mean with task-bootstrap and Wilson intervals, per family and per difficulty."""
    if not episodes:
        raise UserError("no episodes to summarize: the evaluated split is empty")
    tasks, seeds, m = _matrix(episodes)
    per_task = np.nanmean(m, axis=1)
    rewards = np.array([e.reward for e in episodes], np.float64)
    out = {
        "tasks": len(tasks), "seeds": seeds, "episodes": len(episodes),
        "per_seed": {str(s): float(np.nanmean(m[:, j])) for j, s in enumerate(seeds)},
        "success": float(rewards.mean()),
        "ci": list(task_bootstrap_ci(per_task, confidence)),
        "ci_method": f"{confidence:.0%} percentile bootstrap over tasks ({RESAMPLES} resamples)",
        "wilson": list(wilson(float(rewards.sum()), len(rewards), confidence)),
        "partial": float(np.mean([e.partial for e in episodes])),
        "tokens": int(sum(e.tokens for e in episodes)),
        "turns_mean": float(np.mean([e.turns for e in episodes])),
    }
    for key in ("family", "difficulty"):
        groups: dict[str, list[EpisodeOutcome]] = {}
        for e in episodes:
            groups.setdefault(getattr(e, key), []).append(e)
        out[f"per_{key}"] = {g: _group(v, confidence) for g, v in sorted(groups.items())}
    return out


def paired_difference(base: Sequence[EpisodeOutcome], new: Sequence[EpisodeOutcome],
                      confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """new - base on the (task, seed) episodes both have: mean, task-bootstrap CI, sign-flip p-value."""
    a = {(e.task_id, e.seed): e.reward for e in base}
    b = {(e.task_id, e.seed): e.reward for e in new}
    common = sorted(set(a) & set(b))
    if not common:
        raise UserError("the two evaluations share no (task, seed) episodes; evaluate the same split and seeds")
    per_task: dict[str, list[float]] = {}
    for k in common:
        per_task.setdefault(k[0], []).append(b[k] - a[k])
    d = np.array([np.mean(v) for v in per_task.values()])
    return {"tasks": int(d.size), "episodes": len(common), "base": float(np.mean([a[k] for k in common])),
            "new": float(np.mean([b[k] for k in common])), **task_differences(d, confidence, resamples, seed)}


def task_differences(d: np.ndarray, confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
                     seed: int = 0) -> dict:
    """Mean of per-task paired differences `d`, its task-bootstrap CI and a two-sided sign-flip p-value."""
    d = np.asarray(d, np.float64)
    rng = np.random.default_rng(seed)
    flips = rng.choice([-1.0, 1.0], size=(resamples, d.size))
    null = np.abs((flips * d).mean(axis=1))
    p = float((1 + np.sum(null >= abs(d.mean()) - 1e-12)) / (resamples + 1))
    return {"difference": float(d.mean()), "ci": list(task_bootstrap_ci(d, confidence, resamples, seed)),
            "p_value": p, "test": "two-sided sign-flip permutation over per-task differences"}


# ------------------------------------------------------------------------------------------- running episodes


def spread(tasks: Sequence[Any], n: int) -> list:
    """The first n tasks taken round-robin over the tiers (split files list tasks tier by tier)."""
    groups: dict[str, list] = {}
    for t in tasks:
        groups.setdefault(t.difficulty, []).append(t)
    order = [g[i] for i in range(max(map(len, groups.values()), default=0)) for g in groups.values() if i < len(g)]
    return order[:n]


def run_evaluation(policy, tasks: Sequence[Any], backend, episode_cfg, seeds: Sequence[int], *,
                   batch_size: int = 64, transcripts: pathlib.Path | None = None, samples: int = 3,
                   progress: bool = True) -> list[EpisodeOutcome]:
    """Play every task once per seed (batches of `batch_size` episodes); optionally write a few transcripts.

    The sampling seed of a batch derives from the evaluation seed and the batch's first task index."""
    from tqdm import tqdm

    from asyncres_jax.rollout.episodes import format_transcript, run_episodes

    out, texts, start_errors = [], [], []
    bar = tqdm(total=len(seeds) * len(tasks), desc="evaluating", unit="episode", file=sys.stderr, leave=False,
               disable=not progress, ascii=not sys.stderr.isatty())
    for s in seeds:
        for i in range(0, len(tasks), batch_size):
            chunk = tasks[i:i + batch_size]
            for task, r in zip(chunk, run_episodes(policy, chunk, backend, episode_cfg, seed=int(s) * 1_000_003 + i)):
                if r.error is not None:  # its sandbox never started: no outcome of the policy's, left out
                    start_errors.append(f"{r.task_id}: {r.error}")
                    continue
                tokens = int(np.sum(r.tokens.generated_mask)) if r.tokens is not None else 0
                out.append(EpisodeOutcome(r.task_id, task.family, task.difficulty, int(s), float(r.reward),
                                          float(r.partial), r.turns, tokens, r.end))
                if len(texts) < samples:
                    texts.append(format_transcript(r))
            bar.update(len(chunk))
            hostmem.release_free_memory()  # the batch's buffers are free now (see hostmem)
    bar.close()
    if start_errors:
        print(f"warning: {len(start_errors)} episodes could not start and are left out of the evaluation; first: "
              f"{start_errors[0]}", file=sys.stderr)
    if transcripts is not None and texts:
        transcripts.parent.mkdir(parents=True, exist_ok=True)
        transcripts.write_text("\n\n".join(texts) + "\n")
    return out


def report(episodes: Sequence[EpisodeOutcome], **meta) -> dict:
    return {**meta, **summarize(episodes), "episodes_detail": [dataclasses.asdict(e) for e in episodes]}


def load_report(path: str | pathlib.Path) -> tuple[dict, list[EpisodeOutcome]]:
    p = pathlib.Path(path)
    if not p.is_file():
        raise UserError(f"{p} does not exist; give a JSON report written by `python -m asyncres_jax.evaluate --out`")
    try:
        data = json.loads(p.read_text())
        return data, [EpisodeOutcome(**e) for e in data["episodes_detail"]]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise UserError(f"{p} is not an evaluation report (no episodes_detail)") from None


def format_report(r: dict) -> str:
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    ci = lambda c: f"[{pct(c[0])}, {pct(c[1])}]"  # noqa: E731
    lines = [f"{r.get('split', '?')} split of {r.get('source', '?')} at update {r.get('update', '?')}: "
             f"{r['tasks']} tasks x {len(r['seeds'])} seeds",
             "  per seed: " + ", ".join(f"{s}: {pct(v)}" for s, v in r["per_seed"].items()),
             f"  success {pct(r['success'])}  95% CI {ci(r['ci'])} (bootstrap over tasks), "
             f"Wilson {ci(r['wilson'])}; partial credit {pct(r['partial'])}"]
    for key in ("per_family", "per_difficulty"):
        lines.append(f"  {key[4:]}:")
        for g, v in r[key].items():
            lines.append(f"    {g:<12} {pct(v['success']):>6} {ci(v['wilson']):>16}  partial {pct(v['partial']):>6}  "
                         f"({v['tasks']} tasks)")
    if "compare" in r:
        c = r["compare"]
        lines.append(f"  vs base: {pct(c['base'])} -> {pct(c['new'])}, difference {100 * c['difference']:+.1f} pts "
                     f"95% CI [{100 * c['ci'][0]:+.1f}, {100 * c['ci'][1]:+.1f}], p = {c['p_value']:.3f} "
                     f"({c['tasks']} tasks)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- in training


def evaluate_params(cfg, model, params, split: str, n_tasks: int, backend, *, out_dir: pathlib.Path | None = None,
                    tag: str = "", seeds: Sequence[int] | None = None) -> dict:
    """Evaluate `params` on n_tasks of a split of cfg's dataset (after the family/tier filter; tiers balanced)."""
    from asyncres_jax.envs.task import load_split
    from asyncres_jax.model.generate import Engine
    from asyncres_jax.rollout.episodes import EpisodeConfig, ModelPolicy

    tasks = spread(filter_tasks(load_split(cfg.tasks.dataset, split), cfg.tasks.families, cfg.tasks.difficulties),
                   n_tasks)
    if not tasks:
        raise UserError(f"{cfg.tasks.dataset}/splits/{split}.txt lists no tasks to evaluate")
    episode_cfg = EpisodeConfig.from_sections(cfg.episode, cfg.sandbox)
    if cfg.eval.temperature is not None:  # e.g. greedy evaluation of a policy trained with sampling (GRPO)
        episode_cfg = dataclasses.replace(episode_cfg, temperature=cfg.eval.temperature)
    engine = Engine(model, context_limit=episode_cfg.context_limit)
    t = time.monotonic()
    seeds = list(cfg.eval.seeds if seeds is None else seeds)
    sample_path = out_dir / f"{split}_{tag}_transcripts.txt" if out_dir is not None else None
    policy = ModelPolicy.from_config(engine, params, episode_cfg)
    episodes = run_evaluation(policy, tasks, backend, episode_cfg, seeds, transcripts=sample_path)
    seconds = time.monotonic() - t
    r = report(episodes, split=split, seconds=seconds, tokens_per_second=sum(e.tokens for e in episodes) / seconds,
               temperature=episode_cfg.temperature)
    return r


def rollout_layout(params, model):
    """The learner's params as the model's engine runs them on the whole mesh: masters split over "data"
    (model.sharding.learner_shardings) are brought back to the rollout layout; others are already in it."""
    from asyncres_jax.model.sharding import param_shardings
    from asyncres_jax.rollout.replicas import for_inference

    if model.mesh is None:
        return params
    return for_inference(params, param_shardings(params, model.config, model.mesh))


def attach(trainer) -> None:
    """Evaluations of a training run, drained: before the first update the validation and test splits (the
    base model), validation after every eval.every updates, and both splits after the last update; the final
    test report carries the paired comparison with the base model's."""
    cfg = trainer.cfg
    if trainer.backend is None:  # the fake environment has no tasks to evaluate
        return
    run = trainer.run_dir
    done = {(e["split"], e["update"]) for e in read_evals(run)}
    val, test = cfg.tasks.val_split, cfg.tasks.test_split

    def evaluate_now(split: str, n: int, seeds: Sequence[int]) -> None:
        version = trainer.store.version
        if (split, version) in done or n <= 0:
            return
        r = reused_base_report(cfg, run, split, seeds) if version == 0 else None
        if r is not None:
            log(f"the base model's {split} evaluation: reused from {r['reused_from']}")
        else:
            log(f"evaluating the {split} split ({n} tasks x {len(seeds)} seeds) at update {version}")
            r = evaluate_params(cfg, trainer.model, rollout_layout(trainer.store.params, trainer.model), split, n,
                                trainer.backend, out_dir=run / EVAL_DIR, tag=f"{version:05d}", seeds=seeds)
        r.update(update=version, elapsed_seconds=trainer.elapsed(), source=str(run))
        base = run / EVAL_DIR / f"{split}_00000.json"
        if version > 0 and base.is_file():
            r["compare"] = paired_difference(load_report(base)[1], [EpisodeOutcome(**e) for e in r["episodes_detail"]])
        write_eval(run, r)
        done.add((split, version))
        trainer.metrics.write_eval(r)
        log(format_report(r))

    val_seeds = cfg.eval.val_seeds or cfg.eval.seeds

    def hook(t) -> None:
        v = t.store.version
        if cfg.eval.every and (v % cfg.eval.every == 0 or v >= trainer.total_updates):
            evaluate_now(val, cfg.eval.val_tasks, val_seeds)
        if v >= trainer.total_updates:
            evaluate_now(test, cfg.eval.test_tasks, cfg.eval.seeds)

    def before(t) -> None:
        if t.store.version == 0:
            if cfg.eval.every:
                evaluate_now(val, cfg.eval.val_tasks, val_seeds)
            evaluate_now(test, cfg.eval.test_tasks, cfg.eval.seeds)

    trainer.before_run_hooks.append(before)
    trainer.drained_hooks.append(hook)


def base_eval_settings(cfg) -> dict:
    """What a base-model evaluation depends on: the model, the tasks, the episodes it plays (at the evaluation's
    temperature) and how many tasks and seeds. Two runs that agree here get the same update-0 reports."""
    from omegaconf import OmegaConf

    d = OmegaConf.to_container(OmegaConf.structured(cfg))
    episode = dict(d["episode"])
    if cfg.eval.temperature is not None:
        episode["temperature"] = cfg.eval.temperature
    keep = ("val_tasks", "test_tasks", "seeds", "val_seeds")
    return {"model": d["model"], "tasks": d["tasks"], "episode": episode, "sandbox.backend": cfg.sandbox.backend,
            "eval": {k: d["eval"][k] for k in keep}}


def reused_base_report(cfg, run_dir: pathlib.Path, split: str, seeds: Sequence[int]) -> dict | None:
    """The update-0 report of `split` from the run in eval.base_from, when there is one and it was evaluated with
    this run's settings (then it is the report this run would compute: held-out evaluation of the same base model
    is deterministic up to float ties, and the study's runs share one). None when eval.base_from is unset, is this
    run, or holds no such report yet; a UserError when its settings differ."""
    from asyncres_jax.config import load_config

    if not cfg.eval.base_from:
        return None
    src = pathlib.Path(cfg.eval.base_from)
    path = src / EVAL_DIR / f"{split}_00000.json"
    if src.resolve() == pathlib.Path(run_dir).resolve() or not path.is_file():
        return None
    ours, theirs = base_eval_settings(cfg), base_eval_settings(load_config(src / CONFIG_FILE))
    diff = [k for k in ours if ours[k] != theirs[k]]
    if diff:
        raise UserError(f"eval.base_from={src} evaluated the base model with other {', '.join(diff)} settings than "
                        "this run; point it at a run with the same settings or set eval.base_from='' to evaluate here")
    r = json.loads(path.read_text())
    if r["seeds"] != list(seeds):
        raise UserError(f"eval.base_from={src}: its {split} evaluation used seeds {r['seeds']}, this run {list(seeds)}")
    r["reused_from"] = str(src)
    return r


def write_eval(run_dir: pathlib.Path, r: dict) -> None:
    run_dir = pathlib.Path(run_dir)
    (run_dir / EVAL_DIR).mkdir(parents=True, exist_ok=True)
    (run_dir / EVAL_DIR / f"{r['split']}_{r['update']:05d}.json").write_text(json.dumps(r, indent=1))
    # every episode's reward stays in the small summary (about 30 bytes each), so that rows of a study can be
    # compared task by task from the committed eval.jsonl files alone
    summary = {k: v for k, v in r.items() if k != "episodes_detail"}
    if "episodes_detail" in r:
        summary["outcomes"] = [[e["task_id"], e["seed"], e["reward"]] for e in r["episodes_detail"]]
    with open(run_dir / EVAL_FILE, "a") as f:
        f.write(json.dumps(summary) + "\n")


def read_evals(run_dir: str | pathlib.Path) -> list[dict]:
    """Summaries in RUN_DIR/eval.jsonl; for an (update, split) evaluated twice (a resumed run), the last."""
    path = pathlib.Path(run_dir) / EVAL_FILE
    if not path.is_file():
        return []
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            rows[(r["split"], r["update"])] = r
    return sorted(rows.values(), key=lambda r: (r["split"], r["update"]))


# ------------------------------------------------------------------------------------------- the CLI


def _load(ns) -> tuple[Any, Any, Any, dict]:
    """(cfg, model, params, meta) from --checkpoint (the run's config, latest or given checkpoint) or --model."""
    from asyncres_jax.config import load_config
    from asyncres_jax.mesh import make_mesh
    from asyncres_jax.run import find_checkpoint, load_policy_model, restore_params

    mesh = make_mesh("1x1")
    if ns.checkpoint:
        run, step = find_checkpoint(pathlib.Path(ns.checkpoint))
        cfg = load_config(run / CONFIG_FILE, ns.overrides)
        model = load_policy_model(cfg.model.name, cfg.model.dtype, mesh)
        params, restored = restore_params(run, step, cfg, model)
        return cfg, model, params, {"source": str(run), "update": restored.meta["version"],
                                    "checkpoint": restored.step}
    cfg = load_config(ns.config, [f"model.name={ns.model}", *ns.overrides])
    model = load_policy_model(cfg.model.name, cfg.model.dtype, mesh)
    return cfg, model, model.params, {"source": ns.model, "update": 0}


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m asyncres_jax.evaluate",
                                description="Held-out success of a checkpoint or a base model, per seed, family "
                                            "and tier, with 95%% confidence intervals.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a run directory (latest checkpoint) or RUN_DIR/checkpoints/STEP")
    src.add_argument("--model", help="a model name, HF directory or .gguf (the base model)")
    p.add_argument("--config", help="with --model: episode/task settings from this run config "
                                    "(default: configs/smollm2_cpu.yaml when it exists)")
    p.add_argument("--split", default="test", choices=("train", "val", "test"))
    p.add_argument("--seeds", type=int, nargs="+", help="sampling seeds (default: the config's eval.seeds)")
    p.add_argument("--dataset", help="task dataset folder (default: the config's tasks.dataset)")
    p.add_argument("--tasks", type=int, help="evaluate N tasks of the split, tiers balanced (default: the config's "
                                             "eval.test_tasks / eval.val_tasks; 0 = all)")
    p.add_argument("--compare", help="a report of another evaluation (--out) to compare with, paired per episode")
    p.add_argument("--out", help="write the full report (summary and every episode) to this JSON file")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of text")
    p.add_argument("overrides", nargs="*", help="config key=value overrides, e.g. episode.temperature=0")
    ns = p.parse_args(argv)
    if ns.model and not ns.config and pathlib.Path("configs/smollm2_cpu.yaml").is_file():
        ns.config = "configs/smollm2_cpu.yaml"
    if ns.dataset:
        ns.overrides = [*ns.overrides, f"tasks.dataset={ns.dataset}"]
    if ns.tasks is not None and ns.tasks < 0:
        raise UserError(f"--tasks {ns.tasks}: give a positive number of tasks (0 = the whole split)")
    return ns


def _main(argv: list[str]) -> int:
    ns = _parse(argv)
    import jax  # noqa: F401

    from asyncres_jax.run import compilation_cache, ensure_tasks, make_backend

    compilation_cache()
    base = load_report(ns.compare)[1] if ns.compare else None
    cfg, model, params, meta = _load(ns)
    ensure_tasks(cfg)
    n = ns.tasks if ns.tasks is not None else (cfg.eval.test_tasks if ns.split == "test" else cfg.eval.val_tasks)
    backend = make_backend(cfg)
    try:
        r = evaluate_params(cfg, model, params, ns.split, n or 10**9, backend, seeds=ns.seeds)
    finally:
        backend.close()
    r.update(meta)
    if base is not None:
        r["compare"] = paired_difference(base, [EpisodeOutcome(**e) for e in r["episodes_detail"]])
    if ns.out:
        pathlib.Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(ns.out).write_text(json.dumps(r, indent=1))
    summary = {k: v for k, v in r.items() if k != "episodes_detail"}
    print(json.dumps(summary, indent=1) if ns.json else format_report(r))
    return 0


def main(argv: list[str] | None = None) -> int:
    from asyncres_jax.errors import cli_main

    return cli_main(_main)(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
