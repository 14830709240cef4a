"""One front port for the data-parallel replicas (``magnetar serve --front-port P``), routing by cache.

Each replica keeps its own context cache, so behind a plain load balancer the second question about a document
lands on a replica that never encoded it. The front (on the job's first rank, beside its replica; uvicorn and httpx,
no new process manager) sends each request to the replica most likely to hold its context, as SGLang's router does:
it remembers, per replica, the prompts it routed there (their text, in blocks of :data:`BLOCK` characters, chained
hashes, the most recent :data:`MAX_BLOCKS` per replica) and routes a request to the replica sharing the longest
prefix with it -- the same document, the same conversation's earlier turns --; when none shares a block (or two
share as many), to the one with the fewest requests in flight, then the one routed fewer so far. Requests that name
a replica's own state go there: ``magnetar.context_id`` (a pinned context), ``previous_response_id`` (a stored
response), ``DELETE /v1/contexts/{id}`` and ``/v1/responses/{id}`` (learnt from the replies that made them).
``GET /v1/contexts`` lists every replica's pinned contexts with the replica that holds them; ``/health`` is the
replicas' together; what every replica answers alike -- ``/tokenize``, ``/detokenize``, ``/v1/models/{id}``,
``/version``, the API's schema (``/openapi.json``) and page (``/docs``) -- goes to the one with the fewest requests
in flight. Bodies and streams pass through unchanged (status, headers, server-sent events; the reply says
``x-magnetar-replica``); the replicas check every request themselves (key, limits, fields)."""
from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from typing import Any, Optional

from fastapi import FastAPI, Request  # at module level: the handlers' annotations are resolved from here
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from magnetar.serve.errors import http_error

log = logging.getLogger(__name__)

BLOCK = 256  # characters per block of a prompt's chained hashes
MAX_BLOCKS = 1 << 16  # block hashes remembered per replica (least recently routed out)
MAX_IDS = 1 << 16  # context and response ids remembered (their replica)
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "host"}


def prompt_text(body: dict) -> str:
    """The text a request's context is made of, in prompt order: the messages' roles and contents (chat), the
    prompt (completions), the instructions and input (responses), ``magnetar.context`` first when given. Any JSON
    object is read (what is not text counts as none): the replica, not the front, refuses a malformed request."""
    parts: list[str] = []
    options = body.get("magnetar")
    if isinstance(options, dict) and isinstance(options.get("context"), str):
        parts.append(options["context"])
    for key in ("instructions", "context"):
        if isinstance(body.get(key), str):
            parts.append(body[key])
    for key in ("messages", "input"):
        value = body.get(key)
        if isinstance(value, str):
            parts.append(value)
        elif isinstance(value, list):
            for m in value:
                if isinstance(m, dict):
                    content = m.get("content", m.get("output", ""))
                    role = m.get("role", m.get("type", ""))
                    parts.append(f"{role if isinstance(role, str) else ''}:{_text(content)}")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        parts.append(prompt)
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        parts.append(prompt[0])
    elif isinstance(prompt, list):
        parts.append(json.dumps(prompt[:4096]))
    return "\n".join(parts)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def block_digests(text: str) -> list[bytes]:
    """The chained hashes of ``text``'s whole blocks: entry ``k`` names its first ``(k + 1) * BLOCK`` characters."""
    out, h = [], b""
    for k in range(len(text) // BLOCK):
        h = hashlib.blake2b(h + text[k * BLOCK:(k + 1) * BLOCK].encode("utf-8", "surrogatepass"),
                            digest_size=12).digest()
        out.append(h)
    return out


class PrefixRouter:
    """Where each request goes (thread-safe): the replica whose remembered prompts share the longest prefix with
    it, else the least loaded; requests naming a replica's state go to that replica."""

    def __init__(self, replicas: int):
        self.replicas = replicas
        self._blocks: list[OrderedDict] = [OrderedDict() for _ in range(replicas)]
        self._ids: OrderedDict[str, int] = OrderedDict()  # context / response id -> replica
        self.inflight = [0] * replicas
        self.routed = [0] * replicas
        self._lock = threading.Lock()

    def choose(self, body: dict) -> tuple[int, str]:
        """(the replica, why) for a generation or context request's JSON ``body``; remembers its prompt there."""
        owner = self._owner(body)
        digests = block_digests(prompt_text(body))
        with self._lock:
            if owner is not None:
                replica, why = owner, "owner"
            else:
                matched = [self._matched(r, digests) for r in range(self.replicas)]
                replica = min(range(self.replicas), key=lambda r: (-matched[r], self.inflight[r], self.routed[r], r))
                why = "prefix" if matched[replica] else "load"
            blocks = self._blocks[replica]
            for d in digests:
                blocks[d] = None
                blocks.move_to_end(d)
            while len(blocks) > MAX_BLOCKS:
                blocks.popitem(last=False)
            self.routed[replica] += 1
        return replica, why

    def _matched(self, replica: int, digests: list[bytes]) -> int:
        blocks, n = self._blocks[replica], 0
        for d in digests:
            if d not in blocks:
                break
            n += 1
        return n

    def _owner(self, body: dict) -> Optional[int]:
        options = body.get("magnetar")
        for key in ((options or {}).get("context_id") if isinstance(options, dict) else None,
                    body.get("previous_response_id")):
            if isinstance(key, str):
                found = self.owner(key)
                if found is not None:
                    return found
        return None

    def owner(self, rid: str) -> Optional[int]:
        with self._lock:
            return self._ids.get(rid)

    def learn(self, rid: Any, replica: int) -> None:
        """Remember that the context or response ``rid`` lives on ``replica``."""
        if not isinstance(rid, str):
            return
        with self._lock:
            self._ids[rid] = replica
            self._ids.move_to_end(rid)
            while len(self._ids) > MAX_IDS:
                self._ids.popitem(last=False)


def build_front(urls: list[str], max_request_bytes: int = 1 << 20):
    """The front's FastAPI app over the replicas at ``urls`` (``http://host:port``, by data-parallel rank); a body
    over ``max_request_bytes`` (the replicas' own bound) is refused before it is held whole (413)."""
    import httpx

    app = FastAPI(title="Magnetar front", docs_url=None, redoc_url=None, openapi_url=None)  # the replicas' own
    router = PrefixRouter(len(urls))
    app.state.router = router
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=httpx.Limits(max_connections=1024))

    @app.exception_handler(StarletteHTTPException)  # an unknown path, a method it does not take: as the replicas
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return http_error(app, request, exc)

    def headers_of(request: Request) -> dict:
        return {k: v for k, v in request.headers.items() if k.lower() not in _HOP}

    def raw(request: Request) -> str:
        """The request's path and query as they arrived (percent-encoded): an id reaches the replica as sent."""
        from urllib.parse import quote

        path = request.scope.get("raw_path")  # optional in ASGI: else the decoded path, encoded again
        path = path.decode("latin-1") if path else quote(request.url.path)
        query = request.scope.get("query_string") or b""
        return path + ("?" + query.decode("latin-1") if query else "")

    async def forward(request: Request, replica: int, path: str, body: bytes, learn: Optional[str] = None):
        router.inflight[replica] += 1
        try:
            upstream = await client.send(client.build_request(request.method, urls[replica] + path, content=body,
                                                              headers=headers_of(request)), stream=True)
        except httpx.TransportError as e:
            router.inflight[replica] -= 1
            return JSONResponse({"error": {"message": f"replica {replica} ({urls[replica]}) did not answer: {e}",
                                           "type": "server_error", "param": None, "code": None}}, status_code=502)
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
        headers["x-magnetar-replica"] = str(replica)
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            async def events():
                try:
                    first = True
                    async for chunk in upstream.aiter_raw():
                        if first and learn:
                            _learn_from(router, chunk, replica)
                            first = False
                        yield chunk
                finally:
                    await upstream.aclose()
                    router.inflight[replica] -= 1
            return StreamingResponse(events(), status_code=upstream.status_code, headers=headers)
        try:
            content = await upstream.aread()
        finally:
            await upstream.aclose()
            router.inflight[replica] -= 1
        if learn and upstream.status_code == 200:
            _learn_from(router, content, replica)
        return Response(content, status_code=upstream.status_code, headers=headers)

    async def read(request: Request) -> Optional[bytes]:
        """The body, or None past ``max_request_bytes`` (its Content-Length, or as a chunked body arrives)."""
        if int(request.headers.get("content-length") or 0) > max_request_bytes:
            return None
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_request_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    def too_large() -> JSONResponse:
        return JSONResponse({"error": {"message": f"the request body is over {max_request_bytes} bytes (the "
                                                  f"replicas' --max-request-bytes)", "type": "invalid_request_error",
                                       "param": None, "code": "request_too_large"}}, status_code=413)

    async def routed(request: Request, learn: Optional[str] = None):
        body = await read(request)
        if body is None:
            return too_large()
        try:
            parsed = json.loads(body) if body.strip() else {}
        except ValueError:
            parsed = {}
        replica, why = router.choose(parsed if isinstance(parsed, dict) else {})
        log.debug("%s -> replica %d (%s)", request.url.path, replica, why)
        return await forward(request, replica, raw(request), body, learn)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await routed(request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await routed(request)

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await routed(request, learn="response")

    @app.post("/v1/contexts")
    async def post_context(request: Request):
        return await routed(request, learn="context")

    @app.api_route("/v1/contexts/{rid}", methods=["DELETE"])
    @app.api_route("/v1/responses/{rid}", methods=["GET", "DELETE"])
    async def owned(request: Request, rid: str):
        replica = router.owner(rid)
        if replica is None:
            return JSONResponse({"error": {"message": f"{rid!r} is not known to any replica behind this front",
                                           "type": "invalid_request_error", "param": None, "code": None}},
                                status_code=404)
        return await forward(request, replica, raw(request), b"")

    @app.get("/v1/contexts")
    async def contexts(request: Request):
        """Every replica's pinned contexts, each with the replica that holds it."""
        data = []
        for replica, url in enumerate(urls):
            got = await client.get(url + "/v1/contexts", headers=headers_of(request))
            if got.status_code != 200:
                return Response(got.content, status_code=got.status_code, media_type="application/json")
            data += [dict(c, replica=replica) for c in got.json()["data"]]
        return {"object": "list", "data": data}

    @app.get("/v1/models")
    async def models(request: Request):
        return await forward(request, 0, "/v1/models", b"")

    def least_loaded() -> int:
        return min(range(len(urls)), key=lambda r: router.inflight[r])

    async def alike(request: Request):
        """A request every replica answers alike: to the one with the fewest in flight."""
        body = await read(request)
        if body is None:
            return too_large()
        return await forward(request, least_loaded(), raw(request), body)

    for path, method in (("/tokenize", "POST"), ("/detokenize", "POST"), ("/v1/models/{model_id:path}", "GET"),
                         ("/docs", "GET"), ("/version", "GET")):
        app.add_api_route(path, alike, methods=[method], include_in_schema=False)

    @app.get("/openapi.json", include_in_schema=False)
    async def schema(request: Request):
        """A replica's schema, as the front answers it: without ``/metrics`` (each replica's own: scrape each), with
        the front's own ``/health`` (every replica's status) and 502 (a replica that did not answer)."""
        got = await forward(request, least_loaded(), "/openapi.json", b"")
        if got.status_code != 200:
            return got
        doc = json.loads(got.body)
        doc["paths"].pop("/metrics", None)
        health = {"type": "object", "required": ["status", "replicas", "routed"], "properties": {
            "status": {"type": "string", "enum": ["ok", "degraded"]},
            "replicas": {"type": "array", "items": {"type": ["integer", "null"]}},
            "routed": {"type": "array", "items": {"type": "integer"}}}}
        for code, what in (("200", "every replica answers"), ("503", "a replica does not answer, or is not ok")):
            doc["paths"]["/health"]["get"]["responses"][code] = {
                "description": what, "content": {"application/json": {"schema": health}}}
        for ops in doc["paths"].values():
            for op in ops.values():
                op.setdefault("responses", {})["502"] = {
                    "description": "a replica did not answer (through the front port, --front-port)",
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        return JSONResponse(doc)

    @app.get("/health")
    async def health():
        states = []
        for url in urls:
            try:
                states.append((await client.get(url + "/health", timeout=5)).status_code)
            except httpx.TransportError:
                states.append(None)
        ok = all(s == 200 for s in states)
        return JSONResponse({"status": "ok" if ok else "degraded", "replicas": states,
                             "routed": router.routed}, status_code=200 if ok else 503)

    return app


def _learn_from(router: PrefixRouter, content: bytes, replica: int) -> None:
    """The id a reply made (a pinned context's, a stored response's): from a JSON body, or the first event."""
    text = content.decode("utf-8", "replace")
    if text.startswith("event:") or text.startswith("data:"):
        for line in text.splitlines():
            if line.startswith("data:"):
                text = line[5:].strip()
                break
    try:
        obj = json.loads(text)
    except ValueError:
        return
    if isinstance(obj, dict):
        router.learn(obj.get("id") or (obj.get("response") or {}).get("id"), replica)


class Front:
    """The front's uvicorn server on ``sock`` (a bound socket), in a thread of the job's first rank."""

    def __init__(self, sock, urls: list[str], *, max_request_bytes: int, log_level: str = "warning"):
        import uvicorn

        self.app = build_front(urls, max_request_bytes)
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level=log_level, lifespan="off",
                                                    access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name="magnetar-front",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
