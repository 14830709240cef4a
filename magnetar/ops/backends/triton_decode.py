"""Triton decode backend: a decode step's context part over KV read where it lies, through a
:class:`~magnetar.ops.pointers.PointerTable` -- one launch per layer that a CUDA graph holds (issue 47, item 1).

Split-KV ("flash-decoding"): a program per (row, KV head, split) holds the G query heads sharing that KV head,
walks its share of each of the row's pages (a page of n keys is cut into ``splits`` ranges of whole tiles), keys
and values read from the addresses the table holds, positions deciding what the row sees, scores and softmax in
float32 (an online softmax over tiles of :data:`TILE` keys), and writes its normalized output and log-sum-exp; the
splits' states are merged by :func:`~magnetar.ops.merge_states`. How many splits: enough programs to fill the card
(:func:`splits`), fixed per batch size, so a graph's launch is the same at every replay whatever the contexts'
lengths; a split that gets no key is the empty state ``(0, -inf)``.

It serves nothing else: an ordinary attention call is refused (the registry's ``auto`` never picks it for one), and
:func:`magnetar.ops.pointers.pointer_backend` picks it for a static or graph step on CUDA where Triton runs. Under
``TRITON_INTERPRET=1`` it runs on CPU tensors (Triton's interpreter): how CI-less machines test the kernel itself
(tests/test_pointer_attention.py, where Triton is installed).
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from magnetar.ops.merge import merge_states

TILE = 64  # keys per step of a program's loop
MAX_SPLITS = 32


@functools.lru_cache(maxsize=1)
def _kernel():
    """The jitted kernel (Triton imported on first use: importing Magnetar never imports it)."""
    import triton
    import triton.language as tl

    @triton.jit
    def decode_pages(Q, QPOS, KT, VT, PT, NT, KH, VH, O, L, scale, window, pages, nsplit,
                     sqb, sqh, sqd, sob, soh, sos, slb, slh, sls,
                     G: tl.constexpr, BG: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
                     WINDOW: tl.constexpr, IEEE: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        rows = tl.arange(0, BG)
        dd = tl.arange(0, BD)
        rmask = rows < G
        dmask = dd < D
        heads = h * G + rows
        q = tl.load(Q + b * sqb + heads[:, None] * sqh + dd[None, :] * sqd, mask=rmask[:, None] & dmask[None, :],
                    other=0.0)
        qp = tl.load(QPOS + b)
        m = tl.full([BG], float("-inf"), tl.float32)
        total = tl.zeros([BG], tl.float32)
        acc = tl.zeros([BG, BD], tl.float32)
        for p in range(0, pages):
            at = b * pages + p
            n = tl.load(NT + at)
            per = tl.cdiv(tl.cdiv(n, nsplit), BN) * BN
            lo = s * per
            hi = tl.minimum(lo + per, n)
            kb = tl.load(KT + at).to(tl.pointer_type(Q.dtype.element_ty))
            vb = tl.load(VT + at).to(tl.pointer_type(Q.dtype.element_ty))
            pb = tl.load(PT + at).to(tl.pointer_type(tl.int64))
            kh = tl.load(KH + at)
            vh = tl.load(VH + at)
            for start in range(lo, hi, BN):
                keys = start + tl.arange(0, BN)
                kmask = keys < hi
                kpos = tl.load(pb + keys, mask=kmask, other=0)
                vis = kmask & (kpos <= qp)
                if WINDOW:
                    vis = vis & (kpos > qp - window)
                k = tl.load(kb + h * kh + keys[:, None] * D + dd[None, :], mask=kmask[:, None] & dmask[None, :],
                            other=0.0)
                if IEEE:
                    sc = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    sc = tl.dot(q, tl.trans(k))
                sc = tl.where(vis[None, :], sc * scale, float("-inf"))
                m_new = tl.maximum(m, tl.max(sc, 1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m - m_use)
                pr = tl.exp(sc - m_use[:, None])
                total = total * alpha + tl.sum(pr, 1)
                v = tl.load(vb + h * vh + keys[:, None] * D + dd[None, :], mask=kmask[:, None] & dmask[None, :],
                            other=0.0)
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
                m = m_new
        seen = total > 0
        safe = tl.where(seen, total, 1.0)
        out = tl.where(seen[:, None], acc / safe[:, None], 0.0)
        lse = tl.where(seen, m + tl.log(safe), float("-inf"))
        tl.store(O + s * sos + b * sob + heads[:, None] * soh + dd[None, :], out, mask=rmask[:, None] & dmask[None, :])
        tl.store(L + s * sls + b * slb + heads * slh, lse, mask=rmask)

    return decode_pages


def _pow2(n: int, least: int) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


@functools.lru_cache(maxsize=8)
def _units(device: torch.device) -> int:
    """The programs that fill ``device``: twice its multiprocessors on CUDA; 2 elsewhere (the interpreter)."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def splits(device: torch.device, rows: int, hkv: int) -> int:
    """How many ranges each page's keys are cut into for ``rows x hkv`` programs: enough to fill the device (at least
    2 on a CPU: the tests see the splits merged), at most :data:`MAX_SPLITS`."""
    return max(1, min(MAX_SPLITS, -(-_units(torch.device(device)) // (rows * hkv))))


class TritonDecodeBackend:
    name = "triton_decode"
    device_types = ("cuda", "cpu")  # the CPU through Triton's interpreter only (runs_here says when)

    def validate(self, call) -> list[str]:
        return ["serves only a decode step's context part through a pointer table (magnetar.ops.pointers)"]

    def forward(self, call):
        raise ValueError("triton_decode: " + self.validate(call)[0])

    @staticmethod
    def reason(device) -> Optional[str]:
        """Why the kernel cannot run on ``device`` (None: it can): Triton missing, or a CPU without its
        interpreter (``TRITON_INTERPRET=1``)."""
        kind = torch.device(device).type
        if kind == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            return "Triton runs on a CPU only through its interpreter (TRITON_INTERPRET=1)"
        if kind not in ("cuda", "cpu"):
            return f"needs a CUDA device, got {kind}"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "the triton package is not installed (it comes with torch's CUDA wheels)"
        return None

    def runs_here(self, device="cuda") -> bool:
        return self.reason(device) is None

    def pointers_forward(self, q, q_pos, table, layer: int, scale: float, window: Optional[int] = None):
        """The contract of :mod:`magnetar.ops.pointers`: ``q (B, Hq, 1, D)`` at ``q_pos (B, 1)`` over the pages
        ``table`` points row b at, layer ``layer``."""
        B, Hq, S, D = q.shape
        if S != 1:
            raise ValueError(f"triton_decode: one query token per row (a decode step), got {S}")
        hkv = table.hkv
        G = Hq // hkv
        n = splits(q.device, B, hkv)
        o = torch.empty(n, B, Hq, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(n, B, Hq, dtype=torch.float32, device=q.device)
        t = table.device[:, layer]
        _kernel()[(B, hkv, n)](
            q, q_pos.reshape(B).contiguous(), t[0], t[1], t[2], t[3], t[4], t[5], o, lse, float(scale), int(window or 0), table.pages, n,
            q.stride(0), q.stride(1), q.stride(3), o.stride(1), o.stride(2), o.stride(0), lse.stride(1),
            lse.stride(2), lse.stride(0),
            G=G, BG=_pow2(G, 16), D=D, BD=_pow2(D, 16), BN=TILE, WINDOW=window is not None,
            IEEE=q.dtype == torch.float32)
        out, l = merge_states(o.unsqueeze(3), lse.unsqueeze(3))
        return out.to(q.dtype), l
