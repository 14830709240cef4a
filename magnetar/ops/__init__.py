"""Attention kernels with the ``(out, lse)`` contract, the state merge, and the fused-op builders.

``attention_with_lse`` and ``merge_states`` are the two primitives every attention strategy is built from.
This package knows nothing about process groups, models or engines.
"""
from magnetar.ops.attention import attention_with_lse
from magnetar.ops.backends import explain, list_backends, register_backend
from magnetar.ops.merge import merge_states, merge_states_torch

__all__ = ["attention_with_lse", "merge_states", "merge_states_torch", "list_backends", "register_backend", "explain"]
