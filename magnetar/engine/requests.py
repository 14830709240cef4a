"""A request's inputs, checked: strings or ids -> token ids (the one place every entry tokenizes), the length
checks against the model's positions and the decode policy, the ranks' agreement, and the request's sampling
parameters and sampler.

Every check raises ``ValueError`` naming the argument before any compute (:mod:`magnetar.engine.inputs`); strings
are tokenized with the chat template (:mod:`magnetar.engine.template`), and one too long for the model is refused
from a bounded prefix. This module knows nothing of methods, phases or batches.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from magnetar.config import EngineConfig
from magnetar.engine import inputs
from magnetar.engine.agree import check_request
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
        raise ValueError(f"the context ({L} tokens) + query ({Q}) + one new token exceeds the model's "
                         f"{max_positions} positions; shorten the context by at least {L + Q + 1 - max_positions} "
                         f"tokens")
    if config is not None:
        for rank in sorted({0, config.parallel.cp_size - 1}):
            plan_for_length(config, L, rank)
    if policy is not None:
        policy.check(L)
    return None if max_positions is None else max_positions - L - Q


def sampling_key(params: SamplingParams) -> tuple:
    """The sampling fields the ranks must agree on (max_new_tokens and stop are fields of their own)."""
    return params.temperature, params.top_p, params.top_k, params.seed


class Requests:
    """Checks and tokenizes one engine's requests. ``tokenizer`` may be None (then only token ids are accepted);
    ``model_config`` gives the vocabulary, positions and EOS ids; ``policy`` is the decode policy whose limits a
    context must meet."""

    def __init__(self, tokenizer, model, config: EngineConfig, groups: ParallelGroups, device: torch.device,
                 policy: Optional[DecodePolicy] = None):
        self.tokenizer, self.model, self.config, self.groups, self.device = tokenizer, model, config, groups, device
        self.policy = policy
        self.max_positions = getattr(model.config, "max_position_embeddings", None)

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
            raise ValueError(f"logprobs must be at most the model's vocabulary size ({vocab} tokens: there are no "
                             f"more alternatives), got {params.logprobs}")
        return params

    def sampler(self, params: SamplingParams) -> RequestSampler:
        """A fresh :class:`~magnetar.engine.sampling.RequestSampler` for one request."""
        return RequestSampler(params, vocab_size=int(self.model.config.vocab_size), eos_ids=self.eos_ids(),
                              tokenizer=self.tokenizer)

    def eos_ids(self) -> list[int]:
        ids = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if ids is None and self.tokenizer is not None:
            ids = self.tokenizer.eos_token_id
        if ids is None:
            return []
        return [ids] if isinstance(ids, int) else list(ids)
