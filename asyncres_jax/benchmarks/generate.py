"""bench generate: tokens/s of our KV-cached generation vs transformers' PyTorch `generate`.

Same model weights (the transformers model is built from our loaded params, so both see identical float32
numbers), same prompts, batch and greedy settings, both generating exactly --new-tokens per sequence (EOS
is ignored on both sides so the work is equal). Runs alternate ours/theirs so that the noise of a shared
machine hits both alike; we report the median of --runs each and the ratio, plus how many greedy tokens
agree (a sanity check that both computed the same thing).

"roofline" measures, in the same run, what bounds a decode step at this batch: the step's dense products alone
(every weight matrix once, XLA and torch) and one read of the weights. "ours_decode_vs_dense_bound" is how close
our decode comes to XLA's dense-only rate; "ratio_bound" the ratio to transformers we would reach with our
prefill and a decode that did nothing but those products.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import numpy as np

from asyncres_jax.errors import UserError, cli_main

_TOPICS = ["a cat", "the sea", "a robot", "a city at night", "an old tree", "a lost key", "a train", "the moon",
           "a baker", "a storm", "a library", "a mountain", "a violin", "a garden", "a desert", "a lighthouse"]


def _prompts(model, batch: int) -> list[str]:
    return [model.chat_prompt([{"role": "user", "content": f"Write a short story about {_TOPICS[i % len(_TOPICS)]} "
                                                           f"(number {i})."}]) for i in range(batch)]


def torch_model_from(model):
    """A transformers CausalLM with our params (float32), for a like-for-like comparison."""
    import torch
    import transformers

    c = model.config
    cls_cfg = transformers.Qwen2Config if c.architecture == "Qwen2ForCausalLM" else transformers.LlamaConfig
    hf_cfg = cls_cfg(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                     num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                     num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                     rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
                     tie_word_embeddings=c.tie_word_embeddings, max_position_embeddings=c.max_position_embeddings,
                     bos_token_id=c.bos_token_id, eos_token_id=list(c.eos_token_ids), torch_dtype="float32")
    if c.architecture != "Qwen2ForCausalLM":
        hf_cfg.attention_bias = c.attention_bias
    tm = getattr(transformers, c.architecture)(hf_cfg).float().eval()
    p = model.params

    def t(x, transpose=False):
        a = np.array(x, np.float32)
        return torch.from_numpy(a.T.copy() if transpose else a)
    sd = {"model.embed_tokens.weight": t(p["embed"]["embedding"]), "model.norm.weight": t(p["final_norm"]["scale"])}
    for i in range(c.num_layers):
        lp, pre = p["layers"][i], f"model.layers.{i}."
        sd[pre + "input_layernorm.weight"] = t(lp["input_norm"]["scale"])
        sd[pre + "post_attention_layernorm.weight"] = t(lp["post_attn_norm"]["scale"])
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[pre + f"self_attn.{name}.weight"] = t(lp["attn"][name]["kernel"], True)
            if "bias" in lp["attn"][name]:
                sd[pre + f"self_attn.{name}.bias"] = t(lp["attn"][name]["bias"])
        for name in ("gate_proj", "up_proj", "down_proj"):
            sd[pre + f"mlp.{name}.weight"] = t(lp["mlp"][name]["kernel"], True)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"] if c.tie_word_embeddings else t(p["lm_head"]["kernel"], True)
    missing, unexpected = tm.load_state_dict(sd, strict=False)
    missing = [k for k in missing if "rotary" not in k]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    return tm


def _left_pad(token_lists, pad_id):
    T = max(len(t) for t in token_lists)
    ids = np.full((len(token_lists), T), pad_id, np.int64)
    mask = np.zeros((len(token_lists), T), np.int64)
    for i, t in enumerate(token_lists):
        ids[i, T - len(t):], mask[i, T - len(t):] = t, 1
    return ids, mask


def _dense_step(params, x_bd, cfg):
    """One decode step's dense products and nothing else: every kernel once, as the decoder multiplies them."""
    import jax
    import jax.numpy as jnp

    for i in range(cfg.num_layers):
        a, m = params["layers"][i]["attn"], params["layers"][i]["mlp"]
        q, k, v = (x_bd @ a[n]["kernel"] for n in ("q_proj", "k_proj", "v_proj"))
        o = (q + jnp.tile(k + v, cfg.num_heads // cfg.num_kv_heads)) @ a["o_proj"]["kernel"]
        h = jax.nn.silu(x_bd @ m["gate_proj"]["kernel"]) * (x_bd @ m["up_proj"]["kernel"])
        x_bd = x_bd + 1e-3 * (o + h @ m["down_proj"]["kernel"])
    head = params["embed"]["embedding"].T if cfg.tie_word_embeddings else params["lm_head"]["kernel"]
    return x_bd @ head


def roofline(model, batch: int, repeats: int = 7) -> dict:
    """The limits of one decode step at this batch, measured now on this machine (best of `repeats`).

    dense: the step's matrix products alone, run by XLA (and by torch when installed) on the model's own
    weights; bandwidth: one read of all the weights (a jitted sum), which every decode step must do.
    """
    import jax
    import jax.numpy as jnp

    cfg, params = model.config, model.params
    leaves = jax.tree.leaves(params)
    n_bytes = sum(x.size * x.dtype.itemsize for x in leaves)
    flops = 2 * batch * sum(x.size for x in leaves if x.ndim == 2)  # every matrix once (tied head = embedding)
    dense = jax.jit(functools.partial(_dense_step, cfg=cfg))
    read = jax.jit(lambda p: sum(jnp.sum(x) for x in jax.tree.leaves(p)))
    x_bd = jnp.ones((batch, cfg.hidden_size), jnp.float32)

    def best(fn, *args):
        jax.block_until_ready(fn(*args))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            ts.append(time.perf_counter() - t0)
        return min(ts)

    t_dense, t_read = best(dense, params, x_bd), best(read, params)
    res = {"dense_step_ms": round(t_dense * 1e3, 4), "dense_gflop_s": round(flops / t_dense / 1e9, 1),
           "dense_bound_tok_s": round(batch / t_dense, 1), "weights_mb": round(n_bytes / 1e6, 1),
           "read_gb_s": round(n_bytes / t_read / 1e9, 1), "bandwidth_bound_tok_s": round(batch / t_read, 1)}
    try:
        import torch
    except ImportError:
        return res
    tp = jax.tree.map(lambda x: torch.from_numpy(np.array(x)), params)
    tx = torch.ones(batch, cfg.hidden_size)

    def torch_dense():
        with torch.no_grad():
            return _dense_step_torch(tp, tx, cfg)
    ts = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        torch_dense()
        ts.append(time.perf_counter() - t0)
    t_torch = min(ts[1:])
    return res | {"torch_dense_step_ms": round(t_torch * 1e3, 4),
                  "torch_dense_gflop_s": round(flops / t_torch / 1e9, 1)}


def _dense_step_torch(params, x_bd, cfg):
    import torch

    for i in range(cfg.num_layers):
        a, m = params["layers"][i]["attn"], params["layers"][i]["mlp"]
        q, k, v = (x_bd @ a[n]["kernel"] for n in ("q_proj", "k_proj", "v_proj"))
        o = (q + (k + v).repeat(1, cfg.num_heads // cfg.num_kv_heads)) @ a["o_proj"]["kernel"]
        h = torch.nn.functional.silu(x_bd @ m["gate_proj"]["kernel"]) * (x_bd @ m["up_proj"]["kernel"])
        x_bd = x_bd + 1e-3 * (o + h @ m["down_proj"]["kernel"])
    head = params["embed"]["embedding"].T if cfg.tie_word_embeddings else params["lm_head"]["kernel"]
    return x_bd @ head


@cli_main
def _transformers_generate(model, prompts, new_tokens: int):
    """A timed greedy `generate` of transformers' model on the same weights and prompts; None without torch."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_grad_enabled(False)
    tm = torch_model_from(model)
    ids, mask = _left_pad(prompts, pad_id=(model.config.eos_token_ids or (0,))[0])
    ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)

    def theirs():
        t0 = time.perf_counter()
        out = tm.generate(input_ids=ids_t, attention_mask=mask_t, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=int(ids[0, 0]))
        return time.perf_counter() - t0, out[:, ids.shape[1]:].numpy()
    return theirs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncres_jax.bench generate", description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-torch", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.batch < 1 or args.new_tokens < 1 or args.runs < 1:
        raise UserError("--batch, --new-tokens and --runs must be >= 1")

    import jax

    from asyncres_jax.model import load_model
    from asyncres_jax.model.generate import Engine

    model = load_model(args.model, dtype="float32")
    engine = Engine(model)
    engine.eos_ids = ()  # equal work on both sides: exactly new_tokens per sequence
    prompts = [engine.encode(p) for p in _prompts(model, args.batch)]
    N, B = args.new_tokens, args.batch

    def ours():
        t0 = time.perf_counter()
        conv = engine.start_tokens(model.params, prompts, seed=0)
        jax.block_until_ready(conv.cache)
        t1 = time.perf_counter()
        conv, _ = engine.generate(model.params, conv, N)
        t2 = time.perf_counter()
        gen = [np.asarray(t)[np.asarray(g)] for t, g in zip(conv.tokens, conv.generated_mask)]
        assert all(len(g) == N for g in gen)
        return t2 - t0, t2 - t1, np.stack(gen)

    theirs = None if args.no_torch else _transformers_generate(model, prompts, N)

    t_compile = time.perf_counter()
    _, _, ours_tokens = ours()  # warm-up: compiles every program the timed runs use
    t_compile = time.perf_counter() - t_compile
    if theirs is not None:
        theirs()
    ours_t, ours_decode_t, theirs_t = [], [], []
    for _ in range(args.runs):  # alternate, so machine noise hits both sides alike
        total, dec, _ = ours()
        ours_t.append(total)
        ours_decode_t.append(dec)
        if theirs is not None:
            t, theirs_tokens = theirs()
            theirs_t.append(t)
    res = {"model": args.model, "batch": B, "new_tokens": N, "runs": args.runs,
           "ours_tok_s": B * N / statistics.median(ours_t),
           "ours_decode_only_tok_s": B * N / statistics.median(ours_decode_t),
           "ours_runs_s": [round(x, 3) for x in ours_t], "ours_warmup_s": round(t_compile, 2),
           "prompt_tokens_max": max(len(p) for p in prompts), "jax_devices": len(jax.devices())}
    if theirs is not None:
        res |= {"transformers_tok_s": B * N / statistics.median(theirs_t),
                "transformers_runs_s": [round(x, 3) for x in theirs_t],
                "ratio": statistics.median(theirs_t) / statistics.median(ours_t),
                "run_ratios": [round(b / a, 3) for a, b in zip(ours_t, theirs_t)],
                "greedy_token_agreement": float(np.mean(theirs_tokens == ours_tokens))}
    res |= {"roofline": roofline(model, B)}
    res["ours_decode_vs_dense_bound"] = round(res["ours_decode_only_tok_s"] / res["roofline"]["dense_bound_tok_s"], 3)
    if theirs is not None:
        # The best ratio XLA's matrix products allow: our own prefill, then decode at the dense-only bound.
        prefill_s = statistics.median(ours_t) - statistics.median(ours_decode_t)
        best_s = prefill_s + B * N / res["roofline"]["dense_bound_tok_s"]
        res["ratio_bound"] = round(statistics.median(theirs_t) / best_s, 3)
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:24s} {v:.1f}" if isinstance(v, float) else f"{k:24s} {v}")
    return 0
