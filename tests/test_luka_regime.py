"""LuKA's regimes (``luka_regime``), the paging of generated tokens, and the compression statistics.

References: Hugging Face's dense forward (tests/tiny_models.reference), the same engine without LuKA, fp64
attention over [context ‖ Phase-2 store] written out here with its causal mask by positions, and Magnetar's
earlier code path (a LukaDecoder that leaves the query/generated tokens to the engine, as before).
"""
from __future__ import annotations

import argparse
import copy
import types

import pytest
import torch

import magnetar
from magnetar.config import EngineConfig, LukaConfig, add_cli_args
from magnetar.engine.kv import KVShard
from magnetar.luka.decoder import LukaDecoder
from tests.conftest import assert_close, assert_differs
from tests.dist_utils import run_distributed
from tests.tiny_models import reference, tiny_model

L, Q = 300, 6  # context and query tokens of the engine tests
REFINE_ALL = dict(luka_mode="clustered", luka_refine="top_fraction", luka_refine_fraction=1.0,
                  luka_refine_mass="exact")  # every page refined with its own mass: dense attention exactly


def _ids(seed, n=L, m=Q):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g), torch.randint(0, 256, (m,), generator=g)


def _engine(model, **flat):
    return magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, **flat)


def _pages(tokens, page=16):
    """Tokens held in whole pages."""
    return max(0, tokens) // page * page


# -- the regimes in the engine --------------------------------------------------------------------------------

def test_after_query_reads_the_question_exactly_then_pages():
    model = tiny_model("llama", seed=21, num_hidden_layers=4)
    ctx, q = _ids(1)
    ref_logits, ref_tokens = reference(model, ctx, q, 3)
    luka = dict(luka_mode="mixed", luka_lined_layers=1, luka_recent=64, luka_compress_every=4)
    one = _engine(model, **luka).generate(ctx, q, max_new_tokens=1, return_logits=True)  # after_query: the default
    assert_close(one.first_token_logits, ref_logits, what="logits", msg="query forward, after_query")
    assert one.token_ids == ref_tokens[:1]
    # the answer's only token came from the exact read: nothing was compressed when it was produced
    assert one.decode_stats == {"paged_fraction": 0.0, "paged_generated_tokens": 0.0, "unattended_fraction": 0.0,
                                "compressed_fraction": 0.0}
    three = _engine(model, **luka).generate(ctx, q, max_new_tokens=3, return_logits=True)
    assert_close(three.first_token_logits, ref_logits, what="logits", msg="3 tokens, after_query")
    assert three.token_ids[0] == ref_tokens[0]
    # paged right after the question: at the forward of generated token 1 (position L + Q), not again before 4 steps
    st = three.decode_stats
    assert st["paged_fraction"] == pytest.approx(_pages(L + Q - 64) / L, abs=1e-12)
    assert 0.5 < st["unattended_fraction"] < 1.0 and st["paged_generated_tokens"] == 0.0
    assert_close(st["compressed_fraction"], (2 * st["paged_fraction"] + 2 * st["unattended_fraction"]) / 4,
                 what="fp64", msg="mean over the 4 LuKA layers")
    # before_query: the question itself already reads the pages (Magnetar's earlier behaviour)
    before = _engine(model, luka_regime="before_query", **luka).generate(ctx, q, max_new_tokens=1, return_logits=True)
    assert_differs(before.first_token_logits, ref_logits, msg="query forward, before_query")
    assert before.decode_stats["paged_fraction"] == pytest.approx(_pages(L - 64) / L, abs=1e-12)
    # no decode policy: no stats
    assert _engine(model).generate(ctx, q, max_new_tokens=1).decode_stats is None


def test_regimes_read_their_forwards_exactly_in_scoring():
    """Teacher-forced scoring runs chunks of luka_compress_every tokens: the first is the query. after_query reads
    it exactly, after_generation the next one too, before_query none; later chunks read pages."""
    model = tiny_model("llama", seed=22, num_hidden_layers=4)
    ctx, cont = _ids(2, m=20)
    E = 4
    cfgs = {r: LukaConfig(luka_mode="clustered", luka_recent=32, luka_compress_every=E, luka_regime=r)
            for r in ("before_query", "after_query", "after_generation")}
    dense, *scored = _engine(model).score_variants(ctx, cont, [None, *cfgs.values()])
    got = dict(zip(cfgs, (s.token_logprobs for s in scored)))
    want = dense.token_logprobs
    assert_differs(got["before_query"][:E], want[:E], msg="before_query, query chunk")
    assert_close(got["after_query"][:E], want[:E], what="same_computation", msg="after_query, query chunk")
    assert_differs(got["after_query"][E : 2 * E], want[E : 2 * E], msg="after_query, first generated chunk")
    assert_close(got["after_generation"][: 2 * E], want[: 2 * E], what="same_computation",
                 msg="after_generation, query and first generated chunk")
    assert_differs(got["after_generation"][2 * E : 3 * E], want[2 * E : 3 * E], msg="after_generation, then")


def test_after_generation_first_tokens_are_dense():
    model = tiny_model("qwen2", seed=23, num_hidden_layers=4)
    ctx, q = _ids(3)
    E, recent = 4, 22  # the first page boundary falls between the forwards of tokens E and E + 1
    _, ref_tokens = reference(model, ctx, q, 2 * E)
    res = _engine(model, luka_mode="clustered", luka_recent=recent, luka_compress_every=E,
                  luka_regime="after_generation").generate(ctx, q, max_new_tokens=2 * E)
    assert res.token_ids[:E] == ref_tokens[:E]
    # the first pages: at the forward reading generated token E (position L + Q + E - 1); none since
    assert res.decode_stats["paged_fraction"] == pytest.approx(_pages(L + Q + E - 1 - recent) / L, abs=1e-12)


# -- generated tokens paged ----------------------------------------------------------------------------------

class _RawGenerated(LukaDecoder):
    """Magnetar's earlier path: the engine attends the query/generated tokens itself, densely."""

    pages_generated = False


@pytest.mark.parametrize("rule", [dict(luka_refine="top_fraction", luka_refine_fraction=1.0),
                                  dict(luka_refine="threshold", luka_refine_eps=0.0)])
def test_refining_every_page_with_generated_pages_decodes_like_dense(rule):
    model = tiny_model("llama", seed=24, num_hidden_layers=3)
    ctx, q = _ids(4, n=100, m=5)
    ref_logits, ref_tokens = reference(model, ctx, q, 48)
    res = _engine(model, luka_mode="clustered", luka_refine_mass="exact", luka_recent=16, luka_page_size=8,
                  luka_compress_every=4, **rule).generate(ctx, q, max_new_tokens=48, return_logits=True)
    assert_close(res.first_token_logits, ref_logits, what="logits", msg=str(rule))
    assert res.token_ids == ref_tokens
    st = res.decode_stats
    # every whole page of the context; its last 4 tokens stay raw
    assert st["paged_fraction"] == pytest.approx(96 / 100, abs=1e-12)
    # pages of the query's and generated tokens too: at the last compression (position 100 + 5 + 44), the
    # entries older than the raw tail of 16
    assert st["paged_generated_tokens"] == _pages(149 - 16 - 100, 8) > 0


def test_generated_pages_enter_the_cover_and_before_query_keeps_the_old_path():
    model = tiny_model("llama", seed=25, num_hidden_layers=3)
    ctx, cont = _ids(5, n=100, m=40)
    cfg = LukaConfig(luka_mode="clustered", luka_refine="none", luka_recent=16, luka_page_size=8,
                     luka_compress_every=4, luka_regime="before_query")
    eng = _engine(model)
    paged, = eng.score_variants(ctx, cont, [cfg])
    eng.scorer._policies[cfg] = _RawGenerated(cfg, model.config)  # the same config served by the earlier path
    raw, = eng.score_variants(ctx, cont, [cfg])
    # the store's first page is cut at the chunk starting at continuation token 24 (position 124: entries before
    # 108 are older than the tail, 8 of the store's); until then both paths compute the same
    assert_close(paged.token_logprobs[:24], raw.token_logprobs[:24], what="same_computation", msg="before any")
    assert_differs(paged.token_logprobs[24:], raw.token_logprobs[24:], msg="with the store's pages")
    # generation with a short answer (nothing of the store paged): before_query is Magnetar's earlier result
    ctx, q = _ids(6)
    flat = dict(luka_mode="mixed", luka_lined_layers=1, luka_recent=32, luka_compress_every=4,
                luka_regime="before_query")
    new = _engine(model, **flat)
    old = _engine(model, **flat)
    old.policy = _RawGenerated(old.config.luka, model.config)
    a, b = (e.generate(ctx, q, max_new_tokens=12, return_logits=True) for e in (new, old))
    assert_close(a.first_token_logits, b.first_token_logits, what="same_computation", msg="before_query")
    assert a.token_ids == b.token_ids and a.decode_stats == b.decode_stats


def _dense_over(q, keys, values, q_pos, k_pos, scale):
    """fp64 attention of ``q (Hq, S, D)`` over ``keys/values (H, n, D)`` with keys visible when k_pos <= q_pos:
    ``out (Hq, S, D)``, ``lse (Hq, S)`` and the mass each key received ``(H, n)`` (summed over the group)."""
    H, G = keys.shape[0], q.shape[0] // keys.shape[0]
    k, v = keys.double().repeat_interleave(G, 0), values.double().repeat_interleave(G, 0)
    logits = torch.einsum("hsd,hnd->hsn", q.double(), k) * scale
    logits = logits.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    p = torch.softmax(logits, -1)
    return torch.einsum("hsn,hnd->hsd", p, v), torch.logsumexp(logits, -1), p.sum(1).reshape(H, G, -1).sum(1)


def test_decoder_pages_the_store_with_exact_masses():
    """The decoder alone over a context shard and a Phase-2 store it pages: the query read exactly, then every
    page refined (dense attention) and, for a second decoder, no page refined (the cover: mean summaries of the
    shard's and the store's pages, the shard's raw tail, the store's raw tail causally) -- out, lse and the mass
    of every entry against fp64 written out."""
    g = torch.Generator().manual_seed(0)
    N, H, G, D, ps, scale = 20, 2, 2, 8, 4, 0.3
    shard = KVShard(1)
    mass0 = torch.rand(1, H, N, generator=g)
    shard.layers[0].append(torch.randn(1, H, N, D, generator=g), torch.randn(1, H, N, D, generator=g), torch.arange(N),
                           mass0)
    shard.freeze()
    store = KVShard(1)
    store.freeze()
    kv, gen = shard.layers[0], store.layers[0]
    common = dict(luka_mode="clustered", luka_page_size=ps, luka_recent=6, luka_compress_every=2,
                  luka_compressor="mean")
    every = LukaDecoder(LukaConfig(luka_refine="top_fraction", luka_refine_fraction=1.0, luka_refine_mass="exact",
                                   **common), types.SimpleNamespace(num_hidden_layers=1))
    cover = LukaDecoder(LukaConfig(luka_refine="none", **common), types.SimpleNamespace(num_hidden_layers=1))
    want_mass, want_gen = mass0[0].double(), torch.zeros(H, 0, dtype=torch.float64)
    pos = N
    for step, S in enumerate([3] + [1] * 16):  # the query, then 16 generated tokens
        q_pos = torch.arange(pos, pos + S)
        q = torch.randn(1, H * G, S, D, generator=g)
        gen.append(torch.randn(1, H, S, D, generator=g), torch.randn(1, H, S, D, generator=g), q_pos)
        keys, values = torch.cat((kv.k[0], gen.k[0]), 1), torch.cat((kv.v[0], gen.v[0]), 1)
        out, lse, m = _dense_over(q[0], keys, values, q_pos, torch.cat((kv.pos, gen.pos)), scale)
        o, l = every.attend_context(0, 0, q, kv, q_pos, scale, N, gen=gen)
        assert_close(o[0], out, what="fp32", msg=f"every page refined, step {step}")
        assert_close(l[0], lse, what="fp32", msg=f"every page refined lse, step {step}")
        every.after_merge(0, l)  # the shard and the store are the whole KV: the merged lse is this one
        want_mass = want_mass + m[:, :N]
        want_gen = torch.cat((want_gen, torch.zeros(H, S, dtype=torch.float64)), 1) + m[:, N:]
        # no refinement: the cover written out from the state's page counts (pages cut at this forward)
        o, l = cover.attend_context(0, 0, q, kv, q_pos, scale, N, gen=gen)
        cover.after_merge(0, l)
        st = cover.layer_state(kv)
        if step == 0:  # after_query: the query read exactly
            assert st.pages == 0 and st.ks is None
            assert_close(o[0], out, what="fp32", msg="cover, the query")
            continue
        cut, gcut = st.pages * ps, st.gen_pages * ps
        summaries = lambda t, n: t[:, :n].reshape(H, -1, ps, D).mean(2)  # noqa: E731
        ck = torch.cat((summaries(kv.k[0], cut), summaries(gen.k[0], gcut), kv.k[0, :, cut:], gen.k[0, :, gcut:]), 1)
        cv = torch.cat((summaries(kv.v[0], cut), summaries(gen.v[0], gcut), kv.v[0, :, cut:], gen.v[0, :, gcut:]), 1)
        visible = torch.cat((torch.full((st.pages + st.gen_pages,), -1), kv.pos[cut:], gen.pos[gcut:]))
        c_out, c_lse, _ = _dense_over(q[0], ck, cv, q_pos, visible, scale)
        assert_close(o[0], c_out, what="fp32", msg=f"cover, step {step} ({st.pages} + {st.gen_pages} pages)")
        assert_close(l[0], c_lse, what="fp32", msg=f"cover lse, step {step}")
        pos += S
    st = every.layer_state(kv)
    assert st.pages == N // ps and st.gen_pages >= 2  # the store's oldest tokens were paged and refined
    assert_close(st.mass, want_mass, what="mass", msg="the shard's mass")
    assert_close(st.gen_mass, want_gen, what="mass", msg="the store's mass")
    assert every.stats(shard, N) == {"paged_fraction": 1.0, "paged_generated_tokens": float(st.gen_pages * ps),
                                     "compressed_fraction": 1.0}


# -- distributed KV ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", [dict(method="star", block_size=40, anchor_size=8),
                                    dict(method="pulsar", sink_size=4, chunk_size=4, summary_budget=0.25)])
def test_simulated_ranks_refine_all_in_the_default_regime_equals_the_method(method):
    model = tiny_model("qwen2", seed=26, num_hidden_layers=3)
    ctx, q = _ids(7)
    flat = dict(cp_size=4, simulate=True, **method)
    base = _engine(model, **flat).generate(ctx, q, max_new_tokens=6, return_logits=True)
    luka = _engine(model, luka_recent=32, luka_compress_every=2, **REFINE_ALL, **flat).generate(
        ctx, q, max_new_tokens=6, return_logits=True)
    assert_close(luka.first_token_logits, base.first_token_logits, what="same_computation", msg=method["method"])
    assert luka.token_ids == base.token_ids
    # one process pages the ranks' joined shard (counted once): last compression at the forward of token 5
    assert luka.decode_stats["paged_fraction"] == pytest.approx(_pages(L + Q + 4 - 32) / L, abs=1e-12)


def _star_worker(rank, world):
    model = tiny_model("qwen2", seed=27, num_hidden_layers=3)
    ctx, q = _ids(8, n=160)
    flat = dict(method="star", cp_size=world, block_size=40, anchor_size=8)
    base = _engine(model, **flat).generate(ctx, q, max_new_tokens=2, return_logits=True)
    luka = _engine(model, luka_recent=32, **REFINE_ALL, **flat).generate(ctx, q, max_new_tokens=2, return_logits=True)
    assert_close(luka.first_token_logits, base.first_token_logits, what="same_computation", msg=f"rank {rank}")
    assert luka.token_ids == base.token_ids
    # every rank pages its own shard (blocks in position order) at position 160 + Q: the ranks' pages add up
    recent_from, start, want = 160 + Q - 32, 0, 0
    for n in luka.context_kv_tokens_per_rank:
        want += _pages(min(n, recent_from - start))
        start += n
    assert luka.decode_stats["paged_fraction"] == pytest.approx(want / 160, abs=1e-12) and want > 0


def test_star_ranks_page_their_own_shards():
    run_distributed(_star_worker, 2)


# -- configuration and records --------------------------------------------------------------------------------

def test_regime_option_checks_flag_and_label():
    assert LukaConfig().luka_regime == "after_query"
    with pytest.raises(ValueError, match=r"luka_regime.*choose one of after_query, after_generation, before_query"):
        LukaConfig(luka_mode="clustered", luka_regime="before_answer")
    with pytest.raises(ValueError, match="luka_regime"):
        EngineConfig.create(luka_mode="clustered", luka_regime=1)
    parser = add_cli_args(argparse.ArgumentParser())
    assert parser.parse_args(["--luka-regime", "after_generation"]).luka_regime == "after_generation"
    with pytest.raises(SystemExit):
        parser.parse_args(["--luka-regime", "later"])
    from magnetar.luka.decoder import LukaDecoder

    luka_label = LukaDecoder.label  # the report's label of a LuKA run (method_label asks the registry's class)
    default = luka_label(LukaConfig(luka_mode="clustered"))  # the paper's regime goes unnamed
    assert "query" not in default and "generation" not in default
    assert luka_label(LukaConfig(luka_mode="clustered", luka_regime="before_query")) == default[:-1] + ", before query)"


def test_runner_records_the_decode_stats(monkeypatch):
    from magnetar.eval import runner

    stats = {"paged_fraction": 0.75, "compressed_fraction": 0.75}
    suite = types.SimpleNamespace(perplexity=False, fidelity=False, score=lambda sample, text: 1.0)
    sample = types.SimpleNamespace(max_new_tokens=4, answers=("x",))
    monkeypatch.setattr(runner, "get_suite", lambda name: suite)
    monkeypatch.setattr(runner, "fitted_sample", lambda *a: (sample, {}, ("ctx", "q")))

    def result(decode_stats):
        return types.SimpleNamespace(text="x", context_tokens=10, query_tokens=2, ttft_seconds=0.1,
                                     decode_seconds_per_token=None, simulated=False, phase1_seconds=[0.1],
                                     prefill_stats=None, decode_stats=decode_stats)

    engine = types.SimpleNamespace(max_positions=None,
                                   generate_batch=lambda reqs, max_new_tokens: [result(stats), result(None)])
    cfg = EngineConfig.create(luka_mode="clustered")
    args = types.SimpleNamespace(suite="wikisalad", data_seed=0)
    group = [("dense", 100, "easy", i, cfg, f"k{i}") for i in range(2)]
    with_stats, without = runner._run_group(args, engine, None, group)
    assert with_stats["decode_stats"] == stats and "decode_stats" not in without


def test_scored_chunks_choose_pages_per_token(monkeypatch):
    """After the query's forward, a scored chunk of E tokens stands for E decode steps: its tokens choose their
    pages one by one (per_token), as decoding would; the query's own forward chooses once (before_query)."""
    import magnetar.luka.decoder as decoder

    seen, real = [], decoder.clustered_attention
    monkeypatch.setattr(decoder, "clustered_attention",
                        lambda q, *a, **kw: seen.append((q.shape[2], kw["per_token"])) or real(q, *a, **kw))
    model = tiny_model("llama", seed=27, num_hidden_layers=2)
    ctx, cont = _ids(8, m=12)
    cfg = LukaConfig(luka_mode="clustered", luka_recent=32, luka_compress_every=4, luka_regime="before_query")
    _engine(model).score_variants(ctx, cont, [cfg])
    assert seen == [(4, False)] * 2 + [(4, True)] * 4, seen  # 2 layers x 3 chunks of 4
