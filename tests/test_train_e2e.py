"""The training program end to end on 8 simulated devices: a tiny random model, the deterministic fake
environment, async K=1 on a 4x2 mesh; 3 updates, checkpoints, a resume, and an export that transformers loads."""

import json

import jax
import numpy as np
import pytest

from asyncres_jax import metrics
from asyncres_jax.config import load_config
from asyncres_jax.rollout.jobs import fake_tokens
from asyncres_jax.run import export
from asyncres_jax.trainer import ESTrainer

pytestmark = pytest.mark.xdist_group("train_e2e")


def config(run_dir, *more):
    return load_config(None, [f"run_dir={run_dir}", "mesh=4x2", "model.name=tiny", "tasks.dataset=fake",
                              "es.population=8", "es.sigma=0.02", "es.alpha=0.02", "pool.mode=async",
                              "pool.max_staleness=1", "checkpoint.every=2", "checkpoint.keep=2", *more])


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    trainer = ESTrainer(config(run_dir, "es.updates=3"))
    initial = jax.tree.map(np.asarray, trainer.store.params)
    trainer.run()
    out = dict(run_dir=run_dir, initial=initial, params=jax.tree.map(np.asarray, trainer.store.params),
               cohort=trainer.coordinator.state_dict()["cohort"], trainer=trainer)
    trainer.close()
    return out


def test_three_async_updates_on_a_4x2_mesh(first):
    run_dir = first["run_dir"]
    assert first["trainer"].store.version == 3
    assert len(first["trainer"].pool.replicas) == 4
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), first["initial"], first["params"])
    assert all(jax.tree.leaves(changed))  # full-rank ES moves every leaf
    records = metrics.read(run_dir)
    assert [r["update"] for r in records] == [1, 2, 3]
    for r in records:
        assert sum(r["staleness_hist"].values()) == 8  # N results per cohort
        assert set(map(int, r["staleness_hist"])) <= {0, 1}  # K = 1
        assert r["fitness_std"] > 0 and r["tokens"] > 0 and 0 <= r["utilization"] <= 1
    # 4 workers, N = 8: from the second cohort on, some results were dispatched one version earlier.
    assert any(r["staleness_hist"].get("1", 0) for r in records[1:])


def test_run_directory_has_config_manifest_and_checkpoints(first):
    run_dir = first["run_dir"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["1", "2"]  # at updates 2 and 3
    manifest = json.loads((run_dir / "manifest.json").read_text())
    session = manifest["sessions"][0]
    assert session["mesh"] == {"data": 4, "model": 2} and len(session["devices"]) == 8
    assert session["git_revision"] and session["packages"]["jax"] == jax.__version__
    assert manifest["config"]["es"]["population"] == 8
    assert load_config(run_dir / "config.yaml") == config(run_dir, "es.updates=3")


def test_export_loads_in_transformers_with_matching_logits(first, tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    from asyncres_jax.model.tiny import tiny_model

    out = export(str(first["run_dir"]), str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    assert json.loads((out / "asyncres_export.json").read_text())["update"] == 3
    model = tiny_model(0)
    tokens = fake_tokens(7, model.config.vocab_size)
    ours = np.asarray(model.logits(tokens, params=first["params"]))
    with torch.no_grad():
        theirs = hf(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=2e-4, rtol=2e-4)


@pytest.fixture(scope="module")
def resumed(first):
    """The same run resumed for one more update; what the resume saw, recorded for the tests below.

    A fixture rather than a test, so the corrupt-checkpoint test finds these checkpoints whatever order or
    worker the tests run in.
    """
    run_dir = first["run_dir"]
    trainer = ESTrainer(config(run_dir, "es.updates=4"))  # same run, one more update
    try:
        seen = dict(version=trainer.store.version, params=jax.tree.map(np.asarray, trainer.store.params),
                    cohort=trainer.coordinator.state_dict()["cohort"])
        trainer.run()
        seen["final_version"] = trainer.store.version
    finally:
        trainer.close()
    seen["updates"] = [r["update"] for r in metrics.read(run_dir)]
    seen["sessions"] = len(json.loads((run_dir / "manifest.json").read_text())["sessions"])
    return seen


def test_resume_continues_from_the_checkpoint(first, resumed):
    assert resumed["version"] == 3
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, resumed["params"], first["params"])))
    # The results accepted after update 3 but not committed yet came back with the coordinator.
    assert resumed["cohort"] == first["cohort"]
    assert len(first["cohort"]) > 0
    assert resumed["final_version"] == 4
    assert resumed["updates"] == [1, 2, 3, 4]
    assert resumed["sessions"] == 2


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(first, resumed, capsys):
    run_dir = first["run_dir"]  # after the resume: checkpoints at updates 3 (step 2) and 4 (step 3)
    for f in (run_dir / "checkpoints" / "3" / "arrays").rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and "d" in f.parent.name:
            f.write_bytes(b"")
    trainer = ESTrainer(config(run_dir, "es.updates=4"))
    try:
        assert trainer.store.version == 3
        assert all(jax.tree.leaves(jax.tree.map(np.array_equal, jax.tree.map(np.asarray, trainer.store.params),
                                                first["params"])))
    finally:
        trainer.close()
    assert "is unreadable" in capsys.readouterr().err
    assert [r["update"] for r in metrics.read(run_dir)] == [1, 2, 3]  # update 4 will be redone, not logged twice
