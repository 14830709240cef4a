"""``runtime.check_finite``: a request whose activations turn NaN/inf fails with an error that says where,
instead of decoding plausible tokens from garbage.

Each forward records, per layer and without a device sync, whether its attention output holds a non-finite
value (its float64 sum, :class:`LayerFlags`); the phase drivers read the
record once: Phase 1 after the rank's last segment (the ranks then agree through the collective that already checks
the block plan), Phase 2 only when a step's logits are not finite (every rank sees the same logits, so every rank
takes that path and they gather their records). The error names the phase, the step, the first layer and the CP rank
where it began.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from magnetar.ops.nonfinite import finite_flag, finite_sum_dtype


class NonFiniteError(FloatingPointError):
    """A step of the engine produced NaN/inf; the message names the phase, layer and CP rank."""


HINT = ("the model's weights, its inputs or the KV hold NaN/inf (float16 overflow is a common cause: try "
        "--dtype bfloat16 or float32); --check-finite false turns this check off")


_READ_ELEMENTS = 1 << 16  # a CPU output this large is summed in its own dtype and read at once (LayerFlags)


class LayerFlags:
    """Per-layer "non-finite attention output seen" flags of one rank, kept on the device: each layer's outputs
    summed in float64. Exact for float32 / bfloat16 / float16 outputs (a sum of their finite values cannot reach
    float64's range, so the sum is non-finite exactly when an element is: a flag that raises may not false-alarm);
    two ops a layer where a min/max test took eight (about 2 % of a CPU decode step). A float64 output is tested
    with :func:`~magnetar.ops.nonfinite.finite_flag` (its finite values could overflow a sum). On a CPU, an output of
    at least :data:`_READ_ELEMENTS` elements (a query forward's or a Phase 1's -- a decode step's keep their one read
    of the device a step) is summed in its own dtype (:func:`~magnetar.ops.nonfinite.finite_sum_dtype`: no float64
    copy of a 1000-token query's output) and read at once; only a non-finite sum -- an element, or an overflow -- is
    decided by ``finite_flag``: as exact, without the copy."""

    def __init__(self, num_layers: int, device):
        self.sums = torch.zeros(num_layers, dtype=torch.float64, device=device)
        self._rows = self.sums.unbind()  # a view per layer, made once

    def record(self, layer: int, out: torch.Tensor) -> None:
        """Add layer ``layer``'s output (no device sync)."""
        if out.dtype != torch.float64:
            if out.device.type != "cpu" or out.numel() < _READ_ELEMENTS:
                self._rows[layer].add_(out.detach().sum(dtype=torch.float64))
                return
            if math.isfinite(out.detach().sum(dtype=finite_sum_dtype(out)).item()):
                return  # every element finite: nothing to add
        self._rows[layer].add_(torch.where(finite_flag(out), 0.0, float("nan")))  # the exact element test

    def first(self) -> Optional[int]:
        """The first flagged layer (one device sync), or None."""
        bad = torch.nonzero(~torch.isfinite(self.sums)).flatten()
        return int(bad[0]) if bad.numel() else None


def describe(per_rank: list[Optional[int]]) -> str:
    """``"layer 3 on CP rank 1"`` for the earliest flagged layer over the ranks (``per_rank[r]``: rank r's)."""
    flagged = [(layer, r) for r, layer in enumerate(per_rank) if layer is not None]
    if not flagged:
        return "no attention output was non-finite (the non-finite values arose after the last attention)"
    layer, rank = min(flagged)
    others = ", ".join(f"rank {r}: layer {lay}" for lay, r in sorted(flagged) if r != rank)
    return f"the first non-finite attention output is layer {layer} on CP rank {rank}" + \
        (f" (also {others})" if others else "")
