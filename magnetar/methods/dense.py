"""Dense attention, the reference every method is measured against: one rank encodes the whole context."""
from __future__ import annotations

import torch

from magnetar.config import EngineConfig
from magnetar.engine.plan import RankPlan, Segment
from magnetar.methods.local import LocalMethod


class DenseMethod(LocalMethod):
    name = "dense"

    def plan(self, config: EngineConfig, context_ids: torch.Tensor, cp_rank: int) -> RankPlan:
        L = int(context_ids.numel())
        seg = Segment(torch.arange(L), torch.arange(L), slice(None), 0)
        return RankPlan(cp_rank, [(0, L)], [seg], query_position=L)
