"""DeepSpeed op builders for Magnetar's C++/CUDA ops (the fused ``merge_states``, the Hamming top-k, the sparse
prefill op, the CPU decode attention and the CPU small bf16 GEMM).

The builders subclass DeepSpeed's :class:`~deepspeed.ops.op_builder.builder.OpBuilder` /
:class:`~deepspeed.ops.op_builder.builder.CUDAOpBuilder` and are JIT-compiled on first use through
``builder.jit_load()`` (:mod:`magnetar.ops.fused_merge` does that lazily; importing this module builds nothing).

Build cache: DeepSpeed's ``jit_load`` calls ``torch.utils.cpp_extension.load(name=<name>, ...)``, so the compiled
extension lives in ``$TORCH_EXTENSIONS_DIR/<name>/`` (default ``~/.cache/torch_extensions/py<XY>_<cpu|cuXYZ>/<name>/``).
``<name>`` is ``NAME`` plus a digest of the op sources' contents (every file of ``csrc/``), and the build compiles a
copy of those sources staged under the same digest (``<extensions root>/magnetar_csrc_<digest>/``), never the
checkout's own files: the generated ninja file holds absolute source paths, so with them every checkout (a clean
clone, a virtualenv, CI's folder) of the same sources finds the same build and reuses it, while a checkout with
other sources gets a build of its own (no two rebuild each other's op on every switch). A cached build is reused by
every later process: ninja only recompiles when a source file or a flag changed. Concurrent
first builds are serialised by torch's file lock ``<build dir>/lock``, which a process killed mid-build leaves
behind; :class:`magnetar.ops.jit.LazyOp` loads under its own ``flock`` first and removes such a stale lock (see
:mod:`magnetar.ops.jit`), so no load waits forever.

The sources are resolved to absolute paths from this file, so the builders work from a source checkout and from
an installed package (``pyproject.toml`` ships ``magnetar/ops/csrc/*``).

Prebuilt ops (DeepSpeed's ``DS_BUILD_OPS`` convention): ``DS_BUILD_MAGNETAR_OPS=1 pip install --no-build-isolation .``
compiles every op that :meth:`is_compatible` on the build machine at install time (``setup.py`` adds each
builder's :meth:`builder` extension, built by torch's ``BuildExtension``); ``DS_BUILD_MAGNETAR_<OP>=1`` / ``=0``
(each builder's ``BUILD_VAR``) turns one op on or off whatever ``DS_BUILD_MAGNETAR_OPS`` says. An op is installed
as the module :meth:`absolute_name` (``magnetar/ops/<NAME>_op.*.so``) and recorded in ``magnetar/ops/
prebuilt_ops.json`` (:data:`PREBUILT_RECORD`, DeepSpeed's ``installed_ops``) with the torch version it was built
against and a digest of its sources. :meth:`load` (and :class:`magnetar.ops.jit.LazyOp`) imports a recorded
module when the running torch and the shipped sources are still those of the record, and JIT-builds otherwise,
with a warning saying why the prebuilt one was passed over. ``python -m magnetar.ops`` reports every op.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Mapping, Optional

import torch
from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder

logger = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
# What setup.py prebuilt into this package (DeepSpeed's installed_ops): written by the build, read by load().
PREBUILT_RECORD = Path(__file__).resolve().parent / "prebuilt_ops.json"
PREBUILT_FORMAT = 1
BUILD_ALL_VAR = "DS_BUILD_MAGNETAR_OPS"


def csrc_digest(folder: Path = CSRC_DIR) -> str:
    """A digest of the op sources: every file's name and bytes in ``folder`` (10 hex digits)."""
    h = hashlib.sha1()
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:10]


def _build_name(base: str) -> str:
    """``base`` + the digest of the op sources: every checkout of the same sources shares one cached build."""
    return f"{base}_{csrc_digest()[:8]}"


# JIT builds compile a copy of the sources staged under their digest (:func:`staged_sources`); setup.py's prebuild
# turns this off: setuptools wants the sources inside the package being built
STAGE_SOURCES = True


def _src() -> Path:
    """The folder the builders' sources and include paths are taken from."""
    return staged_sources() if STAGE_SOURCES else CSRC_DIR


def staged_sources() -> Path:
    """The op sources, copied once under their digest next to torch's builds
    (``<extensions root>/magnetar_csrc_<digest>/``): the paths every build compiles, the same for every checkout of the
    same sources. Made atomically (a copy in a temporary folder, then renamed); a copy whose files no longer match
    the digest is replaced."""
    from torch.utils.cpp_extension import _get_build_directory  # torch's own rule (TORCH_EXTENSIONS_DIR, ...)

    digest = csrc_digest()
    # absolute: DeepSpeed's builders read a relative source path as relative to DeepSpeed's own folder (a relative
    # TORCH_EXTENSIONS_DIR failed every build that way)
    root = Path(_get_build_directory("", verbose=False)).resolve()
    staged = root / f"magnetar_csrc_{digest}"
    if staged.is_dir() and csrc_digest(staged) == digest:
        return staged
    tmp = Path(tempfile.mkdtemp(prefix=f".magnetar_csrc_{digest}.", dir=root))
    try:
        for path in CSRC_DIR.iterdir():
            if path.is_file():
                shutil.copy2(path, tmp / path.name)
        if staged.is_dir():  # damaged (a cut copy, an edit): the fresh one replaces it
            shutil.rmtree(staged, ignore_errors=True)
        try:
            os.rename(tmp, staged)
        except OSError:  # another process staged it first: theirs holds the same bytes
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return staged


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


def read_prebuilt_record(path: Optional[Path] = None) -> tuple[dict, Optional[str]]:
    """``(record, problem)``: the prebuilt-ops record at ``path`` (default :data:`PREBUILT_RECORD`; ``{}`` when
    there is none) and, for a record that cannot be used, why (``record`` is then ``{}``). Never raises: a broken
    record only means JIT builds."""
    path = PREBUILT_RECORD if path is None else path
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}, None
    except OSError as err:
        return {}, f"cannot read {path}: {err}"
    try:
        record = json.loads(text)
    except ValueError as err:
        return {}, f"{path} is not valid JSON ({err}); reinstall magnetar"
    ok = isinstance(record, dict) and record.get("format") == PREBUILT_FORMAT and isinstance(record.get("ops"), dict)
    if not ok:
        return {}, f"{path} is not a format-{PREBUILT_FORMAT} prebuilt-ops record; reinstall magnetar"
    return record, None


@dataclass(frozen=True)
class PrebuiltStatus:
    """Whether an op's prebuilt module may be imported: ``recorded`` (the install's record lists the op, or the
    record cannot be read), ``usable`` (listed, and built against this torch from these sources) and ``reason``
    (why not, when not usable)."""

    recorded: bool
    usable: bool
    reason: str


class PrebuiltOp:
    """DeepSpeed's ``load()`` for Magnetar's builders: the module ``setup.py`` prebuilt when it is usable, else
    a JIT build. Mixed in before :class:`OpBuilder` (whose ``load`` consults DeepSpeed's own ``installed_ops``,
    which never lists Magnetar's ops)."""

    def sources_digest(self) -> str:
        """sha256 over the op's sources and the csrc headers (names and bytes): what a prebuild is tied to."""
        h = hashlib.sha256()
        for path in [Path(s) for s in self.sources()] + sorted(CSRC_DIR.glob("*.h")):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        return h.hexdigest()

    def prebuilt_status(self, record_path: Optional[Path] = None) -> PrebuiltStatus:
        """Whether :meth:`load` may import the prebuilt module, per the record (default :data:`PREBUILT_RECORD`)."""
        record, problem = read_prebuilt_record(record_path)
        if problem is not None:
            return PrebuiltStatus(True, False, problem)
        entry = record.get("ops", {}).get(self.NAME)
        if not isinstance(entry, dict):
            return PrebuiltStatus(False, False, f"not prebuilt (install with {BUILD_ALL_VAR}=1 or {self.BUILD_VAR}=1)")
        reinstall = f"reinstall with {BUILD_ALL_VAR}=1 to prebuild it again"
        if entry.get("module") != self.absolute_name():
            return PrebuiltStatus(True, False, f"recorded as module {entry.get('module')!r}, expected "
                                               f"{self.absolute_name()!r}; {reinstall}")
        if record.get("torch") != str(torch.__version__):
            return PrebuiltStatus(True, False, f"prebuilt against torch {record.get('torch')}, running torch "
                                               f"{torch.__version__}; {reinstall}")
        try:
            digest = self.sources_digest()
        except OSError as err:
            return PrebuiltStatus(True, False, f"cannot read the op's sources to check the prebuild: {err}")
        if entry.get("sources_sha256") != digest:
            return PrebuiltStatus(True, False, f"prebuilt from other sources than {CSRC_DIR} holds now; {reinstall}")
        return PrebuiltStatus(True, True, "")

    def load_prebuilt(self) -> Optional[ModuleType]:
        """The prebuilt module, or None (not prebuilt, or not usable: then a warning says why). Never raises."""
        status = self.prebuilt_status()
        if status.usable:
            problem = _prebuilt_library_problem(self.absolute_name())
            if problem is not None:
                status = PrebuiltStatus(True, False, f"its library is damaged ({problem}); reinstall with "
                                                     f"{BUILD_ALL_VAR}=1 to prebuild it again")
        if status.usable:
            try:
                return importlib.import_module(self.absolute_name())
            except Exception as err:  # noqa: BLE001 -- e.g. an undefined symbol: fall back to JIT, never fail
                status = PrebuiltStatus(True, False, f"importing {self.absolute_name()} failed: "
                                                     f"{type(err).__name__}: {err}")
        if status.recorded:
            logger.warning("magnetar: the prebuilt %s op is not used, it is JIT-built instead: %s", self.NAME,
                           status.reason)
        return None

    def load(self, verbose=False):
        module = self.load_prebuilt()
        return module if module is not None else self.jit_load(verbose)


def _prebuilt_library_problem(module: str) -> Optional[str]:
    """:func:`magnetar.ops.jit.library_problem` of a prebuilt module's library file (None when it has none)."""
    from magnetar.ops.jit import library_problem

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None  # the import below says why
    origin = getattr(spec, "origin", None)
    if spec is None or not origin or not origin.endswith((".so", ".pyd", ".dylib")):
        return None
    return library_problem(Path(origin))


class MergeStatesBuilder(PrebuiltOp, OpBuilder):
    """CPU build of the fused merge of partial attention states (``csrc/merge_states.cpp``)."""

    BUILD_VAR = "DS_BUILD_MAGNETAR_MERGE_STATES"
    NAME = "magnetar_merge_states"

    def __init__(self):
        super().__init__(name=_build_name(self.NAME))

    def absolute_name(self):
        return f"magnetar.ops.{self.NAME}_op"

    def sources(self):
        return [str(_src() / "merge_states.cpp")]

    def include_paths(self):
        return [str(_src())]

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


def plain_arch_list(arch_list: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` without architecture-specific suffixes (``9.0a`` -> ``9.0``, ``10.0f+PTX`` ->
    ``10.0+PTX``): DeepSpeed's builder parses each minor version as an int and fails on them (seen on the GPU image,
    whose list names ``9.0a``), and these kernels use no sm_90a-only instruction. Separators become ``;``."""
    out = []
    for token in arch_list.replace(" ", ";").split(";"):
        token = token.strip()
        if not token:
            continue
        ptx = token.endswith("+PTX")
        base = token[:-4] if ptx else token
        major, _, minor = base.partition(".")
        minor = minor.rstrip("abcdefghijklmnopqrstuvwxyz") if minor else minor
        out.append(f"{major}.{minor}" + ("+PTX" if ptx else "") if minor else base + ("+PTX" if ptx else ""))
    return ";".join(dict.fromkeys(out))


class MergeStatesCUDABuilder(PrebuiltOp, CUDAOpBuilder):
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
        src = _src()
        return [str(src / "merge_states_cuda.cpp"), str(src / "merge_states_kernel.cu")]

    def include_paths(self):
        return [str(_src())]

    def nvcc_args(self):
        # Keep IEEE expf/logf and division: the op must agree with the torch reference to fp32 tolerance.
        return [a for a in super().nvcc_args() if a != "--use_fast_math"]

    def compute_capability_args(self, cross_compile_archs=None):
        # DeepSpeed cannot parse arch-specific entries such as "9.0a" in TORCH_CUDA_ARCH_LIST: build for the plain
        # architecture instead (same machine code for these kernels)
        for holder, key in ((os.environ, "TORCH_CUDA_ARCH_LIST"), (self.__dict__, "_jit_arch_list")):
            value = holder.get(key)
            if value and plain_arch_list(value) != value.replace(" ", ";"):
                holder[key] = plain_arch_list(value)
        return super().compute_capability_args(cross_compile_archs)

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
        return [str(_src() / "hamming.cpp")]

    def cxx_args(self):
        # the POPCNT instruction (every x86-64 CPU since 2008) instead of the compiler's bit-twiddling fallback
        return super().cxx_args() + (["-mpopcnt"] if _x86_64() else [])


class HammingCUDABuilder(MergeStatesCUDABuilder):
    """CUDA build of the Hamming op (``csrc/hamming_cuda.cpp`` + ``csrc/hamming_kernel.cu``); not yet run on a GPU."""

    BUILD_VAR = "DS_BUILD_MAGNETAR_HAMMING_CUDA"
    NAME = "magnetar_hamming_cuda"

    def sources(self):
        src = _src()
        return [str(src / "hamming_cuda.cpp"), str(src / "hamming_kernel.cu")]


class SparseAttentionBuilder(MergeStatesBuilder):
    """CPU build of the sparse prefill op (``csrc/sparse_attention.cpp``): the oracle's and the indexer's top-k
    support and the gathered sparse GQA attention."""

    BUILD_VAR = "DS_BUILD_MAGNETAR_SPARSE_ATTENTION"
    NAME = "magnetar_sparse_attention"

    def sources(self):
        return [str(_src() / "sparse_attention.cpp")]


class DecodeAttentionBuilder(MergeStatesBuilder):
    """CPU build of the decode attention kernel (``csrc/decode_attention.cpp``): a few query rows per KV head over
    every key in one pass (the ``cpu_decode`` attention backend); AVX2/FMA code chosen at run time."""

    BUILD_VAR = "DS_BUILD_MAGNETAR_DECODE_ATTENTION"
    NAME = "magnetar_decode_attention"

    def sources(self):
        return [str(_src() / "decode_attention.cpp")]


class SmallGemmBuilder(MergeStatesBuilder):
    """CPU build of the few-row bf16 products (``csrc/small_gemm.cpp``): a decode step's linear layers over a blocked
    copy of their weights (:mod:`magnetar.engine.gemv`); AVX-512 BF16 code chosen at run time."""

    BUILD_VAR = "DS_BUILD_MAGNETAR_SMALL_GEMM"
    NAME = "magnetar_small_gemm"

    def sources(self):
        return [str(_src() / "small_gemm.cpp")]


class RMSNormBuilder(MergeStatesBuilder):
    """CPU build of Llama's RMSNorm as one pass over each row (``csrc/rms_norm.cpp``: :mod:`magnetar.ops.rms_norm`,
    swapped into a model by :mod:`magnetar.engine.norms`); AVX-512 code chosen at run time, a scalar loop elsewhere."""

    BUILD_VAR = "DS_BUILD_MAGNETAR_RMS_NORM"
    NAME = "magnetar_rms_norm"

    def sources(self):
        return [str(_src() / "rms_norm.cpp")]


class RotaryBuilder(MergeStatesBuilder):
    """CPU build of the rotary position embedding as one pass over q or k (``csrc/rotary.cpp``: :mod:`magnetar.ops.
    rotary`, put in a model's ``apply_rotary_pos_emb`` by :mod:`magnetar.engine.rotary`); AVX-512 code chosen at run
    time, a scalar loop elsewhere."""

    BUILD_VAR = "DS_BUILD_MAGNETAR_ROTARY"
    NAME = "magnetar_rotary"

    def sources(self):
        return [str(_src() / "rotary.cpp")]

    def cxx_args(self):
        return super().cxx_args() + ["-ffp-contract=off"]  # HF's roundings: no product and sum fused into an FMA


class AmxAttentionBuilder(MergeStatesBuilder):
    """CPU build of the bf16 prefill attention on AMX tiles (``csrc/amx_attention.cpp``: the ``cpu_amx`` attention
    backend); it runs where the CPU has AMX-BF16 and Linux grants the tile state, and its emulated tiles run on any
    AVX-512 CPU (for tests)."""

    BUILD_VAR = "DS_BUILD_MAGNETAR_AMX_ATTENTION"
    NAME = "magnetar_amx_attention"

    def sources(self):
        return [str(_src() / "amx_attention.cpp")]


# Every op, keyed by NAME (DeepSpeed's ALL_OPS): what setup.py may prebuild and `python -m magnetar.ops` reports.
ALL_OPS = {cls.NAME: cls for cls in (MergeStatesBuilder, MergeStatesCUDABuilder, HammingBuilder, HammingCUDABuilder,
                                     SparseAttentionBuilder, DecodeAttentionBuilder, SmallGemmBuilder,
                                     RMSNormBuilder, RotaryBuilder, AmxAttentionBuilder)}


def _flag(environ: Mapping[str, str], name: str) -> Optional[bool]:
    text = environ.get(name)
    if text is None:
        return None
    if text not in ("0", "1"):
        raise ValueError(f"{name}={text!r}: set it to 1 (prebuild at install time) or 0 (JIT-build on first use)")
    return text == "1"


def prebuild_plan(environ: Mapping[str, str] = os.environ) -> list[tuple[OpBuilder, Optional[str]]]:
    """The ops the install should prebuild, as DeepSpeed's setup.py decides: ``DS_BUILD_MAGNETAR_OPS`` is the
    default for every op and an op's own ``BUILD_VAR`` overrides it. Returns ``(builder, None)`` for an op to
    build and ``(builder, reason)`` for a requested op skipped as incompatible with this machine (requested only
    by ``DS_BUILD_MAGNETAR_OPS``). Raises ``ValueError`` for a flag that is not 0/1 and for an op requested by
    its own flag that cannot be built here (the reason says why)."""
    default = bool(_flag(environ, BUILD_ALL_VAR))
    plan = []
    for cls in ALL_OPS.values():
        own = _flag(environ, cls.BUILD_VAR)
        if not (default if own is None else own):
            continue
        builder = cls()
        if builder.is_compatible(verbose=False):
            plan.append((builder, None))
        elif own:
            raise ValueError(f"{cls.BUILD_VAR}=1 asks to prebuild {cls.NAME}, which cannot be built here: "
                             f"{builder.error_log}; set {cls.BUILD_VAR}=0")
        else:
            plan.append((builder, builder.error_log or "incompatible with this machine"))
    return plan


def prebuilt_record(builders) -> dict:
    """The record of ``builders`` prebuilt against the running torch (written next to the built modules)."""
    return {"format": PREBUILT_FORMAT, "torch": str(torch.__version__), "cuda": torch.version.cuda,
            "ops": {b.NAME: {"module": b.absolute_name(), "sources_sha256": b.sources_digest()} for b in builders}}
