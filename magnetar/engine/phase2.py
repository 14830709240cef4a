"""Phase 2 and decoding: the query attends to the whole distributed KV cache, then tokens are generated.

Every CP rank runs the same forward on the same tokens (the query, then each generated token): attention
over its own context shard, and on the query rank (cp_rank 0, the only one that stores query/generated KV)
over those tokens causally; one packed all-gather of ``(out, lse)`` per layer and the merge make every
rank's output identical. The next token is chosen on the query rank (greedy or seeded sampling) and
broadcast, so all ranks decode the same sequence. Stops at EOS, a stop string or ``max_new_tokens``.

Several independent requests decode as one batch (:class:`DecodeBatch`): each has its own KV (attention runs
per request inside the layer, everything else batched, one collective per layer for the batch); queries of
different lengths are right-padded and the padding never reaches a KV store. Requests join the batch between
steps and leave it when finished (continuous batching); each has its own :class:`TokenChooser`.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from magnetar.config import EngineConfig
from magnetar.engine.finite import HINT, LayerFlags, NonFiniteError, describe
from magnetar.engine.kv import KVShard, LayerKV
from magnetar.engine.graphs import DecodeGraphs
from magnetar.engine.sampling import NOTHING_TO_SAMPLE, SamplingParams, sample_rows
from magnetar.engine.static import ContextKernelFailed, StaticDecode, static_problem
from magnetar.engine.strategy import DecodePolicy, LayerContext
from magnetar.ops import attention_with_lse, merge_states
from magnetar.ops.merge import merge_requests
from magnetar.ops.nonfinite import all_finite
from magnetar.ops.pages import Page, attend_pages
from magnetar.parallel import ParallelGroups, all_gather_states
from magnetar.parallel.collectives import all_gather_ints, wait_all
from magnetar.utils.nvtx import (PHASE2_DECODE_STEP, PHASE2_GATHER, PHASE2_LAYER, PHASE2_MERGE, PHASE2_QUERY,
                                 PHASE2_SAMPLE, PHASE2_SCORE, nvtx_range)
from magnetar.utils.sync import to_device

log = logging.getLogger(__name__)


# the fewest keys of a cached store several requests of a decode step read, for their rows to attend it in one call of
# its own (Phase2Context._shared_context); a shorter one -- a chat template's system prompt every request begins with
# -- is read as one more page of each request's paged call: the extra call and merge a layer cost more than reading
# a few dozen keys once per request (8 clients over a 24-token system prompt: 80-84 against ~72 ms a step at batch 8)
SHARED_MIN_KEYS = 256


class Phase2Context(LayerContext):
    """The Phase-2 forward of a batch of B requests, each with its own KV.

    ``positions (B, S)``; ``shards[b]`` is this rank's context KV of request b (a view: a fork's in segments,
    each attended as a part of its own -- :meth:`~magnetar.engine.kv.KVShard.segments`); ``gens[b]`` the query rank's
    store of request b's query/generated KV (None on the other ranks); ``valid[b]`` how many of the S input
    tokens of request b are real (queries of different lengths are right-padded; padding sits after the real
    tokens, so no real token sees it, and its KV is never stored). ``policy`` (a
    :class:`~magnetar.engine.strategy.DecodePolicy`, or None for dense decoding) chooses the context KV each
    token attends to; ``context_tokens[b]`` is request b's whole context length (over all ranks).

    Per layer: local parts (context shard -- through the policy where it applies --, and on the query rank
    the query/generated KV, causally; a policy with ``pages_generated`` attends that KV too, in the same call)
    -> one packed all-gather of ``(out, lse)`` for the batch -> the merge.
    Every rank ends with the same output, so every rank runs the same model forward.

    ``starts[b]``: request b's first position on the host (``positions[b, 0]``), when the caller knows it. In a
    decode step (one token each, no decode policy applying) whose every context shard precedes its token, each
    request's parts are then pages of one attention (:func:`magnetar.ops.pages.attend_pages`) -- under a sliding
    window the keys in it, where positions are consecutive --: the whole batch in ONE kernel launch a layer where the
    backend has a paged kernel (``cpu_decode``; ``triton_decode`` on CUDA), else its kernel page by page with ONE
    finite check a layer, rather than two front-end calls (two host reads each) and a merge a request.
    """

    layer_range = PHASE2_LAYER

    def __init__(self, positions: torch.Tensor, shards: list[KVShard], gens: Optional[list[KVShard]],
                 valid: list[int], groups: ParallelGroups, backend: str, policy: Optional[DecodePolicy] = None,
                 context_tokens: Optional[list[int]] = None, check_finite: bool = False,
                 starts: Optional[list[int]] = None):
        self.positions, self.shards, self.gens, self.valid = positions, shards, gens, valid
        self.starts = starts
        self._stored = -1  # the layer whose own-token KV _paged stored already (its fallback must not again)
        self.groups, self.group, self.timeout, self.backend = groups, groups.cp_group, groups.timeout, backend
        self.policy, self.context_tokens = policy, context_tokens
        # runtime.check_finite: which layers' local states (before the merge) were not finite on this rank
        self.flags = LayerFlags(shards[0].num_layers, positions.device) if check_finite else None

    def check_logits(self, logits: torch.Tensor, what: str) -> None:
        """Raise :class:`NonFiniteError` if ``logits`` are not finite (every rank sees the same logits, so every
        rank raises; they first gather where their local states turned non-finite)."""
        if self.flags is None or all_finite(logits):
            return
        raise NonFiniteError(self.nonfinite_message(what))

    def nonfinite_message(self, what: str) -> str:
        """Why logits of this forward were not finite: where the local states first turned non-finite on each CP
        rank (``runtime.check_finite``; a gather over the CP group: every rank of it calls this together)."""
        if self.flags is None:
            return f"non-finite logits in Phase 2 ({what}); {HINT}"
        mine = self.flags.first()
        per_rank = [mine]
        if self.groups.cp_size > 1:  # an integer gather (-1: finite everywhere on that rank)
            got = all_gather_ints([-1 if mine is None else mine], self.group, self.positions.device,
                                  timeout=self.groups.timeout)[:, 0].tolist()
            per_rank = [None if x < 0 else x for x in got]
        return f"non-finite logits in Phase 2 ({what}): {describe(per_rank)}; {HINT}"

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: Optional[int] = None) -> torch.Tensor:
        local_o, local_l = self.local_state(layer, q, k, v, scale, window)
        if self.flags is not None:
            self.flags.record(layer, local_o)
        if self.groups.cp_size == 1:  # one rank: its state is the result (a merge of one state is the identity on
            out, lse = local_o, local_l  # what attention_with_lse and merge_states give: (0, -inf) or NaN rows)
        else:
            with nvtx_range(PHASE2_GATHER, n=layer):  # one collective per layer for the whole batch
                outs, lses = all_gather_states(local_o, local_l, self.group, timeout=self.timeout)
            with nvtx_range(PHASE2_MERGE, n=layer):
                out, lse = merge_states(outs, lses)
        if self.policy is not None:  # e.g. LuKA accumulates the attention mass, normalised by the merged lse
            self.policy.after_merge(layer, lse)
        return out

    def local_state(self, layer: int, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                    scale: float, window: Optional[int] = None, own: Optional[list] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's state ``(out (B, Hq, S, D), lse (B, Hq, S))`` of the batch over what it holds (before the CP
        gather): the context shards' and, on the query rank, the own tokens' (``k``, ``v``: this forward's, stored
        there). With no ``gens``: the context part, and ``own[b]`` -- row b's own tokens' ``(k, v (1, Hkv, n, D))``
        held elsewhere, at consecutive positions ending at its token (None: none) -- in the same softmax: what a
        static decode step reads where no pointer kernel runs (:mod:`magnetar.engine.static`: its slots)."""
        B, Hq, S, D = q.shape
        shared = self._shared_context(layer, q, scale, window) if B > 1 and S == 1 else {}
        paged = self._paged(layer, q, k, v, scale, window, shared, own)
        if paged is not None and not shared:
            local_o, local_l = paged
        elif paged is not None:  # a request on a shared context: that call's state merged with its other pages'
            mine = [[(paged[0][b : b + 1], paged[1][b : b + 1])] for b in range(B)]
            local_o, local_l = merge_requests([[*shared[b].values(), *p] if b in shared else p
                                               for b, p in enumerate(mine)], q)
        else:  # requests hold KV of different lengths: each attends its own (its context part, its own tokens)
            parts = [self._local(layer, b, q, k, v, scale, window, shared.get(b), own[b] if own else None)
                     for b in range(B)]
            local_o, local_l = merge_requests(parts, q)
        return local_o, local_l

    def _shared_context(self, layer: int, q: torch.Tensor, scale: float, window: Optional[int]
                        ) -> dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
        """The context part of the requests of a decode step (one new token each) that read the same cached
        context store -- several questions about one document, or conversations forking from it (the segment they
        share) --, in ONE call per store: their query rows laid side by side over its KV (each row at its own
        position), so the store is read once per step rather than once per request (the rows are independent: the
        same states as a call each). Request b -> {segment j of its shard -> ``(o (1, Hq, 1, D), lse (1, Hq,
        1))``}; segments read by one request alone, and requests a decode policy serves, are not here."""
        groups: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
        for b, shard in enumerate(self.shards):
            if self.policy is not None and self.policy.applies(layer, window):
                continue
            for j, ctx in enumerate(shard.segments(layer)):
                groups.setdefault((id(ctx.k), id(ctx.v), id(ctx.pos)), []).append((b, j))
        out: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for members in groups.values():
            if len(members) < 2:
                continue
            ctx = self.shards[members[0][0]].segments(layer)[members[0][1]]
            if len(ctx) < SHARED_MIN_KEYS:  # a short store (a system prompt): read with each request's pages
                continue
            rows = [b for b, _ in members]
            idx = torch.tensor(rows, device=q.device)
            qs = q.index_select(0, idx).transpose(0, 2)  # (n, Hq, 1, D) -> (1, Hq, n, D): a row per request
            # every key before every row's token (host facts): the FULL kind, no positions to read; else they decide
            full = window is None and all(self._seen_from(b, ctx, None, own=False) == 0 for b in rows)
            where = {} if full else dict(q_pos=self.positions.index_select(0, idx)[:, 0], k_pos=ctx.pos, window=window)
            o, l = attention_with_lse(qs, ctx.k, ctx.v, causal=not full, scale=scale, backend=self.backend,
                                      k_finite=ctx.keys_finite(), **where)
            for i, (b, j) in enumerate(members):
                out.setdefault(b, {})[j] = (o[:, :, i:i + 1], l[:, :, i:i + 1])
        return out

    def _paged(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: Optional[int], shared: dict, own: Optional[list] = None
               ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The batch's local state in one paged call (class docstring) -- for a request in ``shared`` the state of
        its pages but the segments attended already (with the others on the same store) --, or None: the
        per-part path (not a decode step, a decode policy here, a context shard not wholly before its request's token
        -- or, under a window, not at consecutive positions --, the paged call refused, or a value that was not
        finite: that path applies the exact rules). Under a window a page is the part of a store the window keeps
        (the own tokens sit at consecutive positions ending at the token by construction). The query rank's tokens'
        KV is stored here (as :meth:`_local` does) before the pages are read; only then can the call still say None,
        and :meth:`_local` then finds it stored."""
        if q.shape[2] != 1 or self.starts is None or (self.policy is not None and self.policy.applies(layer, window)):
            return None
        pages = []
        for b, shard in enumerate(self.shards):
            done = shared.get(b, {})
            pages.append([])
            for j, ctx in enumerate(shard.segments(layer)):
                if j in done:
                    continue
                cut = self._seen_from(b, ctx, window, own=False)
                if cut is None:  # a key at or after the token, or gapped positions under a window: positions decide
                    return None
                if cut < len(ctx):
                    pages[b].append(Page(ctx.k[:, :, cut:], ctx.v[:, :, cut:], ctx.keys_finite()))
        if self.gens is not None:  # the query rank: its own tokens, the new one last
            own = [(g.k, g.v) for g in (self._own(layer, b, k, v) for b in range(len(self.gens)))]
            self._stored = layer
        for b, kv in enumerate(own or ()):  # (or held elsewhere: a static step's slots)
            if kv is not None:
                cut = _own_cut(kv[0].shape[2], window)
                pages[b].append(Page(kv[0][:, :, cut:], kv[1][:, :, cut:]))
        return attend_pages(q, pages, scale, backend=self.backend)

    def _seen_from(self, b: int, kv: LayerKV, window: Optional[int], *, own: bool) -> Optional[int]:
        """In a decode step, the index from which request b's token sees every key of ``kv`` and none before (all of
        them: 0; none: ``len(kv)``), known on the host -- or None: positions must decide. A context shard's facts
        are its :meth:`~LayerKV.span` (read once per context): every key before the token, and under a window at
        consecutive positions, the window keeping those at positions > token - window; the own tokens (``own``) sit
        at consecutive positions ending at the token by construction. Without ``starts``: None."""
        if self.starts is None:
            return None
        n = len(kv)
        if own:
            return _own_cut(n, window)
        span = kv.span()
        if span is None or span[1] >= self.starts[b] or (window is not None and not span[2]):
            return None
        return 0 if window is None else min(max(self.starts[b] - window + 1 - span[0], 0), n)

    def _own(self, layer: int, b: int, k: torch.Tensor, v: torch.Tensor) -> LayerKV:
        """The query rank's store of request b's own tokens at ``layer``, this forward's real tokens appended once."""
        g = self.gens[b].layers[layer]
        if self._stored != layer:
            n = self.valid[b]
            g.append(k[b : b + 1, :, :n], v[b : b + 1, :, :n], self.positions[b, :n])
        return g

    def _local(self, layer, b, q, k, v, scale, window, shared=None, own=None
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Request b's parts ``(o, lse)`` over what this rank holds: its context shard's segments and (query rank)
        its own tokens (none: this rank holds nothing for it); ``shared``: segment j -> its part, attended already
        with the other requests on the same store; ``own``: its own tokens' ``(k, v)`` held elsewhere (a decode
        step's: :meth:`local_state`). :func:`~magnetar.ops.merge.merge_requests` merges them.

        A right-padded query (``valid[b]`` < S) attends with its real rows only, and its parts get the padding's
        rows as the empty state ``(0, -inf)``: the padding's rows would see every real key by position -- a piece
        of their own in every call, two calls and a merge where one does -- and nothing reads them (no real token
        sees the padding, its KV is never stored, its logits never kept)."""
        S, n = q.shape[2], self.valid[b]
        policy = self.policy is not None and self.policy.applies(layer, window)
        trim = n < S and not policy  # a decode policy takes the real rows' count itself (valid)
        qb, pos = (q[b : b + 1, :, :n], self.positions[b, :n]) if trim else (q[b : b + 1], self.positions[b])
        parts = []
        shard = self.shards[b]
        # the query rank stores its own query/generated tokens (the real ones)
        g = self._own(layer, b, k, v) if self.gens is not None else None
        if policy:
            ctx = shard.whole(layer)  # one store for the policy's choice (a fork's segments joined, on this view)
            if len(ctx):  # sparse decoding / LuKA: the policy attends to its choice of this shard's KV -- and of
                # the query rank's own tokens too when it pages them (pages_generated)
                mine = {"gen": g} if g is not None and self.policy.pages_generated else {}
                parts.append(self.policy.attend_context(layer, b, qb, ctx, pos, scale, self.context_tokens[b],
                                                        backend=self.backend, valid=self.valid[b], **mine))
                g = None if mine else g
        else:  # context KV precedes the query: visible to every query token (positions decide)
            for j, ctx in enumerate(shard.segments(layer)):
                parts.append(shared[j] if shared is not None and j in shared else
                             self._attend_part(b, qb, pos, ctx, scale, window, own=False,
                                               k_finite=ctx.keys_finite()))
        if g is not None:  # the query rank: its own query/generated tokens, causally
            parts.append(self._attend_part(b, qb, pos, g, scale, window, own=True))
        if own is not None:  # a decode step's own tokens, held elsewhere: every one before the token, the window's
            cut = _own_cut(own[0].shape[2], window)
            parts.append(attention_with_lse(qb, own[0][:, :, cut:], own[1][:, :, cut:], causal=False, scale=scale,
                                            backend=self.backend))
        return [_padded(o, lse, S) for o, lse in parts] if trim else parts

    def _attend_part(self, b: int, qb: torch.Tensor, pos: torch.Tensor, kv: LayerKV, scale: float,
                     window: Optional[int], *, own: bool, k_finite: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Request b's rows ``qb`` at positions ``pos`` over one store (its context shard, or with ``own`` its own
        tokens'). In a decode step where the host knows which keys the token sees (:meth:`_seen_from`), the call is
        over those, of the FULL kind without positions: the front end reads none to classify it (a host
        synchronization a call on a GPU, and a mask under a window); else positions decide."""
        cut = self._seen_from(b, kv, window, own=own) if qb.shape[2] == 1 else None
        if cut is not None:  # the keys from cut on, every one seen (none: the (0, -inf) state)
            return attention_with_lse(qb, kv.k[:, :, cut:], kv.v[:, :, cut:], causal=False, scale=scale,
                                      backend=self.backend, k_finite=k_finite)
        return attention_with_lse(qb, kv.k, kv.v, q_pos=pos, k_pos=kv.pos, scale=scale, window=window,
                                  backend=self.backend, k_finite=k_finite)


def _own_cut(n: int, window: Optional[int]) -> int:
    """The first of a decode step's ``n`` own tokens (at consecutive positions ending at the new one) its row sees:
    all of them, or under a window the last ``window``."""
    return 0 if window is None else max(n - window, 0)


def _padded(o: torch.Tensor, lse: torch.Tensor, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A state of a request's real rows ``(1, H, n, D)`` / ``(1, H, n)`` with rows n..S-1 the empty state."""
    n = o.shape[2]
    return (F.pad(o, (0, 0, 0, S - n)),  # zeros
            F.pad(lse, (0, S - n), value=float("-inf")))


@dataclass
class DecodeResult:
    token_ids: list[int]
    ttft_seconds: float
    decode_seconds: list[float] = field(default_factory=list)  # per generated token after the first
    # eos, stop_string or max_new_tokens once finished; "nonfinite" / "failed": it failed alone (DecodeBatch.isolate)
    stop_reason: Optional[str] = None
    error: Optional[str] = None  # why a request failed alone (stop_reason "nonfinite" or "failed")
    first_logits: Optional[torch.Tensor] = None
    gen_kv_tokens: int = 0
    decode_stats: Optional[dict] = None  # the decode policy's stats() of this rank after the last token
    # with Phase2Request.logprobs, on the replica's first rank: per generated token (log p, [(id, log p)] of the
    # most likely alternatives); with prompt_logprobs, the same for query tokens 1.. (each given those before it),
    # and for query token 0 too when the context's last logits are known (Phase2Request.context_logits)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: Optional[list] = None


class TokenChooser(Protocol):
    """One request's decoding rule (:class:`magnetar.engine.sampling.RequestSampler` is the engine's): each step,
    :meth:`choose` on the replica's first rank (it picks the next token and records it; the token is then
    broadcast) or :meth:`record` of the broadcast token on the other ranks; then every rank reads
    :attr:`stop_reason` (the same on every rank: it depends on the token ids only)."""

    def choose(self, logits: torch.Tensor) -> int: ...

    def record(self, token: int) -> None: ...

    @property
    def stop_reason(self) -> Optional[str]: ...

    # whether the engine may choose its tokens with the batch's on the device (greedy: argmax, else sample_rows
    # with params and generator_on), the token then given to record
    @property
    def device_choice(self) -> bool: ...

    params: SamplingParams

    def generator_on(self, device) -> torch.Generator: ...


# what the token broadcast carries instead of a token id for a request that got none
NONFINITE = -1  # its logits were not finite (isolate)
FAILED = -2  # its token choice raised on the replica's first rank (its sampler, its log-probabilities)


class RequestFailed(RuntimeError):
    """One request's token choice failed on the replica's first rank; the other ranks raise this (the first rank
    raises the request's own exception)."""


def _read_choices(logits: torch.Tensor, together: list[tuple[int, TokenChooser]], check: bool
                  ) -> tuple[list[bool], dict[int, int]]:
    """One read of the device for a step's ``logits (B, V)``: whether each row is finite (all True without
    ``check``), and the tokens of the rows ``together`` -- ``(row, chooser)`` of requests chosen with their batch:
    greedy ones by ``argmax``, sampled ones by :func:`~magnetar.engine.sampling.sample_rows` (exactly
    :meth:`RequestSampler.choose`'s choices; -1 for a row with nothing to sample from)."""
    n, parts = logits.shape[0], []
    if check:
        parts.append(torch.isfinite(logits).all(dim=-1).long())
    greedy = [i for i, c in together if c.params.greedy]
    sampled = [(i, c) for i, c in together if not c.params.greedy]
    if greedy:
        parts.append(logits[to_device(torch.tensor(greedy), logits.device)].argmax(dim=-1))
    if sampled:
        rows = logits[to_device(torch.tensor([i for i, _ in sampled]), logits.device)]
        tokens, ok = sample_rows(rows, [c for _, c in sampled])
        parts.append(torch.where(ok, tokens, -1))
    values = torch.cat(parts).tolist() if parts else []
    finite = [bool(v) for v in values[:n]] if check else [True] * n
    return finite, dict(zip(greedy + [i for i, _ in sampled], values[n if check else 0:]))


def _broadcast_tokens(tokens: list[int], groups: ParallelGroups, device) -> list[int]:
    """The tokens chosen on the replica's first rank, on every rank of the replica (TP x CP): the ranks never
    choose for themselves, so sampling (or a tie in bitwise-different logits) cannot make them diverge."""
    if groups.replica_size == 1:
        return tokens
    t = torch.tensor(tokens, dtype=torch.long, device=device)
    work = dist.broadcast(t, src=groups.replica_ranks[0], group=groups.replica_group, async_op=True)
    wait_all(work, groups.timeout, "next-token broadcast")
    return t.tolist()


@dataclass
class Phase2Request:
    """One question over one context's distributed KV: this rank's context KV ``shard`` (a
    :meth:`~magnetar.engine.kv.KVShard.view` of its own, so the decode policy's per-request state starts
    empty), the query ids ``(Q,)`` starting at RoPE position ``query_position``, the whole context's length over
    all ranks, and the request's :class:`TokenChooser`."""

    shard: KVShard
    query: torch.Tensor
    query_position: int
    context_tokens: int
    chooser: TokenChooser
    logprobs: Optional[int] = None  # None: none; k: each chosen token's log-probability and k alternatives
    prompt_logprobs: bool = False  # also the query tokens' (from the query forward)
    # (V,): the logits at the context's last position (ContextHandle.last_logits), when known: with prompt_logprobs
    # the first query token gets its log-probability too
    context_logits: Optional[torch.Tensor] = None


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: int) -> list[tuple[float, list]]:
    """``(log p(token), [(id, log p)] of the k most likely)`` for each row of ``logits (N, V)`` and its token:
    ``log_softmax`` of the logits in float32."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(-1, torch.tensor(list(tokens), device=lp.device)[:, None])[:, 0].tolist()
    if k <= 0:
        return [(c, []) for c in chosen]
    values, ids = lp.topk(k, dim=-1)
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), values.tolist())]


@dataclass
class _Live:
    req: Phase2Request
    result: DecodeResult
    gen: Optional[KVShard]  # the query rank's store of this request's query/generated KV
    next_pos: int


class DecodeBatch:
    """Requests decoding together over their distributed KV: they :meth:`join` between steps (their query
    forward, which also chooses their first token) and leave when finished (EOS, stop string, limit); each
    :meth:`step` is ONE model forward and one collective per layer for every unfinished request.

    Every rank of the replica makes the same calls in the same order (the engine, or a server loop that
    broadcasts what rank 0 decided). Requests are independent: a request's tokens equal those of it alone.

    ``isolate``: a request whose logits turn non-finite (a NaN its own tokens reach) fails alone -- it ends with
    ``stop_reason`` "nonfinite" and ``error`` saying where (no token is chosen for it) -- and the others go on;
    the first rank decides and the token broadcast carries the decision. So does a request whose token choice
    raises (its sampler, its log-probabilities: stop reason "failed", ``error`` the exception). Otherwise
    (``Engine.generate``'s batch) any non-finite logits raise :class:`~magnetar.engine.finite.NonFiniteError` on
    every rank (``check_finite``), and a failed choice its exception (:class:`RequestFailed` on the ranks that did
    not choose).
    """

    def __init__(self, model, config: EngineConfig, groups: ParallelGroups, device, *,
                 policy: Optional[DecodePolicy] = None, keep_logits: bool = False, isolate: bool = False,
                 graphs: Optional[DecodeGraphs] = None):
        self.model, self.config, self.groups, self.device = model, config, groups, device
        self.policy, self.keep_logits, self.isolate = policy, keep_logits, isolate
        self.chooses = groups.is_replica_leader
        self._live: dict[int, _Live] = {}
        self._ids = itertools.count()
        self._steps = 0
        # runtime.decode_step: how the steps run (magnetar.engine.static), and why not as configured (None: as asked)
        self.decode_step, self.why_not = static_problem(config.runtime.decode_step, policy, groups)
        if self.why_not is not None:
            log.info("decode_step %s: %s", config.runtime.decode_step, self.why_not)
        # graph steps: the engine's plan, slot pool and captured graphs (magnetar.engine.graphs)
        self.static = (StaticDecode(model, groups, device, self.decode_step, config.runtime.attention_backend,
                                    graphs=graphs, pages=self._context_pages) if self.decode_step != "eager" else None)

    def _context_pages(self, positions: torch.Tensor, shards: list[KVShard], starts: list[int]):
        """A static step's context part read as pages (:meth:`Phase2Context.local_state` with no store of own
        tokens): row b over ``shards[b]`` -- and its slot's own tokens, given per call --, its token at
        ``positions[b]`` (``starts[b]`` on the host)."""
        ctx = Phase2Context(positions, shards, None, [1] * len(shards), self.groups,
                            self.config.runtime.attention_backend, starts=starts)
        return lambda layer, q, scale, window, own=None: ctx.local_state(layer, q, None, None, scale, window, own)

    @property
    def active(self) -> list[int]:
        """The ids of the unfinished requests, in joining order."""
        return [rid for rid, r in self._live.items() if r.result.stop_reason is None]

    def result(self, rid: int) -> DecodeResult:
        return self._live[rid].result

    def pop(self, rid: int) -> DecodeResult:
        """Remove a finished request; its result with the decode policy's stats of this rank."""
        live = self._live.pop(rid)
        live.result.gen_kv_tokens = live.gen.tokens() if live.gen is not None else 0
        if self.static is not None and rid in self.static.owner:
            held = self.static.release(rid)
            if live.gen is not None:
                live.result.gen_kv_tokens = held
        live.result.decode_stats = (None if self.policy is None
                                    else self.policy.stats(live.req.shard, live.req.context_tokens))
        return live.result

    def _forward(self, live: list[_Live], ids: torch.Tensor, starts: list[int], valid: list[int],
                 what: str, every: bool = False) -> tuple[torch.Tensor, Phase2Context, Optional[torch.Tensor]]:
        """Each request's last logits ``(B, V)``, the context, and with ``every`` the logits of every position."""
        device, S = self.device, ids.shape[1]
        pos = torch.tensor(starts, device=device)[:, None] + torch.arange(S, device=device)[None]
        ctx = Phase2Context(pos, [r.req.shard for r in live],
                            [r.gen for r in live] if self.groups.is_cp_leader else None, valid, self.groups,
                            self.config.runtime.attention_backend, self.policy,
                            [r.req.context_tokens for r in live], check_finite=self.config.runtime.check_finite,
                            starts=starts)
        # the LM head over each request's last real token only (a 1-D index keeps those positions of every row:
        # (B, distinct lengths, V), not (B, S, V) -- 8 right-padded 1K queries made 1.6 GB of logits otherwise)
        ends = sorted(set(valid))
        keep = 0 if every else (1 if len(ends) == 1 else torch.tensor(ends, device=device) - 1)
        logits = self.model(input_ids=ids.to(device), position_ids=pos, use_cache=False, logits_to_keep=keep,
                            magnetar=ctx).logits
        full = logits if every else None
        # each request's row: its last real position (every), else its end's index among those kept (one end: 0)
        last = torch.tensor([n - 1 for n in valid] if every else [ends.index(n) for n in valid], device=device)
        logits = logits[torch.arange(len(valid), device=device), last]  # (B, V): each request's last real token
        return logits, ctx, full  # checked finite where the tokens are chosen (_choose_tokens: one read per step)

    def _choose(self, live: list[_Live], logits: torch.Tensor, ctx: Phase2Context, what: str,
                full: Optional[torch.Tensor] = None, lengths: Optional[list[int]] = None) -> list[int]:
        """The next token of every request in ``live`` (chosen on the replica's first rank, recorded by every
        rank's chooser) appended to its result, with its stop reason. With ``isolate``, a request whose logits
        are not finite gets :data:`NONFINITE` in the broadcast, and one whose choice raised (its sampler, its
        logprobs) :data:`FAILED`: every rank then fails it alone, stop reason "nonfinite" or "failed" (no token
        appended). Without ``isolate`` a failed choice raises on every rank. ``full (B, S, V)`` and ``lengths``: the
        query forward's logits of every position, for the requests that asked for ``prompt_logprobs``."""
        with nvtx_range(PHASE2_SAMPLE):
            return self._choose_tokens(live, logits, ctx, what, full, lengths)

    def _choose_tokens(self, live: list[_Live], logits: torch.Tensor, ctx: Phase2Context, what: str,
                       full: Optional[torch.Tensor], lengths: Optional[list[int]]) -> list[int]:
        picked, errors = [NONFINITE] * len(live), {}
        if self.chooses:
            # the tokens of the requests without a grammar or log-probabilities are chosen together on the device
            # (greedy and sampled), read with every row's finite flag in ONE transfer: a step's only wait for the
            # device unless a request reads its own row (a grammar's mask, log-probabilities)
            together = [(i, r.req.chooser) for i, r in enumerate(live) if r.req.chooser.device_choice
                        and r.req.logprobs is None and not (full is not None and r.req.prompt_logprobs)]
            finite, chosen = _read_choices(logits, together, self.isolate or self.config.runtime.check_finite)
            for i, r in enumerate(live):
                if not finite[i]:
                    continue
                if i in chosen:
                    picked[i], errors[i] = self._record_one(r, chosen[i])
                else:
                    prompt = full[i, : lengths[i]] if full is not None and r.req.prompt_logprobs else None
                    picked[i], errors[i] = self._choose_one(r, logits[i], prompt)
        tokens = _broadcast_tokens(picked, self.groups, self.device)
        error = ctx.nonfinite_message(what) if NONFINITE in tokens else None  # every rank alike
        if not self.isolate and NONFINITE in tokens:  # runtime.check_finite: every rank raises
            raise NonFiniteError(error)
        if not self.isolate and FAILED in tokens:  # every rank raises, the first with the request's own error
            i = tokens.index(FAILED)
            if errors.get(i) is not None:
                raise errors[i]
            raise RequestFailed(f"request {i} of this {what} failed on the replica's first rank (its log says why)")
        for i, (r, t) in enumerate(zip(live, tokens)):
            if t == NONFINITE:
                r.result.stop_reason, r.result.error = "nonfinite", error
                continue
            if t == FAILED:
                e = errors.get(i)
                r.result.stop_reason = "failed"
                r.result.error = (f"{type(e).__name__}: {e}" if e is not None
                                  else "its token choice failed on the replica's first rank (its log says why)")
                continue
            if not self.chooses:
                r.req.chooser.record(t)
            r.result.token_ids.append(t)
            r.result.stop_reason = r.req.chooser.stop_reason
        return tokens

    def _record_one(self, r: _Live, token: int) -> tuple[int, Optional[Exception]]:
        """On the replica's first rank: request ``r``'s token chosen with the batch on the device, recorded as
        :meth:`_choose_one` records its own (or :data:`FAILED` and the exception)."""
        try:
            if token < 0:  # sample_rows: the row's probabilities were not finite (as choose raises)
                raise ValueError(NOTHING_TO_SAMPLE)
            r.req.chooser.record(token)
            return token, None
        except Exception as e:  # noqa: BLE001 -- as _choose_one: the request's own failure
            log.error("a request's token failed: %s: %s", type(e).__name__, e, exc_info=not self.isolate)
            return FAILED, e

    def _choose_one(self, r: _Live, logits: torch.Tensor,
                    prompt: Optional[torch.Tensor] = None) -> tuple[int, Optional[Exception]]:
        """On the replica's first rank: request ``r``'s next token for its ``logits (V,)``, and its log-probabilities
        when it asked for them (``prompt (Q, V)``: its query's logits, for its query tokens' log-probabilities: token
        i + 1 given the context and query tokens 0..i) -- or :data:`FAILED` and the exception when any raises. An
        exception here belongs to this request alone (its options, its values): the token broadcast carries the
        verdict, so every rank fails the request alone (``isolate``) or raises alike, and no rank waits in a
        collective for the others."""
        try:
            token = r.req.chooser.choose(logits)
            if r.req.logprobs is not None:  # from the logits the token was chosen by
                [row] = token_logprobs(logits[None], [token], r.req.logprobs)
                r.result.logprobs.append(row)
            if prompt is not None:  # row i predicts query token i + 1; the context's last logits query token 0
                rows, first = prompt[:-1], r.req.context_logits
                if first is not None:
                    rows = torch.cat((first.to(rows.device, torch.float32)[None], rows.float()))
                targets = r.req.query.tolist()[len(r.req.query) - len(rows):]
                r.result.prompt_logprobs = [] if not len(rows) else token_logprobs(rows, targets,
                                                                                    r.req.logprobs or 0)
            return token, None
        except Exception as e:  # noqa: BLE001 -- every exception of one request's choice is that request's
            log.error("a request's token choice failed: %s: %s", type(e).__name__, e, exc_info=not self.isolate)
            return FAILED, e

    @torch.inference_mode()
    def join(self, requests: Sequence[Phase2Request]) -> list[int]:
        """Run the queries of ``requests`` (one forward, right-padded) and choose their first tokens; returns
        their ids. Requests finished by their first token are finished at once (``stop_reason`` set)."""
        t0 = time.perf_counter()
        live = []
        for req in requests:
            gen = None
            if self.groups.is_cp_leader:  # every TP rank of CP rank 0 keeps its heads of the query/generated KV
                gen = KVShard(self.model.config.num_hidden_layers)
                gen.freeze()
            live.append(_Live(req, DecodeResult([], 0.0), gen, req.query_position + int(req.query.numel())))
        lengths = [int(r.req.query.numel()) for r in live]
        padded = torch.zeros(len(live), max(lengths), dtype=torch.long)
        for b, r in enumerate(live):
            padded[b, : lengths[b]] = r.req.query  # right padding: after the real tokens, so none of them sees it
        every = any(r.req.prompt_logprobs for r in live)
        with nvtx_range(PHASE2_QUERY):
            logits, ctx, full = self._forward(live, padded, [r.req.query_position for r in live], lengths,
                                              "the query", every=every)
            self._choose(live, logits, ctx, "the query", full=full, lengths=lengths)
        ttft = time.perf_counter() - t0
        rids = []
        for b, r in enumerate(live):
            r.result.ttft_seconds = ttft
            r.result.first_logits = logits[b].float().cpu() if self.keep_logits else None
            rid = next(self._ids)
            self._live[rid] = r
            rids.append(rid)
        if self.static is not None:
            self._place([rid for rid in rids if self._live[rid].result.stop_reason is None])
        return rids

    def _place(self, rids: list[int]) -> None:
        """Static steps: copy the joined requests' KV into slots -- unless a context's KV is not finite (the slots'
        one attention call would not keep the exact non-finite rules): then the batch goes back to eager."""
        bad = [rid for rid in rids if not all(lk.keys_finite() and lk.values_finite()
                                              for i in range(self._live[rid].req.shard.num_layers)
                                              for lk in self._live[rid].req.shard.segments(i))]
        mine = bad[0] if bad else -1
        if self.groups.replica_size > 1:  # each rank checks its own KV; every rank of the replica must decide alike
            got = all_gather_ints([mine], self.groups.replica_group, self.device, timeout=self.groups.timeout)
            mine = max(got[:, 0].tolist())
        if mine >= 0:
            self._to_eager(f"a context's KV is not finite (request {mine}): decode steps run eager, whose attention "
                           f"keeps the exact rules for non-finite values")
            return
        for rid in rids:
            self.static.place(rid, self._live[rid].req.shard, self._live[rid].gen)

    def _to_eager(self, why: str) -> None:
        """Leave static steps for good: each placed request's query and generated KV goes back to its eager store."""
        for rid in list(self.static.owner):
            live = self._live[rid]
            if live.gen is not None:
                gen = KVShard(len(live.gen.layers))
                gen.freeze()
                for layer, (k, v, pos) in zip(gen.layers, self.static.generated(rid)):
                    layer.append(k.clone(), v.clone(), pos.clone())
                live.gen = gen
        self.static.close()
        self.static, self.decode_step, self.why_not = None, "eager", why
        log.warning("decode steps: %s", why)

    @torch.inference_mode()
    def step(self) -> list[int]:
        """One decode step of every unfinished request; returns the ids that got a token (in joining order)."""
        rids = self.active
        if not rids:
            return []
        self._steps += 1
        live = [self._live[rid] for rid in rids]
        t1 = time.perf_counter()
        with nvtx_range(PHASE2_DECODE_STEP, t=self._steps):
            what = f"decode step {self._steps}"
            if self.static is not None:  # every request in one slot-batched (maybe compiled) forward
                try:
                    logits = self.static.step(rids, [r.result.token_ids[-1] for r in live],
                                              [r.next_pos for r in live])
                    ctx = self.static
                except ContextKernelFailed as e:  # one rank per replica: the step again, eager (several ranks
                    if self.groups.replica_size > 1:  # would have to agree first: it fails loudly there)
                        raise
                    self._to_eager(f"{e}: decode steps run eager")
            if self.static is None:
                ids = torch.tensor([[r.result.token_ids[-1]] for r in live])
                logits, ctx, _ = self._forward(live, ids, [r.next_pos for r in live], [1] * len(live), what)
            self._choose(live, logits, ctx, what)
        dt = time.perf_counter() - t1
        for r in live:
            r.result.decode_seconds.append(dt)
            r.next_pos += 1
        return rids

    def cancel(self, rid: int) -> None:
        """Finish the unfinished request ``rid`` now (``stop_reason`` "cancelled"): it leaves the next step; its
        KV goes with :meth:`pop`. Every rank of the replica cancels the same request between the same steps."""
        live = self._live.get(rid)
        if live is None:
            raise ValueError(f"rid {rid} is not in this batch (finished requests leave it with pop)")
        if live.result.stop_reason is None:
            live.result.stop_reason = "cancelled"


@torch.inference_mode()
def run_scoring(model, config: EngineConfig, shard: KVShard, ids: torch.Tensor, start: int,
                groups: ParallelGroups, device, *, policy: Optional[DecodePolicy] = None,
                context_tokens: Optional[int] = None) -> torch.Tensor:
    """Teacher-forced Phase 2 for perplexity: ``ids (S,)`` at RoPE positions ``start ...`` run as one query
    over the distributed context KV (plus, causally, each other); returns the log-probability of every
    ``ids[i + 1]`` given the context and ``ids[: i + 1]``, shape ``(S - 1,)``, float32, on every rank."""
    if ids.numel() < 2:
        raise ValueError(f"scoring needs at least 2 continuation tokens (the first is only conditioned on), "
                         f"got {ids.numel()}")
    logits = run_teacher_forced(model, config, shard, ids, start, groups, device, policy=policy,
                                context_tokens=context_tokens)
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return logp.gather(1, ids[1:].to(device).reshape(-1, 1)).reshape(-1).cpu()


@torch.inference_mode()
def run_teacher_forced(model, config: EngineConfig, shard: KVShard, ids: torch.Tensor, start: int,
                       groups: ParallelGroups, device, *, policy: Optional[DecodePolicy] = None,
                       context_tokens: Optional[int] = None, gen: Optional[KVShard] = None,
                       every: bool = True) -> torch.Tensor:
    """The logits ``(S, V)`` float32 (on ``device``, the same on every rank) of ``ids (S,)`` run teacher-forced at
    RoPE positions ``start ...`` as the Phase-2 query over the distributed context KV: row ``i`` predicts
    ``ids[i + 1]`` given the context and ``ids[: i + 1]``. ``gen``: a frozen, empty shard that receives the KV of
    ``ids`` on the CP leader (a prefix extension keeps it); ``every=False``: only the last row's logits ``(1, V)``."""
    gens = None
    if groups.is_cp_leader:
        gens = [gen if gen is not None else KVShard(model.config.num_hidden_layers)]
        gens[0].freeze()
    S = int(ids.numel())
    # A stateful decoder (LuKA: accumulated mass, pages cut every few steps) sees the continuation in chunks of
    # its step size, each chunk attending causally to the ones before (their KV stays in `gens`).
    chunk = (policy.score_chunk if policy is not None else 0) or S
    logits = []
    for a in range(0, S, chunk):
        n = min(chunk, S - a)
        pos = (start + a + torch.arange(n, device=device))[None]
        ctx = Phase2Context(pos, [shard], gens, [n], groups, config.runtime.attention_backend, policy,
                            [context_tokens] if context_tokens is not None else None,
                            check_finite=config.runtime.check_finite)
        with nvtx_range(PHASE2_SCORE):
            logits.append(model(input_ids=ids[a : a + n].reshape(1, n).to(device), position_ids=pos, use_cache=False,
                                logits_to_keep=0 if every else 1, magnetar=ctx).logits[0].float())
        ctx.check_logits(logits[-1], f"scoring tokens {a}..{a + n - 1}")
    return torch.cat(logits) if every else logits[-1]
