"""Phase 1: encode this rank's part of the context and keep its KV shard.

Dense, Star and Pulsar run one model forward per segment of the plan (``[prefix ‖ block]`` with the
tokens' own positions) and keep the block's KV; Ring runs one forward over the rank's shard with ring
attention in every layer (all ranks in lock-step); the streaming baseline runs window-sized chunks against
its sinks and recent window and finally evicts everything else. No logits are computed (the base model
is called, not the LM head).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from magnetar.config import EngineConfig
from magnetar.engine.hf import ForwardContext
from magnetar.engine.kv import KVShard
from magnetar.engine.plan import RankPlan
from magnetar.parallel import ParallelGroups
from magnetar.utils.nvtx import nvtx_range


@dataclass
class Phase1Result:
    shard: KVShard
    seconds: float
    kept_tokens: int  # context tokens whose KV was kept (before streaming eviction)
    prefill_stats: Optional[object] = None  # sparse prefill: this rank's magnetar.prefill.PrefillStats


def _base_model(model):
    return model.get_decoder() if hasattr(model, "get_decoder") else model.base_model


@torch.inference_mode()
def run_phase1(model, config: EngineConfig, plan: RankPlan, context_ids: torch.Tensor, groups: ParallelGroups,
               device: torch.device, progress=None, track_mass: bool = False, prefill=None) -> Phase1Result:
    """Encode the plan's segments (or ring shard) of ``context_ids (L,)``; returns the frozen KV shard.
    ``track_mass``: also keep the attention mass every stored key received (LuKA; dense/Star/Pulsar only).
    ``prefill``: the engine's :class:`magnetar.prefill.PrefillPolicy` (made here from ``config.prefill`` when
    not given); the patched layers of every segment then attend sparsely, budget from the context length."""
    base = _base_model(model)
    run = None
    if prefill is None and config.prefill.prefill_policy != "none":
        from magnetar.prefill.policy import PrefillPolicy

        prefill = PrefillPolicy(config.prefill, model.config)
    if prefill is not None and plan.ring_shard is None and config.method != "streaming":
        if prefill.needs_hidden:
            from magnetar.engine.hf import capture_attention_inputs

            capture_attention_inputs(model)
        run = prefill.start(int(context_ids.numel()))
    shard = KVShard(model.config.num_hidden_layers)
    backend = config.runtime.attention_backend
    t0 = time.perf_counter()
    with nvtx_range(f"phase1/{config.method}"):
        if plan.ring_shard is not None:
            pos = plan.ring_shard.to(device)
            ctx = ForwardContext("prefill_ring", pos, shard, group=groups.cp_group, timeout=groups.timeout,
                                 backend=backend)
            base(input_ids=context_ids[plan.ring_shard].to(device)[None], position_ids=pos[None], use_cache=False,
                 magnetar=ctx)
        else:
            stream = None
            if config.method == "streaming":
                stream = (config.streaming.sink_tokens, config.streaming.window_size)
                shard.freeze()  # chunks read the cache as they go
            for seg in plan.segments:
                pos = seg.positions.to(device)
                mode = "prefill_stream" if stream else "prefill_local"
                ctx = ForwardContext(mode, pos, shard, keep=seg.keep, backend=backend, stream=stream,
                                     track_mass=track_mass and not stream, prefill=run)
                with nvtx_range(f"phase1/block{seg.block}"):
                    base(input_ids=context_ids[seg.indices].to(device)[None], position_ids=pos[None],
                         use_cache=False, magnetar=ctx)
                if progress is not None:
                    progress.update(1)
    shard.freeze()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    kept = shard.tokens()
    if config.method == "streaming":
        _evict_to_window(shard, config.streaming.sink_tokens, config.streaming.window_size, int(context_ids.numel()))
    return Phase1Result(shard, seconds, kept, None if run is None else run.stats)


def _evict_to_window(shard: KVShard, sinks: int, window: int, context_len: int) -> None:
    """StreamingLLM's cache after prefill: the attention sinks and the last ``window`` context tokens."""
    for layer in shard.layers:
        if layer.k is None:
            continue
        sel = (layer.pos < sinks) | (layer.pos >= context_len - window)
        layer.k, layer.v, layer.pos = layer.k[:, :, sel].contiguous(), layer.v[:, :, sel].contiguous(), layer.pos[sel]
