"""Lazy, once-per-process loading of a JIT-built DeepSpeed op, per device type, that never raises on failure.

:class:`LazyOp` is the loader behind the Hamming ops (:mod:`magnetar.sparse.codes`): the first
``available(device)`` / ``load(device)`` for a device type builds or loads the op for it under a lock (torch's
file lock serialises concurrent first builds in other processes; see :mod:`magnetar.ops.op_builder` for the
build cache). A failure is cached with its reason and logged once; ``available`` then returns False and
``load`` raises ``RuntimeError`` with the reason, so callers fall back to their torch implementation.
Build output is printed only with ``MAGNETAR_VERBOSE_BUILD=1``.
"""
from __future__ import annotations

import logging
import os
import threading
from types import ModuleType
from typing import Callable, Optional, Union

import torch

logger = logging.getLogger(__name__)

DeviceLike = Union[str, torch.device, torch.Tensor]


def device_type(device: DeviceLike) -> str:
    return device.device.type if isinstance(device, torch.Tensor) else torch.device(device).type


class LazyOp:
    """``make_builder(device_type)`` returns a DeepSpeed ``OpBuilder`` (or None: no op for that device type);
    the loaded module must define every name in ``required``."""

    def __init__(self, what: str, make_builder: Callable[[str], object], required: tuple[str, ...],
                 logger_name: Optional[str] = None):
        self.what, self.make_builder, self.required = what, make_builder, required
        self.logger = logging.getLogger(logger_name) if logger_name else logger
        self._lock = threading.Lock()
        self.modules: dict[str, ModuleType] = {}
        self.failures: dict[str, str] = {}

    def _try_load(self, dtype: str) -> tuple[Optional[ModuleType], Optional[str]]:
        verbose = os.environ.get("MAGNETAR_VERBOSE_BUILD", "0") == "1"
        try:
            builder = self.make_builder(dtype)
            if builder is None:
                return None, f"no {self.what} op for device type {dtype!r} (there is one for cpu and cuda)"
            if not builder.is_compatible(verbose):
                return None, builder.error_log or f"{builder.name} is not compatible with this machine"
            module = builder.jit_load(verbose=verbose)
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
                               "used (MAGNETAR_VERBOSE_BUILD=1 shows the build log). Reason: %s", self.what, dtype, shown)
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

    def load(self, device: DeviceLike) -> ModuleType:
        module = self._get(device)
        if module is None:
            dtype = device_type(device)
            raise RuntimeError(f"magnetar: the {self.what} op is unavailable for {dtype} tensors: "
                               f"{self.failures.get(dtype, 'unknown reason')}")
        return module
