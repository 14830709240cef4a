"""NVTX ranges for Nsight Systems, from one exception-safe helper that costs ~nothing when no profiler runs.

Usage::

    with nvtx_range("phase1/block 3"):
        ...

    @nvtx_range("phase2/merge")
    def merge(...): ...

Ranges are emitted only when a profiler is attached (Nsight sets ``NVTX_INJECTION64_PATH``) or
``MAGNETAR_NVTX=1``; ``MAGNETAR_NVTX=0`` turns them off. When off, entering a range is one attribute check.
The pop runs in ``__exit__`` so an exception inside the range never leaves the NVTX stack unbalanced
(DeepSpeed's ``instrument_w_nvtx`` pushes and pops around the call without ``finally``).
Emission goes through the ``nvtx`` package (works without CUDA); if it is missing, through
``torch.cuda.nvtx`` when CUDA is available; otherwise ranges are no-ops.
"""
from __future__ import annotations

import functools
import os
from typing import Callable, Optional

DOMAIN = "magnetar"


def _backend() -> Optional[tuple[Callable, Callable]]:
    flag = os.environ.get("MAGNETAR_NVTX")
    if flag == "0":
        return None
    if flag != "1" and not os.environ.get("NVTX_INJECTION64_PATH"):
        return None
    try:
        import nvtx

        return (lambda msg: nvtx.push_range(msg, domain=DOMAIN)), (lambda: nvtx.pop_range(domain=DOMAIN))
    except ImportError:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    except ImportError:
        pass
    return None


_EMIT = _backend()


def enabled() -> bool:
    """Whether ranges are emitted in this process."""
    return _EMIT is not None


def refresh() -> bool:
    """Re-read the environment (e.g. after setting ``MAGNETAR_NVTX``); returns :func:`enabled`."""
    global _EMIT
    _EMIT = _backend()
    return enabled()


class nvtx_range:
    """Context manager and decorator for one NVTX range named ``message``."""

    __slots__ = ("message", "_pops")

    def __init__(self, message: str):
        self.message = message
        self._pops = []  # the pop to run for each push still open on this object (re-entrant use)

    def __enter__(self):
        emit = _EMIT
        if emit is not None:
            emit[0](self.message)
            self._pops.append(emit[1])
        return self

    def __exit__(self, exc_type, exc, tb):
        if self._pops:
            self._pops.pop()()  # pop with the emitter that pushed, even if refresh() ran in between
        return False  # never swallow the exception

    def __call__(self, fn: Callable) -> Callable:
        message = self.message

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with nvtx_range(message):
                return fn(*args, **kwargs)

        return wrapper
