"""Lazy, once-per-process loading of a prebuilt or JIT-built DeepSpeed op, per device type, that never raises on
failure.

:class:`LazyOp` is the loader behind every fused op (the merge, :mod:`magnetar.sparse.codes`' Hamming op, the
sparse prefill op): the first ``available(device)`` / ``load(device)`` for a device type imports the module
``pip install`` prebuilt when the builder has a usable one (``builder.load_prebuilt()``, see
:mod:`magnetar.ops.op_builder`), else builds or loads it by JIT under a lock (torch's file lock serialises
concurrent first builds in other processes; see :mod:`magnetar.ops.op_builder` for the build cache). A failure
is cached with its reason and logged once; ``available`` then returns False and ``load`` raises
``RuntimeError`` with the reason, so callers fall back to their torch implementation.
Build output is printed only with ``MAGNETAR_VERBOSE_BUILD=1``.

No load waits forever. torch serialises builds of one extension with a bare lock file ``<build dir>/lock``
that a process killed mid-build leaves behind, after which every later load waits on it silently. So every
Magnetar load first takes its own lock, ``<build dir>/magnetar.lock``, with ``flock`` -- which the kernel
releases when its holder dies, so it can never be stale. While holding it no live Magnetar process is inside
a build of that directory, so a torch ``lock`` found then is stale: it is removed with a warning. The wait
for ``magnetar.lock`` (another process building right now) is bounded by ``MAGNETAR_OP_LOCK_TIMEOUT_S``
(default 600 s); past it the op counts as unavailable (torch fallback) with a warning that names the lock,
its holder's pid and how to clear it.

No load maps a library that was not completed. A build cut short (a full disk, a killed linker, a partial copy
of the cache) can leave a library whose ELF header is valid but whose segments run past the end of the file:
``dlopen`` maps it and the process dies of SIGBUS, with no message, in every later run. So before torch loads a
cached build (under the lock), :func:`library_problem` checks the file's ELF structure (every segment and header
table inside the file) and, once a build has completed, the size and sha256 recorded next to it
(``magnetar.built``); a library that fails either is removed with the rest of its build folder and built again,
with a warning -- and if the rebuild fails, the torch fallback is used with the warning every failed load gets.
A prebuilt library (``pip install`` with the ops) that fails the ELF check is not imported (JIT instead).

A completed CPU build whose record names the running torch is imported as it is, without running ninja
(:func:`reuse_completed_build`): ninja rebuilds whenever its compile command changes, and the command holds the
folder torch is installed in, so two virtual environments (a clean checkout's and this one's) rebuilt the same
sources in turn. The build folder's name holds the sources' digest, so other sources still build apart.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import struct
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterator, Optional, Union

import torch

logger = logging.getLogger(__name__)

DeviceLike = Union[str, torch.device, torch.Tensor]


LOCK_TIMEOUT_ENV = "MAGNETAR_OP_LOCK_TIMEOUT_S"
DEFAULT_LOCK_TIMEOUT_S = 600.0


def device_type(device: DeviceLike) -> str:
    return device.device.type if isinstance(device, torch.Tensor) else torch.device(device).type


def build_directory(name: str) -> Path:
    """Where ``torch.utils.cpp_extension.load(name=name)`` builds and caches the extension (created if needed)."""
    from torch.utils.cpp_extension import _get_build_directory  # torch's own rule (TORCH_EXTENSIONS_DIR, ...)

    return Path(_get_build_directory(name, verbose=False))


def extensions_root() -> Path:
    """The folder of torch's JIT builds: ``$TORCH_EXTENSIONS_DIR``, or
    ``~/.cache/torch_extensions/py<XY>_<cpu|cuXYZ>`` (created if needed, as torch does for any build)."""
    from torch.utils.cpp_extension import _get_build_directory  # torch's own rule; "" names the root itself

    return Path(_get_build_directory("", verbose=False))


def jit_cached(name: str) -> Optional[Path]:
    """The extension ``torch.utils.cpp_extension.load(name=name)`` built earlier, if its library exists (it is
    reused unless a source or flag changed since); None otherwise. Creates nothing for ``name``."""
    from torch.utils.cpp_extension import LIB_EXT

    path = extensions_root() / name / f"{name}{LIB_EXT}"
    return path if path.is_file() else None


def lock_timeout_s() -> float:
    """``MAGNETAR_OP_LOCK_TIMEOUT_S`` (seconds a load waits for another process's build), default 600."""
    text = os.environ.get(LOCK_TIMEOUT_ENV)
    if text is None:
        return DEFAULT_LOCK_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{LOCK_TIMEOUT_ENV}={text!r} is not a number of seconds; set it to e.g. 600") from None
    if not value >= 0:
        raise ValueError(f"{LOCK_TIMEOUT_ENV}={text!r} must be >= 0 seconds")
    return value


@contextlib.contextmanager
def build_lock(directory: Path, timeout_s: float, log: logging.Logger = logger) -> Iterator[None]:
    """Hold ``directory/magnetar.lock`` (``flock``: released by the kernel if this process dies) for a build or
    load of the extension in ``directory``, waiting at most ``timeout_s``; then remove torch's ``lock`` there if
    one is left (stale: no live Magnetar process is building). Raises ``TimeoutError`` naming the lock."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "magnetar.lock"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = path.read_text().strip() or "unknown"
                    raise TimeoutError(
                        f"waited {timeout_s:g} s ({LOCK_TIMEOUT_ENV}) for {path}, held by pid {holder} building or "
                        f"loading this op; let it finish, or end that process (the lock goes with it) -- if no such "
                        f"process exists, delete {path}") from None
                time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        stale = directory / "lock"
        if stale.exists():
            log.warning("magnetar: removing the stale build lock %s (left by a process that died while building; no "
                        "live Magnetar process is building there)", stale)
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        yield
    finally:
        os.close(fd)  # releases the flock


BUILT_RECORD = "magnetar.built"  # {"size", "sha256", "torch"} of a completed build's library, next to it


def library_problem(path: Path) -> Optional[str]:
    """Why the shared library ``path`` cannot be a completed build, or None: not an ELF file, or an ELF file cut
    short (its program headers, a segment or its section headers run past the end of the file -- what makes
    ``dlopen`` die of SIGBUS). Reads the headers only."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF" or len(head) < 52 or head[4] not in (1, 2) or head[5] not in (1, 2):
                return f"{path} is not an ELF shared library ({size} bytes)"
            wide, order = head[4] == 2, "<" if head[5] == 1 else ">"
            if wide and len(head) < 64:
                return f"{path} is cut inside its ELF header ({size} bytes)"
            if wide:
                phoff, shoff = struct.unpack_from(order + "QQ", head, 0x20)
                phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 0x36)
            else:
                phoff, shoff = struct.unpack_from(order + "II", head, 0x1C)
                phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 0x2A)
            if phoff + phnum * phentsize > size:
                return f"{path} is cut short: its program headers end at byte {phoff + phnum * phentsize}, the file " \
                       f"has {size}"
            if shoff and shoff + shnum * shentsize > size:
                return f"{path} is cut short: its section headers end at byte {shoff + shnum * shentsize}, the file " \
                       f"has {size}"
            f.seek(phoff)
            table = f.read(phnum * phentsize)
        for i in range(phnum):
            if wide:
                p_offset, = struct.unpack_from(order + "Q", table, i * phentsize + 8)
                p_filesz, = struct.unpack_from(order + "Q", table, i * phentsize + 32)
            else:
                p_offset, = struct.unpack_from(order + "I", table, i * phentsize + 4)
                p_filesz, = struct.unpack_from(order + "I", table, i * phentsize + 16)
            if p_offset + p_filesz > size:
                return f"{path} is cut short: segment {i} ends at byte {p_offset + p_filesz}, the file has {size}"
    except (OSError, struct.error) as err:
        return f"{path} cannot be read as an ELF library ({err})"
    return None


def _file_record(path: Path) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"size": path.stat().st_size, "sha256": h.hexdigest()}


def cached_build_problem(directory: Path, name: str) -> Optional[str]:
    """Why the library torch would load from ``directory`` (its build folder for op ``name``) is not a completed
    build, or None (no library there yet, or a sound one): :func:`library_problem`, and a library that differs
    from the size and sha256 recorded when its build completed (:data:`BUILT_RECORD`)."""
    from torch.utils.cpp_extension import LIB_EXT

    lib = directory / f"{name}{LIB_EXT}"
    if not lib.exists():
        return None
    problem = library_problem(lib)
    if problem is not None:
        return problem
    record = directory / BUILT_RECORD
    if record.exists():
        try:
            want = json.loads(record.read_text())
        except (OSError, ValueError):
            want = None
        have = _file_record(lib)
        if not isinstance(want, dict) or {k: want.get(k) for k in have} != have:
            return f"{lib} is not the library its build completed (size or sha256 differ from {record})"
    return None


def record_completed_build(directory: Path, name: str) -> None:
    """Write :data:`BUILT_RECORD` for the library of a build that just loaded (atomically: a cut write leaves the
    old record or none): its size and sha256, and the torch it was built against."""
    from torch.utils.cpp_extension import LIB_EXT

    lib = directory / f"{name}{LIB_EXT}"
    if lib.exists():
        tmp = directory / (BUILT_RECORD + ".tmp")
        tmp.write_text(json.dumps(dict(_file_record(lib), torch=str(torch.__version__))))
        os.replace(tmp, directory / BUILT_RECORD)


def reuse_completed_build(directory: Path, name: str) -> Optional[ModuleType]:
    """The library of a completed CPU build in ``directory`` (its record names this torch), imported as torch's
    ``load`` would import it -- without asking ninja, which rebuilds whenever the compile command changed, and it
    changes with the folder torch is installed in (every virtual environment, every clean checkout's) though the
    headers are the same: two checkouts of the same sources rebuilt the ops in turn, ~1.5 min of a core each time.
    The build folder's name holds the sources' digest (:mod:`magnetar.ops.op_builder`), the flags are the builder's
    own, and the library was checked whole (:func:`cached_build_problem`) by the caller. None: build as usual."""
    import importlib.util

    from torch.utils.cpp_extension import LIB_EXT

    lib, record = directory / f"{name}{LIB_EXT}", directory / BUILT_RECORD
    try:
        want = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    if not lib.is_file() or not isinstance(want, dict) or want.get("torch") != str(torch.__version__):
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, lib)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 -- an unloadable library: build it as usual
        logger.warning("magnetar: the completed build %s does not import (%s: %s); it is built again", lib,
                       type(err).__name__, err)
        return None
    return module


def clear_build(directory: Path) -> None:
    """Remove everything in a build folder but Magnetar's lock (held by the caller): the next load builds anew."""
    for entry in directory.iterdir():
        if entry.name == "magnetar.lock":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()


class LazyOp:
    """``make_builder(device_type)`` returns a DeepSpeed ``OpBuilder`` (or None: no op for that device type; the
    ones it has are ``devices``); the loaded module must define every name in ``required``."""

    def __init__(self, what: str, make_builder: Callable[[str], object], required: tuple[str, ...],
                 logger_name: Optional[str] = None, devices: tuple[str, ...] = ("cpu", "cuda")):
        self.what, self.make_builder, self.required, self.devices = what, make_builder, required, devices
        self.logger = logging.getLogger(logger_name) if logger_name else logger
        self._lock = threading.Lock()
        self.modules: dict[str, ModuleType] = {}
        self.failures: dict[str, str] = {}

    def _try_load(self, dtype: str) -> tuple[Optional[ModuleType], Optional[str]]:
        verbose = os.environ.get("MAGNETAR_VERBOSE_BUILD", "0") == "1"
        try:
            builder = self.make_builder(dtype)
            if builder is None:
                return None, (f"no {self.what} op for device type {dtype!r} (there is one for "
                              f"{' and '.join(self.devices)})")
            # magnetar's builders offer the module `pip install` prebuilt (DS_BUILD_MAGNETAR_OPS=1): no compiler
            # or build lock needed for it. A builder without one (a test's stand-in) always JIT-builds.
            load_prebuilt = getattr(builder, "load_prebuilt", None)
            module = load_prebuilt() if load_prebuilt is not None else None
            if module is None:
                if not builder.is_compatible(verbose):
                    return None, builder.error_log or f"{builder.name} is not compatible with this machine"
                directory = build_directory(builder.name)
                with build_lock(directory, lock_timeout_s(), self.logger):
                    problem = cached_build_problem(directory, builder.name)
                    if problem is not None:
                        self.logger.warning("magnetar: the cached build of the %s op was not completed (%s); it is "
                                            "removed and built again", self.what, problem)
                        clear_build(directory)
                    module = reuse_completed_build(directory, builder.name) if dtype == "cpu" else None
                    if module is None:
                        module = builder.jit_load(verbose=verbose)
                        record_completed_build(directory, builder.name)
            missing = [n for n in self.required if not hasattr(module, n)]
            if missing:
                return None, f"{builder.name} loaded but lacks {missing} (stale build cache?)"
            return module, None
        except Exception as err:  # noqa: BLE001 -- a failed build must never take the caller down
            return None, f"{type(err).__name__}: {err}"

    def _get(self, device: DeviceLike) -> Optional[ModuleType]:
        dtype = device_type(device)
        if dtype in self.modules or dtype in self.failures:
            return self.modules.get(dtype)
        with self._lock:
            if dtype in self.modules or dtype in self.failures:
                return self.modules.get(dtype)
            module, reason = self._try_load(dtype)
            if module is not None:
                self.modules[dtype] = module
            else:
                self.failures[dtype] = reason
                shown = reason if len(reason) <= 4000 else reason[:1000] + "\n...\n" + reason[-3000:]
                self.logger.warning("magnetar: the %s op is unavailable for %s tensors; the torch implementation is "
                               "used (MAGNETAR_VERBOSE_BUILD=1 shows the build log). Reason: %s",
                               self.what, dtype, shown)
            return module

    def available(self, device: DeviceLike) -> bool:
        """Whether the op runs on ``device``'s type (builds/loads it on the first call). Never raises."""
        try:
            return self._get(device) is not None
        except Exception as err:  # noqa: BLE001 -- e.g. an unparsable device string
            self.logger.warning("magnetar: %s availability check for %r failed: %s", self.what, device, err)
            return False

    def unavailable_reason(self, device: DeviceLike) -> Optional[str]:
        if self.available(device):
            return None
        try:
            return self.failures.get(device_type(device), "unknown reason")
        except Exception as err:  # noqa: BLE001 -- an unparsable device string
            return f"invalid device {device!r}: {err}"

    def runs_here_reason(self, name: str, lacks: str) -> Optional[str]:
        """For a CPU op whose module says with ``supported()`` whether this CPU runs it: why it cannot run here --
        ``"the <name> op is unavailable: <why>"`` when it did not build or load, ``lacks`` when the CPU lacks what it
        needs -- or None. Builds or loads it on the first call; never raises."""
        reason = self.unavailable_reason("cpu")
        if reason is not None:
            return f"the {name} op is unavailable: {reason}"
        return None if self.load("cpu").supported() else lacks

    def load(self, device: DeviceLike) -> ModuleType:
        module = self._get(device)
        if module is None:
            dtype = device_type(device)
            raise RuntimeError(f"magnetar: the {self.what} op is unavailable for {dtype} tensors: "
                               f"{self.failures.get(dtype, 'unknown reason')}")
        return module


class CpuKernel:
    """A CPU op an attention backend calls (``cpu_decode``'s, ``cpu_amx``'s): :meth:`reason` -- why it cannot run here
    (:meth:`LazyOp.runs_here_reason`), or None -- is asked once, since a backend's ``validate`` runs on every attention
    call (~60 a decode step or a forward); :attr:`module` is the loaded op once :meth:`reason` said None."""

    __slots__ = ("op", "name", "lacks", "module", "_missing")

    def __init__(self, op: LazyOp, name: str, lacks: str):
        self.op, self.name, self.lacks = op, name, lacks
        self.module: Optional[ModuleType] = None
        self._missing: Optional[str] = None

    def reason(self) -> Optional[str]:
        if self.module is None and self._missing is None:
            self._missing = self.op.runs_here_reason(self.name, self.lacks)
            if self._missing is None:
                self.module = self.op.load("cpu")
        return self._missing
