"""The sparse-prefill budget: a top-k schedule over input length, and the causal token-pair sparsity it gives.

Pure Python (no torch): :mod:`magnetar.config` validates ``prefill_schedule`` with :func:`parse_schedule`.

Sparsity accounting (paper Sec. 5.1): for a sequence of ``S`` tokens, causal dense attention has
``S (S + 1) / 2`` valid (query, key) pairs; a per-query top-k support keeps ``min(k, t + 1)`` keys for the
query at position ``t``, i.e. ``k S - k (k - 1) / 2`` pairs when ``k <= S``. The reported sparsity is the
fraction of causal pairs dropped -- a token-pair fraction, not a FLOP, memory or latency fraction.
Worked example (Table 2): ``S = 4096, k = 256`` keeps 1,015,936 of 8,390,656 pairs: sparsity 87.9 %.
"""
from __future__ import annotations

from typing import Optional, Sequence

# Sec. 5.1 / Table 2: 256 / 512 / 1024 / 2048 for 4K / 8K / 16K / >= 32K tokens
PAPER_SCHEDULE = "4096:256,8192:512,16384:1024,*:2048"

Schedule = tuple[tuple[Optional[int], int], ...]


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


def parse_schedule(text: str) -> Schedule:
    """``"4096:256,8192:512,*:2048"`` -> ``((4096, 256), (8192, 512), (None, 2048))``.

    Entries ``MAX_LEN:K`` with strictly increasing ``MAX_LEN``, then one ``*:K`` for every longer input; a
    length ``L`` gets the ``K`` of the first entry with ``L <= MAX_LEN``. Raises ValueError on anything else.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"a schedule is 'MAX_LEN:K,...,*:K', got {text!r}")
    out: list[tuple[Optional[int], int]] = []
    for part in text.split(","):
        bound, sep, k = part.strip().partition(":")
        if not sep:
            raise ValueError(f"schedule entry {part.strip()!r} is not 'MAX_LEN:K' (e.g. '4096:256' or '*:2048')")
        try:
            kk = int(k)
            length = None if bound.strip() == "*" else int(bound)
        except ValueError:
            raise ValueError(f"schedule entry {part.strip()!r}: MAX_LEN must be an int or '*', K an int") from None
        if kk < 1 or (length is not None and length < 1):
            raise ValueError(f"schedule entry {part.strip()!r}: MAX_LEN and K must be >= 1")
        if out and out[-1][0] is None:
            raise ValueError(f"schedule {text!r}: the '*:K' entry must come last")
        if length is not None and out and length <= out[-1][0]:
            raise ValueError(f"schedule {text!r}: MAX_LEN values must increase ({out[-1][0]} then {length})")
        out.append((length, kk))
    if out[-1][0] is not None:
        raise ValueError(f"schedule {text!r} must end with a '*:K' entry for inputs longer than {out[-1][0]}")
    return tuple(out)


def budget_for_length(L: int, schedule: Sequence[tuple[Optional[int], int]] | str) -> int:
    """The top-k the schedule gives a ``L``-token input: the first entry with ``L <= MAX_LEN`` (``None``: any)."""
    sched = parse_schedule(schedule) if isinstance(schedule, str) else tuple(schedule)
    for length, k in sched:
        if length is None or L <= length:
            return int(k)
    raise ValueError(f"the schedule {sched} has no entry for {L} tokens; end it with (None, K) ('*:K')")
