"""The serving leader's decisions, pure: the jobs waiting and what the batch holds -> the next :class:`Tick`.

No ranks, no HTTP, no engine: the scheduler asks the context cache two questions through the callables it is given
(``is_cached(key)``, ``prefix_tokens(ids)``), so it is unit-tested with plain values (tests/test_serve_scheduler.py).
The rules of one tick:

* cancels first (a request still waiting is dropped here; one decoding, or holding Phase-1 chunks, is cancelled on
  every rank by the tick);
* at most ONE job that needs a Phase 1 (a request whose context is not cached, or a ``POST /v1/contexts``), plus any
  number whose context is cached or pinned -- up to ``max_batch_size`` decoding requests;
* a long context (``prefill_chunk`` > 0) runs its Phase 1 one chunk per tick, after the longest cached prefix, and
  joins the batch with its last chunk;
* the joining requests' queries (one forward) hold ``max_join_tokens`` tokens at most (0: no bound): the first
  always joins, and once one does not fit, the later ones wait for the next tick (arrival order kept), one decode
  step later -- so requests arriving together get their first tokens one tick after another instead of all after one
  long forward (vLLM's ``max_num_batched_tokens``; a Phase 1 is bounded apart, by the one-per-tick rule and
  ``prefill_chunk``);
* a release of a pinned context waits for the requests that read it and for an encode of it still queued;
* a request about a pinned context deleted after it was checked is refused (:attr:`Decision.refused`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from magnetar.serve.ticks import Add, Chunk, Encode, Tick


@dataclass
class Job:
    """What the HTTP thread asks of the engine loop (leader only)."""

    kind: str  # "generate" | "encode" | "release" | "cancel"
    sid: int
    sink: Any = None  # magnetar.serve.loop.Sink: where its events go
    prepared: Any = None  # generate: a magnetar.serve.prompts.Prepared
    endpoint: str = ""
    cid: Optional[str] = None
    context_ids: Optional[torch.Tensor] = None  # encode
    key: Optional[str] = None  # encode: the context's cache key
    arrived: float = field(default_factory=time.monotonic)
    last: Optional[float] = None  # when its last token was routed
    chunked: int = 0  # generate: the context tokens its Phase-1 chunks have encoded so far (--prefill-chunk)
    chunking: bool = False  # generate: a chunk of it was sent (every rank holds its partial context)


@dataclass
class Decision:
    """One tick and what else the scheduler decided: ``refused`` jobs (a pinned context deleted after the request
    was checked: the loop answers each with a 400) and ``released`` release jobs (done once the tick is sent)."""

    tick: Tick
    refused: list[Job] = field(default_factory=list)
    released: list[Job] = field(default_factory=list)


class Scheduler:
    """The waiting jobs (``pending``, in arrival order) and the cancels not yet sent; see the module docstring.
    ``is_cached(key)``: whether the context cache holds a context; ``prefix_tokens(ids)``: how many first tokens of
    ``ids`` a cached prefix holds (``Engine.is_cached``, ``Engine.cached_prefix_tokens``)."""

    def __init__(self, *, max_batch_size: int, prefill_chunk: int = 0, max_join_tokens: int = 0,
                 is_cached: Callable[[str], bool] = lambda key: False,
                 prefix_tokens: Callable[[torch.Tensor], int] = lambda ids: 0):
        self.max_batch_size, self.prefill_chunk = max_batch_size, prefill_chunk
        self.max_join_tokens = max_join_tokens
        self.is_cached, self.prefix_tokens = is_cached, prefix_tokens
        self.pending: list[Job] = []
        self.cancels: list[int] = []

    @property
    def idle(self) -> bool:
        """Nothing waits and no cancel is to be sent."""
        return not self.pending and not self.cancels

    def add(self, job: Job) -> None:
        self.pending.append(job)

    def drop(self, sid: int) -> None:
        """Forget the waiting job ``sid`` (it failed: its Phase-1 chunk raised)."""
        self.pending = [j for j in self.pending if j.sid != sid]

    def cancel(self, sid: int, *, decoding: bool) -> Optional[Job]:
        """The client of ``sid`` left. A job still waiting is dropped and returned (the caller answers it); one that
        holds Phase-1 chunks, or is ``decoding``, is cancelled on every rank by the next tick."""
        waiting = next((j for j in self.pending if j.sid == sid), None)
        if waiting is not None:
            self.pending.remove(waiting)
            if waiting.chunking:  # every rank drops the chunks it holds for it
                self.cancels.append(sid)
        elif decoding:
            self.cancels.append(sid)
        return waiting

    def decide(self, *, active: int, pinned: set) -> Decision:
        """The next tick, with ``active`` requests decoding and the pinned contexts ``pinned`` (their ids)."""
        decision = Decision(Tick(cancels=self.cancels))
        tick = decision.tick
        self.cancels = []
        room = self.max_batch_size - (active - len(tick.cancels))
        phase1, keys = False, set()
        joined, full = None, False  # the joining queries' tokens (None: none yet); full: later requests wait
        for job in list(self.pending):
            if job.kind == "release":
                # after the requests that read it, and after an encode of it still queued (a POST whose client left)
                if not any((j.kind == "generate" and j.prepared.context_id == job.cid) or
                           (j.kind == "encode" and j.cid == job.cid) for j in self.pending):
                    tick.releases.append(job.cid)
                    self.pending.remove(job)
                    decision.released.append(job)
                continue
            key = job.key if job.kind == "encode" else job.prepared.key
            cid = job.prepared.context_id if job.kind == "generate" else None
            if cid is not None and cid not in pinned:  # deleted after the request was checked
                self.pending.remove(job)
                decision.refused.append(job)
                continue
            needs = cid is None and not self.is_cached(key) and key not in keys
            if (job.kind == "generate" and (room <= 0 or full)) or (needs and phase1):
                continue
            if needs and job.kind == "generate" and self._chunks(job):  # a chunk now; the request joins after
                ids = job.prepared.context_ids
                job.chunked, job.chunking = min(job.chunked + self.prefill_chunk, int(ids.numel())), True
                tick.chunks.append(Chunk(job.sid, ids[: job.chunked].tolist()))
                phase1 = True
                continue
            if job.kind == "generate":
                query = job.prepared.request.query_tokens
                if joined is not None and self.max_join_tokens and joined + query > self.max_join_tokens:
                    full = True  # it and every later request wait for the next tick
                    continue
                joined = (joined or 0) + query
            phase1, room = phase1 or needs, room - (job.kind == "generate")
            keys.add(key)
            self.pending.remove(job)
            if job.kind == "encode":
                tick.encodes.append(Encode(job.sid, job.cid, job.context_ids.tolist()))
            else:
                p = job.prepared  # a pinned context's ids stay out: every rank holds its handle
                tick.adds.append(Add(job.sid, p.request.to_dict(context=p.context_id is None), p.context_id))
        return decision

    def _chunks(self, job: Job) -> bool:
        """Whether the next Phase-1 work of ``job`` (a request whose context is not cached) is a chunk: chunking is
        on, the request is encoded the server's way, and more than one chunk of its context is left to encode."""
        p = job.prepared
        if self.prefill_chunk <= 0 or p.options or p.context_id is not None:
            return False
        if job.chunked == 0:  # chunks start after the longest cached prefix (a conversation's earlier turn)
            job.chunked = self.prefix_tokens(p.context_ids)
        return int(p.context_ids.numel()) - job.chunked > self.prefill_chunk
