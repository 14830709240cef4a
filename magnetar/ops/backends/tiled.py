"""Tiled pure-torch backend: online softmax over key tiles, memory bounded by ``rows x tile`` scores.

The portable fallback for GPUs without flash-attn (and any other device): scores are formed per key tile in
float32 and folded into a running ``(out, lse)`` with the same stable merge as
:func:`magnetar.ops.merge.merge_states_torch`. Key tiles that lie entirely in the future of every query in
the row chunk are skipped when the key positions are sorted.
"""
from __future__ import annotations

import os

import torch

from magnetar.ops.backends.reference import attend_block, fold_gqa, fold_positions, unfold_gqa
from magnetar.ops.call import FULL
from magnetar.ops.merge import merge_states_torch

# Score elements per tile step (rows x keys x heads); 2**24 float32 = 64 MiB of scores.
_SCORE_BUDGET = int(os.environ.get("MAGNETAR_TILED_SCORE_BUDGET", str(1 << 24)))


class TiledBackend:
    name = "tiled"
    device_types = None

    def validate(self, call) -> list[str]:
        return []

    def forward(self, call):
        q, k, v = call.q, call.k, call.v
        B, Hq, Sq, D = q.shape
        Hkv, Sk = k.shape[1], k.shape[2]
        qf = fold_gqa(q, Hkv)  # (B, Hkv, M, D)
        M = qf.shape[2]
        qpos = fold_positions(call.q_pos, call.group)
        per_row = B * Hkv
        tile = max(64, min(Sk, _SCORE_BUDGET // max(1, per_row * min(M, 1024))))
        rows = max(1, min(M, _SCORE_BUDGET // max(1, per_row * tile)))
        kpos_1d = call.k_pos if call.k_pos.dim() == 1 else None
        sorted_keys = kpos_1d is not None and bool((kpos_1d[1:] >= kpos_1d[:-1]).all())

        outs, lses = [], []
        for r0 in range(0, M, rows):
            qr = qf[:, :, r0 : r0 + rows]
            qp = qpos[..., r0 : r0 + rows]
            acc_o = torch.zeros(B, Hkv, qr.shape[2], D, dtype=torch.float32, device=q.device)
            acc_l = torch.full((B, Hkv, qr.shape[2]), float("-inf"), dtype=torch.float32, device=q.device)
            qmax = int(qp.max()) if (sorted_keys and call.mask_kind != FULL) else None
            for t0 in range(0, Sk, tile):
                kp = call.k_pos[..., t0 : t0 + tile]
                if qmax is not None and int(kp[0]) > qmax:
                    break  # sorted keys: this and every later tile is in the future of all rows
                vis = None if call.mask_kind == FULL else call.visible(q_pos=qp, k_pos=kp)
                o, l = attend_block(qr, k[:, :, t0 : t0 + tile], v[:, :, t0 : t0 + tile], call.scale, vis)
                acc_o, acc_l = merge_states_torch(torch.stack((acc_o, o)), torch.stack((acc_l, l)))
            outs.append(acc_o)
            lses.append(acc_l)
        out = torch.cat(outs, dim=2)
        lse = torch.cat(lses, dim=2)
        return unfold_gqa(out, Hq).to(q.dtype), unfold_gqa(lse, Hq).float()
