"""What every HTTP request passes before a route sees it, and the HTTP protocol that bounds a connection.

:class:`Gate` is an ASGI middleware around the FastAPI app. In this order, a request is refused with OpenAI's
error body when

1. its ``Host`` header names another host than the server's (DNS rebinding: a web page whose name resolves to
   127.0.0.1 must not read the answers) -- checked when the server is bound to a loopback address, or always
   with ``--allowed-hosts``: **400** ``invalid_host``;
2. an API key is set (``--api-key`` or ``MAGNETAR_API_KEY``) and the request to ``/v1/...``, ``/tokenize``,
   ``/detokenize`` (or ``/metrics``,
   unless ``--public-metrics``) does not carry ``Authorization: Bearer KEY``: **401** ``invalid_api_key``
   (``/health`` and the OpenAPI schema stay open, as in vLLM and SGLang);
3. a POST body to a route that reads one is not ``application/json`` (a form, ``text/plain`` or no content type:
   the "simple" requests a browser sends cross-site without asking): **415** -- a method a path does not take (a
   PUT, a POST to ``/health``) reads no body and is the app's **405** (or 404 for a path it does not have);
4. its body is larger than ``--max-request-bytes`` -- told by ``Content-Length`` before anything is read, or
   counted as a chunked body arrives: **413** ``request_too_large``;
5. its body does not arrive whole within ``--request-timeout-s`` of its headers (a body shorter than its
   ``Content-Length``, a client that trickles): **408**;
6. more connections are open than ``--max-connections`` (counted by the protocol, :class:`Connections`), or the
   request bodies of the requests in flight would hold more than ``--max-inflight-bytes`` (told by
   ``Content-Length``, or counted as bodies arrive): **503** ``server_overloaded`` with ``Retry-After: 1``.

Every response carries an ``x-request-id`` header (:class:`RequestIds`, the outermost layer: CORS preflights and
every refusal too): the request's own when it sent a usable one (at most 128 characters of letters, digits and
``-_.:``), else one made here (``req-`` and 24 hex digits).

A request's headers are bounded by :class:`BoundedH11Protocol`: a connection that has not sent a whole request
head within ``--request-timeout-s`` (nothing at all, or half the headers) is closed, and h11 refuses a head
larger than its 16 KiB limit. This module knows nothing about the engine (the error bodies are
:func:`magnetar.serve.protocol.error_body`).
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import re
import time
import uuid
from typing import Iterable, Optional

from magnetar.serve.protocol import error_body

log = logging.getLogger(__name__)

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
JSON_TYPES = ("application/json",)
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id(given: Optional[str]) -> str:
    """The ``x-request-id`` of a response: the client's own when usable (a log-safe token), else a new one."""
    if given is not None and _REQUEST_ID.fullmatch(given.strip()):
        return given.strip()
    return f"req-{uuid.uuid4().hex[:24]}"


def is_loopback(host: str) -> bool:
    """Whether the address ``host`` (a name or an IP) is this machine's loopback."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_of(header: str) -> str:
    """The host name of a ``Host`` header value (``example.com:8000`` -> ``example.com``, ``[::1]:80`` -> ``::1``),
    lower-cased."""
    value = header.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


KEYED_PATHS = ("/tokenize", "/detokenize")  # outside /v1, but the model's tokenizer: the key guards them too


def check_api_key(key: Optional[str], name: str = "api_key") -> Optional[str]:
    """The API key as the server compares it (None: no key): surrounding whitespace stripped -- a key mounted from a
    secret file ends in a newline, and the gate strips the token a client sends alike. A key that is empty once
    stripped, or holds a character an HTTP header cannot carry as it is (non-ASCII -- headers are read as latin-1,
    and the ``openai`` client refuses to send such a header -- or a control character), is a ValueError naming
    ``name`` (the flag or variable it came from): no client could ever authenticate with it."""
    if key is None:
        return None
    if not isinstance(key, str):
        raise ValueError(f"{name} must be a string (the key clients send), got {type(key).__name__}")
    stripped = key.strip()
    if not stripped:
        raise ValueError(f"{name} is empty; give the key clients must send (or leave it out)")
    bad = next((c for c in stripped if not (c.isascii() and c.isprintable())), None)
    if bad is not None:
        raise ValueError(f"{name} holds {bad!r} (U+{ord(bad):04X}), which an HTTP header cannot carry, so no client "
                         f"could send this key; use printable ASCII (e.g. `openssl rand -hex 32`)")
    return stripped


class Refused(Exception):
    """A request the gate refuses: HTTP ``status``, OpenAI's error ``code`` and a message."""

    def __init__(self, status: int, message: str, code: Optional[str], headers: Iterable[tuple[bytes, bytes]] = ()):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, list(headers)

    def body(self) -> bytes:
        """OpenAI's error body, as JSON bytes."""
        return json.dumps(error_body(self.message, code=self.code)).encode()


def check_body_budget(max_inflight_bytes: int, max_request_bytes: int) -> None:
    """ValueError naming both flags when the in-flight budget of request bodies could never hold one whole request."""
    if max_inflight_bytes < max_request_bytes:
        raise ValueError(f"--max-inflight-bytes {max_inflight_bytes} is below --max-request-bytes "
                         f"{max_request_bytes}: one whole request could never be taken; raise it")


class Connections:
    """The HTTP connections open now (the protocol counts them: :func:`bounded_protocol`), and how many may be."""

    def __init__(self, limit: Optional[int] = None):
        self.open, self.limit = 0, limit


class RequestIds:
    """The outermost ASGI layer: every response -- the app's, the gate's refusals, a CORS preflight answered before
    the gate -- carries ``x-request-id`` (:func:`request_id`), which the layers inside read from
    ``scope["state"]["request_id"]``."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope.get("headers") or () if k.lower() == b"x-request-id"), None)
        rid = request_id(given.decode("latin-1") if given is not None else None)
        scope.setdefault("state", {})["request_id"] = rid
        await self.app(scope, receive, _with_request_id(send, rid.encode()))


class Gate:
    """ASGI middleware: the checks of the module docstring, then ``app`` (inside :class:`RequestIds`, which gives
    every response its request id). ``bound_host``: the address the server
    listens on; ``allowed_hosts``: ``Host`` names accepted besides the loopback names (with any, only those and
    the loopback names are accepted even off loopback); ``api_key``: None for no key; ``connections``: the open
    connections and their limit (None: unlimited); ``max_inflight_bytes``: the request-body bytes all requests in
    flight may hold together (None: unlimited); ``json_paths``: the paths whose POST reads a JSON body (the app's POST
    routes; None: every POST, PUT and PATCH is held to JSON)."""

    def __init__(self, app, *, max_request_bytes: int, request_timeout_s: float, bound_host: str,
                 allowed_hosts: Iterable[str] = (), api_key: Optional[str] = None, public_metrics: bool = False,
                 on_refused=None, connections: Optional[Connections] = None,
                 max_inflight_bytes: Optional[int] = None, json_paths: Optional[Iterable[str]] = None):
        self.app = app
        self.json_paths = None if json_paths is None else frozenset(json_paths)
        self.connections = connections
        self.max_inflight_bytes, self.inflight_bytes = max_inflight_bytes, 0
        self.max_request_bytes = max_request_bytes
        self.request_timeout_s = request_timeout_s
        self.allowed_hosts = {h.lower() for h in allowed_hosts}
        self.check_host = bool(self.allowed_hosts) or is_loopback(bound_host)
        if self.check_host:
            self.allowed_hosts |= set(LOOPBACK_NAMES)
            if not bound_host.startswith("0.") and bound_host not in ("::", ""):
                self.allowed_hosts.add(bound_host.lower().strip("[]"))
        self.api_key = api_key.encode() if api_key else None
        self.public_metrics = public_metrics
        self.on_refused = on_refused  # called with the status of every refusal (metrics)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {}
        for name, value in scope.get("headers") or ():
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        try:
            self._check(scope, headers)
        except Refused as r:
            return await self._refuse(send, r)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        # this request's body bytes in the in-flight budget until it is answered: its Content-Length reserved now
        # (checked in _check, no await since), more as a body without one arrives
        length = headers.get("content-length")
        held = {"bytes": int(length) if length is not None else 0}
        self.inflight_bytes += held["bytes"]
        try:
            await self.app(scope, self._bounded(receive, held), send)
        finally:
            self.inflight_bytes -= held["bytes"]

    def _check(self, scope, headers: dict) -> None:
        path = scope["path"]
        c = self.connections
        if c is not None and c.limit is not None and c.open > c.limit:
            raise Refused(503, f"this server has {c.open} connections open, more than its {c.limit} "
                               f"(--max-connections); retry shortly, or close idle connections",
                          "server_overloaded", [(b"retry-after", b"1")])
        if self.check_host:
            host = host_of(headers.get("host", ""))
            if host not in self.allowed_hosts:
                raise Refused(400, f"Host {headers.get('host', '')[:100]!r} is not a name of this server (allowed: "
                                   f"{', '.join(sorted(self.allowed_hosts))}); start it with --allowed-hosts NAME to "
                                   f"accept another", "invalid_host")
        if self.api_key is not None and (path.startswith("/v1/") or path == "/v1" or path in KEYED_PATHS or
                                         (path == "/metrics" and not self.public_metrics)):
            given = headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key):
                raise Refused(401, "missing or incorrect API key: send the server's key (--api-key / "
                                   "MAGNETAR_API_KEY) as 'Authorization: Bearer KEY' (the openai client's api_key)",
                              "invalid_api_key", [(b"www-authenticate", b"Bearer")])
        if scope["method"] in ("POST", "PUT", "PATCH"):
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            reads = self.json_paths is None or (scope["method"] == "POST" and path in self.json_paths)
            if reads and media not in JSON_TYPES:
                shown = repr(media[:60]) if media else "none"
                raise Refused(415, f"the request body must be JSON with 'Content-Type: application/json' (got "
                                   f"{shown})", "unsupported_media_type")
            length = headers.get("content-length")
            if length is not None:
                if not length.strip().isdigit():
                    raise Refused(400, f"Content-Length {length[:40]!r} is not a number of bytes", None)
                if int(length) > self.max_request_bytes:
                    raise Refused(413, self._too_large(f"{int(length)} bytes"), "request_too_large")
                self._check_inflight(int(length))

    def _check_inflight(self, more: int) -> None:
        """503 when ``more`` body bytes would take the requests in flight past ``max_inflight_bytes``."""
        if self.max_inflight_bytes is not None and self.inflight_bytes + more > self.max_inflight_bytes:
            raise Refused(503, f"the requests in flight hold {self.inflight_bytes} bytes of request bodies; "
                               f"{more} more would pass this server's {self.max_inflight_bytes} "
                               f"(--max-inflight-bytes); retry shortly", "server_overloaded",
                          [(b"retry-after", b"1")])

    def _too_large(self, size: str) -> str:
        return (f"the request body ({size}) is larger than this server accepts ({self.max_request_bytes} bytes, "
                f"--max-request-bytes); a context that long does not fit the model anyway -- shorten it")

    def _bounded(self, receive, held: dict):
        """``receive`` that refuses a body past the byte limit (413), past the in-flight budget (503; ``held``
        counts this request's bytes in it) or still incomplete at the deadline (408); once the body is whole it
        passes every message through (the disconnect a streaming response waits for)."""
        state = {"bytes": 0, "done": False, "deadline": None}

        async def bounded():
            if state["done"]:
                return await receive()
            if state["deadline"] is None:  # from the app's first read: the server's own work before it (routing,
                # a first request's imports on a loaded machine) is not the client's time to send
                state["deadline"] = time.monotonic() + self.request_timeout_s
            left = state["deadline"] - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), timeout=max(left, 0.0))
            except asyncio.TimeoutError:
                raise Refused(408, f"the request body did not arrive whole within {self.request_timeout_s:g} s "
                                   f"(--request-timeout-s): send all the bytes its Content-Length announces",
                              "request_timeout") from None
            if message["type"] == "http.request":
                n = len(message.get("body", b""))
                extra = state["bytes"] + n - held["bytes"]  # past what its Content-Length reserved
                if extra > 0:
                    self._check_inflight(extra)
                    held["bytes"] += extra
                    self.inflight_bytes += extra
                state["bytes"] += n
                if state["bytes"] > self.max_request_bytes:
                    raise Refused(413, self._too_large(f"more than {self.max_request_bytes} bytes"),
                                  "request_too_large")
                if not message.get("more_body", False):
                    state["done"] = True
            else:
                state["done"] = True
            return message

        return bounded

    async def _refuse(self, send, r: Refused) -> None:
        if self.on_refused is not None:
            self.on_refused(r.status)
        body = r.body()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close"), *r.headers]
        await send({"type": "http.response.start", "status": r.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _with_request_id(send, rid: bytes):
    """``send`` that adds ``x-request-id`` to the response head."""
    async def sender(message):
        if message["type"] == "http.response.start":
            message = dict(message, headers=[*message.get("headers", ()), (b"x-request-id", rid)])
        await send(message)

    return sender


def bounded_protocol(header_timeout_s: float, connections: Optional[Connections] = None):
    """uvicorn's h11 protocol, with a connection closed when it has not sent a whole request head within
    ``header_timeout_s`` of connecting (or of the bytes of its next request), and the open connections counted in
    ``connections`` (the gate answers past their limit: uvicorn's own ``limit_concurrency`` 503 carries none of
    the server's headers)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11Protocol(H11Protocol):
        _head_timer: Optional[asyncio.TimerHandle] = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if connections is not None:
                connections.open += 1
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:
                if self._head_timer is None:
                    self._arm()  # the bytes of a next request on a kept-alive connection
            else:
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            if connections is not None:
                connections.open -= 1
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.info("closing a connection that sent no whole request head within %g s", header_timeout_s)
                self.transport.close()

    return BoundedH11Protocol
