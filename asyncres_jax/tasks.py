"""python -m asyncres_jax.tasks generate|check|list|play ...

  generate --out DIR --n N --seed S            write N procedurally generated tasks and DIR/splits/*.txt
  check DIR... --backend bwrap|docker (--oracle | --noop) [--json] [--initial] [--split S]
                                               run each task's oracle (or nothing), grade, one line per task
  list DIR [--split S] [--json]                the tasks of a dataset (or split) with family and difficulty
  play TASK --backend bwrap|docker --commands FILE [--json]
                                               play a scripted episode, print the transcript and reward

DIR may be one task directory or a dataset folder of them. `check` exits 1 when a task scores other than
expected (1 with --oracle, 0 with --noop) or its initial-state tests fail, and 3 when some task could not be
checked at all (its image did not build, its container did not start, it has no oracle): such a task's line
carries "error" and no reward, and the other tasks are still checked.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

from asyncres_jax.errors import UserError, cli_main

# subcommand name -> (help, add_arguments(parser), run(args) -> int); other modules may register more (play)
COMMANDS: dict[str, tuple[str, callable, callable]] = {}


def command(name: str, help: str, add_arguments):
    def register(fn):
        COMMANDS[name] = (help, add_arguments, fn)
        return fn

    return register


def _tasks_of(dirs: list[str], split: str | None):
    from asyncres_jax.envs.task import load_dataset, load_split

    tasks = []
    for d in dirs:
        tasks += load_split(d, split) if split else load_dataset(d)
    if not tasks:
        raise UserError("no tasks selected")
    return tasks


# --- generate ---------------------------------------------------------------------------------------------

def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="folder to write the dataset into (new or empty)")
    p.add_argument("--n", type=int, required=True, help="number of tasks")
    p.add_argument("--seed", type=int, default=0, help="generator seed (same seed, same tasks)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out folder")
    p.add_argument("--families", nargs="+", default=[], metavar="FAMILY",
                   help="generate only these families (default: all); an unknown name lists the known ones")


@command("generate", "write procedurally generated tasks (Endless Terminals layout) and splits", _generate_args)
def cmd_generate(args) -> int:
    from asyncres_jax.envs.generator import generate

    splits = generate(args.out, args.n, args.seed, force=args.force, families=args.families)
    print(json.dumps({"out": str(args.out), **{k: len(v) for k, v in splits.items()}}))
    return 0


# --- check ------------------------------------------------------------------------------------------------

def _check_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dirs", nargs="+", metavar="DIR", help="task directories or dataset folders")
    p.add_argument("--backend", default="bwrap", choices=("bwrap", "docker"))
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--oracle", action="store_true", help="run solution/solve.sh, then grade (expect 1)")
    mode.add_argument("--noop", action="store_true", help="grade the untouched starting state (expect 0)")
    p.add_argument("--initial", action="store_true", help="also run environment/test_initial_state.py first")
    p.add_argument("--split", choices=("train", "val", "test"), help="only the tasks of this split of DIR")
    p.add_argument("--workers", type=int, default=min(16, 2 * (os.cpu_count() or 1)),
                   help="tasks checked at once (default: 2 per CPU, at most 16)")
    p.add_argument("--json", action="store_true", help="one JSON object per task and line")


@command("check", "run each task's oracle (or nothing) in a sandbox and grade it", _check_args)
def cmd_check(args) -> int:
    from asyncres_jax.envs import make_backend
    from asyncres_jax.envs.check import check_tasks

    tasks = _tasks_of(args.dirs, args.split)
    want = 1 if args.oracle else 0
    bad = errors = 0
    with make_backend(args.backend) as backend:
        for rec in check_tasks(backend, tasks, workers=args.workers, oracle=args.oracle, initial=args.initial):
            errors += "error" in rec
            ok = "error" not in rec and rec["reward"] == want and rec.get("initial", 1) == 1
            bad += not ok and "error" not in rec
            if args.json:
                print(json.dumps(rec), flush=True)
            elif "error" in rec:
                print(f"ERR {rec['task']}  {rec['error']}", flush=True)
            else:
                extra = f"  initial={rec['initial']}" if "initial" in rec else ""
                print(f"{'ok ' if ok else 'BAD'} {rec['task']}  reward={rec['reward']:g} partial={rec['partial']:.2f}"
                      f"{extra}  {rec.get('seconds', 0):.2f}s", flush=True)
    if not args.json:
        print(f"{len(tasks) - bad - errors}/{len(tasks)} tasks as expected, {errors} could not be checked",
              file=sys.stderr)
    return 3 if errors else 1 if bad else 0


# --- list -------------------------------------------------------------------------------------------------

def _list_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dirs", nargs="+", metavar="DIR")
    p.add_argument("--split", choices=("train", "val", "test"))
    p.add_argument("--json", action="store_true")


@command("list", "list a dataset's tasks with family and difficulty", _list_args)
def cmd_list(args) -> int:
    tasks = _tasks_of(args.dirs, args.split)
    for t in tasks:
        if args.json:
            print(json.dumps({"task": t.name, "path": str(t.path), **{k: v for k, v in t.metadata.items()
                                                                       if isinstance(v, (str, int, float))}}))
        else:
            print(f"{t.name}\t{t.family or '-'}\t{t.difficulty or '-'}")
    if not args.json:
        by = collections.Counter(t.difficulty or "-" for t in tasks)
        print(f"{len(tasks)} tasks: " + ", ".join(f"{k} {v}" for k, v in sorted(by.items())), file=sys.stderr)
    return 0


# --- play (asyncres_jax/rollout/play.py) ------------------------------------------------------------------

def _play_args(p: argparse.ArgumentParser) -> None:
    from asyncres_jax.rollout.play import add_arguments

    add_arguments(p)


@command("play", "play one scripted episode (one command a line) and print the transcript and reward", _play_args)
def cmd_play(args) -> int:
    from asyncres_jax.rollout.play import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m asyncres_jax.tasks", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help, add_arguments, _) in COMMANDS.items():
        add_arguments(sub.add_parser(name, help=help))
    return parser


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return COMMANDS[args.command][2](args)


if __name__ == "__main__":
    sys.exit(main())
