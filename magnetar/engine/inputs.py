"""Argument checks of the engine's public entry points: ``init_inference``, ``Engine.generate`` /
``generate_batch`` / ``score`` / ``score_variants``.

Every check raises ``ValueError`` naming the argument (a :class:`~magnetar.config.FieldError` whose ``field`` is
the argument's name where a request's field is checked), what was passed and what to pass instead, before any
compute or collective; nothing is coerced silently (a ``bool`` is not an ``int``, ``2.5`` is not ``2``, a
``str`` is not a list of strings, a float tensor is not token ids). What the entries accept:

* ``context`` / ``query`` / ``continuation``: a ``str`` (needs a tokenizer) or a token-id tensor of an integer
  dtype, 1-D ``(N,)`` or ``(1, N)``. A ``list`` of ids is refused (wrap it: ``torch.tensor(ids)``), so a list
  can never be mistaken for a batch; ``bytes`` are refused (decode them first). Ids must lie in
  ``[0, model.config.vocab_size)``, whether given or produced by the tokenizer. The context must not be empty
  (Phase 1 encodes at least one token; dense attention over nothing is not a request worth a special path),
  the query neither, and a scored continuation needs at least 2 tokens.
* ``max_new_tokens``: an ``int`` >= 1 with ``context + query + max_new_tokens`` within the model's positions.
* ``stop``: None or a list/tuple of non-empty strings. ``return_logits``: a ``bool``.
* ``requests`` (``generate_batch``): a non-empty list/tuple of ``(context, query)`` pairs.
* ``sparse`` (``score_variants``): a non-empty list/tuple of None / a decode-policy section (``SparseConfig``,
  ``LukaConfig``: ``config.DECODE_SECTIONS``).
* ``init_inference``: ``model`` a loaded HF causal LM (``torch.nn.Module`` with a ``.config``), a registered
  model name, a local model folder or a Hugging Face Hub id ``org/name`` (a ``str``, ``bytes`` or
  ``os.PathLike``: which one is decided when it is loaded); ``config`` None or an ``EngineConfig`` (a dict is
  refused: build it with ``EngineConfig.from_dict``); ``tokenizer`` None or callable with ``decode``; ``groups``
  None or ``ParallelGroups``; ``revision`` None or a non-empty ``str``, ``trust_remote_code`` a ``bool``,
  ``cache_dir`` None or a path -- all three only with a model given by name (a loaded model has nothing to load).

This module knows nothing about methods, phases or ranks.
"""
from __future__ import annotations

import numbers
import os
from typing import Optional, Sequence, Union

import torch

from magnetar.config import DECODE_SECTIONS, SECTIONS, EngineConfig, FieldError, PolicySection, describe
# the stop strings' limits live in the config layer (the server's flags read them without importing the engine)
from magnetar.config.checks import MAX_STOP_CHARS, MAX_STOP_STRINGS
from magnetar.models import MODELS
from magnetar.models.hub import check_hub_options
from magnetar.parallel import ParallelGroups

_MIN_TOKENS_WHY = {
    "context": "Phase 1 encodes at least one context token; pass a non-empty context",
    "query": "Phase 2 needs at least one query token; pass a question",
    "continuation": "scoring needs at least 2 (token i + 1 is scored given tokens 0..i); pass a longer continuation",
    "answer": "there is nothing to score; pass the answer's token ids (e.g. GenerationResult.token_ids)",
}


def is_int(value) -> bool:
    """True for an integer that is not a bool (``True`` would otherwise count as 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


# -- prompts and token ids --------------------------------------------------------------------------------
def check_prompt(value, name: str) -> None:
    """``value`` is a ``str`` or an integer token-id tensor ``(N,)`` / ``(1, N)``; else a ``ValueError`` naming
    ``name``."""
    if isinstance(value, str):
        check_unicode(value, name)
        return
    if isinstance(value, (bytes, bytearray)):
        raise FieldError(f"{name} is bytes; pass a str (decode it first: .decode('utf-8')) or a tensor of token "
                         f"ids", name)
    if isinstance(value, (list, tuple)):
        raise FieldError(f"{name} is a {type(value).__name__}; pass a str or a 1-D tensor of token ids "
                         f"(torch.tensor(ids)) -- for several requests use generate_batch([(context, query), ...])",
                         name)
    if not isinstance(value, torch.Tensor):
        raise FieldError(f"{name} must be a str or a 1-D tensor of token ids, got {describe(value)}", name)
    if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
        raise FieldError(f"{name} is a {value.dtype} tensor; token ids must be an integer tensor "
                         f"(e.g. torch.long), not rounded or cast from {value.dtype}", name)
    if value.dim() == 0 or value.dim() > 2 or (value.dim() == 2 and value.shape[0] != 1):
        raise FieldError(
            f"{name} has shape {tuple(value.shape)}; one request takes token ids of shape (N,) or (1, N) -- "
            f"for several requests use generate_batch([(context, query), ...])", name)


def check_unicode(text: str, name: str) -> None:
    """``text`` holds no lone surrogate (a Python ``str`` can; no tokenizer or UTF-8 text can)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise FieldError(f"{name} holds a lone surrogate (U+{ord(text[e.start]):04X} at index {e.start}), which is not "
                         f"Unicode text; decode the source with errors='replace' or remove it", name) from None


_INT64 = 2**63


def check_token_ids(ids: Union[torch.Tensor, Sequence[int]], name: str, vocab_size: Optional[int], *,
                    min_tokens: int = 1, tokenized: bool = False) -> None:
    """``ids (N,)`` integer: at least ``min_tokens`` of them, each in ``[0, vocab_size)``. ``ids`` may be a list of
    Python ints not yet made a tensor (a client's): then ints past int64 are refused too, also without a
    vocabulary (``torch.tensor`` would fail on them).

    ``tokenized``: the ids came from the tokenizer (an id out of range then means it does not match the model).
    """
    tensor = isinstance(ids, torch.Tensor)
    n = int(ids.numel()) if tensor else len(ids)
    if n < min_tokens:
        why = _MIN_TOKENS_WHY.get(name, f"pass at least {min_tokens}")
        raise FieldError(f"the {name} is empty: {why}" if n == 0 else f"the {name} has {n} token(s); {why}", name)
    if n == 0 or (vocab_size is None and tensor):
        return
    lo, hi = (int(x) for x in ids.aminmax()) if tensor else (min(ids), max(ids))
    if (lo >= 0 and hi < vocab_size) if vocab_size is not None else (-_INT64 <= lo and hi < _INT64):
        return
    bad = lo if lo < 0 else hi
    where = int((ids == bad).nonzero()[0, 0]) if tensor else ids.index(bad)
    shown = bad if bad.bit_length() <= 128 else f"of {bad.bit_length()} bits"  # a huge int's repr is slow, or refused
    fix = ("the tokenizer does not match the model; pass the model's own tokenizer" if tokenized else
           "pass ids from the model's own tokenizer")
    if vocab_size is None:
        raise FieldError(f"{name} holds token id {shown} (at index {where}), past int64: no model has such an id; "
                         f"{fix}", name)
    raise FieldError(f"{name} holds token id {shown} (at index {where}), outside the model's vocabulary "
                     f"[0, {vocab_size}) (model.config.vocab_size = {vocab_size}); {fix}", name)


def answer_ids(value, vocab_size: Optional[int]) -> torch.Tensor:
    """``score_answer``'s ``answer``: token ids as a list of ints or an integer tensor, at least one, in the
    vocabulary; returned as ``(T,)`` int64 on CPU."""
    if isinstance(value, (list, tuple)):
        if not all(is_int(t) for t in value):
            raise ValueError("answer must be token ids (ints), e.g. GenerationResult.token_ids; got "
                             f"{describe(next(t for t in value if not is_int(t)))} in the list")
        value = torch.tensor(list(value), dtype=torch.long)
    if isinstance(value, str):
        raise ValueError("answer must be token ids (GenerationResult.token_ids), not text: text would be "
                         "tokenized differently from what the model generated")
    check_prompt(value, "answer")
    ids = value.reshape(-1).long().cpu()
    check_token_ids(ids, "answer", vocab_size)
    return ids


# -- generation options -----------------------------------------------------------------------------------
def check_max_new_tokens(value) -> None:
    if not is_int(value):
        raise FieldError(f"max_new_tokens must be an int >= 1, got {describe(value)}", "max_new_tokens")
    if value < 1:
        raise FieldError(f"max_new_tokens must be >= 1, got {value}", "max_new_tokens")


class PositionLimit(int):
    """The most positions a request may use: the model's ``max_position_embeddings``, or ``runtime.max_model_len``
    below it (``capped``) -- an int that says which in the messages (:func:`positions_phrase`)."""

    capped: bool

    def __new__(cls, value: int, capped: bool = False):
        limit = super().__new__(cls, value)
        limit.capped = capped
        return limit


def position_limit(model_positions: Optional[int], max_model_len: Optional[int]) -> Optional[int]:
    """The engine's :class:`PositionLimit`: ``max_model_len`` (``runtime.max_model_len``) when given -- at most
    ``model_positions``, the model's ``max_position_embeddings`` (ValueError naming the field otherwise) --, else the
    model's (None: the model names none)."""
    if max_model_len is None:
        return None if model_positions is None else PositionLimit(model_positions)
    if model_positions is not None and max_model_len > model_positions:
        raise FieldError(f"runtime.max_model_len ({max_model_len}) exceeds the model's {model_positions} positions "
                         f"(max_position_embeddings): give at most {model_positions} (--max-model-len)",
                         "max_model_len")
    return PositionLimit(max_model_len, capped=max_model_len != model_positions)


def positions_phrase(limit: int) -> str:
    """How a message names ``limit``: the model's positions, or this engine's cap (``--max-model-len``)."""
    if getattr(limit, "capped", False):
        return f"the {limit} positions of runtime.max_model_len (--max-model-len)"
    return f"the model's {limit} positions"


def check_positions(context: int, query: int, max_new_tokens: int, max_positions: Optional[int]) -> None:
    """``context + query + max_new_tokens`` tokens must fit the model's positions; the error says by how much to
    lower ``max_new_tokens`` or shorten the context."""
    total = context + query + max_new_tokens
    if max_positions is None or total <= max_positions:
        return
    room, excess = max_positions - context - query, total - max_positions
    fixes = [f"lower max_new_tokens to at most {room}"] if room >= 1 else []
    if excess < context:  # at least one context token stays
        fixes.append(f"shorten the context by at least {excess} tokens")
    fix = " or ".join(fixes) or f"shorten the query ({query} tokens) and the context"
    raise FieldError(f"context ({context}) + query ({query}) + max_new_tokens ({max_new_tokens}) = {total} tokens "
                     f"exceeds {positions_phrase(max_positions)}"
                     f"{'' if getattr(max_positions, 'capped', False) else ' (max_position_embeddings)'}; {fix}",
                     "max_new_tokens" if room >= 1 else "context")  # room for one new token: fewer new tokens


def check_stop(stop, max_count: int = MAX_STOP_STRINGS) -> None:
    """``stop``: None or a list/tuple of at most ``max_count`` non-empty strings of at most
    :data:`MAX_STOP_CHARS` characters each."""
    if stop is None:
        return
    if isinstance(stop, (str, bytes)):
        wrapped = repr(stop) if len(stop) <= 60 else "..."
        raise FieldError(f"stop must be a list of strings, got the {describe(stop)}; wrap it: stop=[{wrapped}]", "stop")
    if not isinstance(stop, (list, tuple)):
        raise FieldError(f"stop must be None or a list of strings, got {describe(stop)}", "stop")
    if len(stop) > max_count:
        raise FieldError(f"stop holds {len(stop)} strings; at most {max_count} are allowed: keep the ones that "
                         f"matter", "stop")
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            raise FieldError(f"stop[{i}] must be a non-empty str (an empty one would stop at once), got "
                             f"{describe(s)}", "stop")
        if len(s) > MAX_STOP_CHARS:
            raise FieldError(f"stop[{i}] is {len(s)} characters long; a stop string may have at most "
                             f"{MAX_STOP_CHARS}", "stop")


def check_flag(value, name: str) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {describe(value)}")


def check_requests(requests) -> None:
    """``requests``: a non-empty list/tuple of ``(context, query)`` pairs, each checked by :func:`check_prompt`."""
    if not isinstance(requests, (list, tuple)):
        raise ValueError(f"requests must be a list of (context, query) pairs, got {describe(requests)}")
    if not requests:
        raise ValueError("generate_batch needs at least one (context, query) request")
    for i, r in enumerate(requests):
        if not isinstance(r, (list, tuple)) or len(r) != 2:
            got = f"a {type(r).__name__} of {len(r)}" if isinstance(r, (list, tuple)) else describe(r)
            raise ValueError(f"requests[{i}] must be a (context, query) pair, got {got}; for one request use "
                             f"generate(context, query) or generate_batch([(context, query)])")
        where = f"requests[{i}] " if len(requests) > 1 else ""  # generate() passes one request
        check_prompt(r[0], f"{where}context")
        check_prompt(r[1], f"{where}query")


def check_score(context, continuation, variants) -> None:
    """``score_variants``'s arguments: the two prompts and a non-empty list of decoding variants."""
    check_prompt(context, "context")
    check_prompt(continuation, "continuation")
    kinds = [SECTIONS[s].__name__ for s in DECODE_SECTIONS]  # the decode-policy sections: SparseConfig, LukaConfig
    if not isinstance(variants, (list, tuple)):
        raise ValueError(f"sparse must be a list of decoding variants (None, {' or '.join(kinds)}), "
                         f"got {describe(variants)}; for one variant pass [variant]")
    if not variants:
        raise ValueError("sparse is empty; pass at least one decoding variant (None for dense decoding)")
    for i, v in enumerate(variants):
        if v is not None and not (isinstance(v, PolicySection) and v.section in DECODE_SECTIONS):
            raise ValueError(f"sparse[{i}] must be None or a {' or a '.join(kinds)}, got {describe(v)}"
                             + (f"; build it with {'(**d) or '.join(kinds)}(**d)" if isinstance(v, dict) else ""))


# -- init_inference ---------------------------------------------------------------------------------------
def is_model_path(model) -> bool:
    """True for a model given by name (registry name, local folder or Hub id), to be loaded by ``load_model``."""
    return isinstance(model, (str, bytes)) or isinstance(model, os.PathLike)


def check_tokenizer_fits(tokenizer, hf_config) -> None:
    """A tokenizer given to ``init_inference`` (``--tokenizer``: another model's) must not make ids the model has no
    embedding for: ValueError naming both sizes."""
    size = len(tokenizer) if callable(getattr(tokenizer, "__len__", None)) else None
    vocab = getattr(hf_config, "vocab_size", None)
    if isinstance(size, int) and isinstance(vocab, int) and size > vocab:
        raise ValueError(f"the tokenizer (tokenizer=, --tokenizer) has {size} tokens, more than the model's vocabulary "
                         f"of {vocab} (config vocab_size): its ids from {vocab} on have no embedding; give a tokenizer "
                         f"of at most {vocab} tokens (the model's own, or a smaller model's)")


def check_init(model, config, tokenizer, groups, *, revision=None, trust_remote_code=False, cache_dir=None) -> None:
    """``init_inference``'s arguments (the flat config fields are checked by ``EngineConfig``; whether a model name
    is a registry name, a local folder or a Hub id is decided by ``load_model``)."""
    if not is_model_path(model) and not (isinstance(model, torch.nn.Module) and hasattr(model, "config")):
        raise ValueError(f"model must be a loaded Hugging Face causal LM (a transformers PreTrainedModel), a "
                         f"registered model name ({', '.join(sorted(MODELS))}), a local model folder or a Hugging "
                         f"Face Hub id (org/name); got {describe(model)}")
    check_hub_options(revision, trust_remote_code, cache_dir)
    if not is_model_path(model):
        given = [name for name, value, default in (("revision", revision, None), ("cache_dir", cache_dir, None),
                                                   ("trust_remote_code", trust_remote_code, False))
                 if value is not default]
        if given:
            raise ValueError(f"{' and '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to a model given by name "
                             f"(Hub id, folder or registry name), which init_inference loads; this model is loaded "
                             f"already: drop {'it' if len(given) == 1 else 'them'}")
    if config is not None and not isinstance(config, EngineConfig):
        raise ValueError(f"config must be an EngineConfig, got {describe(config)}; build one with "
                         f"EngineConfig.from_dict(d) / EngineConfig.from_file(path), or pass fields as keywords "
                         f"(init_inference(model, method='star', cp_size=2))")
    if tokenizer is not None and not (callable(tokenizer) and callable(getattr(tokenizer, "decode", None))):
        raise ValueError(f"tokenizer must be a Hugging Face tokenizer (callable, tokenizer(text) -> "
                         f"{{'input_ids': [...]}}, with .decode(ids)), got {describe(tokenizer)}")
    if groups is not None and not isinstance(groups, ParallelGroups):
        raise ValueError(f"groups must be a ParallelGroups from magnetar.parallel.init_groups(cp_size) (or None: "
                         f"init_inference creates them), got {describe(groups)}")
