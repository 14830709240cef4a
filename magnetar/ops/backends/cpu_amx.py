"""CPU prefill backend on Intel AMX: bf16 attention with its log-sum-exp, flash-style over AMX tiles
(``csrc/amx_attention.cpp``, JIT-built like Magnetar's other CPU ops).

It takes the query forward's calls in bfloat16 -- a query's rows over its own keys (bottom-right causal) and over a
cached prefix (every key visible) -- with more query rows per KV head than ``cpu_decode`` takes (a question of 3+
tokens with SmolLM2's 3 query heads a KV head), a head dimension that is a multiple of 32 up to 256 and q, k, v
contiguous along it, where the CPU has AMX-BF16 and Linux grants the tile state; it refuses everything else (a
position mask, float32, a decode call's few rows, another CPU), which ``auto`` sends on to ``cpu_decode`` /
``cpu_flash``. Torch's CPU flash kernel ran SmolLM2's 1000-token causal square at ~0.3 TFLOP/s on two cores of the
Intel AMX VM (a quarter of the forward), its 47-key prefix call at under 0.1; this kernel takes 0.63-0.66x and ~0.4x
their time (docs/results.md, "An AMX attention kernel").
"""
from __future__ import annotations

import torch

from magnetar.ops.backends.cpu_decode import MAX_ROWS as DECODE_ROWS
from magnetar.ops.call import CAUSAL_BOTTOM_RIGHT, FULL
from magnetar.ops.jit import CpuKernel, LazyOp

MAX_DIM = 256


def _make_builder(device_type: str):
    from magnetar.ops import op_builder  # imports DeepSpeed; deferred to the first load

    return op_builder.AmxAttentionBuilder() if device_type == "cpu" else None


AMX_ATTENTION_OP = LazyOp("CPU AMX attention", _make_builder, ("attention", "attention_emulated", "supported"),
                          logger_name=__name__, devices=("cpu",))


def shape_reasons(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[str]:
    """Why the kernel cannot take these tensors (empty: it can), the op's availability aside."""
    reasons = []
    if not (q.dtype == k.dtype == v.dtype == torch.bfloat16):
        reasons.append(f"needs q, k, v all bfloat16, got {q.dtype} / {k.dtype} / {v.dtype}")
    D = q.shape[-1]
    if D % 32 or D > MAX_DIM or k.shape[-1] != D or v.shape[-1] != D:
        reasons.append(f"head dimensions {D} / {k.shape[-1]} / {v.shape[-1]}: one, a multiple of 32, at most {MAX_DIM}")
    rows = (q.shape[1] // max(1, k.shape[1])) * q.shape[2]
    if rows <= DECODE_ROWS:  # the kernel packs every key for them: cpu_decode reads each once (2x at 8K keys)
        reasons.append(f"{rows} query rows per KV head (query heads per KV head x query tokens): more than "
                       f"{DECODE_ROWS}, cpu_decode's")
    if k.shape[2] == 0:
        reasons.append("no keys")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        reasons.append("q, k and v must be contiguous along the head dimension")
    return reasons


class CpuAmxBackend:
    name = "cpu_amx"
    device_types = ("cpu",)

    def __init__(self):
        self._kernel = CpuKernel(AMX_ATTENTION_OP, "AMX attention",
                                 "this CPU lacks AVX-512 with AMX-BF16, or Linux did not grant the tile state")

    def validate(self, call) -> list[str]:
        q = call.q
        if q.device.type != "cpu":
            return [f"needs CPU tensors, got {q.device}"]
        if call.mask_kind not in (FULL, CAUSAL_BOTTOM_RIGHT):
            return [f"AMX kernel: every key visible or bottom-right causal only (mask kind {call.mask_kind})"]
        reasons = shape_reasons(q, call.k, call.v)
        if not reasons and (why := self._kernel.reason()) is not None:
            reasons.append(why)
        return reasons

    def forward(self, call):
        if (why := self._kernel.reason()) is not None:
            raise RuntimeError(f"cpu_amx: {why}")
        causal = call.mask_kind == CAUSAL_BOTTOM_RIGHT
        return self._kernel.module.attention(call.q, call.k, call.v, float(call.scale), causal)
