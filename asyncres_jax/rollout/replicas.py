"""Rollout replicas of a ("data", "model") mesh: one per row of the data axis, each a 1xM sub-mesh with its own
copy of the weights. The threaded pool, the multi-process trainer and every Ray actor build them here."""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from asyncres_jax.mesh import replica_meshes
from asyncres_jax.model.sharding import shares_host_memory
from asyncres_jax.rollout.pool import Replica

Params = Any
HOST_ALIGNMENT = 64  # XLA:CPU aliases a host buffer only at this alignment (numpy gives 16)


class HostCopies:
    """One aligned host copy per source array, for devices that share host memory (simulated CPU devices).

    device_put(host, sharding, may_alias=True) then makes every replica's array a view of that one buffer, so the
    replicas of a version cost one copy of the weights in all. A copy lives as long as its source array or an
    array aliasing it (jax keeps the buffer's owner alive)."""

    def __init__(self):
        self._copies: dict[int, tuple[weakref.ref, np.ndarray]] = {}
        self._lock = threading.Lock()

    def of(self, x) -> np.ndarray:
        if not isinstance(x, jax.Array):
            return _aligned(np.asarray(x))
        key = id(x)
        with self._lock:
            hit = self._copies.get(key)
            if hit is not None and hit[0]() is x:
                return hit[1]
        host = _aligned(np.asarray(x))  # gathers a split array; outside the lock: other replicas go on meanwhile

        def forget(ref, key=key):
            with self._lock:
                if self._copies.get(key, (None,))[0] is ref:
                    del self._copies[key]
        with self._lock:
            self._copies[key] = (weakref.ref(x, forget), host)
        return host


_HOST_COPIES = HostCopies()  # one per process: replicas and evaluation of a version share its host copy


def _host_copies(mesh: Mesh) -> HostCopies | None:
    return _HOST_COPIES if shares_host_memory(mesh) else None


def _aligned(a: np.ndarray) -> np.ndarray:
    buf = np.empty(a.nbytes + HOST_ALIGNMENT, np.uint8)
    start = -buf.ctypes.data % HOST_ALIGNMENT
    out = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def to_submesh(x, sharding, host: HostCopies | None = None) -> jax.Array:
    """x (on the whole mesh, or a host array) as an array with `sharding` (on a sub-mesh of it).

    Where the replica's devices already hold exactly the shards it needs (the data axis replicates the weights),
    the new array is assembled from those buffers without a copy. Where the devices share host memory (`host`
    given), it aliases x's host copy. Other layouts go through device_put.
    """
    if isinstance(x, jax.Array):
        shape = x.shape
        have = {s.device: s for s in x.addressable_shards}
        want = sharding.devices_indices_map(shape)
        source = x.sharding.devices_indices_map(shape)
        if all(d in have and source[d] == idx for d, idx in want.items()):
            return jax.make_array_from_single_device_arrays(shape, sharding, [have[d].data for d in want])
    if host is not None:
        return jax.device_put(host.of(x), sharding, may_alias=True)
    return jax.device_put(np.asarray(x), sharding)


def on_mesh(tree, mesh: Mesh):
    """Leaves not yet placed on the mesh (optimiser counters, made on the default device) replicated over it,
    so a restored checkpoint puts every leaf on the same devices as the parameters."""
    replicated = NamedSharding(mesh, P())

    def place(x):
        return x if isinstance(getattr(x, "sharding", None), NamedSharding) else jax.device_put(x, replicated)
    return jax.tree.map(place, tree)


def placer(shardings, dtype=None, host: HostCopies | None = None) -> Callable[[Params], Params]:
    """place(master params) -> the replica's copy: each leaf on its sharding (a tree like the params, or one
    for every leaf), cast to `dtype` there (local ops only). `host`: see to_submesh."""
    def one(x, s):
        y = to_submesh(x, s, host)
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
    default the weights are replicated over the replica's devices. On devices that share host memory the
    replicas alias one host copy of each version (HostCopies)."""
    host = _host_copies(mesh)
    out = []
    for i, sub in enumerate(replica_meshes(mesh)):
        if not owned(sub):
            continue
        shardings = NamedSharding(sub, P()) if shardings_for is None else shardings_for(sub)
        out.append(Replica(i, sub, place=placer(shardings, dtype, host)))
    return out


def for_inference(params, shardings):
    """params as the model runs them on the whole mesh (`shardings`: the rollout layout, replicated over "data"),
    from masters that may be split over "data" (model.sharding.learner_shardings); where the devices share host
    memory, every device's copy aliases one host buffer."""
    mesh = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, NamedSharding))[0].mesh
    host = _host_copies(mesh)
    return jax.tree.map(lambda x, s: to_submesh(x, s, host), params, shardings)
