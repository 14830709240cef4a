"""Pulsar Attention's Phase 1: ``[sink ‖ Σ_0 … Σ_{i-1} ‖ B_i]`` for every block i of this rank.

With a halo (``halo_size`` / ``halo_blocks``, Magnetar's option as Star's, issue 30) the prefix also holds the
tokens just before the block: ``[sink ∪ Σ_0 … Σ_{i-1} ∪ halo ‖ B_i]``, each token once.

The selection (IDF table of Eq. 2, chunk scores, top-k chunks, de-duplicated prefix, positions and the query
offset of App. E) is :func:`magnetar.methods.summaries.plan_pulsar`, computed identically on every rank from
the token ids alone (no communication). This module only turns this rank's blocks into segments: the
model input, its positions and the slice whose KV is kept (the block alone when ``discard_summary_kv``).
"""
from __future__ import annotations

import torch

from magnetar.config import EngineConfig, PulsarConfig
from magnetar.engine.plan import RankPlan, Segment, covers_ranks, my_blocks
from magnetar.methods.local import LocalMethod, exact_label, exact_problems
from magnetar.methods.star import halo_label, halo_problems, halo_tokens
from magnetar.methods.summaries import plan_pulsar


class PulsarMethod(LocalMethod):
    name = "pulsar"

    def validate(self, config: EngineConfig, context_len: int) -> list[str]:
        return (covers_ranks(config, context_len) or halo_problems(config, context_len)
                or exact_problems(config, context_len))

    def label_options(self, config: EngineConfig) -> list[str]:
        """The block size when set, then every Pulsar option that differs from its default."""
        p, d = config.pulsar, PulsarConfig()
        out = [f"block {config.blocks.block_size}"] if config.blocks.block_size is not None else []
        if p.scorer != d.scorer:
            out.append(p.scorer)
        if p.summary_budget != d.summary_budget:
            out.append(f"budget {p.summary_budget:g}")
        for name in ("sink_size", "chunk_size", "positions", "discard_summary_kv"):
            if getattr(p, name) != getattr(d, name):
                out.append(f"{name} {getattr(p, name)}")
        return out + halo_label(config) + exact_label(config)

    def cost_assumptions(self, config: EngineConfig, with_ids: bool) -> list[str]:
        if with_ids:
            return []
        return ["pulsar summaries assumed not to overlap the sink (Eq. 4 upper bound)"
                if config.pulsar.scorer != "even" else "pulsar even scorer: exact"]

    def plan(self, config: EngineConfig, context_ids: torch.Tensor, cp_rank: int) -> RankPlan:
        return pulsar_plan(config, context_ids, int(context_ids.numel()), cp_rank)

    def plan_for_length(self, config: EngineConfig, context_len: int, cp_rank: int) -> RankPlan:
        """Without token ids the summaries are unknown: with the ``even`` scorer they depend on the length only
        (exact); otherwise they are placed to avoid the sink, which gives the largest de-duplicated prefix
        (Eq. 4's upper bound) -- the cost model's assumption (:func:`~magnetar.methods.summaries.plan_pulsar`)."""
        return pulsar_plan(config, None, context_len, cp_rank)


def pulsar_plan(config: EngineConfig, context_ids, context_len: int, cp_rank: int) -> RankPlan:
    """This rank's segments (model input, positions, the kept slice) and the RoPE position of the first query
    token, from the one planner of :mod:`magnetar.methods.summaries` (``context_ids`` None: without ids)."""
    pc = config.pulsar
    bounds, mine = my_blocks(config, context_len, cp_rank)
    plan = plan_pulsar(context_ids, bounds, chunk_size=pc.chunk_size, budget=pc.summary_budget, scorer=pc.scorer,
                       sink_size=pc.sink_size, position_mode=pc.positions, context_len=context_len,
                       halo=halo_tokens(config, bounds))
    segments = []
    for i in mine:
        blk = plan.blocks[i]
        offset = blk.prefix_len
        keep = slice(offset, None) if pc.discard_summary_kv else slice(None)
        segments.append(Segment(blk.input_indices, blk.input_positions, keep, i, block_offset=offset))
    return RankPlan(cp_rank, [bounds[i] for i in mine], segments, query_position=plan.query_start)
