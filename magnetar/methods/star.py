"""Star Attention's Phase 1 (``../shared/papers``): every block but the first is prefixed with the anchor
block (the context's first ``anchor_size`` tokens, at their own positions); the rank keeps the block's KV.

``halo_size`` W (Magnetar's option, issue 30): the prefix also holds the W tokens just before the block, at their
own positions -- what a block encoded alone misses most is the text it continues. The prefix is the sorted union
of anchor and halo (each token once). W 0 is Star; a prefix reaching back to the context's start is dense Phase 1.
``halo_blocks`` f gives W as a fraction of the request's block size (W = round(f x block), f <= 1), so one setting
fits every context length, where a token count must be at most the shortest context's block.

``exact_layers`` (hybrid layers, Star's and Pulsar's option, issue 30): in those layers the block attends exactly
to every earlier block (:mod:`magnetar.methods.local`).
"""
from __future__ import annotations

import torch

from magnetar.config import EngineConfig
from magnetar.engine.plan import RankPlan, Segment, covers_ranks, my_blocks, resolve_block_size
from magnetar.methods.local import LocalMethod, exact_label, exact_problems


class StarMethod(LocalMethod):
    name = "star"

    def validate(self, config: EngineConfig, context_len: int) -> list[str]:
        return (covers_ranks(config, context_len) or halo_problems(config, context_len)
                or exact_problems(config, context_len))

    def label_options(self, config: EngineConfig) -> list[str]:
        b = config.blocks
        out = [f"block {b.block_size}"] if b.block_size is not None else []
        out += [f"anchor {b.anchor_size}"] if b.anchor_size is not None else []
        return out + halo_label(config) + exact_label(config)

    def plan(self, config: EngineConfig, context_ids: torch.Tensor, cp_rank: int) -> RankPlan:
        L = int(context_ids.numel())
        bounds, mine = my_blocks(config, L, cp_rank)
        segments = [star_segment(config, bounds, i) for i in mine]
        return RankPlan(cp_rank, [bounds[i] for i in mine], segments, query_position=L)


def halo_problems(config: EngineConfig, context_len: int) -> list[str]:
    """Why this request's halo cannot apply (Star's and Pulsar's check): a fixed ``halo_size`` longer than a block."""
    halo = config.blocks.halo_size
    if halo:
        block = resolve_block_size(config, context_len)
        if halo > block:
            return [f"halo_size ({halo}) exceeds the block size ({block} tokens for this {context_len}-token "
                    f"context): lower --halo-size to at most {block}, or give it relative to the block with "
                    f"--halo-blocks (a longer reach is the anchor's or the summaries' job)"]
    return []


def halo_label(config: EngineConfig) -> list[str]:
    """The halo's part of a run's label (``halo 500``, ``halo 1 block``; nothing without a halo)."""
    b = config.blocks
    out = [f"halo {b.halo_size}"] if b.halo_size else []
    return out + ([f"halo {b.halo_blocks:g} block{'s' if b.halo_blocks != 1 else ''}"] if b.halo_blocks else [])


def halo_tokens(config: EngineConfig, bounds: list[tuple[int, int]]) -> int:
    """The halo W in tokens for this request: ``halo_size``, or ``halo_blocks`` x the block size (the first
    block's length, as the anchor's default)."""
    b = config.blocks
    if b.halo_blocks:
        return round(b.halo_blocks * (bounds[0][1] - bounds[0][0]))
    return b.halo_size


def star_segment(config: EngineConfig, bounds: list[tuple[int, int]], i: int) -> Segment:
    """Block ``i`` as ``[anchor ∪ halo ‖ block]`` (block 0 has no prefix; the prefix never overlaps the block)."""
    s, e = bounds[i]
    block = torch.arange(s, e)
    anchor_size = config.blocks.anchor_size
    if anchor_size is None:
        anchor_size = bounds[0][1] - bounds[0][0]
    prefix = torch.arange(min(anchor_size, s))
    halo = halo_tokens(config, bounds)
    if halo and s:
        prefix = torch.unique(torch.cat((prefix, torch.arange(max(0, s - halo), s))), sorted=True)
    idx = torch.cat((prefix, block))
    return Segment(idx, idx.clone(), slice(prefix.numel(), None), i, block_offset=prefix.numel())
