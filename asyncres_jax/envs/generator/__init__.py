"""The offline procedural task generator: `python -m asyncres_jax.tasks generate --out DIR --n N --seed S`.

Splits are disjoint by construction. Every task is a combination (family, variant, difficulty, categorical
parameters); a combination's split is a fixed function of its hash, so a combination that lands in test can
never be generated for train or val, whatever the seed. Some variants of some families (Family.held_out) are
test-only. Within a combination, the random contents (words, numbers, file counts) still differ per task.
Everything derives from random.Random(f"...{seed}:{index}:{attempt}"): the same seed writes the same bytes.
"""

from __future__ import annotations

import hashlib
import pathlib
import random
import shutil
from typing import Sequence

from asyncres_jax.envs.generator.families import FAMILIES, Family
from asyncres_jax.envs.generator.spec import Spec, write_task
from asyncres_jax.errors import UserError

DIFFICULTIES = ("easy", "medium", "hard")
FRACTIONS = {"train": 0.84, "val": 0.04, "test": 0.12}  # Endless Terminals: 2,083 / 100 / 300
_BUCKETS = {"test": range(0, 12), "val": range(12, 16), "train": range(16, 100)}
MAX_ATTEMPTS = 400


def combination_id(fam: Family, variant: str, difficulty: str, params: tuple) -> str:
    return hashlib.sha256(repr((fam.name, variant, difficulty, params)).encode()).hexdigest()[:16]


def combination_split(fam: Family, variant: str, difficulty: str, params: tuple) -> str:
    """The one split a combination belongs to."""
    if variant in fam.held_out:
        return "test"
    bucket = int(combination_id(fam, variant, difficulty, params), 16) % 100
    return next(s for s, r in _BUCKETS.items() if bucket in r)


def split_sizes(n: int) -> dict[str, int]:
    if n < 3:
        return {"train": n, "val": 0, "test": 0}
    test = max(1, round(n * FRACTIONS["test"]))
    val = max(1, round(n * FRACTIONS["val"]))
    return {"train": n - test - val, "val": val, "test": test}


def draw(seed: int, index: int, split: str, fam: Family, difficulty: str) -> tuple[str, Spec]:
    """A (variant, spec) of this family and difficulty whose combination belongs to `split`."""
    variants = fam.variants if split == "test" else tuple(v for v in fam.variants if v not in fam.held_out)
    for attempt in range(MAX_ATTEMPTS):
        rng = random.Random(f"asyncres-gen:{seed}:{index}:{attempt}")
        variant = rng.choice(variants)
        spec = fam.build(rng, difficulty, variant)
        if combination_split(fam, variant, difficulty, spec.params) == split:
            return variant, spec
    raise LookupError(f"no {split} combination of {fam.name}/{difficulty} in {MAX_ATTEMPTS} draws")


def plan(n: int, seed: int, families: Sequence[str] = ()) -> list[tuple[str, str, str]]:
    """(split, family, difficulty) per task index: splits interleaved, families and tiers balanced."""
    rng = random.Random(f"asyncres-plan:{seed}")
    splits = [s for s, k in split_sizes(n).items() for _ in range(k)]
    rng.shuffle(splits)
    fams = sorted(families or FAMILIES)
    out, counters = [], {s: rng.randrange(len(fams) * 3) for s in FRACTIONS}
    for s in splits:
        c = counters[s]
        counters[s] += 1
        out.append((s, fams[c % len(fams)], DIFFICULTIES[(c // len(fams)) % 3]))
    return out


def generate(out: str | pathlib.Path, n: int, seed: int, *, force: bool = False,
             families: Sequence[str] = ()) -> dict[str, list[str]]:
    """Write n tasks and DIR/splits/{train,val,test}.txt; returns the split lists. `families` (default all)
    restricts the generator to those families; a combination's split does not depend on it."""
    if n < 1:
        raise UserError(f"--n must be at least 1, got {n}")
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise UserError(f"unknown task families {unknown}; choose from {sorted(FAMILIES)}")
    root = pathlib.Path(out)
    if root.exists() and any(root.iterdir()):
        if not force:
            raise UserError(f"{root} is not empty; choose a new --out folder (or pass --force to replace it)")
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[str]] = {"train": [], "val": [], "test": []}
    fams = sorted(families or FAMILIES)
    for i, (split, fam_name, difficulty) in enumerate(plan(n, seed, fams)):
        for k in range(len(fams)):  # a family with no combination in this split cedes to the next one
            fam = FAMILIES[fams[(fams.index(fam_name) + k) % len(fams)]]
            try:
                variant, spec = draw(seed, i, split, fam, difficulty)
                break
            except LookupError:
                continue
        else:
            raise RuntimeError(f"no family has a {split}/{difficulty} combination")
        fam_name = fam.name
        name = f"{fam_name}-{variant.replace('.', '')}-{difficulty}-{i:05d}"
        meta = {"family": fam_name, "domain": fam.domain, "variant": variant, "difficulty": difficulty,
                "split": split, "generator_seed": seed, "category": fam.domain,
                "combination": combination_id(fam, variant, difficulty, spec.params)}
        write_task(root, name, spec, meta)
        splits[split].append(name)
    (root / "splits").mkdir(exist_ok=True)
    for s, names in splits.items():
        (root / "splits" / f"{s}.txt").write_text("".join(f"{nm}\n" for nm in names))
    return splits


__all__ = ["FAMILIES", "DIFFICULTIES", "generate", "combination_id", "combination_split", "split_sizes", "draw"]
