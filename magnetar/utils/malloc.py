"""A CPU server's freed tensor memory kept by glibc's malloc for the next allocation, rather than handed back to the
kernel and faulted in again page by page.

Why: torch's CPU tensors come from malloc. glibc serves a block of at least ``M_MMAP_THRESHOLD`` (128 KiB, raised
to the largest block freed so far) with a fresh ``mmap`` and gives it back with ``munmap`` when it is freed, and it
trims the heap's free top past ``M_TRIM_THRESHOLD``: a serving process, whose activations change size with every
batch and query length, then touches fresh pages again and again -- each a page fault the kernel zeroes. A forward
of four joined 1K-token bf16 queries of SmolLM2 of unequal lengths took 95-127 thousand minor faults (0.2-0.27 s of
system time, ~10 % of it) on the Intel AMX VM; with the two thresholds fixed here, none (docs/results.md, "One pass
for the rotary embedding", (3)). vLLM's CPU build preloads tcmalloc for the same reason.

:func:`keep_freed_memory` fixes ``M_MMAP_THRESHOLD`` at its 64-bit maximum (32 MiB: a larger block is still its own
mapping, returned when freed) and ``M_TRIM_THRESHOLD`` at :data:`TRIM_BYTES` (the free heap top kept up to that);
the cost is a resident size that stays near its peak. ``magnetar serve`` calls it on CPU ranks. It does nothing
where the user chose already: glibc's own variables (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, read
at process start) or another allocator in ``LD_PRELOAD`` (tcmalloc, jemalloc, mimalloc) -- nor off glibc.
"""
from __future__ import annotations

import ctypes
import os
from typing import Optional

M_TRIM_THRESHOLD = -1  # mallopt's parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_BYTES = 32 * 2**20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: the largest value mallopt takes
TRIM_BYTES = 2**30
CHOSEN = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")  # glibc's variables: the user's own choice
ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


def _libc():
    return ctypes.CDLL(None)


def keep_freed_memory(environ=os.environ, libc=None) -> Optional[str]:
    """Fix glibc's two thresholds (module docstring): what was done, for the log -- or None where nothing was to do
    (the user's own settings, another allocator, not glibc) or mallopt refused (then the reason in the string)."""
    if any(environ.get(name) for name in CHOSEN):
        return None
    if any(a in environ.get("LD_PRELOAD", "") for a in ALLOCATORS):
        return None
    try:
        libc = libc or _libc()
        libc.gnu_get_libc_version  # glibc only: its mallopt parameters
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_BYTES) and mallopt(M_TRIM_THRESHOLD, TRIM_BYTES)):
        return "glibc's mallopt refused the thresholds: freed memory goes back to the kernel as by default"
    return (f"malloc keeps freed memory for the next tensors (mmap threshold {MMAP_BYTES >> 20} MiB, trim threshold "
            f"{TRIM_BYTES >> 20} MiB; set MALLOC_TRIM_THRESHOLD_ to choose your own)")
