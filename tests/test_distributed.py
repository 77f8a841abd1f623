"""Two JAX processes (4 simulated CPU devices each, gloo collectives, a localhost coordinator) train as one:
2 sync ES updates over a 4x2 global mesh with the fake environment (the first in one session, the second after
a resume from the processes' sharded checkpoint) end with exactly the parameters of the same run in one
process on 8 devices. Plus the cluster flags and launcher variables, and their errors."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from asyncres_jax import distributed, metrics
from asyncres_jax.config import load_config
from asyncres_jax.errors import UserError

ROOT = pathlib.Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "jax"
TIMEOUT_S = 480  # the whole two-run scenario on a loaded CI machine; ~1 minute idle
RUN = ["--mesh", "4x2", "model.name=tiny", "tasks.dataset=fake", "es.population=8", "es.sigma=0.02",
       "es.alpha=0.02", "pool.mode=sync", "checkpoint.keep=3"]


def _gloo_available() -> bool:
    from jax._src.lib import _jax

    return hasattr(_jax, "make_gloo_tcp_collectives")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], log: pathlib.Path) -> subprocess.Popen:
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(CACHE), "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)  # the CLI's --cpu-devices sets the device count, not the test process's 8
    for key in [k for k in env if k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS", "SLURM_", "OMPI_"))]:
        env.pop(key)
    return subprocess.Popen([sys.executable, "-m", "asyncres_jax.train", *args], cwd=ROOT, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def _kill(procs: list[subprocess.Popen]) -> None:
    """Every process group we started ends here, whatever happened."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait(timeout=30)


def _final_params(run_dir: pathlib.Path) -> dict[str, np.ndarray]:
    from asyncres_jax.checkpoint import flatten
    from asyncres_jax.mesh import make_mesh
    from asyncres_jax.run import load_policy_model, restore_params

    cfg = load_config(run_dir / "config.yaml")
    model = load_policy_model(cfg.model.name, cfg.model.dtype, make_mesh("1x1", jax.devices()[:1]))
    params, restored = restore_params(run_dir, None, cfg, model)
    assert restored.meta["version"] == 2
    return {k: np.asarray(v) for k, v in flatten(params, "params").items()}


def _finish(procs: dict[str, subprocess.Popen], tmp: pathlib.Path, end: float) -> dict[str, str]:
    """Wait (until `end`) for every process to exit 0; returns their logs."""
    codes = {}
    for name, p in procs.items():
        try:
            codes[name] = p.wait(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            codes[name] = None
    logs = {name: (tmp / f"{name}.log").read_text() for name in procs}
    for name, code in codes.items():
        tail = "\n".join(line for line in logs[name].splitlines() if "[Gloo]" not in line)[-3000:]
        assert code == 0, f"{name} exited with {code} (None: still running after {TIMEOUT_S}s):\n{tail}"
    return logs


def _train_both_ways(tmp: pathlib.Path) -> dict:
    """One process on 8 devices: 2 updates. Two processes on 4 each: 1 update, checkpoint, then a second
    session resumes from that checkpoint (restored into the global shardings) for the 2nd update."""
    if not _gloo_available():
        pytest.skip("this jaxlib has no gloo CPU collectives: multi-process CPU runs are impossible here")
    single, multi = tmp / "single", tmp / "multi"
    end = time.monotonic() + TIMEOUT_S
    procs: dict[str, subprocess.Popen] = {}

    def cluster(session: str, *more: str) -> None:
        port = _free_port()
        for i in (0, 1):
            name = f"{session}{i}"
            procs[name] = _start(["--cpu-devices", "4", *RUN, f"run_dir={multi}", "checkpoint.every=1", *more,
                                  "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id",
                                  str(i)], tmp / f"{name}.log")
    try:
        procs["single"] = _start(["--cpu-devices", "8", *RUN, f"run_dir={single}", "es.updates=2"],
                                 tmp / "single.log")
        cluster("first", "es.updates=1")
        logs = _finish({k: procs[k] for k in ("first0", "first1")}, tmp, end)
        cluster("resumed", "es.updates=2", "--resume")
        logs |= _finish(procs, tmp, end)
    finally:
        _kill(list(procs.values()))
    return {"single": single, "multi": multi, "logs": logs}


def _same_final_parameters(runs):
    single, multi = _final_params(runs["single"]), _final_params(runs["multi"])
    assert single.keys() == multi.keys()
    for name in single:
        np.testing.assert_array_equal(multi[name], single[name], err_msg=name)
    initial = {k: np.asarray(v) for k, v in _initial_params().items()}
    assert all(not np.array_equal(single[k], initial[k]) for k in single)  # 2 full-rank updates moved every leaf


def _initial_params():
    from asyncres_jax.checkpoint import flatten
    from asyncres_jax.model.tiny import tiny_model

    return flatten(tiny_model(0).params, "params")


def _same_cohorts_and_fitness(runs):
    one, two = metrics.read(runs["single"]), metrics.read(runs["multi"])
    assert [r["update"] for r in two] == [1, 2]
    for a, b in zip(one, two):
        assert (a["fitness_mean"], a["fitness_std"]) == (b["fitness_mean"], b["fitness_std"])
        assert b["staleness_hist"] == {"0": 8}
    # process 1 committed the same cohorts (its own record), though it ran only half of the jobs
    theirs = metrics.read(runs["multi"] / "processes" / "1")
    assert [r["fitness_mean"] for r in theirs] == [r["fitness_mean"] for r in two]


def _process_zero_alone_writes_and_logs(runs):
    multi, logs = runs["multi"], runs["logs"]
    manifest = json.loads((multi / "manifest.json").read_text())
    assert [s["resumed_at_update"] for s in manifest["sessions"]] == [None, 1]
    assert all(len(s["devices"]) == 8 for s in manifest["sessions"])
    assert "update 1/1" in logs["first0"] and "update 2/2" in logs["resumed0"] and "resuming" in logs["resumed0"]
    assert not any(word in logs[name] for word in ("update 1/1", "update 2/2", "resuming")
                   for name in ("first1", "resumed1"))
    assert "2 replicas x 1 workers" in logs["first0"]  # each process drives its own 2 of the 4 rows


def _each_process_checkpoints_its_own_shards(runs):
    checkpoints = runs["multi"] / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["1", "2"]
    for step in ("1", "2"):
        arrays = checkpoints / step / "arrays"
        assert (arrays / "ocdbt.process_0").is_dir() and (arrays / "ocdbt.process_1").is_dir()


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
    runs = _train_both_ways(tmp_path)
    _same_final_parameters(runs)
    _same_cohorts_and_fitness(runs)
    _process_zero_alone_writes_and_logs(runs)
    _each_process_checkpoints_its_own_shards(runs)


# ------------------------------------------------------------------------------------------- cluster spec


def test_flags_name_the_cluster():
    spec = distributed.resolve("10.0.0.1:1234", 4, 3, environ={})
    assert (spec.coordinator, spec.num_processes, spec.process_id, spec.distributed) == ("10.0.0.1:1234", 4, 3, True)


def test_jax_environment_variables_name_the_cluster():
    env = {"JAX_COORDINATOR_ADDRESS": "host0:999", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    spec = distributed.resolve(environ=env)
    assert (spec.coordinator, spec.num_processes, spec.process_id) == ("host0:999", 2, 1)
    assert distributed.resolve("h:1", 2, 0, environ=env).process_id == 0  # flags win over the environment


def test_no_cluster_is_one_process():
    assert not distributed.resolve(environ={}).distributed
    assert not distributed.resolve(num_processes=1, environ={}).distributed
    assert not distributed.resolve(environ={"SLURM_NTASKS": "4", "SLURM_PROCID": "0"}).distributed  # no srun step


@pytest.mark.parametrize("env,expected", [
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_STEP_ID": "0"}, ("SLURM", 4, 2)),
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}, ("OpenMPI", 2, 1)),
])
def test_launchers_are_detected(env, expected):
    spec = distributed.resolve(environ=env)
    assert (spec.source, spec.num_processes, spec.process_id, spec.coordinator) == (*expected, None)


@pytest.mark.parametrize("kwargs,env,message", [
    ({"num_processes": 2}, {}, "coordinator and process id is missing"),
    ({"coordinator": "h:1", "num_processes": 2}, {}, "process id is missing"),
    ({"coordinator": "h:1", "num_processes": 2, "process_id": 2}, {}, "outside 0..1"),
    ({"coordinator": "h:1", "num_processes": 0, "process_id": 0}, {}, "at least 1"),
    ({"coordinator": "h", "num_processes": 2, "process_id": 0}, {}, "not HOST:PORT"),
    ({"coordinator": "h:70000", "num_processes": 2, "process_id": 0}, {}, "not HOST:PORT"),
    ({}, {"JAX_NUM_PROCESSES": "two"}, "not an integer"),
    ({}, {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"}, "JAX_PROCESS_ID: the process id is missing"),
    ({}, {"SLURM_NTASKS": "2", "SLURM_PROCID": "5", "SLURM_STEP_ID": "0"}, "SLURM says rank '5' of '2'"),
])
def test_inconsistent_clusters_are_one_line_errors(kwargs, env, message):
    with pytest.raises(UserError, match=message) as e:
        distributed.resolve(**kwargs, environ=env)
    assert "\n" not in str(e.value)


def test_cli_reports_a_half_named_cluster(capsys, tmp_path):
    from asyncres_jax.train import main

    assert main(["--num-processes", "2", "--process-id", "0", f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "coordinator" in err[0]
    assert not (tmp_path / "run").exists()


def test_async_schedule_and_grpo_are_refused_across_processes(monkeypatch):
    async_es, grpo = load_config(None, ["pool.mode=async"]), load_config(None, ["algo=grpo", "pool.mode=sync"])
    distributed.check_config(async_es)  # one process: everything goes
    distributed.check_config(grpo)
    monkeypatch.setattr(distributed, "_SPEC", distributed.ClusterSpec("h:1", 2, 0, "test"))
    with pytest.raises(UserError, match="pool.mode=sync or controlled"):
        distributed.check_config(async_es)
    with pytest.raises(UserError, match="algo=grpo runs in one process"):
        distributed.check_config(grpo)
    distributed.check_config(load_config(None, ["pool.mode=sync"]))


def test_process_zero_evaluates_on_its_first_replica(tmp_path, monkeypatch):
    """Evaluation sees replica 0's model and the float32 masters placed there (no global computation)."""
    from asyncres_jax.trainer import ESTrainer

    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", "mesh=4x2", "model.name=tiny", "tasks.dataset=fake",
                             "es.population=8", "pool.mode=sync"])
    trainer = ESTrainer(cfg)
    try:
        seen = []
        distributed.attach_on_main(trainer, seen.append)
        assert seen == [trainer]  # one process: the trainer itself, no barriers
        monkeypatch.setattr(distributed, "_SPEC", distributed.ClusterSpec("h:1", 2, 0, "test"))
        hooks = len(trainer.drained_hooks), len(trainer.before_run_hooks)
        distributed.attach_on_main(trainer, seen.append)
        view = seen[1]
        assert (len(trainer.drained_hooks), len(trainer.before_run_hooks)) == (hooks[0] + 1, hooks[1] + 1)
        replica0 = set(trainer.pool.replicas[0].mesh.devices.flat)
        assert view.model.mesh is trainer.pool.replicas[0].mesh and view.store.version == 0
        assert view.drained_hooks is trainer.drained_hooks and view.cfg is trainer.cfg
        for placed, master in zip(jax.tree.leaves(view.store.params), jax.tree.leaves(trainer.store.params)):
            assert placed.sharding.device_set == replica0 and placed.dtype == np.float32
            np.testing.assert_array_equal(np.asarray(placed), np.asarray(master))
        monkeypatch.setattr(distributed, "_SPEC", distributed.ClusterSpec("h:1", 2, 1, "test"))
        distributed.attach_on_main(trainer, seen.append)
        assert len(seen) == 2  # process 1 never evaluates
    finally:
        trainer.close()


def test_a_replica_may_not_span_processes():
    from types import SimpleNamespace

    dev = [SimpleNamespace(process_index=i // 4) for i in range(8)]  # 2 processes x 4 devices
    distributed.check_mesh(SimpleNamespace(devices=np.array(dev, object).reshape(4, 2)))
    with pytest.raises(UserError, match=r"mesh 1x8: replica 0 spans processes \[0, 1\].*--mesh 2x4"):
        distributed.check_mesh(SimpleNamespace(devices=np.array(dev, object).reshape(1, 8)))
    with pytest.raises(UserError, match="replica 1 spans"):  # rows of 3 straddle the boundary at device 4
        distributed.check_mesh(SimpleNamespace(devices=np.array(dev[:6], object).reshape(2, 3)))
