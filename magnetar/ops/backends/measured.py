"""Which attention backend ``auto`` tries first on a given card, from what the GPU kit measured (issue 48, item 1).

``AUTO_ORDER`` (:mod:`magnetar.ops.backends`) is one order for every machine; the fastest mask-free kernel differs by
card (FlashAttention-2 in torch, cuDNN's fused attention, FlexAttention, the flash-attn package). The GPU kit's
``kernels`` step times each at Phase 1's causal square and prints the order it measured; that order goes into
:data:`MEASURED` under the card's name, and ``auto`` then tries those backends first on that card (the rest of
``AUTO_ORDER`` after them, so a backend that refuses a call still falls through). ``MAGNETAR_ATTENTION_ORDER``
(comma-separated backend names) puts its backends first on any device, for a user who measured their own card.
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch

ENV = "MAGNETAR_ATTENTION_ORDER"

# card name (a substring of torch.cuda.get_device_name) -> backends fastest first at a 32K-128K causal square, as the
# GPU kit's kernels step printed them; empty until a lent card has run that step
MEASURED: dict[str, tuple[str, ...]] = {}


@functools.lru_cache(maxsize=None)
def _card(index: int) -> str:
    return torch.cuda.get_device_name(index)


def preferred(device: torch.device, registered: Callable[[], list[str]]) -> tuple[str, ...]:
    """The backends ``auto`` tries first for calls on ``device``: ``MAGNETAR_ATTENTION_ORDER``'s (each checked
    against ``registered()``, once per value: an unknown name is a ValueError naming it), else the measured order of
    this card (:data:`MEASURED`), else none. Asked on every ``auto`` call: nothing here sorts or parses twice."""
    text = os.environ.get(ENV, "")
    if text.strip():
        return _named(text, registered)
    if device.type != "cuda" or not MEASURED:
        return ()
    card = _card(device.index if device.index is not None else torch.cuda.current_device())
    return next((order for key, order in MEASURED.items() if key in card), ())


@functools.lru_cache(maxsize=8)
def _named(text: str, registered: Callable[[], list[str]]) -> tuple[str, ...]:
    """``MAGNETAR_ATTENTION_ORDER``'s backends, each a registered one."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    known = registered()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{ENV}={text.strip()!r}: unknown attention backend(s) {unknown}; choose from {known}")
    return names
