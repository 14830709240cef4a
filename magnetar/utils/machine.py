"""What a benchmark ran on, in one line (issue 47, item 6: "say which you measured on"): the CPU's model name, how
many CPUs this process may use, and the vector / matrix extensions that decide its kernels' speed (AVX2, AVX-512,
AVX-512 BF16, AMX), from ``/proc/cpuinfo`` where there is one -- the same CPU model name covers VMs with and without
AVX-512, and vLLM's and torch's CPU kernels differ by 2-3x between them (docs/results.md)."""
from __future__ import annotations

import os
import platform
from pathlib import Path

# /proc/cpuinfo flag -> the name printed, in this order
_FLAGS = (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX-512-BF16"), ("amx_tile", "AMX"))


def cpu_description(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """E.g. ``"AMD EPYC, 2 CPUs, AVX2 AVX-512 AVX-512-BF16"``; without ``/proc/cpuinfo`` the platform's processor
    name (or machine) and the CPU count."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    name, flags = "", set()
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "unknown CPU"
    isa = " ".join(label for flag, label in _FLAGS if flag in flags)
    return f"{name}, {cpus} CPUs" + (f", {isa}" if isa else "")
