"""Start ``torch.distributed`` the way the ``deepspeed`` launcher and ``torchrun`` expect.

Both launchers export ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (the
``deepspeed`` launcher also passes ``--local_rank=N``; :func:`add_launcher_args` accepts it). On many nodes
the same code runs unchanged: the hostfile only changes those variables. A launched rank exits when its
launcher dies (``magnetar.parallel.lifetime``). The backend is NCCL when CUDA is present and gloo otherwise
(CPU ranks, as in our tests).
"""
from __future__ import annotations

import argparse
import logging
import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from magnetar.parallel.groups import DEFAULT_TIMEOUT
from magnetar.parallel.lifetime import watch_launcher

log = logging.getLogger(__name__)


def add_launcher_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--local_rank`` / ``--local-rank`` (passed by the deepspeed launcher and old torch.distributed.launch)."""
    parser.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                        help="set by the launcher; do not pass by hand")
    return parser


def launched() -> bool:
    """True when a multi-process launcher (deepspeed, torchrun, mpirun with env) started this process."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def import_deepspeed():
    """Import deepspeed with its CPU shm comm op disabled (its first JIT build takes ~65 s and gloo suffices)."""
    import deepspeed

    if not torch.cuda.is_available() or os.environ.get("MAGNETAR_DISABLE_DS_SHM") == "1":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def init_distributed(
    backend: Optional[str] = None, *, timeout: timedelta = DEFAULT_TIMEOUT, use_deepspeed: bool = True
) -> bool:
    """Initialise the default process group from the launcher's environment; returns True if initialised.

    Without launcher variables this is a no-op returning False (the world-size-1 path of
    :func:`magnetar.parallel.init_groups`). ``use_deepspeed`` routes through ``deepspeed.init_distributed`` so
    ``deepspeed.comm`` is set up for ``deepspeed.init_inference``; on CPU its shm comm op (a ~65 s JIT build)
    is disabled first. The process is also made to exit when its launcher dies
    (:func:`magnetar.parallel.lifetime.watch_launcher`; ``MAGNETAR_PARENT_WATCHDOG=0`` turns that off).
    """
    if dist.is_initialized():
        return True
    if not launched():
        return False
    watch_launcher()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA; use backend='gloo' on CPU ranks")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if use_deepspeed:
        deepspeed = import_deepspeed()
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout, auto_mpi_discovery=False, verbose=False)
    else:
        dist.init_process_group(backend=backend, timeout=timeout)
    if backend == "gloo" and "OMP_NUM_THREADS" not in os.environ:
        # CPU ranks on one host share its cores: without this every rank starts cpu_count threads.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
    log.info("rank %d/%d (local %d) on %s", dist.get_rank(), dist.get_world_size(), local_rank, backend)
    return True


def device_for_rank() -> torch.device:
    """The device this rank computes on: its local GPU under NCCL, else CPU."""
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cuda", 0) if torch.cuda.is_available() and not dist.is_initialized() else torch.device("cpu")
