"""Section timing for latency breakdowns: :class:`SectionTimer` and the do-nothing :func:`no_timer`.

A timer is any callable ``timer(name) -> context manager``; code that can be profiled takes an optional
``timer`` and falls back to :func:`no_timer` (``timer = timer or no_timer``). This module knows nothing of the
engine or of any strategy; it only measures wall time.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch


class SectionTimer:
    """Wall time per named section (``with timer("refine"): ...``), synchronising CUDA around each section so
    GPU work is charged to the section that queued it. For latency breakdowns only: it serialises the GPU.

    ``seconds``: ``{section name: total seconds}`` summed over every entry of that section."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str):
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize()
            self.seconds[name] += time.perf_counter() - t0


def no_timer(name: str) -> contextlib.nullcontext:
    """The timer that measures nothing: ``with no_timer("section"): ...`` costs one object."""
    return contextlib.nullcontext()
