"""The bubblewrap backend: daemonless sandboxes, one short-lived bwrap per command.

bwrap is a sandbox only when it starts as an unprivileged host user with no capabilities (as root it can
remount the host read-write). So every bwrap here is exec'd by a child that has already switched to a
sandbox uid (one host uid per live sandbox, from a pool no account uses) with no supplementary groups, and
runs with --unshare-all (user, pid, net, ipc, uts, cgroup namespaces: no network, not even the host's
loopback; no host processes), --cap-drop ALL, --new-session and --die-with-parent. The file system is a
read-only tmpfs root holding read-only binds of the host's system folders (/usr, /etc, /var, /opt, ...),
empty read-only /root, /home and /run (the host's are never mounted), and the sandbox's own host folders
bound writable at /home/user and /tmp. Inside,
the agent is uid 1000, `user`. Resource limits (CPU seconds, address space, file size, processes) are set by
the shell that starts the command; the hard limits cannot be raised without privileges.

A command's whole process tree lives in the sandbox's pid namespace: when the command's shell exits, or when
the outer bwrap is killed on a timeout, the namespace's init dies and the kernel kills everything left in it.
So nothing outlives a command; state persists between commands only through /home/user and /tmp.

Environment prep replays the task's environment/setup.sh, or its Dockerfile's RUN/COPY/WORKDIR/ENV/USER
steps, once per task into a template home folder; every sandbox starts from a copy of that template. A
Dockerfile whose WORKDIR or COPY targets lie in a new top-level folder (Harbor's WORKDIR /app) gets that folder
as one more writable tree, prepared and copied like the home; the agent and the verifier start in the WORKDIR.
What cannot be mapped is refused in one line naming the step: writes into system folders (/usr, /etc, ...) or
other users' homes, multi-stage builds, downloads, packages missing on the host. Every command runs as `user`
(uid 1000) with HOME=/home/user, whatever USER says; tasks that need root or their image's own user need the
docker backend.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import queue
import selectors
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
import weakref

from asyncres_jax.envs import grading
from asyncres_jax.envs.dockerfile import Step, expand, parse_dockerfile, parse_env
from asyncres_jax.envs.sandbox import (OUTPUT_CAP, Backend, CommandResult, Grade, Sandbox, SandboxStartError,
                                       clean_output)
from asyncres_jax.envs.task import Task
from asyncres_jax.errors import UserError

HOME = "/home/user"
INNER_UID = 1000  # the agent's uid and gid inside every sandbox
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "opt", "var")
SYSTEM = "/run/asyncres"  # the backend's system folder, one read-only bind: shims and the limits script
SHIMS = f"{SYSTEM}/shims"  # offline stand-ins for uvx/apt-get/pip at grading time
PREP_SHIMS = f"{SYSTEM}/prep-shims"  # ... and for useradd/chown/sudo during environment prep
LIMITS = f"{SYSTEM}/limits.sh"  # sourced by every command's bash through BASH_ENV
_LIMITS_SH = """\
ulimit -t "$ASYNCRES_CPU" -v "$ASYNCRES_MEM" -f "$ASYNCRES_FSIZE" -u "$ASYNCRES_NPROC" 2>/dev/null
unset BASH_ENV ASYNCRES_CPU ASYNCRES_MEM ASYNCRES_FSIZE ASYNCRES_NPROC
"""
CONTEXT = "/run/asyncres-context"  # the task's environment/ folder during prep
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_STEP_FAILED = "@@asyncres-step-failed"
# top-level folders a Dockerfile cannot claim as its own writable tree: the host's (read-only) system folders
# and the sandbox's own mounts (another user's /home/NAME can be claimed)
_UNMAPPABLE = set(SYSTEM_DIRS) | {"proc", "dev", "sys", "run", "tmp", "home", "root", "logs", "tests"}


@dataclasses.dataclass(frozen=True)
class BwrapConfig:
    uid_base: int = 430_000  # host uids [uid_base, uid_base + uid_slots) are reserved for sandboxes
    uid_slots: int = 4096
    command_timeout_s: float = 60.0  # Sandbox.run's default per-command limit
    nproc: int = 512  # processes of one sandbox (its uid is its own, so this is per sandbox)
    file_size_mb: int | None = None  # None: the task's storage_mb
    memory_factor: float = 2.0  # address-space limit = memory_factor * task.memory_mb (address space > RSS)
    output_cap: int = OUTPUT_CAP
    root: str | None = None  # host folder for templates and sandbox state; None: a fresh temp folder


def as_user(uid: int | None, argv: list[str]) -> list[str]:
    """argv to run as host user `uid` (its own group, no supplementary groups); unchanged for None.

    Through setpriv, not Popen(user=, group=, extra_groups=): with those CPython forks instead of vforking, and
    forking a training process of many GB write-protects all its memory, so its compute threads stall in
    page faults every time a sandbox command starts (`bench sandbox` measures it: "compute_while_spawning")."""
    if uid is None:
        return argv
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv]


def _run_quiet(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30, **kw)


_HOST_CHECKED: dict[int, str | None] = {}


def host_problem(uid: int = 65534) -> str | None:
    """Why this host cannot run bwrap sandboxes (None when it can): bwrap missing, or no user namespaces."""
    if uid in _HOST_CHECKED:
        return _HOST_CHECKED[uid]
    problem = None
    if shutil.which("bwrap") is None:
        problem = "bubblewrap (bwrap) is not installed; install it with: apt-get install bubblewrap " \
                  "(or run scripts/setup_system.sh)"
    elif os.geteuid() == 0 and shutil.which("setpriv") is None:
        problem = "setpriv is not installed (sandboxes start as their own user through it); install it with: " \
                  "apt-get install util-linux (or run scripts/setup_system.sh)"
    else:
        argv = ["bwrap", "--unshare-all", "--cap-drop", "ALL", "--ro-bind", "/", "/", "true"]
        r = _run_quiet(as_user(uid if os.geteuid() == 0 else None, argv))
        if r.returncode != 0:
            problem = ("bwrap cannot create user namespaces as an unprivileged user here "
                       f"({r.stderr.strip() or 'exit ' + str(r.returncode)}); enable them "
                       "(sysctl user.max_user_namespaces>0, kernel.unprivileged_userns_clone=1, or on Ubuntu "
                       "kernel.apparmor_restrict_unprivileged_userns=0), or use --backend docker")
    _HOST_CHECKED[uid] = problem
    return problem


def _clone_tree(src: pathlib.Path, dst: pathlib.Path, uid: int | None) -> None:
    """Copy a prepared home (modes, mtimes, symlinks) and give every entry to `uid`."""
    os.mkdir(dst)
    dirs = [(src, dst)]
    linked: dict[tuple[int, int], pathlib.Path] = {}
    for root, dirnames, filenames in os.walk(src):
        rel = os.path.relpath(root, src)
        out = dst if rel == "." else dst / rel
        for d in list(dirnames):
            s, t = os.path.join(root, d), out / d
            if os.path.islink(s):
                os.symlink(os.readlink(s), t)
                dirnames.remove(d)
                if uid is not None:
                    os.lchown(t, uid, uid)
                continue
            os.mkdir(t)
            dirs.append((pathlib.Path(s), t))
        for f in filenames:
            s, t = os.path.join(root, f), out / f
            st = os.lstat(s)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(s), t)
            elif st.st_nlink > 1 and (st.st_dev, st.st_ino) in linked:  # keep hard links linked
                os.link(linked[st.st_dev, st.st_ino], t)
                continue
            elif stat.S_ISFIFO(st.st_mode):
                os.mkfifo(t, stat.S_IMODE(st.st_mode))
            elif stat.S_ISREG(st.st_mode):
                shutil.copy2(s, t)
                if st.st_nlink > 1:
                    linked[st.st_dev, st.st_ino] = t
            else:
                continue  # sockets and devices do not survive a copy
            if uid is not None:
                os.lchown(t, uid, uid)
    for s, t in reversed(dirs):  # children first: creating entries bumps a folder's mtime
        shutil.copystat(s, t)
        if uid is not None:
            os.lchown(t, uid, uid)


def _rmtree(path: pathlib.Path) -> None:
    def fix(func, p, _exc):  # the agent may have left folders without write or search permission
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
        except OSError:
            pass
        try:
            func(p)
        except OSError:
            pass

    if path.exists():
        shutil.rmtree(path, onerror=fix)


def _communicate(proc: subprocess.Popen, timeout: float, max_bytes: int) -> tuple[bytes, bool]:
    """Read the merged output until EOF, keeping the first max_bytes; kill the process group on timeout."""
    deadline = time.monotonic() + timeout
    chunks, kept, timed_out = [], 0, False
    fd = proc.stdout.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            if not sel.select(left):
                continue
            data = os.read(fd, 65536)
            if not data:
                break
            if kept < max_bytes:
                chunks.append(data[: max_bytes - kept])
                kept += len(chunks[-1])
    if timed_out:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the outer bwrap; its namespace's init follows it
        except ProcessLookupError:
            pass
    proc.stdout.close()
    proc.wait()
    return b"".join(chunks), timed_out


@dataclasses.dataclass(frozen=True)
class _Template:
    home: pathlib.Path  # prepared /home/user
    tests: pathlib.Path  # a world-readable copy of the task's tests/ (the task folder may be private)
    initial: pathlib.Path | None  # a folder holding test_initial_state.py
    env: tuple[tuple[str, str], ...]  # ENV of the Dockerfile, on top of the base environment
    workdir: str
    roots: tuple[str, ...] = ()  # top-level folders (/app) the Dockerfile writes: prepared under home's sibling


class BwrapBackend(Backend):
    name = "bwrap"

    def __init__(self, config: BwrapConfig | None = None):
        self.config = config or BwrapConfig()
        self._privileged = os.geteuid() == 0
        problem = host_problem(self.config.uid_base if self._privileged else os.geteuid())
        if problem:
            raise UserError(problem)
        if self.config.root:
            self.root = pathlib.Path(self.config.root)
            self.root.mkdir(parents=True, exist_ok=True)
            self._own_root = False
        else:
            self.root = pathlib.Path(tempfile.mkdtemp(prefix="asyncres-bwrap-"))
            self._own_root = True
            weakref.finalize(self, _rmtree, self.root)  # a backend never closed still leaves nothing behind
        self.root.chmod(0o711)  # sandbox uids must traverse it to reach their own folders; nothing more
        self._lock = threading.Lock()
        self._free = list(range(self.config.uid_slots - 1, -1, -1))
        self._templates: dict[pathlib.Path, _Template] = {}
        self._template_locks: dict[pathlib.Path, threading.Lock] = {}
        self._live: set[BwrapSandbox] = set()
        self._counter = 0
        self._trash: queue.SimpleQueue = queue.SimpleQueue()
        self._reaper: threading.Thread | None = None
        (self.root / "trash").mkdir(mode=0o700, exist_ok=True)
        system = self.root / "system"
        system.mkdir(exist_ok=True)
        system.chmod(0o755)
        grading.write_offline_shims(system / "shims")
        grading.write_offline_shims(system / "prep-shims", prep=True)
        (system / "limits.sh").write_text(_LIMITS_SH)
        (system / "limits.sh").chmod(0o644)
        self._write_accounts(system)
        self._base_args = self._system_args(system)

    # --- host side ------------------------------------------------------------------------------------

    def _write_accounts(self, system: pathlib.Path) -> None:
        """/etc/passwd and /etc/group with `user` as uid/gid 1000 (replacing whoever has it on the host)."""
        for name, line in (("passwd", f"user:x:{INNER_UID}:{INNER_UID}:user:{HOME}:/bin/bash"),
                           ("group", f"user:x:{INNER_UID}:")):
            host = pathlib.Path("/etc", name).read_text().splitlines()
            keep = [ln for ln in host if ln.split(":")[0] != "user"
                    and (len(ln.split(":")) < 3 or ln.split(":")[2] != str(INNER_UID))]
            p = system / name
            p.write_text("\n".join(keep + [line]) + "\n")
            p.chmod(0o644)

    def _system_args(self, system: pathlib.Path) -> list[str]:
        args = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                "--tmpfs", "/"]
        for d in SYSTEM_DIRS:
            p = pathlib.Path("/", d)
            if p.is_symlink():
                args += ["--symlink", os.readlink(p), str(p)]
            elif p.is_dir():
                args += ["--ro-bind", str(p), str(p)]
        args += ["--ro-bind", str(system / "passwd"), "/etc/passwd",
                 "--ro-bind", str(system / "group"), "/etc/group",
                 # /root and /run: empty, and read-only once / is remounted (so are /home and /)
                 "--proc", "/proc", "--dev", "/dev", "--perms", "0700", "--dir", "/root", "--dir", "/run",
                 "--perms", "0755", "--dir", "/home",
                 "--ro-bind", str(system), SYSTEM,
                 "--uid", str(INNER_UID), "--gid", str(INNER_UID), "--clearenv"]
        return args

    def _take_uid(self) -> tuple[int, int]:
        with self._lock:
            if not self._free:
                raise UserError(f"more than {self.config.uid_slots} live bwrap sandboxes; close some "
                                "or raise BwrapConfig.uid_slots")
            slot = self._free.pop()
            self._counter += 1
            return slot, self._counter

    def _give_uid(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def host_uid(self, slot: int) -> int | None:
        return self.config.uid_base + slot if self._privileged else None

    def _folder(self, kind: str, n: int, uid: int | None) -> pathlib.Path:
        """A fresh host folder with the sandbox's writable /tmp and /logs (home and roots/ are made by the
        caller)."""
        d = self.root / f"{kind}-{n}"
        d.mkdir(mode=0o711)
        (d / "roots").mkdir(mode=0o711)
        for sub, mode in (("tmp", 0o1777), ("logs", 0o755)):
            (d / sub).mkdir()
            (d / sub).chmod(mode)
            if uid is not None:
                os.chown(d / sub, uid, uid)
        return d

    def exec_bwrap(self, uid: int | None, binds: list[str], env: dict[str, str], workdir: str, script: str,
                   timeout: float, limits: dict[str, str]) -> CommandResult:
        """One bwrap: binds on top of the system layout, then `bash -c script` under `limits` (self.limits)."""
        argv = list(self._base_args)
        argv += binds
        for k, v in env.items():
            argv += ["--setenv", k, v]
        # one bash: BASH_ENV makes it set the limits (and forget them) before it reads the command
        for k, v in {"BASH_ENV": LIMITS, **limits}.items():
            argv += ["--setenv", k, v]
        argv += ["--chdir", workdir, "--remount-ro", "/", "--", "/bin/bash", "--noprofile", "--norc", "-c", script]
        kw = dict(umask=0o022) if uid is not None else {}
        t0 = time.perf_counter()
        proc = subprocess.Popen(as_user(uid, argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True, **kw)
        raw, timed_out = _communicate(proc, timeout, 4 * self.config.output_cap)
        code = proc.returncode if not timed_out else 124
        return CommandResult(output=clean_output(raw, self.config.output_cap), exit_code=code,
                             timed_out=timed_out, seconds=time.perf_counter() - t0)

    def limits(self, task: Task, timeout: float) -> dict[str, str]:
        """CPU seconds, address space (KiB), file size (KiB) and processes, as the LIMITS script reads them."""
        fsize_kb = (self.config.file_size_mb or task.storage_mb) * 1024
        mem_kb = int(self.config.memory_factor * task.memory_mb * 1024)
        return {"ASYNCRES_CPU": str(int(timeout) + 5), "ASYNCRES_MEM": str(mem_kb), "ASYNCRES_FSIZE": str(fsize_kb),
                "ASYNCRES_NPROC": str(self.config.nproc)}

    # --- environment prep ----------------------------------------------------------------------------

    def template(self, task: Task) -> _Template:
        """The task's prepared home (built once per task, then shared by every sandbox of the task)."""
        with self._lock:
            if task.path in self._templates:
                return self._templates[task.path]
            lock = self._template_locks.setdefault(task.path, threading.Lock())
        with lock:
            if task.path not in self._templates:
                tpl = self._prepare(task)
                with self._lock:
                    self._templates[task.path] = tpl
            return self._templates[task.path]

    def _prepare(self, task: Task) -> _Template:
        slot, n = self._take_uid()
        uid = self.host_uid(slot)
        try:
            d = self._folder("task", n, uid)
            home = d / "home"
            home.mkdir(mode=0o755)
            if uid is not None:
                os.chown(home, uid, uid)
            tests = d / "tests"
            shutil.copytree(task.tests_dir, tests)
            _world_readable(tests)
            initial = None
            if task.initial_state_test:
                initial = d / "initial"
                initial.mkdir()
                shutil.copy2(task.initial_state_test, initial / "test_initial_state.py")
                _world_readable(initial)
            context = d / "context"
            shutil.copytree(task.environment_dir, context, symlinks=True)
            _world_readable(context)
            prep = _Prep(self, task, d, uid)
            if task.setup_script:
                prep.run_script(f"cd {HOME} && /bin/bash {CONTEXT}/{task.setup_script.name}",
                                f"{task.setup_script.relative_to(task.path)}")
            else:
                prep.replay(parse_dockerfile(task.dockerfile.read_text(), source=str(task.dockerfile)))
            shutil.rmtree(d / "tmp", ignore_errors=True)
            writable = prep.workdir == HOME or prep.workdir.startswith(HOME + "/") or prep.root_of(prep.workdir)
            return _Template(home=home, tests=tests, initial=initial, env=tuple(prep.runtime_env.items()),
                             workdir=prep.workdir if writable else HOME, roots=tuple(prep.roots))
        finally:
            self._give_uid(slot)

    # --- Backend ---------------------------------------------------------------------------------------

    def start(self, task: Task) -> "BwrapSandbox":
        """A fresh sandbox of the task; SandboxStartError (one line, naming the task) when its environment
        cannot be prepared here (a step the sandbox refuses, a failing step) or the sandbox cannot start."""
        try:
            tpl = self.template(task)
        except SandboxStartError:
            raise
        except Exception as e:  # a task that cannot be prepared is that task's error
            raise SandboxStartError(_one_line(str(e) if isinstance(e, UserError) else
                                              f"{task.name}: {type(e).__name__}: {e}")) from None
        slot, n = self._take_uid()
        try:
            uid = self.host_uid(slot)
            d = self._folder("sb", n, uid)
            _clone_tree(tpl.home, d / "home", uid)
            for top in tpl.roots:
                (d / "roots" / top).parent.mkdir(parents=True, exist_ok=True)
                _clone_tree(tpl.home.parent / "roots" / top, d / "roots" / top, uid)
        except BaseException:
            self._give_uid(slot)
            raise
        sb = BwrapSandbox(self, task, tpl, slot, d)
        with self._lock:
            self._live.add(sb)
        return sb

    def _closed(self, sb: "BwrapSandbox") -> None:
        # rename (instant) and delete in the background: teardown stays off the episode's critical path
        trash = self.root / "trash" / sb.folder.name
        os.rename(sb.folder, trash)
        self._trash.put(trash)
        with self._lock:
            self._live.discard(sb)
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, name="bwrap-reaper", daemon=True)
                self._reaper.start()
        self._give_uid(sb.slot)

    def _reap(self) -> None:
        while (path := self._trash.get()) is not None:
            _rmtree(path)

    def close(self) -> None:
        with self._lock:
            live = list(self._live)
        for sb in live:
            sb.close()
        if self._reaper is not None:
            self._trash.put(None)
            self._reaper.join()
            self._reaper = None
        if self._own_root:
            _rmtree(self.root)


def _world_readable(path: pathlib.Path) -> None:
    for root, dirs, files in os.walk(path):
        os.chmod(root, 0o755)
        for f in files:
            p = os.path.join(root, f)
            if not os.path.islink(p):
                os.chmod(p, os.stat(p).st_mode | 0o444)


class _Prep:
    """Replays one task's environment steps as the sandbox user, into the task's template home."""

    def __init__(self, backend: BwrapBackend, task: Task, d: pathlib.Path, uid: int | None):
        self.backend, self.task, self.d, self.uid = backend, task, d, uid
        self.env: dict[str, str] = {"PATH": BASE_PATH, "HOME": HOME}  # what RUN sees (ENV and ARG)
        self.runtime_env: dict[str, str] = {}  # ENV only: what the agent later sees too
        self.workdir = "/"
        self.batch: list[tuple[Step, str, str, dict[str, str]]] = []
        self.roots: list[str] = []  # top-level folders mapped to writable trees (map_roots)

    def binds(self) -> list[str]:
        return ["--bind", str(self.d / "home"), HOME, "--bind", str(self.d / "tmp"), "/tmp",
                "--ro-bind", str(self.d / "context"), CONTEXT, *_root_binds(self.d, self.roots)]

    def root_of(self, path: str) -> str | None:
        top = _top(path)
        return top if top in self.roots else None

    def map_roots(self, steps: list[Step]) -> None:
        """The new top-level folders WORKDIR and COPY/ADD steps target (/app), made writable trees before any
        step runs, so that RUN steps before them may write there too."""
        env, workdir = dict(self.env), "/"
        for step in steps:
            if step.instruction in ("ENV", "ARG"):
                env.update({k: expand(v, env) for k, v in parse_env(step).items()})
                continue
            if step.instruction == "WORKDIR":
                workdir = os.path.normpath(os.path.join(workdir, expand(step.text.strip(), env)))
                target = workdir
            elif step.instruction in ("COPY", "ADD") and not step.flags_and_args()[0].get("from"):
                args = step.flags_and_args()[1]
                if not args:
                    continue
                target = os.path.normpath(os.path.join(workdir, expand(args[-1], env)))
            else:
                continue
            top = _top(target)
            if top and top not in _UNMAPPABLE and top not in self.roots:
                self.roots.append(top)
                (self.d / "roots" / top).mkdir(mode=0o755, parents=True)
                if self.uid is not None:
                    os.chown(self.d / "roots" / top, self.uid, self.uid)

    def run_script(self, script: str, what: str) -> None:
        env = {**_base_env(), **self.env, "PATH": f"{PREP_SHIMS}:{self.env.get('PATH', BASE_PATH)}"}
        timeout = float(self.task.config.get("environment", {}).get("build_timeout_sec", 600))
        r = self.backend.exec_bwrap(self.uid, self.binds(), env, HOME, script, timeout,
                                    self.backend.limits(self.task, timeout))
        if r.timed_out or r.exit_code != 0:
            tail = "\n".join(r.output.strip().splitlines()[-6:])
            raise UserError(f"{self.task.path.name}: environment prep failed at {what}: "
                            f"{'timed out' if r.timed_out else 'exit ' + str(r.exit_code)}{_explain(tail)}")

    def flush(self) -> None:
        if not self.batch:
            return
        lines = ["set +e"]
        for i, (step, script, workdir, env) in enumerate(self.batch):
            exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
            lines.append(f"( cd {shlex.quote(workdir)} && env {exports} PATH={PREP_SHIMS}:{shlex.quote(env['PATH'])} "
                         f"/bin/sh -c {shlex.quote(script)} ) </dev/null 2>&1 "
                         f"|| {{ echo \"{_STEP_FAILED} {i} $?\"; exit 1; }}")
        batch, self.batch = self.batch, []
        timeout = float(self.task.config.get("environment", {}).get("build_timeout_sec", 600))
        r = self.backend.exec_bwrap(self.uid, self.binds(), _base_env(), HOME, "\n".join(lines), timeout,
                                    self.backend.limits(self.task, timeout))
        if r.exit_code == 0 and not r.timed_out:
            return
        out = r.output.rstrip().splitlines()
        failed = [ln for ln in out if ln.startswith(_STEP_FAILED)]
        step = batch[int(failed[-1].split()[1])][0] if failed else batch[-1][0]
        body = out[: out.index(failed[-1])] if failed else out
        tail = "\n".join(body[-6:])
        why = "timed out" if r.timed_out else "failed"
        raise UserError(f"{self.task.path.name}: environment prep {why} at {step.describe()} of "
                        f"{self.task.dockerfile}{_explain(tail)}")

    def host_path(self, path: str, step: Step) -> pathlib.Path:
        p = os.path.normpath(path if path.startswith("/") else os.path.join(self.workdir, path))
        if p == HOME or p.startswith(HOME + "/"):
            return self.d / "home" / os.path.relpath(p, HOME)
        if top := self.root_of(p):
            return self.d / "roots" / top / os.path.relpath(p, "/" + top)
        raise UserError(f"{self.task.path.name}: {step.describe()} writes to {p}, a system folder the bwrap "
                        f"sandbox keeps read-only (writable: {HOME}, /tmp and new top-level folders such as /app); "
                        "use --backend docker")

    def copy(self, step: Step) -> None:
        flags, args = step.flags_and_args()
        if "from" in flags:
            raise UserError(f"{self.task.path.name}: {step.describe()}: COPY --from (multi-stage builds) is not "
                            "supported by the bwrap backend; use --backend docker")
        if step.heredocs:
            dest = expand(args[-1], self.env)
            target = self.host_path(dest, step)
            for h in step.heredocs:
                t = target / h.name if dest.endswith("/") else target
                t.parent.mkdir(parents=True, exist_ok=True)
                t.write_text(h.body + "\n")
                self._own(t)
            return
        if len(args) < 2:
            raise UserError(f"{self.task.path.name}: {step.describe()} needs a source and a destination")
        *srcs, dest = [expand(a, self.env) for a in args]
        target = self.host_path(dest, step)
        many = len(srcs) > 1 or dest.endswith("/")
        ctx = self.d / "context"
        for s in srcs:
            if "://" in s:
                raise UserError(f"{self.task.path.name}: {step.describe()} downloads {s}; the sandbox has no "
                                "network")
            matches = sorted(ctx.glob(s.lstrip("/"))) if any(c in s for c in "*?[") else [ctx / s.lstrip("/")]
            for src in matches:
                if not src.exists():
                    raise UserError(f"{self.task.path.name}: {step.describe()}: {s} is not in "
                                    f"{self.task.environment_dir}")
                t = target / src.name if (many and not src.is_dir()) else target
                if src.is_dir():
                    shutil.copytree(src, t, dirs_exist_ok=True, symlinks=True)
                else:
                    t.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, t)
                self._own(t)
        self._own(target)

    def _own(self, path: pathlib.Path) -> None:
        if self.uid is None:
            return
        home = self.d / "home"
        p = path
        while p != home and home in p.parents:  # created parents too
            os.lchown(p, self.uid, self.uid)
            p = p.parent
        if path.is_dir() and not path.is_symlink():
            for root, dirs, files in os.walk(path):
                for n in dirs + files:
                    os.lchown(os.path.join(root, n), self.uid, self.uid)

    def replay(self, steps: list[Step]) -> None:
        self.map_roots(steps)
        for step in steps:
            kind = step.instruction
            if kind == "RUN":
                script = step.shell_script()
                if step.json_args() is not None:
                    script = shlex.join(step.json_args())
                self.batch.append((step, script, self.workdir, dict(self.env)))
            elif kind in ("ENV", "ARG"):
                for k, v in parse_env(step).items():
                    v = expand(v, self.env)
                    if kind == "ARG" and k in self.env:
                        continue
                    self.env[k] = v
                    if kind == "ENV" and k != "HOME":
                        self.runtime_env[k] = v
            elif kind == "WORKDIR":
                wd = os.path.normpath(os.path.join(self.workdir, expand(step.text.strip(), self.env)))
                if not (_top(wd) in SYSTEM_DIRS and pathlib.Path(wd).is_dir()):  # existing system folders are fine
                    self.flush()
                    p = self.host_path(wd, step)
                    p.mkdir(parents=True, exist_ok=True)
                    self._own(p)
                self.workdir = wd
            elif kind in ("COPY", "ADD"):
                self.flush()
                self.copy(step)
            elif kind in ("FROM", "USER", "CMD", "ENTRYPOINT", "LABEL", "EXPOSE", "VOLUME", "SHELL",
                          "HEALTHCHECK", "STOPSIGNAL", "MAINTAINER", "ONBUILD"):
                continue  # USER: every step runs as the sandbox's own user; the rest do not touch state
            else:
                raise UserError(f"{self.task.path.name}: {step.describe()}: unknown Dockerfile instruction")
        self.flush()


def _top(path: str) -> str:
    """The tree a path belongs to: its top-level folder, or /home/NAME for another user's home ("home/NAME")."""
    parts = os.path.normpath("/" + path).strip("/").split("/")
    if parts[0] == "home" and len(parts) > 1 and parts[1] != "user":
        return "home/" + parts[1]
    return parts[0]


def _root_binds(d: pathlib.Path, roots) -> list[str]:
    return [a for top in roots for a in ("--bind", str(d / "roots" / top), "/" + top)]


def _one_line(text: str) -> str:
    return " | ".join(ln.strip() for ln in text.replace(":\n", ": ").splitlines() if ln.strip())


def _explain(tail: str) -> str:
    hint = ""
    if "Read-only file system" in tail or "Permission denied" in tail:
        hint = (f"\n(the bwrap sandbox can only write under {HOME}, /tmp and new top-level folders such as /app; "
                "steps that write elsewhere need --backend docker)")
    return (":\n" + tail if tail else "") + hint


def _base_env() -> dict[str, str]:
    return {"PATH": BASE_PATH, "HOME": HOME, "USER": "user", "LOGNAME": "user", "SHELL": "/bin/bash",
            "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TERM": "dumb"}


class BwrapSandbox(Sandbox):
    """One episode's environment: its own home and /tmp on the host, a fresh bwrap for each command."""

    def __init__(self, backend: BwrapBackend, task: Task, tpl: _Template, slot: int, folder: pathlib.Path):
        self.backend, self.task, self.tpl, self.slot, self.folder = backend, task, tpl, slot, folder
        self.uid = backend.host_uid(slot)
        self.env = {**_base_env(), **dict(tpl.env)}
        self._closed = False
        self._lock = threading.Lock()

    def _binds(self) -> list[str]:
        return ["--bind", str(self.folder / "home"), HOME, "--bind", str(self.folder / "tmp"), "/tmp",
                *_root_binds(self.folder, self.tpl.roots)]

    def run(self, command: str, timeout: float | None = None) -> CommandResult:
        if self._closed:
            raise RuntimeError("run() on a closed sandbox")
        timeout = self.backend.config.command_timeout_s if timeout is None else timeout
        return self.backend.exec_bwrap(self.uid, self._binds(), self.env, self.tpl.workdir, command, timeout,
                                       self.backend.limits(self.task, timeout))

    def _grade(self, tests: pathlib.Path, script: str) -> Grade:
        logs = self.folder / "logs"
        binds = self._binds() + ["--ro-bind", str(tests), grading.TESTS_DIR, "--bind", str(logs), "/logs"]
        timeout = self.task.verifier_timeout_s
        r = self.backend.exec_bwrap(self.uid, binds, self.env, self.tpl.workdir, script, timeout,
                                    self.backend.limits(self.task, timeout))
        return grading.parse_grade(r.output)

    def grade(self) -> Grade:
        return self._grade(self.tpl.tests, grading.grade_script(workdir=self.tpl.workdir, shims_dir=SHIMS))

    def grade_initial_state(self) -> Grade:
        """Run environment/test_initial_state.py against the current state (reward 1 when it passes)."""
        if self.tpl.initial is None:
            raise UserError(f"{self.task.path}/environment/test_initial_state.py does not exist")
        return self._grade(self.tpl.initial, grading.grade_script(
            workdir=self.tpl.workdir, shims_dir=SHIMS, test_file="test_initial_state.py", use_test_sh=False))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # runs are synchronous and every process dies with its command's namespace: only files remain
        self.backend._closed(self)
