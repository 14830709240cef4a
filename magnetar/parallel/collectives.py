"""Collectives on (out, lse) attention states, each on an explicit group with a timeout.

``all_gather_states`` packs ``out`` and ``lse`` into one byte buffer so a Phase-2 merge costs one
collective per layer, whatever the dtype of ``out`` (bf16 ``out`` is not inflated to float32).
"""
from __future__ import annotations

import itertools
import pickle
import time
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from magnetar.parallel.groups import DEFAULT_TIMEOUT, group_size
from magnetar.parallel.shm import gather_bytes
from magnetar.utils.nvtx import ALL_GATHER_STATES, nvtx_range


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); support both.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def wait_all(works, timeout: Optional[timedelta], what: str) -> None:
    """Wait for async work handles; raise a TimeoutError naming the operation instead of hanging."""
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    for w in works if isinstance(works, (list, tuple)) else [works]:
        if w is None:
            continue
        try:
            ok = w.wait(timeout=timeout)
        except RuntimeError as e:  # gloo raises on timeout / peer failure
            raise TimeoutError(f"{what} did not complete within {timeout} ({e}); is every rank calling it?") from e
        if ok is False:
            raise TimeoutError(f"{what} did not complete within {timeout}; is every rank calling it?")


def barrier(group: Optional[dist.ProcessGroup] = None, *, timeout: Optional[timedelta] = None) -> None:
    """A barrier that raises instead of hanging: gloo's monitored barrier (which names the missing ranks), or an
    async barrier waited on with the timeout elsewhere (NCCL has no monitored barrier). No-op without a
    process group."""
    if not dist.is_initialized():
        return
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    if dist.get_backend(group) == "gloo":
        dist.monitored_barrier(group=group, timeout=timeout)
    else:
        wait_all(dist.barrier(group=group, async_op=True), timeout, "barrier")


_STORE_BARRIERS = itertools.count()


def store_barrier(name: str, *, timeout: timedelta, poll_s: float = 0.2) -> None:
    """Wait until every rank of the default group has reached the barrier ``name`` (the n-th call of each rank meets
    the n-th of the others), counted
    in the group's key-value store. For ranks that end uneven work far apart (an evaluation's dealt items): the
    store answers from its own thread, so the wait is bounded by ``timeout`` alone -- a collective's (gloo's
    monitored barrier included) is bounded by the process group's transport timeout, which a rank still computing
    can outlast. TimeoutError naming how many ranks came; a no-op without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store, world = dist.distributed_c10d._get_default_store(), dist.get_world_size()
    key = f"magnetar/barrier/{name}/{next(_STORE_BARRIERS)}"  # every rank calls them in the same order
    store.add(key, 1)
    deadline = time.monotonic() + timeout.total_seconds()
    while (came := store.add(key, 0)) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name!r}: {came} of {world} ranks arrived within {timeout}")
        time.sleep(poll_s)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def all_gather_states(
    out: torch.Tensor, lse: torch.Tensor, group: Optional[dist.ProcessGroup], *, timeout: Optional[timedelta] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather every rank's partial state for the *same* queries: one collective on ``group``.

    Args:
        out: ``(B, H, S, D)`` any float dtype; lse: ``(B, H, S)`` (cast to float32). Shapes and dtype must be
            equal on every rank of ``group``.
        group: the process group (e.g. ``ParallelGroups.cp_group``); None means a group of one.
    Returns:
        ``outs (W, B, H, S, D)`` in out's dtype and ``lses (W, B, H, S)`` float32, in group-rank order,
        ready for :func:`magnetar.ops.merge_states`.
    """
    if lse.shape != out.shape[:-1]:
        raise ValueError(f"all_gather_states: lse shape {tuple(lse.shape)} must be out's shape without D "
                         f"{tuple(out.shape[:-1])}")
    lse = lse.float()
    world = group_size(group)
    if world == 1:
        return out.unsqueeze(0), lse.unsqueeze(0)
    packed = torch.cat((_as_bytes(out), _as_bytes(lse)))
    what = f"all_gather_states over {world} ranks"
    with nvtx_range(ALL_GATHER_STATES):
        # CPU ranks on one host: through shared memory where parallel.shm_gather gave the group a buffer
        gathered = gather_bytes(packed, group, DEFAULT_TIMEOUT if timeout is None else timeout, what)
        if gathered is None:
            gathered = torch.empty(world * packed.numel(), dtype=torch.uint8, device=packed.device)
            work = _all_gather_flat(gathered, packed, group=group, async_op=True)
            wait_all(work, timeout, what)
    gathered = gathered.view(world, packed.numel())
    n_out = out.numel() * out.element_size()
    outs = gathered[:, :n_out].contiguous().view(out.dtype).view(world, *out.shape)
    lses = gathered[:, n_out:].contiguous().view(torch.float32).view(world, *lse.shape)
    return outs, lses


def broadcast_tensor(t: torch.Tensor, src: int, group: Optional[dist.ProcessGroup], *, timeout=None,
                     what: str = "broadcast") -> torch.Tensor:
    """``t`` from global rank ``src`` to every rank of ``group`` (the others pass a tensor of the same shape and
    dtype to fill), in place; returns it. A group of one returns ``t``."""
    if group_size(group) == 1:
        return t
    wait_all(dist.broadcast(t, src, group=group, async_op=True), timeout, what)
    return t


def all_gather_ints(values: list[int], group: Optional[dist.ProcessGroup], device, *, timeout=None) -> torch.Tensor:
    """Gather a short list of ints from every rank: ``(W, len(values))`` int64 (on CPU)."""
    t = torch.tensor(values, dtype=torch.long, device=device)
    world = group_size(group)
    if world == 1:
        return t.unsqueeze(0).cpu()
    gathered = torch.empty(world * t.numel(), dtype=torch.long, device=device)
    work = _all_gather_flat(gathered, t, group=group, async_op=True)
    wait_all(work, timeout, f"metadata all_gather over {world} ranks")
    return gathered.view(world, -1).cpu()


def all_gather_objects(obj: Any, group: Optional[dist.ProcessGroup], device, *, timeout=None) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order: ``dist.all_gather_object`` with a timeout. The pickles
    travel as bytes, padded to the longest (their lengths in :func:`all_gather_ints` first). The ranks of one job
    trust each other's pickles, as ``all_gather_object`` does; nothing from outside the job is unpickled here."""
    world = group_size(group)
    if world == 1:
        return [obj]
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sizes = all_gather_ints([len(payload)], group, device, timeout=timeout)[:, 0].tolist()
    longest = max(sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    mine = mine.to(device)
    gathered = torch.empty(world * longest, dtype=torch.uint8, device=device)
    work = _all_gather_flat(gathered, mine, group=group, async_op=True)
    wait_all(work, timeout, f"object all_gather over {world} ranks")
    rows = gathered.view(world, longest).cpu()
    return [pickle.loads(rows[r, : sizes[r]].numpy().tobytes()) for r in range(world)]


def all_gather_numbers(values: Sequence[float], group: Optional[dist.ProcessGroup], device, *,
                       timeout=None) -> torch.Tensor:
    """Gather a short list of numbers from every rank: ``(W, len(values))`` float64 (on CPU). Their float64 bits
    travel in :func:`all_gather_ints` (ints are exact below 2**53)."""
    bits = torch.tensor([float(v) for v in values], dtype=torch.float64).view(torch.int64).tolist()
    return all_gather_ints(bits, group, device, timeout=timeout).view(torch.float64)


def describe_per_rank(values: Sequence[str]) -> str:
    """One gathered value per group rank, printed for an error: ``"rank 0: float32, rank 1: float64"``; ranks
    with the same value share one entry (``"ranks 0,2: float32, rank 1: float64"``)."""
    ranks_of: dict[str, list[int]] = {}
    for rank, v in enumerate(values):
        ranks_of.setdefault(v, []).append(rank)
    return ", ".join(f"rank {r[0]}: {v}" if len(r) == 1 else f"ranks {','.join(map(str, r))}: {v}"
                     for v, r in ranks_of.items())
