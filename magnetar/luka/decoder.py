"""LuKA in the engine: the Phase-2 attention over a context shard, per layer lined (H2O) or clustered.

The engine's Phase-2 attention (:class:`magnetar.engine.phase2.Phase2Context`) asks the decoder for each
request's ``(out, lse)`` over this rank's context shard -- on the query rank together with its Phase-2 store
(the query's and the generated tokens' KV, ``gen``), which clustered layers page too -- merges it with the
other ranks' states as usual, and hands the merged log-sum-exp back (:meth:`LukaDecoder.after_merge`) so that
the mass every attended token received -- normalised over everything the token attended to -- is added to the
accumulated mass (H2O's scores, without decay). Phase 1 started that mass: with LuKA on, the prefill of dense /
Star / Pulsar records for every stored key the attention mass the block's queries gave it
(:func:`magnetar.luka.core.column_mass`, handed to Phase 1 as :meth:`LukaDecoder.prefill_mass`).

State per (context shard, layer) lives in the layer's typed policy state under this decoder's id: a copy of the
accumulated mass (so several decoders scoring one shard never see each other's updates), the pages cut so
far and their summaries, and on the query rank the mass and pages of its Phase-2 store. Pages cover the
oldest entries; an entry becomes eligible once it is more than ``luka_recent`` tokens behind the current
query. The query rank pages its Phase-2 store once its whole context shard is eligible, from the store's first
entry (the shard's last ``N mod luka_page_size`` entries stay raw); the store's raw tail is attended causally.

When LuKA starts (``luka_regime``): ``before_query`` runs the segmenter + compressor at the first Phase-2
forward (the query) and then every ``luka_compress_every`` tokens; ``after_query`` reads the query's forward
exactly (dense over the shard, its mass still accumulated) and starts at the next forward; ``after_generation``
also reads the first ``luka_compress_every - 1`` generated tokens' forwards exactly. :meth:`LukaDecoder.stats`
says how much of the context was held compressed when the last token was produced.

Distributed Phase 2 (Star/Pulsar): every rank applies LuKA to its own shard -- heavy hitters in proportion to
its share of the context, its own pages, ``top_k`` per rank -- and the usual merge combines the states.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from magnetar.config import LukaConfig
from magnetar.engine.kv import KVShard, LayerKV
from magnetar.engine.strategy import DecodePolicyBase
from magnetar.luka.core import clustered_attention, column_mass, compress_pages, heavy_hitters
from magnetar.ops import attention_with_lse, merge_states
from magnetar.utils.timing import no_timer

_IDS = itertools.count()


@dataclass
class LukaLayerState:
    """LuKA's state for one (context shard, layer), per decoder (on the query rank with its Phase-2 store's)."""

    mass: torch.Tensor  # (H, N) accumulated attention mass of the shard's entries (this decoder's copy)
    pages: int = 0  # pages cut from the shard: they cover its entries [0, pages * page_size)
    ks: Optional[torch.Tensor] = None  # (H, pages + gen_pages, D) summary keys: the shard's pages, then the store's
    vs: Optional[torch.Tensor] = None
    steps: int = 0  # Phase-2 tokens seen
    query: int = 0  # tokens of the first Phase-2 forward (the query)
    last_compress: int = -1  # steps at the last run of the segmenter
    attended: int = 0  # shard entries the last forward attended as raw tokens (lined; for stats)
    gen_pages: int = 0  # pages cut from the Phase-2 store: they cover its entries [0, gen_pages * page_size)
    gen_mass: Optional[torch.Tensor] = None  # (H, M) accumulated mass of the Phase-2 store's entries
    generator: Optional[torch.Generator] = None


@dataclass
class _Pending:
    """What one forward attended, for :meth:`LukaDecoder.after_merge` to add its mass once the merged lse is known."""

    valid: int  # real query tokens (the rest is padding)
    # (mass (H, n_all) to add to, alpha (H, G, S, n) locally normalised, idx (H, S, n) into mass, local lse (H, G, S))
    parts: list = field(default_factory=list)
    # entries read by plain attention: (mass (H, n) to add to, q (1, Hq, S, D), k (1, H, n, D), q_pos, k_pos, scale),
    # positions None when every key is visible; their mass is recomputed from the merged lse (column_mass)
    dense: list = field(default_factory=list)


class _Pages:
    """The shard's page tokens ``a (H, Pa, L, D)`` followed by the Phase-2 store's ``b (H, Pb, L, D)``, read as
    :func:`magnetar.luka.core.clustered_attention` reads its ``kp`` (``shape`` and ``[heads, idx]`` with ``idx
    (H, S, n)``) without concatenating them: that would copy the context's pages at every step."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        self.a, self.b = a, b
        self.shape = torch.Size((a.shape[0], a.shape[1] + b.shape[1], *a.shape[2:]))

    def __getitem__(self, key) -> torch.Tensor:
        heads, idx = key
        pa = self.a.shape[1]
        if pa == 0:
            return self.b[heads, idx]
        from_a = self.a[heads, idx.clamp(max=pa - 1)]
        from_b = self.b[heads, (idx - pa).clamp(min=0)]
        return torch.where((idx >= pa)[..., None, None], from_b, from_a)


class LukaDecoder(DecodePolicyBase):
    """The engine's LuKA policy (a :class:`magnetar.engine.strategy.DecodePolicy`; every ``luka_mode`` but ``none``
    is registered to it)."""

    @classmethod
    def label(cls, cfg) -> str:
        """``luka(mode, ...)`` naming the LuKA options a result depends on, e.g. ``luka(clustered, mean, top_k 3)``."""
        parts = [cfg.luka_mode]
        if cfg.luka_mode == "mixed":
            parts.append(f"lined {cfg.luka_lined_layers}+{cfg.luka_lined_layers}")
        if cfg.luka_mode in ("lined", "mixed"):
            parts.append(f"heavy {cfg.luka_heavy_fraction:g}")
        if cfg.luka_mode in ("clustered", "mixed"):
            parts.append(cfg.luka_compressor + (f" tau {cfg.luka_tau:g}" if cfg.luka_tau != 1.0 else ""))
            rule = {"top_k": f"top_k {cfg.luka_refine_k}", "top_fraction": f"top_fraction {cfg.luka_refine_fraction:g}",
                    "threshold": f"threshold {cfg.luka_refine_eps:g}", "none": "no refinement"}[cfg.luka_refine]
            # the options that differ from the defaults (the authors' exact mass and shared choice)
            parts.append(rule + (" preserve" if cfg.luka_refine_mass == "preserve" else "")
                         + (" per-KV-head" if cfg.luka_refine_scope == "per_kv_head" else ""))
            if cfg.luka_page_size != 16:
                parts.append(f"page {cfg.luka_page_size}")
            if cfg.luka_zero_values:
                parts.append("V=0")
        if cfg.luka_recent != 128:
            parts.append(f"recent {cfg.luka_recent}")
        if cfg.luka_regime != "after_query":  # the paper's regime is the default; the others are named
            parts.append(cfg.luka_regime.replace("_", " "))
        return f"luka({', '.join(parts)})"

    needs_prefill_mass = True  # H2O's scores start with the attention mass of Phase 1
    pages_generated = True  # attend_context takes the query rank's Phase-2 store (gen=) and pages it too

    def __init__(self, cfg: LukaConfig, model_config, *, timer=None):
        """``timer``: a :class:`magnetar.utils.timing.SectionTimer` to charge time to ``select``, ``attention``,
        ``refine``, ``compress`` and ``mass`` (the latency breakdown of ``benchmarks/bench_luka.py``)."""
        if cfg.luka_mode == "none":
            raise ValueError("LukaDecoder needs luka_mode lined, clustered or mixed")
        super().__init__(cfg, model_config)
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

    def shard_heads(self, first: int, count: int, total: int) -> None:
        """Tensor parallelism: this rank sees ``count`` of ``total`` KV heads. Summaries, heavy hitters and
        per-KV-head refinement are per head; the ``shared`` refinement picks one page set from every head's mass,
        which no rank sees, so it is refused."""
        clustered = any(self.kind(i) == "clustered" for i in range(self.num_layers))
        if clustered and self.cfg.luka_refine_scope == "shared":
            raise ValueError(
                f"luka_refine_scope 'shared' chooses one page set from the mass of all {total} KV heads, but with "
                f"tensor parallelism each rank holds {count} of them: set luka_refine_scope per_kv_head "
                f"(--luka-refine-scope per_kv_head) or tp_size 1")

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

    def stats(self, shard: KVShard, context_tokens: int) -> dict:
        """How much of the context this rank held compressed when the last token was produced (after decoding).

        ``paged_fraction`` (clustered layers): the context tokens held as page summaries, as a fraction of
        ``context_tokens`` (the whole context), averaged over the clustered layers; ``paged_generated_tokens``:
        the query's and generated tokens held in pages (the query rank's Phase-2 store), averaged likewise;
        ``unattended_fraction`` (lined layers): the fraction of the context the last step did not attend
        (neither a heavy hitter nor recent), averaged over the lined layers; ``compressed_fraction``: the
        clustered layers' paged and the lined layers' unattended fractions averaged over all LuKA layers.
        A key is there when a layer of its kind is. Every value is this rank's part of a whole-context figure,
        so the ranks' values add up (a rank that attended nothing gives 0).
        """
        ps, whole = self.cfg.luka_page_size, max(1, context_tokens)
        paged, gen_paged, unattended = [], [], []
        for i in range(shard.num_layers):
            kv = shard.whole(i)  # the store Phase 2 handed the policy (a fork's segments joined on this view)
            st = self.layer_state(kv)
            if st is None:  # no LuKA here: a sliding-window layer, or this rank holds nothing
                continue
            if self.kind(i) == "clustered":
                paged.append(st.pages * ps / whole)
                gen_paged.append(float(st.gen_pages * ps))
            else:
                unattended.append((len(kv) - st.attended) / whole)
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        out = dict(paged_fraction=mean(paged), paged_generated_tokens=mean(gen_paged),
                   unattended_fraction=mean(unattended), compressed_fraction=mean(paged + unattended))
        return {k: out[k] for k in self.stats_keys}

    @property
    def stats_keys(self) -> tuple[str, ...]:
        """The keys of :meth:`stats`: the clustered layers' when there are some, the lined layers' likewise, and
        ``compressed_fraction`` (fixed by the config, so the same on every rank)."""
        kinds = {self.kind(i) for i in range(self.num_layers)}
        return ((("paged_fraction", "paged_generated_tokens") if "clustered" in kinds else ())
                + (("unattended_fraction",) if "lined" in kinds else ()) + ("compressed_fraction",))

    # -- attention --------------------------------------------------------------------------------------
    def attend_context(self, layer: int, b: int, q: torch.Tensor, kv: LayerKV, q_pos: torch.Tensor, scale: float,
                       context_tokens: int, *, backend: str = "auto", valid: Optional[int] = None,
                       gen: Optional[LayerKV] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out (1, Hq, S, D), lse (1, Hq, S))`` of request ``b``'s queries ``q`` at positions ``q_pos (S,)`` over
        its context shard ``kv`` and, on the query rank, its Phase-2 store ``gen`` (this forward's real tokens
        already appended; attended causally by position): clustered layers page it like the context, lined
        layers attend it whole."""
        _, Hq, S, D = q.shape
        H, N = kv.k.shape[1], kv.k.shape[2]
        G = Hq // H
        rows = S if valid is None else valid
        st = self._state(kv, int(q_pos.min()))
        clustered = self.kind(layer) == "clustered"
        if gen is not None and clustered:
            self._track(st, gen)
        qg = q[0].reshape(H, G, S, D)
        recent_from = int(q_pos.min()) - self.cfg.luka_recent  # entries at or after this position stay raw
        pend = _Pending(rows)
        gen_from = 0  # the Phase-2 store's entries from here on are attended raw
        if self._exact(st):  # a forward the regime reads exactly: the whole shard, as dense decoding does
            with self.timer("attention"):
                out, lse = attention_with_lse(q, kv.k, kv.v, q_pos=q_pos, k_pos=kv.pos, scale=scale, backend=backend)
            pend.dense.append((st.mass, q, kv.k, None, None, scale))
            st.attended = N
        elif not clustered:
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
            pend.parts.append((st.mass, alpha, idx[:, None].expand(H, S, idx.shape[1]), lse))
            st.attended = idx.shape[1]
            out, lse = out.to(q.dtype).reshape(1, Hq, S, D), lse.reshape(1, Hq, S)
        else:
            with self.timer("compress"):
                self._maybe_compress(st, kv, gen, recent_from, G)
            out, lse = self._cover(st, qg, kv, gen, scale, pend, rows)
            gen_from = st.gen_pages * self.cfg.luka_page_size
        if gen is not None:  # its raw tail, causally by position (lined layers keep all of it: H2O's budget is a
            # share of the context); clustered layers record its mass, for the summaries of its pages
            k, v, k_pos = gen.k[:, :, gen_from:], gen.v[:, :, gen_from:], gen.pos[gen_from:]
            o, l = attention_with_lse(q, k, v, q_pos=q_pos, k_pos=k_pos, scale=scale, backend=backend)
            if clustered:
                pend.dense.append((st.gen_mass[:, gen_from:], q, k, q_pos, k_pos, scale))
            out, lse = merge_states([out, o], [lse, l])
        self._stash(layer, b, pend)
        if st.steps == 0:
            st.query = rows
        st.steps += rows
        return out, lse

    def after_merge(self, layer: int, lse: torch.Tensor) -> None:
        """Add the mass of this layer's attended entries, normalised by the merged ``lse (B, Hq, S)``."""
        with self.timer("mass"):
            for b, p in self.pending.pop(layer, {}).items():
                merged = lse[b].float()  # (Hq, S)
                for mass, alpha, idx, local in p.parts:
                    H, G, S, _ = alpha.shape
                    c = torch.exp(local - merged.reshape(H, G, S))[..., None]  # local -> global normalisation
                    w = (alpha * c)[:, :, : p.valid].sum(1)  # (H, S', n)
                    mass.scatter_add_(1, idx[:, : p.valid].reshape(H, -1), w.reshape(H, -1))
                for mass, q, k, q_pos, k_pos, scale in p.dense:
                    mass += column_mass(q[:, :, : p.valid], k, merged[None, :, : p.valid], scale=scale,
                                        q_pos=None if q_pos is None else q_pos[: p.valid], k_pos=k_pos)

    def _exact(self, st: LukaLayerState) -> bool:
        """Does the regime read this forward exactly? (``st``: before the forward.)"""
        regime = self.cfg.luka_regime
        if regime == "before_query":
            return False
        if st.steps == 0:  # the query
            return True
        # after_generation: the forward reading generated token j is exact for j < luka_compress_every
        return regime == "after_generation" and st.steps - st.query < self.cfg.luka_compress_every - 1

    def _cover(self, st: LukaLayerState, qg: torch.Tensor, kv: LayerKV, gen: Optional[LayerKV], scale: float,
               pend: _Pending, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Algorithm 1 over [the summaries of the shard's and the Phase-2 store's pages ‖ the shard's raw tail];
        ``rows``: the forward's real query positions (the shared refinement ranks pages over them only). After
        the query's forward, a forward of several tokens stands for as many decode steps (teacher-forced scoring
        in chunks): each token then chooses its own pages (``per_token``), as its own decode step would."""
        H, G, S, D = qg.shape
        N, ps = kv.k.shape[2], self.cfg.luka_page_size
        cut = st.pages * ps
        kp = kv.k[0, :, :cut].reshape(H, st.pages, ps, D)  # views, no copy
        vp = kv.v[0, :, :cut].reshape(H, st.pages, ps, D)
        if st.gen_pages:
            gcut = st.gen_pages * ps
            kp = _Pages(kp, gen.k[0, :, :gcut].reshape(H, st.gen_pages, ps, D))
            vp = _Pages(vp, gen.v[0, :, :gcut].reshape(H, st.gen_pages, ps, D))
        res = clustered_attention(qg, st.ks, st.vs, kp, vp, kv.k[0, :, cut:], kv.v[0, :, cut:], scale=scale,
                                  rule=self.cfg.luka_refine, k=self.cfg.luka_refine_k,
                                  fraction=self.cfg.luka_refine_fraction, eps=self.cfg.luka_refine_eps,
                                  mass=self.cfg.luka_refine_mass, scope=self.cfg.luka_refine_scope, rows=rows,
                                  per_token=st.steps > 0, timer=self.timer,
                                  summary_bias=math.log(ps) if self.cfg.luka_size_bias else 0.0)
        n, R = res.child_idx.shape[-1], N - cut
        # the refined pages' tokens: entry t of the shard for t < cut, else entry t - cut of the Phase-2 store
        child_tok = (res.child_idx[..., None] * ps + torch.arange(ps, device=qg.device)).reshape(H, S, n * ps)
        child_alpha = res.child_alpha.reshape(H, G, S, n * ps)
        if st.gen_pages:
            in_gen = child_tok >= cut
            pend.parts.append((st.gen_mass, child_alpha.masked_fill(~in_gen[:, None], 0.0),
                               (child_tok - cut).clamp(min=0), res.lse))
            child_alpha, child_tok = child_alpha.masked_fill(in_gen[:, None], 0.0), child_tok.masked_fill(in_gen, 0)
        raw_tok = torch.arange(cut, N, device=qg.device).view(1, 1, R).expand(H, S, R)
        pend.parts.append((st.mass, torch.cat((child_alpha, res.raw_alpha), -1), torch.cat((child_tok, raw_tok), -1),
                           res.lse))
        return res.out.to(qg.dtype).reshape(1, H * G, S, D), res.lse.reshape(1, H * G, S)

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

    @staticmethod
    def _track(st: LukaLayerState, gen: LayerKV) -> None:
        """Give the Phase-2 store's new entries a mass (0 until attended)."""
        H, M = gen.k.shape[1], gen.k.shape[2]
        if st.gen_mass is None:
            st.gen_mass = torch.zeros(H, 0, dtype=torch.float32, device=gen.k.device)
        if st.gen_mass.shape[1] < M:
            st.gen_mass = torch.cat((st.gen_mass, st.gen_mass.new_zeros(H, M - st.gen_mass.shape[1])), 1)

    def _maybe_compress(self, st: LukaLayerState, kv, gen: Optional[LayerKV], recent_from: int, group: int) -> None:
        """Cut the pages that became eligible (every ``luka_compress_every`` steps) in the shard, then in the
        Phase-2 store; ``group``: query heads per KV head (the attention_weighted compressor averages over them)."""
        if st.last_compress >= 0 and st.steps - st.last_compress < self.cfg.luka_compress_every:
            return
        st.last_compress = st.steps
        ps = self.cfg.luka_page_size
        H, N, D = kv.k.shape[1], kv.k.shape[2], kv.k.shape[3]
        if st.ks is None:
            st.ks = kv.k.new_zeros(H, 0, D)
            st.vs = kv.v.new_zeros(H, 0, D)
        eligible = int(torch.searchsorted(kv.pos, torch.tensor(recent_from, device=kv.pos.device)))
        pages = eligible // ps
        if pages > st.pages:  # never after the store's first page: that needs the whole shard eligible
            a, z = st.pages * ps, pages * ps
            self._summarize(st, kv.k[0, :, a:z], kv.v[0, :, a:z], st.mass[:, a:z], group)
            st.pages = pages
        if gen is None or eligible < N:
            return
        gen_pages = int(torch.searchsorted(gen.pos, torch.tensor(recent_from, device=gen.pos.device))) // ps
        if gen_pages > st.gen_pages:
            a, z = st.gen_pages * ps, gen_pages * ps
            self._summarize(st, gen.k[0, :, a:z], gen.v[0, :, a:z], st.gen_mass[:, a:z], group)
            st.gen_pages = gen_pages

    def _summarize(self, st: LukaLayerState, k: torch.Tensor, v: torch.Tensor, mass: torch.Tensor, group: int) -> None:
        """Append the summaries of the pages of ``k, v (H, n, D)`` (n a multiple of the page size) to ``st``."""
        H, n, D = k.shape
        ps = self.cfg.luka_page_size
        ks, vs = compress_pages(k.reshape(H, n // ps, ps, D), v.reshape(H, n // ps, ps, D), self.cfg.luka_compressor,
                                mass=mass.reshape(H, -1, ps), tau=self.cfg.luka_tau, group=group,
                                generator=st.generator)
        if self.cfg.luka_zero_values:
            vs = torch.zeros_like(vs)
        st.ks, st.vs = torch.cat((st.ks, ks), 1), torch.cat((st.vs, vs), 1)

    def _stash(self, layer: int, b: int, p: _Pending) -> None:
        self.pending.setdefault(layer, {})[b] = p
