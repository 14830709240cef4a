"""Split a position-masked attention call into mask-free pieces when positions come in a few contiguous runs.

Context-parallel attention produces positions made of a few contiguous runs: a Star block is
``[anchor 0..A) ++ [b0..b0+L)`` with queries ``[b0..b0+L)``; a zigzag ring shard is two runs; a Phase-2
query sits after every key. For one query run ``Q = [qa..qz]`` and one key run ``K = [ka..kz]`` (positions,
consecutive) the causal mask ``k <= q`` is always a combination of at most three mask-free pieces:

    keys <  qa                 visible to every query of Q            -> FULL piece
    keys in [qa, min(kz, qz)]  a square causal block with the queries
                               at the same positions                  -> CAUSAL square piece
                               and fully visible to later queries     -> FULL piece
    keys > qz                  invisible                              -> skipped

Worked example, Star block 1 with anchor 0..3 and block 8..11 (q = k[4:]):
    q run [8..11] x k run [0..3]  -> FULL (q rows 0..3, k cols 0..3)
    q run [8..11] x k run [8..11] -> CAUSAL square (q rows 0..3, k cols 4..7)

Mask-free pieces let every backend use its fastest path (no Sq x Sk mask, no compute on masked blocks, and
FlashAttention can serve them). Pieces are merged with :func:`magnetar.ops.merge.merge_states`.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

MAX_RUN_PAIRS = 64  # beyond this many (q run, k run) pairs the explicit mask is cheaper than the pieces


class Piece(NamedTuple):
    """Rows ``[q0, q1)`` of q attend to keys ``[k0, k1)``; ``causal``: square bottom-right causal, else full."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def index_causal(q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
    """Whether the causal position mask is the bottom-right causal mask of the indices: the key positions strictly
    increase and query ``i`` sees exactly the first ``Sk - Sq + i + 1`` keys. So it is for a segment's own tokens
    attending to themselves in position order, whatever gaps the positions have -- Pulsar's sink, summaries and
    block (dozens of runs), Star's anchor and block, a zigzag shard --: one mask-free causal call, at dense's rate,
    instead of a position mask or several pieces. One reading of the device (1-D positions only)."""
    if q_pos.dim() != 1 or k_pos.dim() != 1:
        return False
    sq, sk = q_pos.shape[0], k_pos.shape[0]
    if not 0 < sq <= sk:
        return False
    seen = torch.searchsorted(k_pos, q_pos.to(k_pos.device), right=True)  # keys at or before each query (k sorted)
    ok = (seen == torch.arange(sk - sq + 1, sk + 1, device=k_pos.device)).all()
    if sk > 1:
        ok &= (k_pos[1:] > k_pos[:-1]).all()  # else searchsorted's answer means nothing
    return bool(ok)


def contiguous_runs(pos: torch.Tensor, limit: int) -> Optional[list[tuple[int, int, int]]]:
    """Runs of consecutive positions as ``(start index, end index, first position)``; None if more than ``limit``."""
    n = pos.shape[0]
    if n == 0:
        return []
    breaks = (pos[1:] != pos[:-1] + 1).nonzero().flatten()
    if breaks.numel() + 1 > limit:
        return None
    starts = [0] + (breaks + 1).tolist()
    ends = starts[1:] + [n]
    firsts = pos[starts].tolist()
    return list(zip(starts, ends, firsts))


def plan_pieces(q_pos: torch.Tensor, k_pos: torch.Tensor, max_pairs: Optional[int] = None) -> Optional[list[Piece]]:
    """Mask-free pieces equivalent to the causal position mask, or None when positions are too fragmented.

    Only 1-D positions are planned (per-sequence positions take the mask path). ``max_pairs`` defaults to
    ``MAX_RUN_PAIRS``; 0 disables planning.
    """
    max_pairs = MAX_RUN_PAIRS if max_pairs is None else max_pairs
    if q_pos.dim() != 1 or k_pos.dim() != 1 or max_pairs <= 0:
        return None
    q_runs = contiguous_runs(q_pos, max_pairs)
    if q_runs is None:
        return None
    k_runs = contiguous_runs(k_pos, max(1, max_pairs // max(1, len(q_runs))))
    if k_runs is None:
        return None
    pieces = []
    for qs, qe, qa in q_runs:
        qz = qa + (qe - qs) - 1
        for ks, ke, ka in k_runs:
            kz = ka + (ke - ks) - 1
            if ka > qz:
                continue  # every key in the future of every query
            full_end = min(kz, qa - 1)  # keys ka..full_end lie before every query: visible to all of Q
            if full_end >= ka:
                pieces.append(Piece(qs, qe, ks, ks + (full_end - ka) + 1, False))
            lo, hi = max(ka, qa), min(kz, qz)  # keys in [qa, qz]: causal w.r.t. the queries at those positions
            if lo > hi:
                continue
            k0, k1 = ks + (lo - ka), ks + (hi - ka) + 1
            q_lo, q_hi = qs + (lo - qa), qs + (hi - qa) + 1  # queries at the same positions: square causal
            pieces.append(Piece(q_lo, q_hi, k0, k1, True))
            if q_hi < qe:
                pieces.append(Piece(q_hi, qe, k0, k1, False))  # later queries see all of these keys
    return pieces
