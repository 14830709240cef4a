"""A request's inputs, checked: strings or ids -> token ids (the one place every entry tokenizes), the length
checks against the model's positions and the decode policy, the ranks' agreement, and the request's sampling
parameters and sampler -- together :meth:`Requests.check`, which makes the one :class:`CheckedRequest` the rest of
the pipeline trusts (``Engine.check``; the server's tick carries it to every rank).

Every check raises ``ValueError`` naming the argument before any compute (:mod:`magnetar.engine.inputs`): a
:class:`~magnetar.config.FieldError` whose ``field`` says which (``context``, ``query``, ``max_new_tokens``, a
sampling field, ``options.<name>``), so a caller maps it to its own names without reading the message. Strings
are tokenized with the chat template (:mod:`magnetar.engine.template`), and one too long for the model is refused
from a bounded prefix. This module knows nothing of methods, phases or batches.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from magnetar.config import EngineConfig, FieldError
from magnetar.engine import inputs
from magnetar.engine.agree import check_request
from magnetar.engine.grammar import check_grammar
from magnetar.engine.sampling import RequestSampler, SamplingParams
from magnetar.engine.strategy import DecodePolicy, plan_for_length
from magnetar.engine.template import Prompt, encode_text, split_prompt
from magnetar.parallel import ParallelGroups

# the sampling fields whose None means "this engine's config.decode value"
DEFAULTED = ("temperature", "top_p", "top_k", "seed")


def check_fit(context_tokens: int, query_tokens: int, max_new_tokens: Optional[int], *,
              max_positions: Optional[int], config: Optional[EngineConfig] = None,
              policy: Optional[DecodePolicy] = None) -> Optional[int]:
    """One request's checks against the model and its method -- pure, no collective: the engine's entries and the
    server's request checks both call it. The context, query and ``max_new_tokens`` fit ``max_positions``
    (``max_new_tokens`` None: at least one new token); ``config``'s method can run the context (its checks and
    block plan on the first and last CP rank, e.g. a block larger than the context); ``policy``'s limits hold.
    Returns the positions left after context and query (None without a limit); ValueError otherwise."""
    L, Q = context_tokens, query_tokens
    if max_new_tokens is not None:
        inputs.check_positions(L, Q, max_new_tokens, max_positions)
    elif max_positions is not None and L + Q + 1 > max_positions:
        raise FieldError(f"the context ({L} tokens) + query ({Q}) + one new token exceeds "
                         f"{inputs.positions_phrase(max_positions)}; shorten the context by at least "
                         f"{L + Q + 1 - max_positions} tokens", "context")
    try:
        if config is not None:
            for rank in sorted({0, config.parallel.cp_size - 1}):
                plan_for_length(config, L, rank)
        if policy is not None:
            policy.check(L)
    except ValueError as e:  # the method or the decode policy cannot run a context of this length
        raise FieldError(str(e), "context", setting=getattr(e, "field", None)) from None
    return None if max_positions is None else max_positions - L - Q


@dataclass(frozen=True)
class CheckedRequest:
    """One generation request, checked once (:meth:`Requests.check`, ``Engine.check``): what the rest of the
    pipeline -- the server's tick, ``ContinuousBatch.encode``, Phase 1, Phase 2 -- trusts without checking again.

    ``context_ids`` ``(L,)`` and ``query_ids`` ``(Q,)`` int64 on CPU, in the vocabulary, fitting the model's
    positions with ``params.max_new_tokens`` and runnable by the method (its block plan) and the decode policy;
    ``params`` the request's :class:`~magnetar.engine.sampling.SamplingParams`; ``options`` the per-request
    encoding options (``Engine.variant``; empty: the engine's own); ``key`` the context's cache key under those
    options; ``handle`` the encoded context when the request came with one (``Engine.encode``; not sent to
    other ranks: they hold their own part of it)."""

    context_ids: torch.Tensor
    query_ids: torch.Tensor
    params: SamplingParams
    key: str
    options: dict = field(default_factory=dict)
    handle: Any = field(default=None, compare=False, repr=False)  # a ContextHandle, or None

    @property
    def context_tokens(self) -> int:
        return int(self.context_ids.numel())

    @property
    def query_tokens(self) -> int:
        return int(self.query_ids.numel())

    def reseeded(self, offset: int) -> "CheckedRequest":
        """The same request with its seed plus ``offset`` (choice ``offset`` of ``n``: sampled choices differ and
        repeat)."""
        if offset == 0:
            return self
        return dataclasses.replace(self, params=self.params.replace(seed=self.params.seed + offset))

    def to_dict(self, *, context: bool = True) -> dict:
        """JSON-able fields (the tick's); ``context=False`` leaves the context's ids out (a context the receiving
        ranks hold already: give them back to :meth:`from_dict`)."""
        params = dataclasses.asdict(self.params)
        params["stop"] = list(params["stop"])
        return {"context_ids": self.context_ids.tolist() if context else None, "query_ids": self.query_ids.tolist(),
                "params": params, "key": self.key, "options": dict(self.options)}

    @classmethod
    def from_dict(cls, d: dict, *, context_ids: Optional[torch.Tensor] = None, handle: Any = None) -> "CheckedRequest":
        """The request :meth:`to_dict` wrote, trusted as it was checked where it was made (the ranks of one
        replica receive it from their leader); ``context_ids`` / ``handle`` supply a context left out."""
        ids = context_ids if d["context_ids"] is None else torch.tensor(d["context_ids"], dtype=torch.long)
        return cls(ids, torch.tensor(d["query_ids"], dtype=torch.long), SamplingParams(**d["params"]), d["key"],
                   dict(d["options"]), handle)


def sampling_key(params: SamplingParams) -> tuple:
    """The sampling fields the ranks must agree on (max_new_tokens and stop are fields of their own)."""
    return params.temperature, params.top_p, params.top_k, params.seed, params.grammar


class Requests:
    """Checks and tokenizes one engine's requests. ``tokenizer`` may be None (then only token ids are accepted);
    ``model_config`` gives the vocabulary, positions and EOS ids; ``policy`` is the decode policy whose limits a
    context must meet."""

    def __init__(self, tokenizer, model, config: EngineConfig, groups: ParallelGroups, device: torch.device,
                 policy: Optional[DecodePolicy] = None):
        self.tokenizer, self.model, self.config, self.groups, self.device = tokenizer, model, config, groups, device
        self.policy = policy
        # the model's positions, or runtime.max_model_len below them (refused above them, by name)
        self.max_positions = inputs.position_limit(getattr(model.config, "max_position_embeddings", None),
                                                   config.runtime.max_model_len)

    @property
    def vocab_size(self) -> Optional[int]:
        return getattr(self.model.config, "vocab_size", None)

    # -- token ids ------------------------------------------------------------------------------------------
    def pair(self, context, query) -> tuple[torch.Tensor, torch.Tensor]:
        """Checked ``(context ids (L,), query ids (Q,))`` int64 on CPU: both strings (the chat template's two
        phases) or both id tensors."""
        strings = not (isinstance(context, torch.Tensor) or isinstance(query, torch.Tensor))
        if not strings:
            if not (isinstance(context, torch.Tensor) and isinstance(query, torch.Tensor)):
                raise ValueError("pass context and query both as strings or both as token-id tensors")
            c, q = context.reshape(-1).long().cpu(), query.reshape(-1).long().cpu()
        else:
            p = self._prompt(context, query)
            c, q = p.context_ids, p.query_ids
        inputs.check_token_ids(c, "context", self.vocab_size, tokenized=strings)
        inputs.check_token_ids(q, "query", self.vocab_size, tokenized=strings)
        return c, q

    def context_ids(self, context) -> torch.Tensor:
        """Checked context ids: a string is cut from the chat template rendered with a stand-in question (the split
        is at the end of the context, so the ids are those :meth:`pair` gives)."""
        inputs.check_prompt(context, "context")
        if isinstance(context, torch.Tensor):
            c, strings = context.reshape(-1).long().cpu(), False
        else:
            c, strings = self._prompt(context, "?").context_ids, True
        inputs.check_token_ids(c, "context", self.vocab_size, tokenized=strings)
        return c

    def query_ids(self, query) -> torch.Tensor:
        """Checked query ids: a string is cut from the template rendered with a stand-in context (the question part
        -- question, end of turn, assistant header -- does not depend on the context)."""
        inputs.check_prompt(query, "query")
        if isinstance(query, torch.Tensor):
            q, strings = query.reshape(-1).long().cpu(), False
        else:
            q, strings = self._prompt(".", query).query_ids, True
        inputs.check_token_ids(q, "query", self.vocab_size, tokenized=strings)
        return q

    def plain_ids(self, x, name: str, min_tokens: int = 1) -> torch.Tensor:
        """``x`` (a string tokenized as plain text -- no chat template, never a special id -- or ids), checked."""
        if isinstance(x, torch.Tensor):
            ids, strings = x.reshape(-1).long().cpu(), False
        else:
            ids, strings = encode_text(self._need_tokenizer(), x, limit=self.max_positions,
                                       name="context or continuation"), True
        inputs.check_token_ids(ids, name, self.vocab_size, min_tokens=min_tokens, tokenized=strings)
        return ids

    def _prompt(self, context: str, query: str) -> Prompt:
        return split_prompt(self._need_tokenizer(), context, query, limit=self.max_positions)

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("string inputs need a tokenizer: init_inference(model, config, tokenizer=...)")
        return self.tokenizer

    # -- checks ---------------------------------------------------------------------------------------------
    def check_lengths(self, context_tokens: int, query_tokens: int, max_new_tokens: int) -> None:
        """The request fits the model's positions, this engine's method and its decode policy (:func:`check_fit`)."""
        check_fit(context_tokens, query_tokens, max_new_tokens, max_positions=self.max_positions, config=self.config,
                  policy=self.policy)

    def agree(self, entry: str, contexts: Sequence[torch.Tensor], queries: Sequence[torch.Tensor],
              params: Optional[SamplingParams] = None, *, return_logits: bool = False, **more: Any) -> None:
        """Every rank of the replica got the same request (one small gather; nothing on one rank or simulated)."""
        if params is not None:
            more.update(max_new_tokens=params.max_new_tokens, stop=params.stop, return_logits=return_logits,
                        sampling=sampling_key(params))
        check_request(self.groups, self.config, self.device, entry=entry, contexts=list(contexts),
                      queries=list(queries), **more)

    # -- sampling -------------------------------------------------------------------------------------------
    def sampling_params(self, params: Optional[SamplingParams] = None, **fields: Any) -> SamplingParams:
        """A request's :class:`~magnetar.engine.sampling.SamplingParams`: ``params`` (default: this engine's
        ``config.decode`` for temperature, top_p, top_k and seed, 64 new tokens, no stop strings) with ``fields``
        changed; temperature, top_p, top_k or seed given as None keep the default, ``stop=None`` is no stop strings.
        A bad value or an unknown field is a ValueError naming it, and so is a value this model cannot give (more
        ``logprobs`` alternatives than its vocabulary has)."""
        if params is not None and not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams (SamplingParams(max_new_tokens=..., ...) or "
                             f"engine.sampling_params(...)), got {type(params).__name__}")
        base = params if params is not None else SamplingParams.from_decode_config(self.config.decode)
        params = base.replace(**{k: v for k, v in fields.items() if v is not None or k not in DEFAULTED})
        vocab = self.vocab_size
        if params.logprobs is not None and vocab is not None and params.logprobs > vocab:
            raise FieldError(f"logprobs must be at most the model's vocabulary size ({vocab} tokens: there are no "
                             f"more alternatives), got {params.logprobs}", "logprobs")
        if params.grammar is not None:  # compiles for this tokenizer, or a FieldError naming where it does not
            self.check_grammar(params.grammar)
        return params

    # -- the one check of a generation request --------------------------------------------------------------
    def check(self, context, query, params: Optional[SamplingParams] = None, *, key_of, options: Optional[dict] = None,
              key: Optional[str] = None, handle: Any = None, default_max_new_tokens: Optional[int] = None,
              **fields: Any) -> CheckedRequest:
        """One request as a :class:`CheckedRequest`: ``context`` (a string, ids, or None with ``handle``: an
        encoded context whose ids it takes) and ``query`` (a string or ids) to checked ids, the sampling params
        (:meth:`sampling_params` of ``params`` and ``fields``), the lengths against the model, this configuration's
        method and the decode policy (:func:`check_fit`). ``default_max_new_tokens``: when neither ``params`` nor
        ``fields`` gives ``max_new_tokens``, at most this many, capped to the positions left after the prompt (a
        server's default). ``key`` the context's cache key when the caller has it, else ``key_of(ids)``. A bad
        request is a :class:`~magnetar.config.FieldError` naming its field; no collective."""
        if handle is not None:
            c = handle.context_ids
        else:
            c = self.context_ids(context)
        q = self.query_ids(query)
        L, Q = int(c.numel()), int(q.numel())
        if fields.get("max_new_tokens", 0) is None:  # not given: the default
            del fields["max_new_tokens"]
        if default_max_new_tokens is not None and "max_new_tokens" not in fields and params is None:
            room = check_fit(L, Q, None, max_positions=self.max_positions)
            fields["max_new_tokens"] = default_max_new_tokens if room is None else min(default_max_new_tokens, room)
        params = self.sampling_params(params, **fields)
        self.check_lengths(L, Q, params.max_new_tokens)
        return CheckedRequest(c, q, params, key if key is not None else key_of(c), dict(options or {}), handle)

    def sampler(self, params: SamplingParams) -> RequestSampler:
        """A fresh :class:`~magnetar.engine.sampling.RequestSampler` for one request."""
        return RequestSampler(params, vocab_size=int(self.model.config.vocab_size), eos_ids=self.eos_ids(),
                              tokenizer=self.tokenizer)

    def check_grammar(self, grammar: str) -> None:
        """A FieldError naming ``grammar`` when llguidance cannot compile it for this model's tokenizer."""
        check_grammar(grammar, self.tokenizer, int(self.vocab_size), tuple(self.eos_ids()))

    def eos_ids(self) -> list[int]:
        ids = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if ids is None and self.tokenizer is not None:
            ids = self.tokenizer.eos_token_id
        if ids is None:
            return []
        return [ids] if isinstance(ids, int) else list(ids)
