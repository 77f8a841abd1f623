"""Backend-neutral grading: the shell script that runs inside an environment, and the parser of its output.

PAPER.md: at grading time the task's tests folder is at /tests; /tests/test.sh runs when present and the
reward file it writes (/logs/verifier/reward.txt) decides; otherwise `pytest /tests/test_final_state.py`
decides. The partial credit is the fraction of final-state tests that passed, read from pytest's summary line
(or its -rA lines), so a small model that gets 3 of 4 checks right is told so.

Real Endless Terminals test.sh files fetch uv with curl and run `uvx --with pytest==8.4.1 ... pytest --ctrf
...`; a sandbox without network can still run them unchanged with the offline stand-ins of
`write_offline_shims` on PATH: uvx/uv run the host's pytest, curl of the uv installer is a no-op, apt-get and
pip only report what is missing, and `--ctrf` is accepted when pytest-json-ctrf is not installed.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex

from asyncres_jax.envs.sandbox import Grade

TESTS_DIR = "/tests"
VERIFIER_DIR = "/logs/verifier"
REWARD_FILE = f"{VERIFIER_DIR}/reward.txt"
MARKER = "@@asyncres-grade"


def grade_script(*, workdir: str = "/home/user", shims_dir: str | None = None) -> str:
    """The bash script a backend runs (as the grading user, tests at /tests) to grade the current state."""
    path = f'export PATH={shlex.quote(shims_dir)}:"$PATH" PYTHONPATH={shlex.quote(shims_dir)}${{PYTHONPATH:+:$PYTHONPATH}} ' \
           'PYTEST_PLUGINS=asyncres_ctrf\n' if shims_dir else ""
    return f"""\
export PYTHONDONTWRITEBYTECODE=1
{path}mkdir -p {VERIFIER_DIR} && rm -f {REWARD_FILE}
cd {shlex.quote(workdir)} 2>/dev/null || cd /
if [ -f {TESTS_DIR}/test.sh ]; then
  bash {TESTS_DIR}/test.sh </dev/null 2>&1
  status=$?
  echo "{MARKER} mode=test.sh status=$status reward=$(head -c 64 {REWARD_FILE} 2>/dev/null | tr -d '[:space:]')"
else
  python3 -m pytest -rA -p no:cacheprovider {TESTS_DIR}/test_final_state.py </dev/null 2>&1
  echo "{MARKER} mode=pytest status=$?"
fi
"""


_MARKER_RE = re.compile(rf"^{MARKER} mode=(\S+) status=(-?\d+)(?: reward=(\S*))?\s*$", re.M)
# pytest's last line: "===== 3 passed, 1 failed in 0.12s =====" (or without the rules under -q)
_SUMMARY_RE = re.compile(r"^=*\s*((?:\d+ [a-z]+(?:, )?)+) in [0-9.]+s\b.*$", re.M)
_COUNT_RE = re.compile(r"(\d+) ([a-z]+)")
_RA_RE = re.compile(r"^(PASSED|FAILED|ERROR) \S+", re.M)


def count_tests(output: str) -> tuple[int, int]:
    """(passed, total) of the last pytest run in `output`; total counts passed, failed and errors."""
    summaries = _SUMMARY_RE.findall(output)
    if summaries:
        counts: dict[str, int] = {}
        for n, kind in _COUNT_RE.findall(summaries[-1]):
            counts[kind] = counts.get(kind, 0) + int(n)
        passed = counts.get("passed", 0)
        failed = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
        return passed, passed + failed
    marks = _RA_RE.findall(output)  # -rA lines, when the summary line got cut off
    passed = marks.count("PASSED")
    return passed, len(marks)


def parse_grade(output: str) -> Grade:
    """The Grade of a grading run's (cleaned) output. No marker means the script did not finish: reward 0."""
    passed, total = count_tests(output)
    partial = passed / total if total else 0.0
    m = None
    for m in _MARKER_RE.finditer(output):
        pass
    if m is None:
        return Grade(reward=0, partial=partial, passed=passed, total=total, log=output)
    mode, status, reward_text = m.group(1), int(m.group(2)), m.group(3)
    if mode == "test.sh":
        try:
            reward = 1 if float(reward_text or "nan") >= 1.0 else 0
        except ValueError:
            reward = 0
    else:
        reward = 1 if status == 0 and total > 0 else 0
    return Grade(reward=reward, partial=partial, passed=passed, total=total, log=output)


# --- offline stand-ins for the network tools Endless Terminals' test.sh files call --------------------------

_SHIM = r'''#!/usr/bin/python3
"""Offline stand-in (asyncres_jax.envs.grading) for __NAME__: no network in the sandbox."""
import importlib.util, os, shutil, subprocess, sys

name = os.path.basename(sys.argv[0])
args = sys.argv[1:]
strict = os.environ.get("ASYNCRES_SHIM_STRICT") == "1"  # environment prep: missing packages are errors
here = os.path.dirname(os.path.abspath(__file__))
PY = "/usr/bin/python3"
MODULES = {"pytest-json-ctrf": "pytest_jsonctrf", "pyyaml": "yaml", "beautifulsoup4": "bs4",
           "pillow": "PIL", "scikit-learn": "sklearn", "python-dateutil": "dateutil"}
OPTIONAL = {"pytest-json-ctrf", "pochi-verifier", "pytest-xprocess", "uv", "pip", "setuptools", "wheel"}


def real(cmd):
    path = os.environ.get("PATH", "").split(":")
    return shutil.which(cmd, path=":".join(p for p in path if os.path.abspath(p) != here))


def missing(what, kind):
    msg = f"{kind} package {what!r} is not installed on the host and cannot be installed offline"
    if strict or what.lower() not in OPTIONAL:
        print(f"error: {msg}; install it on the host (see scripts/setup_system.sh)", file=sys.stderr)
        return True
    print(f"warning: {msg}; skipped", file=sys.stderr)
    return False


def pip_name(spec):
    for sep in ("[", "=", "<", ">", "!", "~", ";", " ", "@"):
        spec = spec.split(sep)[0]
    return spec.strip()


def pip_install(pkgs):
    bad = False
    for spec in pkgs:
        n = pip_name(spec)
        if not n or n.startswith("-") or os.path.exists(spec):
            continue
        mod = MODULES.get(n.lower(), n.lower().replace("-", "_").replace(".", "_"))
        if importlib.util.find_spec(mod) is None:
            bad |= missing(n, "pip")
    return 1 if bad else 0


def pip(args):
    if "install" not in args:
        return 0
    pkgs, skip = [], False
    for a in args[args.index("install") + 1:]:
        if skip:
            skip = False
        elif a in ("-r", "--requirement", "-c", "--constraint", "-i", "--index-url", "--extra-index-url",
                   "--target", "-t", "--prefix", "--root", "-f", "--find-links"):
            skip = True
        elif not a.startswith("-"):
            pkgs.append(a)
    return pip_install(pkgs)


def apt(args):
    if "install" not in args:
        return 0  # update, clean, upgrade, ...: nothing to do offline
    bad = False
    for p in args[args.index("install") + 1:]:
        if p.startswith("-"):
            continue
        p = p.split("=")[0]
        ok = subprocess.run(["dpkg-query", "-W", "-f=${Status}", p], capture_output=True, text=True)
        if "install ok installed" not in ok.stdout and real(p) is None:
            bad |= missing(p, "apt")
    return 1 if bad else 0


def strip_ctrf(argv):
    if importlib.util.find_spec("pytest_jsonctrf") is not None:
        return argv
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--ctrf":
            skip = True
        elif not a.startswith("--ctrf="):
            out.append(a)
    return out


def run_tool(argv):
    """uvx/uv run: drop uv's own options, then run the tool with the host's Python."""
    with_value = {"--with", "-w", "--from", "-p", "--python", "--with-requirements", "--with-editable",
                  "--index", "--index-url", "--extra-index-url", "--directory", "--project"}
    i, wanted = 0, []
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] in with_value and i + 1 < len(argv):
            if argv[i] in ("--with", "-w"):
                wanted.append(argv[i + 1])
            i += 2
        else:
            i += 1
    argv = argv[i:]
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        return 0
    if pip_install(wanted):
        return 1
    if pip_name(argv[0]) in ("pytest", "py.test"):
        os.execv(PY, [PY, "-m", "pytest", *strip_ctrf(argv[1:])])
    if argv[0] in ("python", "python3"):
        os.execv(PY, [PY, *argv[1:]])
    os.execvp(argv[0], argv)


def main():
    if name == "uvx":
        return run_tool(args)
    if name == "uv":
        if args[:1] == ["run"]:
            return run_tool(args[1:])
        if args[:2] == ["pip", "install"]:
            return pip(args[1:])
        return 0  # uv venv/sync/self: nothing to do offline
    if name in ("pip", "pip3"):
        return pip(args)
    if name in ("apt-get", "apt"):
        return apt(args)
    if name == "curl":
        if any("astral.sh/uv" in a for a in args):
            return 0  # the uv installer: uv is this stand-in
        c = real("curl")
        if c is None:
            print("curl: not installed (and there is no network in the sandbox)", file=sys.stderr)
            return 127
        os.execv(c, ["curl", *args])
    if name in ("python3", "python"):
        if args[:2] == ["-m", "pip"]:
            return pip(args[2:])
        if args[:2] == ["-m", "pytest"]:
            os.execv(PY, [PY, "-m", "pytest", *strip_ctrf(args[2:])])
        os.execv(PY, [PY, *args])
    if name == "pytest":
        os.execv(PY, [PY, "-m", "pytest", *strip_ctrf(args)])
    return 0


sys.exit(main())
'''

_CTRF_PLUGIN = '''"""Accepts pytest-json-ctrf's --ctrf option when that plugin is not installed (offline sandboxes)."""
import importlib.util

if importlib.util.find_spec("pytest_jsonctrf") is None:
    def pytest_addoption(parser):
        parser.addoption("--ctrf", action="store", default=None, help="ignored: pytest-json-ctrf is not installed")
'''

SHIM_NAMES = ("uvx", "uv", "pip", "pip3", "apt-get", "apt", "curl", "python", "python3", "pytest")


def write_offline_shims(directory: str | os.PathLike) -> pathlib.Path:
    """Write the offline stand-ins (one script, a link per tool name) and the --ctrf plugin into `directory`."""
    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    main = d / "asyncres-shim"
    main.write_text(_SHIM)
    main.chmod(0o755)
    for n in SHIM_NAMES:
        link = d / n
        if not link.is_symlink():
            link.symlink_to("asyncres-shim")
    (d / "asyncres_ctrf.py").write_text(_CTRF_PLUGIN)
    for p in (d, main, d / "asyncres_ctrf.py"):
        p.chmod(0o755 if p.is_dir() or p == main else 0o644)
    return d
