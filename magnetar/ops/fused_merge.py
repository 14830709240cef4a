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
Like the torch reference, it never reads the ``outs`` row of an *empty* part (lse -inf), so NaN garbage there
does not reach the result, and a part with lse NaN or +inf makes its row ``(NaN, NaN)`` (the non-finite rule
of :mod:`magnetar.ops.merge`).
"""
from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from magnetar.ops.call import validate_states
from magnetar.ops.jit import DeviceLike, LazyOp

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _make_builder(dtype: str):
    """The op builder for device type ``dtype``, or None when there is no fused op for it."""
    from magnetar.ops import op_builder  # imports DeepSpeed; deferred to the first load

    if dtype == "cpu":
        return op_builder.MergeStatesBuilder()
    if dtype == "cuda":
        return op_builder.MergeStatesCUDABuilder()
    return None


# builds/loads once per device type per process; the builder is looked up at call time so tests can swap it
_op = LazyOp("fused merge_states", lambda dtype: _make_builder(dtype), ("merge_states",), logger_name=__name__)


def fused_merge_available(device: DeviceLike) -> bool:
    """Whether the fused op can run on ``device``'s type; builds/loads it on the first call. Never raises."""
    return _op.available(device)


def fused_merge_unavailable_reason(device: DeviceLike) -> Optional[str]:
    """Why the fused op is unavailable on ``device``'s type, or None if it is available (loads it if needed)."""
    return _op.unavailable_reason(device)


def load_fused_merge_op(device: DeviceLike) -> ModuleType:
    """The loaded extension module for ``device``'s type; raises ``RuntimeError`` with the reason if unavailable."""
    return _op.load(device)


def _check(outs: torch.Tensor, lses: torch.Tensor) -> None:
    validate_states(outs, lses)  # tensors, shapes, one device, floating outs and lses
    if outs.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"fused_merge_states: outs must be float32, bfloat16, float16 or float64, got {outs.dtype}")
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
