"""The Phase-1 attention shared by the local methods (dense, Star, Pulsar): ``[prefix ‖ block]`` attends to
itself causally by position, and the block's KV is stored.

With sparse prefill (``ctx.prefill``) the patched layers attend to a top-k support instead (the sparse
trajectory: later layers see that output). With a decode policy that needs it (LuKA, ``ctx.mass``) the
attention mass the segment's queries gave every kept key is stored beside it. What the segment is -- the
anchor, the sink and summaries, the block -- is the method's plan; this module does not know it.
"""
from __future__ import annotations

from typing import Optional

import torch

from magnetar.engine.strategy import MethodBase, Phase1Layer
from magnetar.ops import attention_with_lse
from magnetar.utils.nvtx import PHASE1_LUKA_MASS, PHASE1_PREFILL_SPARSE, nvtx_range


class LocalMethod(MethodBase):
    """Base of the methods whose Phase 1 is local attention over each plan segment; subclasses plan."""

    def attend(self, ctx: Phase1Layer, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: Optional[int]) -> torch.Tensor:
        pos = ctx.positions
        if ctx.prefill is not None and ctx.prefill.applies(layer, window):
            hidden = ctx.hidden[1] if ctx.hidden is not None and ctx.hidden[0] == layer else None
            ctx.hidden = None
            with nvtx_range(PHASE1_PREFILL_SPARSE, n=layer):  # the sparse trajectory: later layers see this
                out, lse = ctx.prefill.attend(layer, q, k, v, scale=scale, pos=pos, hidden=hidden, backend=ctx.backend)
        else:
            out, lse = attention_with_lse(q, k, v, q_pos=pos, k_pos=pos, scale=scale, window=window,
                                          backend=ctx.backend)
        keep = ctx.keep
        mass = None
        if ctx.mass is not None:  # H2O's scores start in prefill: the mass the local queries gave each kept key
            with nvtx_range(PHASE1_LUKA_MASS, n=layer):
                mass = ctx.mass(q, k[:, :, keep], lse, scale=scale, q_pos=pos, k_pos=pos[keep], window=window)[None]
        ctx.shard.layers[layer].append(k[:, :, keep], v[:, :, keep], pos[keep], mass)
        return out
