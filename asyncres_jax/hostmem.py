"""Host memory under glibc: fewer malloc arenas, and freed memory handed back to the operating system.

Episodes run on worker threads, and every batch frees gigabytes of host buffers (KV-cache copies, logits) whose
sizes change with the batch's rows and context. glibc keeps what is freed in its heaps for reuse, so a run's
resident size ratchets up with the variety of batch shapes: a 12-update CPU-default run grew to 19 GB with
glibc's default 8 arenas per core (8.5-10 GB with 2), and a study run whose held-back members play alone (a
second batch shape) was killed by the kernel's OOM killer at 24 GB in its final evaluation. In the next run of
that row, malloc_trim(0) brought the process from 14.1 GB to 8.4 GB at update 6. Off glibc (e.g. macOS) both
calls do nothing and return False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_ARENA_MAX = -8  # malloc.h


@functools.cache
def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """Cap glibc's malloc arenas (what MALLOC_ARENA_MAX does, but from inside the process, before its threads
    start): each worker thread would otherwise keep the buffers it freed in an arena of its own."""
    libc = _glibc()
    return bool(libc.mallopt(M_ARENA_MAX, arenas)) if libc is not None else False


def release_free_memory() -> bool:
    """Return the free memory in glibc's heaps to the operating system (malloc_trim(0)); call it after a batch
    of episodes has freed its buffers. Returns whether memory was released."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
