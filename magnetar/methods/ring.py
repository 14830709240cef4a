"""Ring attention's Phase 1 (exact context parallelism): each rank's shard of the context (zigzag chunks
``r`` and ``2W-1-r`` by default, for load balance) runs one forward in which every layer's attention is
:func:`magnetar.parallel.ring_attention` over the CP group; the rank keeps all of its shard's KV."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from magnetar.config import EngineConfig
from magnetar.engine.plan import RankPlan, Segment, covers_ranks
from magnetar.engine.strategy import MethodBase, Phase1Layer
from magnetar.parallel import contiguous_indices, ring_attention, zigzag_indices


@dataclass(frozen=True)
class RingPlan(RankPlan):
    """A ring rank's plan: one segment, its shard (in the order the ring exchanges it)."""

    @property
    def ring_shard(self) -> torch.Tensor:
        return self.segments[0].indices


class RingMethod(MethodBase):
    name = "ring"
    lockstep_ranks = True  # the shards circulate: every layer exchanges KV with the neighbours

    def validate(self, config: EngineConfig, context_len: int) -> list[str]:
        return covers_ranks(config, context_len)

    def plan(self, config: EngineConfig, context_ids: torch.Tensor, cp_rank: int) -> RankPlan:
        L, cp = int(context_ids.numel()), config.parallel.cp_size
        idx = zigzag_indices(L, cp, cp_rank) if config.parallel.zigzag else contiguous_indices(L, cp, cp_rank)
        return RingPlan(cp_rank, segments=[Segment(idx, idx.clone(), slice(None), cp_rank)], query_position=L)

    def attend(self, ctx: Phase1Layer, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: Optional[int]) -> torch.Tensor:
        pos = ctx.positions
        if ctx.ring is not None:  # a simulated rank: the other ranks' shards from the lock-step forward
            out, _ = ctx.ring.attend(layer, q, k, v, q_pos=pos, k_pos=pos, scale=scale, window=window,
                                     backend=ctx.backend)
        else:
            out, _ = ring_attention(q, k, v, group=ctx.group, q_pos=pos, k_pos=pos, scale=scale, window=window,
                                    timeout=ctx.timeout, backend=ctx.backend)
        ctx.shard.layers[layer].append(k, v, pos)
        return out

    def lockstep(self, plans: list[RankPlan]) -> Optional[RankPlan]:
        """Simulated ranks: the shards exchange KV in every layer, so they run as one forward with attention
        by position over their union -- exactly what the ring computes (``parallel.rank_by_rank`` then runs each
        rank alone against the others' KV from it, for its own time)."""
        idx = torch.cat([p.segments[0].indices for p in plans])
        return RankPlan(0, [], [Segment(idx, idx.clone(), slice(None), 0)], query_position=plans[0].query_position)
