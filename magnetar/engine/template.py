"""Prompt -> (Phase-1 context ids, Phase-2 query ids), as in the Pulsar paper's Appendix B.

With a chat template, the user turn ``context + query`` is rendered once and split right after the context:
everything through the context (system prompt, user header, context) is Phase 1; the question, the end of
the user turn and the assistant header are Phase 2. Both halves are tokenized with
``add_special_tokens=False`` (the template already holds the special tokens). Base models without a chat
template use the plain ``{context}{query}`` template (Star paper, Appendix B.3), with the BOS token first
when the tokenizer normally adds one. :func:`split_messages` does the same for a whole conversation (the server's
chat requests): the last user message is the question, everything before it the context.

User text is text: no special-token id ever comes from the context or the query. A ``<|im_start|>assistant``,
``<|eot_id|>``, ``</s>`` or the tokenizer's BOS/EOS string inside them is tokenized as the characters it is
made of, so an injected chat turn stays inside the user turn. Special tokens are the tokenizer's own
(``all_special_tokens``), every added token flagged special and every added token the chat template writes (its
turn markers, whatever their flag); other added tokens are vocabulary. Without a
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

A text too long for the model is refused before it is tokenized whole (``limit``, the model's positions): when
the user text is longer than ``(limit + 1) * 8`` characters, only that many are tokenized first, and if they
alone exceed ``limit`` tokens the request is a ValueError saying so -- the work and memory a refusal costs are
bounded by the model's size, not by the text's (a 50 MB context used to take 140 s and 10 GiB to be refused).
"""
from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import torch

from magnetar.config import FieldError, describe
from magnetar.engine.inputs import positions_phrase

# Noncharacters, which Unicode keeps for a program's internal use: they wrap the special tokens of user text
# through the template's rendering.
_OPEN, _CLOSE = "\ufdd0", "\ufdd1"


@dataclass(frozen=True)
class Prompt:
    context_ids: torch.Tensor  # (L,) int64, Phase 1
    query_ids: torch.Tensor  # (Q,) int64, Phase 2


def _encode(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def encode_text(tokenizer, text: str, limit: Optional[int] = None, name: str = "text") -> torch.Tensor:
    """``text`` as ``(N,)`` int64 ids without added BOS/EOS, special-token strings in it tokenized as text
    (never a special id). Text without special-token strings gets the ids of ``tokenizer(text)``. ``limit``:
    :func:`check_fits` first (``name`` is the argument the error names)."""
    check_fits(tokenizer, [text], limit, name)
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


# The characters per token below which a text's prefix is tokenized to find that it cannot fit: English averages
# about 4 per token, code and CJK fewer; a text that compresses better than 8 is tokenized whole.
PREFIX_CHARS_PER_TOKEN = 8


def check_fits(tokenizer, texts, limit: Optional[int], name: str) -> None:
    """ValueError naming ``name`` when the user texts ``texts`` (one prompt's parts, in order) certainly make
    more than ``limit`` tokens: when they hold more than ``(limit + 1) * PREFIX_CHARS_PER_TOKEN`` characters,
    that many of them are tokenized (as text), and more than ``limit + len(texts)`` tokens from them alone
    (a part boundary may merge two tokens) cannot fit. Texts that may fit pass; None: no limit."""
    if limit is None:
        return
    total = sum(len(t) for t in texts)
    cut = (limit + 1) * PREFIX_CHARS_PER_TOKEN
    if total <= cut:
        return
    prefix, room = [], cut
    for t in texts:
        prefix.append(t[:room])
        room -= len(prefix[-1])
        if room <= 0:
            break
    n = len(tokenizer("".join(prefix), add_special_tokens=False, split_special_tokens=True)["input_ids"])
    if n > limit + len(texts):
        raise FieldError(f"{name}: too long for {positions_phrase(limit)}: its first {cut} characters alone "
                         f"are {n} tokens (of {total} characters in all); shorten it to about {cut * limit // n} "
                         f"characters", name)


def special_tokens(tokenizer) -> tuple[str, ...]:
    """The strings of ``tokenizer``'s control tokens, longest first: its special tokens (``all_special_tokens`` and
    the added tokens flagged special) and every other added token that its chat template writes (a template's turn
    markers are control tokens whatever their flag says: some tokenizers add ``<|im_start|>`` unflagged)."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or ())
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False) or (str(tok) and str(tok) in template):
            found.add(str(tok))
    return tuple(sorted((t for t in found if t), key=len, reverse=True))


def _split_marker(texts) -> str:
    """The mark rendered between the context and the query: private to this call (a random part no client can
    guess), so user text that holds any earlier mark is text like any other."""
    while True:
        mark = f"\x00MAGNETAR_CONTEXT_END_{secrets.token_hex(8)}\x00"
        if not any(mark in t for t in texts):
            return mark


def _wrap_special(tokenizer, text: str, name: str) -> str:
    """``text`` with every special-token string wrapped in ``_OPEN`` ... ``_CLOSE``."""
    if _OPEN in text or _CLOSE in text:
        raise FieldError(f"the {name} contains the Unicode noncharacter U+FDD0 or U+FDD1, which Magnetar reserves "
                         "to mark special-token strings; remove it (or pass token-id tensors)", name)
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
    control = _control_ids(tokenizer)

    def as_text(tok, piece: str) -> torch.Tensor:
        return torch.tensor(_as_text(tok, piece, control), dtype=torch.long)

    for i, piece in enumerate(pieces[1:], start=1):
        if not piece:
            continue
        encode = as_text if i % 2 == 1 else _encode  # odd pieces: wrapped special tokens of user text
        piece_ids = encode(tokenizer, "\n" + piece).tolist()
        ids += piece_ids[len(newline):] if piece_ids[:len(newline)] == newline else encode(tokenizer, piece).tolist()
    return torch.tensor(ids, dtype=torch.long)


def _control_ids(tokenizer) -> set[int]:
    """The ids of :func:`special_tokens`."""
    return {i for i in tokenizer.convert_tokens_to_ids(list(special_tokens(tokenizer))) if isinstance(i, int)}


def _as_text(tokenizer, text: str, control: set[int]) -> list[int]:
    """``text`` (a control-token string a client wrote) as the ids of its characters: :func:`encode_text`, and where
    that still gives a control id (an added token the template writes but does not flag special:
    ``split_special_tokens`` splits only flagged ones) its two halves each, so the string can never match."""
    ids = encode_text(tokenizer, text).tolist()
    if len(text) < 2 or not control.intersection(ids):
        return ids
    half = len(text) // 2
    return _as_text(tokenizer, text[:half], control) + _as_text(tokenizer, text[half:], control)


def split_prompt(tokenizer, context: str, query: str, limit: Optional[int] = None) -> Prompt:
    """Tokenize ``context`` and ``query`` into the two phases (see module docstring); ``limit``: the model's
    positions (:func:`check_fits`)."""
    if not isinstance(context, str) or not isinstance(query, str):
        raise FieldError("context and query must both be strings (or pass token-id tensors to Engine.generate)",
                         "context" if not isinstance(context, str) else "query")
    if not query.strip():
        raise FieldError("the query is empty: Phase 2 needs at least one query token; pass a question", "query")
    check_fits(tokenizer, [context, query], limit, "context" if len(context) >= len(query) else "query")
    if getattr(tokenizer, "chat_template", None):
        mark = _split_marker([context, query])
        content = _wrap_special(tokenizer, context, "context") + mark + _wrap_special(tokenizer, query, "query")
        return _split_rendered(tokenizer, [{"role": "user", "content": content}], mark)
    return split_plain(tokenizer, context, query)


def renders_tools(tokenizer) -> bool:
    """Whether ``tokenizer``'s chat template renders tool definitions and calls itself (it reads ``tools``):
    :func:`split_messages` then passes them to it; other templates get the server's fallback format
    (:mod:`magnetar.serve.tools`)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and re.search(r"\btools\b", template) is not None


def _split_rendered(tokenizer, messages: list[dict], mark: str, tools: Optional[list] = None) -> Prompt:
    """Render ``messages`` (user text already wrapped, ``mark`` once in the question's message) with the chat
    template (``tools``: the tool definitions it renders) and cut it at ``mark``."""
    try:
        rendered = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # the template's own raise_exception (a role order it refuses), or a missing field
        if isinstance(e, FieldError):
            raise
        raise FieldError(f"the model's chat template cannot render these messages: {e}", "messages") from None
    if rendered.count(mark) != 1:  # the user text cannot hold it (_split_marker): the template dropped or copied it
        raise FieldError(f"the model's chat template {'dropped' if mark not in rendered else 'repeated'} the last "
                         f"user message, so its question cannot be cut from the conversation; send the "
                         f"conversation as a completion's prompt, or pass token ids", "messages")
    head, tail = rendered.split(mark)
    return Prompt(_encode_rendered(tokenizer, head), _encode_rendered(tokenizer, tail))


def split_messages(tokenizer, messages, context: Optional[str] = None, limit: Optional[int] = None,
                   tools: Optional[list] = None) -> Prompt:
    """A chat conversation into the two phases: the last message is the user's question (Phase 2, with the end
    of its turn and the assistant header); everything before it is the context (Phase 1). When the conversation
    ends with tool results (messages of role ``tool``, after an assistant message that called tools), those
    results are Phase 2 and everything before them -- the calls included -- Phase 1, so the next turn of an
    agent extends the cached context. ``tools``: the tool definitions, for a template that renders them
    (:func:`renders_tools`); a message may then carry ``tool_calls`` / ``tool_call_id``, passed to the template.

    ``messages`` is a non-empty list of ``{"role": str, "content": str}``; the last one must have role ``user``
    and a non-blank content (or role ``tool``). ``context`` (optional) is a document placed at the start of the last
    user turn, before the question: ``split_messages(tok, [{"role": "user", "content": q}], context=doc)`` is exactly
    ``split_prompt(tok, doc, q)``. Without ``context``, Phase 1 is the rendered conversation up to the question
    (system prompt, earlier turns, the last user header). Special-token strings in any message or in ``context``
    are text, as in :func:`split_prompt`.

    Without a chat template (base models) the roles are not rendered: the context is the earlier messages'
    contents and then ``context`` (it opens the last turn) joined by blank lines (``"\n\n"``), the query is the
    last message's content (BOS first as in :func:`split_prompt`); an empty context is a ValueError (there is
    nothing to encode).
    Bad messages raise ValueError naming ``messages[i].role`` / ``messages[i].content``. ``limit``: the model's
    positions (:func:`check_fits` over ``context`` and the contents).
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise FieldError(f"messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts (the last one "
                         f"the user's question), got {describe(messages)}", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not m["role"]:
            raise FieldError(f"messages[{i}] must be a dict with a non-empty str 'role' and a str 'content', got "
                             f"{describe(m)}", f"messages[{i}]")
        if not isinstance(m.get("content"), str):
            raise FieldError(f"messages[{i}].content must be a str, got {describe(m.get('content'))}",
                             f"messages[{i}].content")
    last = messages[-1]
    if last["role"] not in ("user", "tool"):
        raise FieldError(f"messages[{len(messages) - 1}].role must be 'user' (the question) or 'tool' (tool "
                         f"results): the last message is what the answer replies to, got role {last['role']!r}",
                         f"messages[{len(messages) - 1}].role")
    first = len(messages) - 1  # the question's message: the last, or the first of the trailing tool results
    while last["role"] == "tool" and first > 0 and messages[first - 1]["role"] == "tool":
        first -= 1
    if last["role"] == "tool" and context is not None:
        raise FieldError("a context opens the last user turn: with tool results last there is none; send the "
                         "document in an earlier message", "context")
    if last["role"] == "user" and not last["content"].strip():
        raise FieldError(f"messages[{len(messages) - 1}].content is empty: Phase 2 needs at least one query "
                         f"token; pass a question", f"messages[{len(messages) - 1}].content")
    if context is not None and not isinstance(context, str):
        raise FieldError(f"context must be a str or None, got {describe(context)}", "context")
    longest = max((len(m["content"]) for m in messages), default=0)
    check_fits(tokenizer, ([] if context is None else [context]) + [m["content"] for m in messages], limit,
               "context" if context is not None and len(context) >= longest else "messages")
    if getattr(tokenizer, "chat_template", None):
        wrapped = [dict(m, content=_wrap_special(tokenizer, m["content"], f"messages[{i}].content"))
                   for i, m in enumerate(messages)]
        head = "" if context is None else _wrap_special(tokenizer, context, "context")
        mark = _split_marker([m["content"] for m in messages] + ([] if context is None else [context]))
        wrapped[first]["content"] = head + mark + wrapped[first]["content"]
        return _split_rendered(tokenizer, wrapped, mark, tools)
    parts = [m["content"] for m in messages[:first]] + ([] if context is None else [context])
    text = "\n\n".join(parts)
    if not text:
        raise FieldError("there is no context: the tokenizer has no chat template, so Phase 1 encodes the messages "
                         "before the question (or a given context); add the document before the question", "messages")
    query = "\n\n".join(m["content"] for m in messages[first:])
    return split_plain(tokenizer, text, query)  # check_fits ran above, over the same text


def split_plain(tokenizer, context: str, query: str, limit: Optional[int] = None) -> Prompt:
    """The template-free split (base models, raw completions): ``context`` as text, with the tokenizer's BOS
    first when it adds one, and ``query`` as text (special-token strings in either are text). ``limit``: the
    model's positions (:func:`check_fits`)."""
    check_fits(tokenizer, [context, query], limit, "context" if len(context) >= len(query) else "query")
    ids = encode_text(tokenizer, context)  # a BOS string in the context is text: the real BOS goes first
    return Prompt(torch.cat((bos_ids(tokenizer), ids)), encode_text(tokenizer, query))


def bos_ids(tokenizer) -> torch.Tensor:
    """``(1,)`` the tokenizer's BOS id when it puts one in front of a text (Gemma's, Llama 3's), else ``(0,)``
    (SmolLM2's adds none): what a plain text starts with, exactly once."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None:
        probe = tokenizer("x", add_special_tokens=True)["input_ids"]
        if probe and probe[0] == bos:
            return torch.tensor([bos], dtype=torch.long)
    return torch.zeros(0, dtype=torch.long)
