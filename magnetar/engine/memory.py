"""Running out of device memory: how it is recognised, what is freed, and the error a client is given.

On a GPU a request whose context does not fit -- a 1M-token document's Phase 1, a query forward joining a full batch
-- raises ``torch.OutOfMemoryError`` (on a CPU a failed allocation raises a RuntimeError from torch's allocator).
Neither says anything of the request. The serving loop (:mod:`magnetar.serve.loop`) uses this module to turn one into
a request's own failure instead of the server's end:

* :func:`out_of_memory` -- whether an exception is a failed allocation (CUDA's, or the CPU allocator's);
* :func:`relieve` -- free what the device holds for later: every context the cache keeps (a host-memory tier keeps
  its copy, as on any eviction), then the collector's and the CUDA allocator's unused blocks; the loop then tries the
  request once more;
* :class:`OutOfDeviceMemory` -- the error that request fails with if it still does not fit: what ran out, on which
  device, how much was free, and what to change. ``alone`` (nothing else held the device: no other request, no pinned
  context, no other Phase 1 in progress -- the cache was dropped) means it cannot fit here at all -- a client error
  (400) -- else the server is busy (503, retry).

Only a replica of ONE process can fail a request alone this way: on several processes one rank's allocation fails
while the others wait in the request's collectives, so the loop ends the replica there, as for a dead rank.
"""
from __future__ import annotations

import gc
from typing import Optional

import torch

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
