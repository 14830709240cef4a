"""Pure-torch reference backend: the whole score matrix in float32, any device, any mask.

Also holds the GQA folding used by every torch path: the G = Hq/Hkv query heads that share a KV head are
folded into the row axis, ``q (B, Hq, Sq, D) -> (B, Hkv, G*Sq, D)``, so K/V are never repeated in memory.
"""
from __future__ import annotations

from typing import Optional

import torch

from magnetar.ops.call import FULL
from magnetar.ops.pointers import pointer_attention
from magnetar.ops.slots import slot_attention


def fold_gqa(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """``(B, Hq, Sq, D) -> (B, Hkv, G*Sq, D)``; rows ordered (g, i) so head h = kv*G + g."""
    B, Hq, Sq, D = q.shape
    return q.reshape(B, hkv, (Hq // hkv) * Sq, D)


def unfold_gqa(x: torch.Tensor, hq: int) -> torch.Tensor:
    """Inverse of :func:`fold_gqa` for outputs ``(B, Hkv, G*Sq, *rest)`` -> ``(B, Hq, Sq, *rest)``."""
    B, Hkv, GS = x.shape[:3]
    return x.reshape(B, hq, GS * Hkv // hq, *x.shape[3:])


def fold_positions(q_pos: torch.Tensor, group: int) -> torch.Tensor:
    """Query positions for the folded rows: ``(Sq,) -> (G*Sq,)``, ``(B, Sq) -> (B, G*Sq)``."""
    return q_pos.repeat(group) if q_pos.dim() == 1 else q_pos.repeat(1, group)


def attend_block(
    qf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, visible: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of folded queries ``(B, Hkv, M, D)`` over ``k, v (B, Hkv, N, D)`` in float32.

    ``visible``: bool broadcastable to ``(B, Hkv, M, N)`` or None (all visible).
    Returns ``out (B, Hkv, M, D)`` and ``lse (B, Hkv, M)`` in float32 (float64 for float64 inputs);
    empty rows ``(0, -inf)``.
    """
    acc = torch.float64 if qf.dtype == torch.float64 else torch.float32
    s = torch.matmul(qf.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(dim=-1)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m_safe.unsqueeze(-1))
    z = p.sum(dim=-1)
    empty = z == 0  # not `z > 0`: a NaN row (NaN in q or a visible key) must stay NaN, never look empty
    out = torch.matmul(p, v.to(acc)) / torch.where(empty, torch.ones_like(z), z).unsqueeze(-1)
    lse = torch.where(empty, torch.full_like(z, float("-inf")), m_safe + torch.log(z))
    return out, lse


class ReferenceBackend:
    name = "torch"
    device_types = None

    @staticmethod
    def slot_forward(q, k, v, q_pos, k_pos, scale, window=None):
        """The decode step's kernel (:func:`magnetar.ops.slots.slot_attention`: float32 math)."""
        return slot_attention(q, k, v, q_pos, k_pos, scale, window)

    @staticmethod
    def pointers_forward(q, q_pos, table, layer, scale, window=None):
        """A decode step's context part through a pointer table (:func:`magnetar.ops.pointers.pointer_attention`:
        float32 math over the pieces the table's host side holds)."""
        return pointer_attention(q, q_pos, table, layer, scale, window)

    def validate(self, call) -> list[str]:
        return []

    def forward(self, call):
        hkv = call.k.shape[1]
        qf = fold_gqa(call.q, hkv)
        visible = None
        if call.mask_kind != FULL:
            visible = call.visible(q_pos=fold_positions(call.q_pos, call.group))
        out, lse = attend_block(qf, call.k, call.v, call.scale, visible)
        hq = call.q.shape[1]
        return unfold_gqa(out, hq).to(call.q.dtype), unfold_gqa(lse, hq).float()
