"""Harbor-style tasks (tests/fixtures/harbor), run as Harbor runs them, through `tasks check` on both backends.

The fixtures: root-app (root, WORKDIR /app, a file written under ~), nonroot-user (USER builder in its own
home), multi-metric (a verifier writing reward.json with two named metrics), sibling-import (a test launching
the task's script, which imports a module next to it) and broken-build (a Dockerfile step that fails).
The oracle scores 1 and no action 0 on each; the broken one is its own error line while the others are scored.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from asyncres_jax.envs.task import load_task
from bwrap_support import backend as bwrap_backend  # noqa: F401  (module-scoped fixture)
from bwrap_support import bwrap_or_skip
from docker_support import require_engine

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "harbor"
REPO = pathlib.Path(__file__).resolve().parent.parent
SCORED = ["multi-metric", "nonroot-user", "root-app", "sibling-import"]


def check(backend: str, mode: str) -> tuple[int, dict[str, dict]]:
    """`python -m asyncres_jax.tasks check FIXTURES --backend B --oracle|--noop --json`: (exit code, records)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "asyncres_jax.tasks", "check", str(FIXTURES), "--backend", backend,
                        f"--{mode}", "--json", "--workers", "2"], capture_output=True, text=True, env=env,
                       timeout=900)
    records = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(records) == 5, r.stdout + r.stderr
    return r.returncode, {rec["task"]: rec for rec in records}


def assert_checked(code: int, records: dict[str, dict], want: int, build_error: str) -> None:
    assert code == 3  # some task could not be checked
    broken = records["broken-build"]
    assert "reward" not in broken and "fetching the toolchain failed" in broken["error"], broken
    assert build_error in broken["error"]
    for name in SCORED:
        assert "error" not in records[name] and records[name]["reward"] == want, records[name]
    assert records["multi-metric"]["rewards"] == {"format": float(want), "correctness": float(want)}
    assert records["root-app"]["rewards"] == {"reward": float(want)}


# --- bwrap ----------------------------------------------------------------------------------------------------

@pytest.mark.bwrap
@pytest.mark.parametrize("mode, want", [("oracle", 1), ("noop", 0)])
def test_bwrap_scores_the_harbor_fixtures_and_reports_the_broken_one(mode, want):
    bwrap_or_skip()
    code, records = check("bwrap", mode)
    assert_checked(code, records, want, "environment prep failed at Dockerfile line 3")


@pytest.mark.bwrap
def test_bwrap_maps_workdir_app_and_keeps_home(bwrap_backend):
    with bwrap_backend.start(load_task(FIXTURES / "root-app")) as sb:
        r = sb.run("pwd; echo $HOME; ls")
        assert r.output == "/app\n/home/user\ninventory.csv\n", r.output


ENV_PROBE = """\
import subprocess


def test_a_launched_program_sees_none_of_the_graders_variables():
    env = subprocess.run(["env"], capture_output=True, text=True).stdout
    for name in ("PYTHONSAFEPATH", "PYTHONNOUSERSITE", "PYTEST_PLUGINS", "ASYNCRES_ADDED", "PYTHONPATH"):
        assert name + "=" not in env, env
"""


@pytest.mark.bwrap
def test_the_tasks_programs_see_none_of_the_graders_variables(bwrap_backend, tmp_path):
    """The sibling import fails under the grader's PYTHONSAFEPATH: the oracle scores 1 only because what the
    tests launch runs without it (and without the rest of the grader's variables)."""
    task = load_task(FIXTURES / "sibling-import")
    with bwrap_backend.start(task) as sb:
        assert "ModuleNotFoundError" in sb.run("PYTHONSAFEPATH=1 python3 tool/convert.py --help").output
        assert sb.run(task.solution.read_text()).exit_code == 0
        g = sb.grade()
        assert (g.reward, g.passed) == (1, 2), g.log
    probe = tmp_path / "probe"
    shutil.copytree(FIXTURES / "sibling-import", probe)
    (probe / "tests" / "test_outputs.py").write_text(ENV_PROBE)
    with bwrap_backend.start(load_task(probe)) as sb:
        g = sb.grade()
    assert (g.reward, g.passed) == (1, 1), g.log


# --- docker ---------------------------------------------------------------------------------------------------

@pytest.mark.docker
@pytest.mark.xdist_group("docker")
@pytest.mark.parametrize("mode, want", [("oracle", 1), ("noop", 0)])
def test_docker_scores_the_harbor_fixtures_and_reports_the_broken_one(mode, want):
    require_engine()
    code, records = check("docker", mode)
    assert_checked(code, records, want, "building the image of task broken-build failed")


@pytest.mark.docker
@pytest.mark.xdist_group("docker")
def test_docker_runs_as_the_image_says_unless_task_toml_overrides(tmp_path):
    from asyncres_jax.envs.docker_backend import DockerBackend

    require_engine()
    override = tmp_path / "root-app-as-nobody"
    shutil.copytree(FIXTURES / "root-app", override)
    with open(override / "task.toml", "a") as f:
        f.write('user = "nobody"\nworkdir = "/tmp"\n')  # appended to the [environment] table
    with DockerBackend() as backend:
        seen = {}
        for name, path in (("root", FIXTURES / "root-app"), ("builder", FIXTURES / "nonroot-user"),
                           ("nobody", override)):
            task = load_task(path)
            with backend.start(task) as sb:
                seen[name] = sb.run("id -un; pwd; echo $HOME").output.split()
    assert seen == {"root": ["root", "/app", "/root"], "builder": ["builder", "/home/builder", "/home/builder"],
                    "nobody": ["nobody", "/tmp", "/nonexistent"]}


def test_a_check_that_breaks_anywhere_is_that_tasks_error_line():
    """Any failure while checking one task (the engine's, the sandbox's) is reported with that task; the
    others are scored."""
    from asyncres_jax.envs.check import check_tasks
    from asyncres_jax.envs.sandbox import Backend

    class Unreachable(Backend):
        name = "unreachable"

        def start(self, task):
            raise ConnectionError(f"engine went away while starting {task.name}")

    tasks = [load_task(FIXTURES / name) for name in ("root-app", "multi-metric")]
    records = list(check_tasks(Unreachable(), tasks, workers=2, oracle=True))
    assert [(r["task"], "reward" in r) for r in records] == [("root-app", False), ("multi-metric", False)]
    assert records[0]["error"] == "ConnectionError: engine went away while starting root-app"
