"""Fused ``merge_states`` op: lazy JIT load of the DeepSpeed op builders in :mod:`magnetar.ops.op_builder`.

:func:`magnetar.ops.merge.merge_states` calls into this module; its torch implementation
(:func:`~magnetar.ops.merge.merge_states_torch`) is the fallback and the reference the op is tested against.

* Importing this module builds nothing and does not import DeepSpeed; the first
  :func:`fused_merge_available` / :func:`fused_merge_states` call for a device type (``cpu`` or ``cuda``)
  JIT-builds or loads the op for that device type, once per process, under a lock.
* The compiled extension is cached on disk by torch (``$TORCH_EXTENSIONS_DIR/<op name>/``, default
  ``~/.cache/torch_extensions/...``) and reused across processes; torch's file lock serialises concurrent
  first builds. See :mod:`magnetar.ops.op_builder`.
* If the op cannot be built or loaded, the reason is cached, ONE warning is logged (``logging`` logger
  ``magnetar.ops.fused_merge``) and :func:`fused_merge_available` returns False; it never raises.
  :func:`fused_merge_states` raises ``RuntimeError`` with that reason.
* Build output is not printed unless ``MAGNETAR_VERBOSE_BUILD=1``.

The op has no autograd formula: it is for inference (inputs that require grad are rejected).
Like the torch reference, it never reads the ``outs`` row of an *empty* part (lse -inf, +inf or NaN), so NaN
garbage there does not reach the result.
"""
from __future__ import annotations

import logging
import os
import threading
from types import ModuleType
from typing import Optional, Union

import torch

logger = logging.getLogger(__name__)

DeviceLike = Union[str, torch.device, torch.Tensor]

_SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

_lock = threading.Lock()
_modules: dict[str, ModuleType] = {}  # device type -> loaded extension module
_failures: dict[str, str] = {}  # device type -> why the op is unavailable


def _device_type(device: DeviceLike) -> str:
    if isinstance(device, torch.Tensor):
        return device.device.type
    return torch.device(device).type


def _verbose_build() -> bool:
    return os.environ.get("MAGNETAR_VERBOSE_BUILD", "0") == "1"


def _make_builder(device_type: str):
    """The op builder for ``device_type``, or None when there is no fused op for it."""
    from magnetar.ops import op_builder  # imports DeepSpeed; deferred to the first load

    if device_type == "cpu":
        return op_builder.MergeStatesBuilder()
    if device_type == "cuda":
        return op_builder.MergeStatesCUDABuilder()
    return None


def _try_load(device_type: str) -> tuple[Optional[ModuleType], Optional[str]]:
    verbose = _verbose_build()
    try:
        builder = _make_builder(device_type)
        if builder is None:
            return None, (
                f"no fused merge_states op for device type {device_type!r} "
                f"(available for: {', '.join(_SUPPORTED_DEVICE_TYPES)})"
            )
        if not builder.is_compatible(verbose):
            return None, builder.error_log or f"{builder.name} is not compatible with this machine"
        module = builder.jit_load(verbose=verbose)
        if not hasattr(module, "merge_states"):
            return None, f"{builder.name} loaded but has no merge_states function (stale build cache?)"
        return module, None
    except Exception as err:  # noqa: BLE001 -- a failed build must never take the caller down
        return None, f"{type(err).__name__}: {err}"


def _load(device: DeviceLike) -> Optional[ModuleType]:
    device_type = _device_type(device)
    module = _modules.get(device_type)
    if module is not None or device_type in _failures:
        return module
    with _lock:  # one build per device type per process; torch's file lock covers other processes
        module = _modules.get(device_type)
        if module is not None or device_type in _failures:
            return module
        module, reason = _try_load(device_type)
        if module is not None:
            _modules[device_type] = module
        else:
            _failures[device_type] = reason
            shown = reason if len(reason) <= 4000 else reason[:1000] + "\n...\n" + reason[-3000:]
            logger.warning(
                "magnetar: the fused merge_states op is unavailable for %s tensors; merge_states(backend='auto') "
                "uses the torch implementation (set MAGNETAR_VERBOSE_BUILD=1 for the build log). Reason: %s",
                device_type,
                shown,
            )
        return module


def fused_merge_available(device: DeviceLike) -> bool:
    """Whether the fused op can run on ``device``'s type; builds/loads it on the first call. Never raises."""
    try:
        return _load(device) is not None
    except Exception as err:  # noqa: BLE001 -- e.g. an unparsable device string
        logger.warning("magnetar: fused_merge_available(%r) failed: %s", device, err)
        return False


def fused_merge_unavailable_reason(device: DeviceLike) -> Optional[str]:
    """Why the fused op is unavailable on ``device``'s type, or None if it is available (loads it if needed)."""
    if fused_merge_available(device):
        return None
    try:
        return _failures.get(_device_type(device), "unknown reason")
    except Exception as err:  # noqa: BLE001
        return f"invalid device {device!r}: {err}"


def load_fused_merge_op(device: DeviceLike) -> ModuleType:
    """The loaded extension module for ``device``'s type; raises ``RuntimeError`` with the reason if unavailable."""
    module = _load(device)
    if module is None:
        device_type = _device_type(device)
        raise RuntimeError(
            f"magnetar: the fused merge_states op is unavailable for {device_type} tensors: "
            f"{_failures.get(device_type, 'unknown reason')}"
        )
    return module


def _check(outs: torch.Tensor, lses: torch.Tensor) -> None:
    from magnetar.ops.merge import _validate  # the shape/device checks every merge shares

    if not isinstance(outs, torch.Tensor) or not isinstance(lses, torch.Tensor):
        raise TypeError("fused_merge_states: outs and lses must be stacked tensors (N, B, H, S, D) and (N, B, H, S)")
    _validate(outs, lses)
    if outs.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"fused_merge_states: outs must be float32, bfloat16, float16 or float64, got {outs.dtype}")
    if not lses.is_floating_point():
        raise ValueError(f"fused_merge_states: lses must be a floating dtype, got {lses.dtype}")
    if torch.is_grad_enabled() and (outs.requires_grad or lses.requires_grad):
        raise ValueError(
            "fused_merge_states: the fused op has no backward; use merge_states(..., backend='torch') for inputs "
            "that require grad, or run under torch.no_grad()"
        )


def fused_merge_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused merge of stacked states ``outs (N, B, H, S, D)``, ``lses (N, B, H, S)``.

    Same contract as :func:`magnetar.ops.merge.merge_states_torch`: returns ``out (B, H, S, D)`` in
    ``outs.dtype`` and ``lse (B, H, S)`` float32; rows empty in every part give ``(0, -inf)``.
    Raises ``RuntimeError`` (with the build failure) when the op is unavailable for the inputs' device.
    """
    _check(outs, lses)
    module = load_fused_merge_op(outs.device)
    return module.merge_states(outs.contiguous(), lses.to(torch.float32).contiguous())
