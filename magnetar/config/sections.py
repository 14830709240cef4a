"""The config sections: one frozen, keyword-only dataclass per area (parallel layout, blocks, Pulsar, StreamingLLM,
decoding, runtime, sparse decoding, LuKA, sparse prefill), each checking its own fields in ``__post_init__``; and
the sparse-prefill budget schedule (parsed here so that config stays a leaf)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

from magnetar.config.checks import (MAX_TIMEOUT_S, MIN_TIMEOUT_S, check_types, check_choice, check_path,
                                    require, check_seed, short_repr)
from magnetar.config.registry import (DECODE_STEPS, DTYPES, LUKA_COMPRESSORS, LUKA_REFINE, LUKA_REFINE_MASS,
                                      LUKA_REFINE_SCOPE, LUKA_REGIMES, POLICY_FIELDS, POSITION_MODES, PREFILL_D_IDX,
                                      PREFIX_REUSE, SCORERS, policy_choices)


class PolicySection:
    """A section that configures one family of policies (:data:`~magnetar.config.registry.POLICY_FIELDS`):
    ``section`` its name in the tree; :attr:`policy` the registered policy it names, or ``"none"``."""

    section: ClassVar[str]

    @property
    def policy(self) -> str:
        return getattr(self, POLICY_FIELDS[self.section])


class EncodingSection:
    """A section of how a context is encoded (blocks, Pulsar, StreamingLLM): a request may set its fields for
    itself (:data:`magnetar.config.REQUEST_OPTIONS`), and a context encoded two ways is two cache entries."""


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    cp_size: int = 1  # ranks sharing one context (CP group size); world = tp_size x cp_size x dp_size
    # ranks sharing one model's weights (TP group size, innermost: consecutive ranks); tp_size > 1 shards the
    # model with DeepSpeed AutoTP (init_inference; runtime.deepspeed_inference must be on)
    tp_size: int = 1
    timeout_s: float = 600.0  # every collective of the engine gives up (and raises) after this long
    zigzag: bool = True  # ring: load-balanced zigzag sharding of the context
    # One process stands in for the cp_size ranks: their Phase 1 runs one after another here, Phase 2 attends
    # to all their KV (the same result as the merge over ranks); no collectives. For evaluation on few devices.
    simulate: bool = False
    # Simulated ranks of a method whose ranks exchange KV in every layer (ring): after the lock-step forward that
    # stands in for them all, each rank runs alone against the others' KV from it (as the ring brings them), so
    # every rank has its own Phase-1 time and its exchange steps to price at a link -- twice Phase 1's work (the
    # benchmarks' choice); off: the lock-step forward's time stands on the first rank
    rank_by_rank: bool = False
    # CPU ranks of a CP group that share one host (gloo, x86) gather Phase 2's per-layer (out, lse) through a
    # shared-memory buffer instead of gloo's sockets (magnetar.parallel.shm); off: always gloo
    shm_gather: bool = True

    def __post_init__(self):
        check_types(self)
        require(self.cp_size >= 1, "cp_size", f"must be an int >= 1, got {short_repr(self.cp_size)}")
        require(self.tp_size >= 1, "tp_size", f"must be an int >= 1, got {short_repr(self.tp_size)}")
        # at least a millisecond: below it the process-group timeout rounds to 0 and the rendezvous fails
        require(MIN_TIMEOUT_S <= self.timeout_s <= MAX_TIMEOUT_S, "timeout_s",
                 f"must be > 0 (at least {MIN_TIMEOUT_S:g} s) and at most {MAX_TIMEOUT_S:g} seconds, got "
                 f"{self.timeout_s}")


@dataclass(frozen=True, kw_only=True)
class BlockConfig(EncodingSection):
    block_size: Optional[int] = None  # tokens per context block; default: context length / cp_size (one block per rank)
    anchor_size: Optional[int] = None  # star: anchor tokens prefixed to every block but the first; default = block_size
    # star, pulsar: every block but the first also sees the halo_size tokens just before it (at their own positions),
    # with the anchor / the sink and summaries (de-duplicated); 0: none. At most the block size (checked per request)
    halo_size: int = 0
    # star, pulsar: the halo as a fraction of this request's block size (1: the whole block before it), so one
    # setting fits every context length; 0: none. Give halo_size or halo_blocks, not both
    halo_blocks: float = 0.0
    # star, pulsar (hybrid layers): these layers' Phase-1 attention is exact -- every block also attends to the KV of
    # every earlier block, exchanged over the CP group as ring attention does -- the others are the method's own.
    # "" none; "all"; "every:K" (layers 0, K, 2K, ...); or layer indices and ranges, "0,8,16" / "0-3,29"
    exact_layers: str = ""

    def __post_init__(self):
        check_types(self)
        parse_exact_layers(self.exact_layers)  # the syntax now; the indices against the model when it is loaded
        require(self.block_size is None or self.block_size >= 1, "block_size", f"must be >= 1, got {self.block_size}")
        require(self.anchor_size is None or self.anchor_size >= 0, "anchor_size",
                 f"must be >= 0, got {self.anchor_size}")
        require(self.halo_size >= 0, "halo_size", f"must be >= 0 tokens (0: no halo), got {self.halo_size}")
        require(0.0 <= self.halo_blocks <= 1.0, "halo_blocks",
                 f"must be in [0, 1] (a fraction of the block: 1 = the whole block before it; 0: no halo), got "
                 f"{self.halo_blocks}")
        require(not (self.halo_size and self.halo_blocks), "halo_blocks",
                 f"give halo_size (tokens, {self.halo_size}) or halo_blocks (a fraction of the block, "
                 f"{self.halo_blocks}), not both")


def parse_exact_layers(spec: str, num_layers: Optional[int] = None) -> tuple[int, ...]:
    """The sorted layer indices of an ``exact_layers`` spec (see :class:`BlockConfig`); ``num_layers``: the model's
    layer count (None: check the syntax only; ``all`` and ``every:K`` then give ()). A ValueError names the field
    and what to change."""
    text = spec.strip().lower()
    if not text:
        return ()
    hint = ('use "all", "every:K" (K >= 1) or layer indices and ranges such as "0,8,16" or "0-3,29"'
            + (f" (this model has layers 0-{num_layers - 1})" if num_layers else ""))
    if text == "all":
        return tuple(range(num_layers)) if num_layers else ()
    if text.startswith("every:"):
        k = text[len("every:"):].strip()
        require(k.isdigit() and int(k) >= 1, "exact_layers", f"{short_repr(spec)} is not a layer spec: {hint}")
        return tuple(range(0, num_layers, int(k))) if num_layers else ()
    out = set()
    for part in text.split(","):
        a, dash, b = part.strip().partition("-")
        ok = a.strip().isdigit() and (not dash or b.strip().isdigit())
        require(ok, "exact_layers", f"{short_repr(spec)} is not a layer spec ({short_repr(part)}): {hint}")
        lo, hi = int(a), int(b) if dash else int(a)
        require(lo <= hi, "exact_layers", f"range {short_repr(part.strip())} runs backwards: write it low-high")
        if num_layers is not None:
            require(hi < num_layers, "exact_layers",
                     f"layer {hi} is outside the model: it has {num_layers} layers (0-{num_layers - 1}); {hint}")
        out.update(range(lo, hi + 1))
    return tuple(sorted(out))


@dataclass(frozen=True, kw_only=True)
class PulsarConfig(EncodingSection):
    sink_size: int = 64  # first tokens of block 0 prefixed to every later block
    chunk_size: int = 32  # summary granularity
    summary_budget: float = 0.125  # fraction of each earlier block kept as its summary
    scorer: str = "max_idf"  # how a summary picks its chunks (magnetar.config.registry.SCORERS)
    positions: str = "sparse"  # sparse: original position ids; contiguous: renumbered (Pulsar App. E)
    discard_summary_kv: bool = True  # drop sink and summary KV after Phase 1

    def __post_init__(self):
        check_types(self)
        require(self.sink_size >= 0, "sink_size", f"must be >= 0, got {self.sink_size}")
        require(self.chunk_size >= 1, "chunk_size", f"must be >= 1, got {self.chunk_size}")
        require(0 < self.summary_budget <= 1, "summary_budget", f"must be in (0, 1], got {self.summary_budget}")
        check_choice("scorer", self.scorer, SCORERS, "scorer")
        check_choice("positions", self.positions, POSITION_MODES, "positions mode")


@dataclass(frozen=True, kw_only=True)
class StreamingConfig(EncodingSection):
    sink_tokens: int = 4  # StreamingLLM attention sinks
    window_size: int = 1024  # recent tokens kept besides the sinks

    def __post_init__(self):
        check_types(self)
        require(self.sink_tokens >= 0, "sink_tokens", f"must be >= 0, got {self.sink_tokens}")
        require(self.window_size >= 1, "window_size", f"must be >= 1, got {self.window_size}")


@dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens holding this probability; 1: off
    seed: int = 0  # sampling seed (the token is drawn on one rank and broadcast)

    def __post_init__(self):
        check_types(self)
        require(self.temperature >= 0, "temperature", f"must be >= 0 (0 = greedy), got {self.temperature}")
        require(self.top_k >= 0, "top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        check_seed("seed", self.seed)


DEFAULT_GRAPH_BATCHES = "1,2,4,8,16,32,64"


def parse_batches(text: str) -> tuple[int, ...]:
    """``runtime.decode_graph_batches``: ``"1,2,4"`` -> ``(1, 2, 4)`` (sorted, unique); ValueError saying what is
    wrong."""
    try:
        sizes = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError:
        raise ValueError(f"must be comma-separated batch sizes such as {DEFAULT_GRAPH_BATCHES!r}, got {text!r}") \
            from None
    if not sizes or sizes[0] < 1:
        raise ValueError(f"must list batch sizes >= 1 such as {DEFAULT_GRAPH_BATCHES!r}, got {text!r}")
    return tuple(sizes)


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    # the model's dtype; "auto" (default, as transformers' and vLLM's): the checkpoint's (its config's dtype; the
    # magnetar.models names are prepared in float32; dummy models: bf16 on a GPU, float32 on a CPU; a float16
    # checkpoint on a CPU runs as bfloat16) or a given model's own, nothing cast; float32 / bfloat16 / float16: cast
    dtype: str = "auto"
    attention_backend: str = "auto"  # see magnetar.ops.backends.list_backends()
    # the most positions one request may use -- context + query + new tokens -- below the model's own
    # (max_position_embeddings; vLLM's --max-model-len): a longer request is refused up front, by name, where it would
    # otherwise run until the device's memory ran out; None: the model's
    max_model_len: Optional[int] = None
    deepspeed_inference: bool = True  # shard with DeepSpeed AutoTP when tp_size > 1 (nothing is called at tp_size 1)
    # raise magnetar.engine.finite.NonFiniteError (phase, layer, rank) when Phase 1's attention or a step's
    # logits are not finite, instead of decoding from NaN; one reduction per layer, no extra device sync
    check_finite: bool = True
    # encoded contexts kept per rank for later questions (Engine.encode / ask, prefix reuse), least recently used
    # out; 0 keeps none (every request runs its Phase 1)
    context_cache_mb: int = 1024
    # a second tier in host memory for the contexts the cache evicts (magnetar.engine.store.HostTier): on GPU ranks
    # their KV is copied to the host and back when asked for again (no Phase 1); on CPU ranks it widens the cache;
    # 0: none
    host_cache_mb: int = 0
    # a folder where every rank also writes the contexts it encodes (magnetar.engine.store), so that a restarted
    # engine -- or one whose cache evicted them -- loads them instead of running Phase 1 again; None: memory only
    context_store: Optional[str] = None
    # the store folder's bound: every rank's files and other layouts' together (least recently used out)
    context_store_mb: int = 10240
    # a context that starts with a cached one encodes only its new tokens, which attend to the cached KV exactly
    # (as a Phase-2 query) and are dealt to the CP ranks, least loaded first: "exact" for the methods whose Phase 1
    # is exact (dense, ring: the same KV as a fresh Phase 1, up to float order), "all" also for star and pulsar (the new
    # tokens then see the whole cached context, not the method's anchor or summaries), "off"
    prefix_reuse: str = "exact"
    # how decode steps run (magnetar.engine.static): "eager" (one attention call per request and layer), "static"
    # (each request's own tokens' KV in preallocated slots, its cached context read where it lies, one call per layer
    # for the batch), "compiled" (static under
    # torch.compile; CUDA graphs on CUDA), "graph" (static over shapes planned up front, each captured as a CUDA
    # graph when the engine starts; uncaptured on the CPU); a decode policy runs eager, tensor parallelism static
    # (said why)
    decode_step: str = "eager"
    # decode_step graph (magnetar.engine.graphs): the batch sizes planned (a batch pads to the next one), the KV
    # entries per layer of the slot pool every planned shape shares -- the requests' own tokens, not their contexts
    # (0: an eighth of the device's free memory on CUDA, no bound on the CPU) --, and the seconds the start's capture
    # may take (shapes left out then run uncaptured)
    decode_graph_batches: str = DEFAULT_GRAPH_BATCHES
    decode_graph_tokens: int = 0  # decode_step graph: the slot pool's KV entries per layer (0: 1/8 of a card's memory)
    decode_graph_warmup_s: float = 300.0  # decode_step graph: the most seconds the start's capture may take

    def __post_init__(self):
        check_types(self)
        check_choice("prefix_reuse", self.prefix_reuse, PREFIX_REUSE, "prefix_reuse")
        check_choice("decode_step", self.decode_step, DECODE_STEPS, "decode_step")
        try:
            parse_batches(self.decode_graph_batches)
        except ValueError as e:
            require(False, "decode_graph_batches", str(e))
        require(self.decode_graph_tokens >= 0, "decode_graph_tokens", f"must be >= 0 KV entries (0: an eighth of "
                f"the free device memory on CUDA, no bound on the CPU), got {self.decode_graph_tokens}")
        require(self.decode_graph_warmup_s > 0, "decode_graph_warmup_s", f"must be > 0 seconds, got "
                f"{self.decode_graph_warmup_s}")
        require(self.context_cache_mb >= 0, "context_cache_mb", f"must be >= 0 MiB (0: keep no context), got "
                 f"{self.context_cache_mb}")
        require(self.context_store_mb >= 0, "context_store_mb", f"must be >= 0 MiB, got {self.context_store_mb}")
        require(self.host_cache_mb >= 0, "host_cache_mb", f"must be >= 0 MiB (0: no host tier), got "
                 f"{self.host_cache_mb}")
        require(self.context_store is None or bool(self.context_store.strip()), "context_store",
                "must be a folder, or None (memory only), got ''")
        check_choice("dtype", self.dtype, DTYPES, "dtype")
        require(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
                f"must be >= 1 positions, or None (the model's), got {self.max_model_len}")
        require(bool(self.attention_backend.strip()), "attention_backend",
                 "must name a backend ('auto' or one of magnetar.ops.backends.list_backends()), got ''")


# (sinks, window) each policy keeps by default, on top of its budget: MagicPIG's setting for lsh; none otherwise
SPARSE_DEFAULT_SINKS_WINDOW = {"lsh": (4, 64)}


@dataclass(frozen=True, kw_only=True)
class SparseConfig(PolicySection):
    """Sparse decoding (Spotlight Attention paper): every Phase-2 token attends, in each layer from
    ``dense_layers`` on, to a budget of the context KV chosen for it by the policy (plus, always, the query's
    and generated tokens' own KV). Nothing is evicted: the choice is made again at every step."""

    section: ClassVar[str] = "sparse"
    sparse_policy: str = "none"  # none | oracle_topk | lsh | spotlight | quest (config.POLICIES, section sparse)
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
        check_types(self)
        check_choice("sparse_policy", self.sparse_policy, policy_choices(self.section), "policy")
        require(self.sparse_budget >= 0, "sparse_budget",
                 f"must be an int >= 0 tokens (0: use sparse_pruning), got {self.sparse_budget!r}")
        require(0.0 <= self.sparse_pruning < 1.0, "sparse_pruning",
                 f"must be in [0, 1) (the fraction of context KV pruned, e.g. 0.98), got {self.sparse_pruning}")
        if self.sparse_policy != "none":
            require((self.sparse_budget > 0) != (self.sparse_pruning > 0), "sparse_budget",
                     "give exactly one of sparse_budget (tokens, > 0) and sparse_pruning (a rate in (0, 1)) for "
                     f"policy {self.sparse_policy!r}, got budget {self.sparse_budget} and pruning "
                     f"{self.sparse_pruning}")
        require(self.dense_layers >= 0, "dense_layers", f"must be >= 0, got {self.dense_layers}")
        require(self.sparse_sinks >= -1, "sparse_sinks",
                 f"must be >= 0 (or -1: the policy default), got {self.sparse_sinks}")
        require(self.sparse_window >= -1, "sparse_window",
                 f"must be >= 0 (or -1: the policy default), got {self.sparse_window}")
        require(self.code_bits > 0 and self.code_bits % 32 == 0, "code_bits",
                 f"must be a positive multiple of 32 (codes are packed 32 bits to a word), got {self.code_bits}")
        require(self.page_size >= 1, "page_size", f"must be >= 1 keys per page, got {self.page_size}")
        check_path("hash_path", self.hash_path)
        check_seed("hash_seed", self.hash_seed)
        require(self.sparse_policy != "spotlight" or bool(self.hash_path), "hash_path",
                 "policy 'spotlight' needs trained hash weights: make them with `magnetar-calibrate spotlight "
                 "--out hashes.pt` and pass hash_path=hashes.pt")

    @property
    def sinks(self) -> int:
        return (self.sparse_sinks if self.sparse_sinks >= 0
                else SPARSE_DEFAULT_SINKS_WINDOW.get(self.sparse_policy, (0, 0))[0])

    @property
    def window(self) -> int:
        return (self.sparse_window if self.sparse_window >= 0
                else SPARSE_DEFAULT_SINKS_WINDOW.get(self.sparse_policy, (0, 0))[1])

    def budget(self, context_tokens: int) -> int:
        """Context KV entries attended per step for a context of ``context_tokens`` (retrieved, besides the
        sinks and window); at most the context."""
        if self.sparse_budget > 0:
            return min(self.sparse_budget, context_tokens)
        return min(context_tokens, max(20, math.ceil((1.0 - self.sparse_pruning) * context_tokens)))


@dataclass(frozen=True, kw_only=True)
class LukaConfig(PolicySection):
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

    section: ClassVar[str] = "luka"
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
        check_types(self)
        check_choice("luka_mode", self.luka_mode, policy_choices(self.section), "mode")
        require(self.luka_lined_layers >= 0, "luka_lined_layers",
                 f"must be an int >= 0 (first and last layers lined in mode 'mixed'), got {self.luka_lined_layers!r}")
        require(0.0 < self.luka_heavy_fraction <= 1.0, "luka_heavy_fraction",
                 f"must be in (0, 1] (a fraction of the context, e.g. 0.125), got {self.luka_heavy_fraction}")
        require(self.luka_recent >= 0, "luka_recent",
                 f"must be an int >= 0 tokens (the raw tail), got {self.luka_recent!r}")
        require(self.luka_page_size >= 1, "luka_page_size",
                 f"must be an int >= 1 tokens per page, got {self.luka_page_size!r}")
        check_choice("luka_compressor", self.luka_compressor, LUKA_COMPRESSORS, "compressor")
        require(self.luka_tau > 0, "luka_tau", f"must be > 0, got {self.luka_tau}")
        check_choice("luka_refine", self.luka_refine, LUKA_REFINE, "refinement rule")
        require(self.luka_refine_k >= 0, "luka_refine_k",
                 f"must be an int >= 0 pages, got {self.luka_refine_k!r}")
        require(0.0 <= self.luka_refine_fraction <= 1.0, "luka_refine_fraction",
                 f"must be in [0, 1], got {self.luka_refine_fraction}")
        require(0.0 <= self.luka_refine_eps <= 1.0, "luka_refine_eps",
                 f"must be in [0, 1] (an attention mass), got {self.luka_refine_eps}")
        check_choice("luka_refine_mass", self.luka_refine_mass, LUKA_REFINE_MASS, "refinement mass rule")
        check_choice("luka_refine_scope", self.luka_refine_scope, LUKA_REFINE_SCOPE, "refinement scope")
        require(self.luka_compress_every >= 1, "luka_compress_every",
                 f"must be an int >= 1 decode steps, got {self.luka_compress_every!r}")
        check_choice("luka_regime", self.luka_regime, LUKA_REGIMES, "regime")
        check_seed("luka_seed", self.luka_seed)

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
class PrefillConfig(PolicySection):
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

    section: ClassVar[str] = "prefill"
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
        check_types(self)
        check_choice("prefill_policy", self.prefill_policy, policy_choices(self.section), "policy")
        require(self.prefill_topk >= 0, "prefill_topk",
                 f"must be an int >= 1 keys per query (or 0: from prefill_schedule), got {self.prefill_topk!r}")
        try:
            parse_schedule(self.prefill_schedule)
        except ValueError as e:
            require(False, "prefill_schedule", str(e))
        require(self.prefill_b_sel >= 1, "prefill_b_sel",
                 f"must be an int >= 1 query rows per selection block (1: per query), got {self.prefill_b_sel!r}")
        require(self.prefill_dense_layers >= 0, "prefill_dense_layers",
                 f"must be an int >= 0 layers, got {self.prefill_dense_layers!r}")
        require(self.prefill_d_idx == 0 or self.prefill_d_idx in PREFILL_D_IDX, "prefill_d_idx",
                 f"must be one of {PREFILL_D_IDX} (or 0: the weight file's), got {self.prefill_d_idx!r}")
        check_path("prefill_indexer_path", self.prefill_indexer_path)
        check_seed("prefill_seed", self.prefill_seed)
        if self.prefill_policy == "indexer":
            require(bool(self.prefill_indexer_path) or self.prefill_indexer_random_init, "prefill_indexer_path",
                     "policy 'indexer' needs distilled indexer weights (prefill_indexer_path=FILE); an untrained "
                     "indexer runs only with prefill_indexer_random_init=true, as a stress test, not quality evidence")
            require(not (self.prefill_indexer_path and self.prefill_indexer_random_init),
                     "prefill_indexer_random_init",
                     "give either prefill_indexer_path (distilled weights) or prefill_indexer_random_init, not both")

    @property
    def schedule(self) -> tuple:
        return parse_schedule(self.prefill_schedule)

    def budget(self, context_tokens: int) -> int:
        """Keys per query (block) for a context of ``context_tokens``: ``prefill_topk`` or the schedule's."""
        return self.prefill_topk if self.prefill_topk > 0 else budget_for_length(context_tokens, self.schedule)
