"""LuKA in the engine: the Phase-2 attention over a context shard, per layer lined (H2O) or clustered.

The engine's Phase-2 attention (:class:`magnetar.engine.phase2.Phase2Context`) asks the decoder for each
request's ``(out, lse)`` over this rank's context shard, merges it with the query/generated KV and the other
ranks' states as usual, and hands the merged log-sum-exp back (:meth:`LukaDecoder.after_merge`) so that the
mass every attended context token received -- normalised over everything the token attended to -- is added
to the shard's accumulated mass (H2O's scores, without decay). Phase 1 started that mass: with LuKA on, the
prefill of dense / Star / Pulsar records for every stored key the attention mass the block's queries gave it
(:func:`magnetar.luka.core.column_mass`, handed to Phase 1 as :meth:`LukaDecoder.prefill_mass`).

State per (context shard, layer) lives in the layer's typed policy state under this decoder's id: a copy of the
accumulated mass (so several decoders scoring one shard never see each other's updates), the pages cut so
far and their summaries. Pages cover the shard's oldest tokens; a token becomes eligible once it is more
than ``luka_recent`` tokens behind the current query, and the segmenter + compressor run at the first step
and then every ``luka_compress_every`` steps. Generated tokens always stay raw (they live in the query rank's
Phase-2 store, attended densely): LuKA compresses the context.

Distributed Phase 2 (Star/Pulsar): every rank applies LuKA to its own shard -- heavy hitters in proportion to
its share of the context, its own pages, ``top_k`` per rank -- and the usual merge combines the states.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from magnetar.config import LukaConfig
from magnetar.engine.kv import LayerKV
from magnetar.luka.core import clustered_attention, column_mass, compress_pages, heavy_hitters
from magnetar.utils.timing import no_timer

_IDS = itertools.count()


@dataclass
class LukaLayerState:
    """LuKA's state for one (context shard, layer), per decoder."""

    mass: torch.Tensor  # (H, N) accumulated attention mass (this decoder's copy)
    pages: int = 0  # pages cut so far: they cover shard entries [0, pages * page_size)
    ks: Optional[torch.Tensor] = None  # (H, pages, D) summary keys
    vs: Optional[torch.Tensor] = None
    steps: int = 0  # Phase-2 tokens seen
    last_compress: int = -1  # steps at the last run of the segmenter
    generator: Optional[torch.Generator] = None


@dataclass
class _Pending:
    state: LukaLayerState
    alpha: torch.Tensor  # (H, G, S, n) mass of the attended context entries (local normalisation)
    idx: torch.Tensor  # (H, S, n) their shard indices
    lse: torch.Tensor  # (H, G, S) local log-sum-exp
    valid: int  # real query tokens (the rest is padding)


class LukaDecoder:
    """The engine's LuKA policy (a :class:`magnetar.engine.strategy.DecodePolicy`, as
    :class:`magnetar.sparse.select.SparseDecoder` is)."""

    needs_prefill_mass = True  # H2O's scores start with the attention mass of Phase 1

    def __init__(self, cfg: LukaConfig, model_config, *, timer=None):
        """``timer``: a :class:`magnetar.utils.timing.SectionTimer` to charge time to ``select``, ``attention``,
        ``refine``, ``compress`` and ``mass`` (the latency breakdown of ``benchmarks/bench_luka.py``)."""
        if cfg.luka_mode == "none":
            raise ValueError("LukaDecoder needs luka_mode lined, clustered or mixed")
        self.cfg = cfg
        self.num_layers = int(model_config.num_hidden_layers)
        self.uid = next(_IDS)
        self.pending: dict[int, dict[int, _Pending]] = {}
        self.timer = timer or no_timer
        self.score_chunk = cfg.luka_compress_every  # teacher-forced scoring runs this many tokens per forward

    # -- what the engine asks ---------------------------------------------------------------------------
    def kind(self, layer: int) -> str:
        return self.cfg.layer_kind(layer, self.num_layers)

    def applies(self, layer: int, window: Optional[int]) -> bool:
        """LuKA in this layer? Not in sliding-window (local) layers: they keep their window."""
        return window is None and self.kind(layer) != "none"

    def check(self, context_tokens: int) -> None:
        """Raise a ValueError if this config cannot run on a context of ``context_tokens``."""
        cfg = self.cfg
        clustered = any(self.kind(i) == "clustered" for i in range(self.num_layers))
        if clustered and cfg.luka_refine == "top_k":
            pages = max(0, context_tokens - cfg.luka_recent) // cfg.luka_page_size
            if cfg.luka_refine_k > pages:
                raise ValueError(
                    f"luka_refine_k ({cfg.luka_refine_k}) exceeds the {pages} pages of a {context_tokens}-token "
                    f"context (pages of {cfg.luka_page_size} tokens, the last {cfg.luka_recent} kept raw): lower "
                    f"--luka-refine-k, --luka-page-size or --luka-recent, or give a longer context")

    def prefill_mass(self, q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, *, scale: float, q_pos: torch.Tensor,
                     k_pos: torch.Tensor, window: Optional[int] = None) -> torch.Tensor:
        """Phase 1's record: the attention mass the local queries gave each kept key (``column_mass``)."""
        return column_mass(q, k, lse, scale=scale, q_pos=q_pos, k_pos=k_pos, window=window)

    def layer_state(self, kv: LayerKV) -> Optional[LukaLayerState]:
        """This decoder's state of one context layer (None before its first step there)."""
        return kv.state.get(self.uid, LukaLayerState)

    # -- attention --------------------------------------------------------------------------------------
    def attend_context(self, layer: int, b: int, q: torch.Tensor, kv: LayerKV, q_pos: torch.Tensor, scale: float,
                       context_tokens: int, *, backend: str = "auto", valid: Optional[int] = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out (1, Hq, S, D), lse (1, Hq, S))`` of request ``b``'s queries over its context shard ``kv``."""
        _, Hq, S, D = q.shape
        H, N = kv.k.shape[1], kv.k.shape[2]
        G = Hq // H
        qmin = int(q_pos.min())
        st = self._state(kv, qmin)
        qg = q[0].reshape(H, G, S, D)
        recent_from = qmin - self.cfg.luka_recent  # context entries at or after this position stay raw
        if self.kind(layer) == "lined":
            share = min(N, math.ceil(self.cfg.heavy_budget(context_tokens) * N / max(context_tokens, 1)))
            with self.timer("select"):
                forced = kv.pos >= recent_from
                idx = heavy_hitters(st.mass, share, forced if bool(forced.any()) else None)  # (H, n)
            with self.timer("attention"):
                heads = torch.arange(H, device=q.device)[:, None]
                ks, vs = kv.k[0][heads, idx].float(), kv.v[0][heads, idx].float()  # (H, n, D)
                logits = torch.einsum("hgsd,hnd->hgsn", qg.float(), ks) * scale
                lse = torch.logsumexp(logits, -1)
                alpha = torch.exp(logits - lse[..., None])
                out = torch.einsum("hgsn,hnd->hgsd", alpha, vs)
            self._stash(layer, b, _Pending(st, alpha, idx[:, None].expand(H, S, idx.shape[1]), lse,
                                           S if valid is None else valid))
        else:
            with self.timer("compress"):
                self._maybe_compress(st, kv, recent_from, G)
            ps = self.cfg.luka_page_size
            cut = st.pages * ps
            kp = kv.k[0, :, :cut].reshape(H, st.pages, ps, D)  # views, no copy
            vp = kv.v[0, :, :cut].reshape(H, st.pages, ps, D)
            res = clustered_attention(qg, st.ks, st.vs, kp, vp, kv.k[0, :, cut:], kv.v[0, :, cut:], scale=scale,
                                      rule=self.cfg.luka_refine, k=self.cfg.luka_refine_k,
                                      fraction=self.cfg.luka_refine_fraction, eps=self.cfg.luka_refine_eps,
                                      mass=self.cfg.luka_refine_mass, scope=self.cfg.luka_refine_scope,
                                      rows=S if valid is None else valid, timer=self.timer,
                                      summary_bias=math.log(ps) if self.cfg.luka_size_bias else 0.0)
            out, lse = res.out.float(), res.lse
            n, R = res.child_idx.shape[-1], N - cut
            child_tok = (res.child_idx[..., None] * ps + torch.arange(ps, device=q.device)).reshape(H, S, n * ps)
            raw_tok = torch.arange(cut, N, device=q.device).view(1, 1, R).expand(H, S, R)
            alpha = torch.cat((res.child_alpha.reshape(H, G, S, n * ps), res.raw_alpha), -1)
            self._stash(layer, b, _Pending(st, alpha, torch.cat((child_tok, raw_tok), -1), lse,
                                           S if valid is None else valid))
        st.steps += S if valid is None else valid
        return out.to(q.dtype).reshape(1, Hq, S, D), lse.reshape(1, Hq, S)

    def after_merge(self, layer: int, lse: torch.Tensor) -> None:
        """Add the mass of this layer's attended context entries, normalised by the merged ``lse (B, Hq, S)``."""
        with self.timer("mass"):
            for b, p in self.pending.pop(layer, {}).items():
                H, G, S, _ = p.alpha.shape
                c = torch.exp(p.lse - lse[b].float().reshape(H, G, S))[..., None]  # local -> global normalisation
                w = (p.alpha * c)[:, :, : p.valid].sum(1)  # (H, S', n)
                p.state.mass.scatter_add_(1, p.idx[:, : p.valid].reshape(H, -1), w.reshape(H, -1))

    # -- state ------------------------------------------------------------------------------------------
    def _state(self, kv, qmin: int) -> LukaLayerState:
        st = self.layer_state(kv)
        if st is None:
            if int(kv.pos.max()) >= qmin:
                raise ValueError("LuKA attends to context KV that precedes every Phase-2 token; this shard holds "
                                 "positions at or after the query")
            if kv.pos.numel() > 1 and not bool((kv.pos[1:] > kv.pos[:-1]).all()):
                raise ValueError("LuKA pages need the context shard in position order (dense, star, pulsar)")
            mass = getattr(kv, "mass", None)
            if mass is None:
                raise ValueError("this context shard carries no attention mass: LuKA needs Phase 1 run with "
                                 "luka_mode set (the engine does this when its config or a scored variant uses LuKA)")
            gen = torch.Generator().manual_seed(self.cfg.luka_seed)
            st = kv.state.put(self.uid, LukaLayerState(mass=mass[0].float().clone(), generator=gen))
        return st

    def _maybe_compress(self, st: LukaLayerState, kv, recent_from: int, group: int) -> None:
        """Cut the pages that became eligible (every ``luka_compress_every`` steps); ``group``: query heads per
        KV head (the attention_weighted compressor averages the mass over them)."""
        if st.last_compress >= 0 and st.steps - st.last_compress < self.cfg.luka_compress_every:
            return
        st.last_compress = st.steps
        ps = self.cfg.luka_page_size
        eligible = int(torch.searchsorted(kv.pos, torch.tensor(recent_from, device=kv.pos.device)))
        pages = eligible // ps
        H, D = kv.k.shape[1], kv.k.shape[3]
        if st.ks is None:
            st.ks = kv.k.new_zeros(H, 0, D)
            st.vs = kv.v.new_zeros(H, 0, D)
        if pages <= st.pages:
            return
        a, z = st.pages * ps, pages * ps
        kp = kv.k[0, :, a:z].reshape(H, pages - st.pages, ps, D)
        vp = kv.v[0, :, a:z].reshape(H, pages - st.pages, ps, D)
        ks, vs = compress_pages(kp, vp, self.cfg.luka_compressor, mass=st.mass[:, a:z].reshape(H, -1, ps),
                                tau=self.cfg.luka_tau, group=group, generator=st.generator)
        if self.cfg.luka_zero_values:
            vs = torch.zeros_like(vs)
        st.ks, st.vs = torch.cat((st.ks, ks), 1), torch.cat((st.vs, vs), 1)
        st.pages = pages

    def _stash(self, layer: int, b: int, p: _Pending) -> None:
        self.pending.setdefault(layer, {})[b] = p
