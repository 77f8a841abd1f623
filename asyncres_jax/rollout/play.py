"""`python -m asyncres_jax.tasks play TASK --backend bwrap|docker --commands FILE`: one scripted episode.

The commands (one a line; blank lines and lines starting with # are skipped) are played through run_episodes,
exactly as a model's replies would be, then the policy says done; the transcript and the grade are printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

from asyncres_jax.errors import UserError
from asyncres_jax.rollout.episodes import EpisodeConfig, ScriptedPolicy, format_transcript, run_episodes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("task", metavar="TASK", help="a task directory")
    p.add_argument("--backend", default="bwrap", choices=("bwrap", "docker"))
    p.add_argument("--commands", required=True, metavar="FILE", help="shell commands, one a line ('-': stdin)")
    p.add_argument("--max-turns", type=int, default=EpisodeConfig.max_turns)
    p.add_argument("--command-timeout", type=float, default=EpisodeConfig.command_timeout_s, metavar="SECONDS")
    p.add_argument("--episode-timeout", type=float, default=EpisodeConfig.episode_timeout_s, metavar="SECONDS")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def read_commands(source: str) -> list[str]:
    if source == "-":
        text = sys.stdin.read()
    else:
        path = pathlib.Path(source)
        if not path.is_file():
            raise UserError(f"--commands {source}: no such file; give a file with one shell command a line")
        text = path.read_text()
    commands = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not commands:
        raise UserError(f"--commands {source} holds no commands (blank lines and # comments are skipped)")
    return commands


def run(args: argparse.Namespace) -> int:
    from asyncres_jax.envs import make_backend
    from asyncres_jax.envs.task import load_task

    task = load_task(args.task)
    commands = read_commands(args.commands)
    cfg = EpisodeConfig(max_turns=args.max_turns, command_timeout_s=args.command_timeout,
                        episode_timeout_s=args.episode_timeout)
    with make_backend(args.backend) as backend:
        [result] = run_episodes(ScriptedPolicy(commands), [task], backend, cfg, seed=0)
    if args.json:
        record = {k: v for k, v in dataclasses.asdict(result).items() if k not in ("tokens", "grade")}
        print(json.dumps(record))
    else:
        print(format_transcript(result))
    return 0
