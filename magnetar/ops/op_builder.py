"""DeepSpeed op builders for Magnetar's C++/CUDA ops (the fused ``merge_states``, the Hamming top-k and the
sparse prefill op).

The builders subclass DeepSpeed's :class:`~deepspeed.ops.op_builder.builder.OpBuilder` /
:class:`~deepspeed.ops.op_builder.builder.CUDAOpBuilder` and are JIT-compiled on first use through
``builder.jit_load()`` (:mod:`magnetar.ops.fused_merge` does that lazily; importing this module builds nothing).

Build cache: DeepSpeed's ``jit_load`` calls ``torch.utils.cpp_extension.load(name=<name>, ...)``, so the compiled
extension lives in ``$TORCH_EXTENSIONS_DIR/<name>/`` (default ``~/.cache/torch_extensions/py<XY>_<cpu|cuXYZ>/<name>/``).
``<name>`` is ``NAME`` plus a short hash of this checkout's source directory: the generated ninja file holds
absolute source paths, so two checkouts (or virtualenvs) sharing one build directory would rebuild each
other's op on every switch; with the hash each keeps its own cached build
and is reused by every later process: ninja only recompiles when a source file or a flag changed. Concurrent
first builds are serialised by torch's file lock ``<build dir>/lock``, which a process killed mid-build leaves
behind; :class:`magnetar.ops.jit.LazyOp` loads under its own ``flock`` first and removes such a stale lock (see
:mod:`magnetar.ops.jit`), so no load waits forever.

The sources are resolved to absolute paths from this file, so the builders work from a source checkout and from
an installed package (``setup.py`` ships ``magnetar/ops/csrc/*``).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

import torch
from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder

CSRC_DIR = Path(__file__).resolve().parent / "csrc"


def _build_name(base: str) -> str:
    """``base`` + a hash of the source location, so separate checkouts keep separate cached builds."""
    return f"{base}_{hashlib.sha1(str(CSRC_DIR).encode()).hexdigest()[:8]}"


def _cxx_compiler() -> str:
    """The C++ compiler torch's cpp_extension will invoke (``$CXX`` or ``c++``; ``cl`` on Windows)."""
    if sys.platform == "win32":
        return os.environ.get("CXX", "cl")
    return os.environ.get("CXX", "c++")


def _use_openmp() -> bool:
    # at::parallel_for only runs in parallel when the extension itself is compiled with OpenMP (the CPU wheels'
    # ATen uses the OpenMP backend, whose invoke_parallel is a header template). Linux only: linking -fopenmp
    # with GCC resolves to the libgomp.so.1 torch already loaded, so there is a single OpenMP runtime.
    # Without it the op is still correct, just single-threaded.
    return sys.platform.startswith("linux") and torch.backends.openmp.is_available()


class MergeStatesBuilder(OpBuilder):
    """CPU build of the fused merge of partial attention states (``csrc/merge_states.cpp``)."""

    BUILD_VAR = "DS_BUILD_MAGNETAR_MERGE_STATES"
    NAME = "magnetar_merge_states"

    def __init__(self):
        super().__init__(name=_build_name(self.NAME))

    def absolute_name(self):
        return f"magnetar.ops.{self.NAME}_op"

    def sources(self):
        return [str(CSRC_DIR / "merge_states.cpp")]

    def include_paths(self):
        return [str(CSRC_DIR)]

    def cxx_args(self):
        # No -march=native (the cached .so may be shared across machines) and no -std=: torch's cpp_extension
        # already passes the C++ standard its headers need (C++20 for torch >= 2.12).
        args = ["-O3", "-g0", "-Wno-reorder"]
        if _use_openmp():
            args.append("-fopenmp")
        return args

    def extra_ldflags(self):
        return ["-fopenmp"] if _use_openmp() else []

    def is_compatible(self, verbose=False):
        compiler = _cxx_compiler()
        exe = compiler.split()[0] if compiler.strip() else ""
        if not exe or shutil.which(exe) is None:
            self.error_log = (
                f"{self.NAME} needs a C++ compiler to JIT-build, but {compiler!r} (from $CXX or the default 'c++') "
                f"was not found on PATH; install g++ or clang++, or set CXX"
            )
            if verbose:
                print(f"[magnetar] {self.error_log}")
            return False
        return super().is_compatible(verbose)


class MergeStatesCUDABuilder(CUDAOpBuilder):
    """CUDA build of the fused merge (``csrc/merge_states_cuda.cpp`` + ``csrc/merge_states_kernel.cu``).

    Not yet compiled on a GPU: see the header of ``merge_states_kernel.cu``.
    """

    BUILD_VAR = "DS_BUILD_MAGNETAR_MERGE_STATES_CUDA"
    NAME = "magnetar_merge_states_cuda"

    def __init__(self):
        super().__init__(name=_build_name(self.NAME))

    def absolute_name(self):
        return f"magnetar.ops.{self.NAME}_op"

    def sources(self):
        return [str(CSRC_DIR / "merge_states_cuda.cpp"), str(CSRC_DIR / "merge_states_kernel.cu")]

    def include_paths(self):
        return [str(CSRC_DIR)]

    def nvcc_args(self):
        # Keep IEEE expf/logf and division: the op must agree with the torch reference to fp32 tolerance.
        return [a for a in super().nvcc_args() if a != "--use_fast_math"]

    def _incompatible_reason(self) -> str | None:
        if torch.version.hip is not None:
            return f"{self.NAME} is not supported on ROCm builds of torch ({torch.version.hip})"
        if not torch.version.cuda:
            return f"{self.NAME} needs a CUDA build of torch; this torch ({torch.__version__}) is CPU-only"
        if not torch.cuda.is_available():
            return f"{self.NAME} needs a visible CUDA device; torch.cuda.is_available() is False"
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME is None:
            return f"{self.NAME} needs the CUDA toolkit (nvcc) to JIT-build, but CUDA_HOME was not found; set CUDA_HOME"
        nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")
        if not os.path.exists(nvcc) and shutil.which("nvcc") is None:
            return f"{self.NAME} needs nvcc to JIT-build, but {nvcc} does not exist (CUDA_HOME={CUDA_HOME})"
        if shutil.which(_cxx_compiler().split()[0]) is None:
            return f"{self.NAME} needs a host C++ compiler ({_cxx_compiler()!r}), not found on PATH"
        return None

    def is_compatible(self, verbose=False):
        reason = self._incompatible_reason()
        if reason is not None:
            self.error_log = reason
            if verbose:
                print(f"[magnetar] {reason}")
            return False
        return super().is_compatible(verbose)


def _x86_64() -> bool:
    import platform

    return platform.machine().lower() in ("x86_64", "amd64")


class HammingBuilder(MergeStatesBuilder):
    """CPU build of the bit-packing and Hamming top-k op (``csrc/hamming.cpp``) behind Spotlight/LSH decoding."""

    BUILD_VAR = "DS_BUILD_MAGNETAR_HAMMING"
    NAME = "magnetar_hamming"

    def sources(self):
        return [str(CSRC_DIR / "hamming.cpp")]

    def cxx_args(self):
        # the POPCNT instruction (every x86-64 CPU since 2008) instead of the compiler's bit-twiddling fallback
        return super().cxx_args() + (["-mpopcnt"] if _x86_64() else [])


class HammingCUDABuilder(MergeStatesCUDABuilder):
    """CUDA build of the Hamming op (``csrc/hamming_cuda.cpp`` + ``csrc/hamming_kernel.cu``); not yet run on a GPU."""

    BUILD_VAR = "DS_BUILD_MAGNETAR_HAMMING_CUDA"
    NAME = "magnetar_hamming_cuda"

    def sources(self):
        return [str(CSRC_DIR / "hamming_cuda.cpp"), str(CSRC_DIR / "hamming_kernel.cu")]


class SparseAttentionBuilder(MergeStatesBuilder):
    """CPU build of the sparse prefill op (``csrc/sparse_attention.cpp``): the oracle's and the indexer's top-k
    support and the gathered sparse GQA attention."""

    BUILD_VAR = "DS_BUILD_MAGNETAR_SPARSE_ATTENTION"
    NAME = "magnetar_sparse_attention"

    def sources(self):
        return [str(CSRC_DIR / "sparse_attention.cpp")]
