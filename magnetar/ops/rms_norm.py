"""Llama's RMSNorm on the CPU as one pass over each row (``csrc/rms_norm.cpp``, JIT-built like Magnetar's other CPU
ops): ``weight * round(x / sqrt(mean(x^2) + eps))`` with Hugging Face's roundings (the normalized row rounded to x's
dtype, then the weight's product rounded once more), in float32 or bfloat16.

:func:`rms_norm` computes it; :func:`rms_norm_unavailable` says why it cannot run here (None: it can).
:mod:`magnetar.engine.norms` swaps it into a model's norms where their own forward gives the same values.
"""
from __future__ import annotations

from typing import Optional

import torch

from magnetar.ops.jit import LazyOp


def _make_builder(device_type: str):
    from magnetar.ops import op_builder  # imports DeepSpeed; deferred to the first load

    return op_builder.RMSNormBuilder() if device_type == "cpu" else None


RMS_NORM_OP = LazyOp("CPU RMSNorm", _make_builder, ("rms_norm", "vectorized"), logger_name=__name__,
                     devices=("cpu",))


def rms_norm_unavailable() -> Optional[str]:
    """Why :func:`rms_norm` cannot run in this process (the op did not build or load), or None. Builds or loads the
    op on the first call; never raises."""
    reason = RMS_NORM_OP.unavailable_reason("cpu")
    return None if reason is None else f"the RMSNorm op is unavailable: {reason}"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x (..., H)`` (float32 or bfloat16, CPU) over its last dimension with ``weight (H)`` of its dtype:
    the module docstring's formula, x's shape and dtype. Raises ValueError naming what does not fit."""
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError(f"rms_norm: CPU tensors, got x on {x.device} and weight on {weight.device}")
    if x.dtype not in (torch.float32, torch.bfloat16) or weight.dtype != x.dtype:
        raise ValueError(f"rms_norm: x and weight both float32 or both bfloat16, got {x.dtype} and {weight.dtype}")
    if weight.dim() != 1 or x.dim() < 1 or x.shape[-1] != weight.shape[0] or weight.shape[0] == 0:
        raise ValueError(f"rms_norm: weight must be (H) with H = x's last size > 0, got x {tuple(x.shape)} and "
                         f"weight {tuple(weight.shape)}")
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return RMS_NORM_OP.load("cpu").rms_norm(rows, weight.contiguous(), float(eps)).reshape(x.shape)
