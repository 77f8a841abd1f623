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
        ("episode.system_prompt=terse", "choose one of full, short"),
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
