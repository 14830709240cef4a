"""Phase 1: encode this rank's part of the context and keep its KV shard.

The driver runs one model forward per segment of the rank's plan (the method's ``[prefix ‖ block]`` inputs
with the tokens' own positions, ring's shard, streaming's chunks); in every layer the attention function
asks the method (:meth:`magnetar.engine.strategy.ContextMethod.attend`) through :class:`Phase1Context`.
No logits are computed (the base model is called, not the LM head) -- except, with ``last_logits``, for the context's
last token on the rank whose segment ends the context: then that segment runs through the LM head too, which keeps
only its last position (what a prompt's scoring needs for the first query token). This module knows no method by
name.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch

from magnetar.config import METHODS, EngineConfig
from magnetar.engine.finite import LayerFlags
from magnetar.engine.hf import capture_attention_inputs
from magnetar.engine.kv import KVShard
from magnetar.engine.plan import RankPlan, Segment
from magnetar.engine.strategy import (ContextMethod, LayerContext, PrefillPolicy, PrefillRun, SimulatedRing,
                                      context_method)
from magnetar.parallel import ParallelGroups
from magnetar.utils.nvtx import PHASE1, PHASE1_BLOCK, PHASE1_LAYER, nvtx_range


@dataclass
class Phase1Result:
    shard: KVShard
    seconds: float
    prefill_stats: Optional[object] = None  # sparse prefill: this rank's PrefillStats (see engine.strategy)
    nonfinite_layer: Optional[int] = None  # runtime.check_finite: first layer whose attention output was not finite
    last_logits: Optional[torch.Tensor] = None  # (V,) float32 on CPU: the context's last position, when asked


class Phase1Context(LayerContext):
    """The Phase-1 forward of one plan segment (see :class:`magnetar.engine.strategy.Phase1Layer`)."""

    layer_range = PHASE1_LAYER

    def __init__(self, method: ContextMethod, config: EngineConfig, segment: Segment, shard: KVShard, *,
                 group: Optional[torch.distributed.ProcessGroup], timeout: Optional[timedelta],
                 prefill: Optional[PrefillRun] = None, mass: Optional[Callable[..., torch.Tensor]] = None,
                 device: Optional[torch.device] = None, flags: Optional[LayerFlags] = None,
                 ring: Optional[SimulatedRing] = None):
        self.method, self.config, self.shard = method, config, shard
        self.ring = ring
        self.positions = segment.positions.to(device)
        self.keep = segment.keep
        self.group, self.timeout = group, timeout
        self.backend = config.runtime.attention_backend
        self.prefill, self.mass = prefill, mass
        self.wants_hidden = prefill is not None and prefill.needs_hidden
        self.hidden = None
        self.flags = flags

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: Optional[int] = None) -> torch.Tensor:
        out = self.method.attend(self, layer, q, k, v, scale, window)
        if self.flags is not None:
            self.flags.record(layer, out)
        return out


def _base_model(model):
    return model.get_decoder() if hasattr(model, "get_decoder") else model.base_model


@torch.inference_mode()
def run_phase1(model, config: EngineConfig, plan: RankPlan, context_ids: torch.Tensor, groups: ParallelGroups,
               device: torch.device, mass: Optional[Callable[..., torch.Tensor]] = None,
               prefill: Optional[PrefillPolicy] = None, ring: Optional[SimulatedRing] = None,
               last_logits: bool = False) -> Phase1Result:
    """Encode the plan's segments of ``context_ids (L,)``; returns the frozen KV shard.
    ``mass``: a decode policy's recorder of the attention mass every stored key received (LuKA), used by
    methods with a local Phase 1. ``prefill``: the engine's sparse-prefill policy (None: dense prefill); the
    patched layers of every segment then attend sparsely, budget from the context length. ``ring``: a simulated
    rank, what a ring exchange brings it (the other ranks' shards: ring's layers and hybrid layers read them).
    ``last_logits``: the logits at the context's last position too, where a segment of this rank ends the context
    (``Phase1Result.last_logits``)."""
    method = context_method(config.method)
    local = METHODS[config.method].local_prefill
    run = prefill.start(int(context_ids.numel())) if prefill is not None and local else None
    if run is not None and run.needs_hidden:
        capture_attention_inputs(model)
    mass = mass if local else None
    base = _base_model(model)
    shard = KVShard(model.config.num_hidden_layers)
    method.begin(shard)
    flags = LayerFlags(model.config.num_hidden_layers, device) if config.runtime.check_finite else None
    t0 = time.perf_counter()
    last, logits = int(context_ids.numel()) - 1, None
    with nvtx_range(PHASE1):
        for seg in plan.segments:
            ctx = Phase1Context(method, config, seg, shard, group=groups.cp_group, timeout=groups.timeout,
                                prefill=run, mass=mass, device=device, flags=flags, ring=ring)
            inputs = dict(input_ids=context_ids[seg.indices].to(device)[None], position_ids=ctx.positions[None],
                          use_cache=False, magnetar=ctx)
            with nvtx_range(PHASE1_BLOCK, i=seg.block):
                if last_logits and len(seg.indices) and int(seg.indices[-1]) == last:  # the model's own head
                    logits = model(**inputs, logits_to_keep=1).logits[0, -1].float().cpu()
                else:
                    base(**inputs)
    shard.freeze()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    method.finish(shard, config, int(context_ids.numel()))
    return Phase1Result(shard, seconds, None if run is None else run.stats,
                        None if flags is None else flags.first(), logits)


class ExtensionContext(LayerContext):
    """One rank's block of a context's new tokens, encoded over a cached prefix (:func:`run_extension`): in every
    layer its queries attend, exactly and by position, to every rank's cached shard and to every rank's block of the
    new tokens (:func:`magnetar.parallel.ring_attention` over the CP group, with this rank's cached KV joined to its
    block's), and the block's KV is kept."""

    layer_range = PHASE1_LAYER

    def __init__(self, prefix: KVShard, shard: KVShard, positions: torch.Tensor, config: EngineConfig,
                 groups: ParallelGroups, flags: Optional[LayerFlags]):
        self.prefix, self.shard, self.positions, self.flags = prefix, shard, positions, flags
        self.group, self.timeout, self.backend = groups.cp_group, groups.timeout, config.runtime.attention_backend
        self.wants_hidden, self.hidden = False, None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: Optional[int] = None) -> torch.Tensor:
        from magnetar.parallel import ring_attention

        cached = self.prefix.segments(layer)  # (a fork's: its document's, then its own)
        keys, values, pos = k, v, self.positions
        if cached:
            keys, values = torch.cat((*[c.k for c in cached], k), dim=2), torch.cat((*[c.v for c in cached], v), dim=2)
            pos = torch.cat((*[c.pos.to(self.positions.device) for c in cached], self.positions))
        out, _ = ring_attention(q, keys, values, group=self.group, q_pos=self.positions, k_pos=pos, scale=scale,
                                window=window, timeout=self.timeout, backend=self.backend)
        self.shard.layers[layer].append(k, v, self.positions)
        if self.flags is not None:
            self.flags.record(layer, out)
        return out


@torch.inference_mode()
def run_extension(model, config: EngineConfig, prefix: KVShard, ids: torch.Tensor, positions: torch.Tensor,
                  groups: ParallelGroups, device: torch.device) -> Phase1Result:
    """This rank's block ``ids`` (at RoPE ``positions``) of a context's new tokens over the cached ``prefix`` shard
    (:class:`ExtensionContext`): one forward of the base model, every rank of the CP group at once. Returns the
    block's own KV (frozen) -- the rank keeps it beside its cached shard."""
    shard = KVShard(model.config.num_hidden_layers)
    flags = LayerFlags(model.config.num_hidden_layers, device) if config.runtime.check_finite else None
    positions = positions.to(device)
    ctx = ExtensionContext(prefix, shard, positions, config, groups, flags)
    t0 = time.perf_counter()
    with nvtx_range(PHASE1):
        _base_model(model)(input_ids=ids.to(device)[None], position_ids=positions[None], use_cache=False,
                           magnetar=ctx)
    shard.freeze()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return Phase1Result(shard, time.perf_counter() - t0, None, None if flags is None else flags.first())
