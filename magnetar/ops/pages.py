"""Paged decode attention: the eager decode step's batch in ONE call per layer, chosen from the backend registry.

In an eager decode step each request reads its own KV -- a cached context's shard and, on the query rank, its own
query and generated tokens -- so through :func:`magnetar.ops.attention_with_lse` a batch of B requests makes 2B calls
a layer, each validated, classified and dispatched on its own, and B merges. :func:`attend_pages` takes the batch at
once: ``q (B, Hq, S, D)`` and, for each request, its KV as a list of pages ``(k, v)`` of shape ``(1, Hkv, n, D)``,
**every key of which the caller knows is visible to every query row of that request** (a decode step's context
precedes its token; its own tokens end at it). The result is the ``(out, lse)`` contract of one attention over the
concatenation of a request's pages -- one softmax, so the output is rounded once, where merging per-page states
rounds each part (bf16) -- and a request with no pages gets ``(0, -inf)`` rows.

A backend of :mod:`magnetar.ops.backends` owns the kernel (as with slot attention, :mod:`magnetar.ops.slots`): one
with a ``pages_forward(q, pages, scale)`` method, which returns ``(out, lse)`` or None when it cannot take the call
(a shape, a dtype) or met a value that is not finite. :func:`attend_pages` returns None in both cases, and the caller
takes its per-part path: there :func:`~magnetar.ops.attention_with_lse` and :func:`~magnetar.ops.merge_states`
apply the exact non-finite rules, so a NaN is never turned into a finite result here. ``auto`` picks ``cpu_decode``
on a CPU whose op runs (``csrc/decode_attention.cpp``'s ``decode_attention_pages``); a backend named in
``runtime.attention_backend`` without such a method -- and every CUDA backend today -- keeps the per-part path.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from magnetar.ops.backends import AttentionBackend, get_backend
from magnetar.utils.nvtx import ATTENTION, nvtx_range

Page = tuple[torch.Tensor, torch.Tensor]  # (k, v), each (1, Hkv, n, D)


def page_backend(name: str, device: torch.device) -> Optional[AttentionBackend]:
    """The backend whose ``pages_forward`` serves paged calls on ``device`` for ``runtime.attention_backend =
    name``: the named one if it has the method, else none; ``auto``: ``cpu_decode`` on a CPU whose op runs here."""
    if name != "auto":
        backend = get_backend(name)
        return backend if hasattr(backend, "pages_forward") else None
    if device.type == "cpu":
        backend = get_backend("cpu_decode")
        if backend.runs_here():
            return backend
    return None


def attend_pages(q: torch.Tensor, pages: Sequence[Sequence[Page]], scale: float,
                 backend: str = "auto") -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``(out (B, Hq, S, D) in q's dtype, lse (B, Hq, S) float32)`` of each request's rows ``q[b]`` over the keys of
    its ``pages[b]`` (every one visible to every row; see the module docstring), or None: no backend took the call,
    or a value was not finite (the caller's per-part path then applies the exact rules)."""
    if len(pages) != q.shape[0]:
        raise ValueError(f"attend_pages: {len(pages)} requests' pages for a batch of {q.shape[0]} queries; pass one "
                         f"list of (k, v) pages per row of q")
    impl = page_backend(backend, q.device)
    if impl is None:
        return None
    with nvtx_range(ATTENTION, backend=impl.name):  # one kernel call, as attention_with_lse's are (docs/profiling.md)
        return impl.pages_forward(q, pages, float(scale))
