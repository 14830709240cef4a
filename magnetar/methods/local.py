"""The Phase-1 attention shared by the local methods (dense, Star, Pulsar): ``[prefix ‖ block]`` attends to
itself causally by position, and the block's KV is stored.

With sparse prefill (``ctx.prefill``) the patched layers attend to a top-k support instead (the sparse
trajectory: later layers see that output). With a decode policy that needs it (LuKA, ``ctx.mass``) the
attention mass the segment's queries gave every kept key is stored beside it. What the segment is -- the
anchor, the sink and summaries, the block -- is the method's plan; this module does not know it.

Hybrid layers (``blocks.exact_layers``, Magnetar's option of Star and Pulsar, issue 30): in the chosen layers the
segment's queries attend exactly to every earlier context token -- the KV of every earlier block at that layer,
exchanged over the CP group as ring attention does (:func:`magnetar.parallel.ring_attention`; simulated ranks read
the shards of the ranks encoded before them) -- and to their own block, not to their local prefix (those positions
are in the earlier blocks' KV). Every layer exact is dense Phase 1 whatever the prefix; none is the method itself.
The last layer always stays local: its attention output shapes no kept KV.
The ranks then run in lock-step at those layers, one block each.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch

from magnetar.config import EngineConfig, parse_exact_layers
from magnetar.engine.plan import block_bounds, resolve_block_size
from magnetar.engine.strategy import MethodBase, Phase1Layer
from magnetar.ops import attention_with_lse
from magnetar.parallel import ring_attention
from magnetar.parallel.groups import group_size
from magnetar.utils.nvtx import PHASE1_LUKA_MASS, PHASE1_PREFILL_SPARSE, nvtx_range


class LocalMethod(MethodBase):
    """Base of the methods whose Phase 1 is local attention over each plan segment; subclasses plan."""

    def attend(self, ctx: Phase1Layer, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: Optional[int]) -> torch.Tensor:
        pos = ctx.positions
        if layer in self.exact_layers(ctx.config, len(ctx.shard.layers)):
            out, lse = _attend_exact(ctx, layer, q, k, v, scale, window)
        elif ctx.prefill is not None and ctx.prefill.applies(layer, window):
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

    def exact_layers(self, config: EngineConfig, num_layers: int) -> tuple[int, ...]:
        return _exact_layers(config.blocks.exact_layers, num_layers)

    def model_problems(self, config: EngineConfig, num_layers: int) -> list[str]:
        try:
            parse_exact_layers(config.blocks.exact_layers, num_layers)
        except ValueError as e:
            return [str(e)]
        return []


@lru_cache(maxsize=64)  # every layer of every segment asks
def _exact_layers(spec: str, num_layers: int) -> tuple[int, ...]:
    """The hybrid layers that change the kept KV: the last layer's Phase-1 attention output feeds no kept key or
    value (Phase 1 stops there), so it stays local -- exact there would cost a ring pass for nothing."""
    return tuple(i for i in parse_exact_layers(spec, num_layers) if i < num_layers - 1)


def exact_label(config: EngineConfig) -> list[str]:
    """The hybrid layers' part of a run's label (``exact layers every:4``; nothing without them)."""
    spec = config.blocks.exact_layers.strip()
    return [f"exact layers {spec}"] if spec else []


def exact_problems(config: EngineConfig, context_len: int) -> list[str]:
    """Why this request's hybrid layers cannot run: they need one block per rank (the ranks exchange their blocks'
    KV in lock-step at those layers)."""
    if not config.blocks.exact_layers.strip() or config.parallel.cp_size == 1:
        return []
    n = len(block_bounds(context_len, resolve_block_size(config, context_len)))
    cp = config.parallel.cp_size
    if n != cp:
        return [f"exact_layers needs one block per rank (the ranks exchange their blocks' KV in those layers), but "
                f"block_size {config.blocks.block_size} gives {n} blocks for this {context_len}-token context on "
                f"cp_size {cp}: leave --block-size unset (context length / cp_size) or set --exact-layers \"\""]
    return []


def _attend_exact(ctx: Phase1Layer, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  window: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A hybrid layer: the segment's queries over every earlier block's KV and their own block's, by position."""
    pos, keep = ctx.positions, ctx.keep
    k_own, v_own, p_own = k[:, :, keep], v[:, :, keep], pos[keep]
    if group_size(ctx.group) > 1:
        return ring_attention(q, k_own, v_own, group=ctx.group, q_pos=pos, k_pos=p_own, scale=scale, window=window,
                              timeout=ctx.timeout, backend=ctx.backend)
    if ctx.ring is not None:  # simulated ranks: the earlier ranks' blocks, as the ring brings them
        return ctx.ring.attend(layer, q, k_own, v_own, q_pos=pos, k_pos=p_own, scale=scale, window=window,
                               backend=ctx.backend)
    return attention_with_lse(q, k_own, v_own, q_pos=pos, k_pos=p_own, scale=scale, window=window,
                              backend=ctx.backend)
