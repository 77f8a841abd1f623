"""Task directories in the Harbor / Endless Terminals layout, datasets of them, and split files.

    TASK/instruction.md                      the text given to the agent
    TASK/task.toml                           [agent]/[verifier] timeout_sec, [environment] cpus/memory_mb/...,
                                             user/workdir (override the image's USER/WORKDIR),
                                             [metadata] (family, difficulty, ...)
    TASK/environment/Dockerfile              or environment/setup.sh: builds the starting state
    TASK/environment/test_initial_state.py   optional: checks the starting state
    TASK/tests/test.sh                       optional: runs the final tests, writes /logs/verifier/reward.txt
                                             and/or reward.json (named metrics)
    TASK/tests/test_final_state.py           pytest checks of the final state (needed when there is no test.sh)
    TASK/solution/solve.sh                   optional: the oracle

A dataset is a folder of task directories; DATASET/splits/{train,val,test}.txt list task directory names,
one per line, relative to the dataset folder.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tomllib
from typing import Any, Mapping

from asyncres_jax.errors import UserError

SPLITS = ("train", "val", "test")
SETUP_SCRIPT = "setup.sh"  # environment/setup.sh, preferred over the Dockerfile when both exist

# Harbor's defaults when task.toml leaves a field out.
DEFAULT_AGENT_TIMEOUT_S = 300.0  # the paper's 300 s wall clock per episode
DEFAULT_VERIFIER_TIMEOUT_S = 120.0
DEFAULT_CPUS = 1
DEFAULT_MEMORY_MB = 2048
DEFAULT_STORAGE_MB = 10240


@dataclasses.dataclass(frozen=True)
class Task:
    path: pathlib.Path  # absolute, resolved
    name: str  # the directory name; what split files list
    instruction: str
    config: Mapping[str, Any]  # task.toml as parsed
    metadata: Mapping[str, Any]  # task.toml [metadata]: family, difficulty, category, tags, ...
    agent_timeout_s: float
    verifier_timeout_s: float
    cpus: int
    memory_mb: int
    storage_mb: int
    user: str | None = None  # [environment] user: who the agent and verifier run as (None: the image's USER)
    workdir: str | None = None  # [environment] workdir: where they start (None: the image's WORKDIR)

    def __hash__(self) -> int:  # config/metadata are dicts; a task is identified by its directory
        return hash(self.path)

    @property
    def environment_dir(self) -> pathlib.Path:
        return self.path / "environment"

    @property
    def tests_dir(self) -> pathlib.Path:
        return self.path / "tests"

    @property
    def dockerfile(self) -> pathlib.Path | None:
        p = self.environment_dir / "Dockerfile"
        return p if p.is_file() else None

    @property
    def setup_script(self) -> pathlib.Path | None:
        p = self.environment_dir / SETUP_SCRIPT
        return p if p.is_file() else None

    @property
    def initial_state_test(self) -> pathlib.Path | None:
        p = self.environment_dir / "test_initial_state.py"
        return p if p.is_file() else None

    @property
    def solution(self) -> pathlib.Path | None:
        p = self.path / "solution" / "solve.sh"
        return p if p.is_file() else None

    @property
    def family(self) -> str:
        return str(self.metadata.get("family", self.metadata.get("category", "")))

    @property
    def difficulty(self) -> str:
        return str(self.metadata.get("difficulty", ""))


def _section(cfg: Mapping[str, Any], key: str, toml_path: pathlib.Path) -> Mapping[str, Any]:
    sec = cfg.get(key, {})
    if not isinstance(sec, dict):
        raise UserError(f"{toml_path}: [{key}] must be a table, got {type(sec).__name__}; fix the task.toml")
    return sec


def _number(sec: Mapping[str, Any], key: str, default: float, where: str, toml_path: pathlib.Path) -> float:
    v = sec.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise UserError(f"{toml_path}: {where}.{key} must be a positive number, got {v!r}; fix the task.toml")
    return v


def _text(sec: Mapping[str, Any], key: str, where: str, toml_path: pathlib.Path, *, absolute: bool = False):
    v = sec.get(key)
    if v is None:
        return None
    if not isinstance(v, str) or not v.strip() or (absolute and not v.startswith("/")):
        kind = "an absolute path" if absolute else "a non-empty string"
        raise UserError(f"{toml_path}: {where}.{key} must be {kind}, got {v!r}; fix the task.toml")
    return v.strip()


def _memory_mb(env: Mapping[str, Any], toml_path: pathlib.Path) -> int:
    # Older Harbor files write memory = "2G"; newer ones memory_mb = 2048.
    if "memory_mb" in env or "memory" not in env:
        return int(_number(env, "memory_mb", DEFAULT_MEMORY_MB, "environment", toml_path))
    text = str(env["memory"]).strip().upper().removesuffix("B")
    units = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
    try:
        return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(float(text) / 2**20)
    except (ValueError, IndexError):
        raise UserError(f"{toml_path}: environment.memory {env['memory']!r} is not a size like '2G'") from None


def load_task(path: str | pathlib.Path) -> Task:
    """Read and validate one task directory; a UserError names the missing or malformed file."""
    root = pathlib.Path(path).resolve()
    if not root.is_dir():
        raise UserError(f"task directory {path} does not exist (or is not a directory)")

    instruction_path = root / "instruction.md"
    if not instruction_path.is_file():
        raise UserError(f"{instruction_path} is missing: every task needs the instruction given to the agent")
    try:
        instruction = instruction_path.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise UserError(f"{instruction_path} is not valid UTF-8") from None
    if not instruction:
        raise UserError(f"{instruction_path} is empty: write the task's instruction into it")

    toml_path = root / "task.toml"
    if not toml_path.is_file():
        raise UserError(f"{toml_path} is missing: every task needs a task.toml (timeouts, resources, metadata)")
    try:
        cfg = tomllib.loads(toml_path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{toml_path} is not valid TOML: {e}") from None

    env_dir = root / "environment"
    if not ((env_dir / "Dockerfile").is_file() or (env_dir / SETUP_SCRIPT).is_file()):
        raise UserError(f"{env_dir}/Dockerfile is missing (nor is there an environment/{SETUP_SCRIPT}): "
                        "the task needs one of them to build its starting state")
    tests_dir = root / "tests"
    if not ((tests_dir / "test.sh").is_file() or (tests_dir / "test_final_state.py").is_file()):
        raise UserError(f"{tests_dir}/test_final_state.py is missing (nor is there a tests/test.sh): "
                        "the task needs its final-state tests")

    metadata = _section(cfg, "metadata", toml_path)
    agent = _section(cfg, "agent", toml_path)
    verifier = _section(cfg, "verifier", toml_path)
    env = _section(cfg, "environment", toml_path)
    return Task(
        path=root,
        name=root.name,
        instruction=instruction,
        config=cfg,
        metadata=dict(metadata),
        agent_timeout_s=float(_number(agent, "timeout_sec", DEFAULT_AGENT_TIMEOUT_S, "agent", toml_path)),
        verifier_timeout_s=float(_number(verifier, "timeout_sec", DEFAULT_VERIFIER_TIMEOUT_S, "verifier", toml_path)),
        cpus=int(_number(env, "cpus", DEFAULT_CPUS, "environment", toml_path)),
        memory_mb=_memory_mb(env, toml_path),
        storage_mb=int(_number(env, "storage_mb", DEFAULT_STORAGE_MB, "environment", toml_path)),
        user=_text(env, "user", "environment", toml_path),
        workdir=_text(env, "workdir", "environment", toml_path, absolute=True),
    )


def _is_task_dir(p: pathlib.Path) -> bool:
    return p.is_dir() and ((p / "task.toml").exists() or (p / "instruction.md").exists())


def load_dataset(path: str | pathlib.Path) -> list[Task]:
    """Every task directory directly under `path` (sorted by name); a single task directory is a dataset of one."""
    root = pathlib.Path(path)
    if not root.is_dir():
        raise UserError(f"dataset folder {path} does not exist")
    if _is_task_dir(root):
        return [load_task(root)]
    tasks = [load_task(p) for p in sorted(root.iterdir()) if _is_task_dir(p)]
    if not tasks:
        raise UserError(f"{path} holds no task directories (folders with instruction.md and task.toml)")
    return tasks


def read_split(path: str | pathlib.Path, split: str) -> list[str]:
    """Task directory names listed in DATASET/splits/SPLIT.txt (blank lines and # comments ignored)."""
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}; choose one of: {', '.join(SPLITS)}")
    split_file = pathlib.Path(path) / "splits" / f"{split}.txt"
    if not split_file.is_file():
        raise UserError(f"{split_file} is missing: a dataset's splits/{split}.txt lists its {split} task directories")
    names = [ln.strip() for ln in split_file.read_text().splitlines()]
    return [n for n in names if n and not n.startswith("#")]


def load_split(path: str | pathlib.Path, split: str) -> list[Task]:
    """The tasks of one split, in the order the split file lists them."""
    root = pathlib.Path(path)
    tasks = []
    for name in read_split(root, split):
        if not (root / name).is_dir():
            raise UserError(f"{root}/splits/{split}.txt lists {name!r}, but {root / name} does not exist")
        tasks.append(load_task(root / name))
    return tasks
