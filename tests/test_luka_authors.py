"""LuKA's defaults against the authors' public code (github.com/ayf7/LuKA at e8b277c), written out here.

Their clustered attention (``modeling/kv_cache.py`` ``top_down_attention``): attention over the cover (page
summaries + raw tail) gives each page a probability per query head and query position; ``TopKRule``
(``modeling/refinement.py``) refines the k pages with the largest probability over *all* heads and positions
of the forward, for every head; a refined page gets its own normaliser (since their commit 5d12276):
``Z = Z_cover - exp(l_page) + Z_page``, written in their code as ``out = (cover_out - sum a_s v_s + sum
ratio_page page_out) / (1 - sum a_s + sum ratio_page)`` with ``ratio_page = Z_page / Z_cover``. Their
attention_weighted compressor weighs a page's tokens by ``softmax(w / tau)`` of the attention each token
received summed over query positions and *averaged* over the KV head's query heads. The reference below is
that, in float64 with Python loops over pages, independent of magnetar.luka.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

import magnetar
from magnetar.config import LukaConfig
from magnetar.luka.core import choose_pages, clustered_attention, compress_pages
from magnetar.luka.decoder import LukaDecoder
from tests.conftest import assert_close, assert_differs
from tests.tiny_models import tiny_model

N, PAGE, RECENT, TOP_K = 44, 4, 8, 3  # pages cut at the first step: (44 - 8) // 4 = 9 pages, a raw tail of 8


def _authors_clustered(q, k, v, w, *, page: int, pages: int, top_k: int, scale: float, tau: float = 1.0):
    """The authors' clustered attention of one forward, float64.

    ``q (Hq, S, D)`` the forward's queries; ``k, v (Hkv, N, D)`` the context KV; ``w (Hkv, N)`` each context token's
    attention mass, summed over queries and averaged over the KV head's query heads. Pages are the first
    ``pages * page`` tokens, the rest is the raw tail. Returns ``(out (Hq, S, D), lse (Hq, S), refined pages,
    the sorted page scores)``.
    """
    q, k, v, w = q.double(), k.double(), v.double(), w.double()
    Hq, S, D = q.shape
    Hkv = k.shape[0]
    G = Hq // Hkv
    cut = pages * page
    ks = torch.zeros(Hkv, pages, D, dtype=torch.float64)
    vs = torch.zeros(Hkv, pages, D, dtype=torch.float64)
    for h in range(Hkv):  # AttentionWeightedCompressor: softmax(importance / tau) over the page's tokens
        for p in range(pages):
            sl = slice(p * page, (p + 1) * page)
            pi = torch.softmax(w[h, sl] / tau, dim=0)
            ks[h, p], vs[h, p] = pi @ k[h, sl], pi @ v[h, sl]
    kv_of = [hq // G for hq in range(Hq)]  # repeat_kv: query head hq reads KV head hq // G
    cover_k = [torch.cat((ks[h], k[h, cut:])) for h in kv_of]
    cover_v = [torch.cat((vs[h], v[h, cut:])) for h in kv_of]
    logits = torch.stack([q[hq] @ cover_k[hq].T * scale for hq in range(Hq)])  # (Hq, S, pages + R)
    lse_cover = torch.logsumexp(logits, -1)
    probs = torch.softmax(logits, -1)
    cover_out = torch.stack([probs[hq] @ cover_v[hq] for hq in range(Hq)])  # (Hq, S, D)
    # TopKRule: max over heads and query positions per summary, k best, refined for every head and position
    score = probs[:, :, :pages].amax(dim=(0, 1))
    refined = score.topk(top_k).indices.tolist()
    num = cover_out.clone()
    den = torch.ones(Hq, S, dtype=torch.float64)
    for p in refined:
        for hq in range(Hq):
            h = kv_of[hq]
            sl = slice(p * page, (p + 1) * page)
            raw = q[hq] @ k[h, sl].T * scale  # (S, page)
            lse_page = torch.logsumexp(raw, -1)
            page_out = torch.softmax(raw, -1) @ v[h, sl]
            ratio = torch.exp(lse_page - lse_cover[hq])
            a_s = probs[hq, :, p]
            num[hq] += ratio[:, None] * page_out - a_s[:, None] * vs[h, p]
            den[hq] += ratio - a_s
    return num / den[..., None], lse_cover + torch.log(den), sorted(refined), score.sort(descending=True).values


@pytest.fixture(scope="module")
def context():
    """A tiny Qwen3 (4 query heads, 2 KV heads), its context KV from Magnetar's Phase 1 and, from Hugging Face's
    own eager forward, the same KV and the attention mass per token averaged over each KV head's query heads."""
    model = tiny_model("qwen3", seed=21, num_hidden_layers=2)
    ctx = torch.randint(0, 256, (N,), generator=torch.Generator().manual_seed(21))
    eng = magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, luka_mode="clustered")
    shard = eng.encoder.phase1(ctx).shard
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        hf = eager(ctx[None], output_attentions=True, use_cache=True)
    cfg = model.config
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    ref = []
    for layer, att in enumerate(hf.attentions):
        w = att[0].double().sum(1).reshape(Hkv, Hq // Hkv, N).mean(1)  # (Hkv, N)
        cache = hf.past_key_values.layers[layer]
        ref.append((cache.keys[0], cache.values[0], w))
    return model, shard, ref


def _queries(S, seed, Hq=4, D=16):
    return 2.0 * torch.randn(1, Hq, S, D, generator=torch.Generator().manual_seed(seed))


def _attend(dec, layer, kv, q, first, valid=None):
    S = q.shape[2]
    out, lse = dec.attend_context(layer, 0, q, kv, torch.arange(first, first + S), 0.25, N, valid=valid)
    dec.after_merge(layer, lse)  # this shard is all the KV the query reads here: its lse is the merged one
    return out[0], lse[0]


def test_decoder_equals_the_authors_formula_on_a_tiny_gqa_model(context):
    """Default config = the authors' rules: shared top-k by the max over heads and positions, exact normaliser,
    attention_weighted summaries over the group-averaged mass (tau 1); pages cut at the first step
    (before_query: the formula is checked on the forward that reads pages, not on an exact one)."""
    model, shard, ref = context
    cfg = LukaConfig(luka_mode="clustered", luka_regime="before_query", luka_page_size=PAGE, luka_recent=RECENT,
                     luka_refine_k=TOP_K)
    dec = LukaDecoder(cfg, model.config)
    others = {name: LukaDecoder(LukaConfig(**dict(vars(cfg), **kw)), model.config)
              for name, kw in (("per_kv_head", dict(luka_refine_scope="per_kv_head")),
                               ("preserve", dict(luka_refine_mass="preserve")))}
    pages = (N - RECENT) // PAGE
    for layer, (k, v, w) in enumerate(ref):
        kv = shard.layers[layer]
        # the forward reading 3 query positions, then a decode step (same pages: the next cut is 16 steps away)
        for first, S, seed in ((N, 3, layer), (N + 3, 1, 10 + layer)):
            q = _queries(S, seed)
            out, lse = _attend(dec, layer, kv, q, first)
            want_out, want_lse, refined, score = _authors_clustered(q[0], k, v, w, page=PAGE, pages=pages,
                                                                   top_k=TOP_K, scale=0.25)
            # a clear gap after the k-th page: float32 vs float64 cannot change the choice
            assert float(score[TOP_K - 1] - score[TOP_K]) > 1e-4, f"layer {layer}: near tie {score.tolist()}"
            assert dec.layer_state(kv).pages == pages
            label = f"layer {layer}, positions {first}..{first + S - 1}, pages {refined}"
            assert_close(out, want_out, what="fp32", msg=label + " out")
            assert_close(lse, want_lse, what="fp32", msg=label + " lse")
            if S > 1:  # the other rules give other outputs here, so this comparison can fail
                for name, other in others.items():
                    o, _ = _attend(other, layer, kv, q, first)
                    assert_differs(o, want_out, msg=f"{label}: {name}")


def test_padding_rows_choose_no_pages(context):
    """Padded query rows (a batch of requests of different lengths) take no part in the shared choice."""
    model, shard, ref = context
    cfg = LukaConfig(luka_mode="clustered", luka_regime="before_query", luka_page_size=PAGE, luka_recent=RECENT,
                     luka_refine_k=TOP_K)
    k, v, w = ref[0]
    q = _queries(3, 0)
    loud = torch.cat((q, 40.0 * _queries(1, 99)), dim=2)  # a 4th, padded row with very peaked attention
    out, lse = _attend(LukaDecoder(cfg, model.config), 0, shard.layers[0], loud, N, valid=3)
    want_out, want_lse, _, _ = _authors_clustered(q[0], k, v, w, page=PAGE, pages=(N - RECENT) // PAGE, top_k=TOP_K,
                                                  scale=0.25)
    assert_close(out[:, :3], want_out, what="fp32", msg="real rows out")
    assert_close(lse[:, :3], want_lse, what="fp32", msg="real rows lse")
    # the padded row alone would choose other pages: the rows argument matters
    _, _, chosen_by_pad, _ = _authors_clustered(loud[0, :, 3:], k, v, w, page=PAGE, pages=(N - RECENT) // PAGE,
                                                top_k=TOP_K, scale=0.25)
    _, _, chosen, _ = _authors_clustered(q[0], k, v, w, page=PAGE, pages=(N - RECENT) // PAGE, top_k=TOP_K,
                                         scale=0.25)
    assert chosen_by_pad != chosen


def test_tau_is_the_authors_old_tau_over_group(context):
    """The compressor averages the mass over the group: new tau = 1 is the old (summed-mass) tau = G."""
    model, shard, _ = context
    kv = shard.layers[1]
    G = model.config.num_attention_heads // model.config.num_key_value_heads
    dec = LukaDecoder(LukaConfig(luka_mode="clustered", luka_regime="before_query", luka_page_size=PAGE,
                                 luka_recent=RECENT), model.config)
    _attend(dec, 1, kv, _queries(1, 5), N)
    st = dec.layer_state(kv)
    H, D = kv.k.shape[1], kv.k.shape[3]
    kp = kv.k[0, :, : st.pages * PAGE].reshape(H, st.pages, PAGE, D)
    vp = kv.v[0, :, : st.pages * PAGE].reshape(H, st.pages, PAGE, D)
    summed = kv.mass[0, :, : st.pages * PAGE].reshape(H, st.pages, PAGE)  # Phase 1's mass, summed over the group
    old_ks, old_vs = compress_pages(kp, vp, "attention_weighted", mass=summed, tau=float(G))
    assert_close(st.ks, old_ks, what="same_computation", msg="summary keys")
    assert_close(st.vs, old_vs, what="same_computation", msg="summary values")
    sharp_ks, _ = compress_pages(kp, vp, "attention_weighted", mass=summed, tau=1.0)
    assert_differs(st.ks, sharp_ks, msg="the summed mass at tau 1")
    with pytest.raises(ValueError, match="group must be an int >= 1"):
        compress_pages(kp, vp, "attention_weighted", mass=summed, group=0)


def _pages(H, G, S, P=6, L=4, R=5, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = 2.0 * torch.randn(H, G, S, D, generator=g)
    kp, vp = torch.randn(H, P, L, D, generator=g), torch.randn(H, P, L, D, generator=g)
    kr, vr = torch.randn(H, R, D, generator=g), torch.randn(H, R, D, generator=g)
    ks, vs = compress_pages(kp, vp, "mean")
    return q, ks, vs, kp, vp, kr, vr


@pytest.mark.parametrize("mass", ["exact", "preserve"])
@pytest.mark.parametrize("rule,kw", [("top_k", {"k": 2}), ("top_fraction", {"fraction": 0.3}),
                                     ("threshold", {"eps": 0.05})])
def test_scopes_agree_for_one_head_and_one_position(rule, kw, mass):
    """One KV head, one query head, one query position: the shared and per-KV-head choices are the same pages
    (top_fraction: for any number of query heads, both rank by the summed mass)."""
    for G in (1, 3) if rule == "top_fraction" else (1,):
        args = _pages(1, G, 1, seed=7)
        a, b = (clustered_attention(*args, scale=0.4, rule=rule, mass=mass, scope=s, **kw)
                for s in ("shared", "per_kv_head"))
        assert a.child_idx.shape[-1] > 0, "nothing refined: the test would not compare the rules"
        assert sorted(a.child_idx.flatten().tolist()) == sorted(b.child_idx.flatten().tolist())
        assert_close(a.out, b.out, what="same_computation", msg=f"{rule} G={G} out")
        assert_close(a.lse, b.lse, what="same_computation", msg=f"{rule} G={G} lse")


def test_shared_and_per_kv_head_rules_written_out():
    """Where the scopes differ, on masses chosen by hand (H, G, S, P)."""
    # one KV head, two query heads, one position: page 0 is hot for head 0 only, page 1 warm for both
    alpha = torch.tensor([[[[0.5, 0.3, 0.1, 0.0]], [[0.0, 0.3, 0.1, 0.0]]]])  # (1, 2, 1, 4)
    idx, _ = choose_pages(alpha, "top_k", k=1, scope="shared")
    assert idx.flatten().tolist() == [0]  # the max over heads: 0.5
    idx, _ = choose_pages(alpha, "top_k", k=1, scope="per_kv_head")
    assert idx.flatten().tolist() == [1]  # the group's sum: 0.6
    idx, valid = choose_pages(alpha, "threshold", eps=0.2, scope="shared")
    assert idx.flatten().tolist() == [0, 1]
    assert valid[0, :, 0].tolist() == [[True, True], [False, True]]  # page 0 refined for head 0 only
    idx, valid = choose_pages(alpha, "threshold", eps=0.2, scope="per_kv_head")
    assert sorted(idx.flatten().tolist()) == [0, 1] and bool(valid.all())  # for the whole group
    # two KV heads, two positions: one set for all heads and positions, padded rows ignored
    alpha = torch.tensor([[[[0.1, 0.6, 0.0], [0.1, 0.0, 0.0]]],
                          [[[0.2, 0.0, 0.3], [0.9, 0.0, 0.0]]]])  # (2, 1, 2, 3)
    idx, valid = choose_pages(alpha, "top_k", k=1, scope="shared")
    assert idx.tolist() == [[[0], [0]], [[0], [0]]] and bool(valid.all())  # 0.9 (head 1, position 1)
    idx, _ = choose_pages(alpha, "top_k", k=1, scope="shared", rows=1)
    assert idx.tolist() == [[[1], [1]], [[1], [1]]]  # position 1 is padding: 0.6 wins
    idx, _ = choose_pages(alpha, "top_k", k=1, scope="per_kv_head")
    assert idx.tolist() == [[[1], [0]], [[2], [0]]]
    idx, _ = choose_pages(alpha, "top_fraction", fraction=0.5, scope="shared")  # ceil(1.5) = 2 by summed mass
    assert sorted(idx[0, 0].tolist()) == [0, 1]  # sums 1.3, 0.6, 0.3
    idx, _ = choose_pages(alpha, "none", scope="shared")
    assert idx.shape == (2, 2, 0)
    with pytest.raises(ValueError, match="unknown refinement scope 'per_head'; choose one of shared, per_kv_head"):
        choose_pages(alpha, "top_k", scope="per_head")
    # threshold 0 refines every page for every head: dense attention (exact mass)
    args = _pages(2, 2, 3, seed=8)
    res = clustered_attention(*args, scale=0.4, rule="threshold", eps=0.0, scope="shared")
    q, _, _, kp, vp, kr, vr = args
    H, P, L, D = kp.shape
    keys = torch.cat((kp.reshape(H, P * L, D), kr), 1).double()
    vals = torch.cat((vp.reshape(H, P * L, D), vr), 1).double()
    logits = torch.einsum("hgsd,hnd->hgsn", q.double(), keys) * 0.4
    assert_close(res.out, torch.einsum("hgsn,hnd->hgsd", torch.softmax(logits, -1), vals), what="fp32", msg="eps 0")
    assert_close(res.lse, torch.logsumexp(logits, -1), what="fp32", msg="eps 0 lse")
    assert math.isclose(float(res.child_alpha.sum() + res.raw_alpha.sum()), H * 2 * 3, rel_tol=1e-5)
