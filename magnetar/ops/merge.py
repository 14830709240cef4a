"""Merge partial attention states ``(out, lse)`` computed over disjoint key sets of the same queries.

Every combination of partial results in Magnetar (ring steps, Star/Pulsar Phase 2, sparse selections) goes
through :func:`merge_states`. Given N parts with outputs ``o_n`` and log-sum-exps ``l_n`` (natural log,
float32), the exact softmax over the union of their keys is::

    m   = max_n l_n                     (over non-empty parts)
    w_n = exp(l_n - m)
    out = sum_n w_n * o_n / sum_n w_n
    lse = m + log(sum_n w_n)

Numerics: accumulation is float32 whatever the input dtype. Per query row:

* a part with ``lse = -inf`` is empty (it saw no key): its ``out`` is never read, even if it is NaN;
* a part with ``lse`` NaN or ``+inf`` carries non-finite input (attention gives NaN lse for a NaN query or a
  visible NaN/inf key): the merged row is ``out = NaN`` (every element), ``lse = NaN``. There is no "NaN lse
  = empty" rule -- a NaN never becomes a plausible finite answer. (FlashAttention's ``+inf`` for a row with
  no visible key never gets here: attention gives such rows ``-inf``.);
* the ``out`` of every other part is read, even where its weight underflows to 0, so a NaN/inf value in it
  stays non-finite in the merged ``out`` (IEEE: ``0 * NaN = NaN``); the merged ``lse`` is unaffected, as in
  attention with a NaN value vector;
* a row empty in every part gives ``out = 0, lse = -inf``.

Never ``lse + log1p(exp(delta))``: that overflows for large ``delta``.

The fused implementation (a DeepSpeed op builder, :mod:`magnetar.ops.fused_merge`) is used when it is
available; this module's torch code is the fallback and the reference it is tested against.
This module does not know where the parts came from (ranks, ring steps or sparse subsets).
"""
from __future__ import annotations

import os
from typing import Sequence, Union

import torch

from magnetar.ops.call import validate_states

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]

_MERGE_BACKENDS = ("auto", "torch", "fused")


def _stack(xs: Tensors, name: str) -> torch.Tensor:
    if isinstance(xs, torch.Tensor):
        return xs
    if not isinstance(xs, (list, tuple)):
        raise ValueError(f"merge_states: {name} must be a list of tensors or one stacked tensor, got "
                         f"{type(xs).__name__}")
    if not xs:
        raise ValueError(f"merge_states: {name} is empty; pass at least one partial state")
    for i, x in enumerate(xs):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"merge_states: {name}[{i}] must be a torch.Tensor, got {type(x).__name__}")
        if x.shape != xs[0].shape or x.dtype != xs[0].dtype:
            raise ValueError(f"merge_states: every part of {name} must have one shape and dtype: {name}[0] is "
                             f"{tuple(xs[0].shape)} {xs[0].dtype}, {name}[{i}] is {tuple(x.shape)} {x.dtype}")
    return torch.stack(xs, dim=0)


def merge_states_torch(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference merge of stacked states: ``outs (N, B, H, S, D)``, ``lses (N, B, H, S)``.

    Returns ``out (B, H, S, D)`` in ``outs.dtype`` and ``lse (B, H, S)`` float32, under the module's rules
    for empty (``-inf``) and non-finite (NaN / ``+inf``) parts.
    """
    validate_states(outs, lses)
    lse = lses.float()
    empty = lse == float("-inf")  # parts that saw no key: their outs are never read
    bad = ~(empty | torch.isfinite(lse))  # NaN / +inf: non-finite input behind the part
    live = ~(empty | bad)
    lse = torch.where(live, lse, torch.full_like(lse, float("-inf")))
    m = lse.amax(dim=0)  # (B, H, S); -inf where no part is live
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m_safe)  # dead parts -> exp(-inf) = 0
    denom = w.sum(dim=0)
    # every live part's out is read, even with weight 0 (0 * NaN stays NaN, as in the fused op); the outs of
    # dead parts may hold garbage (NaN from a masked kernel row): never let them in
    zero = torch.zeros((), device=outs.device)
    acc = torch.where(live.unsqueeze(-1), w.unsqueeze(-1) * outs.float(), zero).sum(dim=0)
    no_live = denom == 0  # rows with no live part: acc is 0 there, so out = 0 / 1 = 0
    out = acc / torch.where(no_live, 1.0, denom).unsqueeze(-1)
    lse_out = torch.where(no_live, torch.full_like(m, float("-inf")), m_safe + torch.log(denom))
    poisoned = bad.any(dim=0)  # (B, H, S)
    out = out.masked_fill(poisoned.unsqueeze(-1), float("nan"))
    lse_out = lse_out.masked_fill(poisoned, float("nan"))
    return out.to(outs.dtype), lse_out


def prepare_merge(device) -> bool:
    """Build or load the fused merge op for ``device``'s type now, when ``merge_states(backend="auto")`` would
    use it, and say whether it will. The engine calls this at start: a first build (tens of seconds) inside a
    request would keep the other ranks waiting in a collective until its timeout."""
    from magnetar.ops import fused_merge  # local import: keeps the builder out of import time

    return os.environ.get("MAGNETAR_FUSED_MERGE", "1") != "0" and fused_merge.fused_merge_available(device)


def merge_states(outs: Tensors, lses: Tensors, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Merge N partial attention results of the same queries into the exact result over all their keys.

    Args:
        outs: list of N tensors ``(B, H, S, D)`` or one stacked ``(N, B, H, S, D)`` tensor (fp32/bf16/fp16).
        lses: list of N tensors ``(B, H, S)`` or one stacked ``(N, B, H, S)`` tensor; natural-log
            log-sum-exp of each part, float32 (other float dtypes are upcast).
        backend: ``"auto"`` (fused op when available, else torch), ``"torch"`` or ``"fused"`` (raises if the
            op cannot be built). ``MAGNETAR_FUSED_MERGE=0`` makes ``auto`` use torch, and so do inputs
            that require grad (the fused op has no backward).

    Returns:
        ``(out, lse)``: ``out (B, H, S, D)`` in the dtype of ``outs``, ``lse (B, H, S)`` float32;
        rows empty in every part give ``out = 0`` and ``lse = -inf``; a row with a NaN or ``+inf`` lse part
        gives ``(NaN, NaN)``; a NaN in a non-empty part's out stays NaN (module docstring).
    """
    if backend not in _MERGE_BACKENDS:
        raise ValueError(f"merge_states: backend must be one of {_MERGE_BACKENDS}, got {backend!r}")
    outs_t, lses_t = _stack(outs, "outs"), _stack(lses, "lses")
    validate_states(outs_t, lses_t)
    if backend == "torch":
        return merge_states_torch(outs_t, lses_t)
    from magnetar.ops import fused_merge  # local import: keeps the builder out of import time

    if backend == "fused":
        return fused_merge.fused_merge_states(outs_t, lses_t)
    if not (outs_t.requires_grad or lses_t.requires_grad) and prepare_merge(outs_t.device):  # no backward
        return fused_merge.fused_merge_states(outs_t, lses_t)
    return merge_states_torch(outs_t, lses_t)


def merge_requests(parts: list[list[tuple[torch.Tensor, torch.Tensor]]], like: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's states ``(B, H, S, D)``, ``(B, H, S)`` from each request's partial states (``parts[b]``: request b's
    ``(o, lse)`` per part, each ``(1, H, S, D)`` / ``(1, H, S)``; ``like``: the batch's queries, for the shape,
    dtype and device of a request with none -- the empty state ``(0, -inf)``): where every request has the same
    number of parts (a decode step: a context and its own tokens each), ONE merge for the whole batch -- the parts
    stacked request by request -- rather than a merge per request (a merge's per-call cost is most of what a decode
    step's merges cost)."""
    B, H, S, D = like.shape
    counts = {len(p) for p in parts}
    if B > 1 and len(counts) == 1 and counts != {0} and len({o.dtype for p in parts for o, _ in p}) == 1:
        n = counts.pop()
        if n == 1:
            return torch.cat([p[0][0] for p in parts]), torch.cat([p[0][1] for p in parts])
        return merge_states([torch.cat([p[i][0] for p in parts]) for i in range(n)],
                            [torch.cat([p[i][1] for p in parts]) for i in range(n)])
    states = []
    for p in parts:
        if not p:  # nothing held for the request: the empty state
            states.append((torch.zeros(1, H, S, D, dtype=like.dtype, device=like.device),
                           torch.full((1, H, S), float("-inf"), device=like.device)))
        else:
            states.append(p[0] if len(p) == 1 else merge_states([o for o, _ in p], [lse for _, lse in p]))
    if B == 1:
        return states[0]
    return torch.cat([o for o, _ in states]), torch.cat([lse for _, lse in states])
