"""Over 300 generated tasks, in bwrap sandboxes run concurrently: the initial-state tests pass before the
episode, doing nothing scores 0, and the oracle scores 1. And a real Endless Terminals-style task directory
(uvx/curl test.sh, printf Dockerfile) runs unchanged; `tasks check --json` reports one object per task."""

import json
import pathlib
import subprocess
import sys

import pytest

from asyncres_jax.envs.check import check_tasks
from asyncres_jax.envs.generator import generate
from asyncres_jax.envs.task import load_dataset, load_task
from bwrap_support import backend  # noqa: F401  (the shared module-scoped fixture)

pytestmark = pytest.mark.bwrap
FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "et_error_summary"


def test_300_generated_tasks_initial_passes_noop_scores_0_oracle_scores_1(backend, tmp_path):
    generate(tmp_path / "ds", 300, seed=2026)
    tasks = load_dataset(tmp_path / "ds")
    assert len(tasks) == 300
    recs = list(check_tasks(backend, tasks, workers=4, oracle=True, initial=True, noop_first=True))
    bad = [r for r in recs if (r.get("initial"), r.get("noop_reward"), r["reward"]) != (1, 0, 1)]
    assert not bad, json.dumps(bad[:3], indent=1)[:6000]
    # partial credit is a real gradient: doing nothing often passes some checks, never all
    noop_partials = [r["noop_partial"] for r in recs]
    assert max(noop_partials) < 1.0 and sum(p > 0 for p in noop_partials) >= 10
    assert all(r["partial"] == 1.0 and r["total"] >= 2 for r in recs)


def test_real_endless_terminals_task_runs_unchanged(backend):
    t = load_task(FIXTURE)
    [noop] = check_tasks(backend, [t], oracle=False, initial=True)
    [oracle] = check_tasks(backend, [t], oracle=True)
    assert (noop["initial"], noop["reward"], oracle["reward"], oracle["partial"]) == (1, 0, 1, 1.0)


def test_cli_check_prints_one_json_object_per_task(tmp_path):
    generate(tmp_path / "ds", 4, seed=1)
    r = subprocess.run([sys.executable, "-m", "asyncres_jax.tasks", "check", str(tmp_path / "ds"), str(FIXTURE),
                        "--backend", "bwrap", "--oracle", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(ln) for ln in r.stdout.splitlines()]
    names = sorted(p.name for p in (tmp_path / "ds").iterdir() if p.name != "splits")
    assert [x["task"] for x in rows] == names + [FIXTURE.name]
    assert all(x["reward"] == 1 and x["partial"] == 1.0 and x["seconds"] > 0 for x in rows)
    noop = subprocess.run([sys.executable, "-m", "asyncres_jax.tasks", "check", str(FIXTURE), "--noop", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert noop.returncode == 0 and json.loads(noop.stdout)["reward"] == 0
