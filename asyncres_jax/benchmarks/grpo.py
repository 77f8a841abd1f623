"""bench grpo: memory and time of one GRPO learner step on SmolLM2-135M, and XLA's estimate for Qwen2.5-7B.

    python -m asyncres_jax.bench grpo --json [--rows 4] [--length 512] [--estimate-7b] [--length-7b 2048]

SmolLM2 (real weights, float32, one CPU device): a synthetic batch of `rows` sequences of `length` tokens, the
second half marked as generated, with old log-probs equal to the reference's. One `Learner.train` (1 epoch, one
minibatch, one micro-batch) is run to compile, then measured: wall time and peak RSS growth over the resident
state (masters + reference + Adam moments), via /proc/self/clear_refs (Linux). XLA's own buffer assignment of the
gradient program (`memory_analysis`: temporaries, arguments, outputs) is reported next to it.

--estimate-7b compiles (never runs) the same gradient program for Qwen2.5-7B-Instruct's shapes on abstract
parameters, one sequence of --length-7b tokens on one device, and reports XLA's temporaries for it; the resident
state (float32 masters, reference, gradients, two Adam moments) is counted from the parameter count.
"""

from __future__ import annotations

import argparse
import json
import time

from asyncres_jax.benchmarks.es import _reset_peak, _status_kib
from asyncres_jax.errors import UserError, cli_main

QWEN25_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                 num_kv_heads=4, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, attention_bias=True,
                 tie_word_embeddings=False, max_position_embeddings=32768, bos_token_id=None,
                 eos_token_ids=(151645,), architecture="Qwen2ForCausalLM")
GIB = 2 ** 30


def _synthetic_batch(learner, vocab: int, rows: int, length: int):
    import numpy as np

    from asyncres_jax.grpo.data import Batch, Segment

    rng = np.random.default_rng(0)
    segs = []
    for _ in range(rows):
        ids = rng.integers(0, vocab, length).astype(np.int32)
        gen = np.arange(length) >= length // 2
        segs.append(Segment(ids, gen, np.zeros(length, np.float32)))
    ref = learner.reference_logprobs(segs)
    segs = [Segment(s.ids, s.loss_mask, np.concatenate([[0.0], r]).astype(np.float32)) for s, r in zip(segs, ref)]
    adv = np.where(np.arange(rows) % 2, 1.0, -1.0).astype(np.float32)
    return Batch(segs, np.arange(rows), adv)


def _memory_analysis(compiled) -> dict:
    m = compiled.memory_analysis()
    return {"temp_gib": m.temp_size_in_bytes / GIB, "argument_gib": m.argument_size_in_bytes / GIB,
            "output_gib": m.output_size_in_bytes / GIB}


def smollm2(rows: int, length: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from asyncres_jax.grpo.step import GRPOHyper, Learner
    from asyncres_jax.model import load_model

    model = load_model("smollm2-135m-instruct", dtype="float32")
    n_params = sum(x.size for x in jax.tree.leaves(model.params))
    rss0 = _status_kib("VmRSS")
    hp = GRPOHyper(epochs=1, minibatch_size=rows, micro_batch_size=rows, temperature=0.6)
    learner = Learner(model.params, model.config, hp)
    model.params = None
    batch = _synthetic_batch(learner, model.config.vocab_size, rows, length)
    learner.train(batch)  # compile
    jax.block_until_ready(learner.params)
    rss_state = _status_kib("VmRSS")
    _reset_peak()
    t = time.perf_counter()
    stats = learner.train(batch)
    jax.block_until_ready(learner.params)
    seconds = time.perf_counter() - t
    peak = _status_kib("VmHWM")
    tokens = np.zeros((rows, length), np.int32)
    args = (learner.params, jnp.asarray(tokens), *(jnp.zeros((rows, length - 1), jnp.float32),) * 2,
            jnp.zeros(rows, jnp.float32), jnp.zeros((rows, length - 1), jnp.float32))
    xla = _memory_analysis(learner._grad.lower(*args).compile())
    return {
        "model": "smollm2-135m-instruct", "params_millions": n_params / 1e6, "rows": rows, "length": length,
        "resident_state_gib": (rss_state - rss0) * 1024 / GIB,
        "resident_state_expected_gib": 4 * n_params * 4 / GIB,  # masters, reference, Adam mu and nu (float32)
        "step_peak_rss_growth_gib": (peak - rss_state) * 1024 / GIB,
        "step_seconds": seconds, "tokens_per_second": rows * length / seconds,
        "grad_norm": stats["grad_norm"], "xla_grad_program": xla,
    }


def qwen7b(length: int) -> dict:
    import jax
    import jax.numpy as jnp

    from asyncres_jax.grpo.step import policy_logprobs
    from asyncres_jax.grpo.loss import grpo_loss
    from asyncres_jax.model.config import ModelConfig
    from asyncres_jax.model.decoder import abstract_params

    cfg = ModelConfig(**QWEN25_7B)
    params = abstract_params(cfg)
    n_params = sum(x.size for x in jax.tree.leaves(params))

    def grad_fn(p, tokens_bt, old_bt, ref_bt, adv_b, w_bt):
        def loss_fn(q):
            return grpo_loss(policy_logprobs(q, cfg, tokens_bt, 0.6), old_bt, ref_bt, adv_b, w_bt, clip_eps=0.2,
                             kl_coef=1e-3)[0]
        return jax.grad(loss_fn)(p)

    f32 = jnp.float32
    args = (params, jax.ShapeDtypeStruct((1, length), jnp.int32), *(jax.ShapeDtypeStruct((1, length - 1), f32),) * 2,
            jax.ShapeDtypeStruct((1,), f32), jax.ShapeDtypeStruct((1, length - 1), f32))
    t = time.perf_counter()
    xla = _memory_analysis(jax.jit(grad_fn).lower(*args).compile())
    params_gib = n_params * 4 / GIB
    return {
        "model": "Qwen2.5-7B-Instruct (abstract)", "params_billions": n_params / 1e9, "length": length,
        "compile_seconds": time.perf_counter() - t, "xla_grad_program": xla,
        "masters_gib": params_gib, "gradients_gib": params_gib, "adam_moments_gib": 2 * params_gib,
        "reference_bf16_gib": params_gib / 2,
        "logits_per_sequence_gib": length * cfg.vocab_size * 4 / GIB,
    }


def main(argv: list[str]) -> int:
    return cli_main(_main)(argv)


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m asyncres_jax.bench grpo", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4, help="sequences in the SmolLM2 micro-batch")
    p.add_argument("--length", type=int, default=512, help="tokens per SmolLM2 sequence")
    p.add_argument("--estimate-7b", action="store_true", help="also compile the 7B gradient program abstractly")
    p.add_argument("--length-7b", type=int, default=2048, help="tokens of the one 7B sequence")
    p.add_argument("--skip-smollm2", action="store_true", help="only the 7B estimate")
    p.add_argument("--json", action="store_true", help="print JSON")
    ns = p.parse_args(argv)
    if ns.rows < 1 or ns.length < 2 or ns.length_7b < 2:
        raise UserError("--rows must be >= 1 and --length/--length-7b >= 2")
    out = {}
    if not ns.skip_smollm2:
        out["smollm2"] = smollm2(ns.rows, ns.length)
    if ns.estimate_7b:
        out["qwen2_5_7b"] = qwen7b(ns.length_7b)
    print(json.dumps(out, indent=None if ns.json else 2))
    return 0
