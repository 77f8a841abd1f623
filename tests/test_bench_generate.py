"""bench generate's in-run roofline: the dense step it times is the decoder's dense work, in XLA and in torch."""

import jax
import numpy as np
import pytest

from asyncres_jax.benchmarks.generate import _dense_step, _dense_step_torch, roofline
from asyncres_jax.model.tiny import tiny_model


def test_xla_and_torch_dense_steps_compute_the_same_products():
    torch = pytest.importorskip("torch")
    model = tiny_model()
    x_bd = np.random.default_rng(0).normal(size=(3, model.config.hidden_size)).astype(np.float32)
    ours = np.asarray(jax.jit(lambda p, x: _dense_step(p, x, model.config))(model.params, x_bd))
    tp = jax.tree.map(lambda a: torch.from_numpy(np.array(a)), model.params)
    theirs = _dense_step_torch(tp, torch.from_numpy(x_bd), model.config).numpy()
    assert ours.shape == (3, model.config.vocab_size)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


def test_roofline_reports_positive_limits_consistent_with_the_weights():
    model = tiny_model()
    r = roofline(model, batch=4, repeats=2)
    n_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.params))
    assert r["weights_mb"] == pytest.approx(n_bytes / 1e6, abs=0.05)
    assert all(r[k] > 0 for k in ("dense_step_ms", "dense_gflop_s", "dense_bound_tok_s", "read_gb_s"))
    # tokens/s bounds are the batch over the step's time: 4 rows per dense step
    assert r["dense_bound_tok_s"] == pytest.approx(4 / (r["dense_step_ms"] / 1e3), rel=0.02)
