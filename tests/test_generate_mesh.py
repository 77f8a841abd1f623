"""Generation on a ("data", "model") mesh of 8 simulated devices gives the unsharded tokens."""

import jax

from asyncres_jax.mesh import make_mesh
from asyncres_jax.model.tiny import tiny_model

PROMPTS = [[{"role": "user", "content": c}] for c in ("list files", "hi", "count lines in the log", "sort")]


def _episode(model):
    e = model.engine
    conv = e.start(model.params, PROMPTS, seed=0)
    conv, texts = e.generate(model.params, conv, 10, {"temperature": 1.0})
    conv = e.extend(conv, [{"role": "user", "content": "ok"}, None, {"role": "user", "content": "output x"},
                           {"role": "user", "content": "failed"}])
    conv, more = e.generate(model.params, conv, 10, {"temperature": 1.0})
    return [t.tolist() for t in conv.tokens], texts + more, conv


def test_sharded_generation_matches_unsharded():
    assert len(jax.devices()) == 8
    ref_tokens, ref_texts, _ = _episode(tiny_model(0))
    mesh = make_mesh("4x2")  # batch over 4 data replicas, heads over 2
    tokens, texts, conv = _episode(tiny_model(0, mesh=mesh))
    assert tokens == ref_tokens and texts == ref_texts
    k = conv.cache.k[0]
    assert k.sharding.spec[:2] == ("data", "model") and len(k.sharding.device_set) == 8
