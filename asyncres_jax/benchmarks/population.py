"""python -m asyncres_jax.bench population [--json]: a low-rank ES population in one batch vs members one by one.

Three ways to generate `--new-tokens` tokens for `--members` members x `--prompts` prompts (SmolLM2, float32):
  lowrank   the members' low-rank perturbations (es/population.py) as ONE generation of members x prompts rows
            over one copy of the weights (time includes building the population's factors);
  fullrank  member after member: es.perturb (full-rank iid noise, a new copy of the weights), then a
            generation of the prompts (time includes the perturbations);
  plain     one unperturbed generation of members x prompts rows (the ceiling for `lowrank`).
Also `lowrank_gather`: `lowrank` with the per-row gather contraction instead of the default select.

EOS is disabled so every row generates exactly --new-tokens tokens (the same work in every variant); greedy
decoding. Each variant runs once to compile, then --repeats times interleaved (a, b, c, a, b, c, ...), and the
median is reported. Targets: lowrank at least 2x faster than fullrank, and at least 80% of plain.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import numpy as np

from asyncres_jax import es
from asyncres_jax.errors import UserError
from asyncres_jax.es.population import LowRankPopulation

PROMPTS = [
    "List the files in the current directory, largest first.",
    "Count the lines of every .log file under /var/log.",
    "Rename every .txt file in /home/user/notes to .md.",
    "Find the ten most common words in report.txt.",
    "Make backup.sh executable and run it.",
    "Extract data.tar.gz into /home/user/data and list what it holds.",
    "Replace every tab in config.ini with four spaces.",
    "Print the lines of access.log that contain a 404 status.",
    "Sort names.csv by its second column and keep the header.",
    "Show the disk usage of each folder in /home/user.",
    "Create a cron entry that runs cleanup.sh every night at 2am.",
    "Compress the logs folder into logs.zip.",
]


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m asyncres_jax.bench population", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default="lowrank,fullrank,plain,lowrank_gather")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.prompts > len(PROMPTS):
        ap.error(f"--prompts is at most {len(PROMPTS)}")
    return args


def main(argv: list[str]) -> int:
    from asyncres_jax.model import Model, load_model
    from asyncres_jax.model.generate import Engine
    from asyncres_jax.model.sampling import Sampling

    args = _parse(argv)
    m = load_model(args.model, dtype=args.dtype)
    prompts = [m.engine.encode(m.chat_prompt([{"role": "user", "content": p}])) for p in PROMPTS[:args.prompts]]
    # No EOS and no tokenizer: every row generates exactly new_tokens tokens.
    engine = Engine(Model(m.config.replace(eos_token_ids=()), m.params, None, m.mesh, m.source))
    greedy = Sampling(temperature=0.0)
    seeds = [es.member_seed(0, 0, i) for i in range(args.members)]
    lowrank_cfg = es.ESConfig(population=args.members, noise="lowrank", rank=args.rank)
    full_cfg = es.ESConfig(population=args.members, noise="iid")

    def generate(params, rows, perturbation=None):
        conv = engine.start_tokens(params, rows, seed=0, perturbation=perturbation)
        conv, _ = engine.generate(params, conv, args.new_tokens, greedy, perturbation=perturbation)
        return conv

    def lowrank(contraction):
        def run():
            t = time.perf_counter()
            pop = LowRankPopulation.create(m.params, lowrank_cfg, seeds, rows_per_member=len(prompts),
                                           contraction=contraction)
            jax.block_until_ready(pop)
            build = time.perf_counter() - t
            conv = generate(m.params, prompts * args.members, pop)
            return conv, {"build_s": build}
        return run

    def fullrank():
        convs, perturb_s = [], 0.0
        for s in seeds:
            t = time.perf_counter()
            params = jax.block_until_ready(es.perturb(m.params, s, full_cfg))
            perturb_s += time.perf_counter() - t
            convs.append(generate(params, prompts))
            del params
        return convs, {"perturb_s": perturb_s}

    def plain():
        return generate(m.params, prompts * args.members), {}

    variants = {"lowrank": lowrank("select"), "fullrank": fullrank, "plain": plain,
                "lowrank_gather": lowrank("gather")}
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in chosen:
        if v not in variants:
            raise UserError(f"unknown variant {v!r}; choose from {', '.join(variants)}")

    def timed(name):
        t = time.perf_counter()
        out, extra = variants[name]()
        convs = out if isinstance(out, list) else [out]
        generated = sum(int(np.sum(g)) for c in convs for g in c.generated_mask)
        seconds = time.perf_counter() - t
        print(f"{name}: {seconds:.2f} s, {generated} tokens", file=sys.stderr, flush=True)  # progress
        return seconds, generated, extra

    results = {name: {"compile_run_s": timed(name)[0], "runs_s": [], "extra": []} for name in chosen}
    for _ in range(args.repeats):
        for name in chosen:
            seconds, generated, extra = timed(name)
            results[name]["runs_s"].append(seconds)
            results[name]["extra"].append(extra)
            results[name]["tokens"] = generated
    for name, r in results.items():
        r["median_s"] = statistics.median(r["runs_s"])
        r["tokens_per_s"] = r["tokens"] / r["median_s"]
        for key in ("build_s", "perturb_s"):
            if r["extra"] and key in r["extra"][0]:
                r[f"median_{key}"] = statistics.median(e[key] for e in r["extra"])
        del r["extra"]
    out = {
        "benchmark": "population", "model": args.model, "dtype": args.dtype, "members": args.members,
        "prompts": args.prompts, "new_tokens": args.new_tokens, "rank": args.rank, "repeats": args.repeats,
        "devices": f"{jax.device_count()} x {jax.devices()[0].platform}", "variants": results,
    }
    med = {name: r["median_s"] for name, r in results.items()}
    if "lowrank" in med and "fullrank" in med:
        out["lowrank_speedup_vs_fullrank"] = med["fullrank"] / med["lowrank"]  # target >= 2
    if "lowrank" in med and "plain" in med:
        out["lowrank_fraction_of_plain"] = med["plain"] / med["lowrank"]  # target >= 0.8
    if "lowrank_gather" in med and "plain" in med:
        out["gather_fraction_of_plain"] = med["plain"] / med["lowrank_gather"]
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for name, r in results.items():
            print(f"{name:15s} median {r['median_s']:.2f} s  {r['tokens_per_s']:.1f} tok/s  runs {r['runs_s']}")
        for k in ("lowrank_speedup_vs_fullrank", "lowrank_fraction_of_plain", "gather_fraction_of_plain"):
            if k in out:
                print(f"{k}: {out[k]:.2f}")
    return 0
