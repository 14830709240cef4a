"""Start ``torch.distributed`` under every launcher DeepSpeed users have.

Where a rank learns its place (:func:`discover_launch`; the first launcher whose rank and size variables are
both set wins, in this order):

* ``env`` -- ``torchrun``, ``deepspeed`` (local, or ``--hostfile`` with pdsh) and ``deepspeed --launcher
  mpich|impi`` (DeepSpeed's ``launcher_helper`` maps ``PMI_RANK`` to ``RANK``): ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK`` (0 if absent, as before), ``LOCAL_WORLD_SIZE`` (torchrun) or ``LOCAL_SIZE`` (deepspeed); these
  launchers export ``MASTER_ADDR``/``MASTER_PORT`` too.
* ``openmpi`` -- Open MPI's ``mpirun``, ``deepspeed --launcher openmpi``: ``OMPI_COMM_WORLD_RANK``, ``_SIZE``,
  ``_LOCAL_RANK``, ``_LOCAL_SIZE``.
* ``mvapich`` -- MVAPICH2's ``mpirun``, ``deepspeed --launcher mvapich``: ``MV2_COMM_WORLD_RANK``, ``_SIZE``,
  ``_LOCAL_RANK``, ``_LOCAL_SIZE``.
* ``mpich`` -- MPICH / Intel MPI ``mpiexec`` (hydra): ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID`` (or
  Cray PALS's ``PALS_LOCAL_RANKID``), ``MPI_LOCALNRANKS`` (all three needed: ``srun --mpi=pmi2`` sets
  ``PMI_RANK`` and ``PMI_SIZE`` only, and is taken as srun).
* ``slurm`` -- ``srun``, ``deepspeed --launcher slurm``: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``,
  ``SLURM_LOCALID``, and ``SLURM_STEP_TASKS_PER_NODE`` at ``SLURM_NODEID`` for the local size. srun sets the
  ``SLURM_STEP_*`` variables for its tasks only, so a batch script's own process is no rank.

The rendezvous address (``MASTER_ADDR``, ``MASTER_PORT``), first rule that applies:

1. ``MASTER_ADDR`` from the environment (``MASTER_PORT`` from it too, else 29500, DeepSpeed's
   ``TORCH_DISTRIBUTED_DEFAULT_PORT``; set it when two jobs share a host);
2. every rank on one host (local size == world size): ``127.0.0.1``;
3. ``srun``: the first host of ``SLURM_STEP_NODELIST`` (``scontrol show hostnames``), where task 0 runs under
   srun's block and cyclic distributions;
4. the MPI launchers: DeepSpeed's own discovery, ``deepspeed.comm.comm.mpi_discovery`` (mpi4py, the ``[mpi]``
   extra): rank 0's ``hostname -I`` broadcast to all ranks;
5. otherwise a ValueError naming ``MASTER_ADDR`` and how to set it.

:func:`init_distributed` exports what it found as ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` (as DeepSpeed's ``mpi_discovery`` does), so ``deepspeed.comm`` and torch's
``env://`` rendezvous see one convention, then calls ``deepspeed.init_distributed`` with its own MPI discovery
off (done here, for every launcher above). The backend is DeepSpeed's accelerator's
``communication_backend_name()``: NCCL on CUDA, on CPU ``ccl`` when oneCCL's torch bindings import and gloo
otherwise (``backend=`` overrides it). A launched rank exits when its launcher dies
(``magnetar.parallel.lifetime``).
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from magnetar.parallel.collectives import barrier
from magnetar.parallel.groups import DEFAULT_TIMEOUT
from magnetar.parallel import shm
from magnetar.parallel.lifetime import watch_launcher
from magnetar.utils.cli import add_launcher_args  # noqa: F401 -- the commands' import of it, as before

log = logging.getLogger(__name__)

DEFAULT_PORT = 29500  # deepspeed.constants.TORCH_DISTRIBUTED_DEFAULT_PORT, torchrun's default too
SCONTROL_TIMEOUT_S = 30


@dataclass(frozen=True)
class LaunchInfo:
    """This process's place in a launched job, read from the launcher's environment (module docstring).

    ``launcher`` names the row that matched (``"env"``, ``"openmpi"``, ``"mvapich"``, ``"mpich"``, ``"slurm"``);
    ``local_world_size`` is None when the launcher does not say; ``master_addr`` is None when the environment does
    not give it and the ranks span several hosts (:func:`init_distributed` then asks scontrol or mpi4py).
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: Optional[int]
    master_addr: Optional[str]
    master_port: int


# The launchers of the module docstring, in order: launcher -> (who sets the variables, rank, world size,
# local-rank candidates, local-size candidates). A launcher applies when its rank and world-size variables are
# set; MPI launchers come before srun because mpirun / mpiexec start their ranks inside Slurm jobs through srun
# (the ranks inherit that step's SLURM_PROCID). "mpich" also needs its local rank: srun --mpi=pmi2 sets
# PMI_RANK / PMI_SIZE (equal to srun's) but no MPI_LOCALRANKID, and is srun's.
_ROWS = {
    "env": ("the launcher", "RANK", "WORLD_SIZE", ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")),
    "openmpi": ("Open MPI's mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",),
                ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    "mvapich": ("MVAPICH's mpirun", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", ("MV2_COMM_WORLD_LOCAL_RANK",),
                ("MV2_COMM_WORLD_LOCAL_SIZE",)),
    "mpich": ("the MPI launcher", "PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "PALS_LOCAL_RANKID"),
              ("MPI_LOCALNRANKS",)),
    "slurm": ("srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", ("SLURM_LOCALID",), ()),
}
MPI_LAUNCHERS = ("openmpi", "mvapich", "mpich")


def _int(env: Mapping[str, str], name: str, who: str, low: int = 0) -> int:
    """``env[name]`` as an int >= ``low``; ValueError naming the variable and ``who`` sets it."""
    text = env[name]
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise ValueError(f"the environment's {name}={text!r} is not an int >= {low} ({who} sets it; unset it to run "
                         "one process)")
    return value


def _slurm_tasks_on_node(env: Mapping[str, str]) -> Optional[int]:
    """Tasks of this srun step on this node: ``SLURM_STEP_TASKS_PER_NODE`` (e.g. ``"2(x3),1"``: 2 tasks on each
    of the first 3 nodes, 1 on the fourth) at index ``SLURM_NODEID``; None when either is missing."""
    spec, node = env.get("SLURM_STEP_TASKS_PER_NODE"), env.get("SLURM_NODEID")
    if spec is None or node is None:
        return None
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise ValueError(f"the environment's SLURM_STEP_TASKS_PER_NODE={spec!r} is not srun's list of N or N(xK) "
                             "(srun sets it; unset it to run one process)")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    index = _int(env, "SLURM_NODEID", "srun")
    if index >= len(counts):
        raise ValueError(f"the environment's SLURM_NODEID={index} is beyond the {len(counts)} nodes of "
                         f"SLURM_STEP_TASKS_PER_NODE={spec!r} (srun sets both)")
    return counts[index]


def discover_launch(environ: Optional[Mapping[str, str]] = None) -> Optional[LaunchInfo]:
    """This process's rank, world size, local rank and size, and ``MASTER_ADDR``/``MASTER_PORT`` where the
    environment gives them (the rules of the module docstring), or None when no launcher started it.

    Pure: reads ``environ`` (default ``os.environ``) and runs nothing. ValueError naming the variable when a
    value is no int, a rank is not below its size, or an MPI launcher or srun gives no local rank.
    """
    env = os.environ if environ is None else environ
    launcher = next((name for name, row in _ROWS.items() if row[1] in env and row[2] in env
                     and (name != "mpich" or any(n in env for n in row[3]))), None)
    if launcher is None:
        return None
    who, rank_name, world_name, local_names, size_names = _ROWS[launcher]
    world = _int(env, world_name, who, low=1)
    rank = _int(env, rank_name, who)
    if rank >= world:
        raise ValueError(f"the environment's {rank_name}={rank} is not below {world_name}={world} ({who} sets both)")
    local_name = next((n for n in local_names if n in env), None)
    if local_name is None and launcher != "env":  # torchrun-style launchers always set it; 0 as before otherwise
        raise ValueError(f"{rank_name} and {world_name} are set but not {' or '.join(local_names)}: have "
                         f"{who} export the rank's index on its host (or export LOCAL_RANK, RANK and WORLD_SIZE)")
    local_rank = _int(env, local_name, who) if local_name else 0
    size_name = next((n for n in size_names if n in env), None)
    if size_name is not None:
        local_size: Optional[int] = _int(env, size_name, who, low=1)
    else:
        local_size = _slurm_tasks_on_node(env) if launcher == "slurm" else None
    if local_size is not None and not local_rank < local_size <= world:
        raise ValueError(f"the environment's local rank {local_rank} ({local_name}) and local size {local_size} "
                         f"({size_name or 'SLURM_STEP_TASKS_PER_NODE'}) do not fit {world_name}={world}: want "
                         f"local rank < local size <= world size")
    port = _int(env, "MASTER_PORT", "the user or launcher", low=1) if "MASTER_PORT" in env else DEFAULT_PORT
    addr = env.get("MASTER_ADDR") or ("127.0.0.1" if world == 1 or local_size == world else None)
    return LaunchInfo(launcher, rank, world, local_rank, local_size, addr, port)


def launched() -> bool:
    """True when a multi-process launcher (any row of the module docstring's table) started this process."""
    return discover_launch() is not None


def launched_world_size() -> int:
    """The number of processes the launcher started (1 without one); a lone ``WORLD_SIZE`` counts too, so a
    command line's ``--cp-size`` is checked against it before anything starts. ValueError naming the variable
    when it is no int >= 1."""
    info = discover_launch()
    if info is not None:
        return info.world_size
    return _int(os.environ, "WORLD_SIZE", "the launcher", low=1) if "WORLD_SIZE" in os.environ else 1


def _no_master(info: LaunchInfo, why: str) -> ValueError:
    return ValueError(f"MASTER_ADDR is not set and the {info.world_size} ranks launched by {_ROWS[info.launcher][0]} "
                      f"may span several hosts ({why}): export MASTER_ADDR=<host of rank 0> (and MASTER_PORT, default "
                      f"{DEFAULT_PORT}) to every rank, e.g. mpirun -x MASTER_ADDR=node0, srun --export=ALL,"
                      f"MASTER_ADDR=node0, or a MASTER_ADDR=node0 line in .deepspeed_env for deepspeed --launcher")


def find_master_addr(info: LaunchInfo) -> str:
    """``MASTER_ADDR`` for a launch whose environment gives none (``info.master_addr`` None): rules 3 to 5 of
    the module docstring. Under an MPI launcher this is a collective: every rank of the job must call it."""
    if info.launcher == "slurm":
        nodes = os.environ.get("SLURM_STEP_NODELIST")
        if not nodes:
            raise _no_master(info, "srun set no SLURM_STEP_NODELIST")
        try:
            hosts = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True,
                                   check=True, timeout=SCONTROL_TIMEOUT_S).stdout.split()
        except (OSError, subprocess.SubprocessError) as e:
            raise _no_master(info, f"`scontrol show hostnames {nodes}` failed: {e}") from e
        if not hosts:
            raise _no_master(info, f"`scontrol show hostnames {nodes}` printed no host")
        return hosts[0]
    if info.launcher in MPI_LAUNCHERS:
        try:
            from mpi4py import MPI  # noqa: F401  (mpi_discovery imports it inside; a missing one is named here)
        except (ImportError, RuntimeError) as e:
            raise _no_master(info, f"mpi4py cannot be imported ({e}); pip install 'magnetar[mpi]' to have rank 0's "
                                   "address broadcast") from e
        from deepspeed.comm.comm import mpi_discovery

        mpi_discovery(distributed_port=info.master_port, verbose=False)  # a collective of every rank of the job
        return os.environ["MASTER_ADDR"]
    raise _no_master(info, "no LOCAL_WORLD_SIZE / LOCAL_SIZE equal to WORLD_SIZE says otherwise")


def import_deepspeed():
    """Import deepspeed with its CPU shm comm op disabled (its first JIT build takes ~65 s and gloo suffices)."""
    import deepspeed

    if not torch.cuda.is_available() or os.environ.get("MAGNETAR_DISABLE_DS_SHM") == "1":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def accelerator_backend() -> str:
    """The communication backend of DeepSpeed's accelerator: ``nccl`` on CUDA; on CPU ``ccl`` when
    ``oneccl_bindings_for_pytorch`` imports, else ``gloo`` (DeepSpeed's CPU accelerator decides at import)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().communication_backend_name() or "gloo"


def init_distributed(
    backend: Optional[str] = None, *, timeout: timedelta = DEFAULT_TIMEOUT, use_deepspeed: bool = True
) -> bool:
    """Initialise the default process group from the launcher's environment; returns True if initialised.

    Without launcher variables this is a no-op returning False (the world-size-1 path of
    :func:`magnetar.parallel.init_groups`). The rank, world, local rank and rendezvous come from
    :func:`discover_launch` (and scontrol or mpi4py for a multi-host job without ``MASTER_ADDR``) and are
    exported under torchrun's names. ``backend`` defaults to :func:`accelerator_backend`; under it the rank's
    accelerator device is its local rank's. ``use_deepspeed`` routes through ``deepspeed.init_distributed`` so
    ``deepspeed.comm`` is set up for ``deepspeed.init_inference``; on CPU its shm comm op (a ~65 s JIT build) is
    disabled first. The process is also made to exit when its launcher dies
    (:func:`magnetar.parallel.lifetime.watch_launcher`; ``MAGNETAR_PARENT_WATCHDOG=0`` turns that off).
    """
    if dist.is_initialized():
        return True
    info = discover_launch()
    if info is None:
        return False
    watch_launcher()
    addr = info.master_addr or find_master_addr(info)
    os.environ.update(RANK=str(info.rank), WORLD_SIZE=str(info.world_size), LOCAL_RANK=str(info.local_rank),
                      MASTER_ADDR=addr, MASTER_PORT=str(info.master_port))
    if info.local_world_size is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(info.local_world_size)
    if backend is None:
        backend = accelerator_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA; use backend='gloo' on CPU ranks")
    if backend == accelerator_backend():
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()
        if acc.device_name() != "cpu":
            acc.set_device(info.local_rank % acc.device_count())
    if use_deepspeed:
        deepspeed = import_deepspeed()
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout, auto_mpi_discovery=False, verbose=False)
    else:
        dist.init_process_group(backend=backend, timeout=timeout)
    if device_for_rank().type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # CPU ranks on one host share its cores: without this every rank starts cpu_count threads.
        torch.set_num_threads(cpu_threads(info.local_world_size or 1))
    log.info("rank %d/%d (local %d) on %s, launched by %s, rendezvous %s:%d", dist.get_rank(),
             dist.get_world_size(), info.local_rank, backend, info.launcher, addr, info.master_port)
    return True


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or ``taskset``'s limit), else the count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def cpu_threads(local_ranks: int, reserve: int = 0) -> int:
    """Intra-op threads for one of ``local_ranks`` CPU ranks sharing this host's usable CPUs, ``reserve`` of them
    left for other work (the server's HTTP thread): at least 1. More threads than free cores make every OpenMP
    region wait for a descheduled thread -- on a busy host ten times slower than one thread (docs/serving.md)."""
    return max(1, (usable_cpus() - reserve) // max(1, local_ranks))


def finish_distributed(*, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
    """End a rank's distributed work in order: a barrier (no rank leaves while another still communicates) and
    ``destroy_process_group``. A rank left to tear the group down at interpreter exit can abort there ("terminate
    called without an active exception", status 134: gloo's threads destroyed while running), seen under
    ``mpirun``. No-op without a process group."""
    if not dist.is_initialized():
        return
    barrier(timeout=timeout)
    shm.disable_all()
    dist.destroy_process_group()


def device_for_rank() -> torch.device:
    """The device this rank computes on: the current device of DeepSpeed's accelerator (the local GPU that
    :func:`init_distributed` set) when the process group runs on the accelerator's backend or there is no
    group; CPU on DeepSpeed's CPU accelerator and when the group was put on another backend (gloo on a GPU host)."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() == "cpu":
        return torch.device("cpu")
    if dist.is_initialized() and dist.get_backend() != acc.communication_backend_name():
        return torch.device("cpu")
    return torch.device(acc.current_device_name())
