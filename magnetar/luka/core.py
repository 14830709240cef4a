"""LuKA's tensor algorithms, independent of the engine: attention mass, page compressors, the cover with
refinement (Algorithm 1, Eq. 1-4, with the authors' exact normaliser or the paper's mass-preserving Eq. 3), and
H2O's heavy-hitter choice.

Layouts (one request, one layer, GQA grouped by KV head):
    q        (H, G, S, D)   the S query tokens of the G query heads reading KV head h
    keys     (H, N, D)      one KV head's keys / values per row
    mass     (H, N)         attention mass a KV entry has received, summed over its group's query heads
    out      (H, G, S, D),  lse (H, G, S)

Which choice comes from where: Eq. 1-4 and the compressors are the paper's; the defaults of
:func:`clustered_attention` (``mass="exact"``, ``scope="shared"``) and the group-averaged weights of the
attention_weighted compressor are the authors' public code (github.com/ayf7/LuKA, ``modeling/kv_cache.py``
``top_down_attention``, ``modeling/refinement.py``; ``exact`` since their commit 5d12276); ``preserve`` is the
paper's Eq. 3 and ``per_kv_head`` Magnetar's earlier rule, both kept as options.

Every function is plain batched torch (gathers, einsums, softmax), no Python loop over pages or tokens:
the refined pages' children are gathered per step and nothing else is re-created.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from magnetar.config import LUKA_REFINE_SCOPE
from magnetar.utils.timing import no_timer


def column_mass(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, *, scale: float,
                q_pos: Optional[torch.Tensor] = None, k_pos: Optional[torch.Tensor] = None,
                window: Optional[int] = None, tile: int = 512) -> torch.Tensor:
    """Attention mass each key receives: ``sum_{g, i} exp(q_gi . k_j * scale - lse_gi)`` over visible pairs.

    ``q (1, Hq, S, D)``, ``k (1, Hkv, N, D)``, ``lse (1, Hq, S)`` -- the log-sum-exp the attention returned
    (so the mass is that attention's, whatever other keys it saw). Causality by positions (``k_pos <= q_pos``,
    and ``k_pos > q_pos - window`` with a sliding window) when both are given. Computed ``tile`` queries at a
    time, never the whole S x N matrix. Returns ``(Hkv, N)`` float32.
    """
    _, Hq, S, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    kf = k[0].float()
    out = torch.zeros(Hkv, N, dtype=torch.float32, device=q.device)
    masked = q_pos is not None and k_pos is not None
    if masked and window is None and (N == 0 or bool(k_pos.max() <= q_pos.min())):
        masked = False  # every key precedes every query (a decode step over its store): no mask to build
    # keys in position order (a prefill's): a query tile only reads the keys it can see, a contiguous range
    ordered = masked and (N < 2 or bool((k_pos[1:] >= k_pos[:-1]).all()))
    for s0 in range(0, S, tile):
        s1 = min(S, s0 + tile)
        a, z = 0, N
        if ordered:
            hi, lo = q_pos[s0:s1].max(), q_pos[s0:s1].min()
            z = int(torch.searchsorted(k_pos, hi, right=True))
            if window is not None:
                a = int(torch.searchsorted(k_pos, lo - window, right=True))
            if z <= a:
                continue
        qt = q[0, :, s0:s1].float().reshape(Hkv, G, s1 - s0, D)
        logits = torch.einsum("hgsd,hnd->hgsn", qt, kf[:, a:z]) * scale
        p = torch.exp(logits - lse[0, :, s0:s1].float().reshape(Hkv, G, s1 - s0, 1))
        if masked:
            qp, kp = q_pos[s0:s1].reshape(-1, 1), k_pos[a:z].reshape(1, -1)
            vis = kp <= qp
            if window is not None:
                vis = vis & (kp > qp - window)
            p = p.masked_fill(~vis, 0.0)
        p = torch.nan_to_num(p, nan=0.0)  # rows with lse = -inf saw nothing
        out[:, a:z] += p.sum(dim=(1, 2))
    return out


# -- compressors -----------------------------------------------------------------------------------------

def compress_pages(kp: torch.Tensor, vp: torch.Tensor, kind: str, *, mass: Optional[torch.Tensor] = None,
                   tau: float = 1.0, group: int = 1, generator: Optional[torch.Generator] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One summary key/value per page. ``kp, vp (H, P, L, D)``; ``mass (H, P, L)`` for ``attention_weighted``:
    the tokens' accumulated attention mass summed over the ``group`` query heads of each KV head.

    * ``mean``: ``k = mean_i k_i``, ``v = mean_i v_i``;
    * ``attention_weighted``: ``pi = softmax(w / tau)`` over the page's tokens with ``w = mass / group``, the
      mass averaged over the group's query heads as the authors' code weighs it (so ``tau`` has their meaning;
      on the summed mass ``tau = 1`` would be ``group`` times sharper), ``k = sum_i pi_i k_i`` (same for v);
    * ``random``: one token of the page drawn uniformly (the same for every head), its key and value.
    Returns ``(H, P, D)`` twice, in kp's dtype.
    """
    if kind == "mean":
        return kp.float().mean(2).to(kp.dtype), vp.float().mean(2).to(vp.dtype)
    if kind == "attention_weighted":
        if mass is None:
            raise ValueError("the attention_weighted compressor needs the tokens' accumulated attention mass")
        if isinstance(group, bool) or not isinstance(group, int) or group < 1:
            raise ValueError(f"group must be an int >= 1 (query heads per KV head), got {group!r}")
        pi = torch.softmax(mass.float() / group / tau, dim=-1)  # (H, P, L)
        return (torch.einsum("hpl,hpld->hpd", pi, kp.float()).to(kp.dtype),
                torch.einsum("hpl,hpld->hpd", pi, vp.float()).to(vp.dtype))
    if kind == "random":
        H, P, L, D = kp.shape
        pick = torch.randint(0, L, (P,), generator=generator).to(kp.device)
        idx = pick.view(1, P, 1, 1).expand(H, P, 1, D)
        return kp.gather(2, idx).squeeze(2), vp.gather(2, idx).squeeze(2)
    raise ValueError(f"unknown compressor {kind!r}; choose one of attention_weighted, mean, random")


# -- refinement rules ------------------------------------------------------------------------------------

def choose_pages(alpha: torch.Tensor, rule: str, *, k: int = 3, fraction: float = 0.1, eps: float = 0.01,
                 scope: str = "shared", rows: Optional[int] = None, per_token: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages to refine from the summaries' masses ``alpha (H, G, S, P)`` (Eq. 1 per query head and token).

    ``scope="shared"`` (the authors' code, ``modeling/refinement.py``): one set of pages per call -- a forward of
    one layer -- for every head and query token, chosen over the first ``rows`` query tokens (the real ones; the
    rest is padding and chooses nothing): ``top_k`` the k pages with the largest mass for any query head and
    token (the max over both), ``top_fraction`` the ceil(fraction * P) pages with the largest mass summed over
    all query heads and tokens, ``threshold`` every page whose mass exceeds ``eps`` for some (query head,
    token), refined exactly for the (query head, token) pairs where it does.
    ``scope="per_kv_head"`` (Magnetar's earlier rule): pages per (KV head, query token), ranked by the mass summed
    over the group; ``top_k`` the k best, ``top_fraction`` the ceil(fraction * P) best, ``threshold`` every page
    whose mass exceeds ``eps`` for some query head of the group, refined for the whole group.
    ``none`` refines nothing. The scopes agree for one query head and one query token (and ``top_fraction``
    for one KV head and one query token).
    ``per_token`` (``shared`` only): each query token chooses its own set, shared by all heads -- what S forwards
    of one token each would choose. The decoder asks for it when a forward of S tokens stands for S decode
    steps (teacher-forced scoring in chunks); ``threshold`` is per token either way.

    Returns ``idx (H, S, n)`` and ``valid (H, G, S, n)``: page ``idx[h, s, j]`` is refined for query head
    ``(h, g)`` at token ``s`` iff ``valid[h, g, s, j]`` (threshold: a row may refine fewer than n pages).
    """
    H, G, S, P = alpha.shape
    if scope not in LUKA_REFINE_SCOPE:
        raise ValueError(f"unknown refinement scope {scope!r}; choose one of {', '.join(LUKA_REFINE_SCOPE)}")
    if rule not in ("top_k", "top_fraction", "threshold", "none"):
        raise ValueError(f"unknown refinement rule {rule!r}; choose one of top_k, top_fraction, threshold, none")
    rows = S if rows is None else rows
    if rule == "none" or P == 0 or rows == 0 or (rule == "top_k" and k == 0):
        empty = torch.zeros(H, S, 0, dtype=torch.long, device=alpha.device)
        return empty, torch.zeros(H, G, S, 0, dtype=torch.bool, device=alpha.device)
    if scope == "shared":
        real = alpha[:, :, :rows]
        if rule == "threshold":
            hot = alpha > eps  # (H, G, S, P)
            pages = hot[:, :, :rows].flatten(0, 2).any(0).nonzero().flatten()  # (n,)
            idx = pages.view(1, 1, -1).expand(H, S, pages.numel())
            return idx, hot[..., pages]
        n = min(k, P) if rule == "top_k" else min(P, math.ceil(fraction * P))
        if per_token:  # (S, P): each token ranks the pages over all heads
            score = alpha.flatten(0, 1).amax(0) if rule == "top_k" else alpha.flatten(0, 1).sum(0)
            pages = score.topk(n, dim=-1).indices  # (S, n)
            return pages[None].expand(H, S, n), torch.ones(H, G, S, n, dtype=torch.bool, device=alpha.device)
        score = real.flatten(0, 2).amax(0) if rule == "top_k" else real.flatten(0, 2).sum(0)
        pages = score.topk(n).indices
        return pages.view(1, 1, n).expand(H, S, n), torch.ones(H, G, S, n, dtype=torch.bool, device=alpha.device)
    rank = alpha.sum(1)  # (H, S, P)
    if rule == "threshold":
        hot = alpha.amax(1) > eps  # (H, S, P)
        n = int(hot.sum(-1).max())
        if n == 0:
            empty = torch.zeros(H, S, 0, dtype=torch.long, device=alpha.device)
            return empty, torch.zeros(H, G, S, 0, dtype=torch.bool, device=alpha.device)
        idx = rank.masked_fill(~hot, -1.0).topk(n, dim=-1).indices
        return idx, hot.gather(-1, idx)[:, None].expand(H, G, S, n)
    n = min(k, P) if rule == "top_k" else min(P, math.ceil(fraction * P))
    idx = rank.topk(n, dim=-1).indices
    return idx, torch.ones(H, G, S, n, dtype=torch.bool, device=alpha.device)


@dataclass
class CoverResult:
    out: torch.Tensor  # (H, G, S, D)
    lse: torch.Tensor  # (H, G, S): log of the cover's normaliser (the state merges with other KV by it)
    summary_alpha: torch.Tensor  # (H, G, S, P): mass of the summaries used as they are (0 where refined)
    raw_alpha: torch.Tensor  # (H, G, S, R): mass of the raw tokens
    child_idx: torch.Tensor  # (H, S, n): refined pages (choose_pages)
    child_alpha: torch.Tensor  # (H, G, S, n, L): mass of their tokens (0 where a page was not refined for a head)


def clustered_attention(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor,
                        kr: torch.Tensor, vr: torch.Tensor, *, scale: float, rule: str = "top_k", k: int = 3,
                        fraction: float = 0.1, eps: float = 0.01, mass: str = "exact", scope: str = "shared",
                        rows: Optional[int] = None, per_token: bool = False, summary_bias: float = 0.0,
                        timer: Optional[Callable] = None) -> CoverResult:
    """Algorithm 1 for queries ``q (H, G, S, D)`` over the cover ``[summaries ks/vs (H, P, D) ‖ raw kr/vr (H, R, D)]``,
    refining pages whose tokens are ``kp/vp (H, P, L, D)``. Every key precedes every query (no mask).

    Eq. 1: ``alpha_c = softmax_c(q . k_c)`` over the cover. The pages refined: :func:`choose_pages` with
    ``rule``, ``scope``, ``rows`` (the real query tokens; the rest is padding) and ``per_token``. A refined
    page's children
    get, with ``mass="exact"`` (the authors' code), their own mass: the page's logit is replaced by the
    log-sum-exp of its children, i.e. the cover is expanded there and renormalised (refining every page is then
    dense attention exactly); with ``mass="preserve"`` (the paper's Eq. 2-3) ``alpha_page * softmax_i(q . k_i)``
    -- the page's mass redistributed. Eq. 4: ``o = sum alpha_n v_n``.
    ``summary_bias`` is added to every summary logit (``log L`` lets a page of L tokens weigh as L tokens).
    ``timer``: a :class:`magnetar.utils.timing.SectionTimer` charging the cover attention to ``attention`` and
    the rest to ``refine``.
    """
    timer = timer or no_timer
    H, G, S, D = q.shape
    P = kp.shape[1]
    qf = q.float()
    with timer("attention"):
        ls = torch.einsum("hgsd,hpd->hgsp", qf, ks.float()) * scale + summary_bias  # (H, G, S, P)
        lr = torch.einsum("hgsd,hrd->hgsr", qf, kr.float()) * scale  # (H, G, S, R)
        lse = torch.logsumexp(torch.cat((ls, lr), -1), -1)  # (H, G, S)
        a_s = torch.exp(ls - lse[..., None])
    with timer("refine"):
        idx, valid = choose_pages(a_s, rule, k=k, fraction=fraction, eps=eps, scope=scope, rows=rows,
                                  per_token=per_token)
        n = idx.shape[-1]
        heads = torch.arange(H, device=q.device)[:, None, None]
        kc = kp[heads, idx].float()  # (H, S, n, L, D): the refined pages' tokens, gathered (never a mask)
        vc = vp[heads, idx].float()
        lc = torch.einsum("hgsd,hsnld->hgsnl", qf, kc) * scale  # (H, G, S, n, L)
        vmask = valid[..., None]  # (H, G, S, n, 1)
        sel = torch.zeros(H, G, S, P, dtype=torch.bool, device=q.device)  # summaries replaced by their children
        if n:
            sel.scatter_(-1, idx[:, None].expand(H, G, S, n), valid)
        a_s, a_r, a_c, lse = _redistribute(mass, ls, lr, lc, lse, a_s, idx, vmask, sel)
    with timer("attention"):
        out = (torch.einsum("hgsp,hpd->hgsd", a_s, vs.float()) + torch.einsum("hgsr,hrd->hgsd", a_r, vr.float()))
    with timer("refine"):
        out = out + torch.einsum("hgsnl,hsnld->hgsd", a_c, vc)
    return CoverResult(out.to(q.dtype), lse, a_s, a_r, idx, a_c)


def _redistribute(mass, ls, lr, lc, lse, a_s, idx, vmask, sel):
    """The expanded cover (``exact``) or Eq. 2-3 (``preserve``): masses of summaries, raw tokens and children."""
    H, G, S, n = lc.shape[:4]
    if mass == "preserve":
        a_page = a_s.gather(-1, idx[:, None].expand(H, G, S, n))  # (H, G, S, n)
        a_c = a_page[..., None] * torch.softmax(lc, dim=-1)
        a_c = a_c.masked_fill(~vmask, 0.0)
        a_s = a_s.masked_fill(sel, 0.0)
        a_r = torch.exp(lr - lse[..., None])
    elif mass == "exact":
        lc = lc.masked_fill(~vmask, float("-inf"))
        ls = ls.masked_fill(sel, float("-inf"))
        lse = torch.logsumexp(torch.cat((ls, lr, lc.flatten(-2)), -1), -1)
        a_s = torch.exp(ls - lse[..., None])
        a_r = torch.exp(lr - lse[..., None])
        a_c = torch.exp(lc - lse[..., None, None])
    else:
        raise ValueError(f"unknown refinement mass {mass!r}; choose exact or preserve")
    return a_s, a_r, a_c, lse


def heavy_hitters(mass: torch.Tensor, budget: int, forced: Optional[torch.Tensor] = None) -> torch.Tensor:
    """H2O's choice: indices ``(H, n)`` of the ``budget`` entries with the most accumulated ``mass (H, N)``
    plus every ``forced (N,)`` entry (the recent window), each once."""
    H, N = mass.shape
    scores = mass.float()
    n_forced = 0
    if forced is not None:
        scores = scores.masked_fill(forced, float("inf"))
        n_forced = int(forced.sum())
    take = min(N, budget + n_forced)
    return scores.topk(take, dim=-1).indices.sort(dim=-1).values
