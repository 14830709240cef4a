"""Run a test body on W CPU processes over gloo (loopback, free port), as ordinary pytest tests do.

``run_distributed(fn, world_size, *args)`` spawns W processes; each initialises the default group with a
short timeout and calls ``fn(rank, world_size, *args)``. An exception in any rank fails the test with that
rank's traceback; a rank that hangs is killed by the timeout instead of stalling the suite.
``wait_serving(url, proc, timeout_s, log)`` waits for a server started as a subprocess (``magnetar serve``).
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# A hang still fails; two xdist workers running multi-rank tests on 2 cores are slow, not hung.
TEST_TIMEOUT = timedelta(seconds=120)


def wait_serving(url: str, proc: subprocess.Popen, timeout_s: float, log: Callable[[], str]) -> None:
    """Return once ``GET url/health`` answers 200; fail the test, with the exit status and ``log()``, when
    ``proc`` exits or ``timeout_s`` passes first."""
    import httpx
    import pytest

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the server did not start (exit {proc.poll()}):\n{log()}")


@contextlib.contextmanager
def serve_in_thread(server, start_s: float = 60):
    """Run ``server`` (a :class:`magnetar.serve.server.Server` of one rank) in a thread of this process until the
    block ends, then drain it: it must stop with status 0."""
    status = []
    thread = threading.Thread(target=lambda: status.append(server.run()), daemon=True)
    thread.start()
    assert server.started.wait(start_s) and server.loop.start_error is None
    try:
        yield server
    finally:
        server.drain()
        thread.join(60)
        assert not thread.is_alive() and status == [0], "the drained server did not stop with status 0"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> tuple[int, int]:
    """``(first, other)``: ``n`` consecutive ports from ``first`` free now (data-parallel replicas listen on
    ``--port + d``), and one more free port outside them (a front port). Two ``free_port()`` calls could return
    P and P + 1 -- the kernel hands out neighbouring ports -- and replica 1 then found its port taken."""
    for _ in range(100):
        first = free_port()
        if first + n - 1 > 65535:
            continue
        try:
            with contextlib.ExitStack() as held:
                for p in range(first + 1, first + n):
                    sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    sock.bind(("127.0.0.1", p))
                other = free_port()
        except OSError:
            continue
        if not first <= other < first + n:
            return first, other
    raise RuntimeError(f"no {n} consecutive free ports on 127.0.0.1 after 100 tries")


def _entry(rank: int, world_size: int, port: int, fn, args, environ=None):
    if environ is not None:  # the caller's environment now (the fork server holds the one it started with)
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # W ranks share 2 cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=TEST_TIMEOUT)
    try:
        fn(rank, world_size, *args)
        # no rank tears its process group down while a peer still uses it (gloo's worker threads then abort the
        # peer at exit with "terminate called without an active exception")
        dist.monitored_barrier(timeout=TEST_TIMEOUT)
    finally:
        dist.destroy_process_group()


# The ranks start from a fork server that imported torch, transformers' model code and magnetar once for the whole
# session (a spawned rank imported them anew: seconds per rank, every multi-rank test). Only imports happen there --
# no tensor op, so no OpenMP pool exists to be forked; each rank then sets its own threads.
_PRELOAD = ["torch", "torch.distributed", "transformers", "magnetar", "magnetar.engine", "tests.dist_utils",
            # transformers is a lazy module: its model code (modeling_utils pulls scipy.optimize, DTensor, dynamo)
            # came in only when a rank built a model -- ~4 s a rank, every multi-rank test
            "transformers.modeling_utils", "transformers.models.llama.modeling_llama"]


def run_distributed(fn, world_size: int, *args) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; re-raise the first failure."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(_PRELOAD)
    mp.start_processes(_entry, args=(world_size, free_port(), fn, args, dict(os.environ)), nprocs=world_size, join=True,
                       start_method="forkserver")
