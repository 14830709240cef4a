"""A shared-memory all-gather for the CPU ranks of a group that share one host (``parallel.shm_gather``).

Phase 2 gathers every rank's ``(out, lse)`` once per layer: a few KB per decode step and layer. Over gloo each
gather is a TCP round trip through gloo's own threads, which on a machine whose cores the ranks fill must first be
scheduled -- on 2 CPU ranks of the 2-core VM a fifth of a batch-1 decode step was the gather (docs/results.md,
"Decode: where a step goes"). Here each rank writes its bytes into its slot of a shared buffer and raises its
counter; a rank waits for the others' counters, yielding the CPU between checks (``os.sched_yield``), then reads
every slot. Two buffers alternate: a rank writes buffer ``n % 2`` in call ``n`` only after every other rank has
entered call ``n - 1``, so nobody still reads it.

The rules of every collective hold: the group is explicit, and a wait past the timeout raises ``TimeoutError``
naming the call -- sooner when a peer's process is gone (its pid is checked while waiting), which gloo's closed
socket would also have told. Payloads larger than a slot go through gloo (:func:`gather_bytes` returns None).

The buffer is a file in ``/dev/shm`` that the group's first rank creates, reserves room for (where there is none,
the group keeps gloo, with a warning) and unlinks at once: from then on only open descriptors hold it, and the other
ranks open it through the first rank's descriptor (``/proc/<pid>/fd/<fd>``), so a crash at any moment -- a rank
killed while the buffer is set up included -- leaves nothing in ``/dev/shm``. A rank that cannot open it (no
``/proc``, another pid namespace) makes the whole group keep gloo, with a warning. A file left by a process killed
in the instant between creating and unlinking it (or by an older version) is swept by the next job that makes a
buffer: a ``magnetar-gather-<pid>-*`` file whose creator ``pid`` no longer runs.
"""
from __future__ import annotations

import logging
import mmap
import os
import platform
import secrets
import socket
import time
from datetime import timedelta
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

SLOT_BYTES = 1 << 20  # per rank and buffer: a batch of 64 single-token queries x 32 heads x 128 dims in fp32 fits
_LINE = 64  # one counter per cache line
_SHM_DIR = "/dev/shm"
log = logging.getLogger(__name__)
_PEER_CHECK_S = 0.2  # how often a waiting rank checks that its peers' processes still exist

_GATHERS: dict[int, "Optional[ShmGather]"] = {}  # id(group) -> its gather (None: the group cannot use one)
_GROUPS: list = []  # the groups of _GATHERS, kept alive so that their ids stay theirs


class ShmGather:
    """The shared buffer of one process group (every rank of it on this host); see the module docstring."""

    def __init__(self, group: dist.ProcessGroup, mapped: mmap.mmap, slot_bytes: int = SLOT_BYTES):
        """A gather over the buffer ``mapped`` (:func:`_map`, on every rank of ``group``); every rank of ``group``
        calls this together."""
        self.group, self.slot_bytes, self._map = group, slot_bytes, mapped
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._flags = np.frombuffer(self._map, dtype=np.int64, count=_LINE // 8 * self.world).reshape(self.world, -1)
        self._data = torch.frombuffer(self._map, dtype=torch.uint8, offset=_LINE * self.world,
                                      count=2 * self.world * slot_bytes).view(2, self.world, slot_bytes)
        pids = [None] * self.world
        dist.all_gather_object(pids, os.getpid(), group=group)
        self._peers = [p for r, p in enumerate(pids) if r != self.rank]
        self.calls = 0

    def all_gather(self, packed: torch.Tensor, timeout: timedelta, what: str) -> torch.Tensor:
        """``(world, n)`` uint8: every rank's ``packed`` (``n`` bytes, at most :attr:`slot_bytes`, the same on every
        rank), in group-rank order."""
        n = packed.numel()
        self.calls += 1
        buf = self._data[self.calls % 2]
        buf[self.rank, :n].copy_(packed)
        self._flags[self.rank, 0] = self.calls  # an aligned 8-byte store: the others see all of it or nothing
        self._wait(self.calls, timeout, what)
        return buf[:, :n].clone()

    def _wait(self, call: int, timeout: timedelta, what: str) -> None:
        flags = self._flags[:, 0]
        if flags.min() >= call:
            return
        start = time.monotonic()
        check = start + _PEER_CHECK_S
        limit = start + timeout.total_seconds()
        while flags.min() < call:
            os.sched_yield()
            now = time.monotonic()
            if now >= check:
                check = now + _PEER_CHECK_S
                gone = [p for p in self._peers if not _alive(p)]
                if gone:
                    raise TimeoutError(f"{what}: the process of a peer rank exited (pid {gone[0]}) while this rank "
                                       f"waited for it in the shared-memory gather")
                if now >= limit:
                    late = [r for r in range(self.world) if flags[r] < call]
                    raise TimeoutError(f"{what} did not complete within {timeout} (shared-memory gather: group "
                                       f"ranks {late} never arrived); is every rank calling it?")

    def close(self) -> None:
        self._data = self._flags = None
        self._map.close()


def gather_bytes(packed: torch.Tensor, group: dist.ProcessGroup, timeout: timedelta, what: str
                 ) -> Optional[torch.Tensor]:
    """``(world, n)`` uint8 through ``group``'s shared-memory gather, or None when it has none (not enabled, not
    every rank on this host, a CUDA tensor, or a payload over a slot: then the caller's collective runs). Every rank
    of ``group`` decides alike: the size is the same on every rank, and whether the group has one was agreed when
    it was made."""
    gather = _GATHERS.get(id(group))
    if gather is None or packed.device.type != "cpu" or packed.numel() > gather.slot_bytes:
        return None
    return gather.all_gather(packed, timeout, what)


def enable(group: Optional[dist.ProcessGroup], timeout: timedelta) -> bool:
    """Give ``group`` a shared-memory gather if its ranks all run on this host with the gloo backend (a collective
    of ``group``: every rank calls it, before the group's first gather); returns whether it has one. A group of one
    rank, or an already-enabled one, needs nothing."""
    if group is None or dist.get_world_size(group) == 1 or id(group) in _GATHERS:
        return _GATHERS.get(id(group)) is not None
    if dist.get_backend(group) != "gloo":  # the same on every rank: no collective
        return False
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    hosts = [None] * world
    # x86's store order makes a counter seen imply the bytes written before it are seen; weaker orders (Arm) would
    # need fences Python cannot issue
    here = (socket.gethostname(), os.path.isdir(_SHM_DIR) and platform.machine().lower() in ("x86_64", "amd64"))
    dist.all_gather_object(hosts, here, group=group)
    fd, path = None, [None]
    if rank == 0 and all(h == (here[0], True) for h in hosts):
        fd = _create(world)  # None if /dev/shm has no room: then nobody uses one
        path[0] = None if fd is None else f"/proc/{os.getpid()}/fd/{fd}"
    try:
        dist.broadcast_object_list(path, src=dist.get_global_rank(group, 0), group=group)
        mapped = None if path[0] is None else _map(fd if rank == 0 else path[0], _size(world, SLOT_BYTES))
        every = [torch.zeros(1, dtype=torch.long) for _ in range(world)]  # whether each rank mapped it: all or none
        dist.all_gather(every, torch.tensor([int(mapped is not None)]), group=group, async_op=True).wait(timeout)
        every = [bool(t) for t in every]
    finally:
        if fd is not None:  # every rank has opened it (or failed): only the mappings hold it now
            os.close(fd)
    if path[0] is not None and not all(every):
        log.warning("parallel.shm_gather: group ranks %s could not open the shared buffer through /proc; the ranks "
                    "gather through gloo", [r for r, ok in enumerate(every) if not ok])
    if mapped is not None and not all(every):
        mapped.close()
    _GATHERS[id(group)] = ShmGather(group, mapped) if path[0] is not None and all(every) else None
    _GROUPS.append(group)
    return _GATHERS[id(group)] is not None


def disable_all() -> None:
    """Forget every group's gather (their buffers unmapped): before the process groups are destroyed."""
    for gather in _GATHERS.values():
        if gather is not None:
            gather.close()
    _GATHERS.clear()
    _GROUPS.clear()


def _size(world: int, slot_bytes: int) -> int:
    return _LINE * world + 2 * world * slot_bytes


_PREFIX = "magnetar-gather-"


def _create(world: int, slot_bytes: int = SLOT_BYTES) -> Optional[int]:
    """An open descriptor of a new buffer for ``world`` ranks: a file in /dev/shm unlinked as soon as it is made (a
    crash from then on leaves nothing), its room reserved (a full /dev/shm -- a container's 64 MB -- would otherwise
    kill a rank with SIGBUS at its first write); None, with a warning, if it cannot be made. Sweeps the files of dead
    predecessors first (:func:`sweep`)."""
    sweep()
    path = os.path.join(_SHM_DIR, f"{_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as e:
        log.warning("parallel.shm_gather: cannot create %s (%s); the ranks gather through gloo", path, e)
        return None
    os.unlink(path)
    try:
        os.posix_fallocate(fd, 0, _size(world, slot_bytes))
    except OSError as e:
        os.close(fd)
        log.warning("parallel.shm_gather: no room for %d bytes in %s (%s); the ranks gather through gloo",
                    _size(world, slot_bytes), _SHM_DIR, e)
        return None
    return fd


def _map(where, size: int) -> Optional[mmap.mmap]:
    """The buffer mapped from ``where`` (the creator's descriptor, or its ``/proc/<pid>/fd/<fd>`` path on the other
    ranks), or None with the reason logged when it cannot be opened."""
    try:
        fd = where if isinstance(where, int) else os.open(where, os.O_RDWR)
    except OSError as e:
        log.warning("parallel.shm_gather: cannot open the group's buffer %s (%s)", where, e)
        return None
    try:
        return mmap.mmap(fd, size)
    except (OSError, ValueError) as e:
        log.warning("parallel.shm_gather: cannot map the group's buffer %s (%s)", where, e)
        return None
    finally:
        if fd is not where:
            os.close(fd)


def sweep(directory: str = _SHM_DIR) -> list[str]:
    """Remove the gather buffers in ``directory`` whose creating process no longer runs (``magnetar-gather-<pid>-*``:
    a process killed between making its file and unlinking it, or an older version's); returns their names. Files
    of live processes are left alone."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        pid = name[len(_PREFIX):].split("-", 1)[0] if name.startswith(_PREFIX) else ""
        if pid.isdigit() and not _alive(int(pid)):
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(name)
            except OSError:  # another job swept it first, or it is not ours to remove
                pass
    if removed:
        log.warning("parallel.shm_gather: removed %d gather buffer(s) of dead processes from %s: %s", len(removed),
                    directory, ", ".join(removed))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
