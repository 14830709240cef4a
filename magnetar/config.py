"""Engine configuration: a tree of frozen, keyword-only dataclasses, validated once, never mutated.

    EngineConfig
      method          dense | ring | star | pulsar | streaming
      parallel        cp_size, timeout_s, zigzag, simulate
      blocks          block_size, anchor_size                     (star, pulsar)
      pulsar          sink_size, chunk_size, summary_budget, scorer, positions, discard_summary_kv
      streaming       sink_tokens, window_size
      decode          temperature, top_k, top_p, seed
      sparse          sparse_policy, sparse_budget, sparse_pruning, dense_layers, sparse_sinks, sparse_window,
                      code_bits, page_size, hash_path, hash_seed     (sparse decoding, any method)
      luka            luka_mode, luka_lined_layers, luka_heavy_fraction, luka_recent, luka_page_size,
                      luka_compressor, luka_tau, luka_refine, luka_refine_k, luka_refine_fraction,
                      luka_refine_eps, luka_refine_mass, luka_compress_every, luka_zero_values, luka_size_bias,
                      luka_seed
                      (LuKA decode-time KV structures: dense, star, pulsar)
      prefill         prefill_policy, prefill_topk, prefill_schedule, prefill_b_sel, prefill_dense_layers,
                      prefill_indexer_path, prefill_indexer_random_init, prefill_d_idx, prefill_seed
                      (sparse prefill of global attention layers: dense, star, pulsar)
      runtime         dtype, attention_backend, deepspeed_inference, check_finite

Build it nested (``EngineConfig(method="pulsar", pulsar=PulsarConfig(scorer="bm25"))``), flat
(``EngineConfig.create(method="pulsar", cp_size=4, scorer="bm25")``), from a JSON/YAML file
(:meth:`EngineConfig.from_file`, nested or flat keys) or from CLI flags (:func:`add_cli_args` /
:meth:`EngineConfig.from_cli`). Every error names the field (and the flag) to change.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, Sequence


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
DTYPES = ("float32", "bfloat16", "float16")
SPARSE_POLICIES = ("none", "oracle_topk", "lsh", "spotlight", "quest")
LUKA_MODES = ("none", "lined", "clustered", "mixed")
LUKA_COMPRESSORS = ("attention_weighted", "mean", "random")
LUKA_REFINE = ("top_k", "top_fraction", "threshold", "none")
LUKA_REFINE_MASS = ("preserve", "exact")
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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _require(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name} ({_flag(name)}): {msg}")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    cp_size: int = 1  # ranks sharing one context (CP group size); world = cp_size x dp_size
    timeout_s: float = 600.0  # every collective of the engine gives up (and raises) after this long
    zigzag: bool = True  # ring: load-balanced zigzag sharding of the context
    # One process stands in for the cp_size ranks: their Phase 1 runs one after another here, Phase 2 attends
    # to all their KV (the same result as the merge over ranks); no collectives. For evaluation on few devices.
    simulate: bool = False

    def __post_init__(self):
        _require(isinstance(self.cp_size, int) and self.cp_size >= 1, "cp_size", f"must be an int >= 1, got {self.cp_size!r}")
        _require(self.timeout_s > 0, "timeout_s", f"must be > 0 seconds, got {self.timeout_s}")


@dataclass(frozen=True, kw_only=True)
class BlockConfig:
    block_size: Optional[int] = None  # tokens per context block; default: context length / cp_size (one block per rank)
    anchor_size: Optional[int] = None  # star: anchor tokens prefixed to every block but the first; default = block_size

    def __post_init__(self):
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
        _require(self.sink_size >= 0, "sink_size", f"must be >= 0, got {self.sink_size}")
        _require(self.chunk_size >= 1, "chunk_size", f"must be >= 1, got {self.chunk_size}")
        _require(0 < self.summary_budget <= 1, "summary_budget", f"must be in (0, 1], got {self.summary_budget}")
        _require(self.scorer in SCORERS, "scorer", f"unknown scorer {self.scorer!r}; choose one of {SCORERS}")
        _require(self.positions in POSITION_MODES, "positions", f"must be one of {POSITION_MODES}, got {self.positions!r}")


@dataclass(frozen=True, kw_only=True)
class StreamingConfig:
    sink_tokens: int = 4  # StreamingLLM attention sinks
    window_size: int = 1024  # recent tokens kept besides the sinks

    def __post_init__(self):
        _require(self.sink_tokens >= 0, "sink_tokens", f"must be >= 0, got {self.sink_tokens}")
        _require(self.window_size >= 1, "window_size", f"must be >= 1, got {self.window_size}")


@dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int = 0  # sampling seed (the token is drawn on one rank and broadcast)

    def __post_init__(self):
        _require(self.temperature >= 0, "temperature", f"must be >= 0 (0 = greedy), got {self.temperature}")
        _require(self.top_k >= 0, "top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    dtype: str = "float32"
    attention_backend: str = "auto"  # see magnetar.ops.backends.list_backends()
    deepspeed_inference: bool = True  # wrap the model with deepspeed.init_inference (tp_size 1)
    # raise magnetar.engine.finite.NonFiniteError (phase, layer, rank) when Phase 1's attention or a step's
    # logits are not finite, instead of decoding from NaN; one reduction per layer, no extra device sync
    check_finite: bool = True

    def __post_init__(self):
        _require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")


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
        _require(self.sparse_policy in SPARSE_POLICIES, "sparse_policy",
                 f"unknown policy {self.sparse_policy!r}; choose one of {SPARSE_POLICIES}")
        _require(isinstance(self.sparse_budget, int) and self.sparse_budget >= 0, "sparse_budget",
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
      (summaries + raw tokens) and refines the pages chosen by ``luka_refine`` into their tokens, giving the
      children the page's mass (``preserve``, Eq. 3) or their exact mass (``exact``). New pages are cut
      every ``luka_compress_every`` decode steps.
    * ``mixed``: the first and last ``luka_lined_layers`` layers lined, the others clustered.
    """

    luka_mode: str = "none"  # none | lined | clustered | mixed
    luka_lined_layers: int = 8  # mixed: this many first and last layers are lined (paper: 8 + 8 of 36)
    luka_heavy_fraction: float = 0.125  # lined: heavy hitters per step, as a fraction of the context (paper ~1/8)
    luka_recent: int = 128  # raw recent tokens: lined's window and clustered's uncompressed tail (paper >= 128)
    luka_page_size: int = 16  # clustered: tokens per page (paper's fixed segmenter: 16)
    luka_compressor: str = "attention_weighted"  # attention_weighted | mean | random
    luka_tau: float = 1.0  # attention_weighted: softmax temperature over the tokens' accumulated mass
    luka_refine: str = "top_k"  # top_k | top_fraction | threshold | none
    luka_refine_k: int = 3  # top_k: pages refined per step (paper: 3)
    luka_refine_fraction: float = 0.1  # top_fraction: fraction rho of the pages refined per step
    luka_refine_eps: float = 0.01  # threshold: refine a page whose mass exceeds eps (0: every page)
    luka_refine_mass: str = "preserve"  # preserve: children share the page's mass (Eq. 3); exact: their own
    luka_compress_every: int = 16  # clustered: decode steps between runs of the segmenter + compressor
    luka_zero_values: bool = False  # ablation: summary values are 0 (an unrefined page contributes nothing)
    luka_size_bias: bool = False  # add log(page size) to summary logits: a page weighs as its tokens (not in the paper)
    luka_seed: int = 0  # the random compressor's seed

    def __post_init__(self):
        _require(self.luka_mode in LUKA_MODES, "luka_mode", f"unknown mode {self.luka_mode!r}; choose one of {LUKA_MODES}")
        _require(isinstance(self.luka_lined_layers, int) and self.luka_lined_layers >= 0, "luka_lined_layers",
                 f"must be an int >= 0 (first and last layers lined in mode 'mixed'), got {self.luka_lined_layers!r}")
        _require(0.0 < self.luka_heavy_fraction <= 1.0, "luka_heavy_fraction",
                 f"must be in (0, 1] (a fraction of the context, e.g. 0.125), got {self.luka_heavy_fraction}")
        _require(isinstance(self.luka_recent, int) and self.luka_recent >= 0, "luka_recent",
                 f"must be an int >= 0 tokens (the raw tail), got {self.luka_recent!r}")
        _require(isinstance(self.luka_page_size, int) and self.luka_page_size >= 1, "luka_page_size",
                 f"must be an int >= 1 tokens per page, got {self.luka_page_size!r}")
        _require(self.luka_compressor in LUKA_COMPRESSORS, "luka_compressor",
                 f"unknown compressor {self.luka_compressor!r}; choose one of {LUKA_COMPRESSORS}")
        _require(self.luka_tau > 0, "luka_tau", f"must be > 0, got {self.luka_tau}")
        _require(self.luka_refine in LUKA_REFINE, "luka_refine",
                 f"unknown refinement rule {self.luka_refine!r}; choose one of {LUKA_REFINE}")
        _require(isinstance(self.luka_refine_k, int) and self.luka_refine_k >= 0, "luka_refine_k",
                 f"must be an int >= 0 pages, got {self.luka_refine_k!r}")
        _require(0.0 <= self.luka_refine_fraction <= 1.0, "luka_refine_fraction",
                 f"must be in [0, 1], got {self.luka_refine_fraction}")
        _require(0.0 <= self.luka_refine_eps <= 1.0, "luka_refine_eps",
                 f"must be in [0, 1] (an attention mass), got {self.luka_refine_eps}")
        _require(self.luka_refine_mass in LUKA_REFINE_MASS, "luka_refine_mass",
                 f"choose one of {LUKA_REFINE_MASS}, got {self.luka_refine_mass!r}")
        _require(isinstance(self.luka_compress_every, int) and self.luka_compress_every >= 1, "luka_compress_every",
                 f"must be an int >= 1 decode steps, got {self.luka_compress_every!r}")

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
        _require(self.prefill_policy in PREFILL_POLICIES, "prefill_policy",
                 f"unknown policy {self.prefill_policy!r}; choose one of {PREFILL_POLICIES}")
        _require(isinstance(self.prefill_topk, int) and not isinstance(self.prefill_topk, bool)
                 and self.prefill_topk >= 0, "prefill_topk",
                 f"must be an int >= 1 keys per query (or 0: from prefill_schedule), got {self.prefill_topk!r}")
        try:
            parse_schedule(self.prefill_schedule)
        except ValueError as e:
            _require(False, "prefill_schedule", str(e))
        _require(isinstance(self.prefill_b_sel, int) and not isinstance(self.prefill_b_sel, bool)
                 and self.prefill_b_sel >= 1, "prefill_b_sel",
                 f"must be an int >= 1 query rows per selection block (1: per query), got {self.prefill_b_sel!r}")
        _require(isinstance(self.prefill_dense_layers, int) and self.prefill_dense_layers >= 0, "prefill_dense_layers",
                 f"must be an int >= 0 layers, got {self.prefill_dense_layers!r}")
        _require(self.prefill_d_idx == 0 or self.prefill_d_idx in PREFILL_D_IDX, "prefill_d_idx",
                 f"must be one of {PREFILL_D_IDX} (or 0: the weight file's), got {self.prefill_d_idx!r}")
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
        _require(self.method in METHODS, "method", f"unknown method {self.method!r}; choose one of {tuple(METHODS)}")
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
    def from_dict(cls, data: dict[str, Any]) -> "EngineConfig":
        """Nested (``{"pulsar": {"scorer": ...}}``) or flat (``{"scorer": ...}``) keys; unknown keys are errors."""
        top: dict[str, Any] = {}
        per_section: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
        for key, value in data.items():
            if key == "method":
                top["method"] = value
            elif key in SECTIONS:
                if isinstance(value, SECTIONS[key]):
                    value = dataclasses.asdict(value)
                if not isinstance(value, dict):
                    raise ValueError(f"config section {key!r} must be a mapping, got {type(value).__name__}")
                for k, v in value.items():
                    if k not in {f.name for f in fields(SECTIONS[key])}:
                        raise ValueError(f"unknown field {k!r} in config section {key!r}; "
                                         f"known: {[f.name for f in fields(SECTIONS[key])]}")
                    per_section[key][k] = v
            elif key in FLAT_FIELDS:
                per_section[FLAT_FIELDS[key]][key] = value
            else:
                raise ValueError(f"unknown config field {key!r}; known: ['method'] + {sorted(FLAT_FIELDS)} "
                                 f"(or sections {sorted(SECTIONS)})")
        sections = {s: SECTIONS[s](**vals) for s, vals in per_section.items()}
        return cls(**top, **sections)

    @classmethod
    def from_file(cls, path: str | Path) -> "EngineConfig":
        """Load a ``.json`` or ``.yaml``/``.yml`` file (nested or flat keys)."""
        path = Path(path)
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            raise ValueError(f"config file {path} must end in .json, .yaml or .yml")
        if not isinstance(data, dict):
            raise ValueError(f"config file {path} must hold a mapping at the top level")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **flat) -> "EngineConfig":
        """A copy with flat fields changed (the original is never mutated)."""
        merged = self.to_dict()
        for key, value in flat.items():
            if key == "method":
                merged["method"] = value
            elif key in FLAT_FIELDS:
                merged[FLAT_FIELDS[key]][key] = value
            else:
                raise ValueError(f"unknown config field {key!r}")
        return EngineConfig.from_dict(merged)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> "EngineConfig":
        """From flags added by :func:`add_cli_args`; ``--config FILE`` values are overridden by explicit flags."""
        base = cls.from_file(args.config).to_dict() if getattr(args, "config", None) else {}
        flat = {}
        for name in ["method", *FLAT_FIELDS]:
            value = getattr(args, name, None)
            if value is not None:
                flat[name] = value
        if base:
            return cls.from_dict(base).replace(**flat)
        return cls.from_dict(flat)


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
            choices = {"scorer": SCORERS, "positions": POSITION_MODES, "dtype": DTYPES,
                       "sparse_policy": SPARSE_POLICIES, "luka_mode": LUKA_MODES, "luka_compressor": LUKA_COMPRESSORS,
                       "luka_refine": LUKA_REFINE, "luka_refine_mass": LUKA_REFINE_MASS,
                       "prefill_policy": PREFILL_POLICIES}.get(name)
            g.add_argument(_flag(name), choices=choices)
    return parser


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
