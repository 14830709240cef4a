"""Phase-1 plan: which context tokens each rank encodes, with which prefix and positions. Pure, no model.

The block arithmetic every method shares lives here; what a method makes of the blocks is its own
:meth:`magnetar.engine.strategy.ContextMethod.plan` (``magnetar/methods/``), reached by
:func:`magnetar.engine.strategy.plan_rank`.

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

import torch

from magnetar.config import EngineConfig, FieldError


@dataclass(frozen=True)
class Segment:
    indices: torch.Tensor  # (n,) global context indices, the model input
    positions: torch.Tensor  # (n,) RoPE positions
    keep: slice  # the part whose KV this rank keeps
    block: int = -1
    block_offset: int = 0  # where the block itself starts in ``indices`` (after the prefix)


@dataclass(frozen=True)
class RankPlan:
    """Phase-1 work of one rank: one model forward per segment, in order."""

    cp_rank: int
    blocks: list[tuple[int, int]] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
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
        raise FieldError(f"block_size ({bs}, --block-size) is larger than the context ({context_len} tokens); "
                         f"use a block size <= {context_len}", "block_size")
    return bs


def my_blocks(config: EngineConfig, context_len: int, cp_rank: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Every block's bounds and the indices of ``cp_rank``'s blocks. Fewer blocks than ranks is allowed (the
    last ranks then hold no context KV and only take part in the Phase-2 merges); the default block size gives
    every rank one block."""
    bounds = block_bounds(context_len, resolve_block_size(config, context_len))
    return bounds, assign_blocks(len(bounds), config.parallel.cp_size)[cp_rank]


def covers_ranks(config: EngineConfig, context_len: int) -> list[str]:
    """A distributed method's refusal when the context has fewer tokens than there are blocks/shards."""
    cp = config.parallel.cp_size
    if context_len < cp:
        return [f"the context ({context_len} tokens) is shorter than the number of blocks/shards (cp_size {cp}): "
                f"use a longer context or a smaller --cp-size"]
    return []


def kept_in(seg: Segment) -> int:
    """Block (own) context tokens of one segment whose KV its rank keeps, its prefix not counted."""
    return seg.indices.numel() - max(seg.block_offset, seg.keep.indices(seg.indices.numel())[0])


def kept_token_count(plan: RankPlan) -> int:
    """Block (own) context tokens whose KV this rank keeps after Phase 1, prefixes not counted; summed over the
    ranks this must equal the context length (before any streaming eviction)."""
    return sum(kept_in(seg) for seg in plan.segments)
