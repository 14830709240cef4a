"""Phase-1 context methods, one module each (dense, star, pulsar + its summaries, ring, streaming).

Each module defines one :class:`magnetar.engine.strategy.ContextMethod`; the engine finds it by name through
the registry in :data:`magnetar.config.METHODS` and imports it lazily. Nothing here is imported by the engine.
"""
