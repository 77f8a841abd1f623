"""Hostile commands, played as scripted episodes through run_episodes on every sandbox backend.

After each: the episode ends or goes on as specified, no process of it survives on the host (every hostile
process carries a unique marker in its command line, which we look for in /proc), no container of it is
left, and nothing outside the sandbox changed (sentinel files planted on the host are intact, nothing new
appeared where the agent tried to write). The docker backend is tested when an engine answers (always in CI).
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import threading
import time
import uuid

import pytest

from asyncres_jax.envs.sandbox import Backend
from asyncres_jax.envs.task import load_task
from asyncres_jax.rollout.episodes import EpisodeConfig, ScriptedPolicy, run_episodes

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "et_error_summary"
CFG = EpisodeConfig(command_timeout_s=2.0, max_turns=6)
ALIVE = "Command executed successfully. Output: alive\n (exit_code=0)"


def _docker_backend():
    from asyncres_jax.envs import docker_backend as db

    if not db.engine_available():
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but no Docker-API engine answers: the hostile tests must run on docker in CI")
        pytest.skip("no Docker-API engine (run under scripts/with_services.sh to include docker)")
    return db.DockerBackend()


def _bwrap_backend():
    from asyncres_jax.envs.bwrap import BwrapBackend

    return BwrapBackend()


@pytest.fixture(scope="module", params=[
    pytest.param("bwrap", marks=pytest.mark.bwrap),
    pytest.param("docker", marks=[pytest.mark.docker, pytest.mark.xdist_group("docker")]),
])
def backend(request):
    with (_bwrap_backend() if request.param == "bwrap" else _docker_backend()) as b:
        yield b


@pytest.fixture(scope="module")
def task():
    return load_task(FIXTURE)


def _fixture_files() -> dict[str, bytes]:
    return {str(p.relative_to(FIXTURE)): p.read_bytes() for p in sorted(FIXTURE.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def host():
    """Files planted outside any sandbox: a secret in the host's home (/root) and in /tmp."""
    token = uuid.uuid4().hex
    planted = {pathlib.Path(f"/root/asyncres-secret-{token}.txt"): f"root secret {token}\n",
               pathlib.Path(f"/tmp/asyncres-sentinel-{token}.txt"): f"tmp sentinel {token}\n"}
    for path, text in planted.items():
        path.write_text(text)
    fixture = _fixture_files()
    yield type("Host", (), {"token": token, "planted": planted, "fixture": fixture})
    for path in planted:
        path.unlink(missing_ok=True)


def assert_host_unchanged(host, *must_not_exist: str):
    for path, text in host.planted.items():
        assert path.read_text() == text, f"{path} changed"
    assert _fixture_files() == host.fixture, "the task folder changed"
    assert pathlib.Path("/usr/bin/bash").is_file() and pathlib.Path("/etc/passwd").is_file()
    for path in must_not_exist:
        assert not os.path.lexists(path), f"{path} appeared on the host"


def _rss_mb() -> float:
    status = pathlib.Path("/proc/self/status").read_text()
    return int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS:")).split()[1]) / 1024


def host_processes_with(marker: str) -> list[str]:
    found = []
    for proc in pathlib.Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:  # gone meanwhile
                continue
            if marker.encode() in cmdline:
                shown = cmdline.replace(b"\0", b" ").decode(errors="replace")[:120]
                found.append(f"{proc.name}: {shown}")
    return found


def assert_nothing_survives(marker: str, backend, sandboxes):
    deadline = time.monotonic() + 5  # killed processes may take a moment to be reaped
    while host_processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert host_processes_with(marker) == []
    for sb in sandboxes:  # the episode's containers are gone
        if backend.name == "docker":
            assert backend.client.containers.list(all=True, filters={"id": sb.container_id}) == []


class Recording(Backend):
    """Passes through to a backend, keeping the sandboxes it started."""

    def __init__(self, inner):
        self.inner, self.name, self.started = inner, inner.name, []

    def start(self, task):
        sb = self.inner.start(task)
        self.started.append(sb)
        if self.name == "docker":  # the check after the episode would see a live container
            assert len(self.inner.client.containers.list(all=True, filters={"id": sb.container_id})) == 1
        return sb


def play(backend, task, commands):
    recording = Recording(backend)
    [result] = run_episodes(ScriptedPolicy(commands), [task], recording, CFG, seed=0)
    assert len(recording.started) == 1
    return result, recording.started


def observations(result) -> list[str]:
    return [m["content"] for m in result.transcript[3::2]]


def marker() -> str:
    return f"asyncres-hostile-{uuid.uuid4().hex[:12]}"


def test_the_process_scan_sees_a_live_marked_process():
    seconds = f"1000.{uuid.uuid4().int % 10**9}"
    proc = subprocess.Popen(["sleep", seconds])
    try:
        deadline = time.monotonic() + 10  # until the child has exec'd sleep
        while not host_processes_with(f"sleep\0{seconds}") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(host_processes_with(f"sleep\0{seconds}")) == 1
    finally:
        proc.kill()
        proc.wait()
    assert host_processes_with(f"sleep\0{seconds}") == []


def test_fork_bomb(backend, task, host):
    mark = marker()
    # the shell stays to keep the bomb going until the command timeout kills it
    result, started = play(backend, task, [f": {mark}; bomb() {{ bomb | bomb & }}; bomb; sleep 30", "echo alive"])
    assert observations(result)[0].startswith("Command timed out after 2 seconds and was killed.")
    assert result.end == "done" and result.turns == 3 and result.graded and result.reward == 0.0
    assert observations(result)[1] == ALIVE  # the sandbox still works after the bomb
    assert_nothing_survives(mark, backend, started)
    assert_host_unchanged(host)


def test_yes_flood_is_capped_and_killed(backend, task, host):
    mark = marker()
    rss = _rss_mb()
    result, started = play(backend, task, [f"yes {mark}", "echo alive"])
    assert _rss_mb() - rss < 100  # the learner's process did not buffer the flood
    flood = observations(result)[0]
    # killed at the timeout (bwrap), or stopped once the backend's output buffer is full (docker)
    assert flood.startswith(("Command timed out after 2 seconds and was killed.", "Command failed."))
    assert f"Output: {mark}\n{mark}\n" in flood
    assert len(flood) <= CFG.output_cap + 200 and "[output truncated" in flood
    assert observations(result)[1] == ALIVE and result.end == "done"
    assert_nothing_survives(mark, backend, started)
    assert_host_unchanged(host)


def test_sleep_is_killed_at_the_command_timeout(backend, task, host):
    seconds = f"1000.{uuid.uuid4().int % 10**9}"  # a unique argument marks the process
    t = time.monotonic()
    result, started = play(backend, task, [f"sleep {seconds}", "echo alive", task.solution.read_text()])
    assert time.monotonic() - t < 60
    assert observations(result)[0].startswith("Command timed out after 2 seconds and was killed.")
    assert observations(result)[1] == ALIVE
    assert (result.end, result.reward) == ("done", 1.0)  # the episode went on and solved the task
    assert_nothing_survives(f"sleep\0{seconds}", backend, started)
    assert_host_unchanged(host)


def test_rm_rf_root(backend, task, host):
    mark = marker()
    result, started = play(backend, task, [f"rm -rf --no-preserve-root / 2>/dev/null; : {mark}; echo done-rm",
                                          "echo alive"])
    assert "done-rm" in observations(result)[0] or "timed out" in observations(result)[0]
    assert observations(result)[1] == ALIVE
    assert result.end == "done" and result.graded and result.reward == 0.0  # the log file it needed is gone
    assert_nothing_survives(mark, backend, started)
    assert_host_unchanged(host)


def test_writing_outside_home(backend, task, host):
    name = f"asyncres-escape-{uuid.uuid4().hex[:12]}"
    system = [f"/{name}", f"/etc/{name}", f"/usr/{name}", f"/opt/{name}", f"/var/{name}", f"/usr/bin/{name}"]
    command = "; ".join(f"echo x > {t} && echo wrote {t}" for t in system)
    # /root and /tmp may be the sandbox's own scratch space: writing there must not reach the host's
    command += f"; echo x > /root/{name}; echo x > /tmp/{name}; echo x > /home/{name}; true"
    result, started = play(backend, task, [command, "echo alive", task.solution.read_text()])
    obs = observations(result)[0]
    assert obs.startswith("Command executed successfully") and "wrote" not in obs  # system writes refused
    assert (result.end, result.reward) == ("done", 1.0)
    assert_nothing_survives(name, backend, started)
    assert_host_unchanged(host, *system, f"/root/{name}", f"/tmp/{name}", f"/home/{name}")


def test_reading_a_file_in_the_hosts_home(backend, task, host):
    secret = next(p for p in host.planted if p.parent == pathlib.Path("/root"))
    command = f"cat {secret}; cat /proc/1/root{secret}; ls -la /root /home; grep -rs {host.token} /root /home /tmp"
    result, started = play(backend, task, [command, "echo alive"])
    obs = observations(result)[0]
    assert obs.startswith("Command failed.") and f"root secret {host.token}" not in obs
    assert observations(result)[1] == ALIVE
    assert_nothing_survives(host.token, backend, started)
    assert_host_unchanged(host)


def test_tcp_to_the_hosts_loopback(backend, task, host):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    port, accepted, stop = server.getsockname()[1], [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        mark = marker()
        command = (f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)"
                   f".sendall(b'{mark}'); print('connected')\"; echo {mark} > /dev/tcp/127.0.0.1/{port} "
                   "&& echo connected")
        result, started = play(backend, task, [command, "echo alive"])
    finally:
        stop.set()
        thread.join()
        server.close()
    obs = observations(result)[0]
    assert obs.startswith("Command failed.") and "connected" not in obs.replace(command, "")
    assert accepted == [], "the sandbox reached a server on the host's loopback"
    assert observations(result)[1] == ALIVE
    assert_nothing_survives(mark, backend, started)
    assert_host_unchanged(host)


def test_background_process_does_not_outlive_the_episode(backend, task, host):
    seconds = f"1000.{uuid.uuid4().int % 10**9}"
    command = (f"nohup sleep {seconds} >/dev/null 2>&1 & disown; (setsid sleep {seconds} >/dev/null 2>&1 &); "
               "echo started")
    t = time.monotonic()
    result, started = play(backend, task, [command, "echo alive", task.solution.read_text()])
    assert observations(result)[0] == "Command executed successfully. Output: started\n (exit_code=0)"
    assert observations(result)[1] == ALIVE and (result.end, result.reward) == ("done", 1.0)
    assert time.monotonic() - t < 30  # the background job did not hold its command until the timeout
    assert_nothing_survives(f"sleep\0{seconds}", backend, started)
    assert_host_unchanged(host)
