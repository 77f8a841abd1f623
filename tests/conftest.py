"""Test-wide set-up: 8 simulated CPU devices and a persistent compilation cache.

XLA reads its flags when JAX initialises, so they are set here, before any test imports jax.
"""

import os
import pathlib

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

_CACHE = pathlib.Path(__file__).resolve().parent.parent / ".cache" / "jax"
jax.config.update("jax_compilation_cache_dir", str(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_threefry_partitionable", True)
