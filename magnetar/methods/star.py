"""Star Attention's Phase 1 (``../shared/papers``): every block but the first is prefixed with the anchor
block (the context's first ``anchor_size`` tokens, at their own positions); the rank keeps the block's KV."""
from __future__ import annotations

import torch

from magnetar.config import EngineConfig
from magnetar.engine.plan import RankPlan, Segment, covers_ranks, my_blocks
from magnetar.methods.local import LocalMethod


class StarMethod(LocalMethod):
    name = "star"

    def validate(self, config: EngineConfig, context_len: int) -> list[str]:
        return covers_ranks(config, context_len)

    def label_options(self, config: EngineConfig) -> list[str]:
        out = [f"block {config.blocks.block_size}"] if config.blocks.block_size is not None else []
        return out + ([f"anchor {config.blocks.anchor_size}"] if config.blocks.anchor_size is not None else [])

    def plan(self, config: EngineConfig, context_ids: torch.Tensor, cp_rank: int) -> RankPlan:
        L = int(context_ids.numel())
        bounds, mine = my_blocks(config, L, cp_rank)
        segments = [star_segment(config, bounds, i) for i in mine]
        return RankPlan(cp_rank, [bounds[i] for i in mine], segments, query_position=L)


def star_segment(config: EngineConfig, bounds: list[tuple[int, int]], i: int) -> Segment:
    """Block ``i`` as ``[anchor ‖ block]`` (block 0 has no anchor; the anchor never overlaps the block)."""
    s, e = bounds[i]
    block = torch.arange(s, e)
    anchor_size = config.blocks.anchor_size
    if anchor_size is None:
        anchor_size = bounds[0][1] - bounds[0][0]
    anchor = torch.arange(min(anchor_size, s))
    idx = torch.cat((anchor, block))
    return Segment(idx, idx.clone(), slice(anchor.numel(), None), i, block_offset=anchor.numel())
