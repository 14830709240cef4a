"""Decode-time KV selection: which context KV entries each Phase-2 token attends to, per layer and KV head.

Policies (``SparseConfig.sparse_policy``), all choosing per KV head for the whole query group (GQA):

* ``oracle_topk`` -- the exact top-k by attention: softmax(q k / sqrt(d)) summed over the group's query heads
  (for one query head per KV head this is the top-k of q.k, the paper's oracle, App. A.2). The upper bound.
* ``lsh``         -- angular LSH codes (random SO(d) rotations, App. A.8), Hamming similarity summed over the
  group; by default with 4 sink tokens and a 64-token local window, as MagicPIG runs.
* ``spotlight``   -- trained MLP hash codes (Eq. 5-6), Hamming similarity; no sinks or window by default.
* ``quest``       -- pages of ``page_size`` keys with per-channel min/max; page score
  sum_d max(q_d max_d, q_d min_d), max over the group; the best ``ceil(budget / page_size)`` pages.

The selected keys are gathered and attended with :func:`magnetar.ops.attention_with_lse`, one batch row per
(query token, KV head), so the result is an ``(out, lse)`` state that merges with the rest (the query's own
KV, other ranks' shards) like any other. Positions keep causality: a padded slot gets a position after the
query and is invisible. A budget covering the whole shard takes the dense path, so ``oracle_topk`` with a full
budget is dense attention exactly.

Per context shard and layer, derived data (key codes, page bounds) is computed once, at the first step, and
kept in the layer's typed policy state (:class:`magnetar.engine.kv.PolicyState`).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from magnetar.config import SparseConfig
from magnetar.engine.kv import LayerKV
from magnetar.ops import attention_with_lse
from magnetar.sparse.codes import HAMMING_OP, hamming_scores, hamming_topk, topk_scores_torch

BIG_POS = 2**62  # position of a padding slot: after every query, so never visible
_IDS = itertools.count()


@dataclass
class KeyCodes:
    """lsh / spotlight: the packed hash codes of a shard's keys, ``(Hkv, N, W)`` int32."""

    codes: torch.Tensor


@dataclass
class PageBounds:
    """quest: per-channel max and min of every page of a shard's keys, each ``(Hkv, P, D)`` float32."""

    kmax: torch.Tensor
    kmin: torch.Tensor


class SparseDecoder:
    """The sparse-decode policy of an engine (a :class:`magnetar.engine.strategy.DecodePolicy`)."""

    needs_prefill_mass = False  # the selection reads the keys only
    score_chunk = 0  # stateless: teacher-forced scoring runs the whole continuation at once

    def __init__(self, cfg: SparseConfig, model_config, *, hash_backend: str = "auto"):
        self.cfg = cfg
        self.hash_backend = hash_backend
        self.uid = next(_IDS)  # policy state is keyed by it: decoders sharing a shard keep their own codes
        self.hashes = None
        if cfg.sparse_policy in ("lsh", "spotlight"):
            from magnetar.sparse.hashing import load_or_make_hashes

            kind = "lsh" if cfg.sparse_policy == "lsh" else "mlp"
            self.hashes = load_or_make_hashes(kind, model_config, path=cfg.hash_path, bits=cfg.code_bits,
                                              seed=cfg.hash_seed)

    def prepare(self, device: torch.device) -> None:
        """Build or load the Hamming op now (at engine start) if this policy hashes, so the first build never
        happens inside a step while the other ranks wait in a collective with a timeout."""
        if self.hashes is not None and self.hash_backend != "torch":
            HAMMING_OP.available(device)

    def shard_heads(self, first: int, count: int, total: int) -> None:
        """Tensor parallelism: this rank sees KV heads ``[first, first + count)``. Every policy chooses per KV head,
        so only the hash functions (one per KV head) are narrowed to those heads."""
        if self.hashes is not None:
            self.hashes.keep_heads(first, count, total)

    def check(self, context_tokens: int) -> None:
        """Raise a ValueError if a fixed ``sparse_budget`` exceeds a context of ``context_tokens``."""
        budget = self.cfg.sparse_budget
        if budget > context_tokens:
            raise ValueError(f"sparse_budget ({budget} tokens) exceeds the context ({context_tokens} tokens): lower "
                             f"--sparse-budget or give a pruning rate (--sparse-pruning 0.98) instead")

    def after_merge(self, layer: int, lse: torch.Tensor) -> None:
        """Nothing to accumulate: the choice is made again at every step from the keys alone."""

    def prefill_mass(self, q, k, lse, *, scale, q_pos, k_pos, window=None) -> torch.Tensor:
        raise NotImplementedError("sparse decoding needs no Phase-1 attention mass (needs_prefill_mass is False)")

    def applies(self, layer: int, window: Optional[int]) -> bool:
        """Sparse in this layer? Not in the first ``dense_layers``, nor in sliding-window (local) layers."""
        return self.cfg.sparse_policy != "none" and layer >= self.cfg.dense_layers and window is None

    def share(self, budget: int, shard_tokens: int, context_tokens: int) -> int:
        """This shard's part of the request's ``budget``: proportional to its share of the context (rounded
        up), so the shares sum to at least the budget and a full budget covers every shard."""
        if context_tokens <= 0 or shard_tokens <= 0:
            return 0
        return min(shard_tokens, math.ceil(budget * shard_tokens / context_tokens))

    def attend_context(self, layer: int, b: int, q: torch.Tensor, kv: LayerKV, q_pos: torch.Tensor, scale: float,
                       context_tokens: int, *, backend: str = "auto", valid: Optional[int] = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The Phase-2 attention's entry point: request ``b``'s queries over this rank's context shard ``kv``,
        attending to the shard's share of the budget (``valid``, the real query tokens, is not needed here)."""
        kk = self.share(self.cfg.budget(context_tokens), kv.k.shape[2], context_tokens)
        return self.attend(layer, q, kv, q_pos, kk, scale, context_tokens, backend=backend)

    # -- scores ------------------------------------------------------------------------------------------
    def _forced(self, kv, context_tokens: int) -> Optional[torch.Tensor]:
        sinks, window = self.cfg.sinks, self.cfg.window
        if not sinks and not window:
            return None
        forced = (kv.pos < sinks) | (kv.pos >= context_tokens - window)
        return forced if bool(forced.any()) else None

    def select(self, layer: int, q: torch.Tensor, kv, kk: int, scale: float, context_tokens: int
               ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Indices ``(Hkv, S, n)`` into ``kv`` for queries ``q (1, Hq, S, D)`` (and a validity mask or None):
        the sinks and window of this shard plus the ``kk`` best other keys."""
        Hkv, N = kv.k.shape[1], kv.k.shape[2]
        _, Hq, S, D = q.shape
        G = Hq // Hkv
        policy = self.cfg.sparse_policy
        forced = self._forced(kv, context_tokens)
        n_forced = int(forced.sum()) if forced is not None else 0
        take = min(N, kk + n_forced)
        if policy == "quest":
            return self._quest(layer, q, kv, take, forced)
        if policy in ("lsh", "spotlight"):
            cached = kv.state.get(self.uid, KeyCodes)
            if cached is None:
                cached = kv.state.put(self.uid, KeyCodes(self.hashes.codes(layer, kv.k[0], backend=self.hash_backend)))
            codes = cached.codes  # (Hkv, N, W)
            qc = self.hashes.codes(layer, q[0].reshape(Hkv, G, S, D).transpose(1, 2), backend=self.hash_backend)
            if forced is None:  # the fused op: scores and top-k in one pass
                return hamming_topk(qc, codes, take, backend=self.hash_backend)[1], None
            scores = hamming_scores(qc, codes, backend=self.hash_backend)
            scores = scores.masked_fill(forced, int(scores.max()) + 1 if scores.numel() else 1)
            return topk_scores_torch(scores, take)[1], None
        if policy == "oracle_topk":
            logits = torch.einsum("hgsd,hnd->hgsn", q[0].reshape(Hkv, G, S, D).float(), kv.k[0].float()) * scale
            scores = torch.softmax(logits, dim=-1).sum(1)  # (Hkv, S, N): attention mass of the group
            if forced is not None:
                scores = scores.masked_fill(forced, float("inf"))
            return scores.topk(take, dim=-1).indices, None
        raise ValueError(f"no selection for policy {policy!r}")

    def _quest(self, layer, q, kv, take, forced):
        Hkv, N, D = kv.k.shape[1], kv.k.shape[2], kv.k.shape[3]
        _, Hq, S, _ = q.shape
        G, ps = Hq // Hkv, self.cfg.page_size
        P = math.ceil(N / ps)
        bounds = kv.state.get(self.uid, PageBounds)
        if bounds is None:  # per-channel min / max of each page (a partial last page pads with its own keys)
            k = kv.k[0].float()
            pad = P * ps - N
            if pad:
                k = torch.cat((k, k[:, -1:].expand(Hkv, pad, D)), dim=1)
            k = k.reshape(Hkv, P, ps, D)
            bounds = kv.state.put(self.uid, PageBounds(k.amax(2), k.amin(2)))
        kmax, kmin = bounds.kmax, bounds.kmin
        qg = q[0].reshape(Hkv, G, S, D).float()
        # sum_d max(q_d max_d, q_d min_d) = q+ . max + q- . min (max_d >= min_d): two matmuls, no (.., P, D) tensor
        page = (torch.einsum("hgsd,hpd->hgsp", qg.clamp(min=0), kmax)
                + torch.einsum("hgsd,hpd->hgsp", qg.clamp(max=0), kmin))
        page = page.amax(1)  # (Hkv, S, P): upper bound of q.k per page, max over the group
        if forced is not None:  # pages holding a sink or window key are always taken
            fp = torch.zeros(P * ps, dtype=torch.bool, device=forced.device)
            fp[:N] = forced
            page = page.masked_fill(fp.reshape(P, ps).any(-1), float("inf"))
        n_pages = min(P, math.ceil(take / ps))
        pages = page.topk(n_pages, dim=-1).indices  # (Hkv, S, n_pages)
        idx = (pages[..., None] * ps + torch.arange(ps, device=pages.device)).reshape(Hkv, S, n_pages * ps)
        valid = idx < N
        return idx.clamp(max=N - 1), valid

    # -- attention over the selection -------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, kv, q_pos: torch.Tensor, kk: int, scale: float,
               context_tokens: int, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """``(out (1, Hq, S, D), lse (1, Hq, S))`` of queries ``q`` over their selection from ``kv``."""
        N = kv.k.shape[2]
        if kk >= N:
            return attention_with_lse(q, kv.k, kv.v, q_pos=q_pos, k_pos=kv.pos, scale=scale, backend=backend)
        idx, valid = self.select(layer, q, kv, kk, scale, context_tokens)
        Hkv, S, n = idx.shape
        _, Hq, _, D = q.shape
        G = Hq // Hkv
        heads = torch.arange(Hkv, device=idx.device)[:, None, None]
        ks = kv.k[0][heads, idx].transpose(0, 1).reshape(S * Hkv, 1, n, D)  # batch row = (token s, KV head h)
        vs = kv.v[0][heads, idx].transpose(0, 1).reshape(S * Hkv, 1, n, D)
        kpos = kv.pos[idx]
        if valid is not None:
            kpos = kpos.masked_fill(~valid, BIG_POS)
        kpos = kpos.transpose(0, 1).reshape(S * Hkv, n)
        qs = q[0].reshape(Hkv, G, S, D).permute(2, 0, 1, 3).reshape(S * Hkv, G, 1, D)
        if valid is None and int(kv.pos.max()) < int(q_pos.min()):
            # every selected key precedes every query (Phase 2 follows its context): the mask-free path
            out, lse = attention_with_lse(qs, ks, vs, causal=False, scale=scale, backend=backend)
        else:
            qpos = q_pos.reshape(S, 1).expand(S, Hkv).reshape(S * Hkv, 1)
            out, lse = attention_with_lse(qs, ks, vs, q_pos=qpos, k_pos=kpos, scale=scale, backend=backend)
        out = out.reshape(S, Hkv, G, D).permute(1, 2, 0, 3).reshape(1, Hq, S, D)
        lse = lse.reshape(S, Hkv, G).permute(1, 2, 0).reshape(1, Hq, S)
        return out, lse
