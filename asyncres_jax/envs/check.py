"""Run a task's oracle (or nothing) in a sandbox and grade it: what `tasks check` and the property tests use."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Iterable, Iterator

from asyncres_jax.envs.sandbox import Backend
from asyncres_jax.envs.task import Task
from asyncres_jax.errors import UserError


def check_task(backend: Backend, task: Task, *, oracle: bool, initial: bool = False,
               noop_first: bool = False) -> dict:
    """One sandbox: optionally the initial-state tests, optionally a grade before acting, then the oracle
    (or nothing) and the final grade. Returns a JSON-ready record."""
    t0 = time.perf_counter()
    rec: dict = {"task": task.name}
    if oracle and task.solution is None:
        raise UserError(f"{task.path}/solution/solve.sh is missing: --oracle needs the task's oracle solution")
    with backend.start(task) as sb:
        if initial and task.initial_state_test is not None:
            g = sb.grade_initial_state()
            rec["initial"] = g.reward
            rec["initial_partial"] = round(g.partial, 4)
        if noop_first:
            g = sb.grade()
            rec["noop_reward"], rec["noop_partial"] = g.reward, round(g.partial, 4)
        if oracle:
            r = sb.run(task.solution.read_text(), timeout=task.agent_timeout_s)
            rec["oracle_exit_code"] = r.exit_code
            if r.exit_code != 0:
                rec["oracle_output"] = r.output[-2000:]
        g = sb.grade()
    rec.update(reward=g.reward, partial=round(g.partial, 4), passed=g.passed, total=g.total,
               seconds=round(time.perf_counter() - t0, 3))
    if g.rewards:
        rec["rewards"] = dict(g.rewards)
    if g.reward != int(oracle):  # the surprising outcome: keep the evidence
        rec["log"] = g.log[-3000:]
    return rec


def check_tasks(backend: Backend, tasks: Iterable[Task], *, workers: int = 8, **kw) -> Iterator[dict]:
    """check_task over many tasks on a thread pool (sandboxes are processes: threads are enough), in order."""
    tasks = list(tasks)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(_safe_check, backend, t, kw) for t in tasks]
        for f in futures:
            yield f.result()


def _safe_check(backend: Backend, task: Task, kw: dict) -> dict:
    """A task that cannot be checked (no oracle, an image that does not build, an engine error) is that task's
    error record, with no reward: it says nothing about the task's score, and the others are still checked."""
    t0 = time.perf_counter()
    try:
        return check_task(backend, task, **kw)
    except UserError as e:
        error = str(e)
    except Exception as e:  # the engine's or the sandbox's own failures: reported, not fatal
        error = f"{type(e).__name__}: {' '.join(str(e).split())}"
    return {"task": task.name, "error": error, "seconds": round(time.perf_counter() - t0, 3)}
