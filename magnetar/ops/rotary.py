"""The rotary position embedding of Llama-family models on the CPU as one pass over q or k (``csrc/rotary.cpp``,
JIT-built like Magnetar's other CPU ops): transformers' ``apply_rotary_pos_emb(q, k, cos, sin)`` (``unsqueeze_dim=1``)
-- ``x * cos + rotate_half(x) * sin``, each product rounded to the dtype, then the sum -- in float32 or bfloat16.

:func:`rotary` computes it; :func:`rotary_unavailable` says why it cannot run here (None: it can).
:mod:`magnetar.engine.rotary` puts it in a model's ``apply_rotary_pos_emb`` where it gives that function's values.
"""
from __future__ import annotations

from typing import Optional

import torch

from magnetar.ops.jit import LazyOp


def _make_builder(device_type: str):
    from magnetar.ops import op_builder  # imports DeepSpeed; deferred to the first load

    return op_builder.RotaryBuilder() if device_type == "cpu" else None


ROTARY_OP = LazyOp("CPU rotary embedding", _make_builder, ("rotary", "vectorized"), logger_name=__name__,
                   devices=("cpu",))
_DTYPES = (torch.float32, torch.bfloat16)


def rotary_unavailable() -> Optional[str]:
    """Why :func:`rotary` cannot run in this process (the op did not build or load), or None. Builds or loads the op
    on the first call; never raises."""
    reason = ROTARY_OP.unavailable_reason("cpu")
    return None if reason is None else f"the rotary embedding op is unavailable: {reason}"


def rotary_refusal(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Optional[str]:
    """Why :func:`rotary` does not take these arguments (None: it does) -- cheap, for a caller that falls back."""
    if not (q.device.type == k.device.type == cos.device.type == sin.device.type == "cpu"):
        return f"rotary: CPU tensors, got q on {q.device}, k on {k.device}, cos on {cos.device}, sin on {sin.device}"
    if not (q.dtype == k.dtype == cos.dtype == sin.dtype) or q.dtype not in _DTYPES:
        return (f"rotary: q, k, cos and sin all float32 or all bfloat16, got {q.dtype}, {k.dtype}, {cos.dtype} and "
                f"{sin.dtype}")
    if cos.dim() != 3 or cos.shape != sin.shape:
        return f"rotary: cos and sin must be (B or 1, S, D), got {tuple(cos.shape)} and {tuple(sin.shape)}"
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4 or t.shape[-1] % 2 or t.shape[2:] != cos.shape[1:] or cos.shape[0] not in (1, t.shape[0]):
            return (f"rotary: {name} must be (B, H, S, D) with D even and cos's S and D, got {name} {tuple(t.shape)} "
                    f"and cos {tuple(cos.shape)}")
    return None


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    """``(q_embed, k_embed)`` as transformers' ``apply_rotary_pos_emb(q, k, cos, sin)``: ``q (B, H, S, D)``, ``k (B,
    Hk, S, D)``, ``cos`` and ``sin (B or 1, S, D)``, all float32 or all bfloat16 on the CPU, D even; each result has
    its input's shape and strides (:func:`rotary_refusal`'s ValueError otherwise)."""
    why = rotary_refusal(q, k, cos, sin)
    if why is not None:
        raise ValueError(why)
    return rotary_checked(q, k, cos, sin)


def rotary_checked(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                      torch.Tensor]:
    """:func:`rotary` for arguments :func:`rotary_refusal` took already (a caller that falls back checks once)."""
    op = ROTARY_OP.load("cpu")
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    return tuple(op.rotary(t if t.stride(-1) == 1 else t.contiguous(), cos, sin) for t in (q, k))
