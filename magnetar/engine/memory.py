"""Running out of device memory: how it is recognised, what is freed, and the error a client is given.

On a GPU a request whose context does not fit -- a 1M-token document's Phase 1, a query forward joining a full batch
-- raises ``torch.OutOfMemoryError`` (on a CPU a failed allocation raises a RuntimeError from torch's allocator).
Neither says anything of the request. The serving loop (:mod:`magnetar.serve.loop`) uses this module to turn one into
a request's own failure instead of the server's end:

* :func:`out_of_memory` -- whether an exception is a failed allocation (CUDA's, or the CPU allocator's);
* :func:`relieve` -- free what the device holds for later: every context the cache keeps (a host-memory tier keeps
  its copy, as on any eviction), then the collector's and the CUDA allocator's unused blocks; the loop then tries the
  request once more;
* :func:`kv_bytes_per_token`, :func:`mlp_bytes_per_token`, :func:`phase1_need`, :func:`device_room`,
  :func:`room_problem` -- before a context's Phase 1, the certain refusal: a context whose KV and the activations
  its Phase-1 forwards must hold at once (the gated MLP's two products beside the hidden states) exceed what the
  device holds beside the weights cannot fit however the server is loaded, and is refused up front by name (a lower
  bound of the need, so nothing that could fit is refused; the rest of the activations and the other requests are
  what the out-of-memory path above meets -- and what ends a replica of several processes);
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


def mlp_bytes_per_token(model, tp_size: int = 1) -> int:
    """At least the activation bytes one token of a Phase-1 forward holds at a layer's MLP: the residual stream and
    the MLP's normed input (2 x hidden) beside the gate's and the up projection's outputs, which the gated MLP of
    every supported architecture multiplies (2 x intermediate, split over ``tp_size``), in the model's element size.
    (Eager holds a third intermediate-wide tensor, the product, and attention's own: not counted -- a lower bound.)
    0 when the model's config does not say."""
    try:
        dims = ModelDims.from_config(model.config)
    except (ValueError, TypeError, AttributeError):
        return 0
    itemsize = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 4)
    return (2 * dims.hidden + 2 * -(-dims.intermediate // max(1, tp_size))) * itemsize


def phase1_need(forwards, per_token: int, act_per_token: int) -> tuple[int, int, int]:
    """The least bytes a process holds at once beside the weights during a Phase 1 whose model ``forwards`` it runs
    in this order, each ``(kept, processed)`` tokens: the KV kept so far accumulates (a forward's own included: its
    last layer's MLP runs after every layer wrote its KV), the activations are the running forward's. Returns
    ``(need, kv, activations)`` at the largest point."""
    best, kept_so_far = (0, 0, 0), 0
    for kept, processed in forwards:
        kept_so_far += kept
        kv, act = kept_so_far * per_token, processed * act_per_token
        if kv + act > best[0]:
            best = (kv + act, kv, act)
    return best


def device_room(device: torch.device, weights: int) -> int:
    """The bytes ``device`` can hold beside ``weights`` bytes of model: a CUDA device's total memory, a CPU's physical
    memory (the host's: other processes' share is not known here), less the weights."""
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(0, int(total) - int(weights))


def room_problem(context_tokens: int, need: tuple[int, int, int], one_process_need: int, room: int,
                 device: torch.device, *, one_process: bool, per_token: int, act_per_token: int) -> Optional[str]:
    """Why a context of ``context_tokens`` cannot fit, or None: its Phase 1's least ``need`` on a process
    (:func:`phase1_need`: total, KV, activations) -- on one process (``one_process``: simulated ranks, or one rank,
    hold the whole context), else on its largest context-parallel rank -- exceeds ``room`` (:func:`device_room`, the
    smallest over the replica's ranks). ``one_process_need``: what the whole context needs on one process, for the
    advice; ``per_token`` / ``act_per_token``: the bytes a kept / processed token needs, for the detail. The message
    says by how much, about how long a context fits, and how many context-parallel ranks it would need."""
    total, kv, act = need
    if not total or total <= room:
        return None
    fits = room * context_tokens // max(1, one_process_need) if one_process else \
        room * context_tokens // max(1, total)  # a shorter context's shares shrink alike: about
    ranks = -(-one_process_need // max(1, room))
    where = "one process (it holds the whole context)" if one_process else "its largest context-parallel rank"
    kv_part = f"{kv // max(1, per_token)} tokens x {per_token // 1024} KiB"
    if act:
        what = (f"its KV ({kv / 2**30:.1f} GiB: {kv_part}) and the activations of its largest Phase-1 forward's MLP "
                f"({act / 2**30:.1f} GiB: {act // max(1, act_per_token)} tokens x {act_per_token // 1024} KiB) need "
                f"at least {total / 2**30:.1f} GiB on {where}")
    else:
        what = f"its KV alone needs {kv / 2**30:.1f} GiB on {where} ({kv_part})"
    return (f"{what}, more than {device} holds beside the model's weights ({room / 2**30:.1f} GiB): a "
            f"{context_tokens}-token context cannot fit; shorten it to at most about {fits} tokens, or spread it over "
            f"at least {ranks} context-parallel ranks of one device each (--cp-size, a method that splits the "
            f"context)")


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
    """A context whose KV and Phase-1 activations certainly cannot fit the device (:func:`room_problem`), refused
    before its Phase 1 on every rank alike: a :class:`~magnetar.config.FieldError` naming ``context``, as the
    engine's other refusals of bad input."""

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
