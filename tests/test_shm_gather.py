"""The shared-memory gather of co-located CPU ranks (magnetar.parallel.shm, parallel.shm_gather): the same bytes as
gloo's all-gather, call after call (its two buffers alternate) and for payloads of any size (over a slot: gloo);
a rank that never arrives, or whose process is gone, ends the wait with a TimeoutError naming it; the buffer's file is
unlinked the moment it is made, so a rank killed at any point leaves nothing in /dev/shm, and files of dead
predecessors are swept."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta

import numpy as np
import pytest
import torch

from magnetar.parallel import all_gather_states, init_groups
from magnetar.parallel import shm
from tests.dist_utils import run_distributed


def _same_as_gloo(rank, world):
    import torch.distributed as dist

    groups = init_groups(world)
    plain = dist.new_group(list(range(world)))  # the same ranks, no shared buffer: gloo's gather
    assert shm.enable(groups.cp_group, groups.timeout) and not shm.enable(None, groups.timeout)
    gather = shm._GATHERS[id(groups.cp_group)]
    assert not _files_of(os.getpid())  # mapped by both ranks, in /dev/shm under no name
    gen = torch.Generator().manual_seed(rank)
    for shape, dtype in [((1, 9, 1, 64), torch.float32), ((8, 9, 1, 64), torch.bfloat16), ((2, 3, 5, 8), torch.float16),
                         ((1, 1, 1, 1), torch.float32), ((3, 4, 7, 16), torch.float32)]:
        out = torch.randn(*shape, generator=gen).to(dtype)
        lse = torch.randn(*shape[:-1], generator=gen)
        lse[0, 0, 0] = float("-inf")  # the empty state travels as it is
        a = all_gather_states(out, lse, groups.cp_group, timeout=groups.timeout)
        b = all_gather_states(out, lse, plain, timeout=groups.timeout)
        assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b))
    assert gather.calls == 5
    big = torch.randn(1, 4, gather.slot_bytes // 16 + 1, 4)  # over a slot: gloo carries it
    a = all_gather_states(big, torch.zeros(big.shape[:-1]), groups.cp_group, timeout=groups.timeout)
    assert gather.calls == 5 and torch.equal(a[0][rank], big)


def _files_of(pid: int) -> list[str]:
    return [n for n in os.listdir(shm._SHM_DIR) if n.startswith(f"{shm._PREFIX}{pid}-")]


def test_shm_gather_gives_gloos_bytes():
    run_distributed(_same_as_gloo, 2)


def _late(rank, world):
    groups = init_groups(world)
    assert shm.enable(groups.cp_group, groups.timeout)
    if rank == 0:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"all_gather_states over 2 ranks did not complete.*ranks \[1\] never"):
            all_gather_states(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1), groups.cp_group,
                              timeout=timedelta(seconds=1))
        assert time.monotonic() - t0 < 10
    else:
        time.sleep(3)  # never joins the gather


def test_shm_gather_times_out_naming_the_missing_rank():
    run_distributed(_late, 2)


def test_a_gone_peer_ends_the_wait_at_once():
    """The wait itself, on a stand-in whose peer is a process that has exited."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    g = shm.ShmGather.__new__(shm.ShmGather)
    g.world, g.rank, g._peers = 2, 0, [child.pid]
    g._flags = np.zeros((2, 8), dtype=np.int64)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=f"peer rank exited \\(pid {child.pid}\\)"):
        g._wait(1, timedelta(seconds=60), "all_gather_states over 2 ranks")
    assert time.monotonic() - t0 < 5
    g._peers = [os.getpid()]  # alive: the timeout ends it
    with pytest.raises(TimeoutError, match=r"within 0:00:00.300000.*ranks \[0, 1\] never arrived"):
        g._wait(1, timedelta(seconds=0.3), "all_gather_states over 2 ranks")
    g._flags[:, 0] = 1  # everybody arrived: no wait
    g._wait(1, timedelta(seconds=0.01), "x")


def test_no_room_in_dev_shm_keeps_gloo(monkeypatch, caplog):
    """A full /dev/shm (a container's 64 MB) would SIGBUS a rank at its first write: the room is reserved when the
    buffer is made, and without it the group keeps gloo, saying why, leaving no file behind."""
    before = set(os.listdir(shm._SHM_DIR))

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    assert shm._create(2) is None
    assert "no room" in caplog.text and "gather through gloo" in caplog.text
    assert set(os.listdir(shm._SHM_DIR)) == before


def test_a_rank_killed_while_the_buffer_is_set_up_leaves_nothing():
    """Issue 44 item 3: the first rank is SIGKILLed after making the buffer, before any peer opened it."""
    code = ("import time\nfrom magnetar.parallel import shm\nfd = shm._create(2)\n"
            "print(fd, flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        fd = int(proc.stdout.readline())
        assert os.path.exists(f"/proc/{proc.pid}/fd/{fd}")  # it exists: open in the process, a peer could open it
        assert not _files_of(proc.pid)  # but under no name in /dev/shm
    finally:
        proc.kill()
        proc.wait()
    assert not _files_of(proc.pid)


def test_files_of_dead_predecessors_are_swept(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    names = [f"{shm._PREFIX}{child.pid}-00aa", f"{shm._PREFIX}{os.getpid()}-00bb", "magnetar-gather-x", "other"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    assert shm.sweep(str(tmp_path)) == [names[0]]  # only the file whose creator is gone
    assert sorted(os.listdir(tmp_path)) == sorted(names[1:])
