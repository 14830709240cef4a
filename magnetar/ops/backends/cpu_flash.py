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
"""
from __future__ import annotations

import os

import torch

from magnetar.ops.call import CAUSAL_BOTTOM_RIGHT, FULL
from magnetar.ops.merge import merge_states_torch

_MASK_BUDGET = int(os.environ.get("MAGNETAR_CPU_MASK_BUDGET", str(1 << 23)))  # 8M floats = 32 MiB per chunk
_KERNEL = None
_GROUPED_ROWS = 64  # the most query rows (query heads per KV head x query tokens) a grouped call lays out


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return _KERNEL


def _run(q, k, v, scale, *, causal=False, mask=None):
    out, lse = _kernel()(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return out, lse.float()


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
            return merge_states_torch(torch.stack((o1, o2)), torch.stack((l1, l2)))
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
