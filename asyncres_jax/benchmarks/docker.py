"""bench docker: the docker backend's image build time (cold / cached layers / cached image) and sandbox latency.

Builds (each on a private copy of the task whose Dockerfile gets a unique comment, so its cache key is new):
  cold            no layer reused (nocache): the task's apt-get/pip/useradd/printf steps all run
  new_task        the install step is cached (every task of a dataset shares it), the task's own steps after
                  it are built: the usual cost of one more task
  cached_layers   every step was built before (only the context changed): cache key, layer look-ups, tag
  cached_image    the image of this content exists (a later run, a fresh backend): hash + tag look-up
Latency, sequentially, `--repeats` times: start (container create + start), one command (`echo`), grade,
teardown (forced removal). Then `--parallel` episodes (start, command, teardown) from as many threads, with the
backend's start cap, as episodes per second.

    bash scripts/with_services.sh python -m asyncres_jax.bench docker --json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import shutil
import statistics
import tempfile
import time
import uuid

from asyncres_jax.envs import docker_backend as db
from asyncres_jax.envs.task import load_task
from asyncres_jax.errors import UserError, cli_main

FIXTURE = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "et_error_summary"


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median": round(statistics.median(xs), 4), "p90": round(xs[int(0.9 * (len(xs) - 1))], 4),
            "min": round(xs[0], 4), "n": len(xs)}


def _variant(task_dir: pathlib.Path, root: pathlib.Path, rebuild_after_install: bool) -> pathlib.Path:
    """A copy of the task with a new cache key: a unique comment, or a unique step after the first RUN (the
    install step), which makes every later step build again."""
    dst = root / f"{task_dir.name}-{uuid.uuid4().hex[:8]}"
    shutil.copytree(task_dir, dst)
    df = dst / "environment" / "Dockerfile"
    text = df.read_text()
    if rebuild_after_install:
        second_run = text.index("\nRUN ", text.index("\nRUN ") + 1)
        text = text[:second_run] + f"\nRUN echo {dst.name} >/dev/null" + text[second_run:]
    df.write_text(text + f"\n# bench {dst.name}\n")
    return dst


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def bench_builds(backend: db.DockerBackend, task_dir: pathlib.Path, root: pathlib.Path) -> tuple[dict, list[str]]:
    images = []
    cold_task = load_task(_variant(task_dir, root, True))
    with db.DockerBackend(backend.cfg, build_nocache=True, sweep=False) as cold_backend:
        cold_s, (image, cold_built) = _timed(cold_backend.image_for, cold_task)
        images.append(image)
    new_s, (image, new_built) = _timed(backend.image_for, load_task(_variant(task_dir, root, True)))
    images.append(image)
    cached_task = load_task(_variant(task_dir, root, False))
    layers_s, (image, layers_built) = _timed(backend.image_for, cached_task)
    images.append(image)
    with db.DockerBackend(backend.cfg, sweep=False) as fresh:
        image_s, (_, image_built) = _timed(fresh.image_for, cached_task)
    if (cold_built, new_built, layers_built, image_built) != (True, True, True, False):
        raise RuntimeError("the image cache did not behave: a new variant was found, or a built one rebuilt")
    memo_s, _ = _timed(backend.image_for, cached_task)
    return {"cold_s": round(cold_s, 3), "new_task_s": round(new_s, 3), "cached_layers_s": round(layers_s, 3),
            "cached_image_s": round(image_s, 4), "in_process_s": round(memo_s, 5)}, images


def bench_latency(backend: db.DockerBackend, task, repeats: int) -> dict:
    start, command, grade, teardown, total = [], [], [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sb = backend.start(task)
        t1 = time.perf_counter()
        r = sb.run("echo hello")
        t2 = time.perf_counter()
        g = sb.grade()
        t3 = time.perf_counter()
        sb.close()
        t4 = time.perf_counter()
        if r.output != "hello\n" or g.total == 0:
            raise RuntimeError(f"bench episode went wrong: {r} / {g.log[-300:]}")
        start.append(t1 - t0), command.append(t2 - t1), grade.append(t3 - t2), teardown.append(t4 - t3)
        total.append((t2 - t0) + (t4 - t3))
    return {"start": _stats(start), "command": _stats(command), "grade": _stats(grade),
            "teardown": _stats(teardown), "start_command_teardown": _stats(total)}


def bench_parallel(backend: db.DockerBackend, task, episodes: int) -> dict:
    def episode(_):
        with backend.start(task) as sb:
            return sb.run("echo hello").output

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(episodes) as pool:
        outs = list(pool.map(episode, range(episodes)))
    seconds = time.perf_counter() - t0
    if outs != ["hello\n"] * episodes:
        raise RuntimeError(f"parallel episodes went wrong: {outs}")
    return {"episodes": episodes, "max_starts": backend.cfg.max_starts, "seconds": round(seconds, 3),
            "episodes_per_s": round(episodes / seconds, 2)}


@cli_main
def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncres_jax.bench docker", description=__doc__.split("\n")[0])
    ap.add_argument("--task", default=str(FIXTURE), help="a task directory whose Dockerfile has at least two RUN "
                    "steps (default: the ET-style test fixture)")
    ap.add_argument("--repeats", type=int, default=10, help="sequential episodes for the latency figures")
    ap.add_argument("--parallel", type=int, default=8, help="episodes started at once for the throughput figure")
    ap.add_argument("--no-builds", action="store_true", help="skip the build measurements")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.parallel < 1:
        raise UserError("--repeats and --parallel must be at least 1")
    task_dir = pathlib.Path(args.task)
    task = load_task(task_dir)
    with db.DockerBackend() as backend, tempfile.TemporaryDirectory(prefix="asyncres-bench-") as tmp:
        version = backend.client.version()
        result = {"engine": f"{version.get('Components', [{}])[0].get('Name', 'engine')} {version.get('Version')}",
                  "task": task.name, "aliases": dict(backend.cfg.base_aliases)}
        first_s, _ = _timed(backend.image_for, task)
        result["first_image_for_s"] = round(first_s, 3)
        images: list[str] = []
        try:
            if not args.no_builds:
                result["build"], images = bench_builds(backend, task_dir, pathlib.Path(tmp))
            result["latency_s"] = bench_latency(backend, task, args.repeats)
            result["parallel"] = bench_parallel(backend, task, args.parallel)
        finally:
            for image in images:  # the bench's own variants; the task's image stays cached
                backend.client.images.remove(image, force=True)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            print(f"{k:20s} {v}")
    return 0
