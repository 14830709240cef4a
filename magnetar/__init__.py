"""Magnetar: long-context LLM inference with context-parallel prefill and distributed decode.

The primitives every attention strategy is built from:

* :func:`magnetar.ops.attention_with_lse` -- attention returning ``(out, lse)`` with position-based causality;
* :func:`magnetar.ops.merge_states` -- exact online-softmax merge of partial ``(out, lse)``;
* :func:`magnetar.parallel.init_groups`, :func:`magnetar.parallel.all_gather_states`,
  :func:`magnetar.parallel.ring_attention` -- context-parallel groups and collectives.
"""
from magnetar.version import __version__
from magnetar.config import EngineConfig
from magnetar.engine import Engine, GenerationResult, init_inference
from magnetar.ops import attention_with_lse, merge_states
from magnetar.parallel import ParallelGroups, all_gather_states, init_groups, ring_attention

__all__ = ["__version__", "EngineConfig", "Engine", "GenerationResult", "init_inference", "attention_with_lse",
           "merge_states", "ParallelGroups", "init_groups", "all_gather_states", "ring_attention"]
