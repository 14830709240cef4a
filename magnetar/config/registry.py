"""The registries and choice tables of the config: methods by name (what config validates and which module
implements each), policies by name (which module implements each, which section configures it), and the values
of every string field with a fixed set. Nothing here imports a strategy module: the engine imports them lazily by
these names."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MethodSpec:
    """What the configuration must know of a Phase-1 context method, without importing it.

    ``impl`` is its :class:`magnetar.engine.strategy.ContextMethod` as ``"module:Class"``, imported lazily by the
    engine; ``distributed``: it spreads one context over the CP group (else it runs on one rank, cp_size 1);
    ``local_prefill``: its Phase 1 is causal attention over ``[prefix ‖ block]`` segments on each rank, which
    LuKA's attention mass and sparse prefill build on. ``own_options``: config fields that only this method (and the
    others that list them) reads, each with what it does (the config refuses them with any other method; a command
    comparing several methods gives them to those alone). ``exact``: its Phase 1 is exact causal attention over the
    whole context, so a cached prefix extended by exact attention over its KV holds what a fresh Phase 1 of the
    longer context would (``runtime.prefix_reuse`` "exact", the server's chunked Phase 1). ``partitions``: its KV
    keeps every context token once over the ranks, so a new token's KV can join it (``prefix_reuse`` "all").
    The engine and the server ask these facts; neither names a method.
    """

    impl: str
    distributed: bool
    local_prefill: bool
    own_options: tuple[tuple[str, str], ...] = ()
    exact: bool = False
    partitions: bool = False


# The halo (issue 30): Star's and Pulsar's option, each block also sees the tokens just before it
HALO_OPTIONS = (("halo_size", "each block also sees the tokens just before it"),
                ("halo_blocks", "each block also sees that fraction of a block before it"))
# Hybrid layers (issue 30): Star's and Pulsar's option, exact attention over every earlier block in chosen layers
EXACT_OPTIONS = (("exact_layers", "these layers attend exactly to every earlier block (KV exchanged as ring's)"),)
# The registry of Phase-1 methods: adding a method is its module in magnetar/methods/ plus one line here.
METHODS: dict[str, MethodSpec] = {
    "dense": MethodSpec("magnetar.methods.dense:DenseMethod", distributed=False, local_prefill=True, exact=True,
                        partitions=True),
    "ring": MethodSpec("magnetar.methods.ring:RingMethod", distributed=True, local_prefill=False, exact=True,
                       partitions=True),
    "star": MethodSpec("magnetar.methods.star:StarMethod", distributed=True, local_prefill=True,
                       own_options=HALO_OPTIONS + EXACT_OPTIONS, partitions=True),
    "pulsar": MethodSpec("magnetar.methods.pulsar:PulsarMethod", distributed=True, local_prefill=True,
                         own_options=HALO_OPTIONS + EXACT_OPTIONS, partitions=True),
    "streaming": MethodSpec("magnetar.methods.streaming:StreamingMethod", distributed=False, local_prefill=False),
}
DISTRIBUTED_METHODS = tuple(n for n, s in METHODS.items() if s.distributed)
# option -> (the methods that read it, in registry order; what it does), from the registry's own_options
METHOD_OPTIONS: dict[str, tuple[tuple[str, ...], str]] = {
    opt: (tuple(n for n, sp in METHODS.items() if opt in dict(sp.own_options)), what)
    for spec in METHODS.values() for opt, what in spec.own_options}

SCORERS = ("max_idf", "tfidf", "bm25", "entropy", "even")
POSITION_MODES = ("sparse", "contiguous")
DTYPES = ("float32", "bfloat16", "float16", "auto")  # auto: the checkpoint's (or a given model's) dtype, not cast
LUKA_COMPRESSORS = ("attention_weighted", "mean", "random")
LUKA_REFINE = ("top_k", "top_fraction", "threshold", "none")
LUKA_REFINE_MASS = ("exact", "preserve")
LUKA_REFINE_SCOPE = ("shared", "per_kv_head")
# When LuKA starts: the question read exactly, pages cut right after it (the paper) / after luka_compress_every
# generated tokens (the authors' code) / before it (Magnetar's earlier behaviour); see LukaConfig
LUKA_REGIMES = ("after_query", "after_generation", "before_query")
LUKA_METHODS = tuple(n for n, s in METHODS.items() if s.local_prefill)  # LuKA needs Phase-1 attention mass
PREFILL_METHODS = LUKA_METHODS  # sparse prefill replaces a local Phase 1's attention
PREFILL_D_IDX = (64, 128, 256)  # the indexer's widths (Sec. 6.3); magnetar.prefill.indexer.D_IDX_CHOICES is this


def check_d_idx(d_idx) -> None:
    """ValueError unless ``d_idx`` is one of the indexer's widths (:data:`PREFILL_D_IDX`)."""
    if d_idx not in PREFILL_D_IDX:
        raise ValueError(f"prefill_d_idx (--prefill-d-idx): must be one of {PREFILL_D_IDX}, got {d_idx!r}")

# string fields with a fixed set of values: their flags' choices, and the names magnetar.engine.agree prints
# (the policy fields' values come from POLICIES: field_choices)
PREFIX_REUSE = ("exact", "all", "off")  # runtime.prefix_reuse (docs/engine.md, "Prefix reuse")
DECODE_STEPS = ("eager", "static", "compiled", "graph")  # runtime.decode_step (magnetar.engine.static)
FIELD_CHOICES = {"scorer": SCORERS, "positions": POSITION_MODES, "dtype": DTYPES, "luka_compressor": LUKA_COMPRESSORS,
                 "luka_refine": LUKA_REFINE, "luka_refine_mass": LUKA_REFINE_MASS,
                 "luka_refine_scope": LUKA_REFINE_SCOPE, "luka_regime": LUKA_REGIMES, "prefix_reuse": PREFIX_REUSE,
                 "decode_step": DECODE_STEPS}


@dataclass(frozen=True)
class PolicySpec:
    """A decode-time or prefill policy, without importing it: ``impl`` is its class as ``"module:Class"`` (imported
    lazily by :mod:`magnetar.engine.strategy`, built with its section's config and the model's config), ``section``
    the config section whose options it reads -- and whose policy field (:data:`POLICY_FIELDS`) names it."""

    impl: str
    section: str


# The config section of each policy family -> its field that names the policy ("none": no policy of that family).
POLICY_FIELDS = {"sparse": "sparse_policy", "luka": "luka_mode", "prefill": "prefill_policy"}
# The families of decode-time policies (magnetar.engine.strategy.DecodePolicy): an engine uses at most one.
DECODE_SECTIONS = ("sparse", "luka")

# The registry of policies, by name: adding one is its module plus one line here (docs/design.md).
POLICIES: dict[str, PolicySpec] = {
    # sparse decoding (SparseConfig.sparse_policy): one selector module per policy, magnetar/sparse/
    "oracle_topk": PolicySpec("magnetar.sparse.oracle:OracleTopK", "sparse"),
    "lsh": PolicySpec("magnetar.sparse.lsh:LshSelector", "sparse"),
    "spotlight": PolicySpec("magnetar.sparse.spotlight:SpotlightSelector", "sparse"),
    "quest": PolicySpec("magnetar.sparse.quest:QuestSelector", "sparse"),
    # LuKA (LukaConfig.luka_mode): one decoder, the mode picks the layers' structures
    "lined": PolicySpec("magnetar.luka.decoder:LukaDecoder", "luka"),
    "clustered": PolicySpec("magnetar.luka.decoder:LukaDecoder", "luka"),
    "mixed": PolicySpec("magnetar.luka.decoder:LukaDecoder", "luka"),
    # sparse prefill (PrefillConfig.prefill_policy)
    "oracle": PolicySpec("magnetar.prefill.policy:PrefillPolicy", "prefill"),
    "indexer": PolicySpec("magnetar.prefill.policy:PrefillPolicy", "prefill"),
}


def policy_choices(section: str) -> tuple[str, ...]:
    """The values of ``section``'s policy field: ``none`` and the policies registered for it (read at each call,
    so a policy registered at run time is a valid choice)."""
    return ("none",) + tuple(n for n, s in POLICIES.items() if s.section == section)


def field_choices(name: str):
    """The fixed set of values of string field ``name`` (its flag's choices), or None when it is free."""
    for section, field_name in POLICY_FIELDS.items():
        if name == field_name:
            return policy_choices(section)
    return FIELD_CHOICES.get(name)
