"""LuKA: lined (H2O) and clustered attention, against direct implementations and dense attention.

References: fp64 attention written out here (softmax over every key), Eq. 1-4 written out page by page with
Python loops, Hugging Face's own dense forward (tests/tiny_models.reference) and, for the Phase-1 mass,
Hugging Face's eager attention weights.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

import magnetar
from magnetar.config import EngineConfig, LukaConfig
from magnetar.luka.core import choose_pages, clustered_attention, column_mass, compress_pages, heavy_hitters
from tests.conftest import assert_close, assert_differs
from tests.dist_utils import run_distributed
from tests.tiny_models import reference, tiny_model


def _dense(q, k, v, scale):  # q (H, G, S, D), k/v (H, N, D) -> fp64 out, lse
    logits = torch.einsum("hgsd,hnd->hgsn", q.double(), k.double()) * scale
    lse = torch.logsumexp(logits, -1)
    return torch.einsum("hgsn,hnd->hgsd", torch.softmax(logits, -1), v.double()), lse


def _pages(H=2, G=3, S=4, P=6, L=4, R=5, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(H, G, S, D, generator=g)
    kp, vp = torch.randn(H, P, L, D, generator=g), torch.randn(H, P, L, D, generator=g)
    kr, vr = torch.randn(H, R, D, generator=g), torch.randn(H, R, D, generator=g)
    ks, vs = compress_pages(kp, vp, "mean")
    return q, ks, vs, kp, vp, kr, vr


def test_column_mass_matches_attention_weights():
    g = torch.Generator().manual_seed(1)
    Hq, Hkv, S, D = 4, 2, 37, 8
    q, k = torch.randn(1, Hq, S, D, generator=g), torch.randn(1, Hkv, S, D, generator=g)
    pos = torch.arange(S)
    for window in (None, 5):
        vis = pos[None, :] <= pos[:, None]
        if window is not None:
            vis &= pos[None, :] > pos[:, None] - window
        logits = torch.einsum("hsd,hnd->hsn", q[0].double(), k[0].double().repeat_interleave(2, 0)) * 0.3
        p = torch.softmax(logits.masked_fill(~vis, float("-inf")), -1)  # (Hq, S, N)
        lse = torch.logsumexp(logits.masked_fill(~vis, float("-inf")), -1).float()[None]
        want = p.sum(1).reshape(Hkv, 2, S).sum(1)
        got = column_mass(q, k, lse, scale=0.3, q_pos=pos, k_pos=pos, window=window, tile=8)
        assert_close(got, want, what="fp32", msg=f"column mass window={window}")
        assert_close(got.sum(-1), torch.full((Hkv,), 2.0 * S), what="mass", msg="column mass total")
        perm = torch.randperm(S, generator=g)  # keys out of position order: the general (masked) path
        shuffled = column_mass(q, k[:, :, perm], lse, scale=0.3, q_pos=pos, k_pos=pos[perm], window=window, tile=8)
        assert_close(shuffled, want[:, perm], what="fp32", msg="column mass, shuffled keys")


def test_compressors_match_their_formulas():
    g = torch.Generator().manual_seed(2)
    kp, vp, w = (torch.randn(2, 3, 5, 4, generator=g), torch.randn(2, 3, 5, 4, generator=g),
                 torch.rand(2, 3, 5, generator=g))
    ks, vs = compress_pages(kp, vp, "mean")
    assert_close(ks, kp.mean(2), what="fp32_reorder", msg="mean k")
    assert_close(vs, vp.mean(2), what="fp32_reorder", msg="mean v")
    tau = 0.5
    ks, vs = compress_pages(kp, vp, "attention_weighted", mass=w, tau=tau)
    for h in range(2):
        for p in range(3):
            pi = [math.exp(float(w[h, p, i]) / tau) for i in range(5)]
            pi = [x / sum(pi) for x in pi]
            assert_close(ks[h, p], sum(pi[i] * kp[h, p, i] for i in range(5)), what="fp32_reorder", msg="weighted k")
            assert_close(vs[h, p], sum(pi[i] * vp[h, p, i] for i in range(5)), what="fp32_reorder", msg="weighted v")
    ks, vs = compress_pages(kp, vp, "random", generator=torch.Generator().manual_seed(0))
    for p in range(3):  # one token of the page, the same one for every head, key and value together
        (i,) = [i for i in range(5) if torch.equal(ks[0, p], kp[0, p, i])]
        assert torch.equal(ks[1, p], kp[1, p, i]) and torch.equal(vs[:, p], vp[:, p, i])
    with pytest.raises(ValueError, match="accumulated attention mass"):
        compress_pages(kp, vp, "attention_weighted")
    with pytest.raises(ValueError, match="unknown compressor"):
        compress_pages(kp, vp, "median")


@pytest.mark.parametrize("scope", ["shared", "per_kv_head"])
@pytest.mark.parametrize("rule,kw", [("top_fraction", {"fraction": 1.0}), ("threshold", {"eps": 0.0})])
def test_refining_every_page_with_exact_mass_is_dense_attention(rule, kw, scope):
    q, ks, vs, kp, vp, kr, vr = _pages()
    H, P, L, D = kp.shape
    res = clustered_attention(q, ks, vs, kp, vp, kr, vr, scale=0.35, rule=rule, mass="exact", scope=scope, **kw)
    out, lse = _dense(q, torch.cat((kp.reshape(H, P * L, D), kr), 1), torch.cat((vp.reshape(H, P * L, D), vr), 1), 0.35)
    assert res.child_idx.shape[-1] == P
    assert_close(res.out, out, what="fp32", msg=f"{rule} {scope} out")
    assert_close(res.lse, lse, what="fp32", msg=f"{rule} {scope} lse")


@pytest.mark.parametrize("rule,kw", [("top_k", {"k": 1}), ("top_fraction", {"fraction": 0.3})])
def test_per_token_choice_equals_one_token_per_call(rule, kw):
    """A chunk of S scored tokens stands for S decode steps: with ``per_token`` each token chooses (for all
    heads) what a call with that token alone chooses; the per-forward choice differs."""
    q, ks, vs, kp, vp, kr, vr = _pages(seed=5)
    S = q.shape[2]
    call = dict(scale=0.35, rule=rule, mass="exact", scope="shared", **kw)
    chunk = clustered_attention(q, ks, vs, kp, vp, kr, vr, per_token=True, **call)
    for s in range(S):
        one = clustered_attention(q[:, :, s : s + 1], ks, vs, kp, vp, kr, vr, **call)
        assert torch.equal(chunk.child_idx[:, s : s + 1], one.child_idx), (rule, s)
        assert_close(chunk.out[:, :, s : s + 1], one.out, what="fp32", msg=f"{rule} token {s} out")
        assert_close(chunk.lse[:, :, s : s + 1], one.lse, what="fp32", msg=f"{rule} token {s} lse")
    forward = clustered_attention(q, ks, vs, kp, vp, kr, vr, **call)
    assert not torch.equal(forward.child_idx, chunk.child_idx), rule  # the data make the rows disagree


def test_mass_preserving_refinement_matches_eq1_to_4_written_out():
    q, ks, vs, kp, vp, kr, vr = _pages(seed=3)
    H, G, S, D = q.shape
    P, L, R = kp.shape[1], kp.shape[2], kr.shape[1]
    scale, k = 0.4, 2
    res = clustered_attention(q, ks, vs, kp, vp, kr, vr, scale=scale, rule="top_k", k=k, mass="preserve",
                              scope="per_kv_head")
    for h in range(H):
        # per_kv_head: the pages refined for query s are the k with the largest mass summed over the group (Eq. 1
        # per query head); the shared scope is tests/test_luka_authors.py's
        for s in range(S):
            alphas = []
            for g_ in range(G):
                logits = [float(q[h, g_, s] @ ks[h, p]) * scale for p in range(P)] + \
                         [float(q[h, g_, s] @ kr[h, r]) * scale for r in range(R)]
                z = sum(math.exp(x) for x in logits)
                alphas.append([math.exp(x) / z for x in logits])
            group = [sum(a[p] for a in alphas) for p in range(P)]
            refined = sorted(range(P), key=lambda p: -group[p])[:k]
            assert sorted(res.child_idx[h, s].tolist()) == sorted(refined)
            for g_ in range(G):
                a = alphas[g_]
                o = torch.zeros(D, dtype=torch.float64)
                total = 0.0
                for p in range(P):
                    if p in refined:  # Eq. 2-3: the children share the page's mass
                        cl = [float(q[h, g_, s] @ kp[h, p, i]) * scale for i in range(L)]
                        zc = sum(math.exp(x) for x in cl)
                        for i in range(L):
                            o += a[p] * math.exp(cl[i]) / zc * vp[h, p, i].double()
                            total += a[p] * math.exp(cl[i]) / zc
                    else:
                        o += a[p] * vs[h, p].double()
                        total += a[p]
                for r in range(R):
                    o += a[P + r] * vr[h, r].double()
                    total += a[P + r]
                assert_close(total, 1.0, what="fp64", msg="reference mass")
                assert_close(res.out[h, g_, s], o, what="fp32", msg=f"out {(h, g_, s)}")
    # the masses the result reports sum to 1 per query (refinement redistributes, never renormalises)
    total = res.summary_alpha.sum(-1) + res.raw_alpha.sum(-1) + res.child_alpha.sum((-1, -2))
    assert_close(total, torch.ones_like(total), what="fp32", msg="reported masses")
    # summaries are only an approximation: the result differs from dense attention (the test can fail)
    out, _ = _dense(q, torch.cat((kp.reshape(H, P * L, D), kr), 1), torch.cat((vp.reshape(H, P * L, D), vr), 1), scale)
    assert_differs(res.out, out, msg="summaries vs dense")


def test_refinement_rules_and_zero_refinement():
    alpha = torch.tensor([[[[0.05, 0.5, 0.2, 0.01, 0.24]]]])  # (H=1, G=1, S=1, P=5)
    idx, valid = choose_pages(alpha, "top_k", k=2)
    assert sorted(idx.flatten().tolist()) == [1, 4] and bool(valid.all())
    idx, valid = choose_pages(alpha, "top_fraction", fraction=0.5)
    assert sorted(idx.flatten().tolist()) == [1, 2, 4]
    idx, valid = choose_pages(alpha, "threshold", eps=0.1)
    assert sorted(idx[valid[:, 0]].tolist()) == [1, 2, 4]
    idx, _ = choose_pages(alpha, "none")
    assert idx.shape[-1] == 0
    with pytest.raises(ValueError, match="unknown refinement rule"):
        choose_pages(alpha, "best")
    q, ks, vs, kp, vp, kr, vr = _pages(seed=4)
    res = clustered_attention(q, ks, vs, kp, vp, kr, vr, scale=0.3, rule="none")
    out, lse = _dense(q, torch.cat((ks, kr), 1), torch.cat((vs, vr), 1), 0.3)  # cover only: summaries + raw
    assert_close(res.out, out, what="fp32", msg="cover out")
    assert_close(res.lse, lse, what="fp32", msg="cover lse")
    # log(L) on the summary logits: a page weighs as L copies of its summary (luka_size_bias)
    L = kp.shape[2]
    res = clustered_attention(q, ks, vs, kp, vp, kr, vr, scale=0.3, rule="none", summary_bias=math.log(L))
    rep = lambda x: x.repeat_interleave(L, dim=1)  # noqa: E731
    out, lse = _dense(q, torch.cat((rep(ks), kr), 1), torch.cat((rep(vs), vr), 1), 0.3)
    assert_close(res.out, out, what="fp32", msg="size bias out")
    assert_close(res.lse, lse, what="fp32", msg="size bias lse")


def test_heavy_hitters_take_the_heaviest_plus_the_window_once():
    mass = torch.tensor([[5.0, 0.1, 3.0, 0.2, 4.0, 9.0, 0.0, 1.0]])
    forced = torch.tensor([False] * 6 + [True, True])
    assert heavy_hitters(mass, 2, forced).tolist() == [[0, 5, 6, 7]]  # no duplicates even if a heavy one is recent
    assert heavy_hitters(mass, 3, None).tolist() == [[0, 4, 5]]
    assert heavy_hitters(mass, 100, forced).tolist() == [list(range(8))]


def _ids(seed, L=200, Q=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (L,), generator=g), torch.randint(0, 256, (Q,), generator=g)


DENSE_EQUIVALENT = {
    "lined, budget >= cache": dict(luka_mode="lined", luka_heavy_fraction=1.0),
    "clustered, every page refined": dict(luka_mode="clustered", luka_refine="top_fraction", luka_refine_fraction=1.0,
                                          luka_refine_mass="exact", luka_recent=20),
    "clustered, eps 0": dict(luka_mode="clustered", luka_refine="threshold", luka_refine_eps=0.0,
                             luka_refine_mass="exact", luka_recent=20, luka_compress_every=2),
    "clustered, every page refined per KV head": dict(luka_mode="clustered", luka_refine="top_fraction",
                                                      luka_refine_fraction=1.0, luka_refine_mass="exact",
                                                      luka_refine_scope="per_kv_head", luka_recent=20),
}


@pytest.mark.parametrize("regime", ["before_query", "after_query"])  # the query forward paged, or read exactly
@pytest.mark.parametrize("name", list(DENSE_EQUIVALENT))
def test_dense_equivalent_configs_decode_like_dense(name, regime):
    model = tiny_model("llama", seed=2, num_hidden_layers=4)
    ctx, q = _ids(7)
    ref_logits, ref_tokens = reference(model, ctx, q, 6)
    eng = magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, luka_regime=regime,
                                  **DENSE_EQUIVALENT[name])
    res = eng.generate(ctx, q, max_new_tokens=6, return_logits=True)
    assert_close(res.first_token_logits, ref_logits, what="logits", msg=name)
    assert res.token_ids == ref_tokens


def test_real_configs_change_the_output_and_cut_pages_over_decoding():
    model = tiny_model("qwen2", seed=3, num_hidden_layers=4)
    ctx, q = _ids(8)
    ref_logits, _ = reference(model, ctx, q, 1)
    for mode in ("lined", "clustered", "mixed"):
        eng = magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, luka_mode=mode,
                                      luka_lined_layers=1, luka_recent=32, luka_compress_every=4,
                                      luka_regime="before_query")  # the query forward already compressed
        res = eng.generate(ctx, q, max_new_tokens=40, return_logits=True)
        assert len(res.token_ids) == 40
        assert_differs(res.first_token_logits, ref_logits, msg=mode)  # not dense: the test can fail


def test_cover_and_pages_over_decoding():
    """The clustered cover holds each context token once: pages cover the oldest tokens, the rest is raw; pages
    are cut every luka_compress_every steps as tokens leave the recent tail."""
    from magnetar.engine.kv import KVShard
    from magnetar.luka.decoder import LukaDecoder

    cfg = LukaConfig(luka_mode="clustered", luka_page_size=8, luka_recent=24, luka_compress_every=4,
                     luka_refine="top_k", luka_refine_k=2, luka_regime="before_query")
    model_cfg = type("C", (), {"num_hidden_layers": 1})()
    dec = LukaDecoder(cfg, model_cfg)
    g = torch.Generator().manual_seed(0)
    N, H, G, D = 100, 2, 2, 8
    shard = KVShard(1)
    shard.layers[0].append(torch.randn(1, H, N, D, generator=g), torch.randn(1, H, N, D, generator=g), torch.arange(N),
                           torch.rand(1, H, N, generator=g))
    shard.freeze()
    kv = shard.layers[0]
    seen = []
    for step in range(12):
        qpos = torch.tensor([N + step])
        q = torch.randn(1, H * G, 1, D, generator=g)
        o, l = dec.attend_context(0, 0, q, kv, qpos, 0.3, N)
        dec.after_merge(0, l)  # this shard is the whole KV: the merged lse is its own
        st = dec.layer_state(kv)
        seen.append(st.pages)
        assert st.pages * 8 <= int((kv.pos < N + step - 24).sum())  # never a recent token in a page
    # pages at steps 0, 4, 8: (100 - 24) // 8 = 9, then (104 - 24) // 8 = 10, (108 - 24) // 8 = 10 ... capped at N
    assert seen[0] == 9 and seen[4] == 10 and seen[8] == 10 and seen == sorted(seen)
    # mass accumulates on tokens (raw and refined; an unrefined page's share stays with its summary)
    added = dec.layer_state(kv).mass.sum(-1) - shard.layers[0].mass[0].sum(-1)
    assert bool((added > 0).all()) and bool((added < 12.0 * G).all())
    # lined: all of a step's mass lands on tokens, G query heads' worth per step (this shard is all the KV)
    lined = LukaDecoder(LukaConfig(luka_mode="lined", luka_recent=24, luka_heavy_fraction=0.25,
                                   luka_regime="before_query"), model_cfg)
    for step in range(5):
        qpos = torch.tensor([N + step])
        o, l = lined.attend_context(0, 0, torch.randn(1, H * G, 1, D, generator=g), kv, qpos, 0.3, N)
        lined.after_merge(0, l)
    added = lined.layer_state(kv).mass.sum(-1) - shard.layers[0].mass[0].sum(-1)
    assert_close(added, torch.full((H,), 5.0 * G), what="mass", msg="lined mass added")
    # the merged lse rescales the update: with another part holding half the mass, half is added
    half = LukaDecoder(LukaConfig(luka_mode="lined", luka_recent=24, luka_heavy_fraction=0.25,
                                  luka_regime="before_query"), model_cfg)
    o, l = half.attend_context(0, 0, torch.randn(1, H * G, 1, D, generator=g), kv, torch.tensor([N]), 0.3, N)
    half.after_merge(0, l + math.log(2.0))
    added = half.layer_state(kv).mass.sum(-1) - shard.layers[0].mass[0].sum(-1)
    assert_close(added, torch.full((H,), 0.5 * G), what="mass", msg="rescaled mass added")


def test_phase1_mass_equals_eager_attention_weights():
    model = tiny_model("llama", seed=5, num_hidden_layers=2)
    ctx, q = _ids(9, L=40)
    eng = magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, luka_mode="lined")
    shard = eng.encoder.phase1(ctx).shard
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        att = eager(ctx[None], output_attentions=True, use_cache=False).attentions  # per layer (1, Hq, S, S)
    for layer, a in enumerate(att):
        want = a[0].sum(1).reshape(2, 2, 40).sum(1)  # (Hkv, N): summed over queries and the group's heads
        assert_close(shard.layers[layer].mass[0], want, what="mass", msg=f"layer {layer}")


def test_score_variants_with_luka_equal_separate_scores():
    model = tiny_model("llama", seed=6, num_hidden_layers=4)
    ctx, cont = _ids(12, L=120, Q=40)
    eng = magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False)
    lined = LukaConfig(luka_mode="lined", luka_recent=16)
    clustered = LukaConfig(luka_mode="clustered", luka_recent=16)
    dense, a, b = eng.score_variants(ctx, cont, [None, lined, clustered])
    alone = magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, luka_mode="lined",
                                    luka_recent=16).score(ctx, cont)
    assert_close(a.token_logprobs, alone.token_logprobs, what="same_computation", msg="lined")
    assert_differs(a.token_logprobs, dense.token_logprobs, msg="lined")
    assert_differs(b.token_logprobs, dense.token_logprobs, msg="clustered")


def test_bad_configs_give_clear_errors():
    with pytest.raises(ValueError, match="luka_page_size"):
        LukaConfig(luka_mode="clustered", luka_page_size=0)
    with pytest.raises(ValueError, match="luka_recent"):
        LukaConfig(luka_mode="clustered", luka_recent=-1)
    with pytest.raises(ValueError, match="luka_mode.*choose one of"):
        LukaConfig(luka_mode="dotted")
    with pytest.raises(ValueError, match="luka_heavy_fraction"):
        LukaConfig(luka_mode="lined", luka_heavy_fraction=0.0)
    with pytest.raises(ValueError, match="luka_refine_scope.*choose one of shared, per_kv_head"):
        LukaConfig(luka_mode="clustered", luka_refine_scope="per_head")
    with pytest.raises(ValueError, match="use one of them"):
        EngineConfig.create(luka_mode="lined", sparse_policy="oracle_topk", sparse_budget=4)
    with pytest.raises(ValueError, match="use method dense / star / pulsar"):
        EngineConfig.create(method="ring", cp_size=2, luka_mode="lined")
    model = tiny_model("llama", seed=2)
    ctx, q = _ids(1, L=60)
    eng = magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, luka_mode="clustered",
                                  luka_recent=20, luka_refine_k=4)  # (60 - 20) // 16 = 2 pages < k = 4
    with pytest.raises(ValueError, match="luka_refine_k \\(4\\) exceeds the 2 pages"):
        eng.generate(ctx, q, max_new_tokens=2)


def _star_worker(rank, world):
    model = tiny_model("qwen2", seed=4, num_hidden_layers=3)
    ctx, q = _ids(11, L=120)
    base = magnetar.init_inference(copy.deepcopy(model), method="star", cp_size=world, deepspeed_inference=False
                                   ).generate(ctx, q, max_new_tokens=5, return_logits=True)
    full = magnetar.init_inference(copy.deepcopy(model), method="star", cp_size=world, deepspeed_inference=False,
                                   luka_mode="lined", luka_heavy_fraction=1.0).generate(ctx, q, max_new_tokens=5,
                                                                                         return_logits=True)
    assert_close(full.first_token_logits, base.first_token_logits, what="same_computation", msg=f"rank {rank}")
    assert full.token_ids == base.token_ids
    mixed = magnetar.init_inference(copy.deepcopy(model), method="star", cp_size=world, deepspeed_inference=False,
                                    luka_mode="mixed", luka_lined_layers=1,
                                    luka_recent=16).generate(ctx, q, max_new_tokens=5)
    assert len(mixed.token_ids) == 5


def test_luka_over_distributed_star_kv():
    run_distributed(_star_worker, 2)
