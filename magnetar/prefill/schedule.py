"""The sparse-prefill budget: a top-k schedule over input length, and the causal token-pair sparsity it gives.

Pure Python (no torch). The schedule parser lives in :mod:`magnetar.config` (a leaf, which validates
``prefill_schedule`` with it) and is re-exported here beside the sparsity accounting.

Sparsity accounting (paper Sec. 5.1): for a sequence of ``S`` tokens, causal dense attention has
``S (S + 1) / 2`` valid (query, key) pairs; a per-query top-k support keeps ``min(k, t + 1)`` keys for the
query at position ``t``, i.e. ``k S - k (k - 1) / 2`` pairs when ``k <= S``. The reported sparsity is the
fraction of causal pairs dropped -- a token-pair fraction, not a FLOP, memory or latency fraction.
Worked example (Table 2): ``S = 4096, k = 256`` keeps 1,015,936 of 8,390,656 pairs: sparsity 87.9 %.
"""
from __future__ import annotations

from magnetar.config import PAPER_SCHEDULE, Schedule, budget_for_length, parse_schedule  # noqa: F401  (one parser)


def causal_pairs(S: int) -> int:
    """Valid (query, key) pairs of causal dense attention over ``S`` tokens: ``S (S + 1) / 2``."""
    return S * (S + 1) // 2


def topk_pairs(S: int, k: int) -> int:
    """Pairs a per-query top-``k`` support keeps over ``S`` tokens: ``k S - k (k - 1) / 2`` (all if ``k >= S``)."""
    if k >= S:
        return causal_pairs(S)
    return k * S - k * (k - 1) // 2


def causal_pair_sparsity(S: int, k: int) -> float:
    """Fraction of causal token pairs a per-query top-``k`` support drops (paper Sec. 5.1); 0 when ``k >= S``."""
    if not (isinstance(S, int) and S >= 1):
        raise ValueError(f"causal_pair_sparsity: S must be an int >= 1 tokens, got {S!r}")
    if not (isinstance(k, int) and k >= 1):
        raise ValueError(f"causal_pair_sparsity: k must be an int >= 1 (prefill_topk / --prefill-topk), got {k!r}")
    return 1.0 - topk_pairs(S, k) / causal_pairs(S)
