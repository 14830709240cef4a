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
import logging
import os
from typing import Optional

import torch

from magnetar.ops.merge import merge_states
from magnetar.ops.pointers import K, K_HEAD, N, POS, V, V_HEAD, PointerTable

log = logging.getLogger(__name__)

TILE = 64  # keys per step of a program's loop
MAX_SPLITS = 32


@functools.lru_cache(maxsize=1)
def _kernel():
    """The jitted kernel (Triton imported on first use: importing Magnetar never imports it)."""
    import triton
    import triton.language as tl

    @triton.jit
    def decode_pages(Q, QPOS, KT, VT, PT, NT, KH, VH, O, L, scale, window, nsplit,
                     sqb, sqh, sqd, sob, soh, sos, slb, slh, sls,
                     G: tl.constexpr, BG: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
                     WINDOW: tl.constexpr, IEEE: tl.constexpr, POSITIONS: tl.constexpr, PAGES: tl.constexpr):
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
        # the non-finite rule (magnetar.ops.nonfinite): +-inf counts as NaN in q and in a key the row sees
        qbad = tl.max(((q != q) | (tl.abs(q.to(tl.float32)) == float("inf"))).to(tl.int32), 1) > 0
        seen = 0  # keys this program's rows see
        m = tl.full([BG], float("-inf"), tl.float32)
        total = tl.zeros([BG], tl.float32)
        acc = tl.zeros([BG, BD], tl.float32)
        for p in tl.static_range(PAGES):  # a row's pieces (a table's width: a constant of the kernel)
            at = b * PAGES + p
            n = tl.load(NT + at)
            per = tl.cdiv(tl.cdiv(n, nsplit), BN) * BN
            lo = s * per
            hi = tl.minimum(lo + per, n)
            kb = tl.load(KT + at).to(tl.pointer_type(Q.dtype.element_ty))
            vb = tl.load(VT + at).to(tl.pointer_type(Q.dtype.element_ty))
            kh = tl.load(KH + at)
            vh = tl.load(VH + at)
            for start in range(lo, hi, BN):
                keys = start + tl.arange(0, BN)
                kmask = keys < hi
                vis = kmask
                if POSITIONS:  # else every key is visible (an eager step's pages)
                    pb = tl.load(PT + at).to(tl.pointer_type(tl.int64))
                    kpos = tl.load(pb + keys, mask=kmask, other=0)
                    vis = vis & (kpos <= qp)
                    if WINDOW:
                        vis = vis & (kpos > qp - window)
                k = tl.load(kb + h * kh + keys[:, None] * D + dd[None, :], mask=kmask[:, None] & dmask[None, :],
                            other=0.0)
                if IEEE:
                    sc = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    sc = tl.dot(q, tl.trans(k))
                kbad = tl.max(((k != k) | (tl.abs(k.to(tl.float32)) == float("inf"))).to(tl.int32), 1) > 0
                sc = tl.where(vis[None, :], sc * scale, float("-inf"))
                sc = tl.where((vis & kbad)[None, :], float("nan"), sc)
                seen += tl.sum(vis.to(tl.int32), 0)
                m_new = tl.maximum(m, tl.max(sc, 1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m - m_use)
                pr = tl.exp(sc - m_use[:, None])
                total = total * alpha + tl.sum(pr, 1)
                # a key the row does not see is not read: its value, even NaN, reaches nothing (0 * NaN)
                v = tl.load(vb + h * vh + keys[:, None] * D + dd[None, :], mask=vis[:, None] & dmask[None, :],
                            other=0.0)
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
                m = m_new
        safe = tl.where(total == 0, 1.0, total)  # a NaN total stays NaN
        out = acc / safe[:, None]
        vbad = tl.max(((out != out) | (tl.abs(out) == float("inf"))).to(tl.int32), 1) > 0  # a non-finite value:
        out = tl.where(vbad[:, None], float("nan"), out)  # the whole row NaN
        lse = m + tl.log(safe)
        out = tl.where(qbad[:, None], float("nan"), out)
        lse = tl.where(qbad, float("nan"), lse)
        out = tl.where(seen > 0, out, 0.0)  # a row seeing no key: (0, -inf), whatever q holds
        lse = tl.where(seen > 0, lse, float("-inf"))
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

    def __init__(self):
        self._tables: dict = {}  # pages_forward's tables, by (rows, pages, KV heads, device)
        self._pages_broken: Optional[str] = None
        from magnetar.ops.pages import PageByPage

        self._by_page = PageByPage("auto")

    def validate(self, call) -> list[str]:
        return ["serves only decode steps' paged calls and pointer tables (magnetar.ops.pages, magnetar.ops.pointers)"]

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
        if kind == "cuda" and not torch.cuda.is_available():
            return "no CUDA device here (torch.cuda.is_available() is False)"
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
        return self._launch(q, q_pos, table, layer, scale, window, positions=True)

    def pages_forward(self, q, pages, scale: float):
        """An eager decode step's batch in one launch (:mod:`magnetar.ops.pages`' contract: row b over its
        ``pages[b]``, every key visible, one softmax): the pages' addresses written into a table of this call's
        shape (kept for the next call of that shape; the copy to the card queued, no wait) and read by the kernel
        with no positions. The kernel applies :mod:`magnetar.ops.nonfinite`'s rule itself (+-inf or NaN in q or a
        key: the row NaN; in a value: its output NaN), so nothing is read back to check; None -- the caller's
        per-part path -- for a call it cannot take (more than one query token, pages of another dtype, device or
        head count, no page at all). A kernel that fails (one that does not build or launch on this card; not out of
        memory) is said once and its calls go page by page (:class:`~magnetar.ops.pages.PageByPage`) from then on."""
        if self._pages_broken is not None:
            return self._by_page.pages_forward(q, pages, scale)
        B, Hq, S, D = q.shape
        rows = [[p for p in request if p.k.shape[2]] for request in pages]
        first = next((p for r in rows for p in r), None)
        if S != 1 or first is None:
            return None
        hkv = first.k.shape[1]
        if any(p.k.shape[1] != hkv or p.k.dtype != q.dtype or p.v.dtype != q.dtype or p.k.device != q.device
               for r in rows for p in r):
            return None
        width = max(len(r) for r in rows)
        key = (B, width, hkv, q.device)
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = PointerTable(1, B, width, hkv, q.device)
        nowhere = torch.zeros(1, dtype=torch.long)  # no positions are read: every key is visible
        table.fill([[(p.k, p.v, nowhere) for p in r] for r in rows])
        table.sync()
        try:
            return self._launch(q, torch.zeros(B, dtype=torch.long, device=q.device), table, 0, scale, None,
                                positions=False)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - the kernel failed on this card: say why once, go page by page
            self._pages_broken = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            log.warning("triton_decode: the eager step's paged kernel failed (%s); its calls go page by page",
                        self._pages_broken)
            return self._by_page.pages_forward(q, pages, scale)
        finally:
            table.forget()  # the launch is queued: freed tensors are reused only by later work on its stream

    def _launch(self, q, q_pos, table, layer: int, scale: float, window: Optional[int], positions: bool):
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
            q, q_pos.reshape(B).contiguous(), t[K], t[V], t[POS], t[N], t[K_HEAD], t[V_HEAD], o, lse, float(scale),
            int(window or 0), n,
            q.stride(0), q.stride(1), q.stride(3), o.stride(1), o.stride(2), o.stride(0), lse.stride(1),
            lse.stride(2), lse.stride(0),
            G=G, BG=_pow2(G, 16), D=D, BD=_pow2(D, 16), BN=TILE, WINDOW=window is not None,
            IEEE=q.dtype == torch.float32, POSITIONS=positions, PAGES=table.pages)
        out, l = merge_states(o.unsqueeze(3), lse.unsqueeze(3))
        return out.to(q.dtype), l
