"""Phase 2 and decoding: the query attends to the whole distributed KV cache, then tokens are generated.

Every CP rank runs the same forward on the same tokens (the query, then each generated token): attention
over its own context shard, and on the query rank (cp_rank 0, the only one that stores query/generated KV)
over those tokens causally; one packed all-gather of ``(out, lse)`` per layer and the merge make every
rank's output identical. The next token is chosen on the query rank (greedy or seeded sampling) and
broadcast, so all ranks decode the same sequence. Stops at EOS, a stop string or ``max_new_tokens``.

Several independent requests decode as one batch: each has its own KV (attention runs per request inside
the layer, everything else batched, one collective per layer for the batch); queries of different lengths
are right-padded and the padding never reaches a KV store.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from magnetar.config import DecodeConfig, EngineConfig
from magnetar.engine.finite import HINT, LayerFlags, NonFiniteError, describe
from magnetar.engine.kv import KVShard
from magnetar.engine.strategy import DecodePolicy, LayerContext
from magnetar.ops import attention_with_lse, merge_states
from magnetar.ops.nonfinite import all_finite
from magnetar.parallel import ParallelGroups, all_gather_states
from magnetar.parallel.collectives import wait_all
from magnetar.utils.nvtx import (PHASE2_DECODE_STEP, PHASE2_GATHER, PHASE2_LAYER, PHASE2_MERGE, PHASE2_QUERY,
                                 PHASE2_SCORE, nvtx_range)


class Phase2Context(LayerContext):
    """The Phase-2 forward of a batch of B requests, each with its own KV.

    ``positions (B, S)``; ``shards[b]`` is this rank's context KV of request b; ``gens[b]`` the query rank's
    store of request b's query/generated KV (None on the other ranks); ``valid[b]`` how many of the S input
    tokens of request b are real (queries of different lengths are right-padded; padding sits after the real
    tokens, so no real token sees it, and its KV is never stored). ``policy`` (a
    :class:`~magnetar.engine.strategy.DecodePolicy`, or None for dense decoding) chooses the context KV each
    token attends to; ``context_tokens[b]`` is request b's whole context length (over all ranks).

    Per layer: local parts (context shard -- through the policy where it applies --, and on the query rank
    the query/generated KV, causally; a policy with ``pages_generated`` attends that KV too, in the same call)
    -> one packed all-gather of ``(out, lse)`` for the batch -> the merge.
    Every rank ends with the same output, so every rank runs the same model forward.
    """

    layer_range = PHASE2_LAYER

    def __init__(self, positions: torch.Tensor, shards: list[KVShard], gens: Optional[list[KVShard]],
                 valid: list[int], groups: ParallelGroups, backend: str, policy: Optional[DecodePolicy] = None,
                 context_tokens: Optional[list[int]] = None, check_finite: bool = False):
        self.positions, self.shards, self.gens, self.valid = positions, shards, gens, valid
        self.groups, self.group, self.timeout, self.backend = groups, groups.cp_group, groups.timeout, backend
        self.policy, self.context_tokens = policy, context_tokens
        # runtime.check_finite: which layers' local states (before the merge) were not finite on this rank
        self.flags = LayerFlags(len(shards[0].layers), positions.device) if check_finite else None

    def check_logits(self, logits: torch.Tensor, what: str) -> None:
        """Raise :class:`NonFiniteError` if ``logits`` are not finite (every rank sees the same logits, so every
        rank raises; they first gather where their local states turned non-finite)."""
        if self.flags is None or all_finite(logits):
            return
        mine = self.flags.first()
        per_rank = [mine]
        if self.groups.cp_size > 1:
            per_rank = [None] * self.groups.cp_size
            dist.all_gather_object(per_rank, mine, group=self.group)
        raise NonFiniteError(f"non-finite logits in Phase 2 ({what}): {describe(per_rank)}; {HINT}")

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: Optional[int] = None) -> torch.Tensor:
        B, Hq, S, D = q.shape
        local_o, local_l = [], []
        for b in range(B):  # requests hold KV of different lengths: attend each to its own
            o, l = self._local(layer, b, q, k, v, scale, window)
            local_o.append(o)
            local_l.append(l)
        local_o, local_l = (torch.cat(local_o), torch.cat(local_l)) if B > 1 else (local_o[0], local_l[0])
        if self.flags is not None:
            self.flags.record(layer, local_o)
        with nvtx_range(PHASE2_GATHER, n=layer):  # one collective per layer for the whole batch
            outs, lses = all_gather_states(local_o, local_l, self.group, timeout=self.timeout)
        with nvtx_range(PHASE2_MERGE, n=layer):
            out, lse = merge_states(outs, lses)
        if self.policy is not None:  # e.g. LuKA accumulates the attention mass, normalised by the merged lse
            self.policy.after_merge(layer, lse)
        return out

    def _local(self, layer, b, q, k, v, scale, window) -> tuple[torch.Tensor, torch.Tensor]:
        """Request b's state over what this rank holds: its context shard and (query rank) its own tokens."""
        S = q.shape[2]
        qb, pos = q[b : b + 1], self.positions[b]
        parts_o, parts_l = [], []
        ctx = self.shards[b].layers[layer]
        g = None
        if self.gens is not None:  # the query rank stores its own query/generated tokens (the real ones)
            g = self.gens[b].layers[layer]
            n = self.valid[b]
            g.append(k[b : b + 1, :, :n], v[b : b + 1, :, :n], pos[:n])
        if len(ctx) and self.policy is not None and self.policy.applies(layer, window):
            # sparse decoding / LuKA: the policy attends to its choice of this shard's KV -- and of the query
            # rank's own tokens too when it pages them (pages_generated)
            mine = {"gen": g} if g is not None and getattr(self.policy, "pages_generated", False) else {}
            o, l = self.policy.attend_context(layer, b, qb, ctx, pos, scale, self.context_tokens[b],
                                              backend=self.backend, valid=self.valid[b], **mine)
            parts_o.append(o)
            parts_l.append(l)
            g = None if mine else g
        elif len(ctx):  # context KV precedes the query: visible to every query token (positions decide)
            o, l = attention_with_lse(qb, ctx.k, ctx.v, q_pos=pos, k_pos=ctx.pos, scale=scale, window=window,
                                      backend=self.backend)
            parts_o.append(o)
            parts_l.append(l)
        if g is not None:  # the query rank: its own query/generated tokens, causally
            o, l = attention_with_lse(qb, g.k, g.v, q_pos=pos, k_pos=g.pos, scale=scale, window=window,
                                      backend=self.backend)
            parts_o.append(o)
            parts_l.append(l)
        if not parts_o:  # this rank holds nothing for request b: the empty state
            return torch.zeros_like(qb), torch.full((1, q.shape[1], S), float("-inf"), device=q.device)
        if len(parts_o) == 1:
            return parts_o[0], parts_l[0]
        return merge_states(parts_o, parts_l)


@dataclass
class DecodeResult:
    token_ids: list[int]
    ttft_seconds: float
    decode_seconds: list[float] = field(default_factory=list)  # per generated token after the first
    stop_reason: str = "max_new_tokens"
    first_logits: Optional[torch.Tensor] = None
    gen_kv_tokens: int = 0
    decode_stats: Optional[dict] = None  # the decode policy's stats() of this rank after the last token


def choose_token(logits: torch.Tensor, cfg: DecodeConfig, generator: Optional[torch.Generator]) -> int:
    """Greedy (temperature 0) or temperature / top-k / top-p sampling from ``logits (V,)``."""
    if cfg.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)
    if cfg.top_k:
        kth = torch.topk(probs, min(cfg.top_k, probs.numel())).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = torch.cumsum(sorted_p, 0) - sorted_p > cfg.top_p * sorted_p.sum()
        sorted_p[drop] = 0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    return int(torch.multinomial(probs.cpu() / probs.sum(), 1, generator=generator))


def _broadcast_tokens(tokens: list[int], groups: ParallelGroups, device) -> list[int]:
    """The tokens chosen on the replica's first rank, on every rank of the replica (TP x CP): the ranks never
    choose for themselves, so sampling (or a tie in bitwise-different logits) cannot make them diverge."""
    if groups.replica_size == 1:
        return tokens
    t = torch.tensor(tokens, dtype=torch.long, device=device)
    work = dist.broadcast(t, src=groups.replica_ranks[0], group=groups.replica_group, async_op=True)
    wait_all(work, groups.timeout, "next-token broadcast")
    return t.tolist()


@torch.inference_mode()
def run_phase2(model, config: EngineConfig, shards: list[KVShard], queries: list[torch.Tensor],
               query_positions: list[int], groups: ParallelGroups, device, *, max_new_tokens: int,
               eos_ids: Sequence[int] = (), stop_checks=None, keep_logits: bool = False,
               policy: Optional[DecodePolicy] = None, context_tokens: Optional[list[int]] = None) -> list[DecodeResult]:
    """Run a batch of queries through the model over their distributed KV, then decode each up to
    ``max_new_tokens``. Request b has context KV ``shards[b]``, query ids ``queries[b]`` starting at RoPE
    position ``query_positions[b]``; ``stop_checks[b](token_ids) -> bool`` (optional) ends it early.
    Finished requests leave the batch; the others go on. One result per request. ``policy`` (a
    :class:`~magnetar.engine.strategy.DecodePolicy`: sparse decoding or LuKA) makes every Phase-2 token attend
    to its choice of the context KV of request b, whose whole context (over all ranks) is ``context_tokens[b]``
    tokens.
    """
    B = len(shards)
    chooser = groups.cp_rank == 0 and groups.tp_rank == 0  # the replica's first rank
    gens = None
    if groups.is_cp_leader:  # every TP rank of CP rank 0 keeps its heads of the query's and generated KV
        gens = [KVShard(model.config.num_hidden_layers) for _ in range(B)]
        for g in gens:
            g.freeze()
    generators = [torch.Generator().manual_seed(config.decode.seed + b) if config.decode.temperature > 0 else None
                  for b in range(B)]
    backend = config.runtime.attention_backend
    def forward(active: list[int], ids: torch.Tensor, starts: list[int], valid: list[int], what: str) -> torch.Tensor:
        S = ids.shape[1]
        pos = torch.tensor(starts, device=device)[:, None] + torch.arange(S, device=device)[None]
        ctx = Phase2Context(pos, [shards[b] for b in active], [gens[b] for b in active] if gens is not None else None,
                            valid, groups, backend, policy,
                            [context_tokens[b] for b in active] if context_tokens else None,
                            check_finite=config.runtime.check_finite)
        logits = model(input_ids=ids.to(device), position_ids=pos, use_cache=False,
                       logits_to_keep=1 if len(set(valid)) == 1 else 0, magnetar=ctx).logits
        last = torch.tensor(valid, device=device) - 1 if logits.shape[1] > 1 else torch.zeros(len(valid), dtype=torch.long, device=device)
        logits = logits[torch.arange(len(valid), device=device), last]  # (B_active, V): each request's last real token
        ctx.check_logits(logits, what)
        return logits

    def choose(active, logits) -> list[int]:
        picked = [choose_token(logits[i], config.decode, generators[b]) for i, b in enumerate(active)] if chooser \
            else [-1] * len(active)
        return _broadcast_tokens(picked, groups, device)

    lengths = [int(q.numel()) for q in queries]
    padded = torch.zeros(B, max(lengths), dtype=torch.long)
    for b, q in enumerate(queries):
        padded[b, : lengths[b]] = q  # right padding: after the real tokens, so none of them sees it
    t0 = time.perf_counter()
    with nvtx_range(PHASE2_QUERY):
        logits = forward(list(range(B)), padded, list(query_positions), lengths, "the query")
        tokens = choose(list(range(B)), logits)
    ttft = time.perf_counter() - t0
    results = [DecodeResult([tokens[b]], ttft, first_logits=logits[b].float().cpu() if keep_logits else None)
               for b in range(B)]
    next_pos = [query_positions[b] + lengths[b] for b in range(B)]
    active = list(range(B))
    step = 0
    while True:
        still = []
        for b in active:
            r = results[b]
            if r.token_ids[-1] in eos_ids:
                r.stop_reason = "eos"
            elif stop_checks is not None and stop_checks[b] is not None and stop_checks[b](r.token_ids):
                r.stop_reason = "stop_string"
            elif len(r.token_ids) < max_new_tokens:
                still.append(b)
        active = still
        if not active:
            break
        step += 1
        t1 = time.perf_counter()
        with nvtx_range(PHASE2_DECODE_STEP, t=step):
            ids = torch.tensor([[results[b].token_ids[-1]] for b in active])
            logits = forward(active, ids, [next_pos[b] for b in active], [1] * len(active), f"decode step {step}")
            tokens = choose(active, logits)
        dt = time.perf_counter() - t1
        for b, t in zip(active, tokens):
            results[b].token_ids.append(t)
            results[b].decode_seconds.append(dt)
            next_pos[b] += 1
    stats = getattr(policy, "stats", None) if context_tokens else None
    for b in range(B):
        results[b].gen_kv_tokens = gens[b].tokens() if gens is not None else 0
        results[b].decode_stats = stats(shards[b], context_tokens[b]) if stats is not None else None
    return results


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
    gens = None
    if groups.is_cp_leader:
        gens = [KVShard(model.config.num_hidden_layers)]
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
                                logits_to_keep=0, magnetar=ctx).logits[0].float())
        ctx.check_logits(logits[-1], f"scoring tokens {a}..{a + n - 1}")
    logp = torch.log_softmax(torch.cat(logits)[:-1], dim=-1)
    return logp.gather(1, ids[1:].to(device).reshape(-1, 1)).reshape(-1).cpu()
