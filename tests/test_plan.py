"""The compile-only plan: a model built from its config.json alone, its decode step, ES update and GRPO step compiled
on 8 simulated devices with training's shardings; per-device parameters really split over the model axis, the
compiler's memory analysis reported, and one-line errors for meshes or runs that do not fit."""

import dataclasses
import json
import pathlib

import pytest

from asyncres_jax import plan, train
from asyncres_jax.config import load_config
from asyncres_jax.errors import UserError

REPO = pathlib.Path(__file__).resolve().parent.parent
QWEN_7B = REPO / "tests" / "fixtures" / "qwen2_5_7b_instruct"


def small_qwen2(tmp_path) -> pathlib.Path:
    """Qwen2.5-7B's config.json scaled down (same architecture: GQA 7:1, QKV bias, untied embeddings)."""
    cj = json.loads((QWEN_7B / "config.json").read_text())
    cj.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=2048)
    d = tmp_path / "qwen2_small"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cj))
    return d


def small_cfg(model_dir, mesh: str, *extra):
    return load_config(REPO / "configs" / "qwen2_5_7b_async1.yaml",
                       [f"model.name={model_dir}", f"mesh={mesh}", "episode.context_limit=512",
                        "es.tasks_per_member=8", "grpo.micro_batch_size=4", *extra])


def test_qwen2_5_7b_config_json_is_the_published_shape():
    cfg = plan.model_config(str(QWEN_7B))
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size,
            cfg.vocab_size, cfg.rope_theta, cfg.tie_word_embeddings, cfg.attention_bias) == (
        3584, 28, 28, 4, 18944, 152064, 1e6, False, True)


@pytest.mark.parametrize("mesh", ["2x4", "8x1"])
def test_plan_compiles_sharded_programs_and_reports_memory(tmp_path, mesh):
    p = plan.make_plan(small_cfg(small_qwen2(tmp_path), mesh), "h100", report=lambda s: None)
    d, m = p.mesh
    assert (d, m) == tuple(int(x) for x in mesh.split("x"))
    total = p.n_params * 4  # float32 masters
    assert p.master_bytes == pytest.approx(total / m, rel=0.05)  # split over "model", replicated over "data"
    assert p.rollout_bytes == pytest.approx(p.n_params * 2 / m, rel=0.05)  # the bfloat16 copy, one replica
    # KV cache at full context: layers x (k, v) x rows x KV heads / M x slots x head_dim x 2 bytes
    c = p.config
    assert p.kv_bytes == 2 * c.num_layers * p.batch * (c.num_kv_heads // m) * p.slots * c.head_dim * 2
    assert p.slots >= 512 and p.batch == 8
    for prog in (p.decode, p.es_update, p.grpo_grad, p.grpo_apply):  # the compiler's memory analysis
        assert prog.temporaries > 0 and prog.arguments > 0
    assert p.decode.arguments >= p.rollout_bytes + p.kv_bytes  # what a replica's device holds while decoding
    assert p.grpo_apply.arguments >= 3 * p.master_bytes  # masters, Adam's two moments (and the gradients)
    assert p.decode.flops > 0 and p.decode.bytes_accessed > 0
    lines = "\n".join(plan.format_plan(p))
    assert "temporaries" in lines and "roofline" in lines and "tokens/s" in lines and "fits" in lines


def test_sharded_decode_reads_fewer_bytes_per_device(tmp_path):
    model = small_qwen2(tmp_path)
    one = plan.make_plan(small_cfg(model, "8x1"), "h100", programs=(), report=lambda s: None)
    four = plan.make_plan(small_cfg(model, "2x4"), "h100", programs=(), report=lambda s: None)
    flops1, bytes1 = one.minimal_step()
    flops4, bytes4 = four.minimal_step()
    assert bytes4 == pytest.approx(bytes1 / 4, rel=0.05) and flops4 == pytest.approx(flops1 / 4, rel=0.05)
    assert four.decode_roofline_s() < one.decode_roofline_s()


def test_a_run_that_does_not_fit_is_one_line_with_what_would(tmp_path):
    p = plan.make_plan(small_cfg(small_qwen2(tmp_path), "8x1"), "h100", programs=("es",), report=lambda s: None)
    plan.check_fits(p, "es")  # a small model fits an H100
    small = dataclasses.replace(p, accelerator=plan.Accelerator("a small device", p.total("es", 2) + 1, 1e12, 1e14))
    with pytest.raises(UserError, match=r"does not fit: algo=es on mesh 8x1 .* 2 rows would fit") as e:
        plan.check_fits(small, "es")
    assert "\n" not in str(e.value)


def test_plan_cli_prints_the_report(capsys, tmp_path):
    code = train.main(["--config", "configs/qwen2_5_7b_async1.yaml", "--mesh", "4x2", "--plan", "--accelerator",
                       "h200", f"model.name={small_qwen2(tmp_path)}", "episode.context_limit=256",
                       "es.tasks_per_member=4", "grpo.micro_batch_size=2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "mesh 4x2" in out and "H200" in out and "ES run per device" in out and "GRPO run per device" in out


@pytest.mark.parametrize("args, fragment", [
    (["--mesh", "1x8"], "model axis 8 does not divide num_heads=28, num_kv_heads=4"),
    (["--mesh", "16x1"], "mesh 16x1 needs 16 devices but this machine has 8; meshes that fit: 1x1, 8x1, 4x2, 2x4, "
                         "1x8; or simulate 16 CPU devices with --cpu-devices 16"),
])
def test_qwen2_5_7b_meshes_that_do_not_fit_are_one_line(capsys, args, fragment):
    code = train.main(["--config", "configs/qwen2_5_7b_async1.yaml", "--plan", f"model.name={QWEN_7B}", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: ") and fragment in err[-1]


def test_model_config_comes_from_headers_alone(tmp_path):
    smollm2 = plan.model_config("smollm2-135m-instruct")  # the GGUF file's header
    assert (smollm2.hidden_size, smollm2.num_layers, smollm2.num_kv_heads) == (576, 30, 3)
    assert plan.model_config(str(QWEN_7B / "config.json")) == plan.model_config(str(QWEN_7B))
    with pytest.raises(UserError, match="not a model folder with a config.json"):
        plan.model_config(str(tmp_path / "missing"))
