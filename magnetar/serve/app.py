"""The HTTP side (FastAPI, on the replica's first rank): OpenAI's endpoints, server-sent events, errors.

Handlers parse and check a request (:mod:`magnetar.serve.protocol`, :mod:`magnetar.serve.prompts`; tokenizing
runs in a worker thread), hand it to the engine loop (:class:`~magnetar.serve.loop.EngineLoop`, a thread-safe
queue) and read its events from an asyncio queue. A request refused here never reaches the other ranks.
A client that disconnects (mid-stream, or while waiting for a whole answer) cancels its request, which frees
its slot in the decode batch.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import time
from typing import Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from magnetar.serve.gate import Refused
from magnetar.serve.loop import Done, Encoded, Failed, Sink, Token
from magnetar.serve.scheduler import Job
from magnetar.serve.contexts import PinnedContext, context_id_of
from magnetar.serve.protocol import (AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk,
                                     ChatCompletionRequest, ChunkChoice, Completion, CompletionChoice,
                                     CompletionRequest, ContextObject, ContextRequest, Delta, ModelCard, ModelList,
                                     PromptTokensDetails, RequestError, Usage, error_body, new_id, now, parse_body,
                                     show)
from magnetar.version import __version__

_DISCONNECT_POLL_S = 0.5  # how often a whole-answer request checks that its client is still there


def usage_of(results: list, n: int = 1) -> Usage:
    """The usage of a request's choices (``n`` per prompt, prompt by prompt): each prompt counted once, as
    OpenAI does, every choice's tokens."""
    prompt = sum(r.context_tokens + r.query_tokens for r in results[::n])
    completion = sum(len(r.token_ids) for r in results)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(
                     cached_tokens=sum(r.cached_context_tokens for r in results[::n])))


class LogprobFormat:
    """OpenAI's ``logprobs`` objects from the engine's ``(log p, [(id, log p)] alternatives)`` per token, with
    each token's text from ``tokenizer`` (one id decoded alone; a byte of a longer character shows as U+FFFD)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, tid: int) -> str:
        got = self._texts.get(tid)
        if got is None:
            got = self.tokenizer.decode([tid]) if self.tokenizer is not None else str(tid)
            if len(self._texts) < 1 << 16:
                self._texts[tid] = got
        return got

    def _top(self, alternatives) -> dict[str, float]:
        top: dict[str, float] = {}
        for tid, lp in alternatives:  # most likely first: two ids with one text keep the likelier
            top.setdefault(self.text(tid), lp)
        return top

    def completion(self, p, tokens: list, offset: int = 0, prompt: bool = True) -> dict:
        """Text completions' ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` of ``tokens`` (the
        choice's Token events) and, when their first carries the prompt's (echo), the prompt's tokens first: those
        in Phase 1 and the first query token have none (null), as OpenAI's first token."""
        ids, lps, tops = [], [], []
        first = tokens[0].prompt_logprobs if tokens and prompt else None
        if first is not None:
            ids = (p.context_ids[len(p.context_ids) - p.echo_context:].tolist() if p.echo_context else []) + \
                p.query_ids.tolist()
            nulls = len(ids) - len(first)
            lps, tops = [None] * nulls + [lp for lp, _ in first], [None] * nulls + [self._top(a) for _, a in first]
        for t in tokens:
            ids.append(t.token_id)
            lps.append(t.logprob[0] if t.logprob else None)
            tops.append(self._top(t.logprob[1]) if t.logprob else None)
        texts = [self.text(i) for i in ids]
        offsets = []
        for piece in texts:
            offsets.append(offset)
            offset += len(piece)
        return {"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat(self, tokens: list) -> dict:
        """Chat's ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`` of ``tokens``."""
        def entry(tid: int, lp: float) -> dict:
            text = self.text(tid)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace"))}

        return {"content": [dict(entry(t.token_id, t.logprob[0]), top_logprobs=[entry(a, lp) for a, lp in
                                                                               t.logprob[1]])
                            for t in tokens if t.logprob]}


class Tagged:
    """A choice's view of the request's :class:`Sink`: its events go to the shared queue as ``(choice, event)``."""

    def __init__(self, sink: Sink, index: int):
        self.sink, self.index = sink, index

    def put(self, item) -> None:
        self.sink.put((self.index, item))


RETRY_AFTER_S = 5  # a draining replica's 503: retry (on another replica, behind a load balancer) after this


def retry_headers(status: int, failed: Optional[str] = None) -> dict[str, str]:
    """What a client's retry logic needs (the ``openai`` SDK reads both): a draining server's 503 says when to retry
    (``Retry-After``); a 500 (the request's own non-finite values, or the engine failed) and a failed server's 503
    say that a retry cannot help (``x-should-retry: false``) -- the SDK then shows the message at once instead of
    retrying into a server that is gone and reporting "Connection error."."""
    if status == 503 and failed is None:
        return {"retry-after": str(RETRY_AFTER_S)}
    if status >= 500:
        return {"x-should-retry": "false"}
    return {}


def _sse(obj) -> str:
    data = obj.model_dump_json(exclude_none=True) if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {data}\n\n"


def build_app(server) -> FastAPI:
    """The FastAPI app of ``server`` (a :class:`magnetar.serve.server.Server`)."""
    app = FastAPI(title="Magnetar", version=__version__, docs_url="/docs", redoc_url=None,
                  description="OpenAI-compatible long-context serving (docs/serving.md)")
    loop, preparer, metrics = server.loop, server.preparer, server.metrics
    names = LogprobFormat(copy.deepcopy(server.engine.tokenizer))  # the HTTP thread's own copy

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        # a client that left (499) is counted as "cancelled" by the loop: not also as rejected
        if request.url.path in ("/v1/chat/completions", "/v1/completions") and exc.status < 500 and exc.status != 499:
            metrics.requests.labels(endpoint=request.url.path, outcome="rejected").inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=retry_headers(exc.status, loop.failed))

    @app.exception_handler(Refused)
    async def _refused(request: Request, exc: Refused):  # raised by the gate while a route reads the body
        metrics.refused(exc.status)
        extra = {k.decode("latin-1"): v.decode("latin-1") for k, v in exc.headers}
        return Response(exc.body(), status_code=exc.status, media_type="application/json",
                        headers={"connection": "close", **extra})

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(f"{exc.detail}: {request.method} {request.url.path[:200]}", None,
                                       "invalid_request_error"), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))  # a 405's Allow

    @app.get("/health")
    async def health():
        refused = loop.refusal()
        if refused is not None:
            return JSONResponse({"status": "failed" if loop.failed else "draining", "message": refused.message},
                                status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=server.model_name, created=server.created)]).model_dump()

    @app.get("/v1/models/{model_id:path}")  # a Hub id holds a slash
    async def model(model_id: str):
        if model_id != server.model_name:
            raise RequestError(f"model {show(model_id)} is not served here; this server serves "
                               f"{server.model_name!r}", "model", status=404)
        return ModelCard(id=server.model_name, created=server.created).model_dump()

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _generate(request, parse_body(ChatCompletionRequest, await request.body()))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, parse_body(CompletionRequest, await request.body()))

    async def _generate(request: Request, req: Union[ChatCompletionRequest, CompletionRequest]):
        _open()
        chat_kind = isinstance(req, ChatCompletionRequest)
        prepared = await preparer.run(preparer.chat if chat_kind else preparer.completion, req)
        n = 1 if req.n is None else req.n
        sink = Sink(asyncio.get_running_loop())
        sids = []
        try:
            for i, p in enumerate(prepared):  # one request per choice, all in the engine's batch
                sids.append(loop.new_sid())
                loop.submit(Job("generate", sids[-1], Tagged(sink, i), p, endpoint=request.url.path))
        except BaseException:
            for sid in sids:
                loop.cancel(sid)
            raise
        rid = new_id("chatcmpl" if chat_kind else "cmpl")
        info = {"prompts": [{"split": p.split, "context_tokens": p.context_tokens,
                             "query_tokens": int(p.query_ids.numel())} for p in prepared[::n]]}
        logprobs = req.logprobs is not None and req.logprobs is not False  # chat: a bool; completions: 0..20
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            # the status line waits for the request's first event: a request the engine refuses (or fails) gets
            # its own HTTP status, not a 200 followed by an error event
            first = await _first(request, sink, sids)
            return StreamingResponse(_stream(sink, sids, prepared, rid, chat_kind, include_usage, n, info, logprobs,
                                             first),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        tokens, dones = await _collect(request, sink, sids)
        texts = ["".join(t.text for t in ts) for ts in tokens]
        usage = usage_of([d.result for d in dones], n)
        if chat_kind:
            return ChatCompletion(id=rid, created=now(), model=server.model_name, usage=usage, magnetar=info,
                                  choices=[ChatChoice(index=i, message=AssistantMessage(content=t),
                                                      finish_reason=d.finish_reason,
                                                      logprobs=names.chat(ts) if logprobs else None)
                                           for i, (t, ts, d) in enumerate(zip(texts, tokens, dones))]).model_dump()
        return Completion(id=rid, created=now(), model=server.model_name, usage=usage, magnetar=info,
                          choices=[CompletionChoice(index=i, text=p.echo + t, finish_reason=d.finish_reason,
                                                    logprobs=names.completion(p, ts) if logprobs else None)
                                   for i, (p, t, ts, d) in enumerate(zip(prepared, texts, tokens, dones))]).model_dump()

    async def _collect(request: Request, sink: Sink, sids: list[int]) -> tuple[list[list[Token]], list[Done]]:
        """Every choice's tokens and last event; cancels them all if the client goes away meanwhile or one
        fails."""
        parts: list[list[Token]] = [[] for _ in sids]
        dones: list[Optional[Done]] = [None] * len(sids)
        checked = [time.monotonic()]
        while any(d is None for d in dones):
            i, item = await _next(request, sink, sids, checked)
            if isinstance(item, Failed):
                _cancel_others(sids, dones, i)
                raise item.error
            if isinstance(item, Done):
                dones[i] = item
            else:
                parts[i].append(item)
        return parts, dones

    def _cancel_others(sids: list[int], dones: list, failed: int) -> None:
        for j, sid in enumerate(sids):
            if j != failed and dones[j] is None:
                loop.cancel(sid)

    async def _first(request: Request, sink: Sink, sids: list[int]):
        """The first event of a request's choices (a first token, or Done) as ``(choice, event)``; RequestError
        when it failed (the other choices are cancelled), or the client left meanwhile (then all are)."""
        i, item = await _next(request, sink, sids, [time.monotonic()])
        if isinstance(item, Failed):
            _cancel_others(sids, [None] * len(sids), i)
            raise item.error
        return i, item

    async def _next(request: Request, sink: Sink, sids: list[int], checked: list[float]):
        """The next ``(choice, event)``. The client is checked every poll period since ``checked[0]`` -- also while
        events keep coming --, and when it has gone every choice is cancelled and a 499 raised."""
        getter = asyncio.ensure_future(sink.queue.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=_DISCONNECT_POLL_S)
                if time.monotonic() - checked[0] >= _DISCONNECT_POLL_S:
                    checked[0] = time.monotonic()
                    if await request.is_disconnected():
                        for sid in sids:
                            loop.cancel(sid)
                        raise RequestError("the client disconnected", status=499)
                if done:
                    return getter.result()
        finally:
            if not getter.done():
                getter.cancel()

    async def _stream(sink: Sink, sids: list[int], prepared: list, rid: str, chat_kind: bool, include_usage: bool,
                      n: int, info: dict, logprobs: bool, first=None):
        created, name = now(), server.model_name
        dones: list[Optional[Done]] = [None] * len(sids)
        offsets = [0] * len(sids)  # completions' text_offset so far, per choice

        def chunk(i: int, text: Optional[str], finish: Optional[str] = None, role: bool = False,
                  lp: Optional[dict] = None):
            if chat_kind:
                return ChatCompletionChunk(id=rid, created=created, model=name, choices=[ChunkChoice(
                    index=i, delta=Delta(role="assistant" if role else None, content=text), finish_reason=finish,
                    logprobs=lp)])
            return Completion(id=rid, created=created, model=name,
                              choices=[CompletionChoice(index=i, text=text or "", finish_reason=finish, logprobs=lp)])

        try:
            for i, p in enumerate(prepared):  # each choice's opening chunk: the role, or the echoed prompt
                if chat_kind:
                    yield _sse(chunk(i, "", role=True))
                elif p.echo and not logprobs:
                    yield _sse(chunk(i, p.echo))
            while True:
                (i, item), first = (first, None) if first is not None else (await sink.queue.get(), None)
                if isinstance(item, Token) and logprobs:
                    p = prepared[i]
                    if chat_kind:
                        yield _sse(chunk(i, item.text, lp=names.chat([item])))
                        continue
                    if p.echo and offsets[i] == 0:  # the echoed prompt (and its tokens' log-probabilities) first
                        lp = names.completion(p, [item])
                        head = {k: v[:-1] for k, v in lp.items()}
                        yield _sse(chunk(i, p.echo, lp=head))
                        offsets[i] = lp["text_offset"][-1]  # where the whole answer puts its first token
                    lp = names.completion(p, [item], offsets[i], prompt=False)
                    # text_offset counts each token's own text, as the whole answer's does (not the text deltas,
                    # which hold back a word or a stop string's start until the next token decides)
                    offsets[i] += len(lp["tokens"][0])
                    yield _sse(chunk(i, item.text, lp=lp))
                elif isinstance(item, Token):
                    if item.text:
                        yield _sse(chunk(i, item.text))
                elif isinstance(item, Done):
                    dones[i] = item
                    yield _sse(chunk(i, None if chat_kind else "", item.finish_reason))
                    if any(d is None for d in dones):
                        continue
                    if include_usage:
                        usage = usage_of([d.result for d in dones], n)
                        final = ChatCompletionChunk(id=rid, created=created, model=name, choices=[], usage=usage,
                                                    magnetar=info) if chat_kind else \
                            Completion(id=rid, created=created, model=name, choices=[], usage=usage, magnetar=info)
                        yield _sse(final)
                    yield "data: [DONE]\n\n"
                    return
                elif isinstance(item, Failed):  # the status line is sent: the error goes as an event
                    _cancel_others(sids, dones, i)
                    dones[i] = item
                    yield _sse(item.error.body())
                    return
        finally:
            for sid, d in zip(sids, dones):
                if d is None:  # the client went away (or the response was cancelled): free the slot
                    loop.cancel(sid)

    @app.post("/v1/contexts")
    async def post_context(request: Request):
        req = parse_body(ContextRequest, await request.body())
        _open()
        checked = await preparer.run(preparer.context, req)
        ids, key = checked.context_ids, checked.key
        cid = context_id_of(key)
        pinned = server.contexts.get(cid)
        if pinned is None:
            server.contexts.reserve(cid)  # the --max-contexts check and the place taken in one step
            try:
                sink = Sink(asyncio.get_running_loop())
                loop.submit(Job("encode", loop.new_sid(), sink, cid=cid, context_ids=ids, key=key))
                item = await sink.queue.get()
                if isinstance(item, Failed):
                    raise item.error
                assert isinstance(item, Encoded)
            except BaseException:  # refused, failed, or the client left while it was encoded
                if server.contexts.unreserve(cid):  # an encode that completes anyway must not stay pinned
                    with contextlib.suppress(RequestError):
                        loop.submit(Job("release", loop.new_sid(), cid=cid))
                raise
            pinned = PinnedContext(cid, key, req.format, item.tokens, now(), ids)
            server.contexts.add(pinned)
        return _context_object(pinned).model_dump()

    @app.delete("/v1/contexts/{cid}")
    async def delete_context(cid: str):
        pinned = server.contexts.get(cid)
        if pinned is None:
            raise RequestError(f"context {show(cid)} is not a context of this server (or was deleted)", "context_id",
                               status=404)
        loop.submit(Job("release", loop.new_sid(), cid=cid))
        server.contexts.remove(cid)
        return _context_object(pinned, deleted=True).model_dump()

    def _context_object(p: PinnedContext, deleted: bool = False) -> ContextObject:
        return ContextObject(id=p.id, created=p.created, model=server.model_name, format=p.format, tokens=p.tokens,
                             deleted=deleted)

    def openapi() -> dict:
        """FastAPI's schema, with the request bodies the handlers parse themselves (strictly, from the raw body)
        and ``/metrics`` as Prometheus text."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in (("/v1/chat/completions", ChatCompletionRequest), ("/v1/completions", CompletionRequest),
                                ("/v1/contexts", ContextRequest)):
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = {
                "text/plain": {"schema": {"type": "string", "description": "Prometheus text format"}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    def _open() -> None:
        refused = loop.refusal()
        if refused is not None:
            raise refused

    return app
