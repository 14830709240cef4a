"""Ring attention: exact attention of every rank's queries over the KV shards of all ranks of a group.

Each of the W ranks of ``group`` holds a shard of q and of k/v with their global positions (any lengths,
uneven or empty). KV shards travel the ring (rank i sends to i+1 and receives from i-1, with
``batch_isend_irecv``); the transfer of the next shard is in flight while the current one is attended to.
After W steps every query has seen every key, and the partial ``(out, lse)`` of each step are folded with
:func:`magnetar.ops.merge_states`. Causality comes from positions, so any sharding (contiguous, zigzag,
Star-style blocks) gives the same result as :func:`magnetar.ops.attention_with_lse` over the concatenation.

Step t on rank i attends to the shard that started on rank (i - t) mod W. A shard whose smallest key
position exceeds every local query position is skipped (no compute), which is where zigzag sharding pays
off: it gives every rank the same amount of visible work.

Zigzag sharding: the sequence is cut into 2W near-equal chunks and rank r takes chunks r and 2W-1-r, e.g.
W = 2, 8 tokens: rank 0 -> [0, 1, 6, 7], rank 1 -> [2, 3, 4, 5].
"""
from __future__ import annotations

import hashlib
import time
from datetime import timedelta
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from magnetar.ops import attention_with_lse, merge_states
from magnetar.ops.attention import check_options, check_positions, validate_qkv
from magnetar.parallel.collectives import all_gather_ints, describe_per_rank, wait_all
from magnetar.parallel.groups import group_rank, group_ranks, group_size
from magnetar.utils.nvtx import PHASE1_RING_STEP, nvtx_range

_NO_KEYS = torch.iinfo(torch.long).max  # min position of an empty shard: never visible


def _check_shard(q, k, v, q_pos, k_pos, group, timeout, causal, scale, window, backend):
    """This rank's arguments, checked before any communication (the rules of attention_with_lse, plus positions
    required as tensors, a process group and a timedelta); ``ValueError`` naming the argument."""
    validate_qkv(q, k, v, caller="ring_attention")
    check_options(causal, scale, window, backend, caller="ring_attention")
    for name, pos, t in (("q_pos", q_pos, q), ("k_pos", k_pos, k)):
        if not isinstance(pos, torch.Tensor):
            raise ValueError(f"ring_attention: {name} is required (global positions of this rank's shard as a "
                             f"tensor), got {type(pos).__name__}")
        check_positions(pos, name, t.shape[2], t.shape[0], t.device, caller="ring_attention")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"ring_attention: group must be a torch.distributed ProcessGroup (e.g. "
                         f"ParallelGroups.cp_group) or None for a group of one, got {type(group).__name__}")
    if timeout is not None and not isinstance(timeout, timedelta):
        raise ValueError(f"ring_attention: timeout must be a datetime.timedelta (e.g. timedelta(seconds=60)) or "
                         f"None, got {type(timeout).__name__} {timeout!r}")


def _dtype_code(dtype: torch.dtype) -> int:
    """A code of ``dtype`` that is the same in every process (a digest of its name)."""
    return int.from_bytes(hashlib.blake2b(str(dtype).encode(), digest_size=7).digest(), "little")


_DTYPE_NAMES = {_dtype_code(d): str(d) for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _agreed(q, k, v, k_pos) -> dict[str, int]:
    """What every rank of the ring must pass alike: the shapes but the sequence axis (v has k's shape), the dtypes,
    the layout of k_pos."""
    return {"B": k.shape[0], "Hq": q.shape[1], "Hkv": k.shape[1], "D": k.shape[3], "q's B": q.shape[0],
            "q's D": q.shape[3], "q dtype": _dtype_code(q.dtype), "k dtype": _dtype_code(k.dtype),
            "v dtype": _dtype_code(v.dtype), "k_pos.dim()": k_pos.dim()}


def _check_agreement(names: list[str], per_rank: list[list[int]]) -> None:
    """Raise the same ValueError on every rank when the gathered ``per_rank`` values of ``names`` differ."""
    diffs = []
    for i, name in enumerate(names):
        values = [row[i] for row in per_rank]
        if len(set(values)) > 1:
            shown = [_DTYPE_NAMES.get(x, f"#{x:x}") if name.endswith("dtype") else str(x) for x in values]
            diffs.append(f"{name} ({describe_per_rank(shown)})")
    if diffs:
        raise ValueError(f"ring_attention: the ranks of the group disagree on {'; '.join(diffs)}; every rank must "
                         "pass q, k, v of the same B, Hq, Hkv, D and dtype (only the sequence length may differ), "
                         "and positions of the same layout")



def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup],
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    causal: bool = True,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    timeout: Optional[timedelta] = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of the local queries over the KV shards of every rank in ``group``.

    Args:
        q: ``(B, Hq, Sq_r, D)`` this rank's queries; k, v: ``(B, Hkv, Sk_r, D)`` this rank's KV shard.
        group: the CP group (None: a group of one). Every rank of it must call with the same B, Hq, Hkv, D and
            dtype (checked in the one metadata gather the exchange needs anyway: a difference raises the same
            ValueError on every rank, naming it and the ranks).
        q_pos, k_pos: global positions of the local queries / keys, ``(S,)`` or ``(B, S)``.
        causal, scale, window, backend: as in :func:`magnetar.ops.attention_with_lse`.
        timeout: per-step limit for the KV exchange (default: ``MAGNETAR_COLLECTIVE_TIMEOUT_S``).
    Returns:
        ``out (B, Hq, Sq_r, D)`` in q's dtype and ``lse (B, Hq, Sq_r)`` float32, equal to attention over the
        concatenation of all shards -- also for NaN/inf inputs: each step's attention and the merge follow the
        non-finite rule, so exactly the rows that can see a bad key (on whichever rank) come back NaN.
    """
    _check_shard(q, k, v, q_pos, k_pos, group, timeout, causal, scale, window, backend)
    world = group_size(group)
    if world == 1:  # gloo cannot send to itself; nothing to exchange anyway
        return attention_with_lse(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=causal, scale=scale, window=window,
                                  backend=backend)

    me = group_rank(group)
    peers = group_ranks(group)
    send_to, recv_from = peers[(me + 1) % world], peers[(me - 1) % world]
    B, Hkv, _, D = k.shape
    k_pos = k_pos.to(device=k.device, dtype=torch.long).contiguous()
    kmin = int(k_pos.min()) if k_pos.numel() else _NO_KEYS
    kmax = int(k_pos.max()) if k_pos.numel() else -_NO_KEYS
    agreed = _agreed(q, k, v, k_pos)  # one gather: the exchange's lengths and positions, and what ranks must share
    meta = all_gather_ints([k.shape[2], kmin, kmax, *agreed.values()], group, k.device, timeout=timeout)
    _check_agreement(list(agreed), meta[:, 3:].tolist())
    lengths, mins, maxs = meta[:, 0].tolist(), meta[:, 1].tolist(), meta[:, 2].tolist()
    qmax = int(q_pos.max()) if q_pos.numel() else None
    qmin = int(q_pos.min()) if q_pos.numel() else None

    kv = torch.stack((k, v)).contiguous()  # one message per step for K and V
    pos = k_pos
    acc: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    for step in range(world):
        src = (me - step) % world
        works = []
        if step < world - 1:  # start moving the next shard before computing on this one
            nxt = (me - step - 1) % world
            new_kv = kv.new_empty((2, B, Hkv, lengths[nxt], D))
            new_pos = pos.new_empty((*pos.shape[:-1], lengths[nxt]))
            ops = []
            if lengths[src] > 0:  # what I send now started on rank src; peers know its length too
                ops += [dist.P2POp(dist.isend, kv, send_to, group), dist.P2POp(dist.isend, pos, send_to, group)]
            if lengths[nxt] > 0:
                ops += [dist.P2POp(dist.irecv, new_kv, recv_from, group),
                        dist.P2POp(dist.irecv, new_pos, recv_from, group)]
            if ops:
                works = dist.batch_isend_irecv(ops)
        skip = _invisible(lengths[src], mins[src], maxs[src], qmin, qmax, causal, window)
        acc = _step(acc, q, kv[0], kv[1], q_pos, pos, step, skip, causal, scale, window, backend)
        if step < world - 1:
            wait_all(works, timeout, f"ring_attention KV exchange (step {step} of {world})")
            kv, pos = new_kv, new_pos
    return _result(acc, q, B)


def _invisible(length: int, kmin: int, kmax: int, qmin: Optional[int], qmax: Optional[int], causal: bool,
               window: Optional[int]) -> bool:
    """Whether no local query sees any key of a shard (empty; every key after every query; every key older than
    every query's window): the step computes nothing."""
    skip = length == 0 or (causal and (qmax is None or kmin > qmax))
    if window is not None and not skip:
        skip = kmax <= qmin - window
    return skip


def _step(acc, q, k, v, q_pos, k_pos, step: int, skip: bool, causal, scale, window, backend):
    """One ring step: the local queries over the shard held now, folded into ``acc`` ((out float32, lse) or None)
    with :func:`merge_states`."""
    if skip:
        return acc
    with nvtx_range(PHASE1_RING_STEP, s=step):
        out, lse = attention_with_lse(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=causal, scale=scale, window=window,
                                      backend=backend)
    out = out.float()  # accumulate across steps in float32, round once at the end
    if acc is None:
        return out, lse
    return merge_states([acc[0], out], [acc[1], lse])


def _result(acc, q, B: int) -> tuple[torch.Tensor, torch.Tensor]:
    if acc is None:  # no key visible to any local query
        Hq, Sq = q.shape[1], q.shape[2]
        return torch.zeros_like(q), torch.full((B, Hq, Sq), float("-inf"), dtype=torch.float32, device=q.device)
    return acc[0].to(q.dtype), acc[1]


class ExchangeClock:
    """The steps of simulated ring exchanges (ranks run one after another on one device): each step's attention
    time and the bytes a real ring moves beside it (the next shard's KV and positions), for pricing the exchange
    at a link's bandwidth afterwards (:func:`exposed_seconds`). On CUDA the steps are timed with events (no host
    synchronization inside the forward; read after it synchronized), elsewhere with the wall clock."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._steps: list[tuple[object, object, int]] = []

    def start(self):
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, started, moved_bytes: int) -> None:
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._steps.append((started, ev, moved_bytes))
        else:
            self._steps.append((started, time.perf_counter(), moved_bytes))

    def steps(self) -> list[tuple[float, int]]:
        """``(attention seconds, bytes moved beside it)`` per step so far (a CUDA clock: after a synchronize)."""
        if self.device.type == "cuda":
            return [(a.elapsed_time(b) / 1e3, n) for a, b, n in self._steps]
        return [(b - a, n) for a, b, n in self._steps]


def exposed_seconds(steps: Sequence[tuple[float, int]], link_gbps: float) -> float:
    """The exchange time a ring's steps leave uncovered over a ``link_gbps`` GB/s link: each step's transfer
    overlaps that step's attention (as :func:`ring_attention` starts the next shard's exchange before attending
    to the one it holds), so a step costs max(attention, transfer) and the exposed part is the excess."""
    if not link_gbps > 0:
        raise ValueError(f"link_gbps must be > 0 (GB/s), got {link_gbps}")
    return sum(max(0.0, n / (link_gbps * 1e9) - s) for s, n in steps)


def ring_attention_local(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    received: Sequence[Union[tuple[torch.Tensor, torch.Tensor, torch.Tensor], int]],
    causal: bool = True,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    backend: str = "auto",
    clock: Optional[ExchangeClock] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`ring_attention` computes on one rank, in one process: this rank's queries over its own KV shard
    ``k, v`` (positions ``k_pos``), then over ``received`` -- every other rank's shard in the order the ring brings
    them (rank ``r-1``, ``r-2``, ...) as ``(k, v, k_pos)`` --, step by step, each folded in with
    :func:`merge_states` under the same skip rule. Simulated ranks run a ring rank by rank this way. An entry may
    be a token count instead: a shard none of these queries can see (causally after them), which the ring still
    moves. ``clock``: records each step's attention time beside the bytes the ring moves during it (the next
    shard's K, V and positions; nothing beside the last step)."""
    validate_qkv(q, k, v, caller="ring_attention_local")
    check_options(causal, scale, window, backend, caller="ring_attention_local")
    check_positions(q_pos, "q_pos", q.shape[2], q.shape[0], q.device, caller="ring_attention_local")
    check_positions(k_pos, "k_pos", k.shape[2], k.shape[0], k.device, caller="ring_attention_local")
    B, Hkv, _, D = k.shape
    per_token = 2 * B * Hkv * D * k.element_size() + 8  # K and V, and an int64 position
    shards: list = [(k, v, k_pos.to(device=k.device, dtype=torch.long))]
    for i, entry in enumerate(received):
        if isinstance(entry, int):
            if entry == 0 or (causal and entry > 0):
                shards.append(entry)
                continue
            raise ValueError(f"ring_attention_local: received[{i}] is a token count ({entry}), which stands only for "
                             f"an empty shard or, causal, one that no query sees; pass its (k, v, k_pos)")
        rk, rv, rp = entry
        shards.append((rk, rv, rp.to(device=rk.device, dtype=torch.long)))
    qmax = int(q_pos.max()) if q_pos.numel() else None
    qmin = int(q_pos.min()) if q_pos.numel() else None
    acc = None
    for step, shard_kv in enumerate(shards):
        started = clock.start() if clock is not None else None
        if not isinstance(shard_kv, int):
            sk, sv, sp = shard_kv
            n = sp.shape[-1]
            skip = _invisible(n, int(sp.min()) if n else _NO_KEYS, int(sp.max()) if n else -_NO_KEYS, qmin, qmax,
                              causal, window)
            acc = _step(acc, q, sk, sv, q_pos, sp, step, skip, causal, scale, window, backend)
        if clock is not None:
            nxt = shards[step + 1] if step + 1 < len(shards) else 0
            moved = nxt * per_token if isinstance(nxt, int) else nxt[0].nbytes + nxt[1].nbytes + nxt[2].nbytes
            clock.stop(started, moved)
    return _result(acc, q, B)


def _chunk_bounds(seq_len: int, parts: int) -> list[int]:
    base, extra = divmod(seq_len, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def contiguous_indices(seq_len: int, world_size: int, rank: int) -> torch.Tensor:
    """Global token indices of ``rank``'s contiguous shard (near-equal sizes, the first shards 1 longer)."""
    b = _chunk_bounds(seq_len, world_size)
    return torch.arange(b[rank], b[rank + 1])


def zigzag_indices(seq_len: int, world_size: int, rank: int) -> torch.Tensor:
    """Global token indices of ``rank``'s zigzag shard: chunks ``rank`` and ``2W-1-rank`` of 2W."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    b = _chunk_bounds(seq_len, 2 * world_size)
    j = 2 * world_size - 1 - rank
    return torch.cat((torch.arange(b[rank], b[rank + 1]), torch.arange(b[j], b[j + 1])))


def shard(x: torch.Tensor, indices: torch.Tensor, dim: int) -> torch.Tensor:
    """Select ``indices`` (from :func:`zigzag_indices` / :func:`contiguous_indices`) along ``dim``."""
    return x.index_select(dim, indices.to(x.device))


def unshard(shards: Sequence[torch.Tensor], indices: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """Reassemble per-rank shards into the full sequence along ``dim`` (inverse of :func:`shard`)."""
    order = torch.cat([i.to(shards[0].device) for i in indices])
    full = torch.cat(list(shards), dim=dim)
    return full.index_select(dim, torch.argsort(order))
