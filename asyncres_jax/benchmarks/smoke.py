"""bench smoke: one accelerator, random weights of a real model's shapes: decode tokens/s, one ES update, peak memory,
each next to what the compile-only plan (asyncres_jax/plan.py) predicts for the same shapes on this device.

    python -m asyncres_jax.bench smoke --json                # Qwen2.5-7B shapes: batch 32 x 256 tokens, N = 30
    python -m asyncres_jax.bench smoke --tiny --json         # the same code on a tiny Qwen2 config (CPU tests)

scripts/gpu_smoke.sh runs the first on a GPU host. The weights are random (float32 masters for the ES update, a
bfloat16 rollout copy for decoding); EOS is ignored so every row decodes exactly --new-tokens. Decoding is timed
on the second of two identical generations (the first compiles); the ES update likewise.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from asyncres_jax.errors import UserError, cli_main

QWEN_7B = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "qwen2_5_7b_instruct"


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m asyncres_jax.bench smoke", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(QWEN_7B), help="a folder with a config.json (its shapes), or 'tiny'")
    p.add_argument("--batch", type=int, default=32, help="rows decoded together")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens decoded per row")
    p.add_argument("--prompt-tokens", type=int, default=32, help="random prompt tokens per row")
    p.add_argument("--population", type=int, default=30, help="ES members N of the update")
    p.add_argument("--accelerator", default="h100", help="the plan's accelerator: h100, h200 or v5e")
    p.add_argument("--tiny", action="store_true", help="a tiny Qwen2 config, batch 4 x 16 tokens, N = 4 (tests)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    ns = p.parse_args(argv)
    if ns.tiny:
        ns.model, ns.batch, ns.new_tokens, ns.prompt_tokens, ns.population = "tiny", 4, 16, 8, 4
    for name in ("batch", "new_tokens", "prompt_tokens"):
        if getattr(ns, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    if ns.population < 2:
        raise UserError("--population must be >= 2")
    return ns


def run(ns: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from asyncres_jax import es, plan
    from asyncres_jax.config import load_config
    from asyncres_jax.mesh import make_mesh
    from asyncres_jax.model.sharding import param_shardings
    from asyncres_jax.model import Model, decoder
    from asyncres_jax.model.generate import Engine

    device = jax.devices()[0]
    context = ns.prompt_tokens + ns.new_tokens + 1
    cfg = load_config(None, [f"model.name={ns.model}", "mesh=1x1", "model.rollout_dtype=bfloat16",
                             f"es.population={ns.population}", f"es.tasks_per_member={ns.batch}",
                             f"episode.context_limit={context}", "tasks.dataset=fake"])
    predicted = plan.make_plan(cfg, ns.accelerator, [device], programs=("es",), report=lambda s: None)
    mcfg = predicted.config.replace(eos_token_ids=())  # every row decodes exactly new_tokens
    mesh = make_mesh("1x1", [device], cfg=mcfg)
    shardings = param_shardings(decoder.abstract_params(mcfg), mcfg, mesh)
    masters = jax.jit(lambda k: decoder.init_params(mcfg, k), out_shardings=shardings)(jax.random.key(0))
    rollout = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p))(masters)
    engine = Engine(Model(mcfg, rollout, None, mesh, "random"), context_limit=context)
    prompts = np.random.default_rng(0).integers(0, mcfg.vocab_size, (ns.batch, ns.prompt_tokens)).tolist()

    def decode() -> float:
        conv = engine.start_tokens(rollout, prompts)
        jax.block_until_ready(conv.cache)
        t = time.perf_counter()
        conv, _ = engine.generate(rollout, conv, ns.new_tokens)
        jax.block_until_ready(conv.cache)
        return time.perf_counter() - t

    decode()  # compiles
    decode_s = decode()

    es_cfg = cfg.es.core()
    seeds = np.asarray([es.member_seed(0, 0, i) for i in range(ns.population)], np.int64)
    shaped = es.shape_fitness(np.random.default_rng(1).random(ns.population).astype(np.float32), es_cfg)
    state = es.init(masters, es_cfg)
    update_s = []
    for _ in range(2):  # the first compiles
        t = time.perf_counter()
        masters, state = es.apply_logged_update(masters, state, seeds, shaped, es_cfg, donate=True)
        jax.block_until_ready(masters)
        update_s.append(time.perf_counter() - t)
    stats = device.memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return {
        "device": str(device.device_kind), "platform": device.platform, "model": ns.model,
        "n_params": predicted.n_params, "batch": ns.batch, "new_tokens": ns.new_tokens, "population": ns.population,
        "decode_seconds": decode_s, "tokens_per_s": ns.batch * ns.new_tokens / decode_s,
        "plan_tokens_per_s": ns.batch / predicted.decode_roofline_s(),
        "update_seconds_first": update_s[0], "update_seconds": update_s[1],
        "peak_bytes": peak,
        "plan_bytes": predicted.total("es"),
        "plan_accelerator": predicted.accelerator.name,
    }


@cli_main
def main(argv: list[str] | None = None) -> int:
    ns = _parse(sys.argv[1:] if argv is None else argv)
    out = run(ns)
    if ns.json:
        print(json.dumps(out, indent=2))
        return 0
    gb = 1e9
    peak = "n/a (no memory_stats on this device)" if out["peak_bytes"] is None else f"{out['peak_bytes'] / gb:.2f} GB"
    print(f"{out['device']} ({out['platform']}), {out['model']}: {out['n_params'] / 1e9:.2f}B parameters\n"
          f"decode {out['batch']} x {out['new_tokens']} tokens: {out['tokens_per_s']:,.0f} tokens/s "
          f"(plan's roofline on {out['plan_accelerator']}: {out['plan_tokens_per_s']:,.0f})\n"
          f"ES update N={out['population']}: {out['update_seconds']:.2f} s (first, with compile: "
          f"{out['update_seconds_first']:.2f} s)\n"
          f"peak memory {peak} (plan: {out['plan_bytes'] / gb:.2f} GB)")
    return 0
