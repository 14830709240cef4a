"""How a prompt is cut into Phase 1's context and Phase 2's query when the client does not say (docs/serving.md,
"Prompts and the two phases"): the rules alone, on text and a tokenizer -- no request, no engine.

* a chat's long last user message (at least ``--paste-threshold`` tokens, :data:`PASTE_TOKENS` by default) holds a
  pasted document: :func:`split_pasted` cuts it into (document, question);
* a completion's text prompt is cut after its last blank line (else its last line break) before non-blank text:
  :func:`split_completion`; a prompt with no line break, or token ids, is cut between tokens (its last
  :data:`QUERY_CUT_TOKENS` are the query);
* a completion's document (``magnetar.context``, or a context pinned with format ``raw``) ends with a blank line:
  :func:`raw_document`.
"""
from __future__ import annotations

from typing import Optional

PASTE_TOKENS = 1024  # --paste-threshold's default: a last user message this long (tokens) holds a document
QUERY_CUT_TOKENS = 64  # a prompt with no line break to cut at (or token ids): its last this many tokens are the query


def raw_document(doc: str) -> str:
    """A completion's document (``magnetar.context``, or ``POST /v1/contexts`` with format ``raw``) as Phase 1
    encodes it: ending with a blank line (``"\\n\\n"`` is added unless it ends with a line break already), so that the
    prompt after it starts a paragraph of its own instead of running on from the document's last sentence."""
    return doc if doc.endswith("\n") else doc + "\n\n"


def split_completion(prompt: str) -> Optional[tuple[str, str]]:
    """A raw prompt's (context, query): cut after its last blank line before non-blank text, else after its last
    newline; None when it has neither or the context would be blank (then the caller cuts tokens)."""
    body = prompt.rstrip()
    cut = body.rfind("\n\n")
    cut = cut + 2 if cut >= 0 else body.rfind("\n") + 1
    if cut <= 0 or not prompt[:cut].strip():
        return None
    return prompt[:cut], prompt[cut:]


def split_pasted(tokenizer, text: str, threshold: int) -> Optional[tuple[str, str]]:
    """(document, question) of a chat's last user message of at least ``threshold`` tokens (0: never), else None.

    The question is what follows the message's last blank line before non-blank text; when there is none, or what
    follows is itself longer than ``threshold // 2`` tokens, what follows its last line break; failing that, its
    last :data:`QUERY_CUT_TOKENS` tokens before any trailing blank lines and spaces (a cut between two tokens). The
    document is everything before, and is never blank; neither is the question. At a blank line the cut falls after
    its first line break (the question starts with the second): a byte-level BPE tokenizer makes one token of a run
    of line breaks that ends the text, and two of the same run inside it, so a document ending in one line break
    tokenizes as the start of the whole conversation does -- the next turn's context then starts with this one's
    token for token, and extends it (prefix reuse). The threshold counts tokens, never characters."""
    # a token holds at least one UTF-8 byte (a CJK character or an emoji is 2-4 tokens of a byte-level BPE, and a
    # character count would miss them): fewer bytes than the threshold cannot be that many tokens
    if threshold <= 0 or len(text.encode("utf-8", "surrogatepass")) < threshold:
        return None
    enc = tokenizer(text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)
    starts = [a for a, _ in enc["offset_mapping"]]
    if len(starts) < threshold:
        return None
    body = text.rstrip()
    starts = [a for a in starts if a < len(body)]  # trailing blank lines and spaces are no question
    if len(starts) < 2:
        return None
    for sep in ("\n\n", "\n"):
        cut = body.rfind(sep)
        if cut < 0:
            continue
        cut += 1
        tail_tokens = sum(a >= cut for a in starts)
        if text[:cut].strip() and text[cut:].strip() and tail_tokens <= threshold // 2:
            return text[:cut], text[cut:]
    cut = starts[len(starts) - min(QUERY_CUT_TOKENS, len(starts) - 1)]
    return (text[:cut], text[cut:]) if text[:cut].strip() else None
