"""ESConfig: the hyperparameters of one ES run. Defaults are the paper's ES (N=30, sigma=0.0015, alpha=0.00075,
full-rank iid noise, z-scored fitness, plain SGD step theta += alpha/N * sum z_i eps_i, no antithetic pairs)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from asyncres_jax.errors import UserError

NOISE_MODES = ("iid", "shared", "lowrank")
SHAPINGS = ("zscore", "centered_rank", "raw")
SHAPING_GROUPS = ("none", "batch")
OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class ESConfig:
    population: int = 30  # N members per update
    sigma: float = 0.0015  # perturbation scale: member i evaluates theta + sigma * eps_i
    alpha: float = 0.00075  # learning rate of the optax optimiser
    noise: str = "iid"  # iid | shared (equal-shaped leaves share one draw) | lowrank (EGGROLL A B^T / sqrt(r))
    rank: int = 1  # r of lowrank noise
    shaping: str = "zscore"  # zscore | centered_rank | raw
    shaping_groups: str = "none"  # none (the whole cohort together) | batch (each task batch apart: shaping.py)
    antithetic: bool = False  # N members = N/2 seeds: member 2k = (+, seed k), member 2k+1 = (-, seed k)
    optimizer: str = "sgd"  # sgd (the paper's rule) | adam
    divide_by_sigma: bool = False  # estimate sum z_i eps_i / (N sigma) (the textbook gradient) instead of / N
    weight_decay: float = 0.0  # decoupled pull toward the initial parameters: theta -= alpha * wd * (theta - theta0)
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8

    def __post_init__(self):
        def bad(name: str, why: str):
            raise UserError(f"ESConfig.{name}={getattr(self, name)!r} is not valid; {why}")

        if not isinstance(self.population, int) or self.population < 1:
            bad("population", "it must be an integer >= 1")
        for name in ("sigma", "alpha"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                bad(name, "it must be a finite number > 0")
        if not isinstance(self.rank, int) or self.rank < 1:
            bad("rank", "it must be an integer >= 1")
        if self.noise not in NOISE_MODES:
            bad("noise", f"choose one of {', '.join(NOISE_MODES)}")
        if self.shaping not in SHAPINGS:
            bad("shaping", f"choose one of {', '.join(SHAPINGS)}")
        if self.shaping_groups not in SHAPING_GROUPS:
            bad("shaping_groups", f"choose one of {', '.join(SHAPING_GROUPS)}")
        if self.shaping_groups != "none" and self.shaping == "raw":
            bad("shaping_groups", "raw fitness is not shaped at all; use shaping=zscore or centered_rank with it")
        if self.optimizer not in OPTIMIZERS:
            bad("optimizer", f"choose one of {', '.join(OPTIMIZERS)}")
        if self.antithetic and self.population % 2:
            bad("population", "it must be even with antithetic=True (members come in +/- pairs)")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            bad("weight_decay", "it must be a finite number >= 0")

    def member_sign(self, member_index: int) -> int:
        """Antithetic members come in pairs sharing a seed: member 2k is +eps, member 2k+1 is -eps."""
        return -1 if self.antithetic and member_index % 2 else 1

    def update_seeds(self, seeds):
        """The seeds an update applies: one per antithetic pair (sync cohorts keep pairs in order)."""
        return seeds[0::2] if self.antithetic else seeds

    @property
    def num_seeds(self) -> int:
        """How many member seeds one update takes: N, or N/2 with antithetic pairs."""
        return self.population // 2 if self.antithetic else self.population
