"""The shape of a causal LM read off its Hugging Face config: layers, widths, heads, vocabulary, windows.

    dims = ModelDims.from_config(model.config)         # or an AutoConfig, or a dict with the HF field names
    dims.windows                                        # per layer: sliding window (int) or None (global)

Knows the HF config field names (``num_hidden_layers``, ``num_key_value_heads``, ``sliding_window``,
``layer_types`` ...) and nothing else: no weights, no engine, no method. Used by the cost model
(:mod:`magnetar.eval.cost`), sparse prefill (which layers it patches) and the indexer calibration.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ModelDims"]


@dataclass(frozen=True)
class ModelDims:
    """Per-model sizes (all positive ints) and, per layer, the sliding window (int) or ``None`` (global)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    windows: tuple  # per layer: sliding window (int) or None (global)
    tied_embeddings: bool = False
    dtype: str = "float32"  # the checkpoint's: what runtime.dtype "auto" loads (its config's dtype, else float32)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def linear_flops_per_token_layer(self) -> int:
        h, E, K, I = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        return 2 * (h * E + 2 * h * K + E * h + 3 * h * I)

    @property
    def params(self) -> int:
        h, E, K, I = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        per_layer = h * E + 2 * h * K + E * h + 3 * h * I
        emb = self.vocab * h
        return self.layers * per_layer + emb * (1 if self.tied_embeddings else 2)

    @classmethod
    def from_config(cls, config: Any) -> ModelDims:
        """From an HF config object or a dict with the HF field names."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()

        def get(name, default=None):
            if isinstance(config, dict):
                return config.get(name, default)
            return getattr(config, name, default)

        def req(name, value):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model config field {name!r} must be a positive int, got {value!r}")
            return value

        layers = req("num_hidden_layers", get("num_hidden_layers"))
        hidden = req("hidden_size", get("hidden_size"))
        heads = req("num_attention_heads", get("num_attention_heads"))
        kv_heads = req("num_key_value_heads", get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
        head_dim = get("head_dim") or (hidden // heads if hidden % heads == 0 else None)
        req("head_dim", head_dim)
        inter = req("intermediate_size", get("intermediate_size"))
        vocab = req("vocab_size", get("vocab_size"))
        sw = get("sliding_window")
        types = get("layer_types")
        if sw and types:
            windows = tuple(int(sw) if t == "sliding_attention" else None for t in types)
        elif sw and get("use_sliding_window", True):
            windows = (int(sw),) * layers
        else:
            windows = (None,) * layers
        if len(windows) != layers:
            raise ValueError(f"layer_types has {len(windows)} entries for {layers} layers")
        return cls(layers, hidden, heads, kv_heads, head_dim, inter, vocab, windows,
                   bool(get("tie_word_embeddings", False)), _dtype_name(get("dtype") or get("torch_dtype")))


def _dtype_name(named) -> str:
    """A config's ``dtype`` / ``torch_dtype`` (a name or a ``torch.dtype``) as one of float32 / bfloat16 / float16;
    float32 for none or another (what ``runtime.dtype="auto"`` loads: ``magnetar.engine.load``)."""
    name = str(named).removeprefix("torch.") if named is not None else "float32"
    return name if name in ("float32", "bfloat16", "float16") else "float32"
