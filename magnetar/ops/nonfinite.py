"""Non-finite attention inputs: a cheap check for the common finite case, and the exact path that makes every
backend give the same answer when q, k or v holds NaN or +-inf.

The rule (docs/design.md, "The (out, lse) contract"), for query row i and the keys it can see (positions
decide visibility, as everywhere):

* a non-finite value (NaN, +inf or -inf) in q row i, or in a key j visible to row i -> ``out[i] = NaN``
  (every element) and ``lse[i] = NaN``; +-inf is treated as NaN, never as a plausible score;
* a non-finite value in v of a key visible to row i -> ``out[i] = NaN`` (every element); ``lse[i]`` is the
  ordinary (finite) log-sum-exp of the row's scores;
* a row that sees no key is ``(0, -inf)`` whatever q holds (nothing was computed from it), and a non-finite
  key no query row can see changes nothing (it is masked).

Backends cannot be trusted to do this on their own: torch's fused CPU kernel adds the mask to the scores, so a
NaN key poisons rows its mask hides it from (and under ``is_causal`` vanishes from rows that see it), and it
returns ``lse = 0`` for a NaN query row; every ``p @ v`` spreads a masked NaN value through ``0 * NaN``. So the
front end (:func:`magnetar.ops.attention.attention_with_lse`) runs the backend as usual and then calls
:func:`fast_path_finite`; only if that fails does :func:`attend_nonfinite` recompute on inputs whose non-finite
values are zeroed and overwrite the affected rows from the rule above.

This module knows the attention call and its visibility rule; it knows no backend, rank or model.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from magnetar.ops.call import FULL, AttentionCall

_NEVER = torch.iinfo(torch.long).max  # position of an unmarked key: after every query


def finite_flag(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on ``t``'s device: every element of ``t`` is finite. No host sync, and no temporary the
    size of ``t``: one ``aminmax`` reduction (NaN propagates through min and max, +-inf shows in one of them)."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    lo, hi = torch.aminmax(t.detach())
    return torch.isfinite(lo) & torch.isfinite(hi)


def finite_sum_dtype(t: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype a finiteness sum of ``t`` runs in: its own where it has float32's range (bfloat16, float32, float64:
    torch sums bfloat16 in float32 and rounds once -- a tenth of the time of asking for a float32 result, which
    made a cast copy of a 1000-token query's q first), float32 for float16 (whose sums overflow at 65504)."""
    return torch.float32 if t.dtype == torch.float16 else None


def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether every element of every tensor is finite, with one device-to-host sync: the tensors' sums (in the
    dtype of :func:`finite_sum_dtype`) added up and tested once. A NaN or +-inf anywhere makes the total non-finite;
    finite values whose sum overflows make it non-finite too -- a false alarm that only sends the caller down its
    exact (slower) path, never a missed one. One reduction per tensor and one scalar test: the per-call cost of a
    decode step's many small attention calls (issue 33's profile: a min/max pass and four scalar ops per tensor were
    a sixth of a batch-8 step). On the CPU each sum is tested as it comes (reading it waits on nothing)."""
    total = None
    for t in tensors:
        if t.numel() == 0:
            continue
        part = t.detach().sum(dtype=finite_sum_dtype(t))
        if t.device.type == "cpu":  # a CPU scalar is read without waiting on anything: each sum is tested as it
            if not math.isfinite(part.item()):  # comes (half the per-call cost of adding them up first)
                return False
            continue
        part = part.float() if part.dtype != torch.float64 else part  # bfloat16 sums added in float32
        total = part if total is None else total + part.to(total.dtype)
    return True if total is None else math.isfinite(total.item())


def fast_path_finite(call: AttentionCall, out: torch.Tensor, check_k: bool = True) -> bool:
    """The fast-path check: q and k finite, and the backend's ``out`` finite. ``check_k=False``: the caller
    knows k is finite (a frozen context shard checked once: :meth:`magnetar.engine.kv.LayerKV.keys_finite`).

    v is never read here: with q and k finite, a non-finite value in v of a *visible* key reaches ``out``
    through ``p @ v`` (even with ``p = 0``: ``0 * NaN`` and ``0 * inf`` are NaN), so the exact path runs; one
    in a *masked* key either stays out (the result is right as it is) or is spread by ``0 * NaN`` into
    ``out`` (then the exact path runs). ``out`` is the size of q, so the check reads q, k and out once.
    """
    return all_finite(call.q, call.k, out) if check_k else all_finite(call.q, out)


def _rows_seeing(call: AttentionCall, marked: torch.Tensor) -> torch.Tensor:
    """Whether query row i sees at least one marked key: ``marked (B|1, Hkv|1, Sk)`` -> ``(B|1, Hkv|1, Sq)``.

    Without an ``Sq x Sk`` mask: the marked keys' positions are sorted and each query counts those in its
    visible interval ``(q_pos - window, q_pos]`` with two binary searches.
    """
    Sq = call.q.shape[2]
    if call.mask_kind == FULL:
        return marked.any(dim=-1, keepdim=True).expand(*marked.shape[:-1], Sq)
    kp, qp = call.k_pos, call.q_pos
    kp = kp.view(1, 1, -1) if kp.dim() == 1 else kp.unsqueeze(1)
    qp = qp.view(1, 1, -1) if qp.dim() == 1 else qp.unsqueeze(1)
    ranked = torch.where(marked, kp, torch.full_like(kp, _NEVER)).sort(dim=-1).values
    lead = torch.broadcast_shapes(ranked.shape[:-1], qp.shape[:-1])
    ranked = ranked.expand(*lead, ranked.shape[-1]).contiguous()
    qp = qp.expand(*lead, Sq).contiguous()
    hi = torch.searchsorted(ranked, qp, right=True)  # marked keys at positions <= q_pos
    if call.window is None:
        return hi > 0
    return hi > torch.searchsorted(ranked, qp - call.window, right=True)


def _per_query_head(rows: torch.Tensor, call: AttentionCall) -> torch.Tensor:
    """``(.., Hkv|1, Sq)`` -> ``(.., Hq|1, Sq)``: query head h reads KV head h // G."""
    return rows if rows.shape[1] == 1 else rows.repeat_interleave(call.group, dim=1)


def _bad_rows(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, S, D)`` -> ``(B, H, S)``: rows holding a non-finite value."""
    return ~torch.isfinite(x).all(dim=-1)


def attend_nonfinite(
    call: AttentionCall,
    attend: Callable[[AttentionCall], tuple[torch.Tensor, torch.Tensor]],
    fast: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact result under the module's rule, for a call whose inputs (or fast result) are not all finite.

    ``attend(call) -> (out, lse)`` is the front end's finite path. It is re-run on a copy of the call whose
    non-finite q/k/v values are zeroed (so nothing masked can leak), then the rows the rule names are set to
    NaN. ``fast`` is the result of the finite path on the original call: returned as is when q, k and v turn
    out to be finite (a non-finite ``out`` from finite inputs, e.g. an overflow, is the backend's answer).
    """
    q, k, v = call.q, call.k, call.v
    bad_q, bad_k, bad_v = _bad_rows(q), _bad_rows(k), _bad_rows(v)
    any_q, any_k, any_v = bool(bad_q.any()), bool(bad_k.any()), bool(bad_v.any())
    if fast is not None and not (any_q or any_k or any_v):
        return fast
    zeroed = AttentionCall(
        q.nan_to_num(0.0, 0.0, 0.0) if any_q else q,
        k.nan_to_num(0.0, 0.0, 0.0) if any_k else k,
        v.nan_to_num(0.0, 0.0, 0.0) if any_v else v,
        call.q_pos, call.k_pos, call.scale, call.mask_kind, call.window,
    )
    out, lse = attend(zeroed)
    poisoned = torch.zeros((1, 1, q.shape[2]), dtype=torch.bool, device=q.device)  # (B|1, Hq|1, Sq)
    if any_k:
        poisoned = poisoned | _per_query_head(_rows_seeing(call, bad_k), call)
    if any_q:  # a NaN query row that sees no key stays (0, -inf): nothing was computed from it
        sees_any = _rows_seeing(call, torch.ones((1, 1, k.shape[2]), dtype=torch.bool, device=q.device))
        poisoned = poisoned | (bad_q & sees_any)
    nan_out = poisoned
    if any_v:
        nan_out = nan_out | _per_query_head(_rows_seeing(call, bad_v), call)
    out = out.masked_fill(nan_out.unsqueeze(-1), float("nan"))
    lse = lse.masked_fill(poisoned, float("nan"))
    return out, lse
