"""A parser of the Dockerfile subset Endless Terminals / Harbor tasks use, for replaying them without Docker.

Handled: comments, `\\` line continuations, BuildKit heredocs (`RUN <<EOF`, `RUN cat > f <<'EOF'`,
`COPY <<EOF /dest`), exec-form (JSON) arguments, and the instructions FROM, RUN, COPY, ADD, WORKDIR, ENV,
ARG, USER. Instructions that do not change the starting state (CMD, ENTRYPOINT, LABEL, EXPOSE, ...) are kept
as steps so a replayer can ignore them by name.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex

from asyncres_jax.errors import UserError

_HEREDOC_RE = re.compile(r"<<(-?)\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\2")
_VAR_RE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


@dataclasses.dataclass(frozen=True)
class Heredoc:
    name: str
    body: str  # without the terminator line; `<<-` strips leading tabs
    expand: bool  # unquoted delimiter: variables are expanded (by the shell, for RUN)


@dataclasses.dataclass(frozen=True)
class Step:
    instruction: str  # upper case: RUN, COPY, ...
    text: str  # the arguments after the instruction, continuations joined, heredoc bodies excluded
    line: int  # 1-based line of the instruction in the Dockerfile
    heredocs: tuple[Heredoc, ...] = ()

    def describe(self) -> str:
        first = self.text if len(self.text) <= 70 else self.text[:67] + "..."
        return f"Dockerfile line {self.line} ({self.instruction} {first})"

    def shell_script(self) -> str:
        """RUN as the shell would see it: `RUN <<EOF` alone runs the heredoc; otherwise heredocs feed the command."""
        if self.heredocs and _HEREDOC_RE.fullmatch(self.text.strip()):
            return self.heredocs[0].body
        script = self.text
        for h in self.heredocs:
            script += "\n" + h.body + "\n" + h.name
        return script

    def json_args(self) -> list[str] | None:
        """The exec (JSON array) form's arguments, or None for the shell form."""
        t = self.text.strip()
        if not t.startswith("["):
            return None
        try:
            args = json.loads(t)
        except json.JSONDecodeError:
            return None
        return [str(a) for a in args] if isinstance(args, list) else None

    def flags_and_args(self) -> tuple[dict[str, str], list[str]]:
        """COPY/ADD: (--flag=value options, positional args)."""
        flags = {}
        rest = self.text.strip()
        while (m := re.match(r"--([\w-]+)(?:=(\S*))?\s*", rest)) is not None:
            flags[m.group(1)] = m.group(2) or ""
            rest = rest[m.end():]
        args = dataclasses.replace(self, text=rest).json_args()
        return flags, args if args is not None else shlex.split(rest)


def parse_dockerfile(text: str, *, source: str = "Dockerfile") -> list[Step]:
    """Split a Dockerfile into steps; a UserError names the line of anything malformed."""
    lines = text.splitlines()
    steps: list[Step] = []
    i = 0
    while i < len(lines):
        raw = lines[i]
        start = i + 1
        i += 1
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        # join continuation lines as Docker does: backslash and newline vanish, comment lines are dropped
        logical = raw.rstrip()
        while logical.endswith("\\"):
            logical = logical[:-1]
            while i < len(lines) and lines[i].strip().startswith("#"):
                i += 1
            if i >= len(lines):
                break
            logical += lines[i].rstrip()
            i += 1
        m = re.match(r"\s*([A-Za-z]+)\s*(.*)", logical, re.S)
        if m is None:
            raise UserError(f"{source} line {start}: cannot read {stripped[:60]!r} as an instruction")
        instr, rest = m.group(1).upper(), m.group(2).strip()
        heredocs = []
        if instr in ("RUN", "COPY", "ADD"):
            for hm in _HEREDOC_RE.finditer(rest):
                strip_tabs, quote, name = hm.group(1), hm.group(2), hm.group(3)
                body = []
                while i < len(lines) and (lines[i].lstrip("\t") if strip_tabs else lines[i]) != name:
                    body.append(lines[i].lstrip("\t") if strip_tabs else lines[i])
                    i += 1
                if i >= len(lines):
                    raise UserError(f"{source} line {start}: heredoc <<{name} is never closed by a line '{name}'")
                i += 1  # the terminator
                heredocs.append(Heredoc(name=name, body="\n".join(body), expand=not quote))
        steps.append(Step(instruction=instr, text=rest, line=start, heredocs=tuple(heredocs)))
    return steps


def parse_env(step: Step) -> dict[str, str]:
    """ENV/ARG: `K=v K2="v 2"` or the legacy `K value` form (ARG without a default gives '')."""
    text = step.text.strip()
    if not text:
        raise UserError(f"{step.describe()}: {step.instruction} needs a name")
    first = text.split(None, 1)
    if "=" not in first[0]:
        if step.instruction == "ARG":
            return {first[0]: ""}
        return {first[0]: first[1] if len(first) > 1 else ""}
    out = {}
    try:
        parts = shlex.split(text)
    except ValueError as e:
        raise UserError(f"{step.describe()}: {e}") from None
    for p in parts:
        k, eq, v = p.partition("=")
        if not eq:
            raise UserError(f"{step.describe()}: expected KEY=value, got {p!r}")
        out[k] = v
    return out


def expand(text: str, env: dict[str, str]) -> str:
    """Docker's $VAR / ${VAR} / ${VAR:-default} substitution for WORKDIR, COPY, ENV and USER."""

    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        if name in env and env[name] != "":
            return env[name]
        return m.group(2) or ""

    return _VAR_RE.sub(sub, text)
