"""Engine configuration: a tree of frozen, keyword-only dataclasses, validated once, never mutated.

    EngineConfig
      method          dense | ring | star | pulsar | streaming
      parallel        cp_size, tp_size, timeout_s, zigzag, simulate
      blocks          block_size, anchor_size                     (star, pulsar)
      pulsar          sink_size, chunk_size, summary_budget, scorer, positions, discard_summary_kv
      streaming       sink_tokens, window_size
      decode          temperature, top_k, top_p, seed
      sparse          sparse_policy, sparse_budget, sparse_pruning, dense_layers, sparse_sinks, sparse_window,
                      code_bits, page_size, hash_path, hash_seed     (sparse decoding, any method)
      luka            luka_mode, luka_lined_layers, luka_heavy_fraction, luka_recent, luka_page_size,
                      luka_compressor, luka_tau, luka_refine, luka_refine_k, luka_refine_fraction,
                      luka_refine_eps, luka_refine_mass, luka_refine_scope, luka_compress_every, luka_regime,
                      luka_zero_values, luka_size_bias, luka_seed
                      (LuKA decode-time KV structures: dense, star, pulsar)
      prefill         prefill_policy, prefill_topk, prefill_schedule, prefill_b_sel, prefill_dense_layers,
                      prefill_indexer_path, prefill_indexer_random_init, prefill_d_idx, prefill_seed
                      (sparse prefill of global attention layers: dense, star, pulsar)
      runtime         dtype, attention_backend, deepspeed_inference, check_finite, context_cache_mb

Build it nested (``EngineConfig(method="pulsar", pulsar=PulsarConfig(scorer="bm25"))``), flat
(``EngineConfig.create(method="pulsar", cp_size=4, scorer="bm25")``), from a JSON/YAML file
(:meth:`EngineConfig.from_file`, nested or flat keys) or from CLI flags (:func:`add_cli_args` /
:meth:`EngineConfig.from_cli`). Every error names the field (and the flag) to change.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any, Optional, Sequence, get_args, get_type_hints


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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _where(name: str) -> str:
    """``pulsar.scorer (--scorer)`` for a field, ``method (--method)``, or the bare name of a section."""
    if name in FLAT_FIELDS:
        return f"{FLAT_FIELDS[name]}.{name} ({_flag(name)})"
    return f"{name} ({_flag(name)})" if name == "method" else name


def _require(cond: bool, name: str, msg: str) -> None:
    if not cond:
        err = ValueError(f"{_where(name)}: {msg}")
        err.field = name  # EngineConfig.from_cli names the config file when the field came from it
        raise err


def _short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: a hostile value must not make a megabyte message."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<a {value.bit_length()}-bit int>"  # repr of a huge int is slow, or refused past 4300 digits
    if isinstance(value, (list, tuple, dict, set)):  # never the repr of a whole value: a YAML alias bomb is huge
        return f"<{type(value).__name__} of {len(value)} items>"
    if isinstance(value, (str, bytes)) and len(value) > limit:
        value = value[:limit]
    text = repr(value)
    if len(text) <= limit:
        return text
    return text[: limit - 4] + "...'" if isinstance(value, str) else text[:limit] + "..."


def _suggest(word: Any, options) -> str:
    """``"; did you mean 'scorer'?"`` when ``word`` is close to one of ``options``, else ``""``."""
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, [str(o) for o in options], n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _choice(name: str, value: Any, options: Sequence, noun: str) -> None:
    """``value`` must be one of ``options``; the error lists them (and the nearest one)."""
    _require(value in options, name, f"unknown {noun} {_short(value)}{_suggest(value, options)} "
                                     f"(choose one of {', '.join(map(str, options))})")


def _type_problem(value: Any, want: type) -> Optional[str]:
    """Why ``value`` cannot be a ``want`` (bool, int, float, str or a config section), or None if it can.
    Nothing is converted: a bool is not a number, 2.5 is not the int 2, the text "4" is not the number 4."""
    if want is bool:
        ok = isinstance(value, bool)
        expected = "true or false"
    elif want is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        expected = "an int"
    elif want is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        try:
            finite = ok and math.isfinite(value)
        except OverflowError:  # an int too large for a float
            finite = False
        if ok and not finite:
            return f"expected a finite number, got {_short(value)}"
        expected = "a number"
    elif want is str:
        ok, expected = isinstance(value, str), "a string"
    else:  # a config section
        if isinstance(value, want):
            return None
        return (f"expected a {want.__name__}, got {type(value).__name__}; build the config from a mapping with "
                f"EngineConfig.from_dict / EngineConfig.create, or pass {want.__name__}(...)")
    if ok:
        return None
    msg = f"expected {expected}, got {type(value).__name__} {_short(value)}"
    if want in (int, float) and isinstance(value, bool):
        return msg + " (a bool is not a number)"
    if want is int and isinstance(value, numbers.Real):
        return msg + " (write a whole number; nothing is rounded)"
    if want is not str and isinstance(value, str) and value.strip():
        return msg + " (a value in quotes is text: write it without quotes)"
    return msg


@cache
def _field_types(cls: type) -> dict[str, tuple[type, bool]]:
    """``{field: (type, None allowed)}`` of a config dataclass, from its annotations."""
    out = {}
    for name, hint in get_type_hints(cls).items():
        args = [a for a in get_args(hint) if a is not type(None)]
        out[name] = (args[0], True) if args else (hint, False)
    return out


def _check_types(obj: Any) -> None:
    """Every field of the config dataclass ``obj`` has its annotated type (ValueError naming the field and
    flag); numpy-style scalars become plain ``int`` / ``float`` so that the config serialises as given."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        want, optional = _field_types(type(obj))[f.name]
        if value is None and optional:
            continue
        problem = _type_problem(value, want)
        if problem is None and want is int and not -_MAX_INT <= value < _MAX_INT:
            problem = f"must fit in 64 bits, got {_short(value)}"
        _require(problem is None, f.name, problem or "")
        if want in (int, float) and type(value) not in (int, float):
            object.__setattr__(obj, f.name, int(value) if want is int else float(value))


_MAX_INT = 2**63  # every int field ends up in a torch int64 or a C long (seeds: torch.Generator.manual_seed)
_MAX_TIMEOUT_S = 1e9  # about 31 years: a timedelta and every process group backend still hold it
_MIN_TIMEOUT_S = 1e-3  # seconds: a process-group timeout rounds to whole milliseconds


def _seed(name: str, value: int) -> None:
    _require(value >= 0, name, f"must be an int >= 0, got {value}")


def _path(name: str, value: Optional[str]) -> None:
    _require(value is None or bool(value.strip()), name, "must be a file path (or unset), got an empty string")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    cp_size: int = 1  # ranks sharing one context (CP group size); world = tp_size x cp_size x dp_size
    # ranks sharing one model's weights (TP group size, innermost: consecutive ranks); the engine does not
    # shard models yet, so init_inference refuses tp_size > 1 (magnetar.parallel.init_groups already lays it out)
    tp_size: int = 1
    timeout_s: float = 600.0  # every collective of the engine gives up (and raises) after this long
    zigzag: bool = True  # ring: load-balanced zigzag sharding of the context
    # One process stands in for the cp_size ranks: their Phase 1 runs one after another here, Phase 2 attends
    # to all their KV (the same result as the merge over ranks); no collectives. For evaluation on few devices.
    simulate: bool = False

    def __post_init__(self):
        _check_types(self)
        _require(self.cp_size >= 1, "cp_size", f"must be an int >= 1, got {_short(self.cp_size)}")
        _require(self.tp_size >= 1, "tp_size", f"must be an int >= 1, got {_short(self.tp_size)}")
        # at least a millisecond: below it the process-group timeout rounds to 0 and the rendezvous fails
        _require(_MIN_TIMEOUT_S <= self.timeout_s <= _MAX_TIMEOUT_S, "timeout_s",
                 f"must be > 0 (at least {_MIN_TIMEOUT_S:g} s) and at most {_MAX_TIMEOUT_S:g} seconds, got "
                 f"{self.timeout_s}")


@dataclass(frozen=True, kw_only=True)
class BlockConfig:
    block_size: Optional[int] = None  # tokens per context block; default: context length / cp_size (one block per rank)
    anchor_size: Optional[int] = None  # star: anchor tokens prefixed to every block but the first; default = block_size

    def __post_init__(self):
        _check_types(self)
        _require(self.block_size is None or self.block_size >= 1, "block_size", f"must be >= 1, got {self.block_size}")
        _require(self.anchor_size is None or self.anchor_size >= 0, "anchor_size", f"must be >= 0, got {self.anchor_size}")


@dataclass(frozen=True, kw_only=True)
class PulsarConfig:
    sink_size: int = 64  # first tokens of block 0 prefixed to every later block
    chunk_size: int = 32  # summary granularity
    summary_budget: float = 0.125  # fraction of each earlier block kept as its summary
    scorer: str = "max_idf"
    positions: str = "sparse"  # sparse: original position ids; contiguous: renumbered (Pulsar App. E)
    discard_summary_kv: bool = True  # drop sink and summary KV after Phase 1

    def __post_init__(self):
        _check_types(self)
        _require(self.sink_size >= 0, "sink_size", f"must be >= 0, got {self.sink_size}")
        _require(self.chunk_size >= 1, "chunk_size", f"must be >= 1, got {self.chunk_size}")
        _require(0 < self.summary_budget <= 1, "summary_budget", f"must be in (0, 1], got {self.summary_budget}")
        _choice("scorer", self.scorer, SCORERS, "scorer")
        _choice("positions", self.positions, POSITION_MODES, "positions mode")


@dataclass(frozen=True, kw_only=True)
class StreamingConfig:
    sink_tokens: int = 4  # StreamingLLM attention sinks
    window_size: int = 1024  # recent tokens kept besides the sinks

    def __post_init__(self):
        _check_types(self)
        _require(self.sink_tokens >= 0, "sink_tokens", f"must be >= 0, got {self.sink_tokens}")
        _require(self.window_size >= 1, "window_size", f"must be >= 1, got {self.window_size}")


@dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int = 0  # sampling seed (the token is drawn on one rank and broadcast)

    def __post_init__(self):
        _check_types(self)
        _require(self.temperature >= 0, "temperature", f"must be >= 0 (0 = greedy), got {self.temperature}")
        _require(self.top_k >= 0, "top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _seed("seed", self.seed)


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    dtype: str = "float32"  # the model's dtype; "auto": the checkpoint's (a given model's own), nothing is cast
    attention_backend: str = "auto"  # see magnetar.ops.backends.list_backends()
    deepspeed_inference: bool = True  # shard with DeepSpeed AutoTP when tp_size > 1 (nothing is called at tp_size 1)
    # raise magnetar.engine.finite.NonFiniteError (phase, layer, rank) when Phase 1's attention or a step's
    # logits are not finite, instead of decoding from NaN; one reduction per layer, no extra device sync
    check_finite: bool = True
    # encoded contexts kept per rank for later questions (Engine.encode / ask, prefix reuse), least recently used
    # out; 0 keeps none (every request runs its Phase 1)
    context_cache_mb: int = 1024

    def __post_init__(self):
        _check_types(self)
        _require(self.context_cache_mb >= 0, "context_cache_mb", f"must be >= 0 MiB (0: keep no context), got "
                 f"{self.context_cache_mb}")
        _choice("dtype", self.dtype, DTYPES, "dtype")
        _require(bool(self.attention_backend.strip()), "attention_backend",
                 "must name a backend ('auto' or one of magnetar.ops.backends.list_backends()), got ''")


# (sinks, window) each policy keeps by default, on top of its budget: MagicPIG's setting for lsh; none otherwise
SPARSE_DEFAULT_SINKS_WINDOW = {"lsh": (4, 64)}


@dataclass(frozen=True, kw_only=True)
class SparseConfig:
    """Sparse decoding (Spotlight Attention paper): every Phase-2 token attends, in each layer from
    ``dense_layers`` on, to a budget of the context KV chosen for it by the policy (plus, always, the query's
    and generated tokens' own KV). Nothing is evicted: the choice is made again at every step."""

    sparse_policy: str = "none"  # none | oracle_topk | lsh | spotlight | quest
    sparse_budget: int = 0  # context KV entries per step and KV head; 0: from sparse_pruning
    sparse_pruning: float = 0.0  # or the fraction of the context KV pruned, e.g. 0.98 (budget >= 20 as in App. A.5)
    dense_layers: int = 2  # the first layers attend densely (the paper keeps layers [0, 1] dense)
    sparse_sinks: int = -1  # first context tokens always kept; -1: the policy's default (lsh 4, others 0)
    sparse_window: int = -1  # last context tokens always kept; -1: the policy's default (lsh 64, others 0)
    code_bits: int = 128  # lsh / spotlight hash code length (a multiple of 32)
    page_size: int = 16  # quest: keys per page
    hash_path: Optional[str] = None  # spotlight: trained hash weights (magnetar-calibrate spotlight); lsh: optional
    hash_seed: int = 0  # lsh: seed of the random rotations

    def __post_init__(self):
        _check_types(self)
        _choice("sparse_policy", self.sparse_policy, SPARSE_POLICIES, "policy")
        _require(self.sparse_budget >= 0, "sparse_budget",
                 f"must be an int >= 0 tokens (0: use sparse_pruning), got {self.sparse_budget!r}")
        _require(0.0 <= self.sparse_pruning < 1.0, "sparse_pruning",
                 f"must be in [0, 1) (the fraction of context KV pruned, e.g. 0.98), got {self.sparse_pruning}")
        if self.sparse_policy != "none":
            _require((self.sparse_budget > 0) != (self.sparse_pruning > 0), "sparse_budget",
                     "give exactly one of sparse_budget (tokens, > 0) and sparse_pruning (a rate in (0, 1)) for "
                     f"policy {self.sparse_policy!r}, got budget {self.sparse_budget} and pruning {self.sparse_pruning}")
        _require(self.dense_layers >= 0, "dense_layers", f"must be >= 0, got {self.dense_layers}")
        _require(self.sparse_sinks >= -1, "sparse_sinks", f"must be >= 0 (or -1: the policy default), got {self.sparse_sinks}")
        _require(self.sparse_window >= -1, "sparse_window",
                 f"must be >= 0 (or -1: the policy default), got {self.sparse_window}")
        _require(self.code_bits > 0 and self.code_bits % 32 == 0, "code_bits",
                 f"must be a positive multiple of 32 (codes are packed 32 bits to a word), got {self.code_bits}")
        _require(self.page_size >= 1, "page_size", f"must be >= 1 keys per page, got {self.page_size}")
        _path("hash_path", self.hash_path)
        _seed("hash_seed", self.hash_seed)
        _require(self.sparse_policy != "spotlight" or bool(self.hash_path), "hash_path",
                 "policy 'spotlight' needs trained hash weights: make them with `magnetar-calibrate spotlight "
                 "--out hashes.pt` and pass hash_path=hashes.pt")

    @property
    def sinks(self) -> int:
        return self.sparse_sinks if self.sparse_sinks >= 0 else SPARSE_DEFAULT_SINKS_WINDOW.get(self.sparse_policy, (0, 0))[0]

    @property
    def window(self) -> int:
        return self.sparse_window if self.sparse_window >= 0 else SPARSE_DEFAULT_SINKS_WINDOW.get(self.sparse_policy, (0, 0))[1]

    def budget(self, context_tokens: int) -> int:
        """Context KV entries attended per step for a context of ``context_tokens`` (retrieved, besides the
        sinks and window); at most the context."""
        if self.sparse_budget > 0:
            return min(self.sparse_budget, context_tokens)
        return min(context_tokens, max(20, math.ceil((1.0 - self.sparse_pruning) * context_tokens)))


@dataclass(frozen=True, kw_only=True)
class LukaConfig:
    """LuKA (``../shared/papers/003``): decode-time structures over the context KV, per layer.

    * ``lined`` (H2O): each step attends to the heavy hitters -- the ``luka_heavy_fraction`` of the context
      with the largest attention mass accumulated (without decay) over prefill and decode -- plus the raw
      recent ``luka_recent`` tokens, each once.
    * ``clustered``: the oldest raw tokens (all but the last ``luka_recent``) are cut into pages of
      ``luka_page_size``, each with one summary key/value (``luka_compressor``); a step attends to the cover
      (summaries + raw tokens) and refines the pages chosen by ``luka_refine`` (for all heads of a forward,
      ``shared``, or per KV head, ``per_kv_head``) into their tokens, giving the children their exact mass
      (``exact``: the authors' code) or the page's mass (``preserve``: the paper's Eq. 3). New pages are cut
      every ``luka_compress_every`` decode steps.
    * ``mixed``: the first and last ``luka_lined_layers`` layers lined, the others clustered.

    ``luka_regime`` -- when LuKA starts, counted in Phase-2 forwards (the query's, then one per generated token):
    * ``after_query`` (the paper's regime): the query (question) attends the whole context exactly, its mass
      joins the accumulated mass, and the context is paged from the next forward on (then every
      ``luka_compress_every`` steps); lined layers use heavy hitters from the next forward on.
    * ``after_generation`` (the authors' code's schedule): the query and the first ``luka_compress_every - 1``
      generated tokens are read exactly (so the first ``luka_compress_every`` generated tokens are dense's); the
      first pages are cut at the forward that reads generated token ``luka_compress_every``.
    * ``before_query``: the context is paged before the query is read (Magnetar's behaviour before the option).
    """

    luka_mode: str = "none"  # none | lined | clustered | mixed
    luka_lined_layers: int = 8  # mixed: this many first and last layers are lined (paper: 8 + 8 of 36)
    luka_heavy_fraction: float = 0.125  # lined: heavy hitters per step, as a fraction of the context (paper ~1/8)
    luka_recent: int = 128  # raw recent tokens: lined's window and clustered's uncompressed tail (paper >= 128)
    luka_page_size: int = 16  # clustered: tokens per page (paper's fixed segmenter: 16)
    luka_compressor: str = "attention_weighted"  # attention_weighted | mean | random
    luka_tau: float = 1.0  # attention_weighted: softmax temperature over the tokens' mass (averaged over the group)
    luka_refine: str = "top_k"  # top_k | top_fraction | threshold | none
    luka_refine_k: int = 3  # top_k: pages refined per step (paper: 3)
    luka_refine_fraction: float = 0.1  # top_fraction: fraction rho of the pages refined per step
    luka_refine_eps: float = 0.01  # threshold: refine a page whose mass exceeds eps (0: every page)
    luka_refine_mass: str = "exact"  # exact: children get their own mass (authors' code); preserve: the page's (Eq. 3)
    luka_refine_scope: str = "shared"  # shared: one page set per forward for all heads (authors'); per_kv_head
    luka_compress_every: int = 16  # clustered: decode steps between runs of the segmenter + compressor
    luka_regime: str = "after_query"  # after_query | after_generation | before_query: when LuKA starts (see above)
    luka_zero_values: bool = False  # ablation: summary values are 0 (an unrefined page contributes nothing)
    luka_size_bias: bool = False  # add log(page size) to summary logits: a page weighs as its tokens (not in the paper)
    luka_seed: int = 0  # the random compressor's seed

    def __post_init__(self):
        _check_types(self)
        _choice("luka_mode", self.luka_mode, LUKA_MODES, "mode")
        _require(self.luka_lined_layers >= 0, "luka_lined_layers",
                 f"must be an int >= 0 (first and last layers lined in mode 'mixed'), got {self.luka_lined_layers!r}")
        _require(0.0 < self.luka_heavy_fraction <= 1.0, "luka_heavy_fraction",
                 f"must be in (0, 1] (a fraction of the context, e.g. 0.125), got {self.luka_heavy_fraction}")
        _require(self.luka_recent >= 0, "luka_recent",
                 f"must be an int >= 0 tokens (the raw tail), got {self.luka_recent!r}")
        _require(self.luka_page_size >= 1, "luka_page_size",
                 f"must be an int >= 1 tokens per page, got {self.luka_page_size!r}")
        _choice("luka_compressor", self.luka_compressor, LUKA_COMPRESSORS, "compressor")
        _require(self.luka_tau > 0, "luka_tau", f"must be > 0, got {self.luka_tau}")
        _choice("luka_refine", self.luka_refine, LUKA_REFINE, "refinement rule")
        _require(self.luka_refine_k >= 0, "luka_refine_k",
                 f"must be an int >= 0 pages, got {self.luka_refine_k!r}")
        _require(0.0 <= self.luka_refine_fraction <= 1.0, "luka_refine_fraction",
                 f"must be in [0, 1], got {self.luka_refine_fraction}")
        _require(0.0 <= self.luka_refine_eps <= 1.0, "luka_refine_eps",
                 f"must be in [0, 1] (an attention mass), got {self.luka_refine_eps}")
        _choice("luka_refine_mass", self.luka_refine_mass, LUKA_REFINE_MASS, "refinement mass rule")
        _choice("luka_refine_scope", self.luka_refine_scope, LUKA_REFINE_SCOPE, "refinement scope")
        _require(self.luka_compress_every >= 1, "luka_compress_every",
                 f"must be an int >= 1 decode steps, got {self.luka_compress_every!r}")
        _choice("luka_regime", self.luka_regime, LUKA_REGIMES, "regime")
        _seed("luka_seed", self.luka_seed)

    def layer_kind(self, layer: int, num_layers: int) -> str:
        """``lined``, ``clustered`` or ``none`` for ``layer`` of a model with ``num_layers`` layers."""
        if self.luka_mode in ("none", "lined", "clustered"):
            return self.luka_mode
        n = self.luka_lined_layers
        return "lined" if layer < n or layer >= num_layers - n else "clustered"

    def heavy_budget(self, context_tokens: int) -> int:
        """Heavy hitters attended per step (lined layers) for a context of ``context_tokens``."""
        return min(context_tokens, max(1, math.ceil(self.luka_heavy_fraction * context_tokens)))


# -- the sparse-prefill budget schedule (parsed here so that config stays a leaf; magnetar.prefill.schedule
# re-exports it beside the sparsity accounting) ---------------------------------------------------------
# Sec. 5.1 / Table 2: 256 / 512 / 1024 / 2048 for 4K / 8K / 16K / >= 32K tokens
PAPER_SCHEDULE = "4096:256,8192:512,16384:1024,*:2048"

Schedule = tuple[tuple[Optional[int], int], ...]


def parse_schedule(text: str) -> Schedule:
    """``"4096:256,8192:512,*:2048"`` -> ``((4096, 256), (8192, 512), (None, 2048))``.

    Entries ``MAX_LEN:K`` with strictly increasing ``MAX_LEN``, then one ``*:K`` for every longer input; a
    length ``L`` gets the ``K`` of the first entry with ``L <= MAX_LEN``. Raises ValueError on anything else.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"a schedule is 'MAX_LEN:K,...,*:K', got {text!r}")
    out: list[tuple[Optional[int], int]] = []
    for part in text.split(","):
        bound, sep, k = part.strip().partition(":")
        if not sep:
            raise ValueError(f"schedule entry {part.strip()!r} is not 'MAX_LEN:K' (e.g. '4096:256' or '*:2048')")
        try:
            kk = int(k)
            length = None if bound.strip() == "*" else int(bound)
        except ValueError:
            raise ValueError(f"schedule entry {part.strip()!r}: MAX_LEN must be an int or '*', K an int") from None
        if kk < 1 or (length is not None and length < 1):
            raise ValueError(f"schedule entry {part.strip()!r}: MAX_LEN and K must be >= 1")
        if out and out[-1][0] is None:
            raise ValueError(f"schedule {text!r}: the '*:K' entry must come last")
        if length is not None and out and length <= out[-1][0]:
            raise ValueError(f"schedule {text!r}: MAX_LEN values must increase ({out[-1][0]} then {length})")
        out.append((length, kk))
    if out[-1][0] is not None:
        raise ValueError(f"schedule {text!r} must end with a '*:K' entry for inputs longer than {out[-1][0]}")
    return tuple(out)


def budget_for_length(L: int, schedule: Sequence[tuple[Optional[int], int]] | str) -> int:
    """The top-k the schedule gives a ``L``-token input: the first entry with ``L <= MAX_LEN`` (``None``: any)."""
    sched = parse_schedule(schedule) if isinstance(schedule, str) else tuple(schedule)
    for length, k in sched:
        if length is None or L <= length:
            return int(k)
    raise ValueError(f"the schedule {sched} has no entry for {L} tokens; end it with (None, K) ('*:K')")


@dataclass(frozen=True, kw_only=True)
class PrefillConfig:
    """Sparse prefill (``../shared/papers/004``): in Phase 1, every global attention layer from
    ``prefill_dense_layers`` on attends, per query (``prefill_b_sel`` 1) or per block of ``prefill_b_sel``
    consecutive queries, to a top-``k`` support of the keys only, and the model continues from that sparse
    output (the sparse trajectory). Sliding-window layers and decoding stay dense.

    * ``oracle``: the support is the top-k of the dense attention averaged over the query heads (Algorithm 1)
      -- a measuring instrument (it computes dense attention to choose), not an acceleration;
    * ``indexer``: a head-collapsed indexer distilled from the oracle ranks the keys (Algorithm 2);
      ``prefill_indexer_random_init`` runs it untrained -- a stress test of the path, never quality evidence.

    ``b_sel`` defaults to 1 (the paper's per-query oracle); 64 is its fused selection-block-shared setting.
    """

    prefill_policy: str = "none"  # none | oracle | indexer
    prefill_topk: int = 0  # keys per query (block); 0: from prefill_schedule by context length
    prefill_schedule: str = PAPER_SCHEDULE  # MAX_LEN:K,...,*:K (the paper's 4K-32K+ budgets)
    prefill_b_sel: int = 1  # query rows sharing one support (1: per query; the paper's fused path: 64)
    prefill_dense_layers: int = 0  # the first layers stay dense
    prefill_indexer_path: Optional[str] = None  # indexer: distilled weights (IndexerBank file)
    prefill_indexer_random_init: bool = False  # indexer: untrained random weights -- stress test only
    prefill_d_idx: int = 0  # indexer width 64 | 128 | 256; 0: the file's (random init: 128)
    prefill_seed: int = 0  # seed of the random-init indexer

    def __post_init__(self):
        _check_types(self)
        _choice("prefill_policy", self.prefill_policy, PREFILL_POLICIES, "policy")
        _require(self.prefill_topk >= 0, "prefill_topk",
                 f"must be an int >= 1 keys per query (or 0: from prefill_schedule), got {self.prefill_topk!r}")
        try:
            parse_schedule(self.prefill_schedule)
        except ValueError as e:
            _require(False, "prefill_schedule", str(e))
        _require(self.prefill_b_sel >= 1, "prefill_b_sel",
                 f"must be an int >= 1 query rows per selection block (1: per query), got {self.prefill_b_sel!r}")
        _require(self.prefill_dense_layers >= 0, "prefill_dense_layers",
                 f"must be an int >= 0 layers, got {self.prefill_dense_layers!r}")
        _require(self.prefill_d_idx == 0 or self.prefill_d_idx in PREFILL_D_IDX, "prefill_d_idx",
                 f"must be one of {PREFILL_D_IDX} (or 0: the weight file's), got {self.prefill_d_idx!r}")
        _path("prefill_indexer_path", self.prefill_indexer_path)
        _seed("prefill_seed", self.prefill_seed)
        if self.prefill_policy == "indexer":
            _require(bool(self.prefill_indexer_path) or self.prefill_indexer_random_init, "prefill_indexer_path",
                     "policy 'indexer' needs distilled indexer weights (prefill_indexer_path=FILE); an untrained "
                     "indexer runs only with prefill_indexer_random_init=true, as a stress test, not quality evidence")
            _require(not (self.prefill_indexer_path and self.prefill_indexer_random_init),
                     "prefill_indexer_random_init",
                     "give either prefill_indexer_path (distilled weights) or prefill_indexer_random_init, not both")

    @property
    def schedule(self) -> tuple:
        return parse_schedule(self.prefill_schedule)

    def budget(self, context_tokens: int) -> int:
        """Keys per query (block) for a context of ``context_tokens``: ``prefill_topk`` or the schedule's."""
        return self.prefill_topk if self.prefill_topk > 0 else budget_for_length(context_tokens, self.schedule)


SECTIONS = {
    "parallel": ParallelConfig,
    "blocks": BlockConfig,
    "pulsar": PulsarConfig,
    "streaming": StreamingConfig,
    "decode": DecodeConfig,
    "runtime": RuntimeConfig,
    "sparse": SparseConfig,
    "luka": LukaConfig,
    "prefill": PrefillConfig,
}
FLAT_FIELDS = {f.name: sec for sec, cls in SECTIONS.items() for f in fields(cls)}


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    method: str = "dense"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    blocks: BlockConfig = field(default_factory=BlockConfig)
    pulsar: PulsarConfig = field(default_factory=PulsarConfig)
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    sparse: SparseConfig = field(default_factory=SparseConfig)
    luka: LukaConfig = field(default_factory=LukaConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)

    def __post_init__(self):
        _check_types(self)
        _choice("method", self.method, tuple(METHODS), "method")
        if self.luka.luka_mode != "none":
            _require(self.sparse.sparse_policy == "none", "luka_mode",
                     f"LuKA and sparse decoding ({self.sparse.sparse_policy!r}) both choose the context KV a step "
                     "attends to; use one of them (set sparse_policy none or luka_mode none)")
            _require(self.method in LUKA_METHODS, "luka_mode",
                     f"LuKA needs every context token's attention mass from a local Phase 1; use method "
                     f"{' / '.join(LUKA_METHODS)}, not {self.method!r}")
        if self.prefill.prefill_policy != "none":
            _require(self.method in PREFILL_METHODS, "prefill_policy",
                     f"sparse prefill replaces the attention of a local Phase 1; use method "
                     f"{' / '.join(PREFILL_METHODS)}, not {self.method!r}")
            _require(self.luka.luka_mode == "none", "prefill_policy",
                     "LuKA's Phase-1 attention mass assumes dense prefill attention; use sparse prefill or LuKA "
                     "(set prefill_policy none or luka_mode none)")
        if not METHODS[self.method].distributed:
            _require(self.parallel.cp_size == 1, "cp_size",
                     f"method {self.method!r} runs on one rank; use cp_size=1 (or method {'/'.join(DISTRIBUTED_METHODS)} "
                     "to spread it)")

    # -- flat access to the names used throughout the docs ------------------------------------------------
    def __getattr__(self, name):  # only called when normal lookup fails: config.cp_size, config.scorer, ...
        section = FLAT_FIELDS.get(name)
        if section is None:
            raise AttributeError(f"EngineConfig has no field {name!r}")
        return getattr(object.__getattribute__(self, section), name)

    @classmethod
    def create(cls, **kwargs) -> "EngineConfig":
        """Build from flat keyword names (``cp_size=4, scorer="bm25"``) and/or section dicts/objects."""
        return cls.from_dict(kwargs)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "EngineConfig":
        """Nested (``{"pulsar": {"scorer": ...}}``) or flat (``{"scorer": ...}``) keys. Unknown keys, a field given
        twice (flat and nested), a section that is not a mapping and a value of the wrong type are errors that
        name the field (``pulsar.scorer``) and its flag; nothing is converted."""
        return cls._build(*_split(data))

    @classmethod
    def _build(cls, top: dict[str, Any], per_section: dict[str, dict[str, Any]]) -> "EngineConfig":
        return cls(**top, **{s: SECTIONS[s](**vals) for s, vals in per_section.items()})

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "EngineConfig":
        """Load a ``.json`` or ``.yaml``/``.yml`` file (UTF-8; nested or flat keys). FileNotFoundError for a
        missing file; ValueError naming the file (and line and column of a syntax error) for anything else."""
        data = _read_file(path)
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"config file {path}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **flat) -> "EngineConfig":
        """A copy with flat fields changed (the original is never mutated)."""
        top, per = {"method": self.method}, _sections_of(self)
        for key, value in flat.items():
            if key in SECTIONS:
                raise ValueError(f"replace takes flat fields (e.g. scorer='bm25'), not the section {key!r}; "
                                 "use EngineConfig.from_dict for nested values")
            _put(top, per, None, key, value, key)
        return EngineConfig._build(top, per)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> "EngineConfig":
        """From flags added by :func:`add_cli_args`; ``--config FILE`` values are overridden by explicit flags
        (the file and the flags are validated together, once)."""
        top, per = {}, {s: {} for s in SECTIONS}
        path = getattr(args, "config", None)
        if path is not None:
            data = _read_file(path)
            try:
                top, per = _split(data)
            except ValueError as e:
                raise ValueError(f"config file {path}: {e}") from None
        from_file = {*top, *(k for vals in per.values() for k in vals)}
        for name in ["method", *FLAT_FIELDS]:
            value = getattr(args, name, None)
            if value is not None:
                _put(top, per, None, name, value, name)
                from_file.discard(name)
        try:
            return cls._build(top, per)
        except ValueError as e:
            if getattr(e, "field", None) in from_file:
                raise ValueError(f"config file {path}: {e}") from None
            raise


def _fields_of(section: Any) -> dict[str, Any]:
    return {f.name: getattr(section, f.name) for f in fields(section)}


def _sections_of(config: EngineConfig) -> dict[str, dict[str, Any]]:
    return {s: _fields_of(getattr(config, s)) for s in SECTIONS}


def _unknown(key: Any, section: Optional[str] = None) -> str:
    """The error for a key that is no config field (of ``section``): the nearest names, where it belongs."""
    if not isinstance(key, str):
        return f"config keys are field names (strings), got {type(key).__name__} {_short(key)}"
    if section is not None:
        names = [f.name for f in fields(SECTIONS[section])]
        home = FLAT_FIELDS.get(key)
        where = f"; {key!r} belongs in section {home!r}" if home else _suggest(key, names)
        return f"unknown field {_short(key)} in config section {section!r}{where} (its fields: {', '.join(names)})"
    return (f"unknown config field {_short(key)}{_suggest(key, ['method', *SECTIONS, *FLAT_FIELDS])} (fields: "
            f"'method', the sections {', '.join(SECTIONS)} and their fields {', '.join(sorted(FLAT_FIELDS))})")


def _put(top: dict, per: dict[str, dict], given: Optional[dict[str, str]], key: Any, value: Any, as_: str) -> None:
    """Set field ``key`` (``method`` or a section's field) to ``value``. With ``given`` (field -> how it was
    written, e.g. ``pulsar.scorer``) a field set twice is an error; without, the later value wins (a flag over
    its config file)."""
    if key == "method":
        top["method"] = value
        return
    if not isinstance(key, str) or key not in FLAT_FIELDS:
        raise ValueError(_unknown(key))
    if given is not None:
        if key in given:
            raise ValueError(f"config field {key!r} is given twice, as {given[key]!r} and as {as_!r}; keep one")
        given[key] = as_
    per[FLAT_FIELDS[key]][key] = value


def _split(data: Any) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """A config mapping (nested and/or flat keys) -> ``(top-level fields, {section: {field: value}})``."""
    if not isinstance(data, Mapping):
        raise ValueError(f"a config is a mapping of field names to values (e.g. {{'method': 'star', "
                         f"'cp_size': 4}}), got {type(data).__name__}")
    top: dict[str, Any] = {}
    per: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    given: dict[str, str] = {}
    for key, value in data.items():
        if key in SECTIONS:
            if isinstance(value, SECTIONS[key]):
                value = _fields_of(value)
            if not isinstance(value, Mapping):
                first = fields(SECTIONS[key])[0].name
                raise ValueError(f"config section {key!r} must be a mapping of its fields (e.g. {{{first!r}: ...}}) "
                                 f"or a {SECTIONS[key].__name__}, got {type(value).__name__} {_short(value)}")
            for k, v in value.items():
                if not isinstance(k, str) or FLAT_FIELDS.get(k) != key:
                    raise ValueError(_unknown(k, key))
                _put(top, per, given, k, v, f"{key}.{k}")
        else:
            _put(top, per, given, key, value, key)
    return top, per


MAX_CONFIG_BYTES = 2**20


def _read_file(path: Any) -> dict[str, Any]:
    """The top-level mapping of a JSON or YAML config file, with every way a file can be wrong named."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"a config file path is a str or Path, got {type(path).__name__} {_short(path)}")
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ValueError(f"config file {p} must end in .json, .yaml or .yml")
    if not p.exists():
        raise FileNotFoundError(f"config file {p} does not exist")
    if p.is_dir():
        raise ValueError(f"config file {p} is a directory; pass a .json or .yaml file")
    if not p.is_file():  # a FIFO would block forever, a device never end
        raise ValueError(f"config file {p} is not a regular file (a FIFO, device or socket); save the config to a "
                         f"file and pass that")
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ValueError(f"config file {p} cannot be read ({e.strerror})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ValueError(f"config file {p} is larger than {MAX_CONFIG_BYTES // 2**20} MiB, more than a config can "
                         f"be; pass the config file itself")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"config file {p} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                         "save it as UTF-8") from None
    if not text.strip():
        raise ValueError(f"config file {p} is empty; write a mapping of config fields (e.g. {{\"method\": \"star\"}}, "
                         "or {} for the defaults)")
    try:
        data = _parse_json(text) if suffix == ".json" else _parse_yaml(text)
    except RecursionError:
        raise ValueError(f"config file {p} is nested too deeply to be a config") from None
    except ValueError as e:
        raise ValueError(f"config file {p}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {p} must hold a mapping of config fields at the top level (e.g. "
                         f"{{\"method\": \"star\"}}), got {type(data).__name__} {_short(data)}")
    return data


def _parse_json(text: str) -> Any:
    def unique(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"key {k!r} appears twice in one object; keep one")
            seen.add(k)
        return dict(pairs)

    try:
        return json.loads(text, object_pairs_hook=unique, parse_int=_parse_int)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


MAX_INT_DIGITS = 100  # an integer of a config is far shorter; Python refuses to read ints past 4300 digits
MAX_YAML_NODES = 10_000  # the values of a config, aliases expanded: a billion-laughs file is refused before built


def _parse_int(text: str) -> int:
    if len(text.lstrip("+-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('+-'))} digits ({text[:20]}...); config values are far "
                         f"smaller -- fix the number")
    return int(text)


def _yaml_size(node, memo: dict) -> int:
    """Nodes of ``node`` with its aliases expanded (each shared node counted once per use, computed once); a
    recursive alias counts as too many."""
    import yaml

    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = MAX_YAML_NODES + 1  # a node reached again while being counted: a recursive value
    if isinstance(node, yaml.SequenceNode):
        n = 1 + sum(_yaml_size(child, memo) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        n = 1 + sum(_yaml_size(k, memo) + _yaml_size(v, memo) for k, v in node.value)
    else:
        n = 1
    memo[id(node)] = n
    return n


def _parse_yaml(text: str) -> Any:
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):  # PyYAML keeps the last of two equal keys without a word
        def construct_document(self, node):
            size = _yaml_size(node, {})
            if size > MAX_YAML_NODES:
                raise yaml.constructor.ConstructorError(None, None, f"the document expands to more than "
                                                        f"{MAX_YAML_NODES} values (aliases repeated or recursive); "
                                                        f"a config holds a few dozen -- write the values out",
                                                        node.start_mark)
            return super().construct_document(node)

        def construct_yaml_int(self, node):
            digits = str(node.value).lstrip("+-").replace("_", "")
            if len(digits) > MAX_INT_DIGITS:
                raise yaml.constructor.ConstructorError(None, None, f"an integer of {len(digits)} digits; config "
                                                        f"values are far smaller -- fix the number",
                                                        node.start_mark)
            return super().construct_yaml_int(node)

        def construct_mapping(self, node, deep=False):
            self.flatten_mapping(node)
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, (str, int, float, bool)):
                    continue  # an unhashable key is refused by SafeLoader itself
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice in one mapping; "
                                                            "keep one", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", UniqueKeyLoader.construct_yaml_int)
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"invalid YAML{at}: {getattr(e, 'problem', None) or e}") from None


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """One flag per config field (``--cp-size``, ``--summary-budget``, ...) plus ``--config FILE``."""
    g = parser.add_argument_group("engine config (defaults in magnetar/config.py)")
    g.add_argument("--config", help="JSON/YAML file with config fields (flags override it)")
    g.add_argument("--method", choices=tuple(METHODS))
    for name, section in FLAT_FIELDS.items():
        f = next(f for f in fields(SECTIONS[section]) if f.name == name)
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if "bool" in kind:
            g.add_argument(_flag(name), type=_parse_bool, metavar="{true,false}")
        elif "int" in kind:
            g.add_argument(_flag(name), type=int)
        elif "float" in kind:
            g.add_argument(_flag(name), type=float)
        else:
            g.add_argument(_flag(name), choices=FIELD_CHOICES.get(name))
    return parser


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
