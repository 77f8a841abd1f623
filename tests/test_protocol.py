"""The Endless Terminals protocol: how replies are parsed and what the model is told back."""

import pytest

from asyncres_jax.envs.sandbox import CommandResult
from asyncres_jax.rollout import protocol
from asyncres_jax.rollout.protocol import NUDGE, Reply, observation, parse_reply


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("<think>list first</think><command>ls -la</command>", Reply("command", "ls -la")),
        ("<command>  cat a.txt\n</command>", Reply("command", "cat a.txt")),
        # several commands: the LAST block runs
        ("<command>ls</command> then <command>pwd</command>", Reply("command", "pwd")),
        ("<command>echo a</command>\n<command>echo b</command>\n<command>echo c</command>", Reply("command", "echo c")),
        # done wins over any command, before or after it
        ("<command>rm x</command><action>done</action>", Reply("done")),
        ("<action>done</action><command>rm x</command>", Reply("done")),
        ("<think>all checked</think>\n<action> done </action>", Reply("done")),
        # multi-line commands keep their inner newlines
        ("<command>cat > f <<'EOF'\na\nEOF</command>", Reply("command", "cat > f <<'EOF'\na\nEOF")),
        # a command block nested in a broken one: the innermost, last block runs
        ("<command>echo <command>id</command>", Reply("command", "id")),
    ],
)
def test_commands_and_done(reply, expected):
    assert parse_reply(reply) == expected


@pytest.mark.parametrize(
    "reply",
    [
        "",
        "   \n",
        "I will list the files.",
        "<think>hmm</think>",
        "<command></command>",  # empty command
        "<command>   </command>",
        "<command>ls",  # never closed
        "ls</command>",  # never opened
        "</command>ls<command>",  # closed before opened
        "<cmd>ls</cmd>",
        "<action>finish</action>",
        "<action>done",  # malformed done
    ],
)
def test_anything_else_gets_the_nudge(reply):
    assert parse_reply(reply) == Reply("invalid")


def test_thinking_is_not_acted_on():
    # a command or done that is only thought about does not run
    assert parse_reply("<think>maybe <command>rm -rf ~</command></think>") == Reply("invalid")
    assert parse_reply("<think>not <action>done</action> yet</think><command>ls</command>") == Reply("command", "ls")
    # the last command outside thinking runs, even when one inside thinking comes later
    assert parse_reply("<command>ls</command><think>or <command>pwd</command>?</think>") == Reply("command", "ls")


def test_nested_think_is_removed_as_a_whole():
    reply = "<think>outer <think>inner</think> still thinking <command>rm a</command></think><command>ls</command>"
    assert parse_reply(reply) == Reply("command", "ls")
    reply = "<think>a<think>b<think>c</think></think><action>done</action></think><command>pwd</command>"
    assert parse_reply(reply) == Reply("command", "pwd")
    assert protocol.strip_thinking("x<think>1<think>2</think>3</think>y").replace(" ", "") == "xy"


def test_unclosed_think_does_not_hide_the_final_command():
    # generation stops at </command>, so a reply may end inside a think block it never closed
    assert parse_reply("<think>let me look <command>ls</command>") == Reply("command", "ls")
    assert parse_reply("<think>a <think>b</think> <command>ls</command>") == Reply("command", "ls")


def test_observation_texts():
    ok = CommandResult(output="a.txt\nb.txt\n", exit_code=0, timed_out=False, seconds=0.01)
    assert observation(ok, 30) == "Command executed successfully. Output: a.txt\nb.txt\n (exit_code=0)"
    failed = CommandResult(output="ls: cannot access 'x'", exit_code=2, timed_out=False, seconds=0.01)
    assert observation(failed, 30) == "Command failed. Output: ls: cannot access 'x' (exit_code=2)"
    slow = CommandResult(output="partial", exit_code=137, timed_out=True, seconds=30.0)
    assert observation(slow, 30) == (
        "Command timed out after 30 seconds and was killed. Output: partial (exit_code=137)"
    )
    assert "2.5 seconds" in observation(slow, 2.5)


def test_observation_strips_ansi_and_caps_output():
    colored = CommandResult(output="\x1b[31mred\x1b[0m", exit_code=0, timed_out=False, seconds=0.0)
    assert observation(colored, 30) == "Command executed successfully. Output: red (exit_code=0)"
    flood = CommandResult(output="y\n" * 100_000, exit_code=0, timed_out=False, seconds=0.0)
    text = observation(flood, 30, cap=1000)
    assert len(text) < 1200 and text.count("y\n") == 500 and "truncated" in text
    assert len(observation(flood, 30)) < 50_000 + 200  # the default cap is the paper's 50,000 characters


def test_first_messages_and_prompt_rules():
    messages = protocol.first_messages("  Create /home/user/out.txt.\n")
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[1]["content"] == "Create /home/user/out.txt."
    prompt = messages[0]["content"]
    for rule in ("<think>", "<command>", "<action>done</action>", "non-interactive", "/home/user"):
        assert rule in prompt
    assert "<command></command>" in NUDGE and "<action>done</action>" in NUDGE


@pytest.mark.parametrize("line, reply", [
    ("mv a.txt b.txt\n", "<command>mv a.txt b.txt</command>"),
    ("rm x.log\n\nThis command deletes the file.", "<command>rm x.log</command>"),  # prose after the line is cut
    ("ls -la</command>", "<command>ls -la</command>"),  # a model that does close the tag
    ("done\n", "<action>done</action>"),
    ("<action>done</action>", "<action>done</action>"),
    ("\nprose on the next line", "<command></command>"),  # an empty line is no command: the parser nudges
])
def test_command_per_line_scaffold_closes_one_line(line, reply):
    assert protocol.close_command_line(line) == reply
    assert parse_reply(reply) == (Reply("done") if "done" in reply else
                                  Reply("command", reply[9:-10]) if reply[9:-10] else Reply("invalid"))
