"""What a generated task is (a Spec) and how it is written out in the Endless Terminals layout.

A family builds a Spec from a random generator: the starting files under /home/user, the instruction, an
oracle shell solution, and named final-state checks (Python bodies). Rendering turns it into instruction.md,
task.toml, environment/Dockerfile (FROM ubuntu:22.04, python3 + pytest, `useradd -m user`, files written with
printf, chown, then USER user, HOME and WORKDIR /home/user), environment/test_initial_state.py,
tests/test_final_state.py, tests/test.sh and solution/solve.sh.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import textwrap

HOME = "/home/user"


@dataclasses.dataclass(frozen=True)
class File:
    path: str  # relative to /home/user
    text: str | None = None  # content (every line newline-terminated); None with link/size
    mode: int | None = None
    mtime: int | None = None  # seconds since the epoch
    link: str | None = None  # symlink target
    size: int | None = None  # a zero-filled file of this many bytes


@dataclasses.dataclass
class Spec:
    instruction: str
    solution: str  # bash, run in /home/user
    checks: list[tuple[str, str]]  # (test name, Python body) of the final-state tests
    files: list[File] = dataclasses.field(default_factory=list)
    dirs: list[str] = dataclasses.field(default_factory=list)  # extra empty folders
    outputs: list[str] = dataclasses.field(default_factory=list)  # must not exist before the episode
    prep: list[str] = dataclasses.field(default_factory=list)  # extra RUN commands, run in /home/user
    params: tuple = ()  # the categorical choices: what split assignment hashes


def q(s: str) -> str:
    """Single-quote for sh."""
    return "'" + s.replace("'", "'\\''") + "'"


def lines_text(lines) -> str:
    return "".join(f"{ln}\n" for ln in lines)


_PRELUDE = '''\
import hashlib
import json
import os
import pathlib
import stat
import subprocess

HOME = pathlib.Path("/home/user")


def text(rel):
    return (HOME / rel).read_text()


def nonblank(rel):
    return [ln.strip() for ln in text(rel).splitlines() if ln.strip()]


def mode(rel):
    return stat.S_IMODE(os.stat(HOME / rel).st_mode)
'''


def _test_file(doc: str, checks: list[tuple[str, str]]) -> str:
    out = [f'"""{doc}"""\n', _PRELUDE]
    for name, body in checks:
        out.append(f"\n\ndef test_{name}():\n{textwrap.indent(textwrap.dedent(body).strip(), '    ')}\n")
    return "".join(out)


def initial_checks(spec: Spec) -> list[tuple[str, str]]:
    checks = [("home_exists", "assert HOME.is_dir()")]
    for i, f in enumerate(spec.files):
        if any(f.path == o or f.path.startswith(o + "/") for o in spec.outputs):
            continue  # written by the Dockerfile only to be packed and removed (archives)
        p = repr(f.path)
        if f.link is not None:
            checks.append((f"link_{i}",
                           f"assert os.path.islink(HOME / {p})\nassert os.readlink(HOME / {p}) == {f.link!r}"))
        elif f.size is not None:
            checks.append((f"file_{i}", f"assert (HOME / {p}).stat().st_size == {f.size}"))
        else:
            digest = __import__("hashlib").sha256(f.text.encode()).hexdigest()
            body = f"assert hashlib.sha256((HOME / {p}).read_bytes()).hexdigest() == {digest!r}"
            if f.mode is not None:
                body += f"\nassert mode({p}) == {oct(f.mode)}"
            checks.append((f"file_{i}", body))
    for i, o in enumerate(spec.outputs):
        checks.append((f"output_absent_{i}", f"assert not os.path.lexists(HOME / {o!r})"))
    return checks


_TEST_SH = """\
#!/bin/bash
# Runs the final-state tests; the verifier reads the reward (1 = all passed, 0 = not) from reward.txt.
cd /home/user
python3 -m pytest -p no:cacheprovider /tests/test_final_state.py -rA
if [ $? -eq 0 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


def dockerfile(spec: Spec) -> str:
    out = [
        "FROM ubuntu:22.04",
        "",
        "RUN apt-get update && \\\n    apt-get install -y python3 python3-pip && \\\n    pip3 install pytest && \\\n"
        "    apt-get clean && rm -rf /var/lib/apt/lists/*",
        "",
        "RUN useradd -m -s /bin/bash user || true",
        "",
    ]
    folders = sorted(({str(pathlib.PurePosixPath(f.path).parent) for f in spec.files} | set(spec.dirs)) - {"."})
    if folders:
        out += ["RUN mkdir -p " + " ".join(q(f"{HOME}/{d}") for d in folders), ""]
    for f in spec.files:
        dest = q(f"{HOME}/{f.path}")
        if f.link is not None:
            out.append(f"RUN ln -s {q(f.link)} {dest}")
        elif f.size is not None:
            out.append(f"RUN head -c {f.size} /dev/zero > {dest}")
        else:
            args = " \\\n".join(f"    {q(ln)}" for ln in f.text.splitlines())
            out.append(f"RUN printf '%s\\n' \\\n{args} \\\n    > {dest}")
    if spec.prep:
        out += ["", "RUN cd /home/user && \\\n    " + " && \\\n    ".join(spec.prep)]
    attrs = [f"chmod {f.mode:o} {q(f'{HOME}/{f.path}')}" for f in spec.files if f.mode is not None]
    attrs += [f"touch -h -d @{f.mtime} {q(f'{HOME}/{f.path}')}" for f in spec.files if f.mtime is not None]
    if attrs:
        out += ["", "RUN " + " && \\\n    ".join(attrs)]
    # the Endless Terminals convention, spelled out for backends that run tasks as their image says (Harbor's)
    out += ["", "RUN chown -R user:user /home/user && chmod 755 /home/user", "", "USER user",
            "ENV HOME=/home/user", "WORKDIR /home/user", ""]
    return "\n".join(out)


def write_task(root: pathlib.Path, name: str, spec: Spec, meta: dict) -> pathlib.Path:
    d = root / name
    for sub in ("environment", "tests", "solution"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    (d / "instruction.md").write_text(spec.instruction.strip() + "\n")
    timeout = {"easy": 120.0, "medium": 300.0, "hard": 600.0}[meta["difficulty"]]
    toml = ['version = "1.0"', "", "[metadata]"]
    toml += [f"{k} = {json.dumps(v)}" for k, v in meta.items()]
    toml += ["", "[verifier]", "timeout_sec = 120.0", "", "[agent]", f"timeout_sec = {timeout}", "",
             "[environment]", "build_timeout_sec = 600.0", "cpus = 1", "memory_mb = 2048", "storage_mb = 10240", ""]
    (d / "task.toml").write_text("\n".join(toml))
    (d / "environment" / "Dockerfile").write_text(dockerfile(spec))
    (d / "environment" / "test_initial_state.py").write_text(
        _test_file("Checks the starting state before the agent acts.", initial_checks(spec)))
    (d / "tests" / "test_final_state.py").write_text(
        _test_file("Checks the final state after the agent has acted.", spec.checks))
    (d / "tests" / "test.sh").write_text(_TEST_SH)
    (d / "tests" / "test.sh").chmod(0o755)
    (d / "solution" / "solve.sh").write_text("#!/bin/bash\nset -e\ncd /home/user\n" + spec.solution.strip() + "\n")
    (d / "solution" / "solve.sh").chmod(0o755)
    return d
