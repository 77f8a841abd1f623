"""Signals on the real path (a tiny random model plays generated tasks in bwrap sandboxes, in a subprocess with
2 simulated devices): a SIGTERM while episodes run drains, checkpoints, removes every sandbox and exits 0, and the
run resumes; a second signal exits at once, still leaving no sandbox or process behind."""

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from asyncres_jax import metrics
from bwrap_support import bwrap_or_skip

pytestmark = [pytest.mark.xdist_group("train_signal"), pytest.mark.bwrap, pytest.mark.slow]
REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def need_bwrap():
    bwrap_or_skip()


@pytest.fixture
def sandbox_tmp():
    """TMPDIR of the training process: sandbox uids must be able to traverse it (pytest's tmp_path is 0700)."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="asyncres-signal-"))
    d.chmod(0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def start(tmp_path, tmp, *extra) -> tuple[subprocess.Popen, pathlib.Path]:
    run = tmp_path / "run"
    env = dict(os.environ, TMPDIR=str(tmp), JAX_COMPILATION_CACHE_DIR=str(REPO / ".cache" / "jax"))
    env.pop("XLA_FLAGS", None)
    args = [sys.executable, "-m", "asyncres_jax.train", "--cpu-devices", "2", "--mesh", "2x1", f"run_dir={run}",
            "model.name=tiny", f"tasks.dataset={tmp_path / 'tasks'}", "tasks.generate_n=12",
            "episode.max_turns=2", "episode.max_new_tokens=4", "episode.context_limit=4096",
            "es.population=3", "es.tasks_per_member=2", "checkpoint.every=100", "eval.every=0", "eval.test_tasks=0",
            *extra]
    log = open(tmp_path / "log.txt", "a")
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True), run


def wait_for_sandbox(tmp_path, tmp, proc, timeout=300.0) -> None:
    end = time.monotonic() + timeout
    while not list(tmp.glob("asyncres-bwrap-*/sb-*")):
        assert proc.poll() is None, (tmp_path / "log.txt").read_text()[-3000:]
        assert time.monotonic() < end, "no sandbox started in time"
        time.sleep(0.05)


def leftovers(tmp_path, tmp) -> tuple[list, list]:
    """Sandbox folders, and live processes whose command line names a path of this test."""
    procs = []
    for p in pathlib.Path("/proc").iterdir():
        try:
            cmdline = (p / "cmdline").read_bytes().decode(errors="replace")
            if p.name.isdigit() and (str(tmp_path) in cmdline or str(tmp) in cmdline):
                procs.append(p.name)
        except OSError:
            pass
    return list(tmp.glob("asyncres-bwrap-*")), procs


def wait_for_line(tmp_path, text, timeout=60.0) -> None:
    end = time.monotonic() + timeout
    while text not in (tmp_path / "log.txt").read_text():
        assert time.monotonic() < end, f"{text!r} not logged in time"
        time.sleep(0.05)


def no_leftovers(tmp_path, tmp, timeout=10.0) -> bool:
    """True once nothing is left (processes of a killed sandbox take a moment to be reaped)."""
    end = time.monotonic() + timeout
    while leftovers(tmp_path, tmp) != ([], []):
        if time.monotonic() > end:
            print("left over:", leftovers(tmp_path, tmp))
            return False
        time.sleep(0.05)
    return True


def test_sigterm_while_episodes_run_checkpoints_cleans_up_and_resumes(tmp_path, sandbox_tmp):
    proc, run = start(tmp_path, sandbox_tmp, "es.updates=50")
    wait_for_sandbox(tmp_path, sandbox_tmp, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 0, (tmp_path / "log.txt").read_text()[-3000:]
    log = (tmp_path / "log.txt").read_text()
    assert "SIGTERM: finishing in-flight jobs" in log and "checkpoint 1 at update" in log
    assert no_leftovers(tmp_path, sandbox_tmp)
    done = len(metrics.read(run))
    assert done < 50

    proc, run = start(tmp_path, sandbox_tmp, "--resume", f"es.updates={done + 1}")
    assert proc.wait(timeout=300) == 0, (tmp_path / "log.txt").read_text()[-3000:]
    assert f"resuming {run} at update {done}" in (tmp_path / "log.txt").read_text()
    assert [r["update"] for r in metrics.read(run)] == list(range(1, done + 2))
    assert no_leftovers(tmp_path, sandbox_tmp)


def test_second_signal_exits_at_once_leaving_nothing_running(tmp_path, sandbox_tmp):
    proc, _ = start(tmp_path, sandbox_tmp, "es.updates=50")
    wait_for_sandbox(tmp_path, sandbox_tmp, proc)
    proc.send_signal(signal.SIGINT)
    wait_for_line(tmp_path, "SIGINT: finishing in-flight jobs")  # two signals at once would be seen as one
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 128 + signal.SIGINT
    assert "SIGINT again: removing sandboxes and exiting now" in (tmp_path / "log.txt").read_text()
    assert no_leftovers(tmp_path, sandbox_tmp)
