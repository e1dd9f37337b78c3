"""Process-level CPU set-up that makes torch's host allocations cheap.

PyTorch's CPU allocator is plain ``malloc``. glibc serves every block above its mmap threshold
(32 MiB at most) with a fresh ``mmap`` and unmaps it on free, so each such tensor (a batch-32
feature map at 320 px, a 640 px training activation) page-faults and zero-fills all its pages
again on every forward pass. Raising the threshold and the trim threshold keeps freed blocks in
the heap for the next step, at the cost of a somewhat larger peak RSS (docs/benchmarks.md has
the figures). Values are untouched; only where memory comes from changes.
"""
from __future__ import annotations

import ctypes
import os

from yolotrain.utils.core.logging import LOGGER

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
KEEP_BYTES = 1 << 30  # blocks up to 1 GiB come from (and return to) the heap
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
_tuned = False


def tune_malloc(keep_bytes: int = KEEP_BYTES) -> bool:
    """Serve and keep blocks up to ``keep_bytes`` in glibc's heap; True when the setting took.

    Does nothing (False) off glibc, when an allocator is preloaded (LD_PRELOAD jemalloc/tcmalloc
    already does this), or when the user set glibc's malloc variables: their choice stands.
    Forked loader workers inherit the setting. Idempotent.
    """
    global _tuned
    if _tuned:
        return True
    if _user_chose_allocator(os.environ) or not _is_glibc():
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = bool(libc.mallopt(M_MMAP_THRESHOLD, keep_bytes)) and bool(libc.mallopt(M_TRIM_THRESHOLD, keep_bytes))
    except (OSError, AttributeError):
        return False
    if not ok:
        LOGGER.debug("mallopt refused the mmap/trim thresholds; large CPU tensors are mapped per allocation")
    _tuned = ok
    return ok


def release_inherited_heap() -> bool:
    """Return the free blocks of a heap inherited through fork to the OS (glibc's malloc_trim), in a loader
    worker: reusing them would copy each page from the parent on first write; fresh pages cost a fault each
    and then stay in this process's own heap. True when it ran."""
    if not _tuned or _user_chose_allocator(os.environ) or not _is_glibc():
        return False
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def _user_chose_allocator(env) -> bool:
    preload = env.get("LD_PRELOAD", "")
    return (any(name in preload for name in _OTHER_ALLOCATORS) or "MALLOC_MMAP_THRESHOLD_" in env
            or "MALLOC_TRIM_THRESHOLD_" in env or "glibc.malloc" in env.get("GLIBC_TUNABLES", ""))


def _is_glibc() -> bool:
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError, AttributeError):
        return False


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (taskset, cgroup cpusets, SLURM's binding),
    which os.cpu_count() ignores, so workers and threads are not sized for cores the rank cannot use."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1
