"""The Endless Terminals agent protocol: system prompt, reply parsing, observation texts and the nudge.

A reply may think inside <think>...</think>, then either runs one shell command, <command>...</command>, or
ends the episode with <action>done</action>. Parsing follows the reference rules (the paper's): `done` wins;
otherwise the LAST command block runs; anything else is answered with a fixed nudge. Thinking is the model
talking to itself, so a command or `done` inside a closed <think> block is not acted on.
"""

from __future__ import annotations

import dataclasses
import re

from asyncres_jax.envs.sandbox import OUTPUT_CAP, CommandResult, clean_output

SYSTEM_PROMPT = """\
You are an agent operating a Linux terminal to complete a task for the user. You work as an unprivileged \
user whose home and working directory is /home/user.

Each reply you write must follow this format:
1. Reason about the next step inside <think></think> tags.
2. Then give exactly ONE of:
   - a single shell command to run, inside <command></command> tags, for example
     <command>ls -la /home/user</command>
   - or <action>done</action> once the task is fully complete.

After each command you will see its output and exit code. Rules:
- The shell is not interactive: never start editors, pagers or prompts (no vim, less, top, ssh, or
  commands waiting for input). Use non-interactive flags such as `-y`, `-f`, `--no-pager`, `cat`, `sed -i`,
  `printf`, and here-documents to write files.
- One command per reply; chain steps with `&&` or `;` when needed. Long-running commands are killed.
- Check your work (list files, print contents, run the script) before you declare the task done.
"""

# For the one-command-per-line scaffold (the reply's "<command>" is given, the harness closes the tag), where most
# rules above are moot: ~100 prompt tokens instead of ~300 (one 128-slot prefill block instead of 384 slots). Its
# example command matters: without one SmolLM2-135M answers every prompt with an empty line.
SHORT_SYSTEM_PROMPT = (
    "You are an agent operating a Linux terminal as an unprivileged user whose home is /home/user. Reply with one "
    "shell command inside <command></command> tags, for example <command>ls -la /home/user</command>, or with "
    "<action>done</action> once the task is complete.")
# The full prompt without its <think> format (the one-command-per-line scaffold never asks for reasoning) and with
# its rules folded into two sentences: ~145 prompt tokens, so a first prompt and its reply fit a 256-slot cache.
# Unlike the short prompt, SmolLM2-135M solves at least as many tasks with it as with the full one
# (docs/performance.md).
COMPACT_SYSTEM_PROMPT = """\
You are an agent operating a Linux terminal to complete a task for the user. You work as an unprivileged \
user whose home and working directory is /home/user.

Reply with exactly ONE shell command inside <command></command> tags, for example
<command>ls -la /home/user</command>
or with <action>done</action> once the task is fully complete.

After each command you will see its output and exit code. The shell is not interactive: never start editors, \
pagers or prompts; write files with `printf`, `cat`, `sed -i` or here-documents. Check your work before you \
declare the task done.
"""
SYSTEM_PROMPTS = {"full": SYSTEM_PROMPT, "compact": COMPACT_SYSTEM_PROMPT, "short": SHORT_SYSTEM_PROMPT}

NUDGE = (
    "I could not find a command in your reply. Reply with exactly one shell command inside "
    "<command></command> tags, or with <action>done</action> if the task is complete."
)

# Generation can stop at these: nothing the parser uses comes after the first of them in a well-formed reply.
STOP_STRINGS = ("</command>", "</action>")

_THINK_PAIR_RE = re.compile(r"<think>(?:(?!<think>).)*?</think>", re.DOTALL)
_DONE_RE = re.compile(r"<action>\s*done\s*</action>", re.IGNORECASE)
COMMAND_OPEN, COMMAND_CLOSE = "<command>", "</command>"


@dataclasses.dataclass(frozen=True)
class Reply:
    """What a model reply asks for: `kind` is "command" (with `command`), "done", or "invalid" (nudge)."""

    kind: str
    command: str = ""


def strip_thinking(text: str) -> str:
    """Remove closed <think>...</think> blocks, innermost first, so nested thinking goes as a whole.

    An unclosed <think> is left in place: generation stops at `</command>`, so a reply that opened a think block
    and then wrote its command must not lose the command to the missing close tag.
    """
    while True:
        stripped = _THINK_PAIR_RE.sub(" ", text)
        if stripped == text:
            return text
        text = stripped


def parse_reply(text: str) -> Reply:
    """Parse one model reply by the protocol's rules (see the module docstring)."""
    visible = strip_thinking(text)
    if _DONE_RE.search(visible):
        return Reply("done")
    end = visible.rfind(COMMAND_CLOSE)
    if end >= 0:
        start = visible.rfind(COMMAND_OPEN, 0, end)
        if start >= 0:
            command = visible[start + len(COMMAND_OPEN) : end].strip()
            if command:
                return Reply("command", command)
    return Reply("invalid")


def close_command_line(line: str) -> str:
    """The reply of the one-command-per-line scaffold (ModelPolicy.command_per_line): what the model wrote after
    the "<command>" it was given, up to the end of its line, as a well-formed reply; `done` ends the episode."""
    line = line.split("\n", 1)[0]
    if COMMAND_CLOSE in line:
        line = line[:line.index(COMMAND_CLOSE)]
    if line.strip().lower() in ("done", "<action>done</action>"):
        return "<action>done</action>"
    return f"{COMMAND_OPEN}{line}{COMMAND_CLOSE}"


def observation(result: CommandResult, timeout_s: float, cap: int = OUTPUT_CAP) -> str:
    """The user message that reports a command's result back to the model."""
    output = clean_output(result.output, cap)
    if result.timed_out:
        return (
            f"Command timed out after {timeout_s:g} seconds and was killed. Output: {output} "
            f"(exit_code={result.exit_code})"
        )
    if result.exit_code == 0:
        return f"Command executed successfully. Output: {output} (exit_code=0)"
    return f"Command failed. Output: {output} (exit_code={result.exit_code})"


def first_messages(instruction: str, system_prompt: str = "full") -> list[dict[str, str]]:
    """The conversation an episode starts from: the system prompt (a SYSTEM_PROMPTS name) and the task instruction
    as the user turn."""
    return [{"role": "system", "content": SYSTEM_PROMPTS[system_prompt]},
            {"role": "user", "content": instruction.strip()}]
