"""The shared vocabulary of the ops package: the attention call as backends see it, and the merge-state checks.

``attention_with_lse`` (:mod:`magnetar.ops.attention`) builds an :class:`AttentionCall` and hands it to a
backend (:mod:`magnetar.ops.backends`); ``merge_states`` (:mod:`magnetar.ops.merge`) and the fused op
(:mod:`magnetar.ops.fused_merge`) both check their stacked inputs with :func:`validate_states`. Keeping these
here lets the front ends import their implementations and never the other way round.

This module knows only torch: no backend, no kernel, nothing about ranks or models.
"""
from __future__ import annotations

from typing import Optional

import torch

# Mask kinds, from cheapest to most general:
FULL = "full"  # every key visible to every query: no mask at all
CAUSAL_BOTTOM_RIGHT = "causal_bottom_right"  # keys 0..Sk-1, queries are the last Sq of them (Sq <= Sk)
POSITIONS = "positions"  # general: build the mask from q_pos / k_pos


class AttentionCall:
    """A validated attention request, as backends see it (treat as read-only).

    ``q (B, Hq, Sq, D)``, ``k, v (B, Hkv, Sk, D)`` share a dtype and device. ``q_pos``/``k_pos`` are int64 on
    q's device, 1-D ``(S,)`` (shared by the batch) or 2-D ``(B, S)``; when the caller gave none they are
    created on first access (the mask-free fast paths never touch them).
    ``mask_kind`` is one of FULL, CAUSAL_BOTTOM_RIGHT, POSITIONS (see :mod:`magnetar.ops.attention`); for FULL
    and CAUSAL_BOTTOM_RIGHT no query row is empty, and for CAUSAL_BOTTOM_RIGHT the positions are the defaults.
    """

    __slots__ = ("q", "k", "v", "scale", "mask_kind", "window", "_q_pos", "_k_pos")

    def __init__(self, q, k, v, q_pos: Optional[torch.Tensor], k_pos: Optional[torch.Tensor], scale: float,
                 mask_kind: str, window: Optional[int] = None):
        self.q, self.k, self.v = q, k, v
        self._q_pos, self._k_pos = q_pos, k_pos
        self.scale, self.mask_kind = scale, mask_kind
        self.window = window  # sliding window (POSITIONS kind only): also require k_pos > q_pos - window

    @property
    def q_pos(self) -> torch.Tensor:
        if self._q_pos is None:
            sq, sk = self.q.shape[2], self.k.shape[2]
            self._q_pos = torch.arange(sk - sq, sk, device=self.q.device)
        return self._q_pos

    @property
    def k_pos(self) -> torch.Tensor:
        if self._k_pos is None:
            self._k_pos = torch.arange(self.k.shape[2], device=self.q.device)
        return self._k_pos

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.k.shape[1]

    def visible(self, q_pos: Optional[torch.Tensor] = None, k_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Boolean visibility ``(1 or B, 1, Sq', Sk')`` for the given (default: all) positions."""
        qp = self.q_pos if q_pos is None else q_pos
        kp = self.k_pos if k_pos is None else k_pos
        vis = kp.unsqueeze(-2) <= qp.unsqueeze(-1)  # (.., Sq, Sk)
        if self.window is not None:
            vis &= kp.unsqueeze(-2) > qp.unsqueeze(-1) - self.window
        return vis.unsqueeze(-3) if vis.dim() == 3 else vis.view(1, 1, *vis.shape)


def validate_states(outs: torch.Tensor, lses: torch.Tensor) -> None:
    """The shape/device/dtype checks every merge shares: ``outs (N, B, H, S, D)`` floating, ``lses (N, B, H, S)``
    floating.

    Raises ``ValueError`` naming the argument and what to change.
    """
    for name, t in (("outs", outs), ("lses", lses)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"merge_states: {name} must be a torch.Tensor, got {type(t).__name__}")
    if outs.dim() != 5:
        raise ValueError(
            f"merge_states: outs must be a list of (B, H, S, D) tensors or one stacked (N, B, H, S, D) tensor; "
            f"got shape {tuple(outs.shape)}"
        )
    if lses.shape != outs.shape[:-1]:
        raise ValueError(
            f"merge_states: lses must have shape (N, B, H, S) = {tuple(outs.shape[:-1])} to match outs "
            f"{tuple(outs.shape)}; got {tuple(lses.shape)}"
        )
    if outs.shape[0] == 0:
        raise ValueError("merge_states: got N = 0 partial states; pass at least one")
    if outs.device != lses.device:
        raise ValueError(f"merge_states: outs on {outs.device} but lses on {lses.device}; move both to one device")
    if not outs.is_floating_point():
        raise ValueError(
            f"merge_states: outs must be a floating dtype (float32, bfloat16, float16 or float64), got {outs.dtype}"
        )
    if not lses.is_floating_point():
        raise ValueError(f"merge_states: lses must be a floating dtype (log-sum-exp, float32 by contract), got "
                         f"{lses.dtype}")
