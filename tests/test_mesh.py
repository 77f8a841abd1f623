"""--mesh DxM: parsing, fit checks, identical logits on every mesh, real weight splits, and Qwen2.5-7B shardings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from asyncres_jax.errors import UserError
from asyncres_jax.mesh import make_mesh, parse_mesh, replica_meshes, valid_model_sizes
from asyncres_jax.model.sharding import param_shardings
from asyncres_jax.model import ModelConfig, init_params, load_model
from asyncres_jax.model.decoder import abstract_params
from asyncres_jax.model.loading import save_hf

pytestmark = pytest.mark.xdist_group("mesh")

# Heads divide 2 and 4 (8 query, 4 KV); a vocabulary of 122 splits over M=2 but not 4 (it replicates there).
TINY = ModelConfig.tiny(num_heads=8, num_kv_heads=4, head_dim=8, vocab_size=122)
QWEN25_7B = dict(architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                 num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, rope_theta=1e6,
                 tie_word_embeddings=False, max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu")


def test_parse_mesh():
    assert parse_mesh("4x2") == (4, 2) and parse_mesh(" 8X1 ") == (8, 1) and parse_mesh((2, 4)) == (2, 4)
    for bad in ["4", "4x", "x2", "4*2", "0x8", "axb"]:
        with pytest.raises(UserError, match="DxM|>= 1"):
            parse_mesh(bad)


def test_mesh_must_match_device_count_and_names_valid_choices():
    assert jax.device_count() == 8
    mesh = make_mesh("4x2")
    assert mesh.axis_names == ("data", "model") and mesh.shape == {"data": 4, "model": 2}
    assert make_mesh("1x1").size == 1  # one device is always allowed
    with pytest.raises(UserError, match=r"mesh 2x2 needs 4 devices but 8 are available; valid meshes: 1x1, 8x1, "
                                        r"4x2, 2x4, 1x8"):
        make_mesh("2x2")
    with pytest.raises(UserError, match="model axis 8 does not divide.*valid model-axis sizes: 1, 2, 4"):
        make_mesh("1x8", cfg=TINY)
    assert [m.shape for m in replica_meshes(make_mesh("4x2"))] == [{"data": 1, "model": 2}] * 4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    params = init_params(TINY, jax.random.key(0))
    # Random norm scales and biases, so a misplaced vector shard would change the logits.
    params = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(1), x.shape) if x.ndim == 1 else x,
                          params)
    save_hf(d, TINY, params)
    return d


def test_same_logits_on_every_mesh_and_weights_really_split(tiny_dir):
    tokens = np.random.default_rng(0).integers(0, TINY.vocab_size, (4, 9))
    mask = np.ones_like(tokens)
    mask[1, :3] = mask[3, :6] = 0  # left pads
    ref = load_model(tiny_dir)
    want = np.asarray(ref.logits(tokens, mask))
    for spec in ["1x1", "8x1", "4x2", "2x4"]:
        m = load_model(tiny_dir, mesh=spec)
        d, mm = parse_mesh(spec)
        assert m.mesh.shape == {"data": d, "model": mm}
        np.testing.assert_allclose(np.asarray(m.logits(tokens, mask))[mask > 0], want[mask > 0], atol=1e-5)
        layer = m.params["layers"][1]
        q, o = layer["attn"]["q_proj"]["kernel"], layer["attn"]["o_proj"]["kernel"]
        down = layer["mlp"]["down_proj"]["kernel"]
        assert len(q.addressable_shards) == d * mm
        assert q.sharding.spec == P(None, "model") and o.sharding.spec == P("model", None)
        # Each device holds 1/M of the heads and of the MLP hidden dimension; "data" replicates.
        assert {s.data.shape for s in q.addressable_shards} == {(64, 64 // mm)}
        assert {s.data.shape for s in o.addressable_shards} == {(64 // mm, 64)}
        assert {s.data.shape for s in down.addressable_shards} == {(128 // mm, 64)}
        assert {s.data.shape for s in layer["attn"]["k_proj"]["bias"].addressable_shards} == {(32 // mm,)}
        emb = m.params["embed"]["embedding"]
        assert emb.sharding.spec == (P() if TINY.vocab_size % mm else P("model", None))
        np.testing.assert_array_equal(np.asarray(q), np.asarray(ref.params["layers"][1]["attn"]["q_proj"]["kernel"]))


def test_mesh_that_does_not_fit_the_model_is_a_user_error(tiny_dir):
    with pytest.raises(UserError, match="model axis 8 does not divide num_heads=8, num_kv_heads=4"):
        load_model(tiny_dir, mesh="1x8")
    with pytest.raises(UserError, match="mesh 3x1 needs 3 devices"):
        load_model(tiny_dir, mesh="3x1")


def test_qwen2_5_7b_builds_abstractly_with_valid_shardings():
    cfg = ModelConfig.from_hf(QWEN25_7B)
    assert cfg.attention_bias and not cfg.tie_word_embeddings and cfg.head_dim == 128 and cfg.rope_theta == 1e6
    abstract = abstract_params(cfg, jnp.bfloat16)
    assert sum(x.size for x in jax.tree.leaves(abstract)) == 7_615_616_512  # the published 7.61B
    assert valid_model_sizes(cfg) == [1, 2, 4]
    for spec in ["8x1", "4x2", "2x4"]:
        mesh = make_mesh(spec, cfg=cfg)
        shardings = param_shardings(abstract, cfg, mesh)
        for leaf, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
            for dim, axis in zip(leaf.shape, s.spec):
                assert axis is None or dim % mesh.shape[axis] == 0
        q = shardings["layers"][0]["attn"]["q_proj"]["kernel"]
        assert q.shard_shape((3584, 3584)) == (3584, 3584 // mesh.shape["model"])
    # The shardings are accepted by jit for an abstract (never allocated) initialisation.
    lowered = jax.jit(lambda k: init_params(cfg, k, jnp.bfloat16), out_shardings=shardings).lower(jax.random.key(0))
    assert lowered.out_info["layers"][27]["mlp"]["up_proj"]["kernel"].shape == (3584, 18944)
    with pytest.raises(UserError, match="valid model-axis sizes: 1, 2, 4"):
        make_mesh("1x8", cfg=cfg)
