"""Backend-neutral grading: the shell script that runs inside an environment, and the parser of its output.

At grading time the task's tests folder is at /tests; /tests/test.sh runs when present and the reward
files it writes decide (Harbor's convention): /logs/verifier/reward.json, a JSON object of named metrics, every
one recorded, and/or /logs/verifier/reward.txt, one number (1 when it says >= 1). Otherwise
`pytest /tests/test_final_state.py` decides. The partial credit is the fraction of final-state tests that
passed, read from pytest's summary line (or its -rA lines), so a small model that gets 3 of 4 checks right is
told so.

Real Endless Terminals test.sh files fetch uv with curl and run `uvx --with pytest==8.4.1 ... pytest --ctrf
...`; a sandbox without network can still run them unchanged with the offline stand-ins of
`write_offline_shims` on PATH: uvx/uv run the host's pytest, curl of the uv installer is a no-op, apt-get and
pip only report what is missing, and `--ctrf` is accepted when pytest-json-ctrf is not installed.

Nothing of the grader's own environment reaches the task's programs: the pytest stand-in sets the variables
that keep a planted pytest.py or usercustomize from being imported (PYTHONSAFEPATH, PYTHONNOUSERSITE) for the
pytest process alone, and its plugin removes them again before any test starts a program of the task's.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex

from asyncres_jax.envs.sandbox import Grade

TESTS_DIR = "/tests"
VERIFIER_DIR = "/logs/verifier"
REWARD_FILE = f"{VERIFIER_DIR}/reward.txt"
REWARD_JSON = f"{VERIFIER_DIR}/reward.json"  # Harbor's multi-metric reward
MARKER = "@@asyncres-grade"
JSON_MARKER = "@@asyncres-reward-json"  # reward.json's text is printed between two of these


def grade_script(*, workdir: str = "/home/user", shims_dir: str | None = None,
                 test_file: str = "test_final_state.py", use_test_sh: bool = True) -> str:
    """The bash script a backend runs (as the grading user, tests at /tests) to grade the current state.

    test_file/use_test_sh=False run another pytest file from /tests instead (the initial-state checks).
    With shims_dir, PATH leads to the offline stand-ins, whose `python3 -m pytest` and `pytest` carry the
    grader's protections; without it the plain pytest run sets them itself.
    """
    path = f'export PATH={shlex.quote(shims_dir)}:"$PATH"\n' if shims_dir else ""
    guard = "" if shims_dir else "PYTHONDONTWRITEBYTECODE=1 PYTHONSAFEPATH=1 PYTHONNOUSERSITE=1 "
    test_sh = f"{TESTS_DIR}/test.sh" if use_test_sh else "/nonexistent/test.sh"
    return f"""\
{path}mkdir -p {VERIFIER_DIR} && rm -f {REWARD_FILE} {REWARD_JSON}
cd {shlex.quote(workdir)} 2>/dev/null || cd /
if [ -f {test_sh} ]; then
  bash {test_sh} </dev/null 2>&1
  status=$?
  echo "{JSON_MARKER}"; head -c 65536 {REWARD_JSON} 2>/dev/null; echo; echo "{JSON_MARKER}"
  echo "{MARKER} mode=test.sh status=$status reward=$(head -c 64 {REWARD_FILE} 2>/dev/null | tr -d '[:space:]')"
else
  {guard}python3 -m pytest -rA -p no:cacheprovider {TESTS_DIR}/{shlex.quote(test_file)} </dev/null 2>&1
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


def _reward_json(output: str) -> tuple[dict[str, float], str | None]:
    """The metrics of reward.json, printed between the last two JSON_MARKER lines (empty when there is none), and
    why it was unreadable. The grader prints the pair after test.sh, so a test's output cannot stand in for it."""
    parts = output.split(JSON_MARKER + "\n")
    text = parts[-2].strip() if len(parts) >= 3 else ""
    if not text:
        return {}, None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        return {}, f"{REWARD_JSON} is not JSON ({e})"
    if not isinstance(data, dict):
        return {}, f"{REWARD_JSON} holds a {type(data).__name__}, not an object of named metrics"
    metrics = {str(k): float(v) for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if not metrics:
        return {}, f"{REWARD_JSON} names no numeric metric"
    return metrics, None


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
    if mode != "test.sh":
        reward = 1 if status == 0 and total > 0 else 0
        return Grade(reward=reward, partial=partial, passed=passed, total=total, log=output)
    rewards, problem = _reward_json(output[: m.start()])
    if problem:  # a reward file that cannot be read is not a pass
        return Grade(reward=0, partial=partial, passed=passed, total=total, log=output + f"\n[grader: {problem}]")
    try:
        txt = float(reward_text) if reward_text else None
    except ValueError:
        txt = None
    if txt is None or txt != txt:  # no number in reward.txt (or NaN)
        if not rewards:
            return Grade(reward=0, partial=partial, passed=passed, total=total, log=output)
    elif not rewards:  # reward.txt alone: 1 when it says >= 1
        return Grade(reward=1 if txt >= 1.0 else 0, partial=partial, passed=passed, total=total, log=output,
                     rewards={"reward": txt})
    else:
        rewards.setdefault("reward", txt)
    reward = rewards["reward"] if "reward" in rewards else sum(rewards.values()) / len(rewards)
    return Grade(reward=reward, partial=partial, passed=passed, total=total, log=output, rewards=rewards)


# --- offline stand-ins for the network tools Endless Terminals' test.sh files call --------------------------

# One POSIX sh script, linked under each tool's name (sh starts in ~1 ms; Python only for pip/uv arguments).
_SHIM = r"""#!/bin/sh
# Offline stand-in (asyncres_jax.envs.grading) for package and network tools: the sandbox has no network.
name=${0##*/}
here=${0%/*}
# installer scaffolding and reporting plugins: nothing needs them once installs are skipped
OPTIONAL=" pytest-json-ctrf pochi-verifier pytest-xprocess uv pip setuptools wheel python3-pip python3-venv
 python3-setuptools python3-wheel python-is-python3 ca-certificates gnupg software-properties-common apt-utils
 lsb-release locales tzdata sudo curl wget build-essential "

real() {  # the real tool: first match on PATH outside this folder
  old_ifs=$IFS; IFS=:
  for d in $PATH; do
    if [ "$d" != "$here" ] && [ -x "$d/$1" ]; then IFS=$old_ifs; echo "$d/$1"; return 0; fi
  done
  IFS=$old_ifs; return 1
}

missing() {  # $1 package, $2 kind; fails unless the package is optional
  case "$OPTIONAL" in *" $1 "*|*" $1
"*)
    echo "warning: $2 package '$1' is not installed on the host and cannot be installed offline; skipped" >&2
    return 0;;
  esac
  echo "error: $2 package '$1' is not installed on the host and cannot be installed offline;" \
       "install it on the host (see scripts/setup_system.sh)" >&2
  return 1
}

PY=$(real python3) || PY=/usr/bin/python3  # the environment's own python (an image may have no /usr/bin one)

pytest_env() {  # the grader's protections, for one pytest process; asyncres_ctrf removes them again inside it
  added=""
  for v in PYTHONSAFEPATH PYTHONNOUSERSITE PYTHONDONTWRITEBYTECODE; do
    eval "[ -z \"\${$v+x}\" ]" && { export "$v=1"; added="$added $v"; }
  done
  export ASYNCRES_ADDED="$added" PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" \
    PYTEST_PLUGINS="asyncres_ctrf${PYTEST_PLUGINS:+,$PYTEST_PLUGINS}"
}

run_pytest() {  # python -m pytest ARGS, protected
  pytest_env
  exec "$PY" -m pytest "$@"
}

dpkg_installed() {  # dpkg keeps a file list per installed package: a stat, not a query of the whole database
  [ -e "/var/lib/dpkg/info/$1.list" ] && return 0
  for f in /var/lib/dpkg/info/"$1":*.list; do [ -e "$f" ] && return 0; done
  return 1
}

pip_check() {  # pip-style arguments; fails naming each missing package
  "$PY" - "$@" <<'PYEOF'
import importlib.util, sys
MODULES = {"pytest-json-ctrf": "pytest_jsonctrf", "pyyaml": "yaml", "beautifulsoup4": "bs4", "pillow": "PIL",
           "scikit-learn": "sklearn", "python-dateutil": "dateutil", "opencv-python": "cv2"}
WITH_VALUE = {"-r", "--requirement", "-c", "--constraint", "-i", "--index-url", "--extra-index-url", "--target",
              "-t", "--prefix", "--root", "-f", "--find-links", "--python", "-p"}
args, names, skip = sys.argv[1:], [], False
for a in args:
    if skip:
        skip = False
    elif a in WITH_VALUE:
        skip = True
    elif not a.startswith("-") and a not in ("install", "pip"):
        for sep in "[=<>!~; @":
            a = a.split(sep)[0]
        if a:
            names.append(a)
for n in names:
    if importlib.util.find_spec(MODULES.get(n.lower(), n.lower().replace("-", "_").replace(".", "_"))) is None:
        print(n)
PYEOF
}

pip_install() {
  status=0
  for n in $(pip_check "$@"); do missing "$n" pip || status=1; done
  return $status
}

run_tool() {  # uvx / uv run: drop uv's options (keeping --with packages to check), run the tool on the host
  withs=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --with|-w) withs="$withs $2"; shift 2;;
      --from|-p|--python|--with-requirements|--with-editable|--index|--index-url|--extra-index-url) shift 2;;
      --directory|--project) shift 2;;
      --) shift; break;;
      -*) shift;;
      *) break;;
    esac
  done
  [ $# -gt 0 ] || exit 0
  # shellcheck disable=SC2086
  pip_install $withs || exit 1
  case "$1" in
    pytest|py.test) shift; run_pytest "$@";;
    python|python3) shift; exec "$PY" "$@";;
  esac
  exec "$@"
}

case "$name" in
  uvx) run_tool "$@";;
  uv)
    case "$1" in
      run) shift; run_tool "$@";;
      pip) shift; [ "$1" = install ] && { shift; pip_install "$@"; exit $?; }; exit 0;;
    esac
    exit 0;;  # uv venv/sync/self: nothing to do offline
  pip|pip3) [ "$1" = install ] && { shift; pip_install "$@"; exit $?; }; exit 0;;
  python|python3)
    if [ "$1" = -m ] && { [ "$2" = pip ] || [ "$2" = pip3 ]; }; then
      [ "$3" = install ] && { shift 3; pip_install "$@"; exit $?; }; exit 0
    fi
    [ "$1" = -m ] && [ "$2" = pytest ] && { shift 2; run_pytest "$@"; }
    exec "$PY" "$@";;
  pytest|py.test)
    p=$(real "$name") || run_pytest "$@"
    pytest_env
    exec "$p" "$@";;
  apt-get|apt)
    found=0; status=0
    for a in "$@"; do
      if [ $found = 1 ]; then
        case "$a" in -*) continue;; esac
        p=${a%%=*}
        if ! dpkg_installed "$p" && ! real "$p" >/dev/null; then
          missing "$p" apt || status=1
        fi
      fi
      [ "$a" = install ] && found=1
    done
    exit $status;;  # update, clean, upgrade: nothing to do offline
  curl)
    for a in "$@"; do case "$a" in *astral.sh/uv*) exit 0;; esac; done  # the uv installer: uv is this stand-in
    c=$(real curl) || { echo "curl: not installed (and the sandbox has no network)" >&2; exit 127; }
    exec "$c" "$@";;
  rm)  # package caches a Dockerfile cleans up are not the sandbox's to delete
    n=0
    for a do
      shift
      case "$a" in /var/lib/apt/lists*|/var/cache/*|/root/.cache*|/usr/share/doc*|/usr/share/man*) continue;; esac
      case "$a" in -*) ;; *) n=$((n + 1));; esac
      set -- "$@" "$a"
    done
    [ $n -gt 0 ] || exit 0
    exec "$(real rm)" "$@";;
  sudo)
    while [ $# -gt 0 ]; do
      case "$1" in -u|-g|-C|-D|-h|-p|-U) shift 2;; -*) shift;; *) break;; esac
    done
    [ $# -gt 0 ] && exec "$@"; exit 0;;
  su)
    while [ $# -gt 0 ]; do [ "$1" = -c ] && exec /bin/sh -c "$2"; shift; done; exit 0;;
esac
# useradd, groupadd, chown, ...: mapped onto the sandbox's own user, which already owns its files
exit 0
"""

_CTRF_PLUGIN = '''"""Loaded into every pytest the grader runs: hands the task's tests the environment without
the grader's variables (programs they start must not inherit them), and accepts pytest-json-ctrf's --ctrf
option when that plugin is not installed (offline sandboxes)."""
import importlib.util
import os


def _restore_environment():
    here = os.path.dirname(os.path.abspath(__file__))
    for name in os.environ.pop("ASYNCRES_ADDED", "").split():
        os.environ.pop(name, None)
    for name, own in (("PYTHONPATH", here), ("PYTEST_PLUGINS", "asyncres_ctrf")):
        sep = os.pathsep if name == "PYTHONPATH" else ","
        rest = [p for p in os.environ.get(name, "").split(sep) if p and p != own]
        if rest:
            os.environ[name] = sep.join(rest)
        else:
            os.environ.pop(name, None)


_restore_environment()

if importlib.util.find_spec("pytest_jsonctrf") is None:
    def pytest_addoption(parser):
        parser.addoption("--ctrf", action="store", default=None,
                         help="ignored: pytest-json-ctrf is not installed")
'''

SHIM_NAMES = ("uvx", "uv", "pip", "pip3", "apt-get", "apt", "curl", "python", "python3", "pytest", "py.test")
# environment prep (Dockerfile RUN steps replayed as the sandbox user) also maps user/ownership tools
PREP_SHIM_NAMES = SHIM_NAMES + ("rm", "sudo", "su", "useradd", "adduser", "groupadd", "addgroup", "usermod",
                                "groupmod", "chown", "chgrp", "passwd", "chpasswd", "locale-gen",
                                "update-locale", "ldconfig")


def write_offline_shims(directory: str | os.PathLike, *, prep: bool = False) -> pathlib.Path:
    """Write the offline stand-ins (one script, a link per tool name) and the --ctrf plugin into `directory`.

    prep=True adds the stand-ins for replaying Dockerfile steps (useradd, chown, rm of package caches, sudo).
    """
    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    main = d / "asyncres-shim"
    main.write_text(_SHIM)
    main.chmod(0o755)
    for n in PREP_SHIM_NAMES if prep else SHIM_NAMES:
        link = d / n
        if not link.is_symlink():
            link.symlink_to("asyncres-shim")
    (d / "asyncres_ctrf.py").write_text(_CTRF_PLUGIN)
    for p in (d, main, d / "asyncres_ctrf.py"):
        p.chmod(0o755 if p.is_dir() or p == main else 0o644)
    return d
