"""Phase-1 plan: which context tokens each rank encodes, with which prefix and positions. Pure, no model.

Blocks are ``block_size`` consecutive context tokens (the last may be shorter); they are dealt to the CP
ranks in order, as evenly as possible (the first ranks take one more when they do not divide), so rank
order is context order. Worked example, context of 10 tokens, block_size 3, cp_size 2::

    blocks  [0,3) [3,6) [6,9) [9,10)      rank 0: blocks 0, 1     rank 1: blocks 2, 3

    star   (anchor_size 3): block 0 -> [0..2];  block 1 -> [0..2 ‖ 3..5] keep 3..5;  block 2 -> [0..2 ‖ 6..8] ...
    pulsar (sink 2, summaries Σ_j): block 2 -> [sink 0..1 ‖ Σ_0 ‖ Σ_1 ‖ 6..8] keep 6..8 (no token twice)
    ring   (zigzag): the context is cut in 2W chunks, rank r holds chunks r and 2W-1-r
    dense / streaming: one rank, one segment per window of tokens

Every segment is ``(indices, positions, keep)``: the global context indices fed to the model, the RoPE
position of each, and the slice whose KV the rank keeps. Kept slices over all ranks cover every context
token exactly once (:func:`kept_token_count` checks it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from magnetar.config import EngineConfig
from magnetar.parallel import contiguous_indices, zigzag_indices


@dataclass(frozen=True)
class Segment:
    indices: torch.Tensor  # (n,) global context indices, the model input
    positions: torch.Tensor  # (n,) RoPE positions
    keep: slice  # the part whose KV this rank keeps
    block: int = -1
    block_offset: int = 0  # where the block itself starts in ``indices`` (after the prefix)


@dataclass(frozen=True)
class RankPlan:
    """Phase-1 work of one rank. ``ring_shard`` is set for method ring (one ring forward over those tokens)."""

    cp_rank: int
    blocks: list[tuple[int, int]] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    ring_shard: Optional[torch.Tensor] = None
    query_position: int = 0  # RoPE position of the first query token


def block_bounds(context_len: int, block_size: int) -> list[tuple[int, int]]:
    return [(s, min(s + block_size, context_len)) for s in range(0, context_len, block_size)]


def assign_blocks(num_blocks: int, cp_size: int) -> list[list[int]]:
    """Block indices per rank, in order, near-even (the first ``num_blocks % cp_size`` ranks take one more)."""
    base, extra = divmod(num_blocks, cp_size)
    out, start = [], 0
    for r in range(cp_size):
        n = base + (1 if r < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def resolve_block_size(config: EngineConfig, context_len: int) -> int:
    """``block_size`` or its default, ceil(context / cp_size); validated against the context."""
    cp = config.parallel.cp_size
    if context_len < 1:
        raise ValueError("the context is empty: Phase 1 needs at least one context token")
    bs = config.blocks.block_size
    if bs is None:
        bs = -(-context_len // cp)
    if bs > context_len:
        raise ValueError(f"block_size ({bs}, --block-size) is larger than the context ({context_len} tokens); "
                         f"use a block size <= {context_len}")
    return bs


def plan_rank(config: EngineConfig, context_ids: torch.Tensor, cp_rank: int) -> RankPlan:
    """The Phase-1 plan of ``cp_rank`` for ``context_ids (L,)`` under ``config``."""
    L = int(context_ids.numel())
    method, cp = config.method, config.parallel.cp_size
    if L < cp and method in ("ring", "star", "pulsar"):
        raise ValueError(f"the context ({L} tokens) is shorter than the number of blocks/shards (cp_size {cp}): "
                         f"use a longer context or a smaller --cp-size")
    if method == "ring":
        idx = zigzag_indices(L, cp, cp_rank) if config.parallel.zigzag else contiguous_indices(L, cp, cp_rank)
        return RankPlan(cp_rank, ring_shard=idx, query_position=L)
    if method == "dense":
        seg = Segment(torch.arange(L), torch.arange(L), slice(None), 0)
        return RankPlan(cp_rank, [(0, L)], [seg], query_position=L)
    if method == "streaming":
        return _plan_streaming(config, L, cp_rank)

    bs = resolve_block_size(config, L)
    bounds = block_bounds(L, bs)
    # Fewer blocks than ranks is allowed (the last ranks then hold no context KV and only take part in the
    # Phase-2 merges); the default block size gives every rank one block.
    mine = assign_blocks(len(bounds), cp)[cp_rank]
    if method == "star":
        segments = [_star_segment(config, bounds, i) for i in mine]
        return RankPlan(cp_rank, [bounds[i] for i in mine], segments, query_position=L)
    if method == "pulsar":
        from magnetar.methods.pulsar import pulsar_segments

        segments, query_position = pulsar_segments(config, context_ids, bounds, mine)
        return RankPlan(cp_rank, [bounds[i] for i in mine], segments, query_position=query_position)
    raise ValueError(f"unknown method {method!r}")


def _star_segment(config: EngineConfig, bounds, i: int) -> Segment:
    s, e = bounds[i]
    block = torch.arange(s, e)
    anchor_size = config.blocks.anchor_size
    if anchor_size is None:
        anchor_size = bounds[0][1] - bounds[0][0]
    anchor = torch.arange(min(anchor_size, s))  # block 0 has no anchor; never overlap the block itself
    idx = torch.cat((anchor, block))
    return Segment(idx, idx.clone(), slice(anchor.numel(), None), i, block_offset=anchor.numel())


def _plan_streaming(config: EngineConfig, L: int, cp_rank: int) -> RankPlan:
    # StreamingLLM prefill, one window-sized chunk at a time: each chunk attends to the attention sinks, the
    # KV of the previous `window_size` tokens (already in the cache) and itself, causally.
    w = config.streaming.window_size
    segments = [Segment(torch.arange(s, min(s + w, L)), torch.arange(s, min(s + w, L)), slice(None), j)
                for j, s in enumerate(range(0, L, w))]
    return RankPlan(cp_rank, [(0, L)], segments, query_position=L)


def kept_token_count(plan: RankPlan) -> int:
    """Block (own) context tokens whose KV this rank keeps after Phase 1, prefixes not counted; summed over the
    ranks this must equal the context length (before any streaming eviction)."""
    if plan.ring_shard is not None:
        return int(plan.ring_shard.numel())
    return sum(seg.indices.numel() - max(seg.block_offset, seg.keep.indices(seg.indices.numel())[0])
               for seg in plan.segments)
