"""``oracle_topk``: the exact top-k by attention -- softmax(q k / sqrt(d)) summed over the group's query heads (for
one query head per KV head the top-k of q.k, the Spotlight paper's oracle, App. A.2). The upper bound of a budget."""
from __future__ import annotations

import torch

from magnetar.engine.kv import LayerKV
from magnetar.sparse.select import SparseSelector


class OracleTopK(SparseSelector):
    def scores(self, layer: int, q: torch.Tensor, kv: LayerKV, scale: float) -> torch.Tensor:
        Hkv, D = kv.k.shape[1], kv.k.shape[3]
        S = q.shape[2]
        logits = torch.einsum("hgsd,hnd->hgsn", q[0].reshape(Hkv, -1, S, D).float(), kv.k[0].float()) * scale
        return torch.softmax(logits, dim=-1).sum(1)  # (Hkv, S, N): attention mass of the group
