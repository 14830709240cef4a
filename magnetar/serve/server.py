"""One replica's server: the engine loop on every rank, uvicorn + FastAPI in a thread on the replica's first rank.

    server = Server(engine, model_name="tiny", port=8000)
    status = server.run()      # every rank of the replica; returns 0 after a drain, 1 after a failure

Under data parallelism each replica is a server of its own: its first rank listens on ``port + dp_rank`` (a
load balancer in front deals requests to the replicas). :meth:`Server.drain` (SIGTERM, SIGINT in the CLI) stops
taking requests (503), finishes those in flight, then stops every rank of the replica with status 0.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import socket
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from magnetar.serve.config import ServeConfig
from magnetar.serve.contexts import ContextRegistry
from magnetar.serve.gate import Connections, check_api_key, check_body_budget
from magnetar.serve.loop import EngineLoop
from magnetar.serve.prompts import Preparer
from magnetar.serve.protocol import now
from magnetar.serve.responses import ResponseStore
from magnetar.version import __version__

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 60.0  # for uvicorn to bind its port
GRACEFUL_S = 10  # after the loop stops, for the last responses to be written
BYTES_PER_POSITION = 64  # the default --max-request-bytes: this many per model position (JSON-escaped CJK: ~12)
MIN_REQUEST_BYTES = 2**20
# the default --max-inflight-bytes: this many whole requests' bodies at once (at least 64 MiB)
INFLIGHT_REQUESTS = 16
MIN_INFLIGHT_BYTES = 64 * 2**20


class Server:
    """Serve ``engine`` with the options of ``config`` (a :class:`~magnetar.serve.config.ServeConfig`; or its fields
    as keywords: ``Server(engine, model_name="tiny", port=8000)``); every rank of a replica builds one with the same
    arguments and calls :meth:`run`. ``sock``: a socket already bound to ``host:port`` (``magnetar serve`` binds it
    before loading the model), else uvicorn binds one. The defaults that depend on the model: ``max_request_bytes``
    :data:`BYTES_PER_POSITION` per model position (at least 1 MiB), ``max_inflight_bytes``
    :data:`INFLIGHT_REQUESTS` whole requests' worth (at least 64 MiB); ``prefill_chunk`` applies only where a chunk
    is exact (:meth:`magnetar.engine.Engine.chunk_problem`)."""

    def __init__(self, engine, config: Optional[ServeConfig] = None, *, sock: Optional[socket.socket] = None,
                 front: Optional[socket.socket] = None, replica_urls: Sequence[str] = (), decode_threads=None,
                 **options):
        if config is None:
            config = ServeConfig(**options)
        elif options:
            config = dataclasses.replace(config, **options)
        self.config, self.engine, self.sock = config, engine, sock
        # the front port's socket and every replica's URL (the job's first rank, with --front-port): the router
        # (magnetar.serve.router) runs beside this replica's HTTP server
        self.front_sock, self.replica_urls, self.front = front, list(replica_urls), None
        self.model_name, self.host = config.model_name, config.host
        self.port = config.port + engine.groups.dp_rank
        self.log_level = config.log_level
        self.created = now()
        max_request_bytes = config.max_request_bytes
        if max_request_bytes is None:
            positions = engine.max_positions
            max_request_bytes = 64 * MIN_REQUEST_BYTES if positions is None else \
                max(MIN_REQUEST_BYTES, BYTES_PER_POSITION * positions)
        self.max_request_bytes, self.request_timeout_s = max_request_bytes, config.request_timeout_s
        self.max_connections, self.api_key = config.max_connections, check_api_key(config.api_key, "api_key")
        self.connections = Connections(config.max_connections)  # counted by the HTTP protocol, refused by the gate
        self.max_inflight_bytes = (max(INFLIGHT_REQUESTS * max_request_bytes, MIN_INFLIGHT_BYTES)
                                   if config.max_inflight_bytes is None else config.max_inflight_bytes)
        check_body_budget(self.max_inflight_bytes, max_request_bytes)
        self.public_metrics, self.allowed_hosts = config.public_metrics, config.allowed_hosts
        store = engine.config.runtime.context_store  # the pinned contexts' list lives beside their stored KV
        self.contexts = ContextRegistry(config.max_contexts, path=None if store is None else
                                        Path(store) / f"pinned-dp{engine.groups.dp_rank}.json")
        self.responses = ResponseStore()  # the Responses API's stored responses (previous_response_id)
        self.preparer = None
        self.loop = EngineLoop(engine, max_batch_size=config.max_batch_size, heartbeat_s=config.heartbeat_s,
                               prefill_threads=config.prefill_threads, prefill_chunk=config.prefill_chunk,
                               max_join_tokens=config.max_join_tokens, decode_threads=decode_threads)
        self.metrics = None
        self.app = None
        self._http = None
        self._thread: Optional[threading.Thread] = None
        self.started = threading.Event()  # set once the leader listens (or failed to)
        if self.loop.leader:  # only the replica's first rank reads requests
            from magnetar.serve.app import build_app, post_paths
            from magnetar.serve.gate import Gate, RequestIds
            from magnetar.serve.metrics import Metrics

            self.preparer = Preparer(engine, config.model_name, config.max_tokens, self.contexts,
                                     max_stop_strings=config.max_stop_strings, paste_tokens=config.paste_threshold,
                                     prefill_chunk=self.loop.prefill_chunk)
            self.metrics = self.loop.metrics = Metrics(config.model_name)
            self.metrics.watch_device(engine.device)
            self.app = build_app(self)
            self.asgi = Gate(self.app, max_request_bytes=max_request_bytes, request_timeout_s=config.request_timeout_s,
                             bound_host=config.host, allowed_hosts=config.allowed_hosts, api_key=self.api_key,
                             public_metrics=config.public_metrics, on_refused=self.metrics.refused,
                             connections=self.connections, max_inflight_bytes=self.max_inflight_bytes,
                             json_paths=post_paths(self.app))
            if config.allowed_origins:  # outside the gate: a preflight has no API key, and refusals get CORS headers
                from starlette.middleware.cors import CORSMiddleware

                self.asgi = CORSMiddleware(self.asgi, allow_origins=list(config.allowed_origins),
                                           allow_methods=["GET", "POST", "DELETE", "OPTIONS"], allow_headers=["*"],
                                           expose_headers=["x-request-id", "retry-after", "x-should-retry"],
                                           max_age=600)
            self.asgi = RequestIds(self.asgi)  # outermost: CORS preflights carry the request id too

    @property
    def leader(self) -> bool:
        return self.loop.leader

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def run(self) -> int:
        """Serve until drained (0) or failed (1); on every rank of the replica."""
        if self.leader:
            error = self._start_http()
            if error is not None:
                log.error("%s", error)
                self.loop.start_error = error
            else:
                if self.contexts.path is not None:
                    threading.Thread(target=self._restore_pinned, name="magnetar-restore", daemon=True).start()
                if self.front_sock is not None:
                    from magnetar.serve.router import Front

                    self.front = Front(self.front_sock, self.replica_urls, max_request_bytes=self.max_request_bytes,
                                       log_level=self.log_level)
                    self.front.start()
                    log.warning("front port %s routes to %d replica(s) by their cached prefixes",
                                self.front_sock.getsockname()[:2], len(self.replica_urls))
        try:
            return self.loop.run()
        finally:
            if self.front is not None:
                self.front.stop()
            if self.leader:
                self._stop_http()
            try:  # what this rank encoded reaches the disk tier before the process goes (a drain, a failure)
                self.engine.flush_store(60)
            except TimeoutError as e:
                log.warning("%s", e)

    def _restore_pinned(self) -> None:
        """Pin again the contexts pinned before a restart (``--context-store``): each is encoded as a ``POST
        /v1/contexts`` would -- from the store, when every rank still has it --, under its old id. One whose cache
        key changed (the server's options did) is dropped, and said."""
        from magnetar.serve.loop import Encoded
        from magnetar.serve.protocol import RequestError
        from magnetar.serve.scheduler import Job

        for p in self.contexts.saved():
            if self.engine.cache_key(p.context_ids) != p.key:
                log.warning("pinned context %s was encoded with other options than this server's: not pinned again",
                            p.id)
                continue
            events: queue.SimpleQueue = queue.SimpleQueue()
            try:
                self.contexts.reserve(p.id)
                self.loop.submit(Job("encode", self.loop.new_sid(), events, cid=p.id, context_ids=p.context_ids,
                                     key=p.key))
            except RequestError as e:  # full, or the server is stopping
                log.warning("pinned context %s is not pinned again: %s", p.id, e.message)
                self.contexts.unreserve(p.id)
                return
            item = events.get()
            if isinstance(item, Encoded):
                self.contexts.add(p)
            else:
                self.contexts.unreserve(p.id)
                log.warning("pinned context %s could not be encoded again: %s", p.id, getattr(item, "error", item))

    def drain(self) -> None:
        """Stop taking requests and stop once those in flight are answered (safe in a signal handler: it only
        sets a flag the loop polls). On ranks other than the leader it does nothing: they follow its ticks."""
        self.loop.draining = True

    def _start_http(self) -> Optional[str]:
        import uvicorn

        from magnetar.serve.gate import bounded_protocol

        config = uvicorn.Config(self.asgi, host=self.host, port=self.port, log_level=self.log_level, lifespan="off",
                                timeout_graceful_shutdown=GRACEFUL_S, access_log=False,
                                http=bounded_protocol(self.request_timeout_s, self.connections))
        self._http = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._http.run, name="magnetar-http", daemon=True,
                                        kwargs={"sockets": [self.sock]} if self.sock is not None else {})
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._http.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        self.started.set()
        if not self._http.started:
            return (f"the HTTP server could not listen on {self.host}:{self.port} (in use, or not an address of this "
                    f"host?); choose another --host/--port")
        log.warning("serving %s on %s (rank %d, dp_rank %d; magnetar %s)", self.model_name, self.url,
                    self.engine.groups.rank, self.engine.groups.dp_rank, __version__)
        return None

    def _stop_http(self) -> None:
        if self._http is not None:
            self._http.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=GRACEFUL_S + 5)
        if self.preparer is not None:
            self.preparer.close()
