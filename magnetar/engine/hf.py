"""Hugging Face integration: Magnetar's attention plugged in through transformers' ``AttentionInterface``.

The model's modelling code is untouched. :func:`prepare_model` registers the attention function
``"magnetar"`` and switches the model to it; a phase driver then calls the model with one extra keyword,
``magnetar=<LayerContext>``, which transformers passes through every decoder layer to the attention function,
and the context computes the layer (:class:`magnetar.engine.phase1.Phase1Context` asks the Phase-1 method,
:class:`magnetar.engine.phase2.Phase2Context` merges over the distributed KV). This module knows neither.

The model never sees an attention mask (mask creation is skipped for unregistered mask types):
causality comes from positions. Queries/keys reach us post-RoPE as ``(B, H, S, D)``; the output goes back
as ``(B, S, Hq, D)`` as transformers expects.
"""
from __future__ import annotations

from typing import Optional

from magnetar.engine.strategy import LayerContext
from magnetar.ops import attention_with_lse
from magnetar.utils.nvtx import nvtx_range

ATTN_NAME = "magnetar"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")


def magnetar_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The function registered as transformers attention ``"magnetar"``; returns ``(out (B,S,Hq,D), None)``."""
    ctx: Optional[LayerContext] = kwargs.get(ATTN_NAME)
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None) or None
    if ctx is None:
        # Called outside the engine (e.g. plain model.generate with a DynamicCache): ordinary causal attention,
        # the query tokens being the last ones of the keys.
        out, _ = attention_with_lse(query, key, value, scale=scaling, window=window)
    elif ctx.layer_range is None:  # a compiled step's context: no profiler range inside the graph
        out = ctx.attend(module.layer_idx, query, key, value, scaling, window)
    else:
        with nvtx_range(ctx.layer_range, n=module.layer_idx):
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


def check_tensor_parallel(config, tp_size: int) -> None:
    """Raise a ValueError unless ``tp_size`` divides the model's KV heads (and so its query heads).

    DeepSpeed AutoTP would split an uneven head count unevenly (some ranks one KV head more); Magnetar wants
    every TP rank to hold the same heads' share, so the per-layer work and the per-head policy state match."""
    if tp_size == 1:
        return
    hq = int(config.num_attention_heads)
    hkv = int(getattr(config, "num_key_value_heads", None) or hq)
    if hkv % tp_size or hq % tp_size:
        fits = [d for d in range(1, hkv + 1) if hkv % d == 0 and hq % d == 0]
        raise ValueError(f"tp_size {tp_size} does not divide the model's {hkv} KV heads ({hq} query heads): each TP "
                         f"rank holds an equal share of the heads; choose tp_size from {fits}")


def _capture_hook(module, args, kwargs):
    ctx = kwargs.get(ATTN_NAME)
    if isinstance(ctx, LayerContext) and ctx.wants_hidden:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        ctx.hidden = (module.layer_idx, hidden)


def capture_attention_inputs(model) -> None:
    """Let sparse prefill's indexer see each attention layer's input hidden states (idempotent).

    transformers' ``AttentionInterface`` hands the attention function q, k, v but not the hidden states the
    indexer scores (Algorithm 2). A forward pre-hook on every attention module -- not a change to the modelling
    code -- records them on the forward's :class:`~magnetar.engine.strategy.LayerContext`, only when it asks.
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
