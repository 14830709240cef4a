"""Tiny random-weight models of every supported architecture (seeded; identical on every rank)."""
from __future__ import annotations

import torch

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, eos_token_id=None,
              bos_token_id=None, pad_token_id=None)


def tiny_model(arch: str, seed: int = 0, **overrides):
    import transformers as tf

    kw = dict(COMMON, **overrides)
    if arch == "llama":
        cfg, cls = tf.LlamaConfig(**kw), tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = tf.Qwen2Config(use_sliding_window=False, **kw), tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg, cls = tf.Qwen3Config(use_sliding_window=False, **kw), tf.Qwen3ForCausalLM
    elif arch == "mistral":
        cfg, cls = tf.MistralConfig(sliding_window=None, **kw), tf.MistralForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


@torch.no_grad()
def reference(model, context_ids: torch.Tensor, query_ids: torch.Tensor, max_new_tokens: int):
    """HF's own dense greedy decoding (sdpa attention, DynamicCache): (first-token logits, tokens)."""
    ids = torch.cat((context_ids, query_ids))[None]
    logits = model(ids).logits[0, -1]
    out = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=0)
    return logits, out[0, ids.shape[1]:].tolist()
