"""The registries and choice tables of the config: methods by name (what config validates and which module
implements each), the policies' implementations by section, and the values of every string field with a fixed set.
Nothing here imports a strategy module: the engine imports them lazily by these names."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MethodSpec:
    """What the configuration must know of a Phase-1 context method, without importing it.

    ``impl`` is its :class:`magnetar.engine.strategy.ContextMethod` as ``"module:Class"``, imported lazily by the
    engine; ``distributed``: it spreads one context over the CP group (else it runs on one rank, cp_size 1);
    ``local_prefill``: its Phase 1 is causal attention over ``[prefix ‖ block]`` segments on each rank, which
    LuKA's attention mass and sparse prefill build on.
    """

    impl: str
    distributed: bool
    local_prefill: bool


# The registry of Phase-1 methods: adding a method is its module in magnetar/methods/ plus one line here.
METHODS: dict[str, MethodSpec] = {
    "dense": MethodSpec("magnetar.methods.dense:DenseMethod", distributed=False, local_prefill=True),
    "ring": MethodSpec("magnetar.methods.ring:RingMethod", distributed=True, local_prefill=False),
    "star": MethodSpec("magnetar.methods.star:StarMethod", distributed=True, local_prefill=True),
    "pulsar": MethodSpec("magnetar.methods.pulsar:PulsarMethod", distributed=True, local_prefill=True),
    "streaming": MethodSpec("magnetar.methods.streaming:StreamingMethod", distributed=False, local_prefill=False),
}
DISTRIBUTED_METHODS = tuple(n for n, s in METHODS.items() if s.distributed)

SCORERS = ("max_idf", "tfidf", "bm25", "entropy", "even")
POSITION_MODES = ("sparse", "contiguous")
DTYPES = ("float32", "bfloat16", "float16", "auto")  # auto: the checkpoint's (or a given model's) dtype, not cast
SPARSE_POLICIES = ("none", "oracle_topk", "lsh", "spotlight", "quest")
LUKA_MODES = ("none", "lined", "clustered", "mixed")
LUKA_COMPRESSORS = ("attention_weighted", "mean", "random")
LUKA_REFINE = ("top_k", "top_fraction", "threshold", "none")
LUKA_REFINE_MASS = ("exact", "preserve")
LUKA_REFINE_SCOPE = ("shared", "per_kv_head")
# When LuKA starts: the question read exactly, pages cut right after it (the paper) / after luka_compress_every
# generated tokens (the authors' code) / before it (Magnetar's earlier behaviour); see LukaConfig
LUKA_REGIMES = ("after_query", "after_generation", "before_query")
LUKA_METHODS = tuple(n for n, s in METHODS.items() if s.local_prefill)  # LuKA needs Phase-1 attention mass
PREFILL_POLICIES = ("none", "oracle", "indexer")
PREFILL_METHODS = LUKA_METHODS  # sparse prefill replaces a local Phase 1's attention
PREFILL_D_IDX = (64, 128, 256)  # magnetar.prefill.indexer.D_IDX_CHOICES (kept here: config imports no torch)
# The decode-time and prefill policies' implementations, by config section ("module:Class", imported lazily by
# magnetar.engine.strategy): every name but "none" of the section's policy field is served by that class.
POLICY_IMPLS = {
    "sparse": "magnetar.sparse.select:SparseDecoder",  # SparseConfig.sparse_policy
    "luka": "magnetar.luka.decoder:LukaDecoder",  # LukaConfig.luka_mode
    "prefill": "magnetar.prefill.policy:PrefillPolicy",  # PrefillConfig.prefill_policy
}
# string fields with a fixed set of values: their flags' choices, and the names magnetar.engine.agree prints
FIELD_CHOICES = {"scorer": SCORERS, "positions": POSITION_MODES, "dtype": DTYPES, "sparse_policy": SPARSE_POLICIES,
                 "luka_mode": LUKA_MODES, "luka_compressor": LUKA_COMPRESSORS, "luka_refine": LUKA_REFINE,
                 "luka_refine_mass": LUKA_REFINE_MASS, "luka_refine_scope": LUKA_REFINE_SCOPE,
                 "luka_regime": LUKA_REGIMES, "prefill_policy": PREFILL_POLICIES}
