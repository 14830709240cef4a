"""Decode-time KV selection: which context KV entries each Phase-2 token attends to, per layer and KV head.

One module per policy (``SparseConfig.sparse_policy``, registered in :data:`magnetar.config.POLICIES`), all
choosing per KV head for the whole query group (GQA), all built on :class:`SparseSelector` here:

* ``oracle_topk`` (:mod:`~magnetar.sparse.oracle`) -- the exact top-k by attention: softmax(q k / sqrt(d)) summed
  over the group's query heads (for one query head per KV head this is the top-k of q.k, the paper's oracle,
  App. A.2). The upper bound.
* ``lsh`` (:mod:`~magnetar.sparse.lsh`) -- angular LSH codes (random SO(d) rotations, App. A.8), Hamming similarity
  summed over the group; by default with 4 sink tokens and a 64-token local window, as MagicPIG runs.
* ``spotlight`` (:mod:`~magnetar.sparse.spotlight`) -- trained MLP hash codes (Eq. 5-6), Hamming similarity; no
  sinks or window by default.
* ``quest`` (:mod:`~magnetar.sparse.quest`) -- pages of ``page_size`` keys with per-channel min/max; page score
  sum_d max(q_d max_d, q_d min_d), max over the group; the best ``ceil(budget / page_size)`` pages.

The base does what they share: the budget and this shard's share of it, the sinks and window always kept, and the
attention over the selection -- the selected keys are gathered and attended with
:func:`magnetar.ops.attention_with_lse`, one batch row per (query token, KV head), so the result is an ``(out,
lse)`` state that merges with the rest (the query's own KV, other ranks' shards) like any other. Positions keep
causality: a padded slot gets a position after the query and is invisible. A budget covering the whole shard
takes the dense path, so ``oracle_topk`` with a full budget is dense attention exactly. A policy gives
:meth:`SparseSelector.scores` (the top ``take`` keys by score are taken) or its own :meth:`SparseSelector.select`.

Per context shard and layer, derived data (key codes, page bounds) is computed once, at the first step, and
kept in the layer's typed policy state (:class:`magnetar.engine.kv.PolicyState`, keyed by ``self.uid``).
"""
from __future__ import annotations

import itertools
import math
from typing import Optional

import torch

from magnetar.config import SparseConfig
from magnetar.engine.kv import LayerKV
from magnetar.engine.strategy import DecodePolicyBase
from magnetar.ops import attention_with_lse

BIG_POS = 2**62  # position of a padding slot: after every query, so never visible
_IDS = itertools.count()


class SparseSelector(DecodePolicyBase):
    """The base of a sparse-decode policy (a :class:`magnetar.engine.strategy.DecodePolicy`)."""

    @classmethod
    def label(cls, cfg: SparseConfig) -> str:
        """``spotlight(90% pruned)`` / ``quest(budget 2048)``: the policy and how much it reads."""
        amount = f"{100 * cfg.sparse_pruning:g}% pruned" if cfg.sparse_pruning else f"budget {cfg.sparse_budget}"
        return f"{cfg.sparse_policy}({amount})"

    def __init__(self, cfg: SparseConfig, model_config):
        super().__init__(cfg, model_config)
        self.uid = next(_IDS)  # policy state is keyed by it: decoders sharing a shard keep their own derived data

    def shard_heads(self, first: int, count: int, total: int) -> None:
        """Tensor parallelism: this rank sees KV heads ``[first, first + count)``. Every policy chooses per KV head:
        nothing to narrow (hashing policies narrow their per-head hash functions)."""

    def check(self, context_tokens: int) -> None:
        """Raise a ValueError if a fixed ``sparse_budget`` exceeds a context of ``context_tokens``."""
        budget = self.cfg.sparse_budget
        if budget > context_tokens:
            raise ValueError(f"sparse_budget ({budget} tokens) exceeds the context ({context_tokens} tokens): lower "
                             f"--sparse-budget or give a pruning rate (--sparse-pruning 0.98) instead")

    def applies(self, layer: int, window: Optional[int]) -> bool:
        """Sparse in this layer? Not in the first ``dense_layers``, nor in sliding-window (local) layers."""
        return layer >= self.cfg.dense_layers and window is None

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

    # -- the choice --------------------------------------------------------------------------------------
    def forced(self, kv: LayerKV, context_tokens: int) -> Optional[torch.Tensor]:
        """``(N,)`` True for this shard's keys always kept (the first ``sinks`` and last ``window`` of the
        context), or None when there are none."""
        sinks, window = self.cfg.sinks, self.cfg.window
        if not sinks and not window:
            return None
        forced = (kv.pos < sinks) | (kv.pos >= context_tokens - window)
        return forced if bool(forced.any()) else None

    def scores(self, layer: int, q: torch.Tensor, kv: LayerKV, scale: float) -> torch.Tensor:
        """``(Hkv, S, N)`` float scores of the shard's keys for queries ``q (1, Hq, S, D)`` (higher: kept first)."""
        raise NotImplementedError(f"{type(self).__name__} defines neither scores() nor select()")

    def select(self, layer: int, q: torch.Tensor, kv: LayerKV, take: int, forced: Optional[torch.Tensor],
               scale: float) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Indices ``(Hkv, S, n)`` into ``kv`` of the ``take`` keys to attend (the ``forced`` ones among them), and
        a validity mask of them or None. By default the top ``take`` of :meth:`scores`."""
        scores = self.scores(layer, q, kv, scale)
        if forced is not None:
            scores = scores.masked_fill(forced, float("inf"))
        return scores.topk(take, dim=-1).indices, None

    def choose(self, layer: int, q: torch.Tensor, kv: LayerKV, kk: int, scale: float, context_tokens: int
               ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """:meth:`select` of the sinks and window of this shard plus the ``kk`` best other keys."""
        forced = self.forced(kv, context_tokens)
        n_forced = int(forced.sum()) if forced is not None else 0
        return self.select(layer, q, kv, min(kv.k.shape[2], kk + n_forced), forced, scale)

    # -- attention over the selection -------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, kv, q_pos: torch.Tensor, kk: int, scale: float,
               context_tokens: int, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """``(out (1, Hq, S, D), lse (1, Hq, S))`` of queries ``q`` over their selection from ``kv``."""
        N = kv.k.shape[2]
        if kk >= N:
            return attention_with_lse(q, kv.k, kv.v, q_pos=q_pos, k_pos=kv.pos, scale=scale, backend=backend)
        idx, valid = self.choose(layer, q, kv, kk, scale, context_tokens)
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
