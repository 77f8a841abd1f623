"""The interface every sandbox backend implements (bwrap, docker), and output handling they share.

A Backend prepares environments for tasks; a Sandbox is one live environment for one episode: commands run
in it as the task's user in its working folder (docker: the image's USER and WORKDIR; bwrap: `user`, in the
Dockerfile's WORKDIR when it could be mapped, else /home/user), and grade() runs the task's tests in it.
"""

from __future__ import annotations

import abc
import dataclasses
import re
from typing import TYPE_CHECKING, Mapping

from asyncres_jax.errors import UserError

if TYPE_CHECKING:
    from asyncres_jax.envs.task import Task

OUTPUT_CAP = 50_000  # characters of command output an observation keeps (the paper's cap)

_ANSI_RE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07]*(\x07|\x1b\\)|\x1b[@-Z\\-_]")


def clean_output(raw: bytes | str, cap: int = OUTPUT_CAP) -> str:
    """Decode, strip ANSI escapes and cap to `cap` characters (keeping the head, marking the cut)."""
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    text = _ANSI_RE.sub("", text).replace("\r\n", "\n")
    if len(text) > cap:
        text = text[:cap] + f"\n[output truncated: {len(text) - cap} more characters]"
    return text


@dataclasses.dataclass(frozen=True)
class CommandResult:
    output: str  # stdout and stderr interleaved, cleaned by clean_output
    exit_code: int
    timed_out: bool
    seconds: float


@dataclasses.dataclass(frozen=True)
class Grade:
    reward: float  # 1 if the task's tests pass, else 0; with reward.json: `reward`, else the mean
    partial: float  # fraction of final-state tests that passed (0.0 when none ran)
    passed: int
    total: int
    log: str
    rewards: Mapping[str, float] = dataclasses.field(default_factory=dict)  # every metric the verifier wrote

    def metric(self, key: str = "") -> float:
        """The reward training uses: the verifier's metric `key` when it wrote one, else `reward`."""
        return float(self.rewards[key]) if key and key in self.rewards else float(self.reward)


class SandboxStartError(UserError):
    """A task's environment could not be built or started: that task's error (an infrastructure or task
    problem), never the policy's failure, so never a reward of 0."""


class Sandbox(abc.ABC):
    """One live environment for one episode. Always closed: use it as a context manager."""

    @abc.abstractmethod
    def run(self, command: str, timeout: float | None = None) -> CommandResult:
        """Run a shell command as the task's user in its working folder; kill its whole process tree on timeout."""

    @abc.abstractmethod
    def grade(self) -> Grade:
        """Run the task's final-state tests against the current state."""

    def grade_initial_state(self) -> Grade:
        """Run the task's environment/test_initial_state.py against the current state (reward 1 = passes)."""
        raise NotImplementedError(f"{type(self).__name__} cannot run initial-state tests")

    @abc.abstractmethod
    def close(self) -> None:
        """Stop every process of this sandbox and remove its state. Idempotent."""

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Backend(abc.ABC):
    """Starts sandboxes for tasks. Thread-safe: episodes start sandboxes from many threads."""

    name: str

    @abc.abstractmethod
    def start(self, task: "Task") -> Sandbox:
        """Prepare a fresh environment for `task` (its environment/ folder) and return it running."""

    def close(self) -> None:
        """Release what the backend holds (caches, connections, leftover sandboxes)."""

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
