"""Continuous batching: requests join the Phase-2 decode batch between steps and leave when finished.

:class:`ContinuousBatch` is what a server loop drives: :meth:`~ContinuousBatch.add` a request (its context's
Phase 1 -- skipped when the context cache holds it -- and its query forward, which chooses its first token; or
:meth:`~ContinuousBatch.prepare` several and :meth:`~ContinuousBatch.join` them: their queries in one forward),
:meth:`~ContinuousBatch.step` every unfinished request by one token (one model forward and one collective per
layer for all of them), :meth:`~ContinuousBatch.cancel` one, :meth:`~ContinuousBatch.pop` a finished one's
:class:`~magnetar.engine.results.GenerationResult`. Each request has its own sampler (seeded generator, stop
criteria) and decode-policy state, so its tokens equal those of it alone (``Engine.generate``), whatever joins
or leaves around it. Every rank of the model replica makes the same calls in the same order (they run
collectives); the server broadcasts what its leader decided.

Each token comes out as a :class:`TokenEvent` with the text it made final (transformers' ``TextStreamer``
rules, via :class:`~magnetar.engine.sampling.TextDeltas`): the deltas of a request joined are its answer text.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

from magnetar.engine.context import ContextHandle
from magnetar.engine.encode import Encoder
from magnetar.engine.finite import NonFiniteError
from magnetar.engine.phase2 import DecodeBatch, Phase2Request, RequestFailed
from magnetar.engine.requests import CheckedRequest, Requests
from magnetar.engine.results import Results
from magnetar.engine.sampling import RequestSampler, SamplingParams, TextDeltas
from magnetar.utils.nvtx import GENERATE, nvtx_range

# the stop reasons of a request that failed alone (its last event has no token), and the error each one raises
FAILED_ALONE = {"nonfinite": NonFiniteError, "failed": RequestFailed}


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of request ``rid``: its id, the text it made final (maybe ""; the last event of a
    request carries the rest of its text) and, on the request's last event, why it ended ("eos",
    "stop_string", "max_new_tokens" or "cancelled"; "nonfinite" when its logits turned NaN/inf, "failed" when its
    token choice raised -- it failed alone, no new token, ``error`` says where; else None). ``token_id`` is -1
    when the request has none."""

    rid: int
    token_id: int
    text: str
    stop_reason: Optional[str] = None
    error: Optional[str] = None
    # with SamplingParams.logprobs, on the replica's first rank: this token's (log p, [(id, log p)] alternatives);
    # with prompt_logprobs, the first event also carries the query tokens' (DecodeResult.prompt_logprobs)
    logprob: Optional[tuple] = None
    prompt_logprobs: Optional[list] = None

    def failure(self) -> Optional[Exception]:
        """The error of a request that failed alone (stop reason "nonfinite": NonFiniteError, "failed":
        RequestFailed; ``error`` its message), else None."""
        kind = FAILED_ALONE.get(self.stop_reason)
        return None if kind is None else kind(self.error)


@dataclass(frozen=True)
class Ready:
    """A checked request whose context is encoded (:meth:`ContinuousBatch.prepare`), ready to
    :meth:`ContinuousBatch.join`."""

    handle: ContextHandle
    cached: bool  # the context came from the cache (no Phase 1)
    query_ids: torch.Tensor  # (Q,) int64
    params: SamplingParams


@dataclass
class _Entry:
    handle: ContextHandle
    cached: bool
    query_ids: torch.Tensor
    sampler: RequestSampler
    deltas: Optional[TextDeltas]


def question(handle: ContextHandle, query_ids: torch.Tensor, sampler: RequestSampler) -> Phase2Request:
    """One question over ``handle``'s KV: a fresh view of the shard (its own decode-policy state)."""
    params = sampler.params
    return Phase2Request(handle.shard.view(), query_ids, handle.query_position, handle.context_tokens, sampler,
                         logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs,
                         context_logits=handle.last_logits if params.prompt_logprobs else None)


class ContinuousBatch:
    """Requests of one engine decoding together; see the module docstring. Made by ``Engine.open_batch()`` from
    the engine's parts: ``check`` is ``Engine.check`` (a request's one check, :meth:`prepare`); ``source(options)``
    gives the :class:`~magnetar.engine.requests.Requests` and
    :class:`~magnetar.engine.encode.Encoder` of the engine (``options`` None) or of its variant with those
    per-request encoding options; ``decode`` is the :class:`~magnetar.engine.phase2.DecodeBatch` the requests
    step in; ``results`` assembles a finished request's :class:`~magnetar.engine.results.GenerationResult`.
    ``agree``: the ranks check they prepare the same request (one small collective each); a caller that already
    gives every rank the same requests -- the server, whose ticks are one broadcast -- turns it off."""

    def __init__(self, check: Callable[..., CheckedRequest],
                 source: Callable[[Optional[dict]], tuple[Requests, Encoder]], decode: DecodeBatch,
                 results: Results, *, return_logits: bool = False, agree: bool = True):
        self.check, self.source, self._batch, self.results, self.agree = check, source, decode, results, agree
        self.requests, _ = source(None)
        self._entries: dict[int, _Entry] = {}
        self.return_logits = return_logits

    @property
    def active(self) -> list[int]:
        """The unfinished requests' ids, in joining order."""
        return self._batch.active

    @property
    def finished(self) -> list[int]:
        """The finished requests not yet popped."""
        active = set(self._batch.active)
        return [rid for rid in self._entries if rid not in active]

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, context: Union[str, torch.Tensor, ContextHandle], query: Union[str, torch.Tensor],
            params: Optional[SamplingParams] = None, *, options: Optional[dict] = None,
            key: Optional[str] = None) -> tuple[int, TokenEvent]:
        """Add one request (:meth:`prepare`, then :meth:`join`): returns its id and its first token's event (the
        request may already be finished)."""
        return self.join([self.prepare(context, query, params, options=options, key=key)])[0]

    def prepare(self, context: Union[str, torch.Tensor, ContextHandle], query: Union[str, torch.Tensor],
                params: Optional[SamplingParams] = None, *, options: Optional[dict] = None,
                key: Optional[str] = None, base: Optional[ContextHandle] = None) -> Ready:
        """Check one request (``Engine.check``: ``context`` a string, token ids ``(L,)`` or a handle from
        ``Engine.encode``; ``query`` a string or ids; ``params`` its
        :class:`~magnetar.engine.sampling.SamplingParams`, default the engine's; ``options`` how its context is
        encoded when not the engine's way, ``Engine.variant``'s options, e.g. ``{"method": "star"}``; ``key`` the
        context's cache key when the caller has it) and :meth:`encode` it. A bad request is a ValueError (a
        :class:`~magnetar.config.FieldError`) on every rank alike, before any collective."""
        request = self.check(context, query, params, options=options, key=key)
        with nvtx_range(GENERATE):
            return self.encode(request, base=base)

    def encode(self, request: CheckedRequest, *, base: Optional[ContextHandle] = None) -> Ready:
        """Encode the context of a request checked already (``Engine.check``; a server's tick carries it to every
        rank): Phase 1 unless the context cache holds it, or its handle. ``base``: a handle of a proper prefix of
        the context that the caller holds (its own Phase-1 chunks), extended on a cache miss whatever the cache
        keeps (``Encoder.encode``). With ``agree`` the ranks first check they encode the same request (one small
        collective). The caller opens the NVTX range (``magnetar/generate``) it belongs to."""
        if not isinstance(request, CheckedRequest):
            raise ValueError(f"request must be a CheckedRequest from Engine.check(), got {type(request).__name__}")
        requests, encoder = self.source(request.options or None)
        if self.agree:
            requests.agree("ask", [request.context_ids], [request.query_ids], request.params,
                           return_logits=self.return_logits)
        if request.handle is not None:
            return Ready(request.handle, True, request.query_ids, request.params)
        handle, cached = encoder.encode(request.context_ids, key=request.key, base=base)
        return Ready(handle, cached, request.query_ids, request.params)

    def join(self, prepared: Sequence[Ready]) -> list[tuple[int, TokenEvent]]:
        """Add prepared requests to the batch: their queries run as ONE forward (right-padded) between two
        steps, which also chooses their first tokens. Returns ``(rid, first event)`` per request, in order."""
        if not prepared:
            return []
        for i, p in enumerate(prepared):
            if not isinstance(p, Ready):
                raise ValueError(f"prepared[{i}] must be a Ready from ContinuousBatch.prepare(), "
                                 f"got {type(p).__name__}")
        samplers = [self.requests.sampler(p.params) for p in prepared]
        rids = self._batch.join([question(p.handle, p.query_ids, s) for p, s in zip(prepared, samplers)])
        out = []
        tokenizer = self.requests.tokenizer
        for rid, p, sampler in zip(rids, prepared, samplers):
            deltas = None
            if tokenizer is not None:
                deltas = TextDeltas(tokenizer, stop=p.params.stop, eos_ids=tuple(sampler.eos_ids))
            self._entries[rid] = _Entry(p.handle, p.cached, p.query_ids, sampler, deltas)
            out.append((rid, self._event(rid)))
        return out

    def step(self) -> list[TokenEvent]:
        """One decode step of every unfinished request: their new tokens' events (none when nothing is active)."""
        return [self._event(rid) for rid in self._batch.step()]

    def cancel(self, rid: int) -> TokenEvent:
        """End the unfinished request ``rid`` now (its last event, stop reason "cancelled", no new token: its
        ``token_id`` is the last one it had); :meth:`pop` it to free its KV."""
        self._check(rid)
        self._batch.cancel(rid)
        return self._event(rid, new_token=False)

    def pop(self, rid: int):
        """Remove the finished request ``rid``; its :class:`~magnetar.engine.results.GenerationResult` (a small
        gather of every rank's figures: every rank pops the same requests in the same order)."""
        entry = self._check(rid)
        if rid in self._batch.active:
            raise ValueError(f"request {rid} is not finished: step until its last event, or cancel it")
        dec = self._batch.pop(rid)
        del self._entries[rid]
        return self.results.assemble([entry.handle], [entry.query_ids], [entry.cached], [dec], [entry.sampler])[0]

    def pop_all(self, rids: Sequence[int]) -> list:
        """:meth:`pop` of several finished requests with one gather of every rank's figures (``Engine.generate``'s
        batch)."""
        entries = [self._check(rid) for rid in rids]
        if any(rid in self._batch.active for rid in rids):
            raise ValueError("every request must be finished: step until their last events, or cancel them")
        decs = [self._batch.pop(rid) for rid in rids]
        for rid in rids:
            del self._entries[rid]
        return self.results.assemble([e.handle for e in entries], [e.query_ids for e in entries],
                                     [e.cached for e in entries], decs, [e.sampler for e in entries])

    def _check(self, rid) -> _Entry:
        entry = self._entries.get(rid) if isinstance(rid, int) and not isinstance(rid, bool) else None
        if entry is None:
            raise ValueError(f"rid must be the id of a request in this batch (add() returned it; popped requests "
                             f"leave it), got {rid!r}")
        return entry

    def _event(self, rid: int, new_token: bool = True) -> TokenEvent:
        res, entry = self._batch.result(rid), self._entries[rid]
        new_token = new_token and res.stop_reason not in FAILED_ALONE  # a failed request got no token
        text = ""
        if entry.deltas is not None:
            if new_token:
                text = entry.deltas.push(res.token_ids[-1])
            if res.stop_reason is not None:
                text += entry.deltas.finish()
        logprob = res.logprobs[-1] if new_token and res.logprobs and len(res.logprobs) == len(res.token_ids) else None
        first = new_token and len(res.token_ids) == 1
        return TokenEvent(rid, res.token_ids[-1] if res.token_ids else -1, text, res.stop_reason, res.error, logprob,
                          res.prompt_logprobs if first else None)
