"""Hugging Face integration: Magnetar's attention plugged in through transformers' ``AttentionInterface``.

The model's modelling code is untouched. :func:`prepare_model` registers the attention function
``"magnetar"`` and switches the model to it; the engine then calls the model with one extra keyword,
``magnetar=ForwardContext(...)``, which transformers passes through every decoder layer to the attention
function. The context says what this forward is:

* ``prefill_local`` -- Phase 1 of dense/Star/Pulsar: the input is ``[prefix ‖ block]`` with the
  tokens' own positions; causal attention by position; the KV of the ``keep`` slice is stored. With sparse
  prefill (``prefill``, :mod:`magnetar.prefill`) the patched layers attend to a top-k support instead.
* ``prefill_stream`` -- Phase 1 of the StreamingLLM baseline: a chunk attends to the attention sinks and the
  cached KV of the last ``window`` tokens, plus itself causally.
* ``prefill_ring``  -- Phase 1 of Ring: the input is this rank's shard; attention is ring attention over the
  CP group; all of the shard's KV is stored.
* ``phase2``        -- query tokens or a generated token: attention over this rank's context shard (and, on
  the query rank, over the query/generated KV, causally), then one packed all-gather of ``(out, lse)`` and
  the merge. Every rank ends with the same output, so every rank runs the same model forward.

The model never sees an attention mask (mask creation is skipped for unregistered mask types):
causality comes from positions. Queries/keys reach us post-RoPE as ``(B, H, S, D)``; the output goes back
as ``(B, S, Hq, D)`` as transformers expects.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch

from magnetar.engine.kv import KVShard
from magnetar.ops import attention_with_lse, merge_states
from magnetar.parallel import all_gather_states, ring_attention
from magnetar.utils.nvtx import nvtx_range

ATTN_NAME = "magnetar"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")
MODES = ("prefill_local", "prefill_ring", "prefill_stream", "phase2")


@dataclass
class ForwardContext:
    """What one model forward computes; read by :func:`magnetar_attention` in every layer.

    Prefill modes (one request): ``positions (S,)`` are the RoPE positions of the input tokens (also passed
    to the model as position_ids), ``shard`` receives the KV, ``keep`` (prefill_local) is the input slice
    whose KV is stored (the block, not its prefix).

    ``phase2`` (a batch of B requests, each with its own KV): ``positions (B, S)``; ``shards[b]`` is this
    rank's context KV of request b; ``gens[b]`` the query rank's store of request b's query/generated KV
    (None on the other ranks); ``valid[b]`` how many of the S input tokens of request b are real (queries
    of different lengths are right-padded; padding sits after the real tokens, so no real token sees it,
    and its KV is never stored).
    """

    mode: str
    positions: torch.Tensor
    shard: Optional[KVShard] = None
    keep: Optional[slice] = None
    shards: Optional[list[KVShard]] = None
    gens: Optional[list[KVShard]] = None
    valid: Optional[list[int]] = None
    group: Optional[torch.distributed.ProcessGroup] = None
    timeout: Optional[timedelta] = None
    backend: str = "auto"
    stream: Optional[tuple[int, int]] = None  # prefill_stream: (sink tokens, window size)
    window: Optional[int] = None  # the current layer's sliding window (set by attend)
    sparse: Optional[object] = None  # phase2: a SparseDecoder (sparse decoding) or LukaDecoder (LuKA), or None
    track_mass: bool = False  # prefill_local: also store the attention mass each kept key received (LuKA)
    context_tokens: Optional[list[int]] = None  # phase2 with sparse: request b's whole context length (all ranks)
    prefill: Optional[object] = None  # prefill_local: a magnetar.prefill.policy.PrefillRun (sparse prefill), or None
    hidden: Optional[tuple[int, torch.Tensor]] = None  # (layer, attention input) set by capture_attention_inputs

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: Optional[int] = None) -> torch.Tensor:
        """Attention of one layer; ``window``: the layer's sliding window (None for global layers)."""
        self.window = window
        pos = self.positions
        if self.mode == "prefill_local":
            if self.prefill is not None and self.prefill.applies(layer, window):
                hidden = self.hidden[1] if self.hidden is not None and self.hidden[0] == layer else None
                self.hidden = None
                with nvtx_range(f"prefill_sparse/layer{layer}"):  # the sparse trajectory: later layers see this
                    out, lse = self.prefill.attend(layer, q, k, v, scale=scale, pos=pos, hidden=hidden,
                                                   backend=self.backend)
            else:
                out, lse = attention_with_lse(q, k, v, q_pos=pos, k_pos=pos, scale=scale, window=window,
                                              backend=self.backend)
            keep = self.keep if self.keep is not None else slice(None)
            mass = None
            if self.track_mass:  # H2O's scores start in prefill: the mass the local queries gave each kept key
                from magnetar.luka.core import column_mass

                with nvtx_range(f"luka/prefill_mass/layer{layer}"):
                    mass = column_mass(q, k[:, :, keep], lse, scale=scale, q_pos=pos, k_pos=pos[keep],
                                       window=window)[None]
            self.shard.layers[layer].append(k[:, :, keep], v[:, :, keep], pos[keep], mass)
            return out
        if self.mode == "prefill_ring":
            out, _ = ring_attention(q, k, v, group=self.group, q_pos=pos, k_pos=pos, scale=scale, window=window,
                                    timeout=self.timeout, backend=self.backend)
            self.shard.layers[layer].append(k, v, pos)
            return out
        if self.mode == "phase2":
            return self._phase2(layer, q, k, v, scale)
        if self.mode == "prefill_stream":
            return self._stream(layer, q, k, v, scale)
        raise ValueError(f"unknown forward mode {self.mode!r}; expected one of {MODES}")

    def _stream(self, layer, q, k, v, scale):
        # StreamingLLM prefill of one chunk: the sinks and the previous `window` tokens' cached KV, plus the
        # chunk itself causally. The cache (frozen store) keeps everything until Phase 1 ends.
        sinks, window = self.stream
        pos = self.positions
        cache = self.shard.layers[layer]
        out, lse = attention_with_lse(q, k, v, q_pos=pos, k_pos=pos, scale=scale, window=self.window,
                                      backend=self.backend)
        if len(cache):
            start = int(pos[0])
            sel = (cache.pos < sinks) | (cache.pos >= start - window)
            o2, l2 = attention_with_lse(q, cache.k[:, :, sel], cache.v[:, :, sel], q_pos=pos, k_pos=cache.pos[sel],
                                        scale=scale, window=self.window, backend=self.backend)
            out, lse = merge_states([out, o2], [lse, l2])
        cache.append(k, v, pos)
        return out

    def _phase2(self, layer, q, k, v, scale):
        B, Hq, S, D = q.shape
        local_o, local_l = [], []
        for b in range(B):  # requests hold KV of different lengths: attend each to its own
            qb, pos = q[b : b + 1], self.positions[b]
            parts_o, parts_l = [], []
            ctx = self.shards[b].layers[layer]
            if len(ctx) and self.sparse is not None and self.sparse.applies(layer, self.window):
                # sparse decoding / LuKA: the policy attends to its choice of this shard's KV
                o, l = self.sparse.attend_context(layer, b, qb, ctx, pos, scale, self.context_tokens[b],
                                                  backend=self.backend, valid=None if self.valid is None else self.valid[b])
                parts_o.append(o)
                parts_l.append(l)
            elif len(ctx):  # context KV precedes the query: visible to every query token (positions decide)
                o, l = attention_with_lse(qb, ctx.k, ctx.v, q_pos=pos, k_pos=ctx.pos, scale=scale, window=self.window,
                                          backend=self.backend)
                parts_o.append(o)
                parts_l.append(l)
            if self.gens is not None:  # the query rank: its own query/generated tokens, causally
                g = self.gens[b].layers[layer]
                n = S if self.valid is None else self.valid[b]
                g.append(k[b : b + 1, :, :n], v[b : b + 1, :, :n], pos[:n])
                o, l = attention_with_lse(qb, g.k, g.v, q_pos=pos, k_pos=g.pos, scale=scale, window=self.window,
                                          backend=self.backend)
                parts_o.append(o)
                parts_l.append(l)
            if not parts_o:
                local_o.append(torch.zeros_like(qb))
                local_l.append(torch.full((1, Hq, S), float("-inf"), device=q.device))
            elif len(parts_o) == 1:
                local_o.append(parts_o[0])
                local_l.append(parts_l[0])
            else:
                o, l = merge_states(parts_o, parts_l)
                local_o.append(o)
                local_l.append(l)
        local_o, local_l = (torch.cat(local_o), torch.cat(local_l)) if B > 1 else (local_o[0], local_l[0])
        with nvtx_range(f"phase2/merge/layer{layer}"):  # one collective per layer for the whole batch
            outs, lses = all_gather_states(local_o, local_l, self.group, timeout=self.timeout)
            out, lse = merge_states(outs, lses)
        if self.sparse is not None and hasattr(self.sparse, "after_merge"):  # LuKA: accumulate attention mass
            self.sparse.after_merge(layer, lse)
        return out


def magnetar_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The function registered as transformers attention ``"magnetar"``; returns ``(out (B,S,Hq,D), None)``."""
    ctx: Optional[ForwardContext] = kwargs.get(ATTN_NAME)
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None) or None
    if ctx is None:
        # Called outside the engine (e.g. plain model.generate with a DynamicCache): ordinary causal attention,
        # the query tokens being the last ones of the keys.
        out, _ = attention_with_lse(query, key, value, scale=scaling, window=window)
    else:
        with nvtx_range(f"{ctx.mode}/layer{module.layer_idx}"):
            out = ctx.attend(module.layer_idx, query, key, value, scaling, window)
    return out.transpose(1, 2), None


_REGISTERED = False


def register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_NAME, magnetar_attention)
        _REGISTERED = True


def check_supported(config) -> None:
    """Raise a ValueError naming the supported architectures if ``config`` is not one of them."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError(f"{model_type}: attention logit soft-capping is not supported by Magnetar's attention")


def _capture_hook(module, args, kwargs):
    ctx = kwargs.get(ATTN_NAME)
    if isinstance(ctx, ForwardContext) and ctx.prefill is not None and ctx.prefill.needs_hidden:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        ctx.hidden = (module.layer_idx, hidden)


def capture_attention_inputs(model) -> None:
    """Let sparse prefill's indexer see each attention layer's input hidden states (idempotent).

    transformers' ``AttentionInterface`` hands the attention function q, k, v but not the hidden states the
    indexer scores (Algorithm 2). A forward pre-hook on every attention module -- not a change to the modelling
    code -- records them on the :class:`ForwardContext`, and only when its prefill run asks for them.
    """
    if getattr(model, "_magnetar_captures_inputs", False):
        return
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "q_proj"):
            module.register_forward_pre_hook(_capture_hook, with_kwargs=True)
    model._magnetar_captures_inputs = True


def prepare_model(model) -> None:
    """Check the architecture and switch the model's attention to Magnetar's (in place, weights untouched)."""
    check_supported(model.config)
    register()
    model.set_attn_implementation(ATTN_NAME)
    model.eval()
