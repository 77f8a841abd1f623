"""Task directories load and validate by the Harbor / Endless Terminals layout; grading output parses to a Grade."""

import pathlib
import subprocess

import pytest

from asyncres_jax.envs import grading
from asyncres_jax.envs.task import load_dataset, load_split, load_task
from asyncres_jax.errors import UserError

TOML = """\
version = "1.0"
[metadata]
family = "count_lines"
difficulty = "easy"
[agent]
timeout_sec = 200.0
[verifier]
timeout_sec = 60.0
[environment]
cpus = 1
memory = "1G"
"""


def make_task(root: pathlib.Path, name: str = "t1") -> pathlib.Path:
    d = root / name
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "solution").mkdir()
    (d / "instruction.md").write_text("Count the lines of /home/user/a.txt into /home/user/n.txt\n")
    (d / "task.toml").write_text(TOML)
    (d / "environment" / "Dockerfile").write_text("FROM ubuntu:22.04\n")
    (d / "tests" / "test_final_state.py").write_text("def test_ok():\n    assert True\n")
    (d / "solution" / "solve.sh").write_text("wc -l < a.txt > n.txt\n")
    return d


def test_load_task_reads_instruction_timeouts_resources_and_metadata(tmp_path):
    t = load_task(make_task(tmp_path))
    assert t.name == "t1" and t.instruction.startswith("Count the lines")
    assert (t.agent_timeout_s, t.verifier_timeout_s, t.cpus, t.memory_mb) == (200.0, 60.0, 1, 1024)
    assert (t.family, t.difficulty) == ("count_lines", "easy")
    assert t.dockerfile is not None and t.solution is not None and t.setup_script is None
    assert t.initial_state_test is None
    assert len({t, load_task(t.path)}) == 1  # hashable, identified by its directory


@pytest.mark.parametrize(
    "breakage, named",
    [
        (lambda d: (d / "instruction.md").unlink(), "instruction.md is missing"),
        (lambda d: (d / "instruction.md").write_text("  \n"), "instruction.md is empty"),
        (lambda d: (d / "task.toml").unlink(), "task.toml is missing"),
        (lambda d: (d / "task.toml").write_text("[agent\n"), "task.toml is not valid TOML"),
        (lambda d: (d / "task.toml").write_text("[agent]\ntimeout_sec = -1\n"), "agent.timeout_sec"),
        (lambda d: (d / "environment" / "Dockerfile").unlink(), "environment/Dockerfile is missing"),
        (lambda d: (d / "tests" / "test_final_state.py").unlink(), "tests/test_final_state.py is missing"),
    ],
)
def test_validation_names_the_missing_or_malformed_file(tmp_path, breakage, named):
    d = make_task(tmp_path)
    breakage(d)
    with pytest.raises(UserError, match=named):
        load_task(d)


def test_setup_script_or_test_sh_are_enough(tmp_path):
    d = make_task(tmp_path)
    (d / "environment" / "Dockerfile").unlink()
    (d / "environment" / "setup.sh").write_text("echo hi > /home/user/a.txt\n")
    (d / "tests" / "test_final_state.py").unlink()
    (d / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    t = load_task(d)
    assert t.setup_script is not None and t.dockerfile is None


def test_dataset_and_splits(tmp_path):
    for n in ("a", "b", "c"):
        make_task(tmp_path, n)
    (tmp_path / "splits").mkdir()
    (tmp_path / "splits" / "train.txt").write_text("c\na\n\n")
    assert [t.name for t in load_dataset(tmp_path)] == ["a", "b", "c"]
    assert [t.name for t in load_split(tmp_path, "train")] == ["c", "a"]
    with pytest.raises(UserError, match="splits/val.txt is missing"):
        load_split(tmp_path, "val")
    (tmp_path / "splits" / "test.txt").write_text("zzz\n")
    with pytest.raises(UserError, match="lists 'zzz'"):
        load_split(tmp_path, "test")
    with pytest.raises(UserError, match="unknown split"):
        load_split(tmp_path, "dev")


def _run_grade_script(tests: pathlib.Path, logs: pathlib.Path, shims: pathlib.Path | None = None) -> str:
    """Run the grading script on this host with /tests and /logs/verifier redirected to temp folders."""
    script = grading.grade_script(workdir=str(tests), shims_dir=str(shims) if shims else None)
    script = script.replace(grading.TESTS_DIR, str(tests)).replace(grading.VERIFIER_DIR, str(logs))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(logs)}
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60).stdout


FINAL = "def test_a():\n    assert True\n\ndef test_b():\n    assert True\n\ndef test_c():\n    assert False\n"


@pytest.fixture
def host_pytest():
    if subprocess.run(["/usr/bin/python3", "-c", "import pytest"], capture_output=True).returncode:
        pytest.skip("the host's /usr/bin/python3 has no pytest (scripts/setup_system.sh installs python3-pytest)")


def test_pytest_mode_counts_partial_credit(tmp_path, host_pytest):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_final_state.py").write_text(FINAL)
    g = grading.parse_grade(_run_grade_script(tmp_path / "tests", tmp_path / "logs"))
    assert (g.reward, g.passed, g.total) == (0, 2, 3) and g.partial == pytest.approx(2 / 3)
    (tmp_path / "tests" / "test_final_state.py").write_text(FINAL.replace("assert False", "assert 1"))
    g = grading.parse_grade(_run_grade_script(tmp_path / "tests", tmp_path / "logs"))
    assert (g.reward, g.passed, g.total, g.partial) == (1, 3, 3, 1.0)


def test_et_style_test_sh_runs_offline_with_the_shims(tmp_path, host_pytest):
    """An Endless Terminals test.sh (apt-get, curl | sh of uv, uvx --with ..., --ctrf) runs without network."""
    tests, logs = tmp_path / "tests", tmp_path / "logs"
    tests.mkdir()
    (tests / "test_final_state.py").write_text(FINAL.replace("assert False", "assert 1"))
    (tests / "test.sh").write_text(
        "#!/bin/bash\napt-get update\napt-get install -y curl\n"
        "curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh\nsource $HOME/.local/bin/env\n"
        f"uvx -p 3.13 -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 pytest --ctrf {logs}/ctrf.json "
        f"{tests}/test_final_state.py -rA\n"
        f"if [ $? -eq 0 ]; then echo 1 > {logs}/reward.txt; else echo 0 > {logs}/reward.txt; fi\n"
    )
    out = _run_grade_script(tests, logs, grading.write_offline_shims(tmp_path / "shims"))
    g = grading.parse_grade(out)
    assert (g.reward, g.passed, g.total) == (1, 3, 3), out[-2000:]


def test_parse_grade_reward_file_decides_in_test_sh_mode():
    summary = "===== 1 failed, 3 passed in 0.10s =====\n"
    assert grading.parse_grade(summary + "@@asyncres-grade mode=test.sh status=0 reward=1\n").reward == 1
    assert grading.parse_grade(summary + "@@asyncres-grade mode=test.sh status=0 reward=0\n").reward == 0
    g = grading.parse_grade(summary + "@@asyncres-grade mode=test.sh status=1 reward=\n")
    assert (g.reward, g.passed, g.total, g.partial) == (0, 3, 4, 0.75)
    # no marker: the script never finished (timed out, killed)
    assert grading.parse_grade(summary).reward == 0
    # -q summaries have no rules; errors count as failures
    assert grading.count_tests("2 passed, 1 error in 0.5s\n") == (2, 3)


def test_reward_json_metrics_are_all_kept_and_the_reward_is_named_or_the_mean():
    def out(json_text: str | None, txt: str = "") -> str:
        body = f"{grading.JSON_MARKER}\n{json_text}\n{grading.JSON_MARKER}\n" if json_text is not None else ""
        return body + f"{grading.MARKER} mode=test.sh status=0 reward={txt}\n"

    g = grading.parse_grade(out('{"correctness": 1.0, "style": 0.5}'))
    assert (g.reward, dict(g.rewards)) == (0.75, {"correctness": 1.0, "style": 0.5})  # no `reward`: the mean
    assert (g.metric("style"), g.metric(), g.metric("absent")) == (0.5, 0.75, 0.75)
    g = grading.parse_grade(out('{"reward": 0.0, "speed": 1}'))
    assert (g.reward, dict(g.rewards)) == (0.0, {"reward": 0.0, "speed": 1.0})  # `reward` when written
    g = grading.parse_grade(out('{"tests": 1}', txt="0"))  # both files: reward.txt adds `reward`, which decides
    assert (g.reward, dict(g.rewards)) == (0.0, {"tests": 1.0, "reward": 0.0})
    for bad in ("{not json", "[1, 2]", '{"note": "text only"}'):
        g = grading.parse_grade(out(bad, txt="1"))
        assert g.reward == 0 and "reward.json" in g.log, bad  # an unreadable reward file is not a pass
    assert grading.parse_grade(out(None, txt="0.5")).reward == 0  # reward.txt alone: 1 only when it says >= 1


def test_a_reward_json_written_by_test_sh_is_read(tmp_path):
    tests, logs = tmp_path / "tests", tmp_path / "logs"
    tests.mkdir()
    (tests / "test.sh").write_text(f"#!/bin/bash\necho '{{\"a\": 1, \"b\": 0}}' > {logs}/reward.json\n")
    g = grading.parse_grade(_run_grade_script(tests, logs))
    assert (g.reward, dict(g.rewards)) == (0.5, {"a": 1.0, "b": 0.0})


def test_a_tests_output_cannot_pose_as_the_reward_json(tmp_path):
    """Something the tests run prints a fake reward.json block; the grader's own (empty) block comes last."""
    tests, logs = tmp_path / "tests", tmp_path / "logs"
    tests.mkdir()
    (tests / "test.sh").write_text(f"#!/bin/bash\nprintf '{grading.JSON_MARKER}\\n{{\"reward\": 1}}\\n"
                                   f"{grading.JSON_MARKER}\\n'\necho 0 > {logs}/reward.txt\n")
    g = grading.parse_grade(_run_grade_script(tests, logs))
    assert (g.reward, dict(g.rewards)) == (0, {"reward": 0.0})
