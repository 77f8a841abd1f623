"""bench sandbox: bwrap sandbox start + one command + teardown latency, and 16 parallel sandboxes' throughput.

Side by side in one run (the machine is shared, so ratios and CPU time matter more than wall times):
  bare      one minimal `bwrap --unshare-all ... true` as the same unprivileged uid (the floor)
  sandbox   BwrapBackend.start(task) + run("echo ok") + close()  (a prepared home copied, limits, clean env)
  parallel  16 threads doing sandbox cycles at once: sandboxes/s and commands/s
  grade     one grading run (pytest inside the sandbox), for scale
  compute_while_spawning
            a thread writing across --ballast-gb of this process's memory (a training process's compute) while
            sandbox commands start in a loop, relative to it alone: the way sandboxes start (setpriv + vfork)
            and, for comparison, Popen(user=...), which makes CPython fork the whole process each time
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time

from asyncres_jax.errors import UserError


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _summary(xs: list[float]) -> dict:
    return {"p50_ms": round(1e3 * _pct(xs, 0.5), 2), "p95_ms": round(1e3 * _pct(xs, 0.95), 2),
            "mean_ms": round(1e3 * statistics.fmean(xs), 2), "n": len(xs)}


class CpuMeter:
    """CPU seconds used by this process and all its descendants (sandboxes included), through a cgroup-v1
    cpuacct group when the host allows one (root); wall-clock numbers on a shared machine say little alone."""

    def __init__(self):
        self.dir = None
        root = "/sys/fs/cgroup/cpuacct"
        if os.geteuid() == 0 and os.path.isfile(f"{root}/cpuacct.usage"):
            d = f"{root}/asyncres-bench-{os.getpid()}"
            try:
                os.mkdir(d)
                with open(f"{d}/cgroup.procs", "w") as f:
                    f.write(str(os.getpid()))
                self.dir, self.root = d, root
            except OSError:
                pass

    def __call__(self) -> float | None:
        if self.dir is None:
            return None
        with open(f"{self.dir}/cpuacct.usage") as f:
            return int(f.read()) / 1e9

    def close(self) -> None:
        if self.dir is not None:
            with open(f"{self.root}/cgroup.procs", "w") as f:
                f.write(str(os.getpid()))
            os.rmdir(self.dir)
            self.dir = None


def compute_while(spawn, ballast_gb: float, seconds: float) -> dict:
    """Passes/s of a thread writing one float per page across `ballast_gb` of fresh memory, alone and while
    `spawn()` runs in a loop; with their ratio and the spawns/s."""
    import numpy as np

    ballast = np.ones(int(ballast_gb * 2**30) // 8)
    stride = 4096 // ballast.itemsize

    def passes(stop: threading.Event, out: list) -> None:
        n = 0
        while not stop.is_set():
            ballast[::stride] += 1.0
            n += 1
        out.append(n)

    def run(busy: bool) -> tuple[float, float]:
        stop, out, spawned = threading.Event(), [], 0
        th = threading.Thread(target=passes, args=(stop, out))
        t0 = time.perf_counter()
        th.start()
        while time.perf_counter() - t0 < seconds:
            if busy:
                spawn()
                spawned += 1
            else:
                time.sleep(0.01)
        stop.set()
        th.join()
        wall = time.perf_counter() - t0
        return out[0] / wall, spawned / wall

    alone, _ = run(False)
    busy, spawns = run(True)
    return {"passes_per_s_alone": round(alone, 2), "passes_per_s_spawning": round(busy, 2),
            "compute_kept": round(busy / alone, 3), "spawns_per_s": round(spawns, 1)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m asyncres_jax.bench sandbox", description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=200, help="sequential cycles per measurement")
    p.add_argument("--parallel", type=int, default=16, help="sandboxes at once for the throughput run")
    p.add_argument("--cycles", type=int, default=20, help="cycles per thread in the throughput run")
    p.add_argument("--ballast-gb", type=float, default=4.0, help="memory of the stand-in training process")
    p.add_argument("--seconds", type=float, default=5.0, help="length of each compute_while_spawning run")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if min(args.n, args.parallel, args.cycles) < 1 or args.ballast_gb <= 0 or args.seconds <= 0:
        raise UserError("--n, --parallel and --cycles must be >= 1, --ballast-gb and --seconds > 0")

    from asyncres_jax.envs import bwrap
    from asyncres_jax.envs.generator import generate
    from asyncres_jax.envs.task import load_dataset

    problem = bwrap.host_problem()
    if problem:
        raise UserError(problem)
    out: dict = {"machine": {"cpus": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2)}}
    with tempfile.TemporaryDirectory(prefix="asyncres-bench-") as tmp, bwrap.BwrapBackend() as backend:
        generate(f"{tmp}/ds", 3, seed=0)
        task = load_dataset(f"{tmp}/ds")[0]
        t0 = time.perf_counter()
        backend.template(task)
        out["prepare_task_ms"] = round(1e3 * (time.perf_counter() - t0), 1)

        uid = backend.host_uid(0)
        bare_argv = ["bwrap", "--unshare-all", "--die-with-parent", "--cap-drop", "ALL", "--ro-bind", "/usr", "/usr",
                     "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/bin", "/bin",
                     "--", "/usr/bin/true"]
        bare, total, start, run, close = [], [], [], [], []
        cpu = CpuMeter()
        cpu_bare = cpu_sandbox = 0.0
        try:
            for _ in range(args.n):  # interleaved, so both see the same machine load
                c0, t0 = cpu(), time.perf_counter()
                subprocess.run(bwrap.as_user(uid, bare_argv), stdin=subprocess.DEVNULL, capture_output=True,
                               check=True)
                bare.append(time.perf_counter() - t0)
                c1, t0 = cpu(), time.perf_counter()
                sb = backend.start(task)
                t1 = time.perf_counter()
                r = sb.run("echo ok")
                t2 = time.perf_counter()
                sb.close()
                t3, c2 = time.perf_counter(), cpu()
                if r.output != "ok\n":
                    raise RuntimeError(f"sandbox command failed: {r}")
                start.append(t1 - t0), run.append(t2 - t1), close.append(t3 - t2), total.append(t3 - t0)
                if c0 is not None:
                    cpu_bare += c1 - c0
                    cpu_sandbox += c2 - c1
        finally:
            cpu.close()
        out["bare_bwrap"] = _summary(bare)
        out["sandbox_start_command_teardown"] = _summary(total)
        if c0 is not None:  # CPU per cycle barely depends on how busy the machine is
            out["cpu_ms_per_cycle"] = {"bare_bwrap": round(1e3 * cpu_bare / args.n, 2),
                                       "sandbox": round(1e3 * cpu_sandbox / args.n, 2)}
        out["breakdown_p50_ms"] = {k: round(1e3 * _pct(v, 0.5), 2) for k, v in
                                   (("start", start), ("command", run), ("teardown", close))}
        out["sandbox_over_bare_p50"] = round(_pct(total, 0.5) / _pct(bare, 0.5), 2)

        with backend.start(task) as sb:
            grades = []
            for _ in range(5):
                t0 = time.perf_counter()
                sb.grade()
                grades.append(time.perf_counter() - t0)
        out["grade"] = _summary(grades)

        def cycles(_):
            lat = []
            for _ in range(args.cycles):
                t0 = time.perf_counter()
                with backend.start(task) as s:
                    s.run("echo ok")
                lat.append(time.perf_counter() - t0)
            return lat

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
            lats = [x for xs in pool.map(cycles, range(args.parallel)) for x in xs]
        wall = time.perf_counter() - t0

        def commands(_):
            with backend.start(task) as s:
                for _ in range(args.cycles):
                    s.run("echo ok")

        t1 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
            list(pool.map(commands, range(args.parallel)))
        wall_cmd = time.perf_counter() - t1
        out["parallel"] = {"sandboxes": args.parallel, "cycles": len(lats),
                           "sandboxes_per_s": round(len(lats) / wall, 1), "latency": _summary(lats),
                           "commands_per_s_in_live_sandboxes": round(args.parallel * args.cycles / wall_cmd, 1)}
        with backend.start(task) as sb:
            out["compute_while_spawning"] = {"sandbox_commands": compute_while(
                lambda: sb.run("true"), args.ballast_gb, args.seconds)}
        if uid is not None:  # what Popen(user=...) would cost: CPython forks the whole (ballasted) process
            fork_kw = dict(user=uid, group=uid, extra_groups=[])
            out["compute_while_spawning"]["bare_bwrap_popen_user"] = compute_while(
                lambda: subprocess.run(bare_argv, stdin=subprocess.DEVNULL, capture_output=True, check=True,
                                       **fork_kw), args.ballast_gb, args.seconds)
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=2))
    return 0
