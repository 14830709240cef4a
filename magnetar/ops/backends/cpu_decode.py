"""CPU decode backend: a few query rows per KV head over every key, one pass over K and V
(``csrc/decode_attention.cpp``, JIT-built like Magnetar's other CPU ops).

It serves the eager decode step's calls -- a new token's query heads over a cached context or over the request's
own tokens, every key visible (the FULL mask kind) -- and, as ``slot_forward``, the static and graph steps' calls
over slot buffers on a CPU (the kernel's masked pass: positions decide what each row sees; entries no row sees are
not read), and, as ``pages_forward``, an eager step's whole batch over each request's KV pages in one launch
(:mod:`magnetar.ops.pages`); it refuses everything else, which ``auto`` then sends to
``cpu_flash``: a mask, more than :data:`MAX_ROWS` query rows per KV head (a prefill), float16 / float64, a head
dimension that is not a multiple of 8 or over 256, K / V not contiguous along D, a CPU without AVX2/FMA, or the op
failing to build (the reason is logged once). Torch's CPU flash kernel reads a decode call's cold cache at a
fraction of a core's rate (packing per block, scalar work); this kernel reads each key and value row once for the
G x Sq rows sharing it: 0.69 -> 0.38 ms (fp32) and 0.78 -> 0.23 ms (bf16) for a 4K-token call of SmolLM2-135M on
one core of the AVX-512 EPYC VM (docs/results.md "bf16 on the CPU beside vLLM's bf16, and a decode attention
kernel"). Where the CPU has AVX-512 BF16, bf16 calls (decode, paged and slot calls alike) take the kernel's second
pass (scores by VDPBF16PS against the keys as stored): a cold 4K call 0.8x, a batch of 8 paged calls 0.75x the AVX2
pass's time (docs/results.md "Decode attention in AVX-512 BF16"; ``MAGNETAR_DECODE_AVX512=0`` switches it off).
"""
from __future__ import annotations

import torch

from magnetar.ops.call import FULL
from magnetar.ops.jit import CpuKernel, LazyOp

MAX_ROWS = 8  # query rows per KV head (query heads per KV head x query tokens) the kernel holds in registers
MAX_DIM = 256
DTYPES = (torch.float32, torch.bfloat16)


def _make_builder(device_type: str):
    from magnetar.ops import op_builder  # imports DeepSpeed; deferred to the first load

    return op_builder.DecodeAttentionBuilder() if device_type == "cpu" else None


DECODE_ATTENTION_OP = LazyOp("CPU decode attention", _make_builder,
                             ("decode_attention", "decode_attention_checked", "slot_attention",
                              "decode_attention_pages", "supported", "avx512_bf16", "set_avx512_bf16"),
                             logger_name=__name__, devices=("cpu",))


def shape_reasons(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[str]:
    """Why the kernel cannot take these tensors (empty: it can), the op's availability aside."""
    reasons = []
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        reasons.append(f"needs q, k, v all float32 or all bfloat16, got {q.dtype} / {k.dtype} / {v.dtype}")
    rows = (q.shape[1] // max(1, k.shape[1])) * q.shape[2]
    if rows > MAX_ROWS:
        reasons.append(f"{rows} query rows per KV head (query heads per KV head x query tokens): at most {MAX_ROWS}")
    D = q.shape[-1]
    if D % 8 or D > MAX_DIM:
        reasons.append(f"head dimension {D}: a multiple of 8, at most {MAX_DIM}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        reasons.append("k and v must be contiguous along the head dimension")
    return reasons


class CpuDecodeBackend:
    name = "cpu_decode"
    device_types = ("cpu",)

    def __init__(self):
        self._kernel = CpuKernel(DECODE_ATTENTION_OP, "decode attention", "this CPU lacks AVX2/FMA")

    def validate(self, call) -> list[str]:
        q = call.q
        if q.device.type != "cpu":
            return [f"needs CPU tensors, got {q.device}"]
        if call.mask_kind != FULL:
            return [f"decode kernel: every key visible to every query only (mask kind {call.mask_kind})"]
        reasons = shape_reasons(q, call.k, call.v)
        if not reasons and (why := self._kernel.reason()) is not None:
            reasons.append(why)
        return reasons

    def forward(self, call):
        return self.forward_checked(call)[:2]

    def forward_checked(self, call):
        """``(out, lse, clean)``: clean -- every score and output element was finite -- means q, k and out are
        finite (every key is visible to every query: a non-finite q or k element makes a score non-finite), the
        front end's fast-path condition, without its pass over them."""
        if (why := self._kernel.reason()) is not None:
            raise RuntimeError(f"cpu_decode: {why}")
        return self._kernel.module.decode_attention_checked(call.q, call.k, call.v, float(call.scale))

    def runs_here(self) -> bool:
        """Whether the op is built and this CPU runs it (asked once)."""
        return self._kernel.reason() is None

    def slot_forward(self, q, k, v, q_pos, k_pos, scale, window=None):
        """The static / graph decode step's call over slot buffers (:mod:`magnetar.ops.slots`' contract): the
        kernel's masked pass -- an entry no row sees is not read, a row seeing none is ``(0, -inf)``. What the
        kernel cannot take (a shape of :func:`shape_reasons`, another device, positions not int64, the op not
        running here) goes to :func:`magnetar.ops.slots.slot_attention`, the same contract in float32 torch."""
        if (q.device.type != "cpu" or shape_reasons(q, k, v) or q_pos.dtype != torch.long or k_pos.dtype != torch.long
                or self._kernel.reason() is not None):
            from magnetar.ops.slots import slot_attention

            return slot_attention(q, k, v, q_pos, k_pos, scale, window)
        return self._kernel.module.slot_attention(q, k, v, q_pos, k_pos, float(scale), int(window or 0))

    def pages_forward(self, q, pages, scale):
        """An eager decode step's batch in one launch (:mod:`magnetar.ops.pages`' contract): request b's rows over
        its ``pages[b]``, one softmax over all of them (empty pages are skipped). None -- the caller's per-part path --
        for what the kernel cannot take (a page of another dtype, layout or head count, a shape of
        :func:`shape_reasons`, no page at all) or when a score or an output element was not finite (that path applies
        the exact non-finite rules)."""
        ks, vs, first = [], [], [0]
        for request in pages:
            for page in request:  # magnetar.ops.pages.Page: its k_finite unused -- the kernel's own flag decides
                if page.k.shape[2]:
                    ks.append(page.k)
                    vs.append(page.v)
            first.append(len(ks))
        if not ks or q.device.type != "cpu" or self._kernel.reason() is not None:
            return None
        hkv = ks[0].shape[1]
        for k, v in zip(ks, vs):
            if (k.dtype != q.dtype or v.dtype != q.dtype or k.shape[0] != 1 or k.shape[1] != hkv or k.shape != v.shape
                    or k.device != q.device or v.device != q.device or k.stride(-1) != 1 or v.stride(-1) != 1):
                return None
        if shape_reasons(q, ks[0], vs[0]):
            return None
        out, lse, clean = self._kernel.module.decode_attention_pages(q, ks, vs, first, hkv, float(scale))
        return (out, lse) if clean else None
