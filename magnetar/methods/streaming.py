"""The StreamingLLM baseline: one rank reads the context in ``window_size`` chunks; each chunk attends to the
attention sinks and the cached KV of the previous ``window_size`` tokens, plus itself causally. After Phase 1
the cache keeps the sinks and the last ``window_size`` context tokens only."""
from __future__ import annotations

from typing import Optional

import torch

from magnetar.config import EngineConfig
from magnetar.engine.kv import KVShard
from magnetar.engine.plan import RankPlan, Segment
from magnetar.engine.strategy import MethodBase, Phase1Layer
from magnetar.ops import attention_with_lse, merge_states


class StreamingMethod(MethodBase):
    name = "streaming"

    def plan(self, config: EngineConfig, context_ids: torch.Tensor, cp_rank: int) -> RankPlan:
        L, w = int(context_ids.numel()), config.streaming.window_size
        segments = [Segment(torch.arange(s, min(s + w, L)), torch.arange(s, min(s + w, L)), slice(None), j)
                    for j, s in enumerate(range(0, L, w))]
        return RankPlan(cp_rank, [(0, L)], segments, query_position=L)

    def begin(self, shard: KVShard) -> None:
        shard.freeze()  # chunks read the cache as they go

    def attend(self, ctx: Phase1Layer, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: Optional[int]) -> torch.Tensor:
        # The cache (a frozen store) keeps everything until Phase 1 ends; sinks and window are chosen per chunk.
        sinks, recent = ctx.config.streaming.sink_tokens, ctx.config.streaming.window_size
        pos = ctx.positions
        cache = ctx.shard.layers[layer]
        out, lse = attention_with_lse(q, k, v, q_pos=pos, k_pos=pos, scale=scale, window=window, backend=ctx.backend)
        if len(cache):
            start = int(pos[0])
            sel = (cache.pos < sinks) | (cache.pos >= start - recent)
            o2, l2 = attention_with_lse(q, cache.k[:, :, sel], cache.v[:, :, sel], q_pos=pos, k_pos=cache.pos[sel],
                                        scale=scale, window=window, backend=ctx.backend)
            out, lse = merge_states([out, o2], [lse, l2])
        cache.append(k, v, pos)
        return out

    def label_options(self, config: EngineConfig) -> list[str]:
        return [f"window {config.streaming.window_size}"]

    def visible_keys(self, config: EngineConfig, positions: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """The chunk itself, the attention sinks and the cached previous ``window_size`` tokens."""
        sinks, window = config.streaming.sink_tokens, config.streaming.window_size
        sel = seen[(seen < sinks) | (seen >= int(positions[0]) - window)]
        return torch.cat((sel, positions))

    def kept_positions(self, config: EngineConfig, kept: torch.Tensor, context_len: int) -> torch.Tensor:
        sinks, window = config.streaming.sink_tokens, config.streaming.window_size
        return kept[(kept < sinks) | (kept >= context_len - window)]

    def finish(self, shard: KVShard, config: EngineConfig, context_len: int) -> None:
        """StreamingLLM's cache after prefill: the attention sinks and the last ``window_size`` context tokens."""
        sinks, window = config.streaming.sink_tokens, config.streaming.window_size
        for layer in shard.layers:
            if layer.k is None:
                continue
            sel = (layer.pos < sinks) | (layer.pos >= context_len - window)
            layer.k, layer.v, layer.pos = (layer.k[:, :, sel].contiguous(), layer.v[:, :, sel].contiguous(),
                                           layer.pos[sel])
