"""The weight layout of the CPU's decode steps (issue 47, item 6: decode on the CPU at vLLM's speed).

A decode step multiplies one row per request by every weight matrix: a matrix-vector product, bound by reading the
weights. ``nn.Linear`` keeps its weight ``(out, in)`` row-major and computes ``x @ W.T``; for a single row, MKL's
kernel for that transposed operand reads the weights at about half the rate of the one that takes ``(in, out)``
rows when a matrix has more outputs than inputs (SmolLM2's MLP up / gate projections, 576 -> 1536, and its LM head,
576 -> 49152, on the 2-core AMD EPYC VM: 9-11 GB/s against 16 GB/s for one thread; docs/results.md "Decode on the
CPU against vLLM's, the default step"). :func:`relayout_for_decode` stores those weights transposed in memory
(``W.t().contiguous().t()``: the same parameter, shape and values, strides ``(1, out)``), so the unchanged model
code's ``F.linear(x, W)`` reaches the faster kernel, and keeps it only when a timed pass over the model's own
matrices says it is faster on this machine (it depends on the CPU and the BLAS build). Matrices with fewer outputs
than inputs (the down projection, k / v) and every other device keep their layout; a tied LM head is transposed
with the embedding it shares (an embedding lookup reads one strided row per token: nothing at decode, a few
milliseconds in a long prefill). Prefill's matrix products are as fast either way (measured: 2048-row products
within noise).
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

_TIMED_BYTES = 256 * 2**20  # the timed pass reads at most this much of the candidates' weights (beyond the caches)
_MIN_BYTES = 32 * 2**20  # smaller candidates stay in the caches: nothing to gain, and a timing's noise decides
_GAIN = 0.9  # the transposed layout is kept when its pass takes at most this fraction of the row-major one's
_PASSES = 3


def _candidates(model) -> list[nn.Parameter]:
    """The distinct 2-D weights of ``model``'s ``nn.Linear`` layers with more outputs than inputs, row-major."""
    seen, out = set(), []
    for m in model.modules():
        w = getattr(m, "weight", None)
        if (isinstance(m, nn.Linear) and isinstance(w, torch.Tensor) and w.dim() == 2 and m.out_features > m.in_features
                and w.is_floating_point() and w.is_contiguous() and id(w) not in seen):
            seen.add(id(w))
            out.append(w)
    return out


def _pass_seconds(weights: list[torch.Tensor]) -> float:
    """The fastest of :data:`_PASSES` single-row products over ``weights`` (after one unmeasured pass)."""
    rows = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights}
    best = float("inf")
    with torch.no_grad():
        for i in range(_PASSES + 1):
            t0 = time.perf_counter()
            for w in weights:
                F.linear(rows[w.shape[1]], w)
            if i:
                best = min(best, time.perf_counter() - t0)
    return best


def _set_layout(weights: list[torch.Tensor], transposed: bool) -> None:
    with torch.no_grad():
        for w in weights:
            w.data = w.data.t().contiguous().t() if transposed else w.data.contiguous()


def relayout_for_decode(model, device: torch.device) -> Optional[str]:
    """On a CPU, the weights of ``model``'s linear layers with more outputs than inputs stored transposed when one
    timed pass over them is faster so (each model once: later engines over the same model object reuse the
    decision); what was decided, for the log (None: nothing to decide -- another device, or such layers' weights
    under :data:`_MIN_BYTES` in all)."""
    if device.type != "cpu":
        return None
    done = getattr(model, "_magnetar_gemv_layout", None)
    if done is not None:
        return done
    weights = _candidates(model)
    if sum(w.numel() * w.element_size() for w in weights) < _MIN_BYTES:
        return None
    timed, total = [], 0
    for w in weights:  # a prefix of the model's own matrices, enough to leave the caches
        timed.append(w)
        total += w.numel() * w.element_size()
        if total >= _TIMED_BYTES:
            break
    before = _pass_seconds(timed)
    _set_layout(timed, True)
    after = _pass_seconds(timed)
    keep = after <= _GAIN * before
    _set_layout(weights if keep else timed, keep)
    what = (f"{len(weights)} linear weights with more outputs than inputs stored (in, out) for the decode step's "
            f"matrix-vector products: {1e3 * before:.1f} -> {1e3 * after:.1f} ms over {len(timed)} of them"
            if keep else f"linear weights kept (out, in): (in, out) measured {1e3 * after:.1f} ms against "
            f"{1e3 * before:.1f} over {len(timed)} of them")
    model._magnetar_gemv_layout = what
    log.info("decode on the CPU: %s", what)
    return what
