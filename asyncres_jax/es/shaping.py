"""Fitness shaping: raw member fitness R [N] -> coefficients z [N] of the ES update.

Done in NumPy float64 on the host (N is tiny) and returned as float32, the exact values a replay log stores.
"""

from __future__ import annotations

import numpy as np

from asyncres_jax.errors import UserError
from asyncres_jax.es.config import ESConfig


def check_fitness(fitness, cfg: ESConfig) -> np.ndarray:
    r_n = np.asarray(fitness, dtype=np.float64)
    if r_n.shape != (cfg.population,):
        raise UserError(
            f"got {r_n.size} fitness values of shape {r_n.shape} for population={cfg.population}; "
            "pass one fitness value per member, in member order"
        )
    if not np.all(np.isfinite(r_n)):
        raise UserError(f"fitness contains NaN or inf at members {np.flatnonzero(~np.isfinite(r_n)).tolist()}; "
                        "score failed episodes as 0 instead")
    return r_n


def centered_ranks(r_n: np.ndarray) -> np.ndarray:
    """Ranks scaled to [-0.5, 0.5]; tied values share their average rank (so all-equal gives zeros)."""
    n = r_n.size
    if n == 1:
        return np.zeros(1)
    ranks = np.empty(n)
    ranks[np.argsort(r_n, kind="stable")] = np.arange(n)
    _, tie_group = np.unique(r_n, return_inverse=True)
    avg = np.bincount(tie_group, weights=ranks) / np.bincount(tie_group)
    return avg[tie_group] / (n - 1) - 0.5


def shape_fitness(fitness, cfg: ESConfig) -> np.ndarray:
    """z_i for each member (float32 [N]).

    zscore: (R - mean) / (population std + 1e-8). When all R are equal z is exactly 0, even where rounding
    would leave mean(R) an ulp away from the common value.
    """
    r_n = check_fitness(fitness, cfg)
    if cfg.shaping == "raw":
        return r_n.astype(np.float32)
    if r_n.max() == r_n.min():
        return np.zeros(cfg.population, np.float32)
    if cfg.shaping == "centered_rank":
        return centered_ranks(r_n).astype(np.float32)
    return ((r_n - r_n.mean()) / (r_n.std() + 1e-8)).astype(np.float32)
