"""The `docker` sandbox backend: task images built from their own Dockerfiles, run by any Docker-API engine.

Works against Docker itself or podman's Docker-compatible service (what CI runs), through the `docker` SDK
and DOCKER_HOST. Each task's environment/ folder becomes one image, built once and found again by a hash of
its contents (tagged localhost/asyncres-env:HASH). A sandbox is one container of that image: no network,
memory and pids limits. As in Harbor, the agent's commands, the oracle and the verifier run as the image's
USER (root when the Dockerfile names none), in its WORKDIR, with the image's environment (HOME from the
user's account), unless task.toml's [environment] user/workdir say otherwise. Generated tasks keep the Endless
Terminals convention (an unprivileged `user` in /home/user) by writing USER/WORKDIR/ENV in their Dockerfiles.
A task whose image cannot be built or whose container cannot be started raises SandboxStartError, naming it.

Offline machines: `base_aliases` rewrites FROM lines before building (e.g. ubuntu:22.04 ->
localhost/asyncres-base:bookworm, the Debian image scripts/setup_system.sh makes with debootstrap). Rewriting
inside our own build context, rather than tagging a Debian image as ubuntu:22.04, leaves the engine's global
namespace alone (another project on the same Docker asking for ubuntu:22.04 still gets Ubuntu) and makes
the alias part of the cache key.

Clean-up: every container and image carries the label `asyncres=1`; containers also carry their owner
(host, pid, process start time). Constructing a backend removes containers whose owner process on this host
is gone, i.e. the leftovers of a crashed run, and leaves live runs alone (pytest-xdist workers share an
engine).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import pathlib
import re
import socket
import tarfile
import tempfile
import threading
import time
import uuid
import weakref
from typing import TYPE_CHECKING, Mapping

from asyncres_jax.envs.grading import TESTS_DIR, grade_script, parse_grade, write_offline_shims
from asyncres_jax.envs.sandbox import Backend, CommandResult, Grade, Sandbox, SandboxStartError, clean_output
from asyncres_jax.errors import UserError

if TYPE_CHECKING:
    import docker

    from asyncres_jax.envs.task import Task

LABEL = "asyncres"  # every container and image this project creates: asyncres=1
OWNER_LABEL = "asyncres.owner"  # containers: "HOST/PID/STARTTIME" of the process that started them
HASH_LABEL = "asyncres.env-hash"  # images: the cache key of the environment/ folder they were built from
IMAGE_REPO = "localhost/asyncres-env"
BASE_IMAGE = "localhost/asyncres-base:bookworm"  # what scripts/setup_system.sh builds
ALIASES_ENV = "ASYNCRES_DOCKER_BASE_ALIASES"  # "ubuntu:22.04=localhost/asyncres-base:bookworm,..."
DEFAULT_COMMAND_TIMEOUT_S = 60.0
RUN_DIR = "/run/asyncres"  # a small tmpfs per container: the grading shims
LOGS_DIR = "/logs/verifier"  # a small tmpfs per container, writable by whoever the verifier runs as
SHIMS_DIR = f"{RUN_DIR}/shims"
KEEP_BYTES = 200_000  # command output read back from the container; clean_output caps it further
GRADE_KEEP_BYTES = 4_000_000  # grading output must keep pytest's summary and the marker at the end

# Runs one command ($2) as `bash -c` under `timeout -s KILL` ($1 seconds), which kills its process group on
# time-out. Every process of the command inherits the marker $4 in its environment; when the command's shell
# ends (or is killed), every process still carrying the marker is killed too, including those that left the
# process group (setsid, double fork): like the bwrap backend, nothing a command starts outlives it, and no
# background job can hold the exec's output open. Only bash builtins run after the command, so a pids limit
# exhausted by a fork bomb does not stop the clean-up. The output is read until EOF but only its first $3
# bytes are kept (a `yes` flood runs, capped, until its time-out).
_WRAPPER = r"""
kill_marked() {
  local round d e found
  for round in 1 2 3 4 5 6 7 8 9 10; do
    found=0
    for d in /proc/[0-9]*; do
      while IFS= read -r -d '' e; do
        if [[ $e == "ASYNCRES_CMD=$1" ]]; then kill -9 "${d#/proc/}" 2>/dev/null; found=1; break; fi
      done 2>/dev/null <"$d/environ"
    done
    ((found)) || return 0
  done
}
(ASYNCRES_CMD="$4" timeout -s KILL "$1" bash -c "$2" </dev/null 2>&1; rc=$?; kill_marked "$4"; exit $rc) \
  | { head -c "$3"; cat >/dev/null; }
exit "${PIPESTATUS[0]}"
"""


def aliases_from_env() -> dict[str, str]:
    """Base-image aliases from $ASYNCRES_DOCKER_BASE_ALIASES ("FROM_IMAGE=LOCAL_IMAGE,...")."""
    return parse_aliases(os.environ.get(ALIASES_ENV, ""))


def parse_aliases(text: str) -> dict[str, str]:
    aliases = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        src, sep, dst = item.partition("=")
        if not sep or not src.strip() or not dst.strip():
            raise UserError(f"base-image alias {item!r} is not IMAGE=LOCAL_IMAGE (e.g. "
                            f"ubuntu:22.04={BASE_IMAGE}); fix ${ALIASES_ENV}")
        aliases[src.strip()] = dst.strip()
    return aliases


@dataclasses.dataclass(frozen=True)
class DockerConfig:
    base_url: str | None = None  # None: $DOCKER_HOST, else the engine's default socket
    base_aliases: Mapping[str, str] = dataclasses.field(default_factory=aliases_from_env)
    user: str | None = None  # None: task.toml's [environment] user, else the image's USER (root if none)
    workdir: str | None = None  # None: task.toml's [environment] workdir, else the image's WORKDIR
    command_timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S  # when run() is given no timeout
    memory_mb: int | None = None  # None: the task's memory_mb (task.toml)
    pids_limit: int = 512
    run_tmpfs_mb: int = 16  # /run/asyncres; counts against the memory limit
    max_builds: int = 2  # concurrent image builds
    max_starts: int = 4  # concurrent container starts and removals (the engine's slowest calls)
    build_network: str = "host"  # builds may reach package registries; running containers get none
    build_nocache: bool = False  # True: reuse no layer of earlier builds (cold-build measurements)
    api_timeout_s: float = 900.0  # socket timeout of engine calls; must exceed any command timeout
    sweep: bool = True  # remove leftover containers of dead runs when the backend starts


def rewrite_from(dockerfile: str, aliases: Mapping[str, str]) -> str:
    """Replace the images of FROM lines that `aliases` names (stage names and --platform are kept)."""
    if not aliases:
        return dockerfile

    def sub(m: re.Match) -> str:
        return m.group(1) + aliases.get(m.group(2), m.group(2))

    return re.sub(r"(?im)^(\s*FROM\s+(?:--\S+\s+)*)(\S+)", sub, dockerfile)


def _synth_dockerfile() -> str:
    """A Dockerfile for a task that only has environment/setup.sh: like the bwrap backend, it runs as the user
    in /home/user (and so do the episodes), on the Ubuntu base with python3 and pytest for grading."""
    return ("FROM ubuntu:22.04\n"
            "RUN python3 -c 'import pytest' 2>/dev/null || "
            "(apt-get update && apt-get install -y python3 python3-pytest)\n"
            "RUN useradd -m -s /bin/bash user || true\n"
            "COPY . /tmp/asyncres-env\n"
            "USER user\n"
            "WORKDIR /home/user\n"
            "RUN bash /tmp/asyncres-env/setup.sh\n"
            "USER root\n"
            "RUN rm -rf /tmp/asyncres-env\n"
            "USER user\n"
            "ENV HOME=/home/user\n")


def _context_files(env_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in env_dir.rglob("*") if (p.is_file() or p.is_symlink()) and "__pycache__" not in p.parts)


def context_tar(env_dir: pathlib.Path, dockerfile: str) -> bytes:
    """The build context: environment/ with the (rewritten) Dockerfile; deterministic (no mtimes)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in _context_files(env_dir):
            rel = p.relative_to(env_dir).as_posix()
            if rel == "Dockerfile":
                continue
            info = tar.gettarinfo(str(p), arcname=rel)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if info.isfile():
                with open(p, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
        data = dockerfile.encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _tar_dir(src: pathlib.Path, arc_root: str) -> bytes:
    """`src` as a tar rooted at `arc_root`, owned by root and readable by all (the verifier may not be root)."""
    def readable(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid, info.gid, info.uname, info.gname = 0, 0, "", ""
        info.mode |= 0o555 if info.isdir() else 0o444
        return info

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(str(src), arcname=arc_root, filter=readable)
    return buf.getvalue()


def _proc_start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (field 22 of /proc/PID/stat), or None if there is no such process."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after "(comm)" start at field 3


def owner_token(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}/{pid}/{_proc_start_time(pid)}"


def owner_is_gone(token: str) -> bool:
    """True when `token` names a process on this host that no longer runs (pid reuse is caught by start time)."""
    host, _, rest = token.partition("/")
    pid, _, start = rest.partition("/")
    if host != socket.gethostname() or not pid.isdigit():
        return False  # another machine's run (a shared engine): not ours to judge
    return _proc_start_time(int(pid)) != start


def connect(cfg: DockerConfig | None = None) -> "docker.DockerClient":
    """A client for the engine at cfg.base_url / $DOCKER_HOST; a UserError (one line) if none answers."""
    import docker

    cfg = cfg or DockerConfig()
    where = cfg.base_url or os.environ.get("DOCKER_HOST") or "the default socket"
    client = None
    try:
        kw = dict(timeout=int(cfg.api_timeout_s), max_pool_size=max(10, 2 * cfg.max_starts + cfg.max_builds))
        client = docker.DockerClient(base_url=cfg.base_url, **kw) if cfg.base_url else docker.from_env(**kw)
        client.ping()
    except Exception as e:  # the SDK raises several unrelated types for "nothing there"
        if client is not None:
            client.close()
        raise UserError(f"no Docker-API engine answers at {where} ({type(e).__name__}); start Docker, or "
                        "podman's service (bash scripts/with_services.sh CMD), and set DOCKER_HOST") from None
    return client


def engine_available(base_url: str | None = None) -> bool:
    try:
        connect(DockerConfig(base_url=base_url, base_aliases={})).close()
        return True
    except UserError:
        return False


class DockerSandbox(Sandbox):
    """One container for one episode; run() and grade() are exec calls into it."""

    def __init__(self, backend: "DockerBackend", task: "Task", container_id: str, workdir: str):
        self._backend, self.task, self.container_id = backend, task, container_id
        self.workdir = workdir  # where commands start and the verifier runs
        self._api = backend.client.api
        self._closed = False

    def _exec(self, argv: list[str], user: str = "", env: Mapping[str, str] | None = None) -> tuple[bytes, bytes, int]:
        """`user` "" is the container's user (the task's); the engine sets HOME from that user's account."""
        ex = self._api.exec_create(self.container_id, argv, user=user, environment=dict(env or {}))
        out, err = self._api.exec_start(ex["Id"], demux=True)
        rc = self._api.exec_inspect(ex["Id"])["ExitCode"]
        return out or b"", err or b"", -1 if rc is None else int(rc)

    def _run_wrapped(self, command: str, timeout: float, keep_bytes: int) -> tuple[bytes, int, bool, float]:
        if self._closed:
            raise RuntimeError("run() on a closed sandbox")
        limit = self._backend.cfg.api_timeout_s - 30  # the engine call must outlast the command
        if not 0 < timeout <= limit:
            raise UserError(f"timeout {timeout:g} s is not in (0, {limit:g}] s; give a positive timeout, or raise "
                            "the docker backend's api_timeout_s")
        t0 = time.monotonic()
        out, _, rc = self._exec(["bash", "-c", _WRAPPER, "asyncres", f"{timeout:.3f}", command, str(keep_bytes),
                                 uuid.uuid4().hex])
        seconds = time.monotonic() - t0
        # `timeout -s KILL` dies with its process group: 137 after the full time means it fired.
        timed_out = rc == 137 and seconds >= timeout
        return out, rc, timed_out, seconds

    def run(self, command: str, timeout: float | None = None) -> CommandResult:
        timeout = self._backend.cfg.command_timeout_s if timeout is None else float(timeout)
        out, rc, timed_out, seconds = self._run_wrapped(command, timeout, KEEP_BYTES)
        return CommandResult(output=clean_output(out), exit_code=rc, timed_out=timed_out, seconds=seconds)

    def put_dir(self, src: pathlib.Path, dest: str) -> None:
        """Copy the host folder `src` to the absolute path `dest` in the container (owned by root)."""
        parent, name = dest.rstrip("/").rsplit("/", 1)
        self._exec(["rm", "-rf", dest], "root")
        if not self._api.put_archive(self.container_id, parent or "/", _tar_dir(src, name)):
            raise RuntimeError(f"could not copy {src} into the container at {dest}")

    def _grade(self, tests: pathlib.Path, script: str) -> Grade:
        """Tests at /tests (put_archive), the offline stand-ins for uv/curl/pip, then the shared script as the
        task's user in its workdir (as Harbor runs a task's verifier)."""
        self.put_dir(tests, TESTS_DIR)
        self.put_dir(self._backend.shims_dir, SHIMS_DIR)
        out, _, _, _ = self._run_wrapped(script, self.task.verifier_timeout_s, GRADE_KEEP_BYTES)
        return parse_grade(clean_output(out, cap=GRADE_KEEP_BYTES))

    def grade(self) -> Grade:
        return self._grade(self.task.tests_dir, grade_script(workdir=self.workdir, shims_dir=SHIMS_DIR))

    def grade_initial_state(self) -> Grade:
        """Run environment/test_initial_state.py against the current state (reward 1 when it passes)."""
        if self.task.initial_state_test is None:
            raise UserError(f"{self.task.path}/environment/test_initial_state.py does not exist")
        return self._grade(self.task.environment_dir, grade_script(
            workdir=self.workdir, shims_dir=SHIMS_DIR, test_file="test_initial_state.py",
            use_test_sh=False))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._backend._remove(self.container_id)


class DockerBackend(Backend):
    """Builds task images (cached by content) and starts one container per sandbox. Thread-safe."""

    name = "docker"

    def __init__(self, cfg: DockerConfig | None = None, **overrides):
        unknown = set(overrides) - {f.name for f in dataclasses.fields(DockerConfig)}
        if unknown:
            raise UserError(f"unknown docker backend option(s) {', '.join(sorted(unknown))}; the options are: "
                            f"{', '.join(f.name for f in dataclasses.fields(DockerConfig))}")
        self.cfg = dataclasses.replace(cfg or DockerConfig(), **overrides)
        self.client = connect(self.cfg)
        self._build_sem = threading.BoundedSemaphore(self.cfg.max_builds)
        self._start_sem = threading.BoundedSemaphore(self.cfg.max_starts)
        self._lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}
        self._images: dict[str, str] = {}  # cache key -> image id
        self._live: set[str] = set()  # container ids this backend started and has not removed
        self._owner = owner_token()
        self._shims = tempfile.TemporaryDirectory(prefix="asyncres-shims-")
        self.shims_dir = write_offline_shims(self._shims.name)
        self.swept = self.sweep() if self.cfg.sweep else []
        # also runs at interpreter exit (weakref.finalize's atexit): a backend never closed still cleans up
        self._finalizer = weakref.finalize(self, DockerBackend._close_all, self.client, self._live, self._shims)

    # --- images ---------------------------------------------------------------------------------------------

    def _dockerfile(self, task: "Task") -> str:
        text = task.dockerfile.read_text() if task.dockerfile else _synth_dockerfile()
        return rewrite_from(text, self.cfg.base_aliases)

    def _base_ids(self, dockerfile: str) -> list[str]:
        """Ids of the FROM images present locally: a rebuilt base invalidates the images built on it."""
        import docker

        ids = []
        for ref in re.findall(r"(?im)^\s*FROM\s+(?:--\S+\s+)*(\S+)", dockerfile):
            try:
                ids.append(self.client.images.get(ref).id)
            except docker.errors.ImageNotFound:
                ids.append(ref)
        return ids

    def image_key(self, task: "Task") -> str:
        """sha256 of the build context (rewritten Dockerfile included) and of the local FROM images."""
        dockerfile = self._dockerfile(task)
        h = hashlib.sha256()
        for p in _context_files(task.environment_dir):
            rel = p.relative_to(task.environment_dir).as_posix()
            if rel == "Dockerfile":
                continue
            h.update(f"{rel}\0{os.access(p, os.X_OK)}\0".encode())
            h.update(os.readlink(p).encode() if p.is_symlink() else p.read_bytes())
            h.update(b"\0")
        h.update(b"Dockerfile\0" + dockerfile.encode() + b"\0")
        for image_id in self._base_ids(dockerfile):
            h.update(image_id.encode() + b"\0")
        return h.hexdigest()

    def image_for(self, task: "Task") -> tuple[str, bool]:
        """(image id, built now) of the task's environment: found by its key, else built once."""
        import docker

        key = self.image_key(task)
        with self._lock:
            if key in self._images:
                return self._images[key], False
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:  # one build per key even when many episodes of one task start at once
            if key in self._images:
                return self._images[key], False
            tag = f"{IMAGE_REPO}:{key[:24]}"
            built = False
            try:
                image = self.client.images.get(tag)
                if image.labels.get(HASH_LABEL) != key:
                    raise docker.errors.ImageNotFound(tag)
            except docker.errors.ImageNotFound:
                image, built = self._build(task, tag, key), True
            with self._lock:
                self._images[key] = image.id
            return image.id, built

    def _build(self, task: "Task", tag: str, key: str):
        import docker

        ctx = context_tar(task.environment_dir, self._dockerfile(task))
        with self._build_sem:
            try:
                image, _ = self.client.images.build(
                    fileobj=io.BytesIO(ctx), custom_context=True, tag=tag, rm=True, forcerm=True,
                    nocache=self.cfg.build_nocache, network_mode=self.cfg.build_network,
                    labels={LABEL: "1", HASH_LABEL: key, "asyncres.task": task.name})
            except docker.errors.BuildError as e:
                tail = " | ".join(str(x.get("stream", x.get("error", ""))).strip() for x in list(e.build_log)[-4:])
                msg = " ".join(str(e.msg).split())
                raise SandboxStartError(f"building the image of task {task.name} failed: {msg}; last output: "
                                        f"{' '.join(tail[-400:].split())}; fix {task.environment_dir}/Dockerfile "
                                        f"(or set base-image aliases in ${ALIASES_ENV} offline)") from None
            except docker.errors.APIError as e:
                raise SandboxStartError(f"building the image of task {task.name} failed: "
                                        f"{' '.join(str(e.explanation or e).split())}") from None
        return image

    # --- containers -----------------------------------------------------------------------------------------

    def start(self, task: "Task") -> DockerSandbox:
        """A running container of the task's image; SandboxStartError (one line, naming the task) when the image
        cannot be built or the container cannot be created or started."""
        try:
            return self._start(task)
        except SandboxStartError:
            raise
        except Exception as e:  # the engine's errors, or none answering: this task's error, not the run's end
            import docker

            why = (e.explanation or str(e)) if isinstance(e, docker.errors.APIError) else f"{type(e).__name__}: {e}"
            raise SandboxStartError(f"starting the container of task {task.name} failed: "
                                    f"{' '.join(str(why).split())[:600]}") from None

    def _start(self, task: "Task") -> DockerSandbox:
        image_id, _ = self.image_for(task)
        cfg = self.cfg
        memory_mb = cfg.memory_mb or task.memory_mb
        user, workdir = cfg.user or task.user, cfg.workdir or task.workdir  # None: the image's
        with self._start_sem:
            container = self.client.containers.create(
                image_id, entrypoint=["sleep", "infinity"], command=[], init=True, user=user or "",
                network_mode="none", mem_limit=f"{memory_mb}m", memswap_limit=f"{memory_mb}m",
                pids_limit=cfg.pids_limit, nano_cpus=int(task.cpus * 1e9), working_dir=workdir,
                tmpfs={RUN_DIR: f"size={cfg.run_tmpfs_mb}m,mode=1777", LOGS_DIR: f"size={cfg.run_tmpfs_mb}m,mode=1777"},
                name=f"asyncres-{uuid.uuid4().hex[:12]}",
                labels={LABEL: "1", OWNER_LABEL: self._owner, "asyncres.task": task.name})
            with self._lock:
                self._live.add(container.id)
        try:
            with self._start_sem:
                container.start()
        except Exception:
            self._remove(container.id)  # created but not started: not left behind for the next sweep
            raise
        workdir = workdir or container.attrs["Config"].get("WorkingDir") or "/"
        return DockerSandbox(self, task, container.id, workdir)

    def _remove(self, container_id: str) -> None:
        import docker

        with self._start_sem:
            try:
                self.client.api.remove_container(container_id, force=True, v=True)
            except docker.errors.NotFound:
                pass
        with self._lock:
            self._live.discard(container_id)

    def sweep(self) -> list[str]:
        """Remove labelled containers whose owner process on this host is gone; returns their ids."""
        import docker

        removed = []
        for c in self.client.containers.list(all=True, filters={"label": f"{LABEL}=1"}):
            if owner_is_gone(c.labels.get(OWNER_LABEL, "")):
                try:
                    c.remove(force=True, v=True)
                    removed.append(c.id)
                except docker.errors.NotFound:
                    pass
        return removed

    @staticmethod
    def _close_all(client, live: set[str], shims) -> None:
        for cid in list(live):
            try:
                client.api.remove_container(cid, force=True, v=True)
            except Exception:
                pass  # already gone, or the engine is: the next start-up's sweep removes it
        live.clear()
        shims.cleanup()
        client.close()

    def close(self) -> None:
        """Remove every container this backend still holds; idempotent."""
        self._finalizer()
