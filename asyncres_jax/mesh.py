"""`--mesh DxM` -> a jax Mesh with axes ("data", "model"), and the model's partition rules.

"model" splits attention heads (q/k/v columns, o_proj rows), the MLP's hidden dimension and the
vocabulary; "data" replicates the weights (D replicas, e.g. D rollout engines). Heads are contiguous
blocks of head_dim columns, so a model axis that divides the head counts splits whole heads.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from asyncres_jax.errors import UserError
from asyncres_jax.model.config import ModelConfig

AXES = ("data", "model")

# (leaf path regex, spec); first match wins. Vocab-sharded specs fall back to replication when M does not
# divide the vocabulary (see param_specs).
RULES: tuple[tuple[str, P], ...] = (
    (r"embed/embedding", P("model", None)),
    (r"lm_head/kernel", P(None, "model")),
    (r"attn/(q|k|v)_proj/kernel", P(None, "model")),
    (r"attn/(q|k|v)_proj/bias", P("model")),
    (r"attn/o_proj/kernel", P("model", None)),
    (r"mlp/(gate|up)_proj/kernel", P(None, "model")),
    (r"mlp/down_proj/kernel", P("model", None)),
    (r"(norm|scale)", P()),
)


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


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


def param_specs(params_like, cfg: ModelConfig, model_size: int):
    """A PartitionSpec per leaf of a params pytree (arrays or ShapeDtypeStructs)."""
    def spec(path, leaf):
        name = _path_str(path)
        for pattern, s in RULES:
            if re.search(pattern, name):
                if "embed" in name or "lm_head" in name:  # vocab-sharded only when it divides evenly
                    vocab_axis = 0 if "embed" in name else 1
                    if leaf.shape[vocab_axis] % model_size:
                        return P()
                return s
        raise ValueError(f"no partition rule for parameter {name}")
    return jax.tree_util.tree_map_with_path(spec, params_like)


def param_shardings(params_like, cfg: ModelConfig, mesh: Mesh):
    """NamedSharding per leaf; raises UserError when the mesh does not fit the model."""
    check_fits(mesh, cfg)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params_like, cfg, mesh.shape["model"]),
                        is_leaf=lambda x: isinstance(x, P))


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """The D replicas of a DxM mesh, each a 1xM mesh (one rollout engine's devices)."""
    return [Mesh(mesh.devices[i:i + 1], AXES) for i in range(mesh.shape["data"])]
