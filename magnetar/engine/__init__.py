"""The inference engine (tokenize/template -> block plan -> Phase 1 -> KV shard -> Phase 2 -> decode).

Not built yet: it is the next issue (Star, Pulsar, Ring and dense inference for Hugging Face models). It will
be composed from ``magnetar.parallel`` and ``magnetar.ops`` only.
"""
