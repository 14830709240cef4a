"""The inference engine: template -> block plan -> Phase 1 -> KV shard -> Phase 2 -> decode loop.

Built from ``magnetar.parallel`` and ``magnetar.ops`` only; Hugging Face models are driven through
transformers' ``AttentionInterface`` (:mod:`magnetar.engine.hf`), never modified.
"""
from magnetar.engine.engine import Engine, GenerationResult, init_inference

__all__ = ["Engine", "GenerationResult", "init_inference"]
