"""The engine's front door: :class:`Engine` -- generate, generate_batch, stream, encode, ask, ask_batch, score and
per-request variants -- over the modules that do each job.

Data flow of one request (each step its own module)::

    requests.Requests       context / query strings or ids -> checked Phase-1 ids, Phase-2 ids; sampling params
    encode.Encoder          the context cache; Phase 1 (plan.plan_rank, phase1.run_phase1), distributed or
                            simulated -> a ContextHandle holding this rank's KV shard
    batch.ContinuousBatch   the one decode driver: queries join, decode steps (phase2.DecodeBatch: gather +
                            merge per layer), results
    results.Results         the GenerationResult, with every rank's figures

Every rank of a CP group calls the engine with the same arguments (the launcher starts one process per rank;
``agree.check_request`` verifies it before Phase 1); the result, with every rank's measurements, is returned on
every rank. Loading (``init_inference``) is :mod:`magnetar.engine.load`.

Sampling parameters: every entry takes one :class:`~magnetar.engine.sampling.SamplingParams` (``params``, as vLLM
does) and/or its fields as keywords (``max_new_tokens=32, temperature=0.7, stop=["\\n"]``), which change
``params`` -- by default this engine's ``config.decode`` with 64 new tokens (:meth:`Engine.sampling_params`).
"""
from __future__ import annotations

import copy
import threading
import uuid
from collections import OrderedDict
from typing import Any, Generator, Optional, Sequence, Union

import torch

from magnetar.config import METHODS, REQUEST_OPTIONS, EngineConfig, FieldError, PolicySection, short_repr
from magnetar.engine import hf, inputs
from magnetar.engine.batch import ContinuousBatch, Ready
from magnetar.engine.context import ContextCache, ContextHandle, prefix_digest
from magnetar.engine.encode import Encoder, KVRoom, kv_options
from magnetar.engine.gemv import fuse_siblings, pack_for_batches, prepare_cpu_decode_ops, relayout_for_decode
from magnetar.engine.memory import device_room, fails_alone, kv_bytes_per_token, mlp_bytes_per_token, relieve
from magnetar.engine.norms import fuse_norms
from magnetar.engine.rotary import fuse_rotary
from magnetar.engine.phase2 import DecodeBatch
from magnetar.engine.requests import CheckedRequest, Requests, check_fit
from magnetar.engine.results import AnswerScore, GenerationResult, RankStats, Results, ScoreResult  # noqa: F401
from magnetar.engine.sampling import RequestSampler, SamplingParams
from magnetar.engine.score import Scorer, ScoreParts
from magnetar.engine.store import ContextStore, HostTier, layout_name, replica_layouts, weights_fingerprint
from magnetar.engine.static import prepare_graphs
from magnetar.engine.strategy import DecodePolicy, decode_policy, prefill_policy
from magnetar.engine.tensor_parallel import weight_bytes
from magnetar.ops.merge import prepare_merge
from magnetar.parallel import ParallelGroups
from magnetar.parallel.collectives import all_gather_ints, all_gather_objects
from magnetar.utils.nvtx import GENERATE, nvtx_range

Context = Union[str, torch.Tensor]
MAX_VARIANTS = 32  # Engine.variant keeps this many (per-request option sets) for reuse



class Engine:
    """Long-context inference with one method (``config.method``) over one CP group."""

    def __init__(self, model, config: EngineConfig, groups: ParallelGroups, tokenizer=None):
        self.model, self.config, self.groups, self.tokenizer = model, config, groups, tokenizer
        self.device = next(model.parameters()).device
        fuse_siblings(model, self.device)  # on a CPU: q/k/v and gate/up as one matrix-vector product each
        fuse_norms(model, self.device)  # on a CPU: each Llama-family RMSNorm as one pass over a row
        fuse_rotary(model, self.device)  # on a CPU: the rotary embedding as one pass over q or k
        relayout_for_decode(model, self.device)  # on a CPU: the decode step's matrix-vector products' layout
        pack_for_batches(model, self.device)  # on a CPU: oneDNN copies for a batch's few-row products
        # what a ContextHandle is tied to: this engine and its variants (same model object, weights, groups); a
        # handle from another engine -- another model, or the same shapes with other weights -- is refused by ask
        self.identity = f"{type(model).__name__}:{getattr(model.config, 'name_or_path', '') or '?'}:{uuid.uuid4().hex}"
        self.cache = ContextCache(config.runtime.context_cache_mb * 2**20)  # encoded contexts (encode / ask)
        self.store = self._open_store()  # the cache's disk tier (runtime.context_store), or None
        # the cache's host-memory tier (runtime.host_cache_mb): what the cache evicts, copied to the host
        self.host = HostTier(config.runtime.host_cache_mb * 2**20) if config.runtime.host_cache_mb else None
        if self.host is not None:
            host = self.host
            self.cache.on_evict = lambda h: host.save(h, prefix_digest(h.context_ids, h.context_tokens))
        # EngineConfig -> this engine with other per-request options (variant()), least recently used first
        self._variants: OrderedDict = OrderedDict()
        self._variants_lock = threading.Lock()
        # the decode policy the Phase-2 attention asks (sparse decoding or LuKA: the section that names one)
        self._policy_config = config.decode_config
        # prepare_merge first, then each policy's ops: build or load every JIT op this engine's requests will use
        # before any request -- a first build inside a step would keep the other ranks waiting in a collective
        # until its timeout (op builds wait for each other under a file lock, so the ranks leave here within
        # about one build of each other)
        prepare_merge(self.device)
        prepare_cpu_decode_ops(model, self.device, config.runtime.attention_backend, config.runtime.decode_step)
        self.policy: Optional[DecodePolicy] = self._prepare(decode_policy(self._policy_config, model.config))
        # sparse prefill (config.prefill): the Phase-1 attention of the patched layers; decoding stays dense
        self.prefill = self._prepare(prefill_policy(config.prefill, model.config))
        if self.prefill is not None and self.prefill.needs_hidden:
            hf.capture_attention_inputs(model)
        self.requests = Requests(tokenizer, model, config, groups, self.device, self.policy)
        # the weight bytes of every rank of the replica (index cp_rank * tp_size + tp_rank; a shard each under TP),
        # and what each rank's device holds beside them (a context whose KV and Phase-1 activations certainly exceed
        # it is refused by name)
        mine, tp = weight_bytes(model), config.parallel.tp_size
        room = device_room(self.device, mine)
        if self.simulated:
            per_rank = [mine] * config.parallel.cp_size  # each stand-in rank holds the model
        else:
            rows = all_gather_ints([mine, room], groups.replica_group, self.device, timeout=groups.timeout)
            per_rank, room = rows[:, 0].tolist(), int(rows[:, 1].min())
        self.encoder = Encoder(model, config, groups, self.device, self.cache, self.identity, policy=self.policy,
                               prefill=self.prefill, store=self.store, host=self.host,
                               room=KVRoom(kv_bytes_per_token(model, tp), room, mlp_bytes_per_token(model, tp)))
        self.results = Results(groups, self.device, simulated=self.simulated, weight_bytes_per_rank=per_rank,
                               method=config.method, stats_keys=self.policy.stats_keys if self.policy else ())
        self.scorer = self._scorer()
        # runtime.decode_step graph: the decode shapes planned now and, on CUDA, captured as graphs now -- before
        # any request (magnetar.engine.graphs); None for the other steps
        self.decode_graphs = prepare_graphs(model, config, groups, self.device, self.policy, self.max_positions)

    def _open_store(self) -> Optional[ContextStore]:
        """This rank's disk tier under ``runtime.context_store`` (its own folder per rank layout), or None."""
        root = self.config.runtime.context_store
        if root is None:
            return None
        p, g = self.config.parallel, self.groups
        layout = layout_name(self.simulated, g.cp_rank, p.cp_size, g.tp_rank, p.tp_size)
        try:
            return ContextStore(root, layout, weights_fingerprint(self.model),
                                self.config.runtime.context_store_mb * 2**20,
                                peers=replica_layouts(self.simulated, p.cp_size, p.tp_size), replicas=g.dp_size,
                                replica=g.dp_rank)
        except ValueError as e:
            raise FieldError(str(e), "context_store") from None

    def _scorer(self) -> Scorer:
        return Scorer(ScoreParts(self.model, self.config, self.groups, self.device, self.requests, self.encoder,
                                 self.policy, self._policy_config, self.prefill, self._prepare))

    def _prepare(self, policy):
        return ready_policy(policy, self.model, self.groups, self.device)

    @property
    def simulated(self) -> bool:
        """True when this process stands in for ``cp_size`` ranks (``config.parallel.simulate``)."""
        return self.config.parallel.simulate and self.config.parallel.cp_size > 1

    @property
    def max_positions(self) -> Optional[int]:
        """The model's positions, or ``runtime.max_model_len`` below them (:attr:`Requests.max_positions`)."""
        return self.requests.max_positions

    @property
    def vocab_size(self) -> Optional[int]:
        return self.requests.vocab_size

    @property
    def weight_bytes_per_rank(self) -> list[int]:
        return self.results.weight_bytes_per_rank

    # -- inputs ---------------------------------------------------------------------------------------------
    def context_ids(self, context: Context) -> torch.Tensor:
        """Checked context ids ``(L,)`` as :meth:`encode` gets them (:meth:`Requests.context_ids`)."""
        return self.requests.context_ids(context)

    def query_ids(self, query: Context) -> torch.Tensor:
        """Checked query ids ``(Q,)`` as :meth:`ask` gets them (:meth:`Requests.query_ids`)."""
        return self.requests.query_ids(query)

    def sampling_params(self, params: Optional[SamplingParams] = None, **fields: Any) -> SamplingParams:
        """One request's :class:`~magnetar.engine.sampling.SamplingParams`: ``params`` (default: ``config.decode``'s
        temperature, top_p, top_k and seed, 64 new tokens, no stop strings) with ``fields`` changed (temperature,
        top_p, top_k or seed given as None keep the default). A bad value is a ValueError naming the field."""
        return self.requests.sampling_params(params, **fields)

    def check_grammar(self, grammar: str) -> None:
        """A FieldError naming ``grammar`` when llguidance cannot compile it (a structured output's grammar,
        :mod:`magnetar.engine.grammar`) for this model's tokenizer; a grammar that compiled is remembered."""
        self.requests.check_grammar(grammar)

    def sampler(self, params: SamplingParams) -> RequestSampler:
        """A fresh :class:`~magnetar.engine.sampling.RequestSampler` for one request of this engine."""
        return self.requests.sampler(params)

    def check(self, context: Union[Context, ContextHandle], query: Context, params: Optional[SamplingParams] = None,
              *, options: Optional[dict] = None, key: Optional[str] = None,
              default_max_new_tokens: Optional[int] = None, prefill_chunk: int = 0,
              **sampling: Any) -> CheckedRequest:
        """One generation request checked once, into the :class:`~magnetar.engine.requests.CheckedRequest` that
        :meth:`open_batch`'s ``encode`` (and a server's tick) trusts: ``context`` a string, token ids or a handle from
        :meth:`encode`; ``query`` a string or ids; ``params`` / ``sampling`` as for :meth:`generate`; ``options``
        this request's encoding options (:meth:`variant`); ``key`` the context's cache key when the caller has it;
        ``default_max_new_tokens``: with no ``max_new_tokens`` given, at most this many, capped to the positions
        left; ``prefill_chunk``: the caller encodes a longer context in chunks of this many tokens (a server's
        ``--prefill-chunk``; it applies where :meth:`chunk_problem` is None), so the room check counts a chunk's
        activations, not the whole context's. A bad request raises :class:`~magnetar.config.FieldError` naming its
        field (``context``, ``query``, ``max_new_tokens``, a sampling field, ``options.<name>``). No collective, no
        compute."""
        if options is not None and not isinstance(options, dict):
            raise FieldError(f"options must be a dict of engine options (e.g. {{'method': 'star'}}), got "
                             f"{type(options).__name__}", "options")
        handle = context if isinstance(context, ContextHandle) else None
        if options and handle is not None:
            raise FieldError("options choose how a context is encoded; this context is a handle, already encoded: "
                             "pass its text or ids, or no options", "options")
        try:
            engine = self.variant(**options) if options else self
        except FieldError as e:
            raise FieldError(str(e), f"options.{e.field}") from None
        if handle is not None:
            engine.encoder.check_handle(handle, "context")

        def checked(by: "Engine") -> CheckedRequest:
            req = by.requests.check(None if handle is not None else context, query, params,
                                    key_of=by.encoder.key, options=options, key=key, handle=handle,
                                    default_max_new_tokens=default_max_new_tokens, **sampling)
            enc = by.encoder
            # a context that certainly cannot fit: refused now, not after a queue and a tick -- one the cache holds
            # needs nothing more; one a lower tier holds, its KV; a kept prefix is extended: the new tokens run
            if handle is None and req.key not in enc.cache:
                enc.check_room(req.context_tokens, prefill_chunk if by.chunk_problem() is None else 0,
                               enc.held_tokens(req.context_ids, req.key))
            return req

        try:
            return checked(engine)
        except FieldError as e:
            if options and e.setting in options:  # the method's plan refused an option's value for this context
                raise FieldError(str(e), f"options.{e.setting}") from None
            if engine is self or e.field != "context":
                raise
            try:  # the context fits this engine's own way: the request's options cannot run it
                checked(self)
            except ValueError:
                raise e from None
            raise FieldError(str(e), f"options.{next(iter(options))}") from None

    # -- generation -----------------------------------------------------------------------------------------
    def generate(self, context: Context, query: Context, params: Optional[SamplingParams] = None, *,
                 return_logits: bool = False, **sampling: Any) -> GenerationResult:
        """Answer ``query`` about ``context`` with ``config.method``; see :class:`GenerationResult`.

        ``context`` and ``query`` are both strings (tokenized with the chat template) or both integer token-id
        tensors ``(N,)`` / ``(1, N)``; bad arguments raise ``ValueError`` (:mod:`magnetar.engine.inputs`).
        ``params`` / ``sampling``: see the module docstring. ``generate(c, q)`` is ``ask(encode(c), q)``."""
        return self.generate_batch([(context, query)], params, return_logits=return_logits, **sampling)[0]

    def generate_batch(self, requests: Sequence[tuple[Context, Context]], params: Optional[SamplingParams] = None, *,
                       return_logits: bool = False, deal: bool = False, **sampling: Any) -> list[GenerationResult]:
        """Several independent ``(context, query)`` requests of any lengths; one result each, on every rank.

        Each context is encoded (its own block plan and KV shard; a context in the cache skips Phase 1); Phase 2
        and decoding run the requests as one batch (one model forward and one collective per layer per step for
        all unfinished requests). Results equal those of separate :meth:`generate` calls: each request samples
        from its own generator seeded with ``seed``.

        Data parallelism: by default a replica runs the requests it is given (the caller decides what each
        replica serves, as ``magnetar-eval`` and the server do; other replicas need not call). With
        ``deal=True`` every rank of the world calls it with the same list: the requests are dealt to the replicas
        (request i to replica ``i % dp_size``), each runs its share, and the results are gathered over the DP
        group, so every rank returns all of them (the replicas first check they got the same list).
        """
        inputs.check_requests(requests)
        inputs.check_flag(return_logits, "return_logits")
        inputs.check_flag(deal, "deal")
        params = self.sampling_params(params, **sampling)
        dp, dp_rank = (1, 0) if self.simulated or not deal else (self.groups.dp_size, self.groups.dp_rank)
        toks = [self.requests.pair(c, q) for c, q in requests]
        if dp > 1:  # every replica must be dealt from the same list: a mismatch would return others' answers
            self.requests.agree("generate", [c for c, _ in toks], [q for _, q in toks], params,
                                return_logits=return_logits, across="dp")
        mine = toks[dp_rank::dp]
        results = self._generate_share(mine, params, return_logits) if mine else []
        if dp == 1:
            return results
        shares = all_gather_objects(results, self.groups.dp_group, self.device, timeout=self.groups.timeout)
        return [shares[i % dp][i // dp] for i in range(len(requests))]

    def _generate_share(self, toks: list[tuple[torch.Tensor, torch.Tensor]], params: SamplingParams,
                        return_logits: bool) -> list[GenerationResult]:
        """This replica's ``(context ids, query ids)`` requests: agreement, their checks, then :meth:`_run`."""
        self.requests.agree("generate", [c for c, _ in toks], [q for _, q in toks], params,
                            return_logits=return_logits)
        return self._run([self.check(c, q, params) for c, q in toks], return_logits)

    def _run(self, requests: list[CheckedRequest], return_logits: bool) -> list[GenerationResult]:
        """Checked requests (the ranks agreed on them) to their results, through the one decode driver -- a
        :class:`~magnetar.engine.batch.ContinuousBatch` that every request joins at once (their queries in one
        forward) and leaves when finished -- without isolation: a request's NaN or failed token choice raises on
        every rank, as :meth:`generate` documents. A request with a handle (:meth:`ask`) reports its Phase 1 as the
        handle measured it (not as a cache hit)."""
        batch = self._open(return_logits=return_logits, agree=False, isolate=False)
        with nvtx_range(GENERATE):
            ready = [batch.encode(r) if r.handle is None else Ready(r.handle, False, r.query_ids, r.params)
                     for r in requests]
            rids = [rid for rid, _ in batch.join(ready)]
            while batch.active:
                batch.step()
        return batch.pop_all(rids)

    def stream(self, context: Union[Context, ContextHandle], query: Context, params: Optional[SamplingParams] = None,
               **sampling: Any) -> Generator[str, None, GenerationResult]:
        """:meth:`generate`, yielding the answer's text in pieces as its tokens are chosen (transformers'
        ``TextIteratorStreamer`` semantics: a piece ends at a space or a newline, never inside a word or a
        character a later token may extend, and never shows text from a stop string on). The pieces joined are
        ``generate(...).text``; the :class:`GenerationResult` is the generator's return value
        (``StopIteration.value``; ``yield from`` gets it). ``context`` may be a handle from :meth:`encode`.
        Every rank iterates to the end (the steps are collectives); closing it early cancels the request on
        the rank that closes it, so close it on every rank alike."""
        batch = self.open_batch()
        rid, event = batch.add(context, query, self.sampling_params(params, **sampling))
        try:
            while True:
                if event.text:
                    yield event.text
                failure = event.failure()  # its own NaN (as generate raises it) or its token choice raised
                if failure is not None:
                    batch.pop(rid)
                    raise failure
                if event.stop_reason is not None:
                    break
                [event] = batch.step()
        finally:
            if rid in batch.active:  # the consumer stopped early
                batch.cancel(rid)
        return batch.pop(rid)

    def open_batch(self, *, return_logits: bool = False, agree: bool = True) -> ContinuousBatch:
        """A :class:`~magnetar.engine.batch.ContinuousBatch` on this engine: requests join it between decode steps
        and leave when finished (a server's loop; every rank of the replica makes the same calls); one request's
        NaN or failed token choice fails it alone. ``agree=False`` drops the per-request agreement collective, for
        a caller that already broadcasts the requests."""
        return self._open(return_logits=return_logits, agree=agree, isolate=True)

    def _open(self, *, return_logits: bool, agree: bool, isolate: bool) -> ContinuousBatch:
        decode = DecodeBatch(self.model, self.config, self.groups, self.device, policy=self.policy,
                             keep_logits=return_logits, isolate=isolate, graphs=self.decode_graphs)
        return ContinuousBatch(self.check, self._source, decode, self.results, return_logits=return_logits,
                               agree=agree)

    def _source(self, options: Optional[dict]) -> tuple[Requests, Encoder]:
        """The requests and encoder of this engine, or of its variant with ``options`` (ContinuousBatch)."""
        engine = self.variant(**options) if options else self
        return engine.requests, engine.encoder

    # -- encoded contexts: encode once, ask many --------------------------------------------------------------
    def encode(self, context: Context) -> ContextHandle:
        """Run Phase 1 on ``context`` (a string, tokenized as the chat template's context part, or token ids
        ``(L,)``) on every rank of the replica and return its handle for :meth:`ask`. A context whose token ids
        match a cached handle (``runtime.context_cache_mb``) returns that handle without running Phase 1. Every
        rank calls it with the same context."""
        c = self.requests.context_ids(context)
        self.requests.agree("encode", [c], [])
        self.requests.check_lengths(int(c.numel()), 1, 1)
        with nvtx_range(GENERATE):
            return self.encoder.encode(c)[0]

    def ask(self, handle: ContextHandle, query: Context, params: Optional[SamplingParams] = None, *,
            return_logits: bool = False, **sampling: Any) -> GenerationResult:
        """Answer ``query`` (a string, tokenized as the chat template's question part, or token ids) about the
        context of ``handle`` (from :meth:`encode`): Phase 2 and decoding only. The question's decode-policy
        state (LuKA pages and masses, sparse codes) is its own: nothing carries over to the next question.
        ``ask(encode(c), q)`` equals ``generate(c, q)``."""
        return self.ask_batch([handle], [query], params, return_logits=return_logits, **sampling)[0]

    def ask_batch(self, handles: Sequence[ContextHandle], queries: Sequence[Context],
                  params: Optional[SamplingParams] = None, *, return_logits: bool = False,
                  **sampling: Any) -> list[GenerationResult]:
        """:meth:`ask` for several ``(handle, query)`` pairs decoded as one batch (handles may repeat)."""
        inputs.check_flag(return_logits, "return_logits")
        params = self.sampling_params(params, **sampling)
        if not isinstance(handles, (list, tuple)) or not isinstance(queries, (list, tuple)) or \
                len(handles) != len(queries) or not handles:
            raise ValueError("handles and queries must be non-empty lists of the same length (one query per handle)")
        for i, h in enumerate(handles):
            self.encoder.check_handle(h, f"handles[{i}]")  # by its place in the list (check names it "context")
        checked = [self.check(h, q, params) for h, q in zip(handles, queries)]
        self.requests.agree("ask", [h.context_ids for h in handles], [r.query_ids for r in checked], params,
                            return_logits=return_logits)
        return self._run(checked, return_logits)

    # -- the context cache, as a server plans with it -------------------------------------------------------
    def is_cached(self, key: str) -> bool:
        """Whether the context cache -- or a lower tier of this rank's, loadable -- holds the context of cache key
        ``key`` (:meth:`cache_key`; :meth:`Encoder.comes_back`: a fork's own entries in host memory count only while
        their document comes back too)."""
        return self.encoder.comes_back(key)

    def is_stored(self, key: str) -> bool:
        """Whether this rank's disk tier (``runtime.context_store``) holds the context of cache key ``key``."""
        return self.store is not None and key in self.store

    def cached_prefix_tokens(self, context_ids: torch.Tensor) -> int:
        """How many first tokens of ``context_ids`` the longest cached (or, on this rank, stored) proper prefix
        encoded this engine's way holds (0: none), without touching the cache's recency order (a server's leader
        plans with it; the ranks' caches must stay alike)."""
        return max(self.cache.prefix_tokens(context_ids, self.encoder.identity, self.encoder.options_digest),
                   self.encoder.tier_prefix_tokens(context_ids))

    def cache_stats(self) -> dict:
        """The context cache's figures: handles, bytes, budget_bytes, hits, misses, evictions, prefix_hits; with
        a host-memory or disk tier, its own under ``host`` / ``store`` (contexts, bytes, budget_bytes, loads,
        writes, evictions, refused)."""
        stats = self.cache.stats()
        if self.host is not None:
            stats["host"] = self.host.stats()
        if self.store is not None:
            stats["store"] = self.store.stats()
        return stats

    def pin(self, handle: ContextHandle) -> None:
        """Keep ``handle``'s stored copy until :meth:`unpin` (a context pinned through the server's API: the disk
        tier does not evict it). Every rank calls it."""
        if self.store is not None:
            self.store.pin(handle.key)

    def unpin(self, handle: ContextHandle) -> None:
        if self.store is not None:
            self.store.unpin(handle.key)

    def flush_store(self, timeout_s: float = 600) -> None:
        """Wait until this rank's disk tier has written every context encoded so far (a draining server, tests)."""
        if self.store is not None:
            self.store.flush(timeout_s)

    def chunk_problem(self) -> Optional[str]:
        """Why this engine does not run a long context's Phase 1 in chunks (a server's ``--prefill-chunk``), or
        None: a chunk extends the chunks before it as prefix reuse does (:meth:`encode_chunk`), which is the exact
        Phase 1 only for an exact method (the registry's fact, never a list of names) on one CP rank (on several
        ranks every chunk's KV would pile up on the first) that extends prefixes."""
        cfg = self.config
        if cfg.parallel.cp_size > 1:
            return f"cp_size {cfg.parallel.cp_size}: each rank encodes its own block of the context (not chunked yet)"
        if not METHODS[cfg.method].exact:
            return f"method {cfg.method!r}: its Phase 1 is not a causal pass over the context"
        return self.encoder.can_extend()

    def encode_chunk(self, context_ids: torch.Tensor, base: Optional[ContextHandle] = None) -> ContextHandle:
        """One chunk of a long context's Phase 1 (:meth:`chunk_problem` is None): ``context_ids`` -- the context's
        first tokens, already checked -- extending ``base``, the caller's handle of the chunks before (None: the
        first chunk, which extends the longest cached prefix, if any). The handle is the caller's alone: it never
        enters the cache (a partial context only its request extends). Every rank of the replica calls it alike."""
        with nvtx_range(GENERATE):
            return self.encoder.encode(context_ids, base=base, keep=False)[0]

    def min_context_tokens(self, options: Optional[dict] = None) -> int:
        """The fewest context tokens this engine's method (or its variant's with ``options``) accepts: one per CP
        rank, else one block (``block_size``) -- a scored prompt's Phase-1 part."""
        config = self.variant_config(**options) if options else self.config
        candidates = [max(1, config.parallel.cp_size)]
        if config.blocks.block_size is not None:
            candidates.append(max(candidates[0], config.blocks.block_size))
        for c in candidates:
            try:
                check_fit(c, 1, None, max_positions=self.max_positions, config=config, policy=self.policy)
                return c
            except ValueError:
                continue
        return candidates[-1]  # refused later by the request's check, with its message

    def relieve_memory(self) -> int:
        """Free what this rank's device holds for later -- a request ran out of device memory
        (:func:`magnetar.engine.memory.relieve`): every cached context (a host-memory tier keeps its copy; one a
        request still reads lives until it ends), then the allocators' unused blocks. Returns the bytes of contexts
        dropped. Every rank of a replica calls it alike (their caches stay alike)."""
        return relieve(self.cache, self.device)

    def fit_failure(self, error: BaseException) -> str:
        """``"<Type>: <first line>"`` of ``error`` when it says a request did not fit memory and the request may fail
        alone on this replica (:func:`magnetar.engine.memory.fails_alone`: the refusal before Phase 1 always, a failed
        allocation where one process holds the replica), the device's cached contexts dropped
        (:meth:`relieve_memory`); anything else is re-raised. A sweep (``magnetar eval``, ``magnetar bench``)
        records such an item and goes on."""
        if not fails_alone(error, self.groups.replica_size):
            raise error
        self.relieve_memory()
        first = str(error).splitlines()[0][:400] if str(error) else ""
        return f"{type(error).__name__}: {first}"

    def release(self, handle: ContextHandle) -> bool:
        """Drop ``handle`` from the context cache (every rank calls it); returns whether it was cached."""
        if not isinstance(handle, ContextHandle):
            raise ValueError(f"handle must be a ContextHandle from encode(), got {type(handle).__name__}")
        return self.cache.release(handle)

    # -- per-request options --------------------------------------------------------------------------------
    def cache_key(self, context_ids: torch.Tensor, config: Optional[EngineConfig] = None) -> str:
        """The context cache's key of ``context_ids`` (int64 ``(L,)``) encoded by this engine (or by its variant of
        ``config``, from :meth:`variant_config`): a digest of the ids and of the options that shape the KV (all
        but the decoding, timeouts and cache budget)."""
        return self.encoder.key(context_ids) if config is None else self.encoder.with_config(config).key(context_ids)

    def variant_config(self, **options) -> EngineConfig:
        """The config of :meth:`variant` with ``options``, checked (a ValueError naming an option that cannot
        change per request, or a bad value), without making the variant."""
        for name in options:
            if name not in REQUEST_OPTIONS:
                raise FieldError(f"{name} cannot change per request: only {', '.join(REQUEST_OPTIONS)} can (they "
                                 f"change how a context is encoded, not the ranks' layout or the decoding); start an "
                                 f"engine with {name}={short_repr(options[name])} for it", name)
        try:
            return self.config.replace(**options)  # validates each value and the method's needs
        except FieldError as e:
            if e.field in options:
                raise
            raise FieldError(str(e), next(iter(options))) from None  # another field's check: the options' values
        except ValueError as e:  # the options together (a method's needs)
            raise FieldError(str(e), next(iter(options))) from None

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
                variant = copy.copy(self)  # shares the model, groups, policies, cache and results
                variant.config, variant.encoder = config, self.encoder.with_config(config)
                variant.requests = Requests(self.tokenizer, self.model, config, self.groups, self.device, self.policy)
                variant.scorer = variant._scorer()
                variant._variants, variant._variants_lock = OrderedDict(), threading.Lock()
                self._variants[config] = variant
                while len(self._variants) > MAX_VARIANTS:
                    self._variants.popitem(last=False)
            else:
                self._variants.move_to_end(config)
        return variant

    # -- scoring --------------------------------------------------------------------------------------------
    def score(self, context: Context, continuation: Context) -> ScoreResult:
        """Log-likelihood of ``continuation`` after ``context`` (for perplexity), with ``config.method``.

        Phase 1 encodes the context as for :meth:`generate`; the continuation then runs teacher-forced as
        the Phase-2 query over the distributed KV (with a decode policy, ``config.decode_config``: each of its tokens
        attends to its choice of the context KV, as a decoded token would). Token ``i + 1`` of the continuation is
        scored given the context and tokens ``0..i``, so a continuation of T tokens gives T - 1 log-probabilities.
        Strings are tokenized as plain text (no chat template, no special tokens).
        """
        return self.scorer.score_variants(context, continuation, [self._policy_config])[0]

    def score_answer(self, context: Context, query: Context, answer: Union[torch.Tensor, list]) -> AnswerScore:
        """The model's distribution at every token of ``answer`` (token ids, e.g. another method's greedy
        ``GenerationResult.token_ids``) teacher-forced after ``query`` about ``context`` (strings as for
        :meth:`generate`, or ids), with ``config.method`` and this engine's decode policy: the input of fidelity
        measures (KL, top-1 agreement) against a reference method. Phase 1 goes through the context cache, so
        scoring the answer :meth:`generate` just gave costs one Phase-2 forward."""
        c, q = self.requests.pair(context, query)
        a = inputs.answer_ids(answer, self.vocab_size)
        return self.scorer.answer(c, q, a)

    def score_variants(self, context: Context, continuation: Context,
                       sparse: Sequence[Optional[PolicySection]]) -> list[ScoreResult]:
        """:meth:`score` once per decoding variant -- a :class:`SparseConfig` or a :class:`LukaConfig` (None,
        policy ``none`` or mode ``none``: dense decoding) -- over ONE Phase 1: the context KV is encoded once
        and shared, as only the decoding differs (each decoder keeps its own LuKA state)."""
        return self.scorer.score_variants(context, continuation, sparse)


def ready_policy(policy, model, groups: ParallelGroups, device: torch.device):
    """``policy`` ready for this rank: under tensor parallelism ``policy.shard_heads(...)`` with this rank's KV
    heads (the policy bases refuse by default), then ``policy.prepare(device)``; None stays None."""
    if policy is None:
        return None
    tp, rank = groups.tp_size, groups.tp_rank
    if tp > 1:
        cfg = model.config
        total = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        policy.shard_heads(rank * total // tp, total // tp, total)
    policy.prepare(device)
    return policy


__all__ = ["Engine", "GenerationResult", "ScoreResult", "RankStats", "REQUEST_OPTIONS", "MAX_VARIANTS", "kv_options",
           "weight_bytes"]
