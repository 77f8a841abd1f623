"""The bwrap sandbox isolates the agent: it runs unprivileged in /home/user, cannot write elsewhere, cannot read
the host's /root or /home, has no network (not even the host's loopback), sees no host process, and leaves no
process behind; commands time out with their whole tree; output is cleaned and capped."""

import os
import pathlib
import socket
import threading
import time
import uuid

import pytest

from asyncres_jax.envs import bwrap
from asyncres_jax.envs.task import load_task
from asyncres_jax.errors import UserError
from bwrap_support import backend  # noqa: F401  (the shared module-scoped fixture)

pytestmark = pytest.mark.bwrap


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = tmp_path_factory.mktemp("tasks") / "probe"
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "solution").mkdir()
    (d / "instruction.md").write_text("Write hello into /home/user/out.txt\n")
    (d / "task.toml").write_text("[environment]\nmemory_mb = 512\n")
    (d / "environment" / "Dockerfile").write_text(
        "FROM ubuntu:22.04\nRUN useradd -m user\nRUN printf 'seed\\n' > /home/user/seed.txt\n"
        "RUN chown -R user:user /home/user\nWORKDIR /home/user\n")
    (d / "tests" / "test_final_state.py").write_text(
        "def test_out():\n    assert open('/home/user/out.txt').read() == 'hello\\n'\n")
    (d / "solution" / "solve.sh").write_text("echo hello > /home/user/out.txt\n")
    return load_task(d)


@pytest.fixture
def sb(backend, task):
    with backend.start(task) as s:
        yield s


def _sleepers(tag: str) -> list[int]:
    """Host pids whose command line carries `tag` (processes started inside sandboxes are visible here)."""
    pids = []
    for p in pathlib.Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if tag.encode() in (p / "cmdline").read_bytes():
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids


def test_agent_is_an_unprivileged_user_in_its_home(sb):
    r = sb.run("id -u; id -un; pwd; grep CapEff /proc/self/status; touch probe")
    lines = r.output.split()
    assert r.exit_code == 0
    assert lines[:3] == ["1000", "user", "/home/user"]
    assert r.output.split("CapEff:")[1].split()[0] == "0000000000000000"
    # on the host the files belong to the sandbox's own unprivileged uid, not to root
    host_uid = (sb.folder / "home" / "probe").stat().st_uid
    assert host_uid != 0 and (os.geteuid() != 0 or host_uid >= sb.backend.config.uid_base)
    # and on the host its file's group is the uid's own group; no supplementary group of the caller is kept
    assert (sb.folder / "home" / "probe").stat().st_gid == (host_uid if os.geteuid() == 0 else os.getegid())
    saved = os.getgroups()
    if os.geteuid() == 0:
        os.setgroups([4242])  # a group the sandbox must not inherit
    try:
        groups = sb.run("grep '^Groups:' /proc/self/status").output.split()
    finally:
        if os.geteuid() == 0:
            os.setgroups(saved)
    assert groups == ["Groups:"]


@pytest.mark.parametrize("path", ["/etc/asyncres-probe", "/usr/asyncres-probe", "/asyncres-probe",
                                  "/var/tmp/asyncres-probe", "/root/asyncres-probe", "/home/asyncres-probe",
                                  "/opt/asyncres-probe"])
def test_cannot_write_outside_home(sb, path):
    r = sb.run(f"echo x > {path}")
    assert r.exit_code != 0
    assert not os.path.exists(path)


def test_home_and_tmp_are_writable_and_persist_between_commands(sb, backend, task):
    assert sb.run("echo 1 > /home/user/a && echo 2 > /tmp/b").exit_code == 0
    assert sb.run("cat /home/user/a /tmp/b").output == "1\n2\n"
    with backend.start(task) as other:  # another sandbox of the same task starts fresh
        assert other.run("cat /home/user/a /tmp/b").exit_code != 0
        assert other.run("cat seed.txt").output == "seed\n"


def test_cannot_read_host_root_or_home_or_the_task(sb, task, tmp_path):
    secret = uuid.uuid4().hex
    places = [pathlib.Path("/root") / f"asyncres-secret-{secret}", pathlib.Path("/home") / f"asyncres-{secret}" / "s"]
    try:
        for p in places:
            p.parent.mkdir(exist_ok=True)
            p.write_text(secret)
        r = sb.run(f"cat {places[0]} {places[1]}; ls -a /root /home; grep -rs {secret} /root /home /tmp")
        assert secret not in r.output.replace(f"asyncres-secret-{secret}", "").replace(f"asyncres-{secret}", "")
        assert sb.run(f"ls /root/asyncres-secret-{secret}").exit_code != 0
        # nor the task's own tests and oracle
        assert sb.run(f"cat {task.solution}").exit_code != 0
    finally:
        for p in places:
            p.unlink(missing_ok=True)
        places[1].parent.rmdir()


def test_no_network_not_even_host_loopback(sb):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(srv.accept()), daemon=True).start()
    try:
        probe = ("python3 -c \"import socket,sys\nfor a in [('127.0.0.1', %d), ('1.1.1.1', 53)]:\n"
                 "    try:\n        socket.create_connection(a, timeout=1); print('CONNECTED', a)\n"
                 "    except OSError as e:\n        print('BLOCKED', a, e)\"" % port)
        r = sb.run(probe, timeout=20)
        assert "CONNECTED" not in r.output and r.output.count("BLOCKED") == 2, r.output
        assert not accepted
        # the only interface is the sandbox's own loopback
        ifaces = [ln.split(":")[0].strip() for ln in sb.run("cat /proc/net/dev").output.splitlines()[2:]]
        assert ifaces == ["lo"]
    finally:
        srv.close()


def test_cannot_see_host_processes(sb):
    r = sb.run(f"ls /proc | grep -E '^[0-9]+$' | wc -l; kill -0 {os.getpid()} && echo SEEN; "
               f"test -e /proc/{os.getpid()}/cmdline && echo VISIBLE")
    assert int(r.output.split()[0]) < 10  # bwrap's init, the shell, ls, grep, wc
    assert "SEEN" not in r.output and "VISIBLE" not in r.output


def test_no_process_left_behind(sb):
    tag = f"asyncres{uuid.uuid4().hex[:8]}"
    r = sb.run(f"(exec -a {tag} sleep 300) & nohup bash -c 'exec -a {tag} sleep 301' >/dev/null 2>&1 & "
               f"setsid bash -c 'exec -a {tag} sleep 302' & disown -a; echo started")
    assert r.output.strip() == "started" and r.seconds < 5
    time.sleep(0.2)  # the kernel tears the namespace down right after its init exits
    assert _sleepers(tag) == []


def test_timeout_kills_the_whole_tree(sb):
    tag = f"asyncres{uuid.uuid4().hex[:8]}"
    r = sb.run(f"(exec -a {tag} sleep 300) & bash -c 'exec -a {tag} sleep 301' & echo begun; sleep 100",
               timeout=1.0)
    assert r.timed_out and r.exit_code == 124 and r.seconds < 5
    assert "begun" in r.output
    time.sleep(0.2)
    assert _sleepers(tag) == []


def test_output_is_ansi_stripped_and_capped(sb):
    assert sb.run(r"printf '\033[1;31mred\033[0m plain\n'").output == "red plain\n"
    r = sb.run("yes 0123456789 | head -c 300000")
    assert r.output.startswith("0123456789\n") and "[output truncated" in r.output
    assert len(r.output) < 50_000 + 100


def test_limits_hold_and_cannot_be_raised(sb):
    assert sb.run("ulimit -H -u unlimited").exit_code != 0
    assert sb.run("ulimit -H -f unlimited").exit_code != 0
    # the address-space limit (2 x memory_mb = 1 GiB here) stops a 4 GiB allocation
    r = sb.run("python3 -c \"b = bytearray(4 << 30)\" && echo ALLOCATED")
    assert "ALLOCATED" not in r.output and "MemoryError" in r.output


def test_close_removes_the_sandbox_state(backend, task):
    s = backend.start(task)
    s.run("echo x > f")
    folder = s.folder
    assert folder.exists()
    s.close()
    s.close()  # idempotent
    assert not folder.exists()


def test_grading_ignores_modules_planted_in_home(sb):
    """A fake pytest.py in /home/user (the grading cwd) must not be imported by the grader."""
    sb.run("printf 'import sys\\nprint(\"1 passed in 0.01s\")\\nsys.exit(0)\\n' > pytest.py; mkdir -p "
           ".local/lib/python3.11/site-packages && cp pytest.py .local/lib/python3.11/site-packages/")
    g = sb.grade()
    assert g.reward == 0 and g.total == 1


def test_missing_bwrap_or_user_namespaces_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(bwrap, "_HOST_CHECKED", {})
    monkeypatch.setattr(bwrap.shutil, "which", lambda name: None)
    with pytest.raises(UserError, match="bubblewrap .* not installed.*apt-get install bubblewrap"):
        bwrap.BwrapBackend()
    monkeypatch.setattr(bwrap, "_HOST_CHECKED", {})
    monkeypatch.setattr(bwrap.shutil, "which", lambda name: "/usr/bin/bwrap")
    monkeypatch.setattr(bwrap, "_run_quiet", lambda argv, **kw: bwrap.subprocess.CompletedProcess(
        argv, 1, "", "bwrap: No permissions to creating new namespace"))
    with pytest.raises(UserError, match="user namespaces"):
        bwrap.BwrapBackend()
