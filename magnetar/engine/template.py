"""Prompt -> (Phase-1 context ids, Phase-2 query ids), as in the Pulsar paper's Appendix B.

With a chat template, the user turn ``context + query`` is rendered once and split right after the context:
everything through the context (system prompt, user header, context) is Phase 1; the question, the end of
the user turn and the assistant header are Phase 2. Both halves are tokenized with
``add_special_tokens=False`` (the template already holds the special tokens). Base models without a chat
template use the plain ``{context}{query}`` template (Star paper, Appendix B.3), with the BOS token first
when the tokenizer normally adds one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_SPLIT = "\x00MAGNETAR_CONTEXT_END\x00"


@dataclass(frozen=True)
class Prompt:
    context_ids: torch.Tensor  # (L,) int64, Phase 1
    query_ids: torch.Tensor  # (Q,) int64, Phase 2


def _encode(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def split_prompt(tokenizer, context: str, query: str) -> Prompt:
    """Tokenize ``context`` and ``query`` into the two phases (see module docstring)."""
    if not isinstance(context, str) or not isinstance(query, str):
        raise ValueError("context and query must both be strings (or pass token-id tensors to Engine.generate)")
    if not query.strip():
        raise ValueError("the query is empty: Phase 2 needs at least one query token; pass a question")
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": context + _SPLIT + query}], tokenize=False, add_generation_prompt=True
        )
        if rendered.count(_SPLIT) != 1:
            raise ValueError("the chat template altered the context/query boundary; pass token ids instead")
        head, tail = rendered.split(_SPLIT)
        return Prompt(_encode(tokenizer, head), _encode(tokenizer, tail))
    ids = _encode(tokenizer, context)
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None:
        probe = tokenizer("x", add_special_tokens=True)["input_ids"]
        if probe and probe[0] == bos and (len(ids) == 0 or ids[0] != bos):
            ids = torch.cat((torch.tensor([bos]), ids))
    return Prompt(ids, _encode(tokenizer, query))
