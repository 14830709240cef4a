"""Serve a model over an OpenAI-compatible HTTP API (docs/serving.md).

    magnetar serve --model smollm2-135m-instruct --method dense --port 8000            # one process
    torchrun --nproc-per-node 4 -m magnetar.serve --model M --method pulsar --cp-size 4 --port 8000
    deepspeed --num_gpus 4 --module magnetar.serve --model M --method star --port 8000
    python -m magnetar.serve ...                                                          # = magnetar serve

Every rank loads the model and runs the engine loop; the first rank of each replica (cp_rank 0, tp_rank 0)
also serves HTTP on ``--host``, port ``--port + dp_rank`` (with several data-parallel replicas, put a load
balancer in front). Every engine field has a flag, as in ``magnetar-run`` (``--method``, ``--cp-size``,
``--tp-size``, ``--block-size``, ``--temperature``, ``--context-cache-mb``, ``--timeout-s``, ``--config FILE``,
...). SIGTERM (or Ctrl-C) drains: new requests get 503, those in flight are answered, then every rank exits 0.
A rank that fails ends every request in flight with a 500 and every rank exits non-zero within the collective
timeout (``--timeout-s``). A bad flag ends every rank with ``magnetar serve: error: ...`` and status 2.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import sys
from pathlib import Path
from typing import Optional

from magnetar.config import add_cli_args
from magnetar.engine.inputs import MAX_STOP_STRINGS
from magnetar.cli.args import check_engine_args
from magnetar.models import ModelNotInstalledError
from magnetar.parallel.launcher import add_launcher_args, finish_distributed, launched_world_size
from magnetar.serve.gate import check_api_key, check_body_budget, is_loopback
from magnetar.serve.loop import PREFILL_CHUNK
from magnetar.serve.split import PASTE_TOKENS
from magnetar.utils.cli import ArgumentParser, fail, int_at_least, user_errors

PROG = "magnetar serve"
API_KEY_ENV = "MAGNETAR_API_KEY"
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port (an int in 1..65535), got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 1..65535, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0.001 <= value <= 86400:
        raise argparse.ArgumentTypeError(f"must be between 0.001 and 86400 seconds, got {text!r}")
    return value


def _host_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip().lower() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated host names, got {text!r}")
    return names


def _origin_list(text: str) -> tuple[str, ...]:
    origins = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    if not origins:
        raise argparse.ArgumentTypeError(f"expected comma-separated origins (https://app.example.com) or '*', got "
                                         f"{text!r}")
    for o in origins:
        if o != "*" and not re.fullmatch(r"https?://[^/\s]+", o):
            raise argparse.ArgumentTypeError(f"{o!r} is not an origin: give scheme://host[:port] (no path), or '*'")
    return origins


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a magnetar.models name, a local HF directory or a Hub id org/name")
    p.add_argument("--revision", help="--model's Hub revision: a branch, tag or commit hash (default main)")
    p.add_argument("--trust-remote-code", action="store_true", help="let --model run its own modelling code")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: every one)")
    p.add_argument("--port", type=_port, default=8000, help="port of the first replica; replica d listens on port + d")
    p.add_argument("--served-model-name",
                   help="the model name clients send (default: --model, or a local folder's own name)")
    p.add_argument("--max-batch-size", type=int_at_least(1), default=16, help="requests decoding together")
    p.add_argument("--max-tokens", type=int_at_least(1), default=256,
                   help="max_tokens of a request that gives none (capped to the positions left)")
    p.add_argument("--max-contexts", type=int_at_least(0), default=16,
                   help="contexts pinned by POST /v1/contexts at most")
    p.add_argument("--paste-threshold", type=int_at_least(0), default=PASTE_TOKENS,
                   help=f"a chat's last user message of at least this many tokens holds a document: its text before "
                        f"the question is encoded as context (Phase 1, cached); 0: never (default {PASTE_TOKENS})")
    p.add_argument("--prefill-chunk", type=int_at_least(0), default=PREFILL_CHUNK,
                   help=f"a new context of more tokens runs its Phase 1 in chunks of this many, one between two decode "
                        f"steps, so decoding requests are not held for a whole Phase 1 (dense or ring on one CP "
                        f"rank; 0: whole; default {PREFILL_CHUNK})")
    p.add_argument("--threads", type=int_at_least(1), default=None,
                   help="intra-op CPU threads per rank (default: OMP_NUM_THREADS if set, else from this process's "
                        "CPU affinity shared by the local ranks: all for Phase 1, one fewer for decode steps)")
    p.add_argument("--log-level", choices=_LOG_LEVELS, default="warning")
    g = p.add_argument_group("what clients may send (docs/serving.md, \"Limits and access\")")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* and /metrics (default: ${API_KEY_ENV}; "
                        "prefer the variable: a flag is visible in the process list)")
    g.add_argument("--public-metrics", action="store_true", help="serve /metrics without the API key")
    g.add_argument("--allowed-hosts", type=_host_list, default=(),
                   help="comma-separated Host names accepted besides localhost/127.0.0.1/::1 (DNS-rebinding "
                        "guard; checked when --host is loopback, or always once this is given)")
    g.add_argument("--allowed-origins", type=_origin_list, default=(),
                   help="comma-separated browser origins allowed to call the API (CORS), or '*'; default none")
    g.add_argument("--max-request-bytes", type=int_at_least(1024), default=None,
                   help="largest request body, else 413 (default: 64 bytes per model position, at least 1 MiB)")
    g.add_argument("--request-timeout-s", type=_positive_seconds, default=60.0,
                   help="a request's head, and then its body, must arrive within this (default 60)")
    g.add_argument("--max-connections", type=int_at_least(1), default=512,
                   help="open connections at most; more get 503 with Retry-After (default 512)")
    g.add_argument("--max-inflight-bytes", type=int_at_least(1024), default=None,
                   help="request-body bytes all requests in flight may hold together; more get 503 with Retry-After "
                        "(default: 16 x --max-request-bytes, at least 64 MiB)")
    g.add_argument("--max-stop-strings", type=int_at_least(1), default=4,
                   help=f"stop strings a request may send (default 4, OpenAI's limit; at most {MAX_STOP_STRINGS})")
    add_cli_args(p)
    add_launcher_args(p)
    return p


def check_inputs(args):
    """Every check that needs no model (the config, --model, files, ports); ValueError names the flag."""
    config = check_engine_args(args)
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name is empty; give the name clients will send (or leave it out)")
    if args.max_stop_strings > MAX_STOP_STRINGS:
        raise ValueError(f"--max-stop-strings {args.max_stop_strings}: at most {MAX_STOP_STRINGS} (the engine's limit)")
    if args.max_inflight_bytes is not None and args.max_request_bytes is not None:  # before the model loads
        check_body_budget(args.max_inflight_bytes, args.max_request_bytes)
    if args.api_key is None:
        args.api_key = check_api_key(os.environ.get(API_KEY_ENV) or None, API_KEY_ENV)
    else:
        args.api_key = check_api_key(args.api_key, "--api-key")
    if not config.parallel.simulate:
        replicas = max(1, launched_world_size() // (config.parallel.cp_size * config.parallel.tp_size))
        if args.port + replicas - 1 > 65535:
            raise ValueError(f"--port {args.port}: the {replicas} replicas listen on ports {args.port}.."
                             f"{args.port + replicas - 1}, past 65535; choose a lower --port")
    return config


def served_name(model: str) -> str:
    """``--served-model-name``'s default: a local model folder's own name (its path would tell every client where
    the server keeps its files), else ``--model`` as given (a registry name or a Hub id)."""
    path = Path(model).expanduser()
    return (path.resolve().name or model) if path.is_dir() else model


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening; uvicorn listens on it). OSError when it cannot be."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def bind_first(args, config) -> Optional[socket.socket]:
    """The HTTP socket of this rank's replica, bound before the model loads, on the replica's first rank (None on
    the others): a port in use is found in seconds, not after minutes of loading. Under a launcher the process
    group is started here and every rank learns whether any replica's port failed (one small gather), so every
    rank ends with the same ValueError naming ``--port``."""
    from datetime import timedelta

    import torch.distributed as dist

    from magnetar.parallel.collectives import all_gather_ints
    from magnetar.parallel.launcher import device_for_rank, init_distributed

    timeout = timedelta(seconds=config.parallel.timeout_s)
    distributed = not config.parallel.simulate and init_distributed(timeout=timeout)
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    per_replica = config.parallel.cp_size * config.parallel.tp_size if distributed else 1
    sock, error = None, None
    if rank % per_replica == 0:
        port = args.port + rank // per_replica
        try:
            sock = bind_socket(args.host, port)
        except OSError as e:
            error = (f"--port {port}: cannot listen on {args.host}:{port} ({e.strerror or e}: in use, or not an "
                     f"address of this host); choose another --port or --host")
    if world > 1:
        failed = all_gather_ints([int(error is not None)], dist.group.WORLD, device_for_rank(),
                                 timeout=timeout)[:, 0].tolist()
        if error is None and any(failed):
            bad = [r for r, f in enumerate(failed) if f]
            error = (f"--port: the replica port of rank(s) {bad} cannot be bound (their message says why); choose "
                     f"another --port")
    if error is not None:
        if sock is not None:
            sock.close()
        raise ValueError(error)
    return sock


def choose_threads(threads: Optional[int]) -> tuple[Optional[int], Optional[int], str]:
    """(decode threads this rank sets, Phase-1 threads -- None: leave torch's --, why): ``--threads`` for both;
    else ``OMP_NUM_THREADS`` (torch already read it); else, on CPU ranks, the usable CPUs
    (:func:`~magnetar.parallel.launcher.cpu_threads`) shared by the local ranks: all of them for Phase 1 and the
    query forwards (compute-bound: more threads pay), one fewer for the decode steps (small ops that wait for every
    thread: one CPU left for the HTTP server and the tokenizers, so a busy host does not deschedule one)."""
    from magnetar.parallel.launcher import cpu_threads, device_for_rank, usable_cpus

    if threads is not None:
        return threads, threads, "--threads"
    if os.environ.get("OMP_NUM_THREADS"):
        return None, None, f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    if device_for_rank().type != "cpu":
        return None, None, "torch's default (not a CPU rank)"
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    return cpu_threads(local, reserve=1), cpu_threads(local), (
        f"{usable_cpus()} usable CPUs over {local} local rank(s): Phase 1 all, decode one left for HTTP; --threads "
        f"to change")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        fail(PROG, f"the server needs the serve extra ({e.name} is not installed): pip install 'magnetar[serve]'")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    with user_errors(PROG):
        config = check_inputs(args)
        sock = bind_first(args, config)  # before the model loads (minutes for a large one)
    import torch

    threads, prefill_threads, why = choose_threads(args.threads)
    if threads is not None:
        torch.set_num_threads(threads)
    logging.getLogger(PROG).warning("%d intra-op threads per rank, %d in Phase 1 (%s)", torch.get_num_threads(),
                                    prefill_threads or torch.get_num_threads(), why)
    import magnetar
    from magnetar.serve.server import Server

    with user_errors(PROG, extra=(ModelNotInstalledError,)):
        engine = magnetar.init_inference(args.model, config, revision=args.revision,
                                         trust_remote_code=args.trust_remote_code)
    if args.api_key is None and not is_loopback(args.host):
        logging.getLogger(PROG).warning("serving on %s without an API key: anyone who reaches the port can use the "
                                        "model; set %s (or --api-key)", args.host, API_KEY_ENV)
    server = Server(engine, model_name=args.served_model_name or served_name(args.model), host=args.host,
                    port=args.port,
                    max_batch_size=args.max_batch_size, max_tokens=args.max_tokens, max_contexts=args.max_contexts,
                    log_level=args.log_level, max_request_bytes=args.max_request_bytes,
                    request_timeout_s=args.request_timeout_s, max_connections=args.max_connections,
                    max_inflight_bytes=args.max_inflight_bytes,
                    max_stop_strings=args.max_stop_strings, api_key=args.api_key, public_metrics=args.public_metrics,
                    allowed_hosts=args.allowed_hosts, allowed_origins=args.allowed_origins,
                    paste_threshold=args.paste_threshold, prefill_threads=prefill_threads,
                    prefill_chunk=args.prefill_chunk, sock=sock)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.drain())
    status = server.run()
    if status:
        # a failed peer: leave at once, without tearing down process groups whose peers are gone
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    finish_distributed(timeout=engine.groups.timeout)
    # the rank's own status (a launcher that was signalled itself exits non-zero whatever its ranks return:
    # docs/serving.md, "Stopping and exit statuses")
    logging.getLogger(PROG).warning("rank %d drained: exit status 0", engine.groups.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
