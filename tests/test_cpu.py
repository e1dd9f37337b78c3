"""yolotrain.utils.core.cpu: large freed blocks stay in the heap, so reusing them costs no page faults."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from yolotrain.utils.core import cpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Allocates, touches and frees a 64 MiB block three times; prints whether tuning took and the
# minor page faults of the last two rounds. Plain malloc (not numpy, which asks for huge pages).
PROBE = r"""
import ctypes, resource, sys
sys.path.insert(0, sys.argv[2])
from yolotrain.utils.core.cpu import tune_malloc
tuned = tune_malloc() if sys.argv[1] == "tune" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(64 << 20)
    ctypes.memset(p, 1, 64 << 20)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(tuned, sum(faults[1:]))
"""


def _probe(mode: str, env: dict[str, str] | None = None) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode, ROOT], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})}).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not cpu._is_glibc(), reason="mallopt thresholds are glibc's")
def test_tuned_heap_reuses_a_freed_64_mib_block_without_faulting_it_in_again():
    tuned, faults = _probe("tune")
    plain_tuned, plain_faults = _probe("plain")
    assert tuned and not plain_tuned
    assert plain_faults > 4096  # glibc maps and unmaps every block above 32 MiB: ~16k faults per round
    assert faults < 256  # the same pages, still mapped


def test_a_users_own_allocator_choice_is_left_alone():
    assert cpu._user_chose_allocator({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"})
    assert cpu._user_chose_allocator({"MALLOC_MMAP_THRESHOLD_": "33554432"})
    assert cpu._user_chose_allocator({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
    assert not cpu._user_chose_allocator({"LD_PRELOAD": "", "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"})
    tuned, _ = _probe("tune", {"MALLOC_MMAP_THRESHOLD_": "33554432"})
    assert not tuned
