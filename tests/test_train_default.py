"""The headline command: `python -m asyncres_jax.train --mesh 8x1` without a config runs the built-in default (the
CPU default, the sandbox chosen from what the machine has), scaled to the mesh (workers per replica follow the
population); a mesh asking for more devices than there are is one line naming the meshes that fit and
--cpu-devices; the CPU default on an 8x1 mesh runs to the end."""

import pathlib
import subprocess
import sys

import pytest
from bwrap_support import bwrap_or_skip

from asyncres_jax import envs, metrics, train
from asyncres_jax.errors import UserError
from asyncres_jax.trainer import rollout_workers

REPO = pathlib.Path(__file__).resolve().parent.parent


def config_of(*argv):
    return train._load(train._parse(list(argv)))


def test_no_config_is_the_cpu_default_with_the_sandbox_chosen_from_the_machine():
    cfg = config_of("--mesh", "8x1")
    cpu = config_of("--config", str(REPO / "configs" / "smollm2_cpu.yaml"))
    assert (cfg.model.name, cfg.tasks.dataset, cfg.es.population, cfg.mesh) == (
        cpu.model.name, cpu.tasks.dataset, cpu.es.population, "8x1")
    assert (cfg.sandbox.backend, cfg.run_dir, cpu.sandbox.backend) == ("auto", "runs/default", "bwrap")
    # naming a dataset composes a config on the schema defaults (what tests and library users do)
    bare = config_of("tasks.dataset=fake", "model.name=tiny")
    assert (bare.es.population, bare.sandbox.backend, bare.pool.workers_per_replica) == (30, "bwrap", 1)


@pytest.mark.parametrize("population, replicas, per_replica, expected", [
    (8, 1, 4, (1, 4)),  # the CPU default on 1x1: as configured
    (8, 2, 4, (2, 3)),  # fewer workers per replica so that N > workers
    (8, 8, 4, (7, 1)),  # more replicas than N - 1: N - 1 of them run jobs
    (30, 8, 1, (8, 1)),
    (30, 4, 8, (4, 7)),
])
def test_workers_per_replica_follow_the_population_and_the_mesh(population, replicas, per_replica, expected):
    used, per = rollout_workers(population, replicas, per_replica)
    assert (used, per) == expected and used * per < population


def test_sandbox_auto_takes_bwrap_then_docker_then_says_why_not(monkeypatch):
    from asyncres_jax.envs import bwrap, docker_backend

    monkeypatch.setattr(bwrap, "host_problem", lambda: None)
    assert envs.choose_backend("auto") == "bwrap"
    assert envs.choose_backend("docker") == "docker"
    monkeypatch.setattr(bwrap, "host_problem", lambda: "no user namespaces")
    monkeypatch.setattr(docker_backend, "engine_available", lambda: True)
    assert envs.choose_backend("auto") == "docker"
    monkeypatch.setattr(docker_backend, "engine_available", lambda: False)
    with pytest.raises(UserError, match="bwrap cannot isolate here .no user namespaces.* no Docker-API engine"):
        envs.choose_backend("auto")


@pytest.mark.parametrize("args", [["--mesh", "16x1"], ["--mesh", "4x4", "--config", "configs/smollm2_cpu.yaml"]])
def test_a_mesh_larger_than_the_machine_is_one_line_naming_cpu_devices(capsys, tmp_path, args):
    code = train.main([*args, f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0] == (f"error: mesh {args[1]} needs 16 devices but this machine has 8; meshes that fit: 1x1, 8x1, "
                      "4x2, 2x4, 1x8; or simulate 16 CPU devices with --cpu-devices 16")
    assert not (tmp_path / "run").exists()


@pytest.mark.bwrap
@pytest.mark.parametrize("model", [
    pytest.param(["model.name=tiny"], id="tiny"),  # the same run with the tiny random model: fits any test machine
    # ~3 CPU-minutes, 9 GB peak (13 GB when every replica held its own masters): never beside the other 12 GB test
    pytest.param([], id="smollm2", marks=[pytest.mark.slow, pytest.mark.xdist_group("big_memory")]),
])
def test_the_cpu_default_runs_to_the_end_on_an_8x1_mesh(tmp_path, model):
    bwrap_or_skip()
    run = tmp_path / "run"
    # The command itself, in a process of its own: its memory is gone when it ends, so the test worker (whose
    # earlier modules hold some) and the other worker keep the room they need on a 24 GB machine.
    proc = subprocess.run(
        [sys.executable, "-m", "asyncres_jax.train", "--config", "configs/smollm2_cpu.yaml", "--mesh", "8x1",
         "--cpu-devices", "8", f"run_dir={run}", f"tasks.dataset={tmp_path / 'tasks'}", "tasks.generate_n=120",
         "es.updates=1", "es.tasks_per_member=2", "eval.every=0", "eval.test_tasks=2", "episode.max_new_tokens=16",
         *model], cwd=REPO, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record,) = metrics.read(run)
    assert record["update"] == 1 and record["episodes"] == 8 * 2
    assert "7 replicas x 1 workers" in proc.stderr
