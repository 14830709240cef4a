"""``quest``: pages of ``page_size`` keys with per-channel min/max (Quest); a page's score is the upper bound of q.k
over it, sum_d max(q_d max_d, q_d min_d), max over the query group; the best ``ceil(take / page_size)`` pages."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from magnetar.engine.kv import LayerKV
from magnetar.sparse.select import SparseSelector


@dataclass
class PageBounds:
    """Per-channel max and min of every page of a shard's keys, each ``(Hkv, P, D)`` float32 (one layer's state)."""

    kmax: torch.Tensor
    kmin: torch.Tensor


class QuestSelector(SparseSelector):
    def select(self, layer: int, q: torch.Tensor, kv: LayerKV, take: int, forced: Optional[torch.Tensor],
               scale: float) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        Hkv, N, D = kv.k.shape[1], kv.k.shape[2], kv.k.shape[3]
        _, Hq, S, _ = q.shape
        G, ps = Hq // Hkv, self.cfg.page_size
        P = math.ceil(N / ps)
        bounds = kv.state.get(self.uid, PageBounds)
        if bounds is None:  # per-channel min / max of each page (a partial last page pads with its own keys)
            k = kv.k[0].float()
            pad = P * ps - N
            if pad:
                k = torch.cat((k, k[:, -1:].expand(Hkv, pad, D)), dim=1)
            k = k.reshape(Hkv, P, ps, D)
            bounds = kv.state.put(self.uid, PageBounds(k.amax(2), k.amin(2)))
        kmax, kmin = bounds.kmax, bounds.kmin
        qg = q[0].reshape(Hkv, G, S, D).float()
        # sum_d max(q_d max_d, q_d min_d) = q+ . max + q- . min (max_d >= min_d): two matmuls, no (.., P, D) tensor
        page = (torch.einsum("hgsd,hpd->hgsp", qg.clamp(min=0), kmax)
                + torch.einsum("hgsd,hpd->hgsp", qg.clamp(max=0), kmin))
        page = page.amax(1)  # (Hkv, S, P): upper bound of q.k per page, max over the group
        if forced is not None:  # pages holding a sink or window key are always taken
            fp = torch.zeros(P * ps, dtype=torch.bool, device=forced.device)
            fp[:N] = forced
            page = page.masked_fill(fp.reshape(P, ps).any(-1), float("inf"))
        n_pages = min(P, math.ceil(take / ps))
        pages = page.topk(n_pages, dim=-1).indices  # (Hkv, S, n_pages)
        idx = (pages[..., None] * ps + torch.arange(ps, device=pages.device)).reshape(Hkv, S, n_pages * ps)
        valid = idx < N
        return idx.clamp(max=N - 1), valid
