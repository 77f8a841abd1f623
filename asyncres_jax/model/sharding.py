"""How the decoder's arrays are laid out on a ("data", "model") mesh.

Each parameter names its logical axes where decoder.py defines it ("vocab", "embed", "heads", "mlp"); the KV
cache's are CACHE_AXES. One table, LOGICAL_TO_MESH, maps logical axes to mesh axes: "model" splits attention
heads (q/k/v columns, o_proj rows), the MLP's hidden dimension and the vocabulary; "data" splits batch rows (D
rollout engines) and replicates the weights. Heads are contiguous blocks of head_dim columns, so a model axis
that divides the head counts splits whole heads. A dimension the mesh axis does not divide (a vocabulary of odd
size) is replicated instead.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from asyncres_jax.mesh import check_fits
from asyncres_jax.model.config import ModelConfig
from asyncres_jax.model.decoder import param_axes

LOGICAL_TO_MESH: dict[str, str | None] = {
    "vocab": "model",
    "heads": "model",  # q/k/v output columns and o_proj input rows, whole heads at a time
    "kv_heads": "model",
    "mlp": "model",
    "embed": None,  # the residual stream stays whole on every device
    "batch": "data",
    "cache_seq": None,
    "head_dim": None,
}
# A layer's keys are [B, nkv, hd, S] and its values [B, nkv, S, hd] (decoder.Attention); only the first two axes
# are split, so one spec serves both.
CACHE_AXES = ("batch", "kv_heads", "cache_seq", "head_dim")


def logical_to_spec(axes: Sequence[str], mesh_shape: dict[str, int], shape: Sequence[int | None] | None = None) -> P:
    """The PartitionSpec of an array with these logical axes; dimensions of `shape` (None: unknown) that their
    mesh axis does not divide stay replicated."""
    out = []
    for i, name in enumerate(axes):
        axis = LOGICAL_TO_MESH[name]
        size = None if shape is None else shape[i]
        if axis is not None and size is not None and size % mesh_shape[axis]:
            axis = None
        out.append(axis)
    return P(*out) if any(out) else P()  # fully replicated: one spelling, P()


@functools.lru_cache(maxsize=32)
def _param_axes(cfg: ModelConfig):
    return param_axes(cfg)


def param_specs(params_like, cfg: ModelConfig, model_size: int):
    """A PartitionSpec per leaf of a params pytree (arrays or ShapeDtypeStructs) of the decoder of `cfg`."""
    mesh_shape = {"data": 1, "model": model_size}
    return jax.tree.map(lambda leaf, axes: logical_to_spec(axes, mesh_shape, leaf.shape), params_like,
                        _param_axes(cfg), is_leaf=lambda x: isinstance(x, tuple))


def param_shardings(params_like, cfg: ModelConfig, mesh: Mesh):
    """NamedSharding per leaf; raises UserError when the mesh does not fit the model."""
    check_fits(mesh, cfg)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params_like, cfg, mesh.shape["model"]),
                        is_leaf=lambda x: isinstance(x, P))


def shares_host_memory(mesh: Mesh) -> bool:
    """Every device of the mesh is a CPU device of this process (simulated devices, `--cpu-devices`): their arrays
    all live in one host memory, so an array replicated over "data" costs one host copy per replica."""
    return all(d.platform == "cpu" and d.process_index == jax.process_index() for d in mesh.devices.flat)


def splits_masters(mesh: Mesh) -> bool:
    """Whether the learner splits its masters over "data" (learner_shardings): several replicas on devices that
    share host memory. Its replicas then copy each version from one host copy instead of replaying the update."""
    return mesh.shape["data"] > 1 and shares_host_memory(mesh)


def learner_shardings(params_like, cfg: ModelConfig, mesh: Mesh):
    """Where the learner keeps its masters: as the rollout weights (param_shardings), except on a mesh of devices
    that share host memory, where each leaf is also split over "data" (its first dimension without a mesh axis
    that the data axis divides). There replicas alias one host copy per version (rollout/replicas.py) and the
    masters are one copy in all instead of one per replica, and the ES step runs once instead of on every replica.
    On accelerators the masters stay replicated, so a replica's shards are already on its devices."""
    shardings = param_shardings(params_like, cfg, mesh)
    if not splits_masters(mesh):
        return shardings
    d = mesh.shape["data"]

    def split(leaf, sharding):
        spec = list(sharding.spec) + [None] * (len(leaf.shape) - len(sharding.spec))
        for i, size in enumerate(leaf.shape):
            if spec[i] is None and size % d == 0:
                spec[i] = "data"
                return NamedSharding(mesh, P(*spec))
        return sharding  # no dimension the data axis divides: stays replicated
    return jax.tree.map(split, params_like, shardings)


def cache_spec(cfg: ModelConfig, mesh: Mesh) -> P:
    """The KV cache's PartitionSpec: rows over "data", kv heads over "model" where it divides them."""
    return logical_to_spec(CACHE_AXES, dict(mesh.shape), (None, cfg.num_kv_heads, None, None))
