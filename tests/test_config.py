"""Run configs: YAML + dotted overrides into typed sections; every mistake is one clear line."""

import pytest

from asyncres_jax.config import TrainConfig, describe, load_config, to_yaml
from asyncres_jax.errors import UserError


def test_defaults_are_the_papers_es():
    cfg = load_config(None)
    assert (cfg.es.population, cfg.es.sigma, cfg.es.alpha) == (30, 0.0015, 0.00075)
    assert (cfg.episode.max_turns, cfg.episode.temperature, cfg.episode.context_limit) == (16, 0.6, 16384)
    assert cfg.eval.seeds == [42, 43, 44]


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("es:\n  population: 8\n  noise: lowrank\npool:\n  mode: sync\n")
    cfg = load_config(path, ["es.rank=4", "pool.max_staleness=0", "eval.seeds=[1,2]"])
    assert isinstance(cfg, TrainConfig)
    assert (cfg.es.population, cfg.es.noise, cfg.es.rank) == (8, "lowrank", 4)
    assert (cfg.pool.mode, cfg.pool.max_staleness, cfg.eval.seeds) == ("sync", 0, [1, 2])


def test_round_trips_through_yaml(tmp_path):
    cfg = load_config(None, ["es.population=6", "seed=3"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("es.populaton=8", "unknown config key 'es.populaton'"),
        ("es.population=many", "es.population"),
        ("es.noise=gaussian", "es.noise='gaussian' is not valid"),
        ("es.sigma=0", "es.sigma=0.0 is not valid"),
        ("pool.mode=eventual", "pool.mode='eventual'"),
        ("sandbox.backend=vm", "choose one of bwrap, docker"),
        ("episode.system_prompt=terse", "choose one of full, compact, short"),
        ("mesh=eight", "mesh"),
        ("es.population", "is not key=value"),
    ],
)
def test_bad_input_is_one_clear_line(override, fragment):
    with pytest.raises(UserError) as e:
        load_config(None, [override])
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_paced_admission_is_an_async_option():
    assert load_config(None, ["pool.pace_admission=true"]).pool.pace_admission
    with pytest.raises(UserError, match="pool.pace_admission=true needs pool.mode=async"):
        load_config(None, ["pool.pace_admission=true", "pool.mode=sync"])


def test_antithetic_needs_even_population():
    with pytest.raises(UserError, match="must be even"):
        load_config(None, ["es.antithetic=true", "es.population=7"])


def test_every_option_is_documented():
    lines = describe()
    options = [line for line in lines if not line.startswith("#")]
    assert len(options) > 40
    assert all(line.split("  # ", 1)[1].strip() for line in options)


def test_a_config_builds_on_its_base(tmp_path):
    (tmp_path / "shared.yaml").write_text("es:\n  population: 10\n  updates: 12\npool:\n  mode: async\n")
    (tmp_path / "study").mkdir()
    (tmp_path / "study" / "sync.yaml").write_text("base: ../shared.yaml\npool:\n  mode: sync\n")
    cfg = load_config(tmp_path / "study" / "sync.yaml", ["es.updates=3"])
    assert (cfg.es.population, cfg.pool.mode, cfg.es.updates) == (10, "sync", 3)  # base <- file <- overrides
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(UserError, match="builds on itself"):
        load_config(tmp_path / "loop.yaml")
    (tmp_path / "orphan.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(UserError, match="missing.yaml does not exist"):
        load_config(tmp_path / "orphan.yaml")


def test_every_option_of_the_es_core_is_reachable_from_yaml_and_listed(tmp_path):
    import dataclasses

    from asyncres_jax import es

    listed = "\n".join(describe())
    for f in dataclasses.fields(es.ESConfig):
        assert f"es.{f.name} = " in listed
    (tmp_path / "c.yaml").write_text("es:\n  optimizer: adam\n  adam_b1: 0.8\n  weight_decay: 0.01\n"
                                     "  divide_by_sigma: true\n")
    core = load_config(tmp_path / "c.yaml").es.core()
    assert core == es.ESConfig(optimizer="adam", adam_b1=0.8, weight_decay=0.01, divide_by_sigma=True)
    with pytest.raises(UserError, match=r"^es.weight_decay=-1.0 is not valid; it must be a finite number >= 0$"):
        load_config(None, ["es.weight_decay=-1"])


def test_an_es_learner_in_bfloat16_is_refused_in_one_line():
    with pytest.raises(UserError, match=r"^model.dtype=bfloat16 with algo=es: .*use model.dtype=float32") as e:
        load_config(None, ["model.dtype=bfloat16"])
    assert "\n" not in str(e.value)
    assert load_config(None, ["model.dtype=bfloat16", "algo=grpo"]).model.dtype == "bfloat16"  # GRPO's own rule
    assert load_config(None, ["model.rollout_dtype=bfloat16"]).model.rollout_dtype == "bfloat16"


def test_members_per_batch_is_an_option_of_the_batched_population_and_fits_a_replicas_workers():
    from asyncres_jax.trainer import members_per_batch

    batched = ["es.noise=lowrank", "es.batched_population=true", "pool.workers_per_replica=4"]
    assert members_per_batch(load_config(None, batched), 4) == 4  # 0: all of a replica's workers in one batch
    assert members_per_batch(load_config(None, [*batched, "es.members_per_batch=2"]), 4) == 2
    with pytest.raises(UserError, match="es.members_per_batch=5 exceeds the 4 workers"):
        members_per_batch(load_config(None, [*batched, "es.members_per_batch=5"]), 4)
    with pytest.raises(UserError, match="es.members_per_batch=2 needs es.batched_population=true"):
        load_config(None, ["es.members_per_batch=2"])


def test_streams_per_batch_splits_a_batched_population_and_may_change_between_sessions():
    from asyncres_jax.run import fingerprint

    batched = ["es.noise=lowrank", "es.batched_population=true"]
    assert load_config(None, batched).es.streams_per_batch == 1
    with pytest.raises(UserError, match=r"^es.streams_per_batch=0 is not valid; it must be > 0$"):
        load_config(None, [*batched, "es.streams_per_batch=0"])
    with pytest.raises(UserError, match=r"^es.streams_per_batch=2 needs es.batched_population=true .*use 1$"):
        load_config(None, ["es.streams_per_batch=2"])
    # the same episodes either way: a run resumes with another number of streams
    two = load_config(None, [*batched, "es.streams_per_batch=2"])
    assert fingerprint(two) == fingerprint(load_config(None, batched))
