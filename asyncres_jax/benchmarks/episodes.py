"""python -m asyncres_jax.bench episodes [--backend bwrap|docker] [--episodes 16] [--repeats 3] --json

Throughput of scripted episodes through run_episodes on a real sandbox backend: the same episodes one at a
time, then all together in one batch (sandbox starts, the commands of each turn and grading in parallel
threads). Each episode runs its task's oracle solution, two inspection commands, then says done, and is
graded, so every phase an episode has is in the time. Task environments are prepared once, before timing.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time

from asyncres_jax.errors import UserError
from asyncres_jax.rollout.episodes import EpisodeConfig, ScriptedPolicy, run_episodes

INSPECT = ("ls -la /home/user", "find /home/user -type f | head -20 | xargs wc -c")


def _backend(name: str):
    if name == "bwrap":
        from asyncres_jax.envs.bwrap import BwrapBackend

        return BwrapBackend()
    if name == "docker":
        from asyncres_jax.envs.docker_backend import DockerBackend

        return DockerBackend()
    raise UserError(f"unknown backend {name!r}; choose bwrap or docker")


def _tasks(folder: str | None, n: int, tmp: pathlib.Path):
    from asyncres_jax.envs.task import load_dataset

    if folder is None:
        from asyncres_jax.envs.generator import generate

        generate(tmp / "tasks", n=n, seed=0)
        folder = str(tmp / "tasks")
    tasks = [t for t in load_dataset(folder) if t.solution is not None]
    if not tasks:
        raise UserError(f"{folder} has no task with a solution/solve.sh; the benchmark runs each task's oracle")
    return [tasks[i % len(tasks)] for i in range(n)]


def _script(task) -> list[str]:
    return [task.solution.read_text(), *INSPECT]


def _play(backend, tasks, cfg, together: bool) -> tuple[float, list]:
    t = time.perf_counter()
    if together:
        policy = ScriptedPolicy(scripts=[_script(task) for task in tasks])
        results = run_episodes(policy, tasks, backend, cfg, seed=0)
    else:
        results = [r for task in tasks for r in run_episodes(ScriptedPolicy(_script(task)), [task], backend, cfg)]
    return time.perf_counter() - t, results


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncres_jax.bench episodes", description=__doc__)
    ap.add_argument("--backend", default="bwrap", choices=("bwrap", "docker"))
    ap.add_argument("--episodes", type=int, default=16, help="episodes per batch")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each mode (the median is reported)")
    ap.add_argument("--tasks", default=None, help="a task folder (default: freshly generated tasks)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    if args.episodes < 1 or args.repeats < 1:
        raise UserError("--episodes and --repeats must be at least 1")

    cfg = EpisodeConfig(command_timeout_s=60.0, max_workers=args.episodes)
    with tempfile.TemporaryDirectory(prefix="asyncres-bench-episodes-") as tmp, _backend(args.backend) as backend:
        tasks = _tasks(args.tasks, args.episodes, pathlib.Path(tmp))
        _play(backend, tasks, cfg, together=True)  # prepares every task's environment once (not timed)
        modes = {}
        for name, together in (("one_at_a_time", False), ("batch", True)):
            walls, results = [], []
            for _ in range(args.repeats):
                wall, results = _play(backend, tasks, cfg, together)
                walls.append(wall)
            wall = statistics.median(walls)
            commands = sum(len(r.commands) for r in results)
            modes[name] = {
                "wall_s": round(wall, 3),
                "episodes_per_s": round(len(results) / wall, 2),
                "commands_per_s": round(commands / wall, 2),
                "mean_reward": statistics.mean(r.reward for r in results),
                "median_sandbox_start_s": round(statistics.median(r.timings.sandbox_start for r in results), 4),
                "median_command_s": round(statistics.median(r.timings.commands / len(r.commands)
                                                            for r in results), 4),
                "median_grade_s": round(statistics.median(r.timings.grade for r in results), 4),
            }
    out = {
        "benchmark": "episodes", "backend": args.backend, "episodes": args.episodes, "repeats": args.repeats,
        "turns_per_episode": len(INSPECT) + 2, "commands_per_episode": len(INSPECT) + 1, **modes,
        "batch_speedup": round(modes["one_at_a_time"]["wall_s"] / modes["batch"]["wall_s"], 2),
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")
    return 0
