"""Pulsar Attention's Phase 1: ``[sink ‖ Σ_0 … Σ_{i-1} ‖ B_i]`` for every block i of this rank.

The selection (IDF table of Eq. 2, chunk scores, top-k chunks, de-duplicated prefix, positions and the query
offset of App. E) is :func:`magnetar.methods.summaries.plan_pulsar`, computed identically on every rank from
the token ids alone (no communication). This module only turns this rank's blocks into segments: the
model input, its positions and the slice whose KV is kept (the block alone when ``discard_summary_kv``).
"""
from __future__ import annotations

import torch

from magnetar.config import EngineConfig
from magnetar.engine.plan import RankPlan, Segment, covers_ranks, my_blocks
from magnetar.methods.local import LocalMethod
from magnetar.methods.summaries import plan_pulsar


class PulsarMethod(LocalMethod):
    name = "pulsar"

    def validate(self, config: EngineConfig, context_len: int) -> list[str]:
        return covers_ranks(config, context_len)

    def plan(self, config: EngineConfig, context_ids: torch.Tensor, cp_rank: int) -> RankPlan:
        bounds, mine = my_blocks(config, int(context_ids.numel()), cp_rank)
        segments, query_position = pulsar_segments(config, context_ids, bounds, mine)
        return RankPlan(cp_rank, [bounds[i] for i in mine], segments, query_position=query_position)


def pulsar_segments(config: EngineConfig, context_ids: torch.Tensor, bounds: list[tuple[int, int]],
                    mine: list[int]) -> tuple[list[Segment], int]:
    """This rank's segments and the RoPE position of the first query token."""
    pc = config.pulsar
    plan = plan_pulsar(context_ids, bounds, chunk_size=pc.chunk_size, budget=pc.summary_budget, scorer=pc.scorer,
                       sink_size=pc.sink_size, position_mode=pc.positions)
    segments = []
    for i in mine:
        blk = plan.blocks[i]
        offset = blk.prefix_len
        keep = slice(offset, None) if pc.discard_summary_kv else slice(None)
        segments.append(Segment(blk.input_indices, blk.input_positions, keep, i, block_offset=offset))
    return segments, plan.query_start
