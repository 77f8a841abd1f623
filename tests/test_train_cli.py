"""The train CLI's bad input: each mistake is one line on stderr and exit code 2, before anything is written;
an existing run is never overwritten without --overwrite, a folder that is not a run is never deleted, and a run
directory another training process uses is refused."""

import os
import pathlib
import subprocess
import sys

import pytest

from asyncres_jax import train
from asyncres_jax.config import load_config
from asyncres_jax.errors import UserError
from asyncres_jax.run import CONFIG_FILE, prepare_run_dir, release_run_dir

pytestmark = pytest.mark.xdist_group("train_cli")

REPO = pathlib.Path(__file__).resolve().parent.parent
FAKE = ["model.name=tiny", "tasks.dataset=fake", "es.population=8", "es.updates=1"]


def run_cli(capsys, *argv):
    code = train.main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


@pytest.mark.parametrize("args, fragment", [
    (["es.populaton=8"], "unknown config key 'es.populaton'"),
    (["--mesh", "3x1"], "mesh 3x1 needs 3 devices but 8 are available"),
    (["--mesh", "1x8"], "model axis 8 does not divide num_heads=4"),
    (["model.name=/nonexistent/model"], "model '/nonexistent/model' not found"),
    (["tasks.dataset=/nonexistent/tasks"], "task folder /nonexistent/tasks does not exist"),
    (["--resume"], "there is no run in"),
    (["pool.mode=async", "es.antithetic=true"], "es.antithetic=true needs pool.mode=sync"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, args, fragment):
    code, last = run_cli(capsys, f"run_dir={tmp_path / 'run'}", *FAKE, *args)
    assert code == 2
    assert last.startswith("error: ") and fragment in last
    assert not (tmp_path / "run").exists()  # nothing written for bad input


def test_run_dir_of_a_different_config_is_refused(capsys, tmp_path):
    run = tmp_path / "run"
    prepare_run_dir(load_config(None, [f"run_dir={run}", *FAKE]), resume=False, overwrite=False)
    (run / "metrics.jsonl").write_text('{"update": 1}\n')
    code, last = run_cli(capsys, f"run_dir={run}", *FAKE, "es.sigma=0.5")
    assert code == 2 and "holds a run of a different config" in last and "es.sigma" in last
    assert (run / "metrics.jsonl").read_text() == '{"update": 1}\n'  # untouched


def test_overwrite_replaces_a_run_but_never_a_foreign_folder(tmp_path):
    run = tmp_path / "run"
    cfg = load_config(None, [f"run_dir={run}", *FAKE])
    assert prepare_run_dir(cfg, resume=False, overwrite=False) is False
    (run / "metrics.jsonl").write_text("old\n")
    assert prepare_run_dir(cfg, resume=False, overwrite=False) is True  # same config: the run continues
    assert (run / "metrics.jsonl").exists()
    assert prepare_run_dir(cfg, resume=False, overwrite=True) is False
    assert not (run / "metrics.jsonl").exists() and (run / CONFIG_FILE).exists()

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    with pytest.raises(UserError, match="is not a training run"):
        prepare_run_dir(load_config(None, [f"run_dir={foreign}", *FAKE]), resume=False, overwrite=True)
    assert (foreign / "thesis.tex").read_text() == "precious"


def test_a_run_dir_in_use_by_another_training_process_is_refused(capsys, tmp_path):
    run = tmp_path / "run"
    cfg = load_config(None, [f"run_dir={run}", *FAKE])
    holder = subprocess.Popen(  # another process that prepared the run directory and still uses it
        [sys.executable, "-c", "import sys, time; from asyncres_jax.config import load_config; "
         "from asyncres_jax.run import prepare_run_dir; "
         "prepare_run_dir(load_config(None, sys.argv[1:]), resume=False, overwrite=False); print('ready', flush=True); "
         "time.sleep(600)", f"run_dir={run}", *FAKE], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "ready\n"
        (run / "metrics.jsonl").write_text("theirs\n")
        code, last = run_cli(capsys, f"run_dir={run}", *FAKE)
        assert code == 2 and f"run_dir {run} is in use by a training process (pid {holder.pid} on " in last
        with pytest.raises(UserError, match="is in use"):  # nor may --overwrite delete it under the other
            prepare_run_dir(cfg, resume=False, overwrite=True)
        assert (run / "metrics.jsonl").read_text() == "theirs\n"
    finally:
        holder.kill()
        holder.wait()
    assert prepare_run_dir(cfg, resume=False, overwrite=False) is True  # the kernel let go with the process
    release_run_dir(run)


def test_export_of_something_that_is_not_a_run(capsys, tmp_path):
    code, last = run_cli(capsys, "export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "hf"))
    assert code == 2 and "is not a run directory" in last


def test_help_config_documents_every_option(capsys):
    assert train.main(["--help-config"]) == 0
    out = capsys.readouterr().out
    for key in ("es.population = 30", "pool.max_staleness = 1", "checkpoint.every", "tasks.dataset"):
        assert key in out


def test_every_shipped_config_is_valid_for_its_program():
    import glob

    from asyncres_jax.grpo import trainer as grpo_trainer
    from asyncres_jax.mesh import parse_mesh
    from asyncres_jax.trainer import check_supported, pool_config

    paths = sorted(glob.glob(str(REPO / "configs" / "**" / "*.yaml"), recursive=True))
    assert any("/study/" in p for p in paths)
    for path in paths:
        cfg = load_config(path)
        if cfg.algo == "es":
            check_supported(cfg)
            cfg.es.core()
            data, _ = parse_mesh(cfg.mesh)
            pool_config(cfg, data * cfg.pool.workers_per_replica)
        else:
            grpo_trainer.check_supported(cfg)
    # the study's rows evaluate one base model one way, so every row may reuse the sync row's base evaluation
    from asyncres_jax.evaluate import base_eval_settings

    study = [load_config(p) for p in paths if "/study/" in p and not p.endswith("common.yaml")]
    assert len(study) == 5 and all(c.eval.base_from == "runs/study/es_sync" for c in study)
    assert all(base_eval_settings(c) == base_eval_settings(study[0]) for c in study)
    cpu = load_config(REPO / "configs" / "smollm2_cpu.yaml")
    assert (cpu.model.name, cpu.sandbox.backend, cpu.pool.mode, cpu.pool.max_staleness) == (
        "smollm2-135m-instruct", "bwrap", "async", 1)
    # the study's rows keep the system prompt they were run with, whatever the CPU default's becomes
    assert all(c.episode.system_prompt == "full" for c in study) and cpu.episode.system_prompt == "compact"
    assert cpu.tasks.generate_n > 0  # generated offline on the first run


def test_the_calibration_config_is_the_study_sync_row():
    import dataclasses

    cal = load_config(REPO / "configs" / "calibration" / "sync.yaml")
    ref = load_config(REPO / "configs" / "study" / "es_sync.yaml")
    assert (cal.tasks.generate_n, cal.eval.test_tasks, cal.es.updates) == (7500, 300, 24)
    # the calibration's runs are the study's sync row: only where they are kept differs
    assert cal.run_dir != ref.run_dir
    assert dataclasses.replace(cal, run_dir=ref.run_dir, eval=dataclasses.replace(
        cal.eval, base_from=ref.eval.base_from)) == ref


@pytest.mark.skipif(not pathlib.Path("/lib/x86_64-linux-gnu/libc.so.6").exists() and
                    not pathlib.Path("/usr/lib/x86_64-linux-gnu/libc.so.6").exists(), reason="glibc only")
def test_training_caps_glibc_malloc_arenas_and_can_hand_free_memory_back():
    from asyncres_jax import hostmem

    # the training program calls this before starting threads (see asyncres_jax.hostmem for the why)
    assert hostmem.limit_malloc_arenas(8) is True
    # memory freed inside the heap (below a live allocation, so free() cannot shrink the heap) stays resident
    # until release_free_memory hands it back
    def resident_mb():
        return int(pathlib.Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    chunks = [bytearray(64 << 10) for _ in range(4096)]  # 256 MB in 64 KB mallocs (below the mmap threshold)
    pin = bytearray(64 << 10)  # noqa: F841 (kept alive on purpose: it holds the heap's top)
    del chunks
    before = resident_mb()
    assert hostmem.release_free_memory() is True
    assert before - resident_mb() > 128


def test_options_added_to_the_schema_keep_earlier_runs_fingerprints():
    from asyncres_jax.run import fingerprint

    # recorded before es.divide_by_sigma, es.weight_decay and es.adam_* became config keys
    assert fingerprint(load_config(None)) == "34c56ad8b7a71c0c"
    # the CPU default as it was then (it has used the compact system prompt since)
    assert fingerprint(load_config(REPO / "configs" / "smollm2_cpu.yaml", ["episode.system_prompt=full"])) == (
        "47c8fcf6b173e1c0")
    assert fingerprint(load_config(None, ["es.optimizer=adam", "es.noise=lowrank"])) == "2d3e8f334305906f"
    assert fingerprint(load_config(None, ["es.weight_decay=0.01"])) != "34c56ad8b7a71c0c"  # set, it counts
