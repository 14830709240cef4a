"""Paged decode attention: the eager decode step's batch in ONE call per layer, chosen from the backend registry.

In an eager decode step each request reads its own KV -- a cached context's shard and, on the query rank, its own
query and generated tokens -- so through :func:`magnetar.ops.attention_with_lse` a batch of B requests makes 2B calls
a layer, each validated, classified and dispatched on its own, and B merges. :func:`attend_pages` takes the batch at
once: ``q (B, Hq, S, D)`` and, for each request, its KV as :class:`Page` ``(k, v)``s of shape ``(1, Hkv, n, D)``,
**every key of which the caller knows is visible to every query row of that request** (a decode step's context
precedes its token; its own tokens end at it). The result is the ``(out, lse)`` contract of one attention over the
concatenation of a request's pages -- one softmax, so the output is rounded once, where merging per-page states
rounds each part (bf16) -- and a request with no pages gets ``(0, -inf)`` rows.

A backend of :mod:`magnetar.ops.backends` owns the kernel (as with slot attention, :mod:`magnetar.ops.slots`): one
with a ``pages_forward(q, pages, scale)`` method, which returns ``(out, lse)`` or None when it cannot take the call
(a shape, a dtype) or met a value that is not finite. :func:`attend_pages` returns None in both cases, and the caller
takes its per-part path: there :func:`~magnetar.ops.attention_with_lse` and :func:`~magnetar.ops.merge_states`
apply the exact non-finite rules, so a NaN is never turned into a finite result here. ``auto`` picks ``cpu_decode``
on a CPU whose op runs (``csrc/decode_attention.cpp``'s ``decode_attention_pages``) and ``triton_decode`` on CUDA
where Triton runs (its split-KV kernel over the pages' addresses: one launch a layer, no read of the device; a kernel
that fails there goes page by page). Elsewhere -- a CUDA machine without Triton, a user's order naming another backend
first, or a backend named in ``runtime.attention_backend`` without such a method -- :class:`PageByPage`
serves the contract with the registry's ordinary kernels: each page one FULL call of the backend ``auto`` (or the
named one) picks, the pages of a request merged, and ONE finite check for the whole batch (a page's ``k_finite``
spares it the read of keys its owner checked once) where the front end makes two host reads a call.
"""
from __future__ import annotations

import os
from typing import NamedTuple, Optional, Sequence

import torch

from magnetar.ops.backends import first_preferred, get_backend, select_backend
from magnetar.ops.backends.measured import ENV
from magnetar.ops.call import FULL, AttentionCall
from magnetar.ops.merge import merge_requests
from magnetar.ops.nonfinite import all_finite
from magnetar.utils.nvtx import ATTENTION, nvtx_range


class Page(NamedTuple):
    """One piece of a request's KV: ``k, v (1, Hkv, n, D)``; ``k_finite``: its owner knows every key is finite
    (checked once for a frozen context: :meth:`magnetar.engine.kv.LayerKV.keys_finite`)."""

    k: torch.Tensor
    v: torch.Tensor
    k_finite: bool = False


class PageByPage:
    """Paged calls on the registry's ordinary kernels (module docstring): request b's pages each one FULL call of
    ``backend`` (``auto``: the kernel ``auto`` picks for it), merged; None when q, a key (a page not ``k_finite``)
    or an output was not finite -- one read of the device for the batch."""

    def __init__(self, backend: str):
        self.name, self.backend = backend, backend

    def pages_forward(self, q, pages, scale):
        states, check = [], [q]
        for b, request in enumerate(pages):
            parts = []
            for page in request:
                if not page.k.shape[2]:
                    continue
                call = AttentionCall(q[b : b + 1], page.k, page.v, None, None, scale, FULL)
                impl = select_backend(call, self.backend)
                with nvtx_range(ATTENTION, backend=impl.name):
                    parts.append(impl.forward(call))
                check += [parts[-1][0]] if page.k_finite else [page.k, parts[-1][0]]
            states.append(parts)
        if not all_finite(*check):  # the per-part path applies the exact rules
            return None
        return merge_requests(states, q)  # one merge for the batch where every request has as many pages


def page_backend(name: str, device: torch.device):
    """What serves paged calls on ``device`` for ``runtime.attention_backend = name``: the named backend if it has
    ``pages_forward``, else :class:`PageByPage` over it; ``auto``: ``cpu_decode`` on a CPU whose op runs here --
    unless ``MAGNETAR_ATTENTION_ORDER`` puts another backend serving this device first (auto's own order) --,
    ``triton_decode`` on CUDA where Triton runs (unless ``MAGNETAR_ATTENTION_ORDER`` names another first; a card's
    measured order is Phase 1's and does not count here), else
    :class:`PageByPage` over ``auto``'s choices."""
    if name != "auto":
        backend = get_backend(name)
        return backend if hasattr(backend, "pages_forward") else PageByPage(name)
    if device.type == "cpu" and first_preferred(device) in (None, "cpu_decode"):
        backend = get_backend("cpu_decode")
        if backend.runs_here():
            return backend
    # on CUDA a user's MAGNETAR_ATTENTION_ORDER decides as on a CPU; a card's measured order (Phase 1's squares) not
    if device.type == "cuda" and (not os.environ.get(ENV, "").strip() or first_preferred(device) == "triton_decode"):
        backend = get_backend("triton_decode")
        if backend.runs_here(device):
            return backend
    return PageByPage("auto")


def attend_pages(q: torch.Tensor, pages: Sequence[Sequence[Page]], scale: float,
                 backend: str = "auto") -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``(out (B, Hq, S, D) in q's dtype, lse (B, Hq, S) float32)`` of each request's rows ``q[b]`` over the keys of
    its ``pages[b]`` (:class:`Page`; every key visible to every row: see the module docstring), or None: the backend
    could not take the call, or a value was not finite (the caller's per-part path then applies the exact rules)."""
    if len(pages) != q.shape[0]:
        raise ValueError(f"attend_pages: {len(pages)} requests' pages for a batch of {q.shape[0]} queries; pass one "
                         f"list of Page(k, v) per row of q")
    impl = page_backend(backend, q.device)
    if isinstance(impl, PageByPage):  # each page's kernel call is a range of its own
        return impl.pages_forward(q, pages, float(scale))
    with nvtx_range(ATTENTION, backend=impl.name):  # one kernel call, as attention_with_lse's are (docs/profiling.md)
        return impl.pages_forward(q, pages, float(scale))
