"""`python -m asyncres_jax.tasks play`: a scripted episode through run_episodes on a real sandbox."""

from __future__ import annotations

import json
import pathlib

import pytest

from asyncres_jax.tasks import main

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "et_error_summary"
SOLUTION = r"""# the oracle, one command a line
mkdir -p /home/user/reports

grep -o '\[[a-z]*\] ERROR' logs/app.log | tr -d '[]' | cut -d' ' -f1 | sort | uniq -c | awk '{print $2, $1}' | sort -k2,2nr -k1,1 > reports/error_summary.txt
cat reports/error_summary.txt
"""  # noqa: E501 (the oracle runs one command a line)

pytestmark = pytest.mark.bwrap


def test_play_prints_the_transcript_and_the_reward(tmp_path, capsys):
    commands = tmp_path / "commands.txt"
    commands.write_text(SOLUTION)
    assert main(["play", str(FIXTURE), "--backend", "bwrap", "--commands", str(commands)]) == 0
    out = capsys.readouterr().out
    assert "--- assistant\n<command>mkdir -p /home/user/reports</command>" in out
    assert "Command executed successfully. Output: billing 3\nauth 2\nmailer 1\nsearch 1\n (exit_code=0)" in out
    assert out.rstrip().splitlines()[-1].startswith("=== et_error_summary: done after 4 turns, reward=1 partial=1.00")


def test_play_json_and_a_failing_script(tmp_path, capsys):
    commands = tmp_path / "commands.txt"
    commands.write_text("ls reports\n")
    assert main(["play", str(FIXTURE), "--commands", str(commands), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert (record["task_id"], record["reward"], record["turns"], record["end"]) == ("et_error_summary", 0.0, 2, "done")
    assert record["commands"] == ["ls reports"]
    assert record["transcript"][3]["content"].startswith("Command failed. Output: ls: cannot access 'reports'")
    assert record["transcript"][3]["content"].endswith("(exit_code=2)")


def test_play_bad_input_is_one_line(tmp_path, capsys):
    assert main(["play", str(FIXTURE), "--commands", str(tmp_path / "missing.txt")]) == 2
    assert capsys.readouterr().err == (f"error: --commands {tmp_path / 'missing.txt'}: no such file; give a file "
                                       "with one shell command a line\n")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n# nothing\n")
    assert main(["play", str(FIXTURE), "--commands", str(empty)]) == 2
    assert "holds no commands" in capsys.readouterr().err
