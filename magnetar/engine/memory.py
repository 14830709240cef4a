"""Running out of device memory: how it is recognised, what is freed, and the error a client is given.

On a GPU a request whose context does not fit -- a 1M-token document's Phase 1, a query forward joining a full batch
-- raises ``torch.OutOfMemoryError`` (on a CPU a failed allocation raises a RuntimeError from torch's allocator).
Neither says anything of the request. The serving loop (:mod:`magnetar.serve.loop`) uses this module to turn one into
a request's own failure instead of the server's end:

* :func:`out_of_memory` -- whether an exception is a failed allocation (CUDA's, or the CPU allocator's);
* :func:`relieve` -- free what the device holds for later: every context the cache keeps (a host-memory tier keeps
  its copy, as on any eviction), then the collector's and the CUDA allocator's unused blocks; the loop then tries the
  request once more;
* :func:`kv_bytes_per_token`, :func:`device_room`, :func:`kv_room_problem` -- before a context's Phase 1, the
  certain refusal: a context whose KV ALONE exceeds what the device holds beside the weights cannot fit however the
  server is loaded, and is refused up front by name (a lower bound of the need, so nothing that could fit is
  refused; the activations and the other requests are what the out-of-memory path above meets);
* :class:`OutOfDeviceMemory` -- the error that request fails with if it still does not fit: what ran out, on which
  device, how much was free, and what to change. ``alone`` (nothing else held the device: no other request, no pinned
  context, no other Phase 1 in progress -- the cache was dropped) means it cannot fit here at all -- a client error
  (400) -- else the server is busy (503, retry).

Only a replica of ONE process can fail a request alone this way: on several processes one rank's allocation fails
while the others wait in the request's collectives, so the loop ends the replica there, as for a dead rank.
"""
from __future__ import annotations

import gc
import os
from typing import Optional

import torch

from magnetar.config import FieldError
from magnetar.models.dims import ModelDims

_CPU_ALLOCATOR = "can't allocate memory"  # torch's CPU allocator's RuntimeError (alloc_cpu.cpp)


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is a failed allocation: ``torch.OutOfMemoryError`` (CUDA) or the CPU allocator's."""
    return isinstance(error, torch.OutOfMemoryError) or (isinstance(error, RuntimeError) and
                                                         _CPU_ALLOCATOR in str(error))


def free_bytes(device: torch.device) -> Optional[tuple[int, int]]:
    """``(free, total)`` bytes of a CUDA ``device`` (None elsewhere: a CPU's memory is the host's)."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)


def relieve(cache, device: torch.device) -> int:
    """Free what ``device`` holds for later: every handle of the context cache ``cache`` (a
    :class:`~magnetar.engine.context.ContextCache`; its ``on_evict`` -- the host-memory tier -- keeps a copy, as on
    any eviction), then the collector's garbage and, on CUDA, the allocator's cached blocks. A handle a request still
    reads stays alive until that request ends. Returns the bytes the cache dropped."""
    dropped = cache.shed()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dropped


def kv_bytes_per_token(model, tp_size: int = 1) -> int:
    """At least the KV bytes one context token keeps on a rank: K and V of its KV heads (split over ``tp_size``) x
    head dim x the model's element size, over the global layers (a sliding-window layer's KV may be cut to its
    window: not counted). 0 when the model's config does not say (nothing is then refused)."""
    try:
        dims = ModelDims.from_config(model.config)
    except (ValueError, TypeError, AttributeError):
        return 0
    itemsize = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 4)
    heads = max(1, dims.kv_heads // max(1, tp_size))
    return sum(2 * heads * dims.head_dim * itemsize for w in dims.windows if w is None)


def device_room(device: torch.device, weights: int) -> int:
    """The bytes ``device`` can hold beside ``weights`` bytes of model: a CUDA device's total memory, a CPU's physical
    memory (the host's: other processes' share is not known here), less the weights."""
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(0, int(total) - int(weights))


def kv_room_problem(context_tokens: int, kept_tokens: int, per_token: int, room: int, device: torch.device,
                    *, one_process: bool) -> Optional[str]:
    """Why a context of ``context_tokens`` cannot fit, or None: its largest KV share -- ``kept_tokens`` tokens of
    ``per_token`` bytes on one process (``one_process``: simulated ranks, or one rank, hold the whole context) --
    exceeds ``room`` (:func:`device_room`, the smallest over the replica's ranks). The message says by how much, how
    long a context fits, and how many context-parallel ranks its KV would need."""
    need = kept_tokens * per_token
    if not per_token or need <= room:
        return None
    fits = room // per_token * context_tokens // max(1, kept_tokens)  # the same share of a shorter context
    ranks = -(-context_tokens * per_token // max(1, room))
    where = "one process (it holds the whole context)" if one_process else "its largest context-parallel rank"
    return (f"its KV alone needs {need / 2**30:.1f} GiB on {where} ({kept_tokens} tokens x {per_token // 1024} KiB), "
            f"more than {device} holds beside the model's weights ({room / 2**30:.1f} GiB): a {context_tokens}-token "
            f"context cannot fit; shorten it to at most about {fits} tokens, or spread it over at least {ranks} "
            f"context-parallel ranks of one device each (--cp-size, a method that splits the context)")


def did_not_fit(error: BaseException) -> bool:
    """Whether ``error`` says a request did not fit memory: a failed allocation (:func:`out_of_memory`), the certain
    refusal before Phase 1 (:class:`ContextTooLarge`) or the serving loop's :class:`OutOfDeviceMemory`."""
    return out_of_memory(error) or isinstance(error, (ContextTooLarge, OutOfDeviceMemory))


def fails_alone(error: BaseException, replica_size: int) -> bool:
    """Whether ``error`` is a request's own failure to fit memory (:func:`did_not_fit`) that the request can fail
    alone on a replica of ``replica_size`` processes: the certain refusal before Phase 1 always (every rank raises it
    alike), an allocation that failed only where one process holds the replica (on several, its peers wait in the
    request's collectives: the replica's failure)."""
    if isinstance(error, ContextTooLarge):
        return True
    return did_not_fit(error) and replica_size == 1


class ContextTooLarge(FieldError):
    """A context whose KV alone cannot fit the device (:func:`kv_room_problem`), refused before its Phase 1 on every
    rank alike: a :class:`~magnetar.config.FieldError` naming ``context``, as the engine's other refusals of bad
    input."""

    def __init__(self, message: str):
        super().__init__(message, "context")


class OutOfDeviceMemory(RuntimeError):
    """A request did not fit the device's memory, even after :func:`relieve`. ``alone``: nothing else held the device
    when it ran out (the caller knows: no other request, pinned context or Phase 1) -- it cannot fit here: status 400;
    otherwise the server is busy: 503, retry later."""

    def __init__(self, what: str, device: torch.device, cause: BaseException, *, alone: bool):
        self.alone = alone
        self.status = 400 if alone else 503
        free = free_bytes(device)
        room = "" if free is None else f", {free[0] / 2**30:.1f} GiB of {free[1] / 2**30:.1f} GiB free after it"
        first = str(cause).splitlines()[0][:200] if str(cause) else type(cause).__name__
        if alone:
            advice = ("nothing else held the device: this request cannot fit here -- shorten its context, or run it "
                      "with more context-parallel ranks (--cp-size), a half-precision --dtype or a larger device")
        else:
            advice = ("other requests or cached contexts held the device: retry when fewer requests run, or shorten "
                      "the context")
        super().__init__(f"out of device memory in {what} on {device}{room} ({first}); {advice}")
