"""Scoring (perplexity): the log-likelihood of a continuation after a context, once per decoding variant over ONE
Phase 1 (``Engine.score`` / ``Engine.score_variants``)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from magnetar.config import EngineConfig, PolicySection
from magnetar.engine import inputs
from magnetar.engine.encode import Encoder
from magnetar.engine.phase2 import run_scoring, run_teacher_forced
from magnetar.engine.requests import Requests
from magnetar.engine.results import AnswerScore, ScoreResult
from magnetar.engine.strategy import DecodePolicy, PrefillPolicy, decode_policy
from magnetar.parallel import ParallelGroups
from magnetar.utils.nvtx import SCORE, nvtx_range


@dataclass(frozen=True)
class ScoreParts:
    """What scoring needs of an engine: its model, config, groups and device, its requests and encoder, its decode
    policy (and the config section that made it), its sparse-prefill policy, and ``prepare``, which readies another
    decode policy for this rank (its ops, its TP shard of the heads)."""

    model: Any
    config: EngineConfig
    groups: ParallelGroups
    device: torch.device
    requests: Requests
    encoder: Encoder
    policy: Optional[DecodePolicy]
    policy_config: Any
    prefill: Optional[PrefillPolicy]
    prepare: Callable


class Scorer:
    """Scores with an engine's :class:`ScoreParts`. Decode policies of other sparse / LuKA configs are made once and
    kept (hash weights load once)."""

    def __init__(self, parts: ScoreParts):
        self.engine, self.prepare = parts, parts.prepare
        self._policies: dict = {}

    def score_variants(self, context, continuation,
                       sparse: Sequence[Optional[PolicySection]]) -> list[ScoreResult]:
        """:meth:`score` once per decoding variant -- a :class:`SparseConfig` or a :class:`LukaConfig` (None,
        policy ``none`` or mode ``none``: dense decoding) -- over ONE Phase 1: the context KV is encoded once
        and shared, as only the decoding differs (each decoder keeps its own LuKA state)."""
        eng = self.engine
        inputs.check_score(context, continuation, sparse)
        c = eng.requests.plain_ids(context, "context")
        t = eng.requests.plain_ids(continuation, "continuation", min_tokens=2)
        eng.requests.agree("score", [c], [t], variants=sparse)
        eng.requests.check_lengths(int(c.numel()), int(t.numel()), 1)
        decoders = [self._decoder(v) for v in sparse]
        for dec in decoders:
            if dec is not None:
                dec.check(int(c.numel()))
        if any(d is not None and d.needs_prefill_mass for d in decoders) and eng.prefill is not None:
            raise ValueError("variants that need the attention mass of a dense Phase 1 (LuKA) cannot score with "
                             f"sparse prefill on (prefill_policy {eng.config.prefill.policy!r}); score them without it")
        out = []
        with nvtx_range(SCORE):
            p1 = eng.encoder.phase1(c, variants=decoders)
            seconds = eng.encoder.seconds_per_rank(p1.stats)
            prefill = None if p1.prefill_stats is None else p1.prefill_stats.as_dict()
            for dec in decoders:
                t0 = time.perf_counter()
                logp = run_scoring(eng.model, eng.config, p1.shard, t, p1.query_position, eng.groups, eng.device,
                                   policy=dec, context_tokens=int(c.numel()))
                out.append(ScoreResult(token_logprobs=logp, method=eng.config.method, context_tokens=int(c.numel()),
                                       phase1_seconds=seconds, phase2_seconds=time.perf_counter() - t0,
                                       simulated=eng.encoder.simulated, prefill_stats=prefill))
        return out

    def answer(self, context_ids: torch.Tensor, query_ids: torch.Tensor, answer_ids: torch.Tensor) -> AnswerScore:
        """``answer_ids`` teacher-forced after ``query_ids`` about ``context_ids`` (checked ids): Phase 1 through the
        context cache (a context just answered by :meth:`Engine.generate` is not encoded again), then the query and
        the answer as one Phase-2 forward with this engine's decode policy; the rows predicting the answer."""
        eng = self.engine
        Q, T = int(query_ids.numel()), int(answer_ids.numel())
        # the answer's last token is predicted, never read: the positions needed are those of a generation of T
        # tokens after the query (a context fitted for that generation fits this score)
        forced = torch.cat((query_ids, answer_ids[:-1]))
        eng.requests.agree("score_answer", [context_ids], [forced])
        eng.requests.check_lengths(int(context_ids.numel()), Q + T - 1, 1)
        with nvtx_range(SCORE):
            handle, hit = eng.encoder.encode(context_ids)
            # a view: the decode policy's state of this question never reaches the cached handle
            logits = run_teacher_forced(eng.model, eng.config, handle.shard.view(), forced, handle.query_position,
                                        eng.groups, eng.device, policy=eng.policy,
                                        context_tokens=handle.context_tokens)
        rows = torch.log_softmax(logits[Q - 1:Q - 1 + T], dim=-1).cpu()
        # a cache hit is one on every rank of the replica: its Phase 1 cost nothing, and nothing is gathered
        seconds = [0.0] * eng.config.parallel.cp_size if hit else eng.encoder.seconds_per_rank(handle.stats)
        return AnswerScore(logprobs=rows, answer_ids=answer_ids, method=eng.config.method,
                           context_tokens=handle.context_tokens, phase1_seconds=seconds,
                           simulated=eng.encoder.simulated, cached=hit)

    def _decoder(self, cfg: Optional[PolicySection]) -> Optional[DecodePolicy]:
        """The decode policy for a sparse or LuKA config (cached: hash weights load once), None for dense."""
        eng = self.engine
        if cfg is None:
            return None
        if cfg == eng.policy_config:
            return eng.policy
        if cfg not in self._policies:
            self._policies[cfg] = self.prepare(decode_policy(cfg, eng.model.config))
        return self._policies[cfg]
