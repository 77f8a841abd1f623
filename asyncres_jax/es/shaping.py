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


def shape_fitness(fitness, cfg: ESConfig, groups=None) -> np.ndarray:
    """z_i for each member (float32 [N]).

    zscore: (R - mean) / (population std + 1e-8). When all R are equal z is exactly 0, even where rounding
    would leave mean(R) an ulp away from the common value.
    groups: each member's task batch (any hashable labels, [N]). With cfg.shaping_groups == "batch" each batch is
    shaped on its own (shape_within_groups); with "none" (the paper's rule) they are ignored.
    """
    r_n = check_fitness(fitness, cfg)
    if cfg.shaping == "raw":
        return r_n.astype(np.float32)
    if cfg.shaping_groups == "batch" and groups is not None:
        return shape_within_groups(r_n, groups, cfg.shaping).astype(np.float32)
    return _shape(r_n, cfg.shaping).astype(np.float32)


def _shape(r_n: np.ndarray, shaping: str) -> np.ndarray:
    """zscore or centered_rank of one set of results, float64."""
    if r_n.max() == r_n.min():
        return np.zeros(r_n.size)
    if shaping == "centered_rank":
        return centered_ranks(r_n)
    return (r_n - r_n.mean()) / (r_n.std() + 1e-8)


def shape_within_groups(r_n: np.ndarray, groups_n, shaping: str) -> np.ndarray:
    """Shape each group (the results played on one task batch) apart from the others, float64 [N].

    Results played on different task batches are not comparable (a batch's difficulty moves every score on it),
    so each is compared only with the results of its own batch. A group of one has no reference: z = 0.
    centered_rank: a group of k ranks is rescaled by sqrt((N+1)(k-1) / ((N-1)(k+1))) so that its ranks have the
    variance of a whole cohort's (N) ranks; zscore: each group is standardised on its own.
    """
    groups_n = np.asarray(groups_n)
    n = r_n.size
    if groups_n.shape != (n,):
        raise UserError(f"got {groups_n.size} group labels of shape {groups_n.shape} for {n} fitness values; "
                        "pass one task-batch label per member")
    z_n = np.zeros(n)
    for g in np.unique(groups_n):
        in_g = groups_n == g
        k = int(in_g.sum())
        if k == 1:
            continue
        z_n[in_g] = _shape(r_n[in_g], shaping)
        if shaping == "centered_rank":
            z_n[in_g] *= np.sqrt((n + 1) * (k - 1) / ((n - 1) * (k + 1)))
    return z_n
