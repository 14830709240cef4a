"""Pulsar Attention's Phase 1: ``[sink ‖ Σ_0 … Σ_{i-1} ‖ B_i]`` for every block i of this rank.

The selection (IDF table of Eq. 2, chunk scores, top-k chunks, de-duplicated prefix, positions and the query
offset of App. E) is :func:`magnetar.methods.summaries.plan_pulsar`, computed identically on every rank from
the token ids alone (no communication). This module only turns this rank's blocks into segments: the
model input, its positions and the slice whose KV is kept (the block alone when ``discard_summary_kv``).
"""
from __future__ import annotations

import torch

from magnetar.config import EngineConfig, PulsarConfig
from magnetar.engine.plan import RankPlan, Segment, assign_blocks, block_bounds, covers_ranks, my_blocks, \
    resolve_block_size
from magnetar.methods.local import LocalMethod
from magnetar.methods.summaries import num_chunks, num_summary_chunks, plan_pulsar, prefix_positions, pulsar_prefix


class PulsarMethod(LocalMethod):
    name = "pulsar"

    def validate(self, config: EngineConfig, context_len: int) -> list[str]:
        return covers_ranks(config, context_len)

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
        return out

    def cost_assumptions(self, config: EngineConfig, with_ids: bool) -> list[str]:
        if with_ids:
            return []
        return ["pulsar summaries assumed not to overlap the sink (Eq. 4 upper bound)"
                if config.pulsar.scorer != "even" else "pulsar even scorer: exact"]

    def plan(self, config: EngineConfig, context_ids: torch.Tensor, cp_rank: int) -> RankPlan:
        bounds, mine = my_blocks(config, int(context_ids.numel()), cp_rank)
        segments, query_position = pulsar_segments(config, context_ids, bounds, mine)
        return RankPlan(cp_rank, [bounds[i] for i in mine], segments, query_position=query_position)

    def plan_for_length(self, config: EngineConfig, context_len: int, cp_rank: int) -> RankPlan:
        """Without token ids the summaries are unknown: with the ``even`` scorer they depend on the length only
        (exact); otherwise they are placed to avoid the sink, which gives the largest de-duplicated prefix
        (Eq. 4's upper bound) -- the cost model's assumption."""
        if config.pulsar.scorer == "even":
            return self.plan(config, torch.zeros(context_len, dtype=torch.long), cp_rank)
        L, pc = context_len, config.pulsar
        bounds = block_bounds(L, resolve_block_size(config, L))
        summaries = []
        for j, (s, e) in enumerate(bounds):
            n = e - s
            k = num_summary_chunks(n, pc.chunk_size, pc.summary_budget)
            chunks = list(range(num_chunks(n, pc.chunk_size)))
            if j == 0:  # prefer chunks past the sink, then the rest: the largest de-duplicated prefix
                past = [c for c in chunks if c * pc.chunk_size >= min(pc.sink_size, n)]
                chunks = past + [c for c in chunks if c not in past]
            chosen = sorted(chunks[:k])
            idx = torch.cat([torch.arange(c * pc.chunk_size, min((c + 1) * pc.chunk_size, n)) for c in chosen])
            summaries.append(idx + s)
        mine = assign_blocks(len(bounds), config.parallel.cp_size)[cp_rank]
        segments, lengths = [], []
        for i, (s, e) in enumerate(bounds):
            prefix = pulsar_prefix(L, bounds, i, summaries, pc.sink_size)
            ppos, bpos = prefix_positions(prefix, s, e - s, mode=pc.positions)
            lengths.append(prefix.numel() + e - s)
            if i in mine:
                off = prefix.numel()
                keep = slice(off, None) if pc.discard_summary_kv else slice(None)
                segments.append(Segment(torch.cat((prefix, torch.arange(s, e))), torch.cat((ppos, bpos)), keep, i, off))
        qpos = L if pc.positions == "sparse" else max(lengths)
        return RankPlan(cp_rank, [bounds[i] for i in mine], segments, query_position=qpos)


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
