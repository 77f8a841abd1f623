"""`--mesh DxM` -> a jax Mesh with axes ("data", "model"), checked against the model it will hold.

"data" holds D replicas of the weights (e.g. D rollout engines), "model" splits each replica M ways; how the
decoder's arrays map onto these axes is model/sharding.py's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from asyncres_jax.errors import UserError
from asyncres_jax.model.config import ModelConfig

AXES = ("data", "model")

def parse_mesh(spec: str | Sequence[int]) -> tuple[int, int]:
    """"4x2" (or (4, 2)) -> (data, model)."""
    if isinstance(spec, str):
        m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", spec)
        if not m:
            raise UserError(f"mesh {spec!r} is not of the form DxM (e.g. 1x1, 4x1, 2x4)")
        d, mm = int(m.group(1)), int(m.group(2))
    else:
        d, mm = (int(x) for x in spec)
    if d < 1 or mm < 1:
        raise UserError(f"mesh {d}x{mm} needs both sizes >= 1")
    return d, mm


def valid_meshes(n_devices: int, cfg: ModelConfig | None = None) -> list[str]:
    """Meshes that use all n_devices (and fit cfg's heads), plus 1x1, which always means one device."""
    full = [f"{n_devices // m}x{m}" for m in range(1, n_devices + 1)
            if n_devices % m == 0 and (cfg is None or m in valid_model_sizes(cfg))]
    return full if "1x1" in full else ["1x1"] + full


def valid_model_sizes(cfg: ModelConfig) -> list[int]:
    g = math.gcd(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size)
    return [m for m in range(1, g + 1) if g % m == 0]


def make_mesh(spec: str | Sequence[int] | Mesh, devices: Sequence[jax.Device] | None = None,
              cfg: ModelConfig | None = None) -> Mesh:
    """A ("data", "model") mesh over all devices (or `devices`); checks it fits `cfg` when given.

    D*M must equal the device count, except 1x1, which takes the first device.
    """
    if isinstance(spec, Mesh):
        mesh = spec
        if tuple(mesh.axis_names) != AXES:
            raise UserError(f"mesh axes are {mesh.axis_names}; expected {AXES}")
    else:
        d, m = parse_mesh(spec)
        devices = list(jax.devices() if devices is None else devices)
        if (d, m) == (1, 1):  # one device is always a valid choice (e.g. the CPU default on a multi-device host)
            devices = devices[:1]
        if d * m != len(devices):
            raise UserError(f"mesh {d}x{m} needs {d * m} devices but {len(devices)} are available; "
                            f"valid meshes: {', '.join(valid_meshes(len(devices), cfg))}")
        mesh = Mesh(np.asarray(devices).reshape(d, m), AXES)
    if cfg is not None:
        check_fits(mesh, cfg)
    return mesh


def check_fits(mesh: Mesh, cfg: ModelConfig) -> None:
    m = mesh.shape["model"]
    if m not in valid_model_sizes(cfg):
        raise UserError(
            f"model axis {m} does not divide num_heads={cfg.num_heads}, num_kv_heads={cfg.num_kv_heads} and "
            f"intermediate_size={cfg.intermediate_size}; valid model-axis sizes: "
            f"{', '.join(map(str, valid_model_sizes(cfg)))} (meshes for {mesh.size} devices: "
            f"{', '.join(valid_meshes(mesh.size, cfg))})")


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """The D replicas of a DxM mesh, each a 1xM mesh (one rollout engine's devices)."""
    return [Mesh(mesh.devices[i:i + 1], AXES) for i in range(mesh.shape["data"])]
