"""bench es: one ES update (N members) on the SmolLM2-135M parameter tree, full-rank and low-rank, next to the
time to merely draw the N full-rank noise trees.

    python -m asyncres_jax.bench es --json [--population 30] [--rank 1] [--variants ...]

The tree's shapes come from the SmolLM2-135M-Instruct GGUF header (30 layers, d=576, f=1536, vocab 49152,
tied embeddings; 134.5M float32 parameters); the values are random, which changes nothing ES does. Each variant
runs in its own subprocess: load the parameters, compile on a tree of one leaf per distinct shape, then measure
wall time and peak memory. Memory = peak RSS during the measured call minus RSS just before it (Linux: the
peak is reset through /proc/self/clear_refs), i.e. the growth over the loaded parameters and optimiser state.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time

from asyncres_jax.errors import UserError, cli_main

VARIANTS = {
    "noise_draws": "draw the N full-rank noise trees, one after another (es.noise; each discarded)",
    "fullrank": "es.update, iid noise (pure: new parameter buffers)",
    "fullrank_donate": "es.update, iid noise, donate=True (old buffers reused)",
    "lowrank": "es.update, lowrank noise (pure)",
    "lowrank_donate": "es.update, lowrank noise, donate=True",
}
TARGETS = {
    "fullrank_over_noise_draws": "<= 1.5",
    "fullrank_extra_memory_over_params": "<= 1.0",
    "fullrank_over_lowrank": ">= 10",
}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (peak RSS) to the current RSS


def smollm2_params():
    """Random float32 parameters with SmolLM2-135M's tree of shapes (from its GGUF header)."""
    import jax

    from asyncres_jax.model import named_model_path
    from asyncres_jax.model.decoder import abstract_params
    from asyncres_jax.model.gguf import read_gguf

    _, cfg = read_gguf(named_model_path("smollm2-135m-instruct"))
    shapes = abstract_params(cfg)
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(shapes))))
    return jax.tree.map(lambda s: 0.02 * jax.random.normal(next(keys), s.shape, s.dtype), shapes)


def one_leaf_per_shape(params):
    """A small tree holding one leaf of every distinct shape: compiles everything the full tree needs."""
    import jax

    from asyncres_jax.es import leaf_paths

    seen = {}
    for path, x in zip(leaf_paths(params), jax.tree.leaves(params)):
        seen.setdefault(x.shape, (path, jax.numpy.copy(x)))  # a copy: donation must not free params
    return {path.replace("/", "."): x for path, x in seen.values()}


def measure(variant: str, population: int, rank: int) -> dict:
    import jax
    import numpy as np

    from asyncres_jax import es

    params = jax.block_until_ready(smollm2_params())
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    noise = "lowrank" if variant.startswith("lowrank") else "iid"
    cfg = es.ESConfig(population=population, noise=noise, rank=rank)
    seeds = [es.member_seed(0, 0, i) for i in range(population)]
    fitness = np.random.default_rng(0).random(population)
    donate = variant.endswith("_donate")

    if variant == "noise_draws":
        jax.block_until_ready(es.noise(params, seeds[0], cfg))  # compile (the whole tree is one program)

        def run():
            for s in seeds:
                jax.block_until_ready(es.noise(params, s, cfg))
            return None
    else:
        small = one_leaf_per_shape(params)
        jax.block_until_ready(es.update(small, es.init(small, cfg), seeds, fitness, cfg, donate=donate))
        state = es.init(params, cfg)

        def run():
            return jax.block_until_ready(es.update(params, state, seeds, fitness, cfg, donate=donate))

    gc.collect()
    base_kib = _status_kib("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    out = run()
    seconds = time.perf_counter() - start
    extra = (_status_kib("VmHWM") - base_kib) * 1024
    del out
    return {
        "variant": variant,
        "seconds": round(seconds, 3),
        "peak_extra_bytes": extra,
        "peak_extra_over_params": round(extra / param_bytes, 3),
        "param_bytes": param_bytes,
        "param_count": sum(x.size for x in jax.tree.leaves(params)),
        "leaves": len(jax.tree.leaves(params)),
        "backend": jax.default_backend(),
    }


def _run_child(variant: str, args) -> dict:
    cmd = [sys.executable, "-m", "asyncres_jax.benchmarks.es", "--child", variant,
           "--population", str(args.population), "--rank", str(args.rank)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"variant {variant} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(results: dict, population: int, rank: int) -> dict:
    def ratio(a, b):
        if a in results and b in results:
            return round(results[a]["seconds"] / results[b]["seconds"], 2)
        return None

    any_result = next(iter(results.values()))
    out = {
        "benchmark": "es",
        "population": population,
        "rank": rank,
        "param_count": any_result["param_count"],
        "param_bytes": any_result["param_bytes"],
        "leaves": any_result["leaves"],
        "backend": any_result["backend"],
        "results": {k: {f: v[f] for f in ("seconds", "peak_extra_bytes", "peak_extra_over_params")}
                    for k, v in results.items()},
        "ratios": {
            "fullrank_over_noise_draws": ratio("fullrank", "noise_draws"),
            "fullrank_over_lowrank": ratio("fullrank", "lowrank"),
            "fullrank_extra_memory_over_params": results.get("fullrank", {}).get("peak_extra_over_params"),
            "fullrank_donate_extra_memory_over_params":
                results.get("fullrank_donate", {}).get("peak_extra_over_params"),
        },
        "targets": TARGETS,
    }
    return out


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncres_jax.bench es", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--population", type=int, default=30, help="members N (default 30)")
    parser.add_argument("--rank", type=int, default=1, help="rank of the lowrank variants (default 1)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), metavar="NAME",
                        help="subset of: " + ", ".join(VARIANTS))
    parser.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.population < 1 or args.rank < 1:
        raise UserError("--population and --rank must be >= 1")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        raise UserError(f"unknown variant(s) {', '.join(unknown)}; choose from: {', '.join(VARIANTS)}")
    if not sys.platform.startswith("linux"):
        raise UserError("bench es measures peak RSS through /proc and runs on Linux only")
    if args.child:
        print(json.dumps(measure(args.child, args.population, args.rank)))
        return 0
    results = {}
    for variant in args.variants:
        results[variant] = _run_child(variant, args)
        if not args.json:
            r = results[variant]
            print(f"{variant:16s} {r['seconds']:8.2f} s   extra memory {r['peak_extra_bytes'] / 2**20:8.1f} MiB "
                  f"({r['peak_extra_over_params']:.2f}x params)   {VARIANTS[variant]}", flush=True)
    summary = summarize(results, args.population, args.rank)
    print(json.dumps(summary, indent=2) if args.json else json.dumps(summary["ratios"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
