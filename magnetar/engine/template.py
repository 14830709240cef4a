"""Prompt -> (Phase-1 context ids, Phase-2 query ids), as in the Pulsar paper's Appendix B.

With a chat template, the user turn ``context + query`` is rendered once and split right after the context:
everything through the context (system prompt, user header, context) is Phase 1; the question, the end of
the user turn and the assistant header are Phase 2. Both halves are tokenized with
``add_special_tokens=False`` (the template already holds the special tokens). Base models without a chat
template use the plain ``{context}{query}`` template (Star paper, Appendix B.3), with the BOS token first
when the tokenizer normally adds one.

User text is text: no special-token id ever comes from the context or the query. A ``<|im_start|>assistant``,
``<|eot_id|>``, ``</s>`` or the tokenizer's BOS/EOS string inside them is tokenized as the characters it is
made of, so an injected chat turn stays inside the user turn. Special tokens are the tokenizer's own
(``all_special_tokens``) and every added token flagged special; other added tokens are vocabulary. Without a
template (and in :func:`encode_text`, which the engine's ``score`` uses) the user text is tokenized with
``split_special_tokens=True``. With a template, each special token in the context or query is wrapped in two
private markers (Unicode noncharacters) before rendering; the rendered halves are cut at the markers, the
template's own text is tokenized as before (its markers stay special ids) and each wrapped token as text.
Text without special tokens renders and tokenizes exactly as before, to the same ids; with them, only the
wrapped tokens change. Rendering the real text (not placeholders tokenized apart from the template) keeps
the template's own handling of the content (Llama 3 trims it) and never splits a token at the template's
edge (Mistral's ``[INST] `` + text). transformers' ``apply_chat_template(sanitize_control_tokens=True)``
marks the same way, but returns one id list (no split into the two phases) and is missing from older
supported versions.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_SPLIT = "\x00MAGNETAR_CONTEXT_END\x00"
# Noncharacters, which Unicode keeps for a program's internal use: they wrap the special tokens of user text
# through the template's rendering.
_OPEN, _CLOSE = "\ufdd0", "\ufdd1"


@dataclass(frozen=True)
class Prompt:
    context_ids: torch.Tensor  # (L,) int64, Phase 1
    query_ids: torch.Tensor  # (Q,) int64, Phase 2


def _encode(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def encode_text(tokenizer, text: str) -> torch.Tensor:
    """``text`` as ``(N,)`` int64 ids without added BOS/EOS, special-token strings in it tokenized as text
    (never a special id). Text without special-token strings gets the ids of ``tokenizer(text)``."""
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def special_tokens(tokenizer) -> tuple[str, ...]:
    """The strings of ``tokenizer``'s special tokens (``all_special_tokens`` and the added tokens flagged
    special), longest first."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            found.add(str(tok))
    return tuple(sorted((t for t in found if t), key=len, reverse=True))


def _wrap_special(tokenizer, text: str, name: str) -> str:
    """``text`` with every special-token string wrapped in ``_OPEN`` ... ``_CLOSE``."""
    if _OPEN in text or _CLOSE in text:
        raise ValueError(f"the {name} contains the Unicode noncharacter U+FDD0 or U+FDD1, which Magnetar reserves "
                         "to mark special-token strings; remove it (or pass token-id tensors)")
    tokens = special_tokens(tokenizer)
    if not tokens:
        return text
    return re.sub("|".join(map(re.escape, tokens)), lambda m: _OPEN + m.group(0) + _CLOSE, text)


def _encode_rendered(tokenizer, text: str) -> torch.Tensor:
    """Ids of a part of the rendered template: the template's text as usual, wrapped user tokens as text.

    The pieces after the first are encoded after a newline that is then dropped (as transformers does), so a
    SentencePiece tokenizer does not add its start-of-text space in the middle of the prompt. A lone marker (a
    template that cut the content) is dropped.
    """
    pieces = re.split(f"{_OPEN}([^{_OPEN}{_CLOSE}]*){_CLOSE}|[{_OPEN}{_CLOSE}]", text)
    if len(pieces) == 1:
        return _encode(tokenizer, text)
    newline = _encode(tokenizer, "\n").tolist()
    ids = _encode(tokenizer, pieces[0]).tolist()
    for i, piece in enumerate(pieces[1:], start=1):
        if not piece:
            continue
        encode = encode_text if i % 2 == 1 else _encode  # odd pieces: wrapped special tokens of user text
        piece_ids = encode(tokenizer, "\n" + piece).tolist()
        ids += piece_ids[len(newline):] if piece_ids[:len(newline)] == newline else encode(tokenizer, piece).tolist()
    return torch.tensor(ids, dtype=torch.long)


def split_prompt(tokenizer, context: str, query: str) -> Prompt:
    """Tokenize ``context`` and ``query`` into the two phases (see module docstring)."""
    if not isinstance(context, str) or not isinstance(query, str):
        raise ValueError("context and query must both be strings (or pass token-id tensors to Engine.generate)")
    if not query.strip():
        raise ValueError("the query is empty: Phase 2 needs at least one query token; pass a question")
    if getattr(tokenizer, "chat_template", None):
        content = _wrap_special(tokenizer, context, "context") + _SPLIT + _wrap_special(tokenizer, query, "query")
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        if rendered.count(_SPLIT) != 1:
            raise ValueError("the chat template altered the context/query boundary; pass token ids instead")
        head, tail = rendered.split(_SPLIT)
        return Prompt(_encode_rendered(tokenizer, head), _encode_rendered(tokenizer, tail))
    ids = encode_text(tokenizer, context)  # a BOS string in the context is text: the real BOS goes first
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None:
        probe = tokenizer("x", add_special_tokens=True)["input_ids"]
        if probe and probe[0] == bos:
            ids = torch.cat((torch.tensor([bos]), ids))
    return Prompt(ids, encode_text(tokenizer, query))
