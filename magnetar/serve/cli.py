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
import signal
import socket
import sys
from pathlib import Path
from typing import Optional

from magnetar.config import add_cli_args
from magnetar.config.checks import MAX_STOP_STRINGS
from magnetar.cli.args import add_model_args, check_engine_args, load_tokenizer_arg
from magnetar.serve.gate import check_api_key, check_body_budget, is_loopback
from magnetar.serve.config import ServeConfig, add_serve_args
from magnetar.utils.cli import ArgumentParser, add_launcher_args, fail, int_at_least, user_errors

PROG = "magnetar serve"
API_KEY_ENV = "MAGNETAR_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--served-model-name",
                   help="the model name clients send (default: --model, or a local folder's own name)")
    p.add_argument("--threads", type=int_at_least(1), default=None,
                   help="intra-op CPU threads per rank (default: OMP_NUM_THREADS if set, else from this process's "
                        "CPU affinity shared by the local ranks: all for Phase 1, one fewer for decode steps)")
    add_serve_args(p)
    add_cli_args(p)
    add_launcher_args(p)
    return p


def check_inputs(args) -> tuple:
    """Every check that needs no model (the engine's config, --model, files, ports, the server's config):
    ``(EngineConfig, ServeConfig)``; ValueError names the flag."""
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
        from magnetar.parallel.launcher import launched_world_size

        replicas = max(1, launched_world_size() // (config.parallel.cp_size * config.parallel.tp_size))
        if args.port + replicas - 1 > 65535:
            raise ValueError(f"--port {args.port}: the {replicas} replicas listen on ports {args.port}.."
                             f"{args.port + replicas - 1}, past 65535; choose a lower --port")
    return config, ServeConfig.from_args(args, model_name=args.served_model_name or served_name(args.model))


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


def advertised_host(host: str) -> str:
    """The address the front reaches a replica bound to ``host`` at: the host itself, or for a wildcard (``0.0.0.0``,
    ``::``) this machine's name's address."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def bind_first(args, config) -> tuple[Optional[socket.socket], Optional[socket.socket], list[str]]:
    """The HTTP socket of this rank's replica, bound before the model loads, on the replica's first rank (None on
    the others): a port in use is found in seconds, not after minutes of loading. With ``--front-port`` the job's
    first rank binds the front's socket too, and learns every replica's address (``[front socket, replica URLs]``;
    None and [] elsewhere). Under a launcher the process group is started here and every rank learns whether any
    port failed (one small gather), so every rank ends with the same ValueError naming ``--port`` or
    ``--front-port``."""
    from datetime import timedelta

    import torch.distributed as dist

    from magnetar.parallel.collectives import all_gather_ints, all_gather_objects
    from magnetar.parallel.launcher import device_for_rank, init_distributed

    timeout = timedelta(seconds=config.parallel.timeout_s)
    distributed = not config.parallel.simulate and init_distributed(timeout=timeout)
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    per_replica = config.parallel.cp_size * config.parallel.tp_size if distributed else 1
    sock, front, error = None, None, None
    if rank % per_replica == 0:
        port = args.port + rank // per_replica
        try:
            sock = bind_socket(args.host, port)
        except OSError as e:
            error = (f"--port {port}: cannot listen on {args.host}:{port} ({e.strerror or e}: in use, or not an "
                     f"address of this host); choose another --port")
    if rank == 0 and args.front_port is not None and error is None:
        try:
            front = bind_socket(args.host, args.front_port)
        except OSError as e:
            error = (f"--front-port {args.front_port}: cannot listen on {args.host}:{args.front_port} "
                     f"({e.strerror or e}); choose another --front-port")
    if world > 1:
        failed = all_gather_ints([int(error is not None)], dist.group.WORLD, device_for_rank(),
                                 timeout=timeout)[:, 0].tolist()
        if error is None and any(failed):
            bad = [r for r, f in enumerate(failed) if f]
            error = (f"--port / --front-port: a port of rank(s) {bad} cannot be bound (their message says why); "
                     f"choose another")
    if error is not None:
        for s in (sock, front):
            if s is not None:
                s.close()
        raise ValueError(error)
    urls: list[str] = []
    if args.front_port is not None:  # every replica's address, by data-parallel rank
        mine = f"http://{advertised_host(args.host)}:{args.port + rank // per_replica}"
        every = all_gather_objects(mine, dist.group.WORLD, device_for_rank(), timeout=timeout) if world > 1 \
            else [mine]
        urls = every[::per_replica] if rank == 0 else []
    return sock, front, urls


def choose_threads(threads: Optional[int]) -> tuple[Optional[int], Optional[int], str]:
    """(decode threads this rank sets, Phase-1 threads -- None: leave torch's --, why): ``--threads`` for both;
    else ``OMP_NUM_THREADS`` (torch already read it); else, on CPU ranks, the usable CPUs
    (:func:`~magnetar.parallel.launcher.cpu_threads`) shared by the local ranks: all of them for Phase 1 and the
    query forwards (compute-bound: more threads pay), one fewer for the decode steps (small ops that wait for every
    thread: one CPU left for the HTTP server and the tokenizers, so a busy host does not deschedule one) -- the
    count a rank alone on its host starts from, and keeps while other processes keep a CPU busy
    (:func:`follow_load`)."""
    from magnetar.parallel.launcher import cpu_threads, device_for_rank, usable_cpus

    if threads is not None:
        return threads, threads, "--threads"
    if os.environ.get("OMP_NUM_THREADS"):
        return None, None, f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    if device_for_rank().type != "cpu":
        return None, None, "torch's default (not a CPU rank)"
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    return cpu_threads(local, reserve=1), cpu_threads(local), (
        f"{usable_cpus()} usable CPUs over {local} local rank(s): Phase 1 all, decode one left for HTTP" +
        (" while the host is busy" if local == 1 and usable_cpus() > 1 else "") + "; --threads to change")


def follow_load(threads: Optional[int]):
    """The decode steps' count that follows the host's load (:class:`~magnetar.serve.threads.DecodeThreads`: every
    usable CPU while the other processes leave them idle, one fewer while they keep one busy), or None where
    :func:`choose_threads`' count stays (``--threads`` or ``OMP_NUM_THREADS`` given, a GPU rank, several local ranks,
    one CPU, no ``/proc/stat``)."""
    from magnetar.parallel.launcher import device_for_rank
    from magnetar.serve.threads import decode_threads

    return decode_threads(threads, int(os.environ.get("LOCAL_WORLD_SIZE") or 1), device_for_rank().type == "cpu")


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
        config, serve_config = check_inputs(args)
        sock, front, urls = bind_first(args, config)  # before the model loads (minutes for a large one)
    import torch

    threads, prefill_threads, why = choose_threads(args.threads)
    if threads is not None:
        torch.set_num_threads(threads)
    adaptive = follow_load(args.threads)
    if adaptive is None:
        logging.getLogger(PROG).warning("%d intra-op threads per rank, %d in Phase 1 (%s)", torch.get_num_threads(),
                                        prefill_threads or torch.get_num_threads(), why)
    else:
        logging.getLogger(PROG).warning(
            "%d intra-op threads per rank in decode steps while the host's other processes leave its CPUs idle, %d "
            "while they keep one busy; %d in Phase 1 (%s)", adaptive.high, adaptive.low,
            prefill_threads or torch.get_num_threads(), why)
    import magnetar
    from magnetar.models import ModelNotInstalledError
    from magnetar.parallel.launcher import device_for_rank, finish_distributed
    from magnetar.serve.server import Server
    from magnetar.utils.malloc import keep_freed_memory

    if device_for_rank().type == "cpu":  # tensors of every size, freed and made again: no page faults each time
        malloc = keep_freed_memory()
        if malloc is not None:
            logging.getLogger(PROG).info("%s", malloc)

    with user_errors(PROG, extra=(ModelNotInstalledError,)):
        engine = magnetar.init_inference(args.model, config, tokenizer=load_tokenizer_arg(args),
                                         revision=args.revision, trust_remote_code=args.trust_remote_code)
    if args.api_key is None and not is_loopback(args.host):
        logging.getLogger(PROG).warning("serving on %s without an API key: anyone who reaches the port can use the "
                                        "model; set %s (or --api-key)", args.host, API_KEY_ENV)
    server = Server(engine, serve_config, sock=sock, prefill_threads=prefill_threads, front=front, replica_urls=urls,
                    decode_threads=adaptive)
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
