"""Few-row products of bf16 weights on AVX-512 BF16 CPUs (``csrc/small_gemm.cpp``, JIT-built like Magnetar's other
CPU ops): what a decode step's linear layers compute -- one to a few dozen rows of activations against every weight.

:class:`SmallGemm` holds a weight's copy in the op's blocked layout and computes ``x @ w.T + bias`` from it;
:func:`small_gemm_unavailable` says why it cannot run here (None: it can). :mod:`magnetar.engine.gemv` offers it
beside oneDNN's copies and keeps whichever its timed pass finds faster. oneDNN read a decode step's bf16 weights at
10-13 GB/s on one core of the AVX-512 EPYC VM (the core reads memory at ~22 GB/s); the op's layout puts 32 outputs
side by side for each pair of inputs, so the weights stream in order through one dot-product instruction per row.
"""
from __future__ import annotations

from typing import Optional

import torch

from magnetar.ops.jit import LazyOp


def _make_builder(device_type: str):
    from magnetar.ops import op_builder  # imports DeepSpeed; deferred to the first load

    return op_builder.SmallGemmBuilder() if device_type == "cpu" else None


SMALL_GEMM_OP = LazyOp("CPU small bf16 GEMM", _make_builder, ("pack", "gemm", "supported"), logger_name=__name__,
                       devices=("cpu",))


def weight_reason(weight_out_in: torch.Tensor) -> Optional[str]:
    """Why the op cannot take this weight (None: it can, where it runs): it needs a 2-D bfloat16 CPU tensor whose
    input size is even (the layout pairs inputs)."""
    if weight_out_in.dtype != torch.bfloat16 or weight_out_in.device.type != "cpu" or weight_out_in.dim() != 2:
        return (f"the weight must be a 2-D bfloat16 CPU tensor, got {weight_out_in.dtype} "
                f"{tuple(weight_out_in.shape)} on {weight_out_in.device}")
    if weight_out_in.shape[1] % 2:
        return f"the weight's input size must be even, got {weight_out_in.shape[1]}"
    return None


def small_gemm_unavailable() -> Optional[str]:
    """Why :class:`SmallGemm` cannot run in this process (the op did not build, or the CPU lacks AVX-512 BF16), or
    None. Builds or loads the op on the first call; never raises."""
    return SMALL_GEMM_OP.runs_here_reason("small GEMM", "this CPU lacks AVX-512 BF16")


class SmallGemm:
    """``weight (out, in)`` bf16 in the op's blocked layout (a copy: the weight itself is left as it is); calling it
    with ``x (..., in)`` bf16 gives ``x @ weight.T + bias`` in bf16 (float32 sums). Raises ValueError naming what
    does not fit: another dtype, an odd ``in``, or the op unavailable here."""

    def __init__(self, weight_out_in: torch.Tensor):
        reason = weight_reason(weight_out_in) or small_gemm_unavailable()
        if reason is not None:
            raise ValueError(f"SmallGemm: {reason}")
        self._op = SMALL_GEMM_OP.load("cpu")
        with torch.no_grad():
            self.w = self._op.pack(weight_out_in.detach())
        self.out_features, self.in_features = weight_out_in.shape

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        y = self._op.gemm(rows, self.w, self.out_features, bias)
        return y.reshape(*x.shape[:-1], self.out_features)
