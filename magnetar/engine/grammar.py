"""Constrained decoding: a request's grammar decides which tokens its answer may take (structured outputs).

A grammar is an llguidance grammar (a ``str``: ``llguidance.LLMatcher.grammar_from_json_schema(schema)``,
``grammar_from_regex``, ``grammar_from_lark``; :attr:`SamplingParams.grammar`). Each step, on every rank of the
replica, the request's :class:`TokenMask` follows the tokens chosen so far; on the rank that chooses, the tokens the
grammar does not allow next get ``-inf`` before the sampler's warpers (greedy and sampling alike), and the answer ends
when the grammar is complete (stop reason ``grammar``; EOS too, where the model has one). A request that runs out of
``max_new_tokens`` first ends as any other (``max_new_tokens``): its partial answer is never marked complete.

Why llguidance (docs/serving.md, "Structured outputs"): it is the grammar engine vLLM and SGLang use as a backend,
computes a mask in tens of microseconds without precompiling the vocabulary against each schema, has no dependency
(a Rust wheel), and takes JSON schemas, regular expressions and Lark grammars. xgrammar, the other maintained one,
pulls triton into a CPU install.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional

import torch

from magnetar.config import FieldError

MAX_GRAMMAR_CHARS = 1 << 20  # a grammar's text at most (a JSON schema of 1 MiB is far past any real one)

_TOKENIZERS: dict = {}  # (id(tokenizer), vocab_size, eos ids) -> (tokenizer, LLTokenizer): once per engine's tokenizer
_VALID: OrderedDict = OrderedDict()  # (grammar, LLTokenizer id) of grammars that compiled, most recent last
MAX_VALID = 256  # grammars remembered as valid (a server's schemas repeat: one compile check each, not per request)
_LOCK = threading.Lock()


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError as e:
        raise FieldError(f"a grammar (structured output) needs the llguidance package ({e}): pip install "
                         f"'magnetar[serve]' or pip install llguidance", "grammar") from None
    return llguidance


def grammar_tokenizer(tokenizer, vocab_size: int, eos_ids: tuple = ()):
    """llguidance's view of ``tokenizer`` over the model's ``vocab_size`` logits (made once, then shared); its end
    of text is the model's EOS ids ``eos_ids`` (the tokenizer's own when none): a grammar that is complete allows
    the token the engine stops at, never another that llguidance takes for EOS."""
    if tokenizer is None:
        raise FieldError("a grammar needs the model's tokenizer (init_inference(model, config, tokenizer=...))",
                         "grammar")
    llg = _llguidance()
    eos = tuple(int(t) for t in eos_ids if 0 <= int(t) < vocab_size)
    key = (id(tokenizer), vocab_size, eos)
    with _LOCK:
        found = _TOKENIZERS.get(key)
        if found is None or found[0] is not tokenizer:
            lltok = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos) if eos else None)
            found = _TOKENIZERS[key] = (tokenizer, lltok)
    return found[1]


def check_grammar(grammar: str, tokenizer, vocab_size: int, eos_ids: tuple = ()) -> None:
    """A FieldError naming ``grammar`` when llguidance cannot compile it for this tokenizer (its message says
    where: a JSON schema's path, a regex's position), or it is not a bounded string."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise FieldError(f"grammar must be a non-empty llguidance grammar string, got {type(grammar).__name__}",
                         "grammar")
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise FieldError(f"grammar is {len(grammar)} characters; at most {MAX_GRAMMAR_CHARS}", "grammar")
    lltok = grammar_tokenizer(tokenizer, vocab_size, eos_ids)
    key = (grammar, id(lltok))
    with _LOCK:
        if key in _VALID:
            _VALID.move_to_end(key)
            return
    error = _llguidance().LLMatcher.validate_grammar(grammar, lltok)
    if error:
        raise FieldError(f"grammar: {error}", "grammar")
    with _LOCK:
        _VALID[key] = None
        while len(_VALID) > MAX_VALID:
            _VALID.popitem(last=False)


class TokenMask:
    """One request's grammar state: :meth:`apply` masks its next token's logits, :meth:`consume` follows the
    chosen token (every rank: the stop decision must be the same everywhere)."""

    def __init__(self, grammar: str, tokenizer, vocab_size: int, eos_ids: tuple = ()):
        llg = _llguidance()
        self._torch = llg.torch
        lltok = grammar_tokenizer(tokenizer, vocab_size, eos_ids)
        self.matcher = llg.LLMatcher(lltok, grammar)
        self.bitmask = llg.torch.allocate_token_bitmask(1, lltok.vocab_size)
        # a model with no EOS cannot end a grammar by EOS: the token llguidance takes for it (an ordinary one) is
        # never allowed as the end (the answer ends where the grammar allows nothing more, or at max_new_tokens)
        self._no_eos = None if eos_ids else lltok.eos_token

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more."""
        return self.matcher.is_stopped()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits (V,)`` as float32 on the CPU with ``-inf`` where the grammar allows no token."""
        self._torch.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        if self._no_eos is not None and self.matcher.is_accepting():
            word, bit = divmod(self._no_eos, 32)
            keep = ~(1 << bit) & 0xFFFFFFFF
            self.bitmask[0, word] &= keep - (1 << 32) if keep >= 1 << 31 else keep  # int32 words
        scores = logits.detach().reshape(1, -1).float().cpu().clone()
        self._torch.apply_token_bitmask_inplace(scores, self.bitmask)
        return scores[0]

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            error: Optional[str] = self.matcher.get_error()
            raise ValueError(f"token {token} does not follow the request's grammar ({error})")
