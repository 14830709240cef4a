"""``ServeConfig``: the server's own options, as :class:`~magnetar.config.EngineConfig` is the engine's -- each field's
default, its ``magnetar serve`` flag (type check and help) in one place. ``Server(engine, ServeConfig(...))`` or
``Server(engine, model_name=..., port=...)`` take it; :func:`add_serve_args` makes the flags, :meth:`ServeConfig.
from_args` reads them back."""
from __future__ import annotations

import argparse
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Optional

from magnetar.config.checks import MAX_STOP_STRINGS
from magnetar.serve.split import PASTE_TOKENS
from magnetar.utils.cli import int_at_least

PREFILL_CHUNK = 2048  # --prefill-chunk's default (tokens)
# --max-join-tokens' default (tokens), vLLM's CPU server's token budget a step: two messages just under
# --paste-threshold (all of it query) join in one forward, and several arriving together get their first tokens two
# by two. On the Intel AMX VM in bf16 two joined 1K queries cost 1.7x one, four 3.4x (docs/results.md, "One pass for
# the rotary embedding"); on the AVX-512 EPYC VM in fp32 a joined query cost what one alone does, and 1024 (each
# alone) gave the better TTFT p50 there ("Queries joined per tick")
MAX_JOIN_TOKENS = 2 * PASTE_TOKENS
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
LIMITS = "what clients may send (docs/serving.md, \"Limits and access\")"  # the flags' second group


def _bounded(cast, low, high, expected: str, bounds: str):
    """An argparse ``type=``: ``cast(text)`` within ``[low, high]``, else an error saying what to give."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text!r}")
        return value

    return parse


tcp_port = _bounded(int, 1, 65535, "a TCP port (an int in 1..65535)", "a TCP port in 1..65535")
positive_seconds = _bounded(float, 0.001, 86400, "a number of seconds", "between 0.001 and 86400 seconds")


def host_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip().lower() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated host names, got {text!r}")
    return names


def origin_list(text: str) -> tuple[str, ...]:
    origins = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    if not origins:
        raise argparse.ArgumentTypeError(f"expected comma-separated origins (https://app.example.com) or '*', got "
                                         f"{text!r}")
    for o in origins:
        if o != "*" and not re.fullmatch(r"https?://[^/\s]+", o):
            raise argparse.ArgumentTypeError(f"{o!r} is not an origin: give scheme://host[:port] (no path), or '*'")
    return origins


def _opt(default, help: str, *, type=None, flag: bool = True, group: Optional[str] = None, **argparse_kw) -> Any:
    """A field with its flag: ``type`` (an argparse ``type=``; None with a bool default: ``store_true``),
    ``flag=False``: no flag of its own (the command line sets it otherwise); ``default`` MISSING: required."""
    meta = dict(help=help, type=type, flag=flag, group=group, argparse=argparse_kw)
    if default is MISSING:
        return field(metadata=meta)
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda: tuple(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """One replica's server options (docs/serving.md). ``model_name`` is the name clients send
    (``--served-model-name``, default from ``--model``); ``sock``-binding, the model and the threads are the command
    line's (:mod:`magnetar.serve.cli`)."""

    model_name: str = _opt(MISSING, "the model name clients send", flag=False)
    host: str = _opt("127.0.0.1", "address to listen on (default 127.0.0.1; 0.0.0.0: every one)")
    port: int = _opt(8000, "port of the first replica; replica d listens on port + d", type=tcp_port)
    front_port: Optional[int] = _opt(None, "one port for all the data-parallel replicas, on the job's first rank: "
                                           "routes each request to the replica holding its longest cached prefix "
                                           "(the fewest requests in flight breaks ties; default: none)", type=tcp_port)
    max_batch_size: int = _opt(16, "requests decoding together", type=int_at_least(1))
    max_tokens: int = _opt(256, "max_tokens of a request that gives none (capped to the positions left)",
                           type=int_at_least(1))
    max_contexts: int = _opt(16, "contexts pinned by POST /v1/contexts at most", type=int_at_least(0))
    paste_threshold: int = _opt(
        PASTE_TOKENS, f"a chat's last user message of at least this many tokens holds a document: its text before the "
                      f"question is encoded as context (Phase 1, cached); 0: never (default {PASTE_TOKENS})",
        type=int_at_least(0))
    prefill_chunk: int = _opt(
        PREFILL_CHUNK, f"a new context of more tokens runs its Phase 1 in chunks of this many, one between two decode "
                       f"steps, so decoding requests are not held for a whole Phase 1 (dense or ring on one CP rank; "
                       f"0: whole; default {PREFILL_CHUNK})", type=int_at_least(0))
    max_join_tokens: int = _opt(
        MAX_JOIN_TOKENS, f"the query tokens the requests joining the decode batch between two decode steps forward "
                         f"together (like vLLM's --max-num-batched-tokens): the first always joins, the next wait a "
                         f"step -- requests arriving together get their first tokens one after another, not all "
                         f"after one long forward (0: no bound; default {MAX_JOIN_TOKENS})", type=int_at_least(0))
    prefill_threads: Optional[int] = _opt(None, "intra-op threads while Phase 1s and query forwards run (None: the "
                                                "process's count throughout)", flag=False)
    heartbeat_s: Optional[float] = _opt(None, "the idle tick period (default: a quarter of the collective timeout, at "
                                              "most 5 s)", flag=False)
    log_level: str = _opt("warning", "uvicorn's and the server's log level", choices=LOG_LEVELS)
    api_key: Optional[str] = _opt(None, "require 'Authorization: Bearer KEY' on /v1/* and /metrics (default: "
                                        "$MAGNETAR_API_KEY; prefer the variable: a flag is visible in the process "
                                        "list)", group=LIMITS)
    public_metrics: bool = _opt(False, "serve /metrics without the API key", group=LIMITS)
    allowed_hosts: tuple = _opt((), "comma-separated Host names accepted besides localhost/127.0.0.1/::1 "
                                    "(DNS-rebinding guard; checked when --host is loopback, or always once this is "
                                    "given)", type=host_list, group=LIMITS)
    allowed_origins: tuple = _opt((), "comma-separated browser origins allowed to call the API (CORS), or '*'; "
                                      "default none", type=origin_list, group=LIMITS)
    max_request_bytes: Optional[int] = _opt(None, "largest request body, else 413 (default: 64 bytes per model "
                                                  "position, at least 1 MiB)", type=int_at_least(1024), group=LIMITS)
    request_timeout_s: float = _opt(60.0, "a request's head, and then its body, must arrive within this (default 60)",
                                    type=positive_seconds, group=LIMITS)
    max_connections: int = _opt(512, "open connections at most; more get 503 with Retry-After (default 512)",
                                type=int_at_least(1), group=LIMITS)
    max_inflight_bytes: Optional[int] = _opt(None, "request-body bytes all requests in flight may hold together; "
                                                   "more get 503 with Retry-After (default: 16 x --max-request-bytes, "
                                                   "at least 64 MiB)", type=int_at_least(1024), group=LIMITS)
    max_stop_strings: int = _opt(4, f"stop strings a request may send (default 4, OpenAI's limit; at most "
                                    f"{MAX_STOP_STRINGS})", type=int_at_least(1), group=LIMITS)

    def __post_init__(self):
        if not isinstance(self.model_name, str) or not self.model_name.strip():
            raise ValueError("model_name (--served-model-name) is empty; give the name clients will send")
        if not 1 <= self.max_stop_strings <= MAX_STOP_STRINGS:
            raise ValueError(f"max_stop_strings (--max-stop-strings) {self.max_stop_strings}: give 1.."
                             f"{MAX_STOP_STRINGS} (the engine's limit)")
        object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))

    @classmethod
    def from_args(cls, args: argparse.Namespace, **given: Any) -> "ServeConfig":
        """The fields with flags from parsed ``args`` (:func:`add_serve_args`), the others from ``given``."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if f.metadata["flag"]}
        return cls(**values, **given)


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """One flag per :class:`ServeConfig` field that has one (``--max-batch-size``, ``--api-key``, ...)."""
    groups = {}
    for f in fields(ServeConfig):
        meta = f.metadata
        if not meta["flag"]:
            continue
        where = parser if meta["group"] is None else groups.setdefault(meta["group"],
                                                                      parser.add_argument_group(meta["group"]))
        default = f.default if f.default_factory is MISSING else f.default_factory()
        kw = dict(help=meta["help"], default=default, **meta["argparse"])
        if isinstance(default, bool):
            kw["action"] = "store_true"
        elif meta["type"] is not None:
            kw["type"] = meta["type"]
        where.add_argument("--" + f.name.replace("_", "-"), **kw)
    return parser

