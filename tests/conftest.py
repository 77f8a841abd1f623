"""Test-wide set-up: 8 simulated CPU devices and a persistent compilation cache.

XLA reads its flags when JAX initialises, so they are set here, before any test imports jax.
"""

import ctypes
import gc
import os
import pathlib

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

_CACHE = pathlib.Path(__file__).resolve().parent.parent / ".cache" / "jax"
jax.config.update("jax_compilation_cache_dir", str(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_threefry_partitionable", True)

_LIBC = ctypes.CDLL("libc.so.6")


@pytest.fixture(autouse=True, scope="module")
def _give_freed_memory_back():
    """Two xdist workers share 24 GB, and glibc keeps the heap pages a module freed: an idle worker that had run
    SmolLM2 modules held 8-9 GB while the other ran a big_memory test, and that worker was lost (most likely to the
    machine's memory). After each module the freed pages go back to the system."""
    yield
    gc.collect()
    _LIBC.malloc_trim(0)
