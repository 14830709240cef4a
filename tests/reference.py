"""The one dense reference every Magnetar test asserts against: plain fp64 attention over explicit positions.

Written independently of ``magnetar.ops`` on purpose (no shared helpers), so a bug in the library cannot
hide in the reference. Layouts match the library: ``q (B, Hq, Sq, D)``, ``k, v (B, Hkv, Sk, D)``.
"""
from __future__ import annotations

import math

import torch


def dense_attention_fp64(q, k, v, *, q_pos=None, k_pos=None, causal=True, scale=None):
    """fp64 attention; returns ``(out fp64 (B,Hq,Sq,D), lse fp64 (B,Hq,Sq))``; empty rows -> (0, -inf).

    Key j is visible to query i iff ``k_pos[j] <= q_pos[i]`` (when ``causal``). Positions may be 1-D
    (shared by the batch) or 2-D ``(B, S)``.
    """
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qd, kd, vd = q.double(), k.double(), v.double()
    out = torch.zeros(B, Hq, Sq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((B, Hq, Sq), float("-inf"), dtype=torch.float64)
    if k_pos is None:
        k_pos = torch.arange(Sk)
    if q_pos is None:
        q_pos = torch.arange(Sk - Sq, Sk)
    k_pos = k_pos.expand(B, Sk) if k_pos.dim() == 1 else k_pos
    q_pos = q_pos.expand(B, Sq) if q_pos.dim() == 1 else q_pos
    for b in range(B):
        for h in range(Hq):
            kv_h = h // group  # query head h reads KV head h // group (HF repeat_kv convention)
            s = (qd[b, h] @ kd[b, kv_h].T) * scale  # (Sq, Sk)
            if causal:
                visible = k_pos[b].cpu()[None, :] <= q_pos[b].cpu()[:, None]
                s = s.masked_fill(~visible, float("-inf"))
            for i in range(Sq):
                row = s[i]
                if Sk == 0 or torch.isinf(row).all():
                    continue
                m = row.max()
                p = torch.exp(row - m)
                z = p.sum()
                out[b, h, i] = (p / z) @ vd[b, kv_h]
                lse[b, h, i] = m + torch.log(z)
    return out, lse


def random_qkv(B, Hq, Hkv, Sq, Sk, D, dtype, gen, scale=1.0):
    """Seeded ``q (B, Hq, Sq, D)``, ``k, v (B, Hkv, Sk, D)`` drawn in float32 from ``gen`` (q, k scaled by
    ``scale``), then rounded to ``dtype``: the inputs the attention tests give the library and the reference."""
    q = (torch.randn(B, Hq, Sq, D, generator=gen) * scale).to(dtype)
    k = (torch.randn(B, Hkv, Sk, D, generator=gen) * scale).to(dtype)
    v = torch.randn(B, Hkv, Sk, D, generator=gen).to(dtype)
    return q, k, v
