"""Fast CPU backend: torch's fused flash-attention kernel for CPU, which also returns the log-sum-exp.

``aten::_scaled_dot_product_flash_attention_for_cpu`` handles GQA natively and takes an additive float
mask, but (a) it returns ``lse = 0`` and ``out = 0`` for rows with no visible key (the front end rewrites
those rows to ``-inf``), (b) it crashes on ``Sk = 0`` (the front end never sends that), (c) a float
mask costs ``Sq x Sk`` memory, and (d) it handles NaN inconsistently (``lse = 0`` for a NaN query; a NaN
key poisons masked rows or vanishes under ``is_causal``): the front end applies the non-finite rule
(:mod:`magnetar.ops.nonfinite`). So masks are avoided where the structure allows:

* FULL: no mask (a few query rows per KV head laid out as rows of one head: each KV head read once);
* bottom-right causal with ``Sq == Sk``: the kernel's own ``is_causal``;
* bottom-right causal with ``Sq < Sk``: the visible prefix ``[0, Sk-Sq)`` without a mask, merged with the
  causal ``Sq x Sq`` square;
* general positions: query chunks with a float mask of at most ``_MASK_BUDGET`` elements each, and, when the
  key positions are sorted, each chunk only reads keys up to its last visible one.

In reduced precision the kernel runs the keys past the last multiple of 16 one at a time: a bf16 call of 975
query rows (SmolLM2's 9 heads over 3) took 1.2 ms over 47 keys and 0.4-0.55 over 16 or 48, and a 975-token causal
square 3-17 % longer than with its keys padded to 976 (the Intel AMX VM, two threads; docs/results.md, "Two more
pieces of a query forward"). So a bf16 / fp16 call of at least ``_PAD_MIN_ROWS`` query rows over at most
``_PAD_MAX_KEYS`` keys gets its keys padded with zeros to the next multiple of :data:`_KEY_BLOCK`: under
``is_causal`` (top-left, Sq <= Sk) no row reaches a key past Sk; without a mask a ``-inf`` mask row over the padding
(one row, broadcast) keeps them out.
The result is the same attention, up to the kernel's rounding.
"""
from __future__ import annotations

import os

import torch

from magnetar.ops.call import CAUSAL_BOTTOM_RIGHT, FULL
from magnetar.ops.merge import merge_states

_MASK_BUDGET = int(os.environ.get("MAGNETAR_CPU_MASK_BUDGET", str(1 << 23)))  # 8M floats = 32 MiB per chunk
_KERNEL = None
_GROUPED_ROWS = 64  # the most query rows (query heads per KV head x query tokens) a grouped call lays out
_KEY_BLOCK = 16  # the kernel's fast key block in reduced precision (module docstring)
_PAD_MIN_ROWS = 16  # fewer query rows than this: the padding's copy of the keys costs more than the tail
_PAD_MAX_KEYS = 2048  # more keys than this: the tail is a small part of the call (4095 keys: no gain measured)


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return _KERNEL


def _run(q, k, v, scale, *, causal=False, mask=None):
    Sq, Sk = q.shape[2], k.shape[2]
    if (mask is None and Sk % _KEY_BLOCK and q.dtype in (torch.bfloat16, torch.float16) and Sq >= _PAD_MIN_ROWS
            and Sk <= _PAD_MAX_KEYS and (not causal or Sq <= Sk)):
        k, v, mask = _padded(k, v, q, causal)
    out, lse = _kernel()(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return out, lse.float()


def _padded(k, v, q, causal):
    """``k`` and ``v`` with zero keys appended up to the next multiple of :data:`_KEY_BLOCK`, and the mask that keeps
    every row off them: None under ``is_causal`` (top-left: row i < Sq <= Sk reads keys up to i), else one ``-inf``
    row over the padding broadcast to every query row."""
    B, H, Sk, D = k.shape
    pad = -Sk % _KEY_BLOCK
    k = torch.cat((k, k.new_zeros(B, H, pad, D)), 2)
    v = torch.cat((v, v.new_zeros(B, H, pad, v.shape[3])), 2)  # its own head size (it may differ from k's)
    if causal:
        return k, v, None
    row = torch.zeros(1, 1, 1, Sk + pad, dtype=q.dtype, device=q.device)
    row[..., Sk:] = float("-inf")
    return k, v, row.expand(1, 1, q.shape[2], Sk + pad)


def _run_grouped(q, k, v, scale):
    """A mask-free call whose few query rows share each KV head (GQA decode): the kernel maps each query head
    to its KV head and streams that head's keys and values once per query head; with the G query heads of a group
    laid out as G x Sq rows of one head, each KV head is read once (15 % less time for a 4K decode call, SmolLM2's
    G = 3, on one core). Rows are independent without a mask, so the result is the same."""
    B, Hq, Sq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    if G == 1 or Sq * G > _GROUPED_ROWS:
        return _run(q, k, v, scale)
    out, lse = _run(q.reshape(B, Hkv, G * Sq, D), k, v, scale)
    return out.reshape(B, Hq, Sq, D), lse.reshape(B, Hq, Sq)


class CpuFlashBackend:
    name = "cpu_flash"
    device_types = ("cpu",)

    def validate(self, call) -> list[str]:
        reasons = []
        if call.q.device.type != "cpu":
            reasons.append(f"needs CPU tensors, got {call.q.device}")
        if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
            reasons.append(f"torch {torch.__version__} has no _scaled_dot_product_flash_attention_for_cpu")
        return reasons

    def forward(self, call):
        q, k, v, scale = call.q, call.k, call.v, call.scale
        Sq, Sk = q.shape[2], k.shape[2]
        if call.mask_kind == FULL:
            return _run_grouped(q, k, v, scale)
        if call.mask_kind == CAUSAL_BOTTOM_RIGHT:
            if Sq == Sk:
                return _run(q, k, v, scale, causal=True)
            p = Sk - Sq
            o1, l1 = _run_grouped(q, k[:, :, :p], v[:, :, :p], scale)
            o2, l2 = _run(q, k[:, :, p:], v[:, :, p:], scale, causal=True)
            return merge_states(torch.stack((o1, o2)), torch.stack((l1, l2)))  # the fused op where it built
        return self._positions(call)

    def _positions(self, call):
        q, k, v = call.q, call.k, call.v
        B, Hq, Sq, D = q.shape
        Sk = k.shape[2]
        mask_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        kp1 = call.k_pos if call.k_pos.dim() == 1 else None
        sorted_keys = kp1 is not None and bool((kp1[1:] >= kp1[:-1]).all())
        rows = max(1, min(Sq, _MASK_BUDGET
                          // max(1, Sk * (B if call.q_pos.dim() == 2 or call.k_pos.dim() == 2 else 1))))
        outs, lses = [], []
        for r0 in range(0, Sq, rows):
            qc = q[:, :, r0 : r0 + rows]
            qp = call.q_pos[..., r0 : r0 + rows]
            begin, end = 0, Sk
            if sorted_keys:
                # keys after the chunk's largest query position are invisible to the whole chunk, and with a
                # sliding window so are keys at or before its smallest query position minus the window
                end = int(torch.searchsorted(kp1, qp.max(), right=True))
                if call.window is not None:
                    begin = min(end, int(torch.searchsorted(kp1, qp.min() - call.window, right=True)))
            if end == begin:
                outs.append(torch.zeros_like(qc))
                lses.append(torch.full(qc.shape[:3], float("-inf"), device=q.device))
                continue
            kp = call.k_pos[..., begin:end]
            vis = call.visible(q_pos=qp, k_pos=kp)  # (1|B, 1, rows, end - begin)
            mask = torch.zeros(vis.shape, dtype=mask_dtype, device=q.device).masked_fill_(~vis, float("-inf"))
            o, l = _run(qc, k[:, :, begin:end], v[:, :, begin:end], call.scale, mask=mask)
            outs.append(o)
            lses.append(l)
        return torch.cat(outs, dim=2), torch.cat(lses, dim=2)
