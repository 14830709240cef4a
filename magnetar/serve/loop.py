"""The lockstep engine loop: every rank of a replica runs it; the replica's first rank also decides.

Each tick:

1. the leader (cp_rank 0, tp_rank 0) turns what the HTTP thread queued into a :class:`~magnetar.serve.ticks.Tick`
   -- cancels, releases of pinned contexts, at most ONE request or context that needs a Phase 1 plus any
   number that hit the context cache, up to ``max_batch_size`` decoding requests;
2. :func:`~magnetar.serve.ticks.broadcast_tick` gives it to every rank of the replica (timeout: the groups');
3. every rank applies it to its :class:`~magnetar.engine.batch.ContinuousBatch` in the same order (``cancel``,
   ``prepare`` each new request -- a Phase 1 on a cache miss --, one ``join`` of them all -- their queries in one
   forward, which chooses their first tokens --, ``pop`` of finished requests) and runs one ``step()`` while
   requests are decoding;
4. the leader hands each request's events to its HTTP handler (:class:`Sink`: ``call_soon_threadsafe`` onto the
   handler's asyncio queue).

Idle, the leader waits on its inbox and sends an empty tick (a heartbeat) every ``heartbeat_s`` -- well under the
collective timeout -- so the other ranks, blocked in the broadcast, never time out while nothing happens. A
request the engine refuses with ValueError (on every rank alike) fails alone with a 400, and one whose own tokens
turn the model's values non-finite (Phase 1's NonFiniteError, or its logits in the decode batch), or whose Phase 1,
query forward or token choice raises anything else, fails alone with a 500 (a joint query forward that raises is
run again one request at a time, to find which). A request that runs out of device memory
(:mod:`magnetar.engine.memory`) is tried once more after the cached contexts are dropped, then fails alone with a 503
(busy) or 400 (it cannot fit); a decode step that runs out fails the requests decoding (:meth:`EngineLoop._fits`,
:meth:`EngineLoop._step`). Only the replica's own failures (a dead rank's TimeoutError, a gloo error, running out
of memory on a replica of several processes: :meth:`EngineLoop._own`) end the loop: the leader answers every request
in flight with a 500 and every rank returns a non-zero status.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from magnetar.engine.batch import FAILED_ALONE
from magnetar.engine.finite import NonFiniteError
from magnetar.engine.memory import OutOfDeviceMemory, did_not_fit, fails_alone, out_of_memory
from magnetar.engine.phase2 import RequestFailed
from magnetar.engine.requests import CheckedRequest
from magnetar.serve.protocol import FINISH_REASONS, RequestError
from magnetar.serve.scheduler import Job, Scheduler
from magnetar.serve.ticks import Tick, broadcast_tick
from magnetar.utils.nvtx import GENERATE, nvtx_range

log = logging.getLogger(__name__)

_POLL_S = 0.2  # how often an idle leader looks at the drain flag


@dataclass
class Token:
    text: str
    token_id: int
    logprob: Optional[tuple] = None  # (log p, [(id, log p)] alternatives) when the request asked for logprobs
    prompt_logprobs: Optional[list] = None  # the first token's event: the query tokens' (echo with logprobs)


@dataclass
class Done:
    result: Any  # GenerationResult
    finish_reason: Optional[str]  # OpenAI's: "stop" / "length"


@dataclass
class Encoded:
    tokens: int


@dataclass
class Failed:
    error: RequestError




class Sink:
    """A request's events, handed from the engine thread to the HTTP handler's asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the HTTP loop is closed: nobody listens any more
            pass


class EngineLoop:
    """See the module docstring. ``metrics`` (a :class:`~magnetar.serve.metrics.Metrics`) and ``contexts`` are
    the leader's; ``heartbeat_s`` defaults to a quarter of the collective timeout, at most 5 s."""

    def __init__(self, engine, *, max_batch_size: int = 16, metrics=None, heartbeat_s: Optional[float] = None,
                 prefill_threads: Optional[int] = None, prefill_chunk: int = 0, max_join_tokens: int = 0,
                 decode_threads=None):
        self.engine, self.groups = engine, engine.groups
        # a new context longer than this many tokens runs its Phase 1 in chunks of it, one between two decode steps
        # (0: whole); only where a chunk's extension is the exact Phase 1 (Engine.chunk_problem)
        self.prefill_chunk = prefill_chunk if engine.chunk_problem() is None else 0
        # sid -> (the handle of its Phase-1 chunks so far, the context tokens reused before its first chunk), on every
        # rank: the request holds its chunks for its life, so the next chunk extends them whatever the cache keeps
        # (they never enter the cache: a partial context only its request extends)
        self._partial: dict[int, tuple[Any, int]] = {}
        # intra-op threads while a tick's Phase 1s and query forwards run (compute-bound: every usable CPU), the
        # decode steps keeping the process's own count (magnetar.serve.cli.choose_threads); None: one count
        self.prefill_threads = prefill_threads
        # the decode steps' count where it follows the host's load (a magnetar.serve.threads.DecodeThreads: every
        # usable CPU while other processes leave them idle, one fewer while they do not); None: the process's count
        self.decode_threads = decode_threads
        self.leader = self.groups.is_replica_leader  # it serves HTTP and decides the ticks
        self.max_batch_size = max_batch_size
        graphs = getattr(engine, "decode_graphs", None)
        if graphs is not None and max_batch_size > max(graphs.plan.batches):
            log.warning("decode_step graph: --max-batch-size %d is more than the largest planned batch (%d, "
                        "--decode-graph-batches %s): batches beyond it run uncaptured", max_batch_size,
                        max(graphs.plan.batches), ",".join(map(str, graphs.plan.batches)))
        self.metrics = metrics
        timeout = self.groups.timeout.total_seconds()
        self.heartbeat_s = min(5.0, timeout / 4) if heartbeat_s is None else heartbeat_s
        self.batch = None
        self.handles: dict = {}  # cid -> ContextHandle, on every rank (pinned contexts)
        self.rids: dict[int, int] = {}  # sid -> the batch's rid, on every rank
        self.sids: dict[int, int] = {}  # rid -> sid
        # the leader's side
        self.inbox: queue.Queue = queue.Queue()
        self.jobs: dict[int, Job] = {}  # sid -> job, from submission to its last event
        # what waits (taken from the inbox, not yet in a tick) and the rules of the next tick
        # max_join_tokens: the query tokens of the requests joining in one tick (one forward; 0: no bound)
        self.scheduler = Scheduler(max_batch_size=max_batch_size, prefill_chunk=self.prefill_chunk,
                                   max_join_tokens=max_join_tokens, is_cached=engine.is_cached,
                                   prefix_tokens=engine.cached_prefix_tokens)
        self._sid = itertools.count(1)
        self._gate = threading.Lock()
        self.closed = False  # no more submissions (stopping)
        self.draining = False  # set by SIGTERM: finish what was accepted, take nothing new, then stop
        self.failed: Optional[str] = None
        self.start_error: Optional[str] = None  # the leader could not start serving: stop every rank

    # -- the HTTP thread's side (leader) ----------------------------------------------------------------------
    def new_sid(self) -> int:
        return next(self._sid)

    def refusal(self) -> Optional[RequestError]:
        """The 503 a new request gets now (draining, failed or stopped), or None."""
        if self.failed is not None:
            return RequestError("the server failed and is shutting down (its log says why)", status=503,
                                type="server_error")
        if self.draining or self.closed:
            return RequestError("the server is shutting down (draining the requests in flight); retry on another "
                                "replica", status=503, type="server_error")
        return None

    def submit(self, job: Job) -> None:
        """Queue ``job``; RequestError 503 when the server takes no more requests."""
        with self._gate:
            refused = self.refusal()
            if refused is not None:
                raise refused
            self.inbox.put(job)

    def pinned_bytes(self, cid: str) -> int:
        """The KV bytes of pinned context ``cid`` (held by a process: its largest shard over the ranks; 0 while it is
        encoded)."""
        handle = self.handles.get(cid)
        return 0 if handle is None else int(handle.nbytes)

    def cancel(self, sid: int) -> None:
        """The client of ``sid`` left: drop the request (queued or decoding); a no-op once it has finished."""
        self.inbox.put(Job("cancel", sid))

    # -- every rank -------------------------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until a stop tick; returns the exit status (0 after a drain, 1 after a failure)."""
        # the tick broadcast gives every rank the same requests: no agreement collective per request
        self.batch = self.engine.open_batch(agree=False)
        try:
            self._warm_up()
            while True:
                tick = self._decide() if self.leader else None
                tick = broadcast_tick(tick, self.groups, self.engine.device)
                if tick.stop:
                    if tick.error is not None:
                        log.error("the server stops: %s", tick.error)
                    return 0 if tick.error is None else 1
                self._apply(tick)
                if self.batch.active:
                    if self.decode_threads is not None:
                        torch.set_num_threads(self.decode_threads.current())
                    self._step()
                if self.leader:
                    self._gauges()
        except Exception as e:  # a dead peer, a collective timeout, an engine failure: never a hang
            log.exception("the engine loop failed on rank %d", self.groups.rank)
            if self.leader:
                self._fail_all(f"{type(e).__name__}: {e}")
            return 1
        finally:
            if self.leader:
                self._close()

    def _warm_up(self) -> None:
        """A compiled decode step (``runtime.decode_step`` compiled) compiles on its first steps: run them before
        the first request, on every rank alike -- one request over a 16-token context (the static graph), then one
        over a 300-token context (more capacity: the graph with the capacity dynamic, which every later single
        request reuses); their contexts leave the cache. A batch of several compiles once more on its first step (a
        graph with the batch size dynamic too was 1.7x slower per step on CPU: not warmed up)."""
        if self.engine.config.runtime.decode_step != "compiled":
            return
        t0 = time.perf_counter()
        vocab = int(self.engine.vocab_size)
        params = self.engine.sampling_params(max_new_tokens=4, temperature=0.0)
        for n, length in ((1, 16), (1, 300)):
            ready = [self.batch.prepare((torch.arange(length) * (7 + i) + 3) % vocab, torch.arange(4) % vocab, params)
                     for i in range(n)]
            rids = [rid for rid, _ in self.batch.join(ready)]
            while self.batch.active:
                self.batch.step()
            for rid, r in zip(rids, ready):
                self.batch.pop(rid)
                self.engine.release(r.handle)
        log.warning("decode_step compiled: the decode step compiled before serving (%.0f s)",
                    time.perf_counter() - t0)

    # -- the leader's decisions -------------------------------------------------------------------------------
    def _decide(self) -> Tick:
        deadline = time.monotonic() + self.heartbeat_s
        while True:
            busy = bool(self.batch.active)
            self._take(block=not busy and not self.scheduler.pending, until=deadline)
            if self.start_error is not None:
                return Tick(stop=True, error=self.start_error)
            if self.draining and not self.batch.active and self.scheduler.idle:
                with self._gate:
                    if self.inbox.empty():
                        self.closed = True
                        return Tick(stop=True)
                continue
            tick = self._schedule()
            if not tick.empty or busy or time.monotonic() >= deadline:
                return tick

    def _take(self, *, block: bool, until: float) -> None:
        """Move the inbox into ``pending`` (cancels apart); waits up to ``_POLL_S`` for the first job if ``block``."""
        while True:
            try:
                if block:
                    job = self.inbox.get(timeout=max(0.0, min(_POLL_S, until - time.monotonic())))
                    block = False
                else:
                    job = self.inbox.get_nowait()
            except queue.Empty:
                return
            if job.kind == "cancel":
                self._take_cancel(job.sid)
            else:
                self.jobs[job.sid] = job
                self.scheduler.add(job)

    def _take_cancel(self, sid: int) -> None:
        if self.scheduler.cancel(sid, decoding=sid in self.rids) is not None:  # it was still waiting
            self._finish_job(sid, "cancelled")

    def _schedule(self) -> Tick:
        decision = self.scheduler.decide(active=len(self.batch.active), pinned=set(self.handles))
        for job in decision.released:
            self.jobs.pop(job.sid, None)
        for job in decision.refused:
            self._reject(job.sid, ValueError(f"magnetar.context_id {job.prepared.context_id!r} was deleted"),
                         "magnetar.context_id")
        return decision.tick

    # -- every rank: apply a tick, route events ---------------------------------------------------------------
    def _apply(self, tick: Tick) -> None:
        for sid in tick.cancels:
            self._partial.pop(sid, None)  # a request cancelled between its Phase-1 chunks
            rid = self.rids.get(sid)
            if rid is not None and rid in self.batch.active:
                self._route([self.batch.cancel(rid)])  # its last event; the pop frees its KV
        if not (tick.encodes or tick.adds or tick.chunks):
            self._apply_releases(tick)
            return
        decode_threads = torch.get_num_threads()
        if self.prefill_threads is not None:
            torch.set_num_threads(self.prefill_threads)
        try:
            self._apply_new(tick)
        finally:
            torch.set_num_threads(decode_threads)
        self._apply_releases(tick)

    def _apply_new(self, tick: Tick) -> None:
        """A tick's Phase-1 chunks, encodes and new requests (their Phase 1s and one query forward)."""
        for ch in tick.chunks:  # a prefix of a checked context, the same on every rank (the tick): no agreement
            ids = torch.tensor(ch.context_ids, dtype=torch.long)
            held = self._partial.pop(ch.sid, None)
            base = None if held is None else held[0]
            try:  # extends the request's own chunks (the first: a cached prefix, if any)
                handle = self._fits(f"the Phase 1 of a {ids.numel()}-token context's chunk",
                                    lambda: self.engine.encode_chunk(ids, base=base), others=bool(self._partial))
            except Exception as e:  # its own tokens: the request fails alone
                self._own(e)
                if self.leader:
                    self.scheduler.drop(ch.sid)
                self._reject(ch.sid, e, None)
                continue
            self._partial[ch.sid] = (handle, handle.reused_tokens if held is None else held[1])
        for enc in tick.encodes:
            try:
                ids = torch.tensor(enc.context_ids, dtype=torch.long)
                self.handles[enc.cid] = handle = self._fits(f"the Phase 1 of a {ids.numel()}-token context",
                                                            lambda: self.engine.encode(ids))
                self.engine.pin(handle)  # the disk tier keeps it until it is released
            except Exception as e:  # every rank refuses alike
                self._own(e)
                self._reject(enc.sid, e, "context")
                continue
            self._send(enc.sid, Encoded(handle.context_tokens))
            self._finish_job(enc.sid, None)
        ready, sids = [], []
        for add in tick.adds:  # each encoded alone (one that fails, fails alone) ...
            handle = self.handles[add.context_id] if add.context_id is not None else None
            held = self._partial.pop(add.sid, None)  # its Phase-1 chunks, when it ran in chunks
            try:  # checked once, by the leader's Engine.check: trusted here
                request = CheckedRequest.from_dict(add.request, handle=handle,
                                                   context_ids=None if handle is None else handle.context_ids)
                with nvtx_range(GENERATE):
                    ready.append(self._fits(f"the Phase 1 of a {request.context_tokens}-token context",
                                            lambda: self.batch.encode(request, base=None if held is None else held[0]),
                                            others=bool(ready)))
                sids.append(add.sid)
                if held is not None and not ready[-1].cached:  # its own chunks are not what it found cached: report
                    r = ready[-1]  # the prefix reused before its first chunk
                    ready[-1] = dataclasses.replace(r, handle=dataclasses.replace(r.handle, reused_tokens=held[1]))
            except Exception as e:  # a bad request, or its own NaN or failure in Phase 1: it fails alone
                self._own(e)
                self._reject(add.sid, e, None)
        self._join(sids, ready)  # ... then their queries in one forward

    def _join(self, sids: list[int], ready: list) -> None:
        """Join ``ready`` (the requests ``sids``) to the batch in one query forward. If that forward raises an
        exception of the requests' own (not the replica's: :meth:`_own`), each joins alone, so that only the
        request that raised fails (every rank raises alike on the same request: the ranks run the same forward)."""
        try:
            joined = self._fits(f"the query forward of {len(ready)} request(s)", lambda: self.batch.join(ready),
                                others=len(ready) > 1)
        except Exception as e:
            self._own(e)
            if len(ready) > 1:
                log.warning("a joint query forward of %d requests failed (%s: %s); they join one at a time",
                            len(ready), type(e).__name__, e)
                for sid, r in zip(sids, ready):
                    self._join([sid], [r])
                return
            log.error("request %d failed in its query forward", sids[0], exc_info=True)
            self._reject(sids[0], e if isinstance(e, OutOfDeviceMemory) else RequestFailed(f"{type(e).__name__}: {e}"),
                         None)
            return
        for sid, (rid, first) in zip(sids, joined):
            self.rids[sid], self.sids[rid] = rid, sid
            self._route([first])

    def _own(self, error: Exception) -> None:
        """Re-raise ``error`` unless it belongs to one request: a collective that timed out or a peer that is gone
        (TimeoutError, ConnectionError, torch.distributed's errors) is the replica's failure and ends the loop, as
        is running out of device memory on a replica of several processes (one rank's allocation failed while the
        others wait in the request's collectives); anything else raised while one request's Phase 1, query or token
        choice ran is that request's (its options, its tokens, its values, its memory on a one-process replica) and
        fails it alone."""
        if isinstance(error, (TimeoutError, ConnectionError, dist.DistError)):
            raise error
        if did_not_fit(error) and not fails_alone(error, self.groups.replica_size):
            log.error("rank %d ran out of device memory: a replica of %d processes cannot fail one request alone "
                      "(the other ranks wait in its collectives); the replica stops", self.groups.rank,
                      self.groups.replica_size)
            raise error

    def _fits(self, what: str, run, *, others: bool = False):
        """``run()``. If it runs out of device memory on a one-process replica: free what the device holds for later
        (:meth:`~magnetar.engine.engine.Engine.relieve_memory`) and run it once more; if it still does not fit,
        :class:`~magnetar.engine.memory.OutOfDeviceMemory` -- ``alone`` when nothing else held the device (no request
        decoding, no pinned context, no other request's Phase 1 in progress: ``others`` says whether this tick holds
        one). Anything else (and memory on several processes: :meth:`_own`) propagates as it is."""
        try:
            return run()
        except Exception as e:  # noqa: BLE001 - a failed allocation is recognised by out_of_memory, the rest re-raised
            if not out_of_memory(e):
                raise
            self._own(e)
            dropped = self.engine.relieve_memory()
            log.warning("out of device memory in %s (%s); dropped %.0f MiB of cached contexts and the allocator's "
                        "unused blocks: trying once more", what, str(e).splitlines()[0][:200] if str(e) else "",
                        dropped / 2**20)
        try:
            return run()
        except Exception as e:  # noqa: BLE001 - as above
            if not out_of_memory(e):
                raise
            self.engine.relieve_memory()
            raise OutOfDeviceMemory(what, self.engine.device, e, alone=self._alone(others or self.batch.active)) from e

    def _alone(self, others) -> bool:
        """Whether nothing but the request that ran out held the device: no ``others`` (other requests decoding or
        in this tick), no pinned context, no other request's Phase 1 in progress (the cache was just dropped)."""
        return not (others or self.handles or self._partial)

    def _step(self) -> None:
        """One decode step of the batch, its events routed. A step that runs out of device memory on a one-process
        replica cannot be taken again (its layers before the failed one have written the new tokens' KV): every
        request decoding fails with :class:`~magnetar.engine.memory.OutOfDeviceMemory` (503; 400 when it was the
        only one), its KV freed, and the server goes on."""
        try:
            events = self.batch.step()
        except Exception as e:  # noqa: BLE001 - a failed allocation is recognised by out_of_memory, the rest re-raised
            if not out_of_memory(e):
                raise
            self._own(e)
            rids = list(self.batch.active)
            alone = self._alone(len(rids) > 1)
            for rid in rids:
                self.batch.cancel(rid)
                self.batch.pop(rid)  # its KV goes
            self.engine.relieve_memory()
            error = OutOfDeviceMemory(f"a decode step of {len(rids)} request(s)", self.engine.device, e, alone=alone)
            log.error("%s", error)
            for rid in rids:
                sid = self.sids[rid]
                self._forget(sid)
                self._reject(sid, error, None)
            return
        self._route(events)

    def _apply_releases(self, tick: Tick) -> None:
        for cid in tick.releases:  # after the adds: a request of this tick may still read the context
            # unpinned only: the context cache keeps its entry (shared with automatic reuse) under its LRU budget
            handle = self.handles.pop(cid, None)
            if handle is not None:
                self.engine.unpin(handle)

    def _route(self, events) -> None:
        for ev in events:
            sid = self.sids[ev.rid]
            if ev.stop_reason != "cancelled" and ev.stop_reason not in FAILED_ALONE:  # those have no new token
                self._token(sid, ev)
            if ev.stop_reason is not None:
                result = self.batch.pop(ev.rid)  # every rank: a small collective
                self._forget(sid)
                failure = ev.failure()  # this request's own NaN or failure: it fails alone, the server goes on
                if failure is not None:
                    self._reject(sid, failure, None)
                    continue
                self._send(sid, Done(result, FINISH_REASONS.get(ev.stop_reason)))
                if self.leader:
                    self.metrics.finished(result)
                self._finish_job(sid, FINISH_REASONS.get(ev.stop_reason, ev.stop_reason))

    def _forget(self, sid: int) -> None:
        rid = self.rids.pop(sid)
        self.sids.pop(rid, None)

    # -- the leader's bookkeeping (no-ops elsewhere) ----------------------------------------------------------
    def _send(self, sid: int, item) -> None:
        job = self.jobs.get(sid) if self.leader else None
        if job is not None and job.sink is not None:
            job.sink.put(item)

    def _token(self, sid: int, ev) -> None:
        job = self.jobs.get(sid) if self.leader else None
        if job is None:
            return
        now = time.monotonic()
        (self.metrics.ttft if job.last is None else self.metrics.tpot).observe(now - (job.last or job.arrived))
        job.last = now
        if job.sink is not None:
            job.sink.put(Token(ev.text, ev.token_id, ev.logprob, ev.prompt_logprobs))

    def _reject(self, sid: int, error: Exception, param: Optional[str]) -> None:
        if isinstance(error, OutOfDeviceMemory):  # 400: it cannot fit this server; 503: busy, retry
            log.warning("request %d: %s", sid, error)
            self._send(sid, Failed(RequestError(str(error), param, status=error.status,
                                                type="invalid_request_error" if error.alone else "server_error")))
            self._finish_job(sid, "out_of_memory")
            return
        if not isinstance(error, ValueError):  # not the client's fault: a 500 for this request alone
            log.error("request %d failed: %s: %s", sid, type(error).__name__, error)
            what = ("the model produced non-finite values for this request" if isinstance(error, NonFiniteError)
                    else "this request failed in the engine (the server's log has the cause; the server goes on)")
            self._send(sid, Failed(RequestError(f"{what} ({error})", status=500, type="server_error")))
            self._finish_job(sid, "error")
            return
        self._send(sid, Failed(RequestError(str(error), param)))
        self._finish_job(sid, "rejected")

    def _finish_job(self, sid: int, outcome: Optional[str]) -> None:
        job = self.jobs.pop(sid, None) if self.leader else None
        if job is not None and outcome is not None and job.endpoint:
            self.metrics.requests.labels(endpoint=job.endpoint, outcome=outcome).inc()

    def _gauges(self) -> None:
        self.metrics.active.set(len(self.batch.active))
        self.metrics.queued.set(len(self.scheduler.pending) + self.inbox.qsize())
        self.metrics.decode_threads.set(torch.get_num_threads())
        self.metrics.cache(self.engine.cache_stats(), len(self.handles))

    def _fail_all(self, why: str) -> None:
        self.failed = why  # the cause stays in the server's log (log.exception above): clients see no internals
        err = RequestError("the engine failed and the server is shutting down (its log says why); retry on another "
                           "replica or after a restart", status=500, type="server_error")
        for sid in list(self.jobs):
            self._send(sid, Failed(err))
            self._finish_job(sid, "error")

    def _close(self) -> None:
        """No more submissions; whatever is still queued gets a 503."""
        with self._gate:
            self.closed = True
        refused = self.refusal()
        while True:
            try:
                job = self.inbox.get_nowait()
            except queue.Empty:
                break
            if job.kind != "cancel":
                self.jobs[job.sid] = job
        for sid in list(self.jobs):
            self._send(sid, Failed(refused))
            self._finish_job(sid, "rejected")
