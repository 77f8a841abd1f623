"""The procedural generator: at least 15 families across the terminal domains, three difficulty tiers, tasks in
the Endless Terminals layout with ET-style Dockerfiles, deterministic in the seed, and train/val/test splits that
are disjoint by construction (held-out parameter combinations and held-out variants)."""

import collections
import hashlib
import json
import pathlib
import random
import subprocess
import sys

import pytest

from asyncres_jax.envs.dockerfile import parse_dockerfile
from asyncres_jax.envs.generator import DIFFICULTIES, FAMILIES, generate, split_sizes
from asyncres_jax.envs.generator.spec import write_task
from asyncres_jax.envs.task import load_dataset, load_split, read_split
from asyncres_jax.errors import UserError


def tree_digest(root: pathlib.Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
            h.update(str(p.stat().st_mode & 0o777).encode())
    return h.hexdigest()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen") / "ds"
    generate(root, 160, seed=11)
    return root


def test_at_least_15_families_over_the_terminal_domains():
    assert len(FAMILIES) >= 15
    domains = {f.domain for f in FAMILIES.values()}
    assert {"files", "search_replace", "counting", "csv_json", "archives", "permissions", "links", "find", "logs",
            "sorting", "config", "scripting", "checksums", "text"} <= domains
    assert sum(bool(f.held_out) for f in FAMILIES.values()) >= 5


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_tier_and_variant_renders_a_valid_task(tmp_path, name):
    fam = FAMILIES[name]
    for difficulty in DIFFICULTIES:
        for variant in fam.variants:
            spec = fam.build(random.Random(f"{name}{difficulty}{variant}"), difficulty, variant)
            assert len(spec.checks) >= 2, "several final-state tests, so partial credit means something"
            assert len({n for n, _ in spec.checks}) == len(spec.checks)
            d = write_task(tmp_path, f"{name}-{variant}-{difficulty}", spec,
                           {"family": name, "difficulty": difficulty, "variant": variant})
            compile((d / "tests" / "test_final_state.py").read_text(), "final", "exec")
            compile((d / "environment" / "test_initial_state.py").read_text(), "initial", "exec")
    tasks = load_dataset(tmp_path)
    assert {t.difficulty for t in tasks} == set(DIFFICULTIES)


def test_dockerfiles_follow_the_endless_terminals_style(dataset):
    for t in load_dataset(dataset)[:40]:
        text = t.dockerfile.read_text()
        steps = parse_dockerfile(text)
        assert steps[0].instruction == "FROM" and steps[0].text == "ubuntu:22.04"
        assert "apt-get install -y python3 python3-pip" in text and "pip3 install pytest" in text
        assert "useradd -m -s /bin/bash user" in text and "chown -R user:user /home/user" in text
        assert steps[-1].instruction == "WORKDIR" and steps[-1].text == "/home/user"
        assert (t.tests_dir / "test.sh").read_text().count("/logs/verifier/reward.txt") == 2
        assert t.initial_state_test is not None and t.solution is not None
        assert t.metadata["family"] in FAMILIES and t.difficulty in DIFFICULTIES


def test_same_seed_same_bytes_other_seed_other_tasks(tmp_path):
    generate(tmp_path / "a", 24, seed=5)
    generate(tmp_path / "b", 24, seed=5)
    generate(tmp_path / "c", 24, seed=6)
    assert tree_digest(tmp_path / "a") == tree_digest(tmp_path / "b")
    assert tree_digest(tmp_path / "a") != tree_digest(tmp_path / "c")


def test_splits_partition_the_dataset_with_the_paper_proportions(dataset):
    names = {p.name for p in dataset.iterdir() if p.name != "splits"}
    splits = {s: read_split(dataset, s) for s in ("train", "val", "test")}
    assert {s: len(v) for s, v in splits.items()} == split_sizes(160) == {"train": 135, "val": 6, "test": 19}
    assert set().union(*map(set, splits.values())) == names and sum(map(len, splits.values())) == len(names)
    for s, tasks in ((s, load_split(dataset, s)) for s in splits):
        assert all(t.metadata["split"] == s for t in tasks)
    diffs = collections.Counter(t.difficulty for t in load_split(dataset, "train"))
    assert min(diffs.values()) >= 30  # tiers balanced


def test_splits_are_disjoint_by_construction_across_seeds(tmp_path):
    """A parameter combination belongs to one split whatever the seed; held-out variants are test-only."""
    seen: dict[str, set[str]] = collections.defaultdict(set)
    for seed in (1, 2, 3):
        generate(tmp_path / str(seed), 100, seed=seed)
        for t in load_dataset(tmp_path / str(seed)):
            seen[t.metadata["combination"]].add(t.metadata["split"])
            if t.metadata["variant"] in FAMILIES[t.family].held_out:
                assert t.metadata["split"] == "test"
    assert all(len(s) == 1 for s in seen.values())
    assert len(seen) > 250  # combinations rarely repeat: the parameters really vary


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "asyncres_jax.tasks", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_generate_and_list(tmp_path):
    r = run_cli("generate", "--out", str(tmp_path / "ds"), "--n", "20", "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"out": str(tmp_path / "ds"), "train": 17, "val": 1, "test": 2}
    r = run_cli("list", str(tmp_path / "ds"), "--split", "test", "--json")
    rows = [json.loads(ln) for ln in r.stdout.splitlines()]
    assert [x["task"] for x in rows] == read_split(tmp_path / "ds", "test")
    assert all(x["split"] == "test" and x["family"] in FAMILIES for x in rows)
    again = run_cli("generate", "--out", str(tmp_path / "ds"), "--n", "20", "--seed", "3")
    assert again.returncode == 2 and again.stderr.startswith("error: ") and again.stderr.count("\n") == 1
    bad = run_cli("check", str(tmp_path / "nowhere"), "--noop")
    assert bad.returncode == 2 and "does not exist" in bad.stderr


def test_generation_can_be_restricted_to_some_families(tmp_path):
    splits = generate(tmp_path / "ds", 40, seed=3, families=["basics", "rename"])
    tasks = load_dataset(tmp_path / "ds")
    assert {t.family for t in tasks} == {"basics", "rename"} and sum(map(len, splits.values())) == 40
    for split, names in splits.items():  # each task sits in the split its combination belongs to
        assert all(t.metadata["split"] == split for t in tasks if t.name in names)
    with pytest.raises(UserError, match="unknown task families"):
        generate(tmp_path / "other", 4, seed=3, families=["nope"])
