"""Rollout replicas of a ("data", "model") mesh: one per row of the data axis, each a 1xM sub-mesh with its own
copy of the weights. The threaded pool, the multi-process trainer and every Ray actor build them here."""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from asyncres_jax.mesh import replica_meshes
from asyncres_jax.rollout.pool import Replica

Params = Any


def to_submesh(x, sharding) -> jax.Array:
    """x (on the whole mesh, or a host array) as an array with `sharding` (on a sub-mesh of it).

    A replica's devices already hold exactly the shards it needs (the data axis replicates the weights), so
    the new array is assembled from those buffers without a copy; other layouts go through device_put.
    """
    if not isinstance(x, jax.Array):
        return jax.device_put(np.asarray(x), sharding)
    shape = x.shape
    have = {s.device: s for s in x.addressable_shards}
    want = sharding.devices_indices_map(shape)
    source = x.sharding.devices_indices_map(shape)
    if all(d in have and source[d] == idx for d, idx in want.items()):
        return jax.make_array_from_single_device_arrays(shape, sharding, [have[d].data for d in want])
    return jax.device_put(np.asarray(x), sharding)


def on_mesh(tree, mesh: Mesh):
    """Leaves not yet placed on the mesh (optimiser counters, made on the default device) replicated over it,
    so a restored checkpoint puts every leaf on the same devices as the parameters."""
    replicated = NamedSharding(mesh, P())

    def place(x):
        return x if isinstance(getattr(x, "sharding", None), NamedSharding) else jax.device_put(x, replicated)
    return jax.tree.map(place, tree)


def placer(shardings, dtype=None) -> Callable[[Params], Params]:
    """place(master params) -> the replica's copy: each leaf on its sharding (a tree like the params, or one
    for every leaf), cast to `dtype` there (local ops only)."""
    def one(x, s):
        y = to_submesh(x, s)
        return y if dtype is None else y.astype(dtype)

    def place(params):
        if isinstance(shardings, NamedSharding):
            return jax.tree.map(lambda x: one(x, shardings), params)
        return jax.tree.map(one, params, shardings)
    return place


def replicas_from_mesh(mesh: Mesh, shardings_for: Callable[[Mesh], Any] | None = None, dtype=None, *,
                       owned: Callable[[Mesh], bool] = lambda sub: True) -> list[Replica]:
    """One Replica per row of the data axis that `owned` keeps (a process drives only its own devices).

    shardings_for(sub_mesh) gives the parameters' shardings on a replica (the model's partition rules); by
    default the weights are replicated over the replica's devices."""
    out = []
    for i, sub in enumerate(replica_meshes(mesh)):
        if not owned(sub):
            continue
        shardings = NamedSharding(sub, P()) if shardings_for is None else shardings_for(sub)
        out.append(Replica(i, sub, place=placer(shardings, dtype)))
    return out
