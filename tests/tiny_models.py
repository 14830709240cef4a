"""Tiny random-weight models of every supported architecture (seeded; identical on every rank)."""
from __future__ import annotations

import torch

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma3")  # mistral and gemma3 with short sliding windows
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
        cfg, cls = tf.MistralConfig(**dict(dict(sliding_window=24), **kw)), tf.MistralForCausalLM
    elif arch == "gemma3":
        # 5 local (sliding window 8) : 1 global layers, as in Gemma-3, with one KV head
        kw = dict(kw, num_hidden_layers=6, num_key_value_heads=1, query_pre_attn_scalar=16)
        cfg, cls = tf.Gemma3TextConfig(**dict(dict(sliding_window=8), **kw)), tf.Gemma3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


def peaked_tiny_model(arch: str = "llama", seed: int = 0, factor: float = 10.0, **overrides):
    """:func:`tiny_model` with q/k projections scaled by ``factor``: peakier attention than the 0.02-std random
    init gives, so a top-k oracle has a support worth learning (sparse prefill tests)."""
    model = tiny_model(arch, seed=seed, **overrides)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(factor)
            layer.self_attn.k_proj.weight.mul_(factor)
    return model


@torch.no_grad()
def reference(model, context_ids: torch.Tensor, query_ids: torch.Tensor, max_new_tokens: int):
    """HF's own dense greedy decoding, (first-token logits, tokens): every step is a full forward of the whole
    sequence with the model's own (sdpa) attention and masks, no KV cache. (HF's sliding-window cache in
    ``generate`` drops keys that its own mask keeps visible, so cached generation is not the reference for
    windowed models.)"""
    ids = torch.cat((context_ids, query_ids))[None]
    first, tokens = None, []
    for _ in range(max_new_tokens):
        logits = model(ids, use_cache=False).logits[0, -1]
        first = logits if first is None else first
        tokens.append(int(logits.argmax()))
        ids = torch.cat((ids, torch.tensor([[tokens[-1]]])), dim=1)
    return first, tokens


def byte_tokenizer(vocab_size: int = 256):
    """A byte-level tokenizer (text -> one id per byte, ids 0..255) with ``vocab_size`` ids: the ids past the bytes
    decode to words `` w<id>`` (never made by encoding), so every id a model of that vocabulary generates reads as
    text (the GPU kit serves dummy weights of a 128K vocabulary with it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({f"\u0120w{i}": i for i in range(len(vocab), vocab_size)})  # \u0120: ByteLevel's space
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def save_tiny(out, arch: str = "llama", seed: int = 0, **overrides):
    """Save :func:`tiny_model` with a byte-level tokenizer (256 ids = its vocabulary) into the folder ``out``, loadable
    by ``--model`` / ``init_inference(path)``; returns the model."""
    byte_tokenizer().save_pretrained(out)
    model = tiny_model(arch, seed=seed, **overrides)
    model.save_pretrained(out)
    return model


# A chat template of plain text markers (the byte-level tokenizer has no special tokens): the server tests' model.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def save_tiny_chat(out, positions: int, template: str = CHAT_TEMPLATE):
    """:func:`save_tiny` (a llama with ``positions`` positions) with ``template`` as its tokenizer's chat template;
    returns ``out``."""
    from transformers import AutoTokenizer

    save_tiny(out, "llama", max_position_embeddings=positions)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = template
    tok.save_pretrained(out)
    return out

