"""The inference engine: template -> method plan -> Phase 1 -> KV shard -> Phase 2 -> decode loop.

Built from ``magnetar.parallel``, ``magnetar.ops``, ``magnetar.config`` and ``magnetar.models``; it knows the
strategies only through the protocols and registries of :mod:`magnetar.engine.strategy` (methods, decode and
prefill policies are imported by name, lazily). Hugging Face models are driven through transformers'
``AttentionInterface`` (:mod:`magnetar.engine.hf`), never modified.
"""
from magnetar.engine.engine import Engine, GenerationResult
from magnetar.engine.load import init_inference

__all__ = ["Engine", "GenerationResult", "init_inference"]
