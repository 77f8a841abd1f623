"""The GRPO learner: jitted, sharded gradient steps over a batch of episodes, AdamW with a global-norm clip.

One `Learner.train(batch)` = `epochs` passes over the batch's episodes in shuffled minibatches of
`minibatch_size` episodes; each minibatch is one optimiser step whose gradient is accumulated over
micro-batches of at most `micro_batch_size` rows (the loss is a fixed-weight sum, so micro-batch gradients add).

Sharding: the parameters (and the reference copy, the gradients and Adam's moments) follow
model.sharding.param_shardings (weights split over "model"); every row-major batch array is split over "data",
so XLA reduces the gradient across data replicas. The reference log-probs are computed once per batch, before
the first update.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from asyncres_jax.grpo.data import Batch, Segment, pack
from asyncres_jax.grpo.loss import grpo_loss, sequence_weights, token_logprobs, tokens_per_episode
from asyncres_jax.model.sharding import param_shardings
from asyncres_jax.model import decoder
from asyncres_jax.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class GRPOHyper:
    lr: float = 1e-6
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    clip_eps: float = 0.2
    kl_coef: float = 1e-3
    epochs: int = 2
    minibatch_size: int = 64  # episodes per optimiser step
    micro_batch_size: int = 8  # rows per forward/backward pass
    temperature: float = 0.6  # the sampling temperature the old log-probs were recorded at (0: greedy = 1.0)

    @classmethod
    def from_config(cls, cfg) -> "GRPOHyper":
        """The `grpo:` section of a training config (and the episodes' sampling temperature)."""
        g = cfg.grpo
        return cls(lr=g.lr, weight_decay=g.weight_decay, grad_clip=g.grad_clip, clip_eps=g.clip_eps,
                   kl_coef=g.kl_coef, epochs=g.epochs, minibatch_size=g.minibatch_size,
                   micro_batch_size=g.micro_batch_size, temperature=cfg.episode.temperature)

    @property
    def logprob_temperature(self) -> float:
        # The engine reports greedy log-probs at temperature 1 (log_softmax of the raw logits).
        return self.temperature if self.temperature > 0 else 1.0


def make_optimizer(hp: GRPOHyper) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(hp.grad_clip),
                       optax.adamw(hp.lr, weight_decay=hp.weight_decay))


def opt_template(params, cfg):
    """The optimiser state's structure for a training config, to restore a GRPO checkpoint into."""
    return jax.eval_shape(make_optimizer(GRPOHyper.from_config(cfg)).init, params)


def policy_logprobs(params, cfg: ModelConfig, tokens_bt, temperature) -> jax.Array:
    """[B, T] tokens -> [B, T-1] log-prob of token t+1 under softmax(logits_t / temperature)."""
    positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1], dtype=jnp.int32), tokens_bt.shape)
    logits_btv, _ = decoder.forward(params, cfg, tokens_bt, positions_bt)
    return token_logprobs(logits_btv[:, :-1], tokens_bt[:, 1:], temperature)


def step_functions(cfg: ModelConfig, hp: GRPOHyper, shardings=None):
    """(logprobs_fn, grad_fn, apply_fn), the programs of one optimiser step, to jit: the log-probs of rows, one
    micro-batch's loss gradient (constrained to the parameters' shardings when given) and the AdamW update."""
    tx = make_optimizer(hp)
    constrain = (lambda t: t) if shardings is None else functools.partial(jax.lax.with_sharding_constraint,
                                                                          shardings=shardings)
    temperature = hp.logprob_temperature

    def logprobs_fn(p, tokens_bt):
        return policy_logprobs(p, cfg, tokens_bt, temperature)

    def grad_fn(p, tokens_bt, old_bt, ref_bt, adv_b, weight_bt):
        def loss_fn(q):
            logp_bt = policy_logprobs(q, cfg, tokens_bt, temperature)
            return grpo_loss(logp_bt, old_bt, ref_bt, adv_b, weight_bt, clip_eps=hp.clip_eps, kl_coef=hp.kl_coef)
        (loss, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(p)
        return constrain(g), {**aux, "loss": loss}

    def apply_fn(p, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, optax.tree.norm(grads)
    return logprobs_fn, grad_fn, apply_fn


class Learner:
    """Float32 master parameters, the frozen reference (the initial model) and the AdamW state, on a mesh."""

    def __init__(self, params, cfg: ModelConfig, hp: GRPOHyper, mesh=None, ref_params=None):
        self.cfg, self.hp, self.mesh = cfg, hp, mesh
        self.data = 1 if mesh is None else mesh.shape["data"]
        self.shardings = None if mesh is None else param_shardings(params, cfg, mesh)
        place = (lambda t: t) if mesh is None else (lambda t: jax.device_put(t, self.shardings))
        # Own copies: updates donate the masters, which must not delete the caller's arrays (or the reference).
        self.params = jax.tree.map(jnp.copy, place(params))
        self.ref_params = jax.tree.map(jnp.copy, place(params if ref_params is None else ref_params))
        self.tx = make_optimizer(hp)
        self.opt_state = self.place_state(jax.jit(self.tx.init)(self.params))
        self.steps = 0  # optimiser steps taken
        logprobs_fn, grad_fn, apply_fn = step_functions(cfg, hp, self.shardings)
        self._logprobs = jax.jit(logprobs_fn)
        self._grad = jax.jit(grad_fn)
        self._add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b), donate_argnums=0)
        self._apply = jax.jit(apply_fn, donate_argnums=(0, 1))

    # -- placement -----------------------------------------------------------------------------------

    def place_state(self, opt_state):
        """Adam's step counters come out of init on one device; replicate them over the mesh like the rest."""
        if self.mesh is None:
            return opt_state
        everywhere = NamedSharding(self.mesh, P())

        def place(x):
            on_mesh = isinstance(x.sharding, NamedSharding) and x.sharding.mesh == self.mesh
            return x if on_mesh else jax.device_put(x, everywhere)
        return jax.tree.map(place, opt_state)

    def _put(self, x, spec):
        x = np.asarray(x)
        return jnp.asarray(x) if self.mesh is None else jax.device_put(x, NamedSharding(self.mesh, spec))

    def _rows_per_micro(self) -> int:
        d = self.data
        return d * -(-self.hp.micro_batch_size // d)

    def _micro_batches(self, idx: Sequence[int], segments: Sequence[Segment]) -> list[list[int]]:
        """Segment indices grouped into micro-batches, longest first (similar lengths share padding)."""
        order = sorted(idx, key=lambda i: -len(segments[i]))
        m = self._rows_per_micro()
        return [order[k:k + m] for k in range(0, len(order), m)]

    # -- the batch -----------------------------------------------------------------------------------

    def reference_logprobs(self, segments: Sequence[Segment]) -> list[np.ndarray]:
        """Each segment's [len - 1] log-probs under the reference parameters."""
        out: list[np.ndarray | None] = [None] * len(segments)
        for group in self._micro_batches(range(len(segments)), segments):
            rows = pack([segments[i] for i in group], [0] * len(group), self._rows_per_micro())
            lp = np.asarray(self._logprobs(self.ref_params, self._put(rows.tokens_bt, P("data", None))))
            for b, i in enumerate(group):
                out[i] = lp[b, :len(segments[i]) - 1]
        return out

    def train(self, batch: Batch, seed: int = 0) -> dict[str, float]:
        """`epochs` passes over the batch in minibatches of episodes; returns mean diagnostics over the steps."""
        hp = self.hp
        ref = self.reference_logprobs(batch.segments)
        by_episode: dict[int, list[int]] = {}
        for i, e in enumerate(np.asarray(batch.episode).tolist()):
            by_episode.setdefault(e, []).append(i)
        episodes = np.asarray(sorted(by_episode))
        rng = np.random.default_rng(seed)
        history: list[dict[str, float]] = []
        for _ in range(hp.epochs):
            perm = rng.permutation(episodes)
            for k in range(0, len(perm), hp.minibatch_size):
                chosen = perm[k:k + hp.minibatch_size]
                seg_idx = [i for e in chosen for i in by_episode[int(e)]]
                history.append(self._step(batch, seg_idx, ref, len(chosen)))
        out = {k: float(np.mean([h[k] for h in history])) for k in history[0]}
        # The first minibatch is on-policy: its ratio shows how well the recomputed log-probs match the engine's.
        out["first_ratio"], out["first_abs_log_ratio"] = history[0]["ratio"], history[0]["abs_log_ratio"]
        out["optimizer_steps"] = float(len(history))
        return out

    def _step(self, batch: Batch, seg_idx: list[int], ref: list[np.ndarray], n_episodes: int) -> dict[str, float]:
        grads, sums = None, {}
        m = self._rows_per_micro()
        tokens_of = tokens_per_episode([batch.segments[i].loss_mask[1:] for i in seg_idx],
                                       [batch.episode[i] for i in seg_idx])
        for group in self._micro_batches(seg_idx, batch.segments):
            segs = [batch.segments[i] for i in group]
            rows = pack(segs, [int(batch.episode[i]) for i in group], m)
            ref_bt = np.zeros_like(rows.old_logp_bt)
            for b, i in enumerate(group):
                ref_bt[b, :len(ref[i])] = ref[i]
            # Weights: token mean over the episode's trained tokens (all its segments), then mean over episodes.
            weight_bt = sequence_weights(rows.mask_bt, rows.episode_b, tokens_of, n_episodes)
            adv_b = np.where(rows.episode_b >= 0, batch.advantage[np.maximum(rows.episode_b, 0)], 0.0)
            g, aux = self._grad(self.params, self._put(rows.tokens_bt, P("data", None)),
                                self._put(rows.old_logp_bt, P("data", None)), self._put(ref_bt, P("data", None)),
                                self._put(adv_b.astype(np.float32), P("data")), self._put(weight_bt, P("data", None)))
            grads = g if grads is None else self._add(grads, g)
            for k, v in aux.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        self.params, self.opt_state, gnorm = self._apply(self.params, self.opt_state, grads)
        self.steps += 1
        return {**sums, "grad_norm": float(gnorm)}
