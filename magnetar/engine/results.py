"""What a request returns and how it is put together: :class:`GenerationResult`, :class:`ScoreResult`, the per-rank
:class:`RankStats`, and :class:`Results`, which assembles finished requests' results with every rank's figures.

Every rank of a replica assembles the same results: the per-rank figures are gathered once per batch over the CP
group, as numbers in one integer gather (simulated ranks measured them all in this process). This module knows
nothing of methods or policies (a decode policy's stats are numbers under the keys it declares).
"""
from __future__ import annotations

import dataclasses
import math
import resource
from dataclasses import dataclass, field
from typing import Optional

import torch

from magnetar.engine.context import ContextHandle
from magnetar.engine.phase2 import DecodeResult
from magnetar.engine.sampling import RequestSampler
from magnetar.parallel import ParallelGroups
from magnetar.parallel.collectives import all_gather_numbers
from magnetar.parallel.ring import exposed_seconds

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
    # simulated ranks: each rank's exchange steps (RankStats.exchange), for phase1_seconds_at; empty lists else
    phase1_exchange: list = field(default_factory=list, repr=False)

    @property
    def phase1_critical_path_seconds(self) -> float:
        return max(self.phase1_seconds)

    def phase1_seconds_at(self, link_gbps: float) -> list[float]:
        """Each rank's Phase-1 seconds with its KV exchange over a ``link_gbps`` GB/s link: simulated ranks add what
        their exchange steps leave uncovered (each step costs max(its attention, its transfer):
        :func:`magnetar.parallel.ring.exposed_seconds`); real ranks' times are measured with their own link and
        are returned as they are."""
        steps = self.phase1_exchange or [()] * len(self.phase1_seconds)
        return [t + exposed_seconds(s, link_gbps) for t, s in zip(self.phase1_seconds, steps)]

    def summary(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("first_token_logits", "phase1_exchange")}
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
class AnswerScore:
    """An answer teacher-forced after a question about a context (see :meth:`Engine.score_answer`): the model's
    distribution at every answer token, the input of fidelity measures against another method."""

    logprobs: torch.Tensor  # (T, V) float32 on CPU: row j is log p( . | context, query, answer[:j])
    answer_ids: torch.Tensor  # (T,) int64
    method: str
    context_tokens: int
    phase1_seconds: list[float]  # per CP rank (real or simulated); 0 for a context that came from the cache
    simulated: bool = False
    cached: bool = False  # the context's Phase 1 came from the context cache

    @property
    def token_logprobs(self) -> torch.Tensor:
        """``(T,)``: log p(answer[j] | context, query, answer[:j])."""
        return self.logprobs.gather(1, self.answer_ids.reshape(-1, 1)).reshape(-1)


@dataclass
class RankStats:
    """One CP rank's figures for one request (``peak_memory_bytes`` None until measured)."""

    phase1_seconds: float
    context_kv_tokens: int  # context KV held after Phase 1
    kv_bytes: int
    peak_memory_bytes: Optional[int] = None
    gen_kv_tokens: int = 0  # query/generated KV (the query rank only)
    decode_stats: Optional[dict] = None  # the decode policy's stats() of this rank (DecodeResult.decode_stats)
    # simulated ranks: each step of this rank's KV exchanges (ring's layers, hybrid layers) as (its attention
    # seconds, the bytes a ring moves beside it) -- priced at a link by GenerationResult.phase1_seconds_at; real
    # ranks measured their link: empty
    exchange: tuple = ()

    @property
    def kv_tokens(self) -> int:
        return self.context_kv_tokens + self.gen_kv_tokens


def sum_stats(per_rank: list[Optional[dict]]) -> Optional[dict]:
    """The ranks' decode-policy stats added key by key (None when no rank has any)."""
    present = [d for d in per_rank if d is not None]
    if not present:
        return None
    return {key: sum(d.get(key, 0) for d in present) for key in dict.fromkeys(k for d in present for k in d)}


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


_ROW = ("phase1_seconds", "context_kv_tokens", "kv_bytes", "peak_memory_bytes", "gen_kv_tokens")


def stats_row(st: RankStats, keys: tuple[str, ...]) -> list[float]:
    """One rank's figures of one request as numbers (what the ranks gather): the :class:`RankStats` fields, whether
    the decode policy reported stats, and its stats in the order of ``keys`` (the policy's ``stats_keys``)."""
    d = st.decode_stats
    if d is not None and set(d) != set(keys):
        raise RuntimeError(f"the decode policy's stats have keys {sorted(d)}, not the {sorted(keys)} it declares "
                           f"(stats_keys)")
    return [getattr(st, f) for f in _ROW] + [float(d is not None)] + [d[k] if d is not None else 0.0 for k in keys]


def stats_from_row(row: list[float], keys: tuple[str, ...]) -> RankStats:
    """The inverse of :func:`stats_row`."""
    ints = {f: int(v) for f, v in zip(_ROW[1:], row[1:len(_ROW)])}
    decode = dict(zip(keys, row[len(_ROW) + 1:])) if row[len(_ROW)] else None
    return RankStats(phase1_seconds=row[0], decode_stats=decode, **ints)


class Results:
    """The :class:`GenerationResult` of finished requests, on every rank of the replica.

    ``simulated``: this process stands in for every CP rank (their figures are all here); ``weight_bytes_per_rank``
    is reported with every result; ``method`` names a handle's method when it does not say (an old handle)."""

    def __init__(self, groups: ParallelGroups, device: torch.device, *, simulated: bool,
                 weight_bytes_per_rank: list[int], method: str, stats_keys: tuple[str, ...] = ()):
        self.groups, self.device, self.simulated = groups, device, simulated
        self.weight_bytes_per_rank, self.method = list(weight_bytes_per_rank), method
        self.stats_keys = tuple(stats_keys)  # the decode policy's (DecodePolicy.stats_keys)

    def assemble(self, handles: list[ContextHandle], qids: list[torch.Tensor], hits: list[bool],
                 decs: list[DecodeResult], samplers: list[RequestSampler]) -> list[GenerationResult]:
        """One result per finished request (one gather of every rank's figures for all of them)."""
        peak = peak_memory(self.device)
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
        if self.simulated or not handles:  # every rank's figures were measured here
            stats = local
        else:  # one gather of numbers: every rank's row of every request
            keys, g = self.stats_keys, self.groups
            rows = [stats_row(per[0], keys) for per in local]
            width = len(rows[0])
            gathered = all_gather_numbers([x for row in rows for x in row], g.cp_group, self.device,
                                          timeout=g.timeout).tolist()  # gathered[rank][request * width + field]
            stats = [[stats_from_row(r[i * width:(i + 1) * width], keys) for r in gathered]
                     for i in range(len(handles))]
        results = []
        for i, (h, q, dec, sampler) in enumerate(zip(handles, qids, decs, samplers)):
            per_rank = stats[i]
            results.append(GenerationResult(
                text=sampler.text(), token_ids=dec.token_ids, method=h.method or self.method,
                context_tokens=h.context_tokens, query_tokens=int(q.numel()), stop_reason=dec.stop_reason,
                phase1_seconds=[s.phase1_seconds for s in per_rank], ttft_seconds=dec.ttft_seconds,
                decode_seconds_per_token=(sum(dec.decode_seconds) / len(dec.decode_seconds)) if dec.decode_seconds
                else None,
                context_kv_tokens_per_rank=[s.context_kv_tokens for s in per_rank],
                kv_tokens_per_rank=[s.kv_tokens for s in per_rank], kv_bytes_per_rank=[s.kv_bytes for s in per_rank],
                peak_memory_bytes_per_rank=[s.peak_memory_bytes for s in per_rank],
                first_token_logits=dec.first_logits, simulated=self.simulated, prefill_stats=h.prefill_stats,
                decode_stats=sum_stats([s.decode_stats for s in per_rank]),
                weight_bytes_per_rank=list(self.weight_bytes_per_rank),
                cached_context_tokens=h.context_tokens if hits[i] else h.reused_tokens,
                phase1_exchange=[list(s.exchange) for s in per_rank] if self.simulated and not hits[i] else [],
            ))
        return results
