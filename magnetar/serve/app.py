"""The HTTP side (FastAPI, on the replica's first rank): OpenAI's endpoints, server-sent events, errors.

Handlers parse and check a request (:mod:`magnetar.serve.protocol`, :mod:`magnetar.serve.prompts`; tokenizing
runs in a worker thread), hand it to the engine loop (:class:`~magnetar.serve.loop.EngineLoop`, a thread-safe
queue) and read its events from an asyncio queue (:class:`Exchange`). A request refused here never reaches the
other ranks. A client that disconnects (mid-stream, or while waiting for a whole answer) cancels its request,
which frees its slot in the decode batch. :func:`build_app` adds the routes in groups (errors, information,
generation, pinned contexts); the two generation endpoints share one collect / stream path and differ only in
their :class:`Responder` (the objects OpenAI defines for each).
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import json
import time
from typing import Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from magnetar.serve.errors import http_error
from magnetar.serve.gate import Refused
from magnetar.serve.loop import Done, Encoded, Failed, Sink, Token
from magnetar.serve.scheduler import Job
from magnetar.serve.responses import ResponsesResponder, chat_turn
from magnetar.serve.tools import ToolCallParser, parse_answer
from magnetar.serve.contexts import PinnedContext, context_id_of
from magnetar.serve.protocol import (AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk,
                                     ChatCompletionRequest, ChunkChoice, Completion, CompletionChoice,
                                     CompletionRequest, ContextObject, ContextRequest, Delta, DetokenizeRequest,
                                     ErrorResponse, ModelCard, ModelList, ResponsesRequest, TokenizeRequest,
                                     PromptTokensDetails, RequestError, Usage, new_id, now, parse_body,
                                     show)
from magnetar.version import __version__

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
# the error statuses the OpenAPI schema names, each answered with OpenAI's error body (ErrorResponse)
ERROR_STATUSES = {
    400: "a bad request: a field's value (named in `param`), a body that is not JSON, a Host header naming another "
         "server (--allowed-hosts)",
    401: "no API key, or another (--api-key): send 'Authorization: Bearer KEY'",
    404: "no such model, context or response",
    408: "the request body did not arrive whole within --request-timeout-s",
    413: "the request body is larger than --max-request-bytes",
    415: "the request body is not 'Content-Type: application/json'",
    500: "the engine failed on this request (the server's log says why)",
    501: "a feature this installation lacks (structured outputs without their grammar library)",
    503: "the server is overloaded (--max-connections, --max-inflight-bytes: retry after Retry-After), draining or "
         "failed",
}
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


class Exchange:
    """One HTTP request's choices in the engine loop: their server ids ``sids`` and the :class:`Sink` their events
    arrive on, read as ``(choice, event)``. Every wait checks the client, whose leaving cancels every choice."""

    def __init__(self, loop, request: Request, sink: Sink, sids: list[int]):
        self.loop, self.request, self.sink, self.sids = loop, request, sink, sids
        self._checked = time.monotonic()

    async def next(self):
        """The next ``(choice, event)``. The client is checked every poll period -- also while events keep coming
        --, and when it has gone every choice is cancelled and a 499 raised."""
        getter = asyncio.ensure_future(self.sink.queue.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=_DISCONNECT_POLL_S)
                if time.monotonic() - self._checked >= _DISCONNECT_POLL_S:
                    self._checked = time.monotonic()
                    if await self.request.is_disconnected():
                        for sid in self.sids:
                            self.loop.cancel(sid)
                        raise RequestError("the client disconnected", status=499)
                if done:
                    return getter.result()
        finally:
            if not getter.done():
                getter.cancel()

    async def first(self):
        """The first event of the choices (a first token, or Done) as ``(choice, event)``; RequestError when it
        failed (the other choices are cancelled), or the client left meanwhile (then all are)."""
        i, item = await self.next()
        if isinstance(item, Failed):
            self.cancel_others([None] * len(self.sids), i)
            raise item.error
        return i, item

    async def collect(self) -> tuple[list[list[Token]], list[Done]]:
        """Every choice's tokens and last event; cancels them all if the client goes away meanwhile or one fails."""
        parts: list[list[Token]] = [[] for _ in self.sids]
        dones: list[Optional[Done]] = [None] * len(self.sids)
        while any(d is None for d in dones):
            i, item = await self.next()
            if isinstance(item, Failed):
                self.cancel_others(dones, i)
                raise item.error
            if isinstance(item, Done):
                dones[i] = item
            else:
                parts[i].append(item)
        return parts, dones

    def cancel_others(self, dones: list, failed: int) -> None:
        for j, sid in enumerate(self.sids):
            if j != failed and dones[j] is None:
                self.loop.cancel(sid)

    def cancel_unfinished(self, dones: list) -> None:
        for sid, d in zip(self.sids, dones):
            if d is None:  # the client went away (or the response was cancelled): free the slot
                self.loop.cancel(sid)


class Responder:
    """What one generation endpoint answers, as OpenAI defines it: the whole response, the stream's chunks (each
    choice's opening, its tokens with their log-probabilities, its end, the usage), over one request's
    ``prepared`` choices (``n`` per prompt) and ``info`` (how the prompts were cut). ``names``: the token texts of
    log-probabilities."""

    id_prefix = ""
    done_marker = True  # the stream ends with "data: [DONE]"
    sse = staticmethod(_sse)  # an event as server-sent text

    def __init__(self, model: str, names: LogprobFormat, prepared: list, n: int, info: dict, logprobs: bool):
        self.model, self.names, self.prepared, self.n, self.info = model, names, prepared, n, info
        self.logprobs = logprobs
        self.id, self.created = new_id(self.id_prefix), now()

    def whole(self, tokens: list[list[Token]], dones: list[Done]) -> dict:
        raise NotImplementedError

    def chunk(self, i: int, text: Optional[str], finish: Optional[str] = None, role: bool = False,
              lp: Optional[dict] = None):
        raise NotImplementedError

    def opening(self, i: int) -> list:
        """Choice ``i``'s first chunks."""
        return []

    def error_event(self, body: dict):
        """The event of a failure after the status line (OpenAI's error object)."""
        return body

    def tokens(self, i: int, item: Token) -> list:
        """The chunks of choice ``i``'s token ``item``."""
        return [self.chunk(i, item.text)] if item.text else []

    def end(self, i: int, done: Done) -> list:
        """The chunks that end choice ``i``."""
        return [self.chunk(i, "", done.finish_reason)]

    def usage_chunk(self, dones: list[Done]):
        raise NotImplementedError

    def usage(self, dones: list[Done]) -> Usage:
        return usage_of([d.result for d in dones], self.n)


class ChatResponder(Responder):
    """Chat completions; a request with tools has its answers read for calls (:class:`ToolCallParser`: the
    content streams until a call begins, each call goes as one ``tool_calls`` delta when complete)."""

    id_prefix = "chatcmpl"

    def __init__(self, *args):
        super().__init__(*args)
        self.parsers = [ToolCallParser(p.tools) if p.tools is not None else None for p in self.prepared]

    def whole(self, tokens, dones):
        choices = []
        for i, (p, ts, d) in enumerate(zip(self.prepared, tokens, dones)):
            content, calls = "".join(t.text for t in ts), []
            if p.tools is not None:
                content, calls = parse_answer(p.tools, content)
            choices.append(ChatChoice(index=i, finish_reason=p.tools.finish_reason(d.finish_reason, calls)
                                      if p.tools is not None else d.finish_reason,
                                      message=AssistantMessage(content=content, tool_calls=calls or None),
                                      logprobs=self.names.chat(ts) if self.logprobs else None))
        return ChatCompletion(id=self.id, created=self.created, model=self.model, usage=self.usage(dones),
                              magnetar=self.info, choices=choices).model_dump()

    def chunk(self, i, text, finish=None, role=False, lp=None, calls=None):
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[ChunkChoice(
            index=i, delta=Delta(role="assistant" if role else None, content=text, tool_calls=calls),
            finish_reason=finish, logprobs=lp)])

    def opening(self, i):
        return [self.chunk(i, "", role=True)]

    def tokens(self, i, item):
        parser = self.parsers[i]
        if parser is None:
            if self.logprobs:
                return [self.chunk(i, item.text, lp=self.names.chat([item]))]
            return super().tokens(i, item)
        text, calls = parser.feed(item.text)
        lp = self.names.chat([item]) if self.logprobs else None
        out = [self.chunk(i, text, lp=lp)] if text or lp else []
        return out + self._calls(i, calls)

    def _calls(self, i, calls: list[dict]) -> list:
        """One chunk per completed call (OpenAI's delta: its index among the answer's calls, id, name, arguments)."""
        parser, out = self.parsers[i], []
        for call in calls:
            index = parser.calls.index(call)
            out.append(self.chunk(i, None, calls=[dict(call, index=index)]))
        return out

    def end(self, i, done):
        parser = self.parsers[i]
        if parser is None:
            return [self.chunk(i, None, done.finish_reason)]
        text, calls = parser.finish()
        out = ([self.chunk(i, text)] if text else []) + self._calls(i, calls)
        return out + [self.chunk(i, None, self.prepared[i].tools.finish_reason(done.finish_reason, parser.calls))]

    def usage_chunk(self, dones):
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                   usage=self.usage(dones), magnetar=self.info)


class CompletionResponder(Responder):
    id_prefix = "cmpl"

    def __init__(self, *args):
        super().__init__(*args)
        self.offsets = [0] * len(self.prepared)  # text_offset so far, per choice

    def whole(self, tokens, dones):
        return Completion(id=self.id, created=self.created, model=self.model, usage=self.usage(dones),
                          magnetar=self.info,
                          choices=[CompletionChoice(index=i, text=p.echo + "".join(t.text for t in ts),
                                                    finish_reason=d.finish_reason,
                                                    logprobs=self.names.completion(p, ts) if self.logprobs else None)
                                   for i, (p, ts, d) in enumerate(zip(self.prepared, tokens, dones))]).model_dump()

    def chunk(self, i, text, finish=None, role=False, lp=None):
        return Completion(id=self.id, created=self.created, model=self.model,
                          choices=[CompletionChoice(index=i, text=text or "", finish_reason=finish, logprobs=lp)])

    def opening(self, i):
        p = self.prepared[i]
        return [self.chunk(i, p.echo)] if p.echo and not self.logprobs else []

    def tokens(self, i, item):
        if not self.logprobs:
            return super().tokens(i, item)
        p, out = self.prepared[i], []
        if p.echo and self.offsets[i] == 0:  # the echoed prompt (and its tokens' log-probabilities) first
            lp = self.names.completion(p, [item])
            out.append(self.chunk(i, p.echo, lp={k: v[:-1] for k, v in lp.items()}))
            self.offsets[i] = lp["text_offset"][-1]  # where the whole answer puts its first token
        lp = self.names.completion(p, [item], self.offsets[i], prompt=False)
        # text_offset counts each token's own text, as the whole answer's does (not the text deltas, which hold
        # back a word or a stop string's start until the next token decides)
        self.offsets[i] += len(lp["tokens"][0])
        out.append(self.chunk(i, item.text, lp=lp))
        return out

    def usage_chunk(self, dones):
        return Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=self.usage(dones),
                          magnetar=self.info)


async def stream_events(exchange: Exchange, responder: Responder, include_usage: bool, first=None):
    """The server-sent events of a streamed response: each choice's opening, its tokens, its end, then the usage
    (``include_usage``) and ``[DONE]``; a failure after the status line goes as an error event. ``first``: the
    first ``(choice, event)``, already read (the status line waits for it)."""
    dones: list = [None] * len(exchange.sids)
    try:
        for i in range(len(exchange.sids)):
            for c in responder.opening(i):
                yield responder.sse(c)
        while True:
            (i, item), first = (first, None) if first is not None else (await exchange.sink.queue.get(), None)
            if isinstance(item, Token):
                for c in responder.tokens(i, item):
                    yield responder.sse(c)
            elif isinstance(item, Done):
                dones[i] = item
                for c in responder.end(i, item):
                    yield responder.sse(c)
                if any(d is None for d in dones):
                    continue
                if include_usage:
                    yield responder.sse(responder.usage_chunk(dones))
                if responder.done_marker:
                    yield "data: [DONE]\n\n"
                return
            elif isinstance(item, Failed):  # the status line is sent: the error goes as an event
                exchange.cancel_others(dones, i)
                dones[i] = item
                yield responder.sse(responder.error_event(item.error.body()))
                return
    finally:
        exchange.cancel_unfinished(dones)


def build_app(server) -> FastAPI:
    """The FastAPI app of ``server`` (a :class:`magnetar.serve.server.Server`): its routes in groups."""
    app = FastAPI(title="Magnetar", version=__version__, docs_url="/docs", redoc_url=None,
                  description="OpenAI-compatible long-context serving (docs/serving.md)")
    _error_handlers(app, server)
    _info_routes(app, server)
    _generation_routes(app, server)
    _context_routes(app, server)
    _token_routes(app, server)
    app.openapi = lambda: _openapi(app, server)
    return app


def _component(components: dict, cls, **properties) -> dict:
    """The JSON schema of ``cls`` (a pydantic model) put in ``components`` (its own definitions beside it;
    ``properties``: keywords added to some of its properties' schemas), and the reference to it."""
    body = cls.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(body.pop("$defs", {}))
    for name, extra in properties.items():
        body["properties"][name].update(extra)
    components[cls.__name__] = body
    return {"$ref": f"#/components/schemas/{cls.__name__}"}


def _answers(paths: dict, components: dict) -> None:
    """Each route's 200 in ``paths``: the objects it answers (the response models of magnetar.serve.protocol,
    their schemas put in ``components``), a generation's server-sent events one by one."""
    def ref(model) -> dict:
        return _component(components, model)

    def obj(required: dict, **optional) -> dict:
        return {"type": "object", "required": list(required), "properties": {**required, **optional}}

    integer, string = {"type": "integer"}, {"type": "string"}
    context = ref(ContextObject)
    response = obj({"id": string, "object": {"const": "response"}, "status": string, "model": string,
                    "output": {"type": "array"}}, usage={"type": ["object", "null"]})
    events = {"text/event-stream": {"schema": obj(  # one server-sent event (stream: true)
        {"data": {"type": "string", "description": "a chunk object as JSON (chat: ChatCompletionChunk; completions: "
                                                   "Completion; responses: the event named in `event`), or [DONE] "
                                                   "last (chat, completions)"}},
        event={"type": "string"})}}
    answers = {
        ("/v1/chat/completions", "post"): (ref(ChatCompletion), events),
        ("/v1/completions", "post"): (ref(Completion), events),
        ("/v1/responses", "post"): (response, events),
        ("/v1/responses/{rid}", "get"): (response, None),
        ("/v1/responses/{rid}", "delete"): (obj({"id": string, "object": {"const": "response"},
                                                 "deleted": {"type": "boolean"}}), None),
        ("/v1/models", "get"): (ref(ModelList), None),
        ("/v1/models/{model_id}", "get"): (ref(ModelCard), None),
        ("/v1/contexts", "post"): (context, None),
        ("/v1/contexts/{cid}", "delete"): (context, None),
        ("/v1/contexts", "get"): (obj({"object": {"const": "list"}, "data": {"type": "array", "items": {"allOf": [
            context, obj({"tier": string, "stored": {"type": "boolean"}, "bytes": integer})]}}}), None),
        ("/tokenize", "post"): (obj({"count": integer, "max_model_len": {"type": ["integer", "null"]},
                                     "tokens": {"type": "array", "items": integer}}), None),
        ("/detokenize", "post"): (obj({"prompt": string}), None),
        ("/health", "get"): (obj({"status": {"const": "ok"}}), None),
        ("/version", "get"): (obj({"version": string}), None),
    }
    for (path, method), (body, stream) in answers.items():
        ok = paths[path][method]["responses"]["200"]
        ok["content"] = {"application/json": {"schema": body}, **(stream or {})}
    # what a made object's id is for (OpenAPI links: clients and Schemathesis's stateful runs follow them)
    for (path, method), uses in ((("/v1/contexts", "post"), (("/v1/contexts/{cid}", "delete", "cid"),)),
                                 (("/v1/responses", "post"), (("/v1/responses/{rid}", "get", "rid"),
                                                              ("/v1/responses/{rid}", "delete", "rid")))):
        paths[path][method]["responses"]["200"]["links"] = {
            f"{m}{p.split('/')[2].capitalize()}": {"operationId": paths[p][m]["operationId"],
                                                   "parameters": {name: "$response.body#/id"}}
            for p, m, name in uses}


def post_paths(app: FastAPI) -> set[str]:
    """The paths whose POST route reads a JSON body (every POST route of ``app``): the gate's 415 applies there."""
    return {r.path for r in app.routes if "POST" in (getattr(r, "methods", None) or ())}


def error_statuses(path: str, method: str, keyed: bool) -> list[int]:
    """The error statuses ``method`` (lower case) on ``path`` (a route's template) may answer: the gate's (a Host
    refused, an overloaded server; ``keyed``: the API key it checks there; a body's type, size and deadline), the
    route's own."""
    codes = {400, 503}
    if keyed:
        codes.add(401)
    if method == "post":
        codes |= {408, 413, 415, 500}  # a body read; the engine runs it
    if path in GENERATION_PATHS:
        codes.add(501)
    if "{" in path or path == "/v1/responses":  # an id (a model, context, response; previous_response_id)
        codes.add(404)
    return sorted(codes)


def _open(loop) -> None:
    """A 503 when the server takes no new request (draining, failed, stopped)."""
    refused = loop.refusal()
    if refused is not None:
        raise refused


def _error_handlers(app: FastAPI, server) -> None:
    loop, metrics = server.loop, server.metrics

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        # a client that left (499) is counted as "cancelled" by the loop: not also as rejected
        if request.url.path in GENERATION_PATHS and exc.status < 500 and exc.status != 499:
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
        return http_error(app, request, exc)


def _info_routes(app: FastAPI, server) -> None:
    loop, metrics = server.loop, server.metrics

    @app.get("/health")
    async def health():
        refused = loop.refusal()
        if refused is not None:
            return JSONResponse({"status": "failed" if loop.failed else "draining", "message": refused.message},
                                status_code=503)
        return {"status": "ok"}

    @app.get("/version")  # vLLM's: open, as /health is
    async def version():
        return {"version": __version__}

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


def _generation_routes(app: FastAPI, server) -> None:
    loop, preparer = server.loop, server.preparer
    names = LogprobFormat(copy.deepcopy(server.engine.tokenizer))  # the HTTP thread's own copy

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(request, parse_body(ChatCompletionRequest, await request.body()), ChatResponder)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, parse_body(CompletionRequest, await request.body()), CompletionResponder)

    @app.post("/v1/responses")
    async def responses(request: Request):
        req = parse_body(ResponsesRequest, await request.body())
        turn = chat_turn(req, server.responses)
        try:
            return await generate(request, turn.chat, functools.partial(ResponsesResponder, turn=turn,
                                                                        store=server.responses))
        except RequestError as e:
            raise turn.renamed(e) from None

    @app.get("/v1/responses/{rid}")
    async def get_response(rid: str):
        return server.responses.find(rid).response

    @app.delete("/v1/responses/{rid}")
    async def delete_response(rid: str):
        server.responses.find(rid)
        server.responses.delete(rid)
        return {"id": rid, "object": "response", "deleted": True}

    async def generate(request: Request, req: Union[ChatCompletionRequest, CompletionRequest], kind):
        """``req`` through the engine loop, answered by ``kind`` (a :class:`Responder`'s class, or a factory of
        one: the Responses API's) -- whole, or streamed."""
        _open(loop)
        chat = isinstance(req, ChatCompletionRequest)
        prepared = await preparer.run(preparer.chat if chat else preparer.completion, req)
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
        info = {"prompts": [{"split": p.split, "context_tokens": p.context_tokens,
                             "query_tokens": int(p.query_ids.numel())} for p in prepared[::n]]}
        logprobs = req.logprobs is not None and req.logprobs is not False  # chat: a bool; completions: 0..20
        responder = kind(server.model_name, names, prepared, n, info, logprobs)
        exchange = Exchange(loop, request, sink, sids)
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            # the status line waits for the request's first event: a request the engine refuses (or fails) gets
            # its own HTTP status, not a 200 followed by an error event
            first = await exchange.first()
            return StreamingResponse(stream_events(exchange, responder, include_usage, first),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return responder.whole(*await exchange.collect())


def _context_routes(app: FastAPI, server) -> None:
    loop, preparer = server.loop, server.preparer

    @app.post("/v1/contexts")
    async def post_context(request: Request):
        req = parse_body(ContextRequest, await request.body())
        _open(loop)
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
        return context_object(pinned).model_dump()

    @app.get("/v1/contexts")
    async def list_contexts():
        """The pinned contexts, each with where its KV lives: ``tier`` ``memory`` (every rank holds it), ``stored``
        (also in the disk tier, ``--context-store``), ``tokens``, ``bytes`` (its largest shard over the ranks)."""
        return {"object": "list", "data": [dict(context_object(p).model_dump(), tier="memory",
                                                stored=server.engine.is_stored(p.key), bytes=loop.pinned_bytes(p.id))
                                           for p in server.contexts.items()]}

    @app.delete("/v1/contexts/{cid}")
    async def delete_context(cid: str):
        pinned = server.contexts.get(cid)
        if pinned is None:
            raise RequestError(f"context {show(cid)} is not a context of this server (or was deleted)", "context_id",
                               status=404)
        loop.submit(Job("release", loop.new_sid(), cid=cid))
        server.contexts.remove(cid)
        return context_object(pinned, deleted=True).model_dump()

    def context_object(p: PinnedContext, deleted: bool = False) -> ContextObject:
        return ContextObject(id=p.id, created=p.created, model=server.model_name, format=p.format, tokens=p.tokens,
                             deleted=deleted)


def _token_routes(app: FastAPI, server) -> None:
    """vLLM's ``/tokenize`` and ``/detokenize`` (the server's tokenizer, on the preparing threads)."""
    preparer = server.preparer

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await preparer.run(preparer.tokenize, parse_body(TokenizeRequest, await request.body()))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await preparer.run(preparer.detokenize, parse_body(DetokenizeRequest, await request.body()))


def _openapi(app: FastAPI, server) -> dict:
    """FastAPI's schema, with the request bodies the handlers parse themselves (strictly, from the raw body; the
    served model's name the one ``model``), every route's answer (:func:`_answers`), ``/metrics`` as Prometheus text,
    and each operation's error statuses (:func:`error_statuses`) in OpenAI's error body -- in place of FastAPI's 422,
    which no route answers (the handlers parse their bodies; path parameters are any string)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        from magnetar.serve.gate import KEYED_PATHS

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in (("/v1/chat/completions", ChatCompletionRequest), ("/v1/completions", CompletionRequest),
                            ("/v1/contexts", ContextRequest), ("/v1/responses", ResponsesRequest),
                            ("/tokenize", TokenizeRequest), ("/detokenize", DetokenizeRequest)):
            body = _component(components, model, model={"enum": [server.model_name]})  # the one name it answers to
            schema["paths"][path]["post"]["requestBody"] = {"required": True,
                                                            "content": {"application/json": {"schema": body}}}
        schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = {
            "text/plain": {"schema": {"type": "string", "description": "Prometheus text format"}}}
        _answers(schema["paths"], components)
        error = _component(components, ErrorResponse)
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for path, ops in schema["paths"].items():
            keyed = server.api_key is not None and (path.startswith("/v1/") or path in KEYED_PATHS or
                                                    (path == "/metrics" and not server.public_metrics))
            for method, op in ops.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                for code in error_statuses(path, method, keyed):
                    responses[str(code)] = {"description": ERROR_STATUSES[code],
                                            "content": {"application/json": {"schema": error}}}
        health = {"type": "object", "required": ["status", "message"], "properties": {
            "status": {"type": "string", "enum": ["draining", "failed"]}, "message": {"type": "string"}}}
        schema["paths"]["/health"]["get"]["responses"]["503"] = {
            "description": "draining or failed: not taking new requests (or, from the gate, overloaded)",
            "content": {"application/json": {"schema": {"oneOf": [health, error]}}}}
        app.openapi_schema = schema
    return app.openapi_schema
