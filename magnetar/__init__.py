"""Magnetar: long-context LLM inference with context-parallel prefill and distributed decode.

The primitives every attention strategy is built from:

* :func:`magnetar.ops.attention_with_lse` -- attention returning ``(out, lse)`` with position-based causality;
* :func:`magnetar.ops.merge_states` -- exact online-softmax merge of partial ``(out, lse)``;
* :func:`magnetar.parallel.init_groups`, :func:`magnetar.parallel.all_gather_states`,
  :func:`magnetar.parallel.ring_attention` -- context-parallel groups and collectives.

The names below are imported when first used (PEP 562): ``import magnetar`` itself imports neither torch nor the
engine, so a command's ``--help`` or a flag's error comes before seconds of imports (``magnetar --help``).
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

from magnetar.version import __version__

# name -> the module that defines it
_LAZY = {"EngineConfig": "magnetar.config", "Engine": "magnetar.engine", "GenerationResult": "magnetar.engine",
         "init_inference": "magnetar.engine", "attention_with_lse": "magnetar.ops", "merge_states": "magnetar.ops",
         "ParallelGroups": "magnetar.parallel", "init_groups": "magnetar.parallel",
         "all_gather_states": "magnetar.parallel", "ring_attention": "magnetar.parallel"}

__all__ = ["__version__", "EngineConfig", "Engine", "GenerationResult", "init_inference", "attention_with_lse",
           "merge_states", "ParallelGroups", "init_groups", "all_gather_states", "ring_attention"]

if TYPE_CHECKING:  # what type checkers and IDEs see
    from magnetar.config import EngineConfig
    from magnetar.engine import Engine, GenerationResult, init_inference
    from magnetar.ops import attention_with_lse, merge_states
    from magnetar.parallel import ParallelGroups, all_gather_states, init_groups, ring_attention


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        if not name.startswith("_") and importlib.util.find_spec(f"magnetar.{name}") is not None:
            return importlib.import_module(f"magnetar.{name}")  # a subpackage (magnetar.engine), as before
        raise AttributeError(f"module 'magnetar' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups are plain attributes
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
