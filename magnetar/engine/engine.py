"""The engine API: ``init_inference(model, config) -> Engine`` and ``Engine.generate(context, query)``.

Data flow of one request (each step its own module)::

    template.split_prompt   context / query strings -> Phase-1 ids, Phase-2 ids        (or token tensors)
    plan.plan_rank          which tokens this rank encodes, with which prefix/positions
    phase1.run_phase1       encode them, keep the KV shard                              (per rank)
    phase2.run_phase2       query + decode over the distributed KV (gather + merge per layer)

Every rank of a CP group calls ``generate`` with the same arguments (the launcher starts one process per
rank; ``agree.check_request`` verifies it before Phase 1); the result, with every rank's measurements, is
returned on every rank.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import math
import os
import resource
import threading
import time
import uuid
from collections import OrderedDict
from datetime import timedelta
from dataclasses import dataclass, field
from typing import Generator, Optional, Sequence, Union

import torch
import torch.distributed as dist

from magnetar.config import EngineConfig, LukaConfig, SparseConfig
from magnetar.engine import hf, inputs
from magnetar.engine.batch import ContinuousBatch
from magnetar.engine.agree import check_request
from magnetar.engine.finite import HINT, NonFiniteError, describe
from magnetar.engine.kv import KVShard
from magnetar.engine.phase1 import run_phase1
from magnetar.engine.context import ContextCache, ContextHandle, context_key
from magnetar.engine.phase2 import DecodeResult, Phase2Request, run_phase2, run_scoring
from magnetar.engine.plan import kept_token_count
from magnetar.engine.sampling import RequestSampler, SamplingParams
from magnetar.engine.strategy import DecodePolicy, context_method, decode_policy, plan_rank, prefill_policy
from magnetar.engine.template import encode_text, split_prompt
from magnetar.engine.tensor_parallel import checkpoint_index, load_shard, shard_tensor_parallel, weight_bytes
from magnetar.models import load_model, model_dtype, model_kind, model_path
from magnetar.ops.merge import prepare_merge
from magnetar.parallel import ParallelGroups, init_groups, local_groups
from magnetar.parallel.collectives import all_gather_ints
from magnetar.parallel.launcher import device_for_rank, init_distributed
from magnetar.utils.nvtx import GENERATE, SCORE, nvtx_range

log = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class GenerationResult:
    """The answer and where the time and memory went (lists are indexed by CP rank)."""

    text: str
    token_ids: list[int]
    method: str
    context_tokens: int
    query_tokens: int
    stop_reason: str
    phase1_seconds: list[float]
    ttft_seconds: float  # Phase 2: query forward over the distributed KV + first token
    decode_seconds_per_token: Optional[float]  # mean over tokens after the first (None if only one)
    kv_tokens_per_rank: list[int]  # context KV held per rank after Phase 1 (+ query/generated on rank 0)
    context_kv_tokens_per_rank: list[int]
    kv_bytes_per_rank: list[int]
    peak_memory_bytes_per_rank: list[int]
    first_token_logits: Optional[torch.Tensor] = field(default=None, repr=False)
    simulated: bool = False  # one process stood in for the CP ranks (config.parallel.simulate)
    # sparse prefill (config.prefill): PrefillStats.as_dict() summed over the ranks -- budget, realised
    # causal token-pair sparsity of the patched layers, queries left without a visible key; None when off
    prefill_stats: Optional[dict] = None
    # the decode policy's stats() when the answer's last token was produced, summed over the ranks (LuKA: the
    # fraction of the context held as page summaries, ...); None without a policy or when it keeps none
    decode_stats: Optional[dict] = None
    # parameter + buffer bytes held by each rank of the model replica, index cp_rank * tp_size + tp_rank (the CP
    # rank at tp_size 1); under TP each is a shard
    weight_bytes_per_rank: list[int] = field(default_factory=list)
    # the context tokens whose Phase 1 was reused from the context cache (all of them on a hit, else 0)
    cached_context_tokens: int = 0

    @property
    def phase1_critical_path_seconds(self) -> float:
        return max(self.phase1_seconds)

    def summary(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "first_token_logits"}
        d["phase1_critical_path_seconds"] = self.phase1_critical_path_seconds
        return d


@dataclass
class ScoreResult:
    """Per-token log-likelihood of a continuation (see :meth:`Engine.score`)."""

    token_logprobs: torch.Tensor  # (T - 1,) float32: log p(continuation[i + 1] | context, continuation[:i + 1])
    method: str
    context_tokens: int
    phase1_seconds: list[float]  # per CP rank (real or simulated)
    phase2_seconds: float
    simulated: bool = False
    prefill_stats: Optional[dict] = None  # as GenerationResult.prefill_stats

    @property
    def nll_sum(self) -> float:
        return float(-self.token_logprobs.double().sum())

    @property
    def tokens(self) -> int:
        return int(self.token_logprobs.numel())

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.tokens)


@dataclass
class RankStats:
    """One CP rank's figures for one request (``peak_memory_bytes`` None until measured)."""

    phase1_seconds: float
    context_kv_tokens: int  # context KV held after Phase 1
    kv_bytes: int
    peak_memory_bytes: Optional[int] = None
    gen_kv_tokens: int = 0  # query/generated KV (the query rank only)
    decode_stats: Optional[dict] = None  # the decode policy's stats() of this rank (DecodeResult.decode_stats)

    @property
    def kv_tokens(self) -> int:
        return self.context_kv_tokens + self.gen_kv_tokens


def _sum_stats(per_rank: list[Optional[dict]]) -> Optional[dict]:
    """The ranks' decode-policy stats added key by key (None when no rank has any)."""
    present = [d for d in per_rank if d is not None]
    if not present:
        return None
    return {key: sum(d.get(key, 0) for d in present) for key in dict.fromkeys(k for d in present for k in d)}


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class Engine:
    """Long-context inference with one method (``config.method``) over one CP group."""

    def __init__(self, model, config: EngineConfig, groups: ParallelGroups, tokenizer=None):
        self.model = model
        self.config = config
        self.groups = groups
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        # what a ContextHandle is tied to: this engine and its variants (same model object, weights, groups); a
        # handle from another engine -- another model, or the same shapes with other weights -- is refused by ask
        self.identity = f"{type(model).__name__}:{getattr(model.config, 'name_or_path', '') or '?'}:{uuid.uuid4().hex}"
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.cache = ContextCache(config.runtime.context_cache_mb * 2**20)  # encoded contexts (encode / ask)
        self._kv_options = _kv_options(config)  # what else than the ids keys a context's KV in the cache
        # EngineConfig -> this engine with other per-request options (variant()), least recently used first
        self._variants: OrderedDict = OrderedDict()
        self._variants_lock = threading.Lock()
        self._policies: dict = {}  # other sparse / LuKA configs scored by score_variants
        # the decode policy the Phase-2 attention asks: sparse decoding (config.sparse) or LuKA (config.luka)
        self._policy_config = config.sparse if config.sparse.sparse_policy != "none" else config.luka
        # prepare_merge first, then each policy's ops: build or load every JIT op this engine's requests will use
        # before any request -- a first build inside a step would keep the other ranks waiting in a collective
        # until its timeout (op builds wait for each other under a file lock, so the ranks leave here within
        # about one build of each other)
        prepare_merge(self.device)
        self.policy: Optional[DecodePolicy] = self._prepare(decode_policy(self._policy_config, model.config))
        # sparse prefill (config.prefill): the Phase-1 attention of the patched layers; decoding stays dense
        self.prefill = self._prepare(prefill_policy(config.prefill, model.config))
        self.last_prefill_stats = None  # PrefillStats of the last request's Phase 1 (all ranks), or None
        if self.prefill is not None and self.prefill.needs_hidden:
            hf.capture_attention_inputs(model)
        # the weight bytes of every rank of the replica (index cp_rank * tp_size + tp_rank; a shard each under TP)
        mine = weight_bytes(model)
        if self.simulated:
            self.weight_bytes_per_rank = [mine] * config.parallel.cp_size  # each stand-in rank holds the model
        else:
            self.weight_bytes_per_rank = all_gather_ints([mine], groups.replica_group, self.device,
                                                         timeout=groups.timeout)[:, 0].tolist()

    def _prepare(self, policy):
        """``policy.prepare(device)`` when the policy has one, and under tensor parallelism
        ``policy.shard_heads(...)`` with this rank's KV heads (optional methods of the strategy protocols)."""
        if policy is None:
            return None
        tp, rank = self.groups.tp_size, self.groups.tp_rank
        if tp > 1:
            shard_heads = getattr(policy, "shard_heads", None)
            if shard_heads is None:
                raise ValueError(f"{type(policy).__name__} cannot run on a tensor-parallel shard of the heads (it has "
                                 f"no shard_heads): use tp_size 1 with it")
            cfg = self.model.config
            total = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
            shard_heads(rank * total // tp, total // tp, total)
        prepare = getattr(policy, "prepare", None)
        if prepare is not None:
            prepare(self.device)
        return policy

    # -- request preparation ------------------------------------------------------------------------------
    def _tokens(self, context, query) -> tuple[torch.Tensor, torch.Tensor]:
        """Checked ``(context ids (L,), query ids (Q,))`` int64 on CPU (:mod:`magnetar.engine.inputs`)."""
        strings = not (isinstance(context, torch.Tensor) or isinstance(query, torch.Tensor))
        if not strings:
            if not (isinstance(context, torch.Tensor) and isinstance(query, torch.Tensor)):
                raise ValueError("pass context and query both as strings or both as token-id tensors")
            c, q = context.reshape(-1).long().cpu(), query.reshape(-1).long().cpu()
        else:
            p = self._prompt(context, query)
            c, q = p.context_ids, p.query_ids
        inputs.check_token_ids(c, "context", self.vocab_size, tokenized=strings)
        inputs.check_token_ids(q, "query", self.vocab_size, tokenized=strings)
        return c, q

    def context_ids(self, context) -> torch.Tensor:
        """Checked context ids for :meth:`encode`: a string is cut from the chat template rendered with a stand-in
        question (the split is at the end of the context, so the ids are those ``generate`` gets)."""
        inputs.check_prompt(context, "context")
        if isinstance(context, torch.Tensor):
            c, strings = context.reshape(-1).long().cpu(), False
        else:
            c, strings = self._prompt(context, "?").context_ids, True
        inputs.check_token_ids(c, "context", self.vocab_size, tokenized=strings)
        return c

    def query_ids(self, query) -> torch.Tensor:
        """Checked query ids for :meth:`ask`: a string is cut from the template rendered with a stand-in context
        (the question part -- question, end of turn, assistant header -- does not depend on the context)."""
        inputs.check_prompt(query, "query")
        if isinstance(query, torch.Tensor):
            q, strings = query.reshape(-1).long().cpu(), False
        else:
            q, strings = self._prompt(".", query).query_ids, True
        inputs.check_token_ids(q, "query", self.vocab_size, tokenized=strings)
        return q

    def _prompt(self, context: str, query: str):
        if self.tokenizer is None:
            raise ValueError("string inputs need a tokenizer: init_inference(model, config, tokenizer=...)")
        return split_prompt(self.tokenizer, context, query, limit=self.max_positions)

    @property
    def vocab_size(self) -> Optional[int]:
        return getattr(self.model.config, "vocab_size", None)

    def _check_lengths(self, L: int, Q: int, max_new_tokens: int) -> None:
        inputs.check_positions(L, Q, max_new_tokens, self.max_positions)
        if self.policy is not None:
            self.policy.check(L)

    def _eos_ids(self) -> list[int]:
        ids = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if ids is None and self.tokenizer is not None:
            ids = self.tokenizer.eos_token_id
        if ids is None:
            return []
        return [ids] if isinstance(ids, int) else list(ids)

    def _gather(self, value):
        if self.groups.cp_size == 1:
            return [value]
        out = [None] * self.groups.cp_size
        dist.all_gather_object(out, value, group=self.groups.cp_group)
        return out

    # -- requests -----------------------------------------------------------------------------------------
    def sampling_params(self, *, max_new_tokens: int = 64, stop: Optional[Sequence[str]] = None,
                        temperature: Optional[float] = None, top_p: Optional[float] = None,
                        top_k: Optional[int] = None, seed: Optional[int] = None) -> SamplingParams:
        """One request's :class:`~magnetar.engine.sampling.SamplingParams`: the values given, and for the sampling
        ones left None this engine's ``config.decode`` (temperature, top_p, top_k, seed). A bad value is a
        ValueError naming the field."""
        given = {k: v for k, v in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("seed", seed))
                 if v is not None}
        return SamplingParams.from_decode_config(self.config.decode, max_new_tokens=max_new_tokens,
                                                 stop=stop).replace(**given)

    def sampler(self, params: SamplingParams) -> RequestSampler:
        """A fresh :class:`~magnetar.engine.sampling.RequestSampler` for one request of this engine."""
        return RequestSampler(params, vocab_size=int(self.model.config.vocab_size), eos_ids=self._eos_ids(),
                              tokenizer=self.tokenizer)

    def generate(self, context: Union[str, torch.Tensor], query: Union[str, torch.Tensor], *, max_new_tokens: int = 64,
                 stop: Optional[Sequence[str]] = None, return_logits: bool = False,
                 temperature: Optional[float] = None, top_p: Optional[float] = None, top_k: Optional[int] = None,
                 seed: Optional[int] = None) -> GenerationResult:
        """Answer ``query`` about ``context`` with ``config.method``; see :class:`GenerationResult`.

        ``context`` and ``query`` are both strings (tokenized with the chat template) or both integer token-id
        tensors ``(N,)`` / ``(1, N)``; bad arguments raise ``ValueError`` (:mod:`magnetar.engine.inputs`).
        ``temperature``, ``top_p``, ``top_k`` and ``seed`` default to ``config.decode``'s (:meth:`sampling_params`).
        ``generate(c, q)`` is ``ask(encode(c), q)``."""
        return self.generate_batch([(context, query)], max_new_tokens=max_new_tokens, stop=stop,
                                   return_logits=return_logits, temperature=temperature, top_p=top_p, top_k=top_k,
                                   seed=seed)[0]

    def generate_batch(self, requests: Sequence[tuple[Union[str, torch.Tensor], Union[str, torch.Tensor]]], *,
                       max_new_tokens: int = 64, stop: Optional[Sequence[str]] = None, return_logits: bool = False,
                       temperature: Optional[float] = None, top_p: Optional[float] = None,
                       top_k: Optional[int] = None, seed: Optional[int] = None,
                       deal: bool = False) -> list[GenerationResult]:
        """Several independent ``(context, query)`` requests of any lengths; one result each, on every rank.

        Each context is encoded (:meth:`encode`: its own block plan and KV shard; a context in the cache skips
        Phase 1); Phase 2 and decoding run the requests as one batch (:meth:`ask_batch`: one model forward and one
        collective per layer per step for all unfinished requests). Results equal those of separate
        :meth:`generate` calls: each request samples from its own generator seeded with ``seed``.

        Data parallelism: by default a replica runs the requests it is given (the caller decides what each
        replica serves, as ``magnetar-eval`` and the server do; other replicas need not call). With
        ``deal=True`` every rank of the world calls it with the same list: the requests are dealt to the replicas
        (request i to replica ``i % dp_size``), each runs its share, and the results are gathered over the DP
        group, so every rank returns all of them (the replicas first check they got the same list).
        """
        inputs.check_generate(requests, max_new_tokens, stop, return_logits)
        inputs.check_flag(deal, "deal")
        params = self.sampling_params(max_new_tokens=max_new_tokens, stop=stop, temperature=temperature,
                                      top_p=top_p, top_k=top_k, seed=seed)
        dp, dp_rank = (1, 0) if self.simulated or not deal else (self.groups.dp_size, self.groups.dp_rank)
        toks = [self._tokens(c, q) for c, q in requests]
        if dp > 1:
            # every replica must be dealt from the same list: a mismatch would return other requests' answers
            check_request(self.groups, self.config, self.device, across="dp", entry="generate",
                          contexts=[c for c, _ in toks], queries=[q for _, q in toks],
                          max_new_tokens=params.max_new_tokens, stop=params.stop, return_logits=return_logits,
                          sampling=_sampling_key(params))
        mine = toks[dp_rank::dp]
        results = self._generate_share(mine, params, return_logits) if mine else []
        if dp == 1:
            return results
        shares = [None] * dp
        dist.all_gather_object(shares, results, group=self.groups.dp_group)
        return [shares[i % dp][i // dp] for i in range(len(requests))]

    def _generate_share(self, toks: list[tuple[torch.Tensor, torch.Tensor]], params: SamplingParams,
                        return_logits: bool) -> list[GenerationResult]:
        """This replica's ``(context ids, query ids)`` requests: agreement, length checks, Phase 1, Phase 2."""
        check_request(self.groups, self.config, self.device, entry="generate", contexts=[c for c, _ in toks],
                      queries=[q for _, q in toks], max_new_tokens=params.max_new_tokens, stop=params.stop,
                      return_logits=return_logits, sampling=_sampling_key(params))
        for c, q in toks:
            self._check_lengths(int(c.numel()), int(q.numel()), params.max_new_tokens)
        with nvtx_range(GENERATE):
            encoded = [self._encode(c) for c, _ in toks]
            return self._ask([h for h, _ in encoded], [q for _, q in toks], [hit for _, hit in encoded],
                             [params] * len(toks), return_logits=return_logits)

    def stream(self, context: Union[str, torch.Tensor, ContextHandle], query: Union[str, torch.Tensor], *,
               max_new_tokens: int = 64, stop: Optional[Sequence[str]] = None, temperature: Optional[float] = None,
               top_p: Optional[float] = None, top_k: Optional[int] = None,
               seed: Optional[int] = None) -> Generator[str, None, GenerationResult]:
        """:meth:`generate`, yielding the answer's text in pieces as its tokens are chosen (transformers'
        ``TextIteratorStreamer`` semantics: a piece ends at a space or a newline, never inside a word or a
        character a later token may extend, and never shows text from a stop string on). The pieces joined are
        ``generate(...).text``; the :class:`GenerationResult` is the generator's return value
        (``StopIteration.value``; ``yield from`` gets it). ``context`` may be a handle from :meth:`encode`.
        Every rank iterates to the end (the steps are collectives); closing it early cancels the request on
        the rank that closes it, so close it on every rank alike."""
        batch = self.open_batch()
        rid, event = batch.add(context, query, self.sampling_params(
            max_new_tokens=max_new_tokens, stop=stop, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed))
        try:
            while True:
                if event.text:
                    yield event.text
                if event.stop_reason == "nonfinite":  # as generate raises it
                    batch.pop(rid)
                    raise NonFiniteError(event.error)
                if event.stop_reason is not None:
                    break
                [event] = batch.step()
        finally:
            if rid in batch.active:  # the consumer stopped early
                batch.cancel(rid)
        return batch.pop(rid)

    def open_batch(self, *, return_logits: bool = False) -> "ContinuousBatch":
        """A :class:`~magnetar.engine.batch.ContinuousBatch` on this engine: requests join it between decode steps
        and leave when finished (a server's loop; every rank of the replica makes the same calls)."""
        return ContinuousBatch(self, return_logits=return_logits)

    # -- encoded contexts: encode once, ask many --------------------------------------------------------------
    def encode(self, context: Union[str, torch.Tensor]) -> ContextHandle:
        """Run Phase 1 on ``context`` (a string, tokenized as the chat template's context part, or token ids
        ``(L,)``) on every rank of the replica and return its handle for :meth:`ask`. A context whose token ids
        match a cached handle (``runtime.context_cache_mb``) returns that handle without running Phase 1. Every
        rank calls it with the same context."""
        return self.admit_context(context)[0]

    def admit_context(self, context: Union[str, torch.Tensor, ContextHandle]) -> tuple[ContextHandle, bool]:
        """``(handle, whether it came from the cache)`` for ``context`` (as :meth:`encode`; a handle is returned
        as it is, counted as cached)."""
        if isinstance(context, ContextHandle):
            self._check_handle(context, "context")
            return context, True
        c = self.context_ids(context)
        check_request(self.groups, self.config, self.device, entry="encode", contexts=[c], queries=[])
        self._check_lengths(int(c.numel()), 1, 1)
        with nvtx_range(GENERATE):
            return self._encode(c)

    def ask(self, handle: ContextHandle, query: Union[str, torch.Tensor], *, max_new_tokens: int = 64,
            stop: Optional[Sequence[str]] = None, return_logits: bool = False, temperature: Optional[float] = None,
            top_p: Optional[float] = None, top_k: Optional[int] = None,
            seed: Optional[int] = None) -> GenerationResult:
        """Answer ``query`` (a string, tokenized as the chat template's question part, or token ids) about the
        context of ``handle`` (from :meth:`encode`): Phase 2 and decoding only. The question's decode-policy
        state (LuKA pages and masses, sparse codes) is its own: nothing carries over to the next question.
        ``ask(encode(c), q)`` equals ``generate(c, q)``."""
        return self.ask_batch([handle], [query], max_new_tokens=max_new_tokens, stop=stop,
                              return_logits=return_logits, temperature=temperature, top_p=top_p, top_k=top_k,
                              seed=seed)[0]

    def ask_batch(self, handles: Sequence[ContextHandle], queries: Sequence[Union[str, torch.Tensor]], *,
                  max_new_tokens: int = 64, stop: Optional[Sequence[str]] = None, return_logits: bool = False,
                  temperature: Optional[float] = None, top_p: Optional[float] = None, top_k: Optional[int] = None,
                  seed: Optional[int] = None) -> list[GenerationResult]:
        """:meth:`ask` for several ``(handle, query)`` pairs decoded as one batch (handles may repeat)."""
        inputs.check_flag(return_logits, "return_logits")
        params = self.sampling_params(max_new_tokens=max_new_tokens, stop=stop, temperature=temperature,
                                      top_p=top_p, top_k=top_k, seed=seed)
        if not isinstance(handles, (list, tuple)) or not isinstance(queries, (list, tuple)) or \
                len(handles) != len(queries) or not handles:
            raise ValueError("handles and queries must be non-empty lists of the same length (one query per handle)")
        for i, h in enumerate(handles):
            self._check_handle(h, f"handles[{i}]")
        qids = [self.query_ids(q) for q in queries]
        self.check_ask(handles, qids, params, return_logits)
        with nvtx_range(GENERATE):
            return self._ask(list(handles), qids, [False] * len(handles), [params] * len(handles),
                             return_logits=return_logits)

    def check_ask(self, handles: Sequence[ContextHandle], qids: Sequence[torch.Tensor],
                  params: SamplingParams, return_logits: bool) -> None:
        """The ranks agree on the questions (one small collective) and each fits the model's positions."""
        check_request(self.groups, self.config, self.device, entry="ask", contexts=[h.context_ids for h in handles],
                      queries=list(qids), max_new_tokens=params.max_new_tokens, stop=params.stop,
                      return_logits=return_logits, sampling=_sampling_key(params))
        for h, q in zip(handles, qids):
            self._check_lengths(h.context_tokens, int(q.numel()), params.max_new_tokens)

    def _check_handle(self, h, name: str) -> None:
        if not isinstance(h, ContextHandle) or h.shard is None:
            raise ValueError(f"{name} must be a ContextHandle from this engine's encode(), got {type(h).__name__}")
        if h.engine != self.identity:
            made = h.engine.rsplit(":", 1)[0] if h.engine else "no engine"
            raise ValueError(f"{name} was encoded by another engine ({made}), not this one "
                             f"({self.identity.rsplit(':', 1)[0]}): its KV belongs to that engine's model and "
                             f"weights, so it answers only there; encode the context with this engine "
                             f"(engine.encode(context)) and ask with that handle")

    def cache_key(self, context_ids: torch.Tensor, config: Optional[EngineConfig] = None) -> str:
        """The context cache's key of ``context_ids`` (int64 ``(L,)``) encoded by this engine (or by its variant of
        ``config``, from :meth:`variant_config`): a digest of the ids and of the options that shape the KV (all
        but the decoding, timeouts and cache budget)."""
        return context_key(context_ids, self._kv_options if config is None else _kv_options(config))

    def variant_config(self, **options) -> EngineConfig:
        """The config of :meth:`variant` with ``options``, checked (a ValueError naming an option that cannot
        change per request, or a bad value), without making the variant."""
        for name in options:
            if name not in REQUEST_OPTIONS:
                raise ValueError(f"{name} cannot change per request: only {', '.join(REQUEST_OPTIONS)} can (they "
                                 f"change how a context is encoded, not the ranks' layout or the decoding); start an "
                                 f"engine with {name}={_short_repr(options[name])} for it")
        return self.config.replace(**options)  # validates each value and the method's needs

    def variant(self, **options) -> "Engine":
        """This engine with other per-request options (:data:`REQUEST_OPTIONS`: ``method`` and the fields of the
        ``blocks``, ``pulsar`` and ``streaming`` sections -- how a context is encoded, not the ranks' layout nor
        the decoding): the same model, groups, tokenizer, decode policy and context cache (whose keys include these
        options, so a context encoded two ways is two entries). No option, or the engine's own values: this
        engine. Made without a collective and kept for reuse, the :data:`MAX_VARIANTS` most recently used (a
        variant is a few references; one dropped is made again when asked for); every rank of the replica uses
        the same variants. Another option is a ValueError naming it."""
        config = self.variant_config(**options)
        if config == self.config:
            return self
        with self._variants_lock:
            variant = self._variants.get(config)
            if variant is None:
                variant = copy.copy(self)  # shares the model, groups, policies and the cache
                variant.config, variant._kv_options = config, _kv_options(config)
                variant._variants, variant._variants_lock = OrderedDict(), threading.Lock()
                self._variants[config] = variant
                while len(self._variants) > MAX_VARIANTS:
                    self._variants.popitem(last=False)
            else:
                self._variants.move_to_end(config)
        return variant

    def release(self, handle: ContextHandle) -> bool:
        """Drop ``handle`` from the context cache (every rank calls it); returns whether it was cached."""
        if not isinstance(handle, ContextHandle):
            raise ValueError(f"handle must be a ContextHandle from encode(), got {type(handle).__name__}")
        return self.cache.release(handle)

    def _encode(self, context_ids: torch.Tensor) -> tuple[ContextHandle, bool]:
        """(the handle of ``context_ids``, whether it came from the cache); Phase 1 runs on a miss."""
        key = self.cache_key(context_ids)
        cached = self.cache.get(key)
        if cached is not None:
            return cached, True
        if self.simulated:
            shard, query_position, stats = self._phase1_simulated(context_ids)
            largest = max(st.kv_bytes for st in stats)
        else:
            shard, query_position, stats, largest = self._phase1_distributed(context_ids)
        prefill = None if self.last_prefill_stats is None else self.last_prefill_stats.as_dict()
        handle = ContextHandle(key, context_ids, shard, query_position, stats, prefill, largest, self.config.method,
                               engine=self.identity)
        self.cache.put(handle)
        return handle, False

    def phase2_request(self, handle: ContextHandle, qids: torch.Tensor, sampler: RequestSampler) -> Phase2Request:
        """One question over ``handle``'s KV: a fresh view of the shard (its own decode-policy state)."""
        return Phase2Request(handle.shard.view(), qids, handle.query_position, handle.context_tokens, sampler)

    def _ask(self, handles: list[ContextHandle], qids: list[torch.Tensor], hits: list[bool],
             params: list[SamplingParams], *, return_logits: bool) -> list[GenerationResult]:
        samplers = [self.sampler(p) for p in params]
        requests = [self.phase2_request(h, q, s) for h, q, s in zip(handles, qids, samplers)]
        decs = run_phase2(self.model, self.config, requests, self.groups, self.device, keep_logits=return_logits,
                          policy=self.policy)
        return self.results(handles, qids, hits, decs, samplers)

    def results(self, handles: list[ContextHandle], qids: list[torch.Tensor], hits: list[bool],
                decs: list[DecodeResult], samplers: list[RequestSampler]) -> list[GenerationResult]:
        """The :class:`GenerationResult` of finished requests, with every rank's figures (one gather)."""
        cfg = self.config
        peak = _peak_memory(self.device)
        local = []  # local[request] = per-rank stats this process measured
        for h, hit, d in zip(handles, hits, decs):
            per = []
            for r, st in enumerate(h.stats):  # generated KV sits with the query rank (rank 0, or this one)
                mine = r == 0 or not self.simulated  # simulated ranks decode over one joined shard: stats once
                per.append(dataclasses.replace(
                    st, phase1_seconds=0.0 if hit else st.phase1_seconds,
                    gen_kv_tokens=d.gen_kv_tokens if mine else 0, decode_stats=d.decode_stats if mine else None,
                    peak_memory_bytes=peak if st.peak_memory_bytes is None else st.peak_memory_bytes))
            local.append(per)
        if self.simulated:  # every rank's figures were measured here
            stats = local
        else:
            gathered = self._gather([per[0] for per in local])  # gathered[rank][request]
            stats = [[g[i] for g in gathered] for i in range(len(handles))]
        results = []
        for i, (h, q, dec, sampler) in enumerate(zip(handles, qids, decs, samplers)):
            per_rank = stats[i]
            results.append(GenerationResult(
                text=sampler.text(), token_ids=dec.token_ids, method=h.method or cfg.method,
                context_tokens=h.context_tokens, query_tokens=int(q.numel()), stop_reason=dec.stop_reason,
                phase1_seconds=[s.phase1_seconds for s in per_rank], ttft_seconds=dec.ttft_seconds,
                decode_seconds_per_token=(sum(dec.decode_seconds) / len(dec.decode_seconds)) if dec.decode_seconds
                else None,
                context_kv_tokens_per_rank=[s.context_kv_tokens for s in per_rank],
                kv_tokens_per_rank=[s.kv_tokens for s in per_rank], kv_bytes_per_rank=[s.kv_bytes for s in per_rank],
                peak_memory_bytes_per_rank=[s.peak_memory_bytes for s in per_rank],
                first_token_logits=dec.first_logits, simulated=self.simulated, prefill_stats=h.prefill_stats,
                decode_stats=_sum_stats([s.decode_stats for s in per_rank]),
                weight_bytes_per_rank=list(self.weight_bytes_per_rank),
                cached_context_tokens=h.context_tokens if hits[i] else 0,
            ))
        return results

    @property
    def simulated(self) -> bool:
        """True when this process stands in for ``cp_size`` ranks (``config.parallel.simulate``)."""
        return self.config.parallel.simulate and self.config.parallel.cp_size > 1

    def _check_kept(self, kept: list[int], context_len: int) -> None:
        if sum(kept) != context_len:  # the KV shards must partition the context exactly
            raise RuntimeError(f"Phase 1 kept {sum(kept)} context tokens over the ranks ({kept}) for a "
                               f"{context_len}-token context; the block plan is inconsistent")

    @staticmethod
    def _check_finite(per_rank: list[Optional[int]]) -> None:
        """Every rank raises the same error when any rank's Phase-1 attention turned non-finite."""
        if any(layer is not None for layer in per_rank):
            raise NonFiniteError(f"non-finite values in Phase 1: {describe(per_rank)}; {HINT}")

    def _mass(self, variants: Sequence[Optional[DecodePolicy]] = ()):
        """The recorder of the Phase-1 attention mass of every kept key when the engine's decode policy or one of
        ``variants`` needs it (LuKA), else None."""
        for p in (self.policy, *variants):
            if p is not None and p.needs_prefill_mass:
                return p.prefill_mass
        return None

    def _phase1_distributed(self, context_ids: torch.Tensor, variants: Sequence[Optional[DecodePolicy]] = ()):
        """This rank's Phase 1: (its KV shard, the query position, [its RankStats], the largest shard's bytes over
        the CP ranks); ``variants``: other decode policies the shard will serve (LuKA's need the Phase-1 mass)."""
        plan = plan_rank(self.config, context_ids, self.groups.cp_rank)
        p1 = run_phase1(self.model, self.config, plan, context_ids, self.groups, self.device,
                        mass=self._mass(variants), prefill=self.prefill)
        # one collective for the checks and the shard sizes
        agreed = self._gather((kept_token_count(plan), p1.nonfinite_layer, p1.shard.nbytes()))
        self._check_kept([a[0] for a in agreed], int(context_ids.numel()))
        self._check_finite([a[1] for a in agreed])
        self.last_prefill_stats = None
        if self.prefill is not None:  # every rank's counts of this request, summed
            per_rank = self._gather(p1.prefill_stats)
            self.last_prefill_stats = functools.reduce(lambda a, b: a.merge(b), per_rank)
        stats = RankStats(p1.seconds, p1.shard.tokens(), p1.shard.nbytes())
        return p1.shard, plan.query_position, [stats], max(a[2] for a in agreed)

    def _phase1_simulated(self, context_ids: torch.Tensor, variants: Sequence[Optional[DecodePolicy]] = ()):
        """Every rank's Phase 1 in turn on this device; their KV joined (Phase 2 over the union equals the merge
        over ranks). A method whose ranks run in lock-step (ring: they exchange KV in every layer) gives one plan
        for all of them, run as one forward: one time for all of them."""
        cfg, W = self.config, self.config.parallel.cp_size
        plans = [plan_rank(cfg, context_ids, r) for r in range(W)]
        self._check_kept([kept_token_count(p) for p in plans], int(context_ids.numel()))
        lockstep = context_method(cfg.method).lockstep(plans)
        if lockstep is not None:  # attention by position over the union: exactly what the ranks compute
            p1 = run_phase1(self.model, cfg.replace(method="dense", cp_size=1), lockstep, context_ids, self.groups,
                            self.device)
            self._check_finite([p1.nonfinite_layer])
            sizes = [kept_token_count(p) for p in plans]
            per_token = p1.shard.nbytes() / max(1, sum(sizes))
            stats = [RankStats(p1.seconds if r == 0 else 0.0, n, int(n * per_token)) for r, n in enumerate(sizes)]
            return p1.shard, plans[0].query_position, stats
        parts, stats = [], []
        mass = self._mass(variants)
        self.last_prefill_stats = None
        for plan in plans:
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            p1 = run_phase1(self.model, cfg, plan, context_ids, self.groups, self.device, mass=mass,
                            prefill=self.prefill)
            if p1.prefill_stats is not None:
                self.last_prefill_stats = p1.prefill_stats if self.last_prefill_stats is None else \
                    self.last_prefill_stats.merge(p1.prefill_stats)
            self._check_finite([None] * plan.cp_rank + [p1.nonfinite_layer])
            parts.append(p1.shard)
            stats.append(RankStats(p1.seconds, p1.shard.tokens(), p1.shard.nbytes(), _peak_memory(self.device)))
        if len({p.query_position for p in plans}) != 1:
            raise RuntimeError(f"simulated ranks disagree on the query position: {[p.query_position for p in plans]}")
        return KVShard.join(parts), plans[0].query_position, stats

    def score(self, context: Union[str, torch.Tensor], continuation: Union[str, torch.Tensor]) -> ScoreResult:
        """Log-likelihood of ``continuation`` after ``context`` (for perplexity), with ``config.method``.

        Phase 1 encodes the context as for :meth:`generate`; the continuation then runs teacher-forced as
        the Phase-2 query over the distributed KV (with ``config.sparse`` or ``config.luka``: each of its tokens
        attends to its choice of the context KV, as a decoded token would). Token ``i + 1`` of the continuation is
        scored given the context and tokens ``0..i``, so a continuation of T tokens gives T - 1 log-probabilities.
        Strings are tokenized as plain text (no chat template, no special tokens).
        """
        return self.score_variants(context, continuation, [self._policy_config])[0]

    def score_variants(self, context: Union[str, torch.Tensor], continuation: Union[str, torch.Tensor],
                       sparse: Sequence[Union[None, SparseConfig, LukaConfig]]) -> list[ScoreResult]:
        """:meth:`score` once per decoding variant -- a :class:`SparseConfig` or a :class:`LukaConfig` (None,
        policy ``none`` or mode ``none``: dense decoding) -- over ONE Phase 1: the context KV is encoded once
        and shared, as only the decoding differs (each decoder keeps its own LuKA state)."""
        inputs.check_score(context, continuation, sparse)
        c, t = (self._plain_ids(x) for x in (context, continuation))
        inputs.check_token_ids(c, "context", self.vocab_size, tokenized=isinstance(context, str))
        inputs.check_token_ids(t, "continuation", self.vocab_size, min_tokens=2,
                               tokenized=isinstance(continuation, str))
        check_request(self.groups, self.config, self.device, entry="score", contexts=[c], queries=[t], variants=sparse)
        self._check_lengths(int(c.numel()), int(t.numel()), 1)
        decoders = [self._decoder(v) for v in sparse]
        for dec in decoders:
            if dec is not None:
                dec.check(int(c.numel()))
        mass = self._mass(decoders)
        if mass is not None and self.prefill is not None:
            raise ValueError("LuKA variants need the attention mass of a dense Phase 1, but sparse prefill is on "
                             f"(prefill_policy {self.config.prefill.prefill_policy!r}); score them without it")
        out = []
        with nvtx_range(SCORE):
            if self.simulated:
                shard, start, stats = self._phase1_simulated(c, variants=decoders)
            else:
                shard, start, stats, _ = self._phase1_distributed(c, variants=decoders)
            seconds = [s.phase1_seconds for s in stats] if self.simulated else \
                [g[0].phase1_seconds for g in self._gather(stats)]
            for dec in decoders:
                t0 = time.perf_counter()
                logp = run_scoring(self.model, self.config, shard, t, start, self.groups, self.device,
                                   policy=dec, context_tokens=int(c.numel()))
                out.append(ScoreResult(token_logprobs=logp, method=self.config.method, context_tokens=int(c.numel()),
                                       phase1_seconds=seconds, phase2_seconds=time.perf_counter() - t0,
                                       simulated=self.simulated, prefill_stats=None if self.last_prefill_stats is None
                                       else self.last_prefill_stats.as_dict()))
        return out

    def _decoder(self, cfg: Union[None, SparseConfig, LukaConfig]) -> Optional[DecodePolicy]:
        """The decode policy for a sparse or LuKA config (cached: hash weights load once), None for dense."""
        if cfg is None:
            return None
        if cfg == self._policy_config:
            return self.policy
        if cfg not in self._policies:
            self._policies[cfg] = self._prepare(decode_policy(cfg, self.model.config))
        return self._policies[cfg]

    def _plain_ids(self, x) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            return x.reshape(-1).long().cpu()
        if self.tokenizer is None:
            raise ValueError("string inputs need a tokenizer: init_inference(model, config, tokenizer=...)")
        # user text is text: never a special-token id; one too long for the positions is refused from a prefix
        return encode_text(self.tokenizer, x, limit=self.max_positions, name="context or continuation")


MAX_VARIANTS = 32  # Engine.variant keeps this many (per-request option sets) for reuse

# the options a request may set for itself (Engine.variant): how its context is encoded
REQUEST_OPTIONS = ("method",) + tuple(f.name for sec in ("blocks", "pulsar", "streaming")
                                      for f in dataclasses.fields(type(getattr(EngineConfig(), sec))))


def _short_repr(value) -> str:
    """``value`` for an error message, cheaply (a request's value may be megabytes or a 5000-digit int)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"<a {value.bit_length()}-bit int>"
    text = repr(value[:60]) if isinstance(value, (str, bytes)) else \
        (f"<{type(value).__name__}>" if isinstance(value, (list, dict, tuple, set)) else repr(value))
    return text if len(text) <= 60 else text[:57] + "..."


def _kv_options(config: EngineConfig) -> str:
    """The options of ``config`` that shape an encoded context's KV, as a stable string (a cache-key part): all
    but the decoding, the timeout, the cache budget and the finiteness check."""
    d = config.to_dict()
    d.pop("decode", None)
    for name in ("timeout_s",):
        d["parallel"].pop(name, None)
    for name in ("context_cache_mb", "check_finite"):
        d["runtime"].pop(name, None)
    return json.dumps(d, sort_keys=True, default=str)


def _sampling_key(params: SamplingParams) -> tuple:
    """The sampling fields the ranks must agree on (max_new_tokens and stop are fields of their own)."""
    return params.temperature, params.top_p, params.top_k, params.seed


def init_inference(model, config: Optional[EngineConfig] = None, *, tokenizer=None,
                   groups: Optional[ParallelGroups] = None, revision: Optional[str] = None,
                   trust_remote_code: bool = False, cache_dir=None, **flat) -> Engine:
    """Prepare ``model`` (a loaded HF causal LM, a ``magnetar.models`` name, a local directory or a Hugging Face
    Hub id ``org/name``, told apart in that order: :func:`magnetar.models.load_model`) for Magnetar.

    ``config`` (or flat fields, e.g. ``method="star", cp_size=4``) picks the method. Under a launcher the
    process group is started here if needed; the TP/CP/DP groups come from :func:`magnetar.parallel.init_groups`.
    With ``tp_size > 1`` the model is sharded over its TP group by DeepSpeed AutoTP
    (:func:`shard_tensor_parallel`; ``runtime.deepspeed_inference`` must be on) and ``tp_size`` must divide
    its KV heads. At ``tp_size`` 1 DeepSpeed is not called: with kernel injection off it has nothing to do
    (docs/engine.md, "What DeepSpeed does in Magnetar"). ``tokenizer`` (needed for string prompts; loaded with a
    model given by name or directory) is a Hugging Face tokenizer, or any object whose ``__call__(text,
    add_special_tokens=False, split_special_tokens=True)`` returns ``{"input_ids": [...]}`` and that has
    ``decode`` (user text is tokenized with ``split_special_tokens``: it never yields a control token).
    A model given by name is loaded in ``config.runtime.dtype``; ``revision``, ``trust_remote_code`` and
    ``cache_dir`` (the Hub cache of a Hub id, the prepared-model cache of a registry name) go to its loading; a
    missing Hub model raises ``magnetar.models.ModelNotFoundError`` saying how to get it (``HF_HUB_OFFLINE=1``:
    cache only). ``dtype="auto"`` keeps the checkpoint's dtype, or a given model's own: nothing is cast.
    """
    inputs.check_init(model, config, tokenizer, groups, revision=revision, trust_remote_code=trust_remote_code,
                      cache_dir=cache_dir)
    if config is None:
        config = EngineConfig.create(**flat)
    elif flat:
        config = config.replace(**flat)
    tp = config.parallel.tp_size
    _check_tp_config(config, groups)  # before any model loading or process-group work
    dtype = _TORCH_DTYPES.get(config.runtime.dtype)  # None: "auto"
    folder = None  # under TP, a local folder with safetensors: each rank loads only its shard, below
    if inputs.is_model_path(model):
        name = os.fsdecode(model)
        if tp > 1 and model_kind(name) != "hub" and not trust_remote_code:
            folder = model_path(name, cache_dir)
        if folder is not None and checkpoint_index(folder) is not None:
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(folder, local_files_only=True)
            dtype = dtype or _checkpoint_dtype(hf_config)
        else:  # from_pretrained: resolves (downloads) Hub ids, runs remote code, reads any format; whole (cut by TP)
            model, loaded_tok = load_model(folder or name, dtype=dtype or "auto", revision=revision,
                                           trust_remote_code=trust_remote_code, cache_dir=cache_dir)
            tokenizer = tokenizer or loaded_tok
            folder = None
    if folder is None:
        hf_config = model.config
        dtype = dtype or model_dtype(model)
    hf.check_supported(hf_config)
    hf.check_tensor_parallel(hf_config, tp)
    if folder is None and tp == 1 and getattr(model, "_magnetar_tp", None) is not None:
        raise ValueError(f"the model was sharded by an engine with tp_size {len(model._magnetar_tp)}: give tp_size "
                         f"{len(model._magnetar_tp)}, or pass an unsharded model (a copy of it) for tp_size 1")
    init_distributed(timeout=_timedelta(config.parallel.timeout_s))
    if groups is None:  # simulated ranks live in this process: no group, no collective (even under a launcher)
        timeout = _timedelta(config.parallel.timeout_s)
        groups = local_groups(timeout=timeout) if config.parallel.simulate else \
            init_groups(config.parallel.cp_size, tp_size=tp, timeout=timeout)
    want = 1 if config.parallel.simulate else config.parallel.cp_size
    if groups.cp_size != want:
        raise ValueError(f"groups.cp_size ({groups.cp_size}) != {want} (config cp_size {config.parallel.cp_size}"
                         f"{', simulated in this process' if config.parallel.simulate else ''})")
    device = device_for_rank()
    if folder is not None:
        model, loaded_tok = load_shard(folder, dtype, groups)
        tokenizer = tokenizer or loaded_tok
    else:
        model = model.to(device=device, dtype=dtype)
        if tp > 1:
            model = shard_tensor_parallel(model, groups, dtype)
    hf.prepare_model(model)
    return Engine(model, config, groups, tokenizer)


def _checkpoint_dtype(hf_config) -> torch.dtype:
    """``dtype="auto"`` for a checkpoint folder: the dtype its config names (``dtype`` / ``torch_dtype``), else
    float32."""
    named = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(named, str):
        named = getattr(torch, named, None)
    return named if isinstance(named, torch.dtype) else torch.float32


def _check_tp_config(config: EngineConfig, groups: Optional[ParallelGroups]) -> None:
    tp = config.parallel.tp_size
    if groups is not None and groups.tp_size != tp:
        raise ValueError(f"groups.tp_size ({groups.tp_size}) != config tp_size ({tp}): build the groups with "
                         f"init_groups(cp_size, tp_size={tp}) or set tp_size={groups.tp_size}")
    if tp == 1:
        return
    if config.parallel.simulate:
        raise ValueError(f"tp_size {tp} needs one process per TP rank, but simulate runs the CP ranks in this one "
                         f"process: set simulate false (launch tp_size x cp_size ranks) or tp_size 1")
    if not config.runtime.deepspeed_inference:
        raise ValueError(f"tp_size {tp} shards the model with DeepSpeed AutoTP (deepspeed.init_inference): set "
                         f"runtime.deepspeed_inference true (--deepspeed-inference) or tp_size 1")


def _timedelta(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)
