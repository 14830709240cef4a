"""Command-line helpers shared by the evaluation CLIs (runner, cost model, benchmark, experiments).

Knows the length notation (``4k``) and how the benchmark-style flags (``--block-size`` ...) become an
:class:`~magnetar.config.EngineConfig`; nothing about suites, engines or results.
"""
from __future__ import annotations

from magnetar.config import EngineConfig

__all__ = ["engine_config", "parse_length"]


def parse_length(text: str) -> int:
    """``"4k"`` -> 4096, ``"1m"`` -> 1048576 (k = 1024 tokens), ``"3000"`` -> 3000."""
    t = text.strip().lower()
    scale = {"k": 1024, "m": 1024 * 1024}.get(t[-1:], 1)
    return int(float(t[:-1]) * scale) if scale > 1 else int(t)


def engine_config(args, method: str, cp: int) -> EngineConfig:
    """The EngineConfig of ``method`` from the command line's engine options (``magnetar-bench`` and the cost
    model's CLI): ``cp`` ranks for the context-parallel methods, one for dense and streaming."""
    flat = dict(method=method, cp_size=1 if method in ("dense", "streaming") else cp, dtype=args.dtype,
                deepspeed_inference=getattr(args, "deepspeed", False))
    for name in ("block_size", "anchor_size", "sink_size", "chunk_size", "summary_budget", "window_size",
                 "attention_backend"):
        if getattr(args, name, None) is not None:
            flat[name] = getattr(args, name)
    return EngineConfig.create(**flat)
