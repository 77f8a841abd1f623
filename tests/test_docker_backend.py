"""The docker sandbox backend against a real Docker-API engine (CI: podman's service, scripts/with_services.sh).

Without an engine these tests skip, except under CI=true, where a missing engine fails them: CI must run them.
All of them run in one xdist worker (group "docker") and share one backend and one built image per task.
"""

from __future__ import annotations

import concurrent.futures
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

from asyncres_jax.envs import docker_backend as db
from asyncres_jax.envs.task import load_dataset, load_task
from asyncres_jax.errors import UserError
from docker_support import require_engine

pytestmark = [pytest.mark.docker, pytest.mark.xdist_group("docker")]

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "et_error_summary"
REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def backend():
    require_engine()
    with db.DockerBackend() as b:
        yield b


@pytest.fixture(scope="module")
def et_task():
    return load_task(FIXTURE)


def oracle(sb, task) -> None:
    r = sb.run(task.solution.read_text(), timeout=60)
    assert r.exit_code == 0 and not r.timed_out, r.output


# --- the hand-written Endless Terminals task ----------------------------------------------------------------

def test_et_task_scores_1_with_the_oracle_and_0_with_nothing(backend, et_task):
    with backend.start(et_task) as sb:
        assert sb.grade_initial_state().reward == 1
        g = sb.grade()
        assert (g.reward, g.passed, g.total) == (0, 1, 4), g.log  # test.sh ran pytest: only "log unchanged" passes
    with backend.start(et_task) as sb:
        oracle(sb, et_task)
        g = sb.grade()
        assert (g.reward, g.partial, g.total) == (1, 1.0, 4), g.log


def test_partial_credit_counts_passing_checks(backend, et_task):
    with backend.start(et_task) as sb:  # right content, but not readable by everyone
        sb.run("mkdir -p reports && printf 'billing 3\\nauth 2\\nmailer 1\\nsearch 1\\n' > reports/error_summary.txt"
               " && chmod 600 reports/error_summary.txt")
        g = sb.grade()
        assert (g.reward, g.passed, g.total) == (0, 3, 4), g.log


def test_image_is_built_once_and_found_again_by_its_content(backend, et_task):
    image_id, _ = backend.image_for(et_task)
    assert backend.image_for(et_task) == (image_id, False)
    image = backend.client.images.get(image_id)
    assert image.labels[db.LABEL] == "1" and image.labels[db.HASH_LABEL] == backend.image_key(et_task)
    with db.DockerBackend(sweep=False) as fresh:  # a new process's backend: found by tag, not rebuilt
        assert fresh.image_for(et_task) == (image_id, False)


def test_image_key_follows_the_environment_and_the_aliases(backend, et_task, tmp_path):
    copy = tmp_path / "task"
    shutil.copytree(FIXTURE, copy)
    same = load_task(copy)
    assert backend.image_key(same) == backend.image_key(et_task)  # content, not path
    (copy / "tests" / "test_final_state.py").write_text("def test_x(): pass\n")
    assert backend.image_key(load_task(copy)) == backend.image_key(et_task)  # tests are not in the image
    df = copy / "environment" / "Dockerfile"
    df.write_text(df.read_text().replace("bad password", "wrong password"))
    assert backend.image_key(load_task(copy)) != backend.image_key(et_task)
    with db.DockerBackend(sweep=False, base_aliases={"ubuntu:22.04": "other:1"}) as other:
        assert other.image_key(et_task) != backend.image_key(et_task)


# --- generated tasks ----------------------------------------------------------------------------------------

def test_generated_tasks_score_1_with_the_oracle_and_0_with_nothing(backend, tmp_path_factory):
    from asyncres_jax.envs.check import check_tasks
    from asyncres_jax.envs.generator import generate

    root = tmp_path_factory.mktemp("generated")
    generate(root, 5, seed=0)
    tasks = load_dataset(root)
    records = list(check_tasks(backend, tasks, workers=2, oracle=True, noop_first=True, initial=True))
    assert len(records) == 5
    for rec in records:  # one sandbox per task: initial-state tests, grade untouched (0), oracle, grade (1)
        assert (rec["initial"], rec["noop_reward"], rec["reward"], rec["partial"]) == (1, 0, 1, 1.0), rec


def test_a_task_with_only_a_setup_script_runs_it_as_the_user(backend, tmp_path):
    task_dir = tmp_path / "setup-only"
    shutil.copytree(FIXTURE, task_dir, ignore=shutil.ignore_patterns("Dockerfile"))
    (task_dir / "environment" / "setup.sh").write_text(
        "mkdir -p logs && printf 'x [billing] ERROR y\\n' > logs/app.log && id -un > whoami.txt\n")
    with backend.start(load_task(task_dir)) as sb:
        r = sb.run("cat whoami.txt; stat -c '%U %a' logs/app.log; pwd")
        assert r.output == "user\nuser 644\n/home/user\n", r.output


def test_concurrent_episodes_build_once_and_start_within_the_cap(tmp_path):
    require_engine()
    task_dir = tmp_path / "variant"
    shutil.copytree(FIXTURE, task_dir)
    with open(task_dir / "environment" / "Dockerfile", "a") as f:
        f.write(f"\n# {uuid.uuid4().hex}\n")  # a new cache key; every step is cached by the engine
    task = load_task(task_dir)
    with db.DockerBackend(max_starts=2, sweep=False) as b:
        in_flight, peak, lock = [0], [0], threading.Lock()
        create = b.client.api.create_container  # (client.containers is a new object on every access)

        def counting_create(*args, **kw):
            with lock:
                in_flight[0] += 1
                peak[0] = max(peak[0], in_flight[0])
            try:
                time.sleep(0.2)  # hold the slot long enough that six threads would overlap without the cap
                return create(*args, **kw)
            finally:
                with lock:
                    in_flight[0] -= 1

        b.client.api.create_container = counting_create
        builds = []
        image_for = b.image_for
        b.image_for = lambda t: builds.append(image_for(t)) or builds[-1]

        def episode(_):
            with b.start(task) as sb:
                return sb.run("echo ok").output

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            assert list(pool.map(episode, range(6))) == ["ok\n"] * 6
        assert sorted(built for _, built in builds) == [False] * 5 + [True]  # one build, five waited for it
        assert peak[0] == 2
        b.client.images.remove(builds[0][0], force=True)


def test_a_failing_dockerfile_is_one_user_error(backend, tmp_path):
    task_dir = tmp_path / "broken"
    shutil.copytree(FIXTURE, task_dir)
    (task_dir / "environment" / "Dockerfile").write_text("FROM ubuntu:22.04\nRUN echo building && false\n")
    with pytest.raises(UserError, match=r"building the image of task broken failed: .*\bbuilding\b") as e:
        backend.start(load_task(task_dir))
    assert "\n" not in str(e.value)


# --- commands -------------------------------------------------------------------------------------------------

def test_commands_run_as_the_user_in_home_with_clean_output(backend, et_task):
    with backend.start(et_task) as sb:
        r = sb.run("id -un; pwd; printf '\\033[31mred\\033[0m\\n'; echo err >&2; exit 3")
        assert r.output == "user\n/home/user\nred\nerr\n" and r.exit_code == 3 and not r.timed_out
        assert sb.run("touch /etc/x").exit_code != 0  # unprivileged
        assert sb.run("echo state > s.txt").exit_code == 0 and sb.run("cat s.txt").output == "state\n"


def test_timeouts_must_fit_the_engine_calls(backend, et_task):
    with backend.start(et_task) as sb:
        for bad in (0, -1, backend.cfg.api_timeout_s):
            with pytest.raises(UserError, match="api_timeout_s"):
                sb.run("true", timeout=bad)


def test_a_background_job_neither_holds_the_command_nor_outlives_it(backend, et_task):
    with backend.start(et_task) as sb:  # like bwrap: state persists through files, not processes
        r = sb.run("sleep 300 & echo started", timeout=60)
        assert (r.output, r.exit_code, r.timed_out) == ("started\n", 0, False)
        assert "sleep 300" not in sb.run("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").output


def test_an_output_flood_is_capped_and_runs_until_its_timeout(backend, et_task):
    with backend.start(et_task) as sb:
        r = sb.run("yes flood", timeout=1)
        assert r.timed_out and r.output.startswith("flood\nflood\n") and "[output truncated" in r.output
        assert sb.run("echo alive").output == "alive\n"


def test_timeout_kills_the_whole_process_tree(backend, et_task):
    with backend.start(et_task) as sb:
        r = sb.run("echo begin; setsid sleep 1001 & (sleep 1002 &); sh -c 'sleep 1003' & sleep 1004", timeout=2)
        assert r.timed_out and r.output.startswith("begin")
        left = sb.run("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").output
        assert not [n for n in ("1001", "1002", "1003", "1004") if f"sleep {n}" in left], left


def test_no_network_and_the_limits_are_set(backend, et_task):
    with backend.start(et_task) as sb:
        r = sb.run("ls /sys/class/net; python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), 3)\"")
        assert r.output.split("\n", 1)[0] == "lo" and r.exit_code != 0, r.output
        attrs = backend.client.api.inspect_container(sb.container_id)
        host = attrs["HostConfig"]
        assert host["NetworkMode"] == "none"
        assert host["Memory"] == et_task.memory_mb * 2**20 and host["PidsLimit"] == backend.cfg.pids_limit
        assert attrs["Config"]["Labels"][db.OWNER_LABEL] == db.owner_token()


def test_close_removes_the_container(backend, et_task):
    import docker

    sb = backend.start(et_task)
    sb.close()
    sb.close()  # idempotent
    with pytest.raises(docker.errors.NotFound):
        backend.client.api.inspect_container(sb.container_id)


# --- crashes ----------------------------------------------------------------------------------------------------

CRASHING_EPISODE = textwrap.dedent("""
    import sys
    from asyncres_jax.envs.docker_backend import DockerBackend
    from asyncres_jax.envs.task import load_dataset, load_task
    backend = DockerBackend(sweep=False)
    sb = backend.start(load_task(sys.argv[1]))
    print(sb.container_id, flush=True)
    sb.run("sleep 600", timeout=600)  # mid-episode when the process is killed
""")


def test_a_crashed_runs_containers_are_removed_at_the_next_start_up(backend, et_task):
    import docker

    backend.image_for(et_task)  # built already: the child only starts a container
    with backend.start(et_task) as live:  # a live run's container: the sweep must leave it alone
        proc = subprocess.Popen([sys.executable, "-c", CRASHING_EPISODE, str(FIXTURE)], cwd=REPO,
                                stdout=subprocess.PIPE, text=True)
        try:
            leftover = proc.stdout.readline().strip()
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert leftover, "the child did not start a container"
        assert backend.client.api.inspect_container(leftover)["State"]["Running"]
        with db.DockerBackend() as next_run:
            assert leftover in next_run.swept and live.container_id not in next_run.swept
        with pytest.raises(docker.errors.NotFound):
            backend.client.api.inspect_container(leftover)
        assert live.run("echo alive").output == "alive\n"


# --- without an engine ------------------------------------------------------------------------------------------

def test_no_engine_or_an_unknown_option_is_one_user_error(tmp_path):
    with pytest.raises(UserError, match="no Docker-API engine answers"):
        db.DockerBackend(base_url=f"unix://{tmp_path}/none.sock")
    with pytest.raises(UserError, match="unknown docker backend option.*max_startz"):
        db.DockerBackend(max_startz=3)


def test_aliases_parse_and_bad_ones_are_user_errors(monkeypatch):
    assert db.parse_aliases("ubuntu:22.04=localhost/b:1, debian:12=x") == {"ubuntu:22.04": "localhost/b:1",
                                                                          "debian:12": "x"}
    with pytest.raises(UserError, match="IMAGE=LOCAL_IMAGE"):
        db.parse_aliases("ubuntu:22.04")
    assert db.rewrite_from("FROM ubuntu:22.04 AS a\nRUN echo FROM ubuntu:22.04\nfrom --platform=x ubuntu:22.04\n",
                           {"ubuntu:22.04": "b:1"}) == (
        "FROM b:1 AS a\nRUN echo FROM ubuntu:22.04\nfrom --platform=x b:1\n")


def test_owner_tokens_tell_dead_processes_from_live_ones():
    assert not db.owner_is_gone(db.owner_token())
    proc = subprocess.Popen(["true"])
    token = db.owner_token(proc.pid)
    proc.wait()
    assert db.owner_is_gone(token)
    assert not db.owner_is_gone("another-host/1/1")  # not ours to judge
