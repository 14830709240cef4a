"""glibc's malloc kept from handing freed tensor memory back to the kernel on a CPU server (magnetar.utils.malloc):
the two thresholds set through mallopt; nothing done where the user chose (glibc's variables, another allocator) or
off glibc; and in a process of its own, tensors of changing sizes made again without page faults, where glibc's
defaults fault each one in anew."""
from __future__ import annotations

import subprocess
import sys

from magnetar.utils import malloc
from magnetar.utils.malloc import keep_freed_memory


class _Libc:
    """libc as ctypes gives it: ``mallopt`` a function whose argtypes / restype may be set; glibc's version call."""

    def __init__(self, ok=1, glibc=True):
        self.calls = []

        def mallopt(param, value):
            self.calls.append((param, value))
            return ok

        self.mallopt = mallopt
        if glibc:
            self.gnu_get_libc_version = object()


def test_the_two_thresholds_are_set():
    libc = _Libc()
    what = keep_freed_memory(environ={}, libc=libc)
    assert libc.calls == [(malloc.M_MMAP_THRESHOLD, 32 * 2**20), (malloc.M_TRIM_THRESHOLD, 2**30)]
    assert what.startswith("malloc keeps freed memory") and "MALLOC_TRIM_THRESHOLD_" in what


def test_nothing_is_done_where_the_user_chose_or_off_glibc():
    for environ in ({"MALLOC_TRIM_THRESHOLD_": "0"}, {"MALLOC_MMAP_THRESHOLD_": "65536"},
                    {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},
                    {"LD_PRELOAD": "/opt/libtcmalloc_minimal.so.4:/x/libgomp.so"}):
        libc = _Libc()
        assert keep_freed_memory(environ=environ, libc=libc) is None and not libc.calls, environ
    libc = _Libc(glibc=False)  # musl and others: other mallopt parameters
    assert keep_freed_memory(environ={}, libc=libc) is None and not libc.calls
    refused = keep_freed_memory(environ={}, libc=_Libc(ok=0))
    assert refused.startswith("glibc's mallopt refused the thresholds")


_FAULTS = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from magnetar.utils.malloc import keep_freed_memory
    assert keep_freed_memory() is not None
def sizes():  # a server's activations: blocks of 4 to 28 MiB, each freed before the next
    for mb in range(4, 30, 3):
        t = torch.empty(mb * 2**20, dtype=torch.uint8)
        t.fill_(1)
        del t
sizes()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
sizes()
sizes()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def test_tensors_made_again_take_no_page_faults():
    default, kept = _faults("default"), _faults("keep")
    # glibc's defaults map and unmap each block, or trim the heap under it: ~36 thousand faults on the VM
    assert default > 5000, default
    assert kept < default / 10, (kept, default)
