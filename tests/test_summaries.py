"""Pulsar Attention's context summaries (magnetar.methods.summaries) against hand-computed answers."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from magnetar.methods.summaries import (
    BM25_B,
    BM25_K1,
    DEFAULT_BUDGET,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_SINK_SIZE,
    POSITION_MODES,
    SCORERS,
    IdfTable,
    chunk_scores,
    corpus_idf,
    num_summary_chunks,
    plan_pulsar,
    prefix_positions,
    pulsar_prefix,
    query_start_position,
    select_summary,
    sink_indices,
)
from tests.conftest import assert_close, assert_differs

T = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731


def hand_idf(docs, t):
    n = len(docs)
    df = sum(1 for d in docs if t in d)
    return math.log(n / max(df, 1))


# ----------------------------------------------------------------------------------------------- constants
def test_defaults_and_names():
    assert SCORERS == ("max_idf", "tfidf", "bm25", "entropy", "even")
    assert POSITION_MODES == ("sparse", "contiguous")
    assert (DEFAULT_CHUNK_SIZE, DEFAULT_BUDGET, DEFAULT_SINK_SIZE) == (32, 0.125, 64)
    assert (BM25_K1, BM25_B) == (1.2, 0.75)


def test_unknown_scorer_lists_scorers():
    # the options are checked once, by the config (this module trusts them): the error lists every scorer
    from magnetar.config import PulsarConfig

    with pytest.raises(ValueError) as e:
        PulsarConfig(scorer="maxidf")
    for name in SCORERS:
        assert name in str(e.value)


# ------------------------------------------------------------------------------------------------ IDF (Eq.2)
def test_corpus_idf_documents_are_blocks():
    # 3 blocks; 1 in every block, 2 in two, 3 repeated 4x inside one block, 7 absent (vocab_size=9).
    ids = T([1, 2, 3, 3,  1, 2, 4, 5,  1, 3, 3, 6])
    tab = corpus_idf(ids, [(0, 4), (4, 8), (8, 12)], vocab_size=9)
    assert isinstance(tab, IdfTable) and tab.n_docs == 3 and tab.vocab_size == 9
    assert tab.df.tolist() == [0, 3, 2, 2, 1, 1, 1, 0, 0]  # 3 appears 4 times but in 2 blocks
    docs = [set(ids[s:e].tolist()) for s, e in [(0, 4), (4, 8), (8, 12)]]
    for t in range(9):
        assert_close(tab.idf[t].item(), hand_idf(docs, t), what="fp64", msg=f"idf of {t}")
    assert tab.idf[1].item() == 0.0                              # in all documents
    assert tab.idf[4].item() == pytest.approx(math.log(3))       # in one document
    assert tab.idf[7].item() == pytest.approx(math.log(3))       # absent: max(df, 1) = 1
    assert tab.doc_lengths == (4, 4, 4)


def test_corpus_idf_block_size_and_single_block():
    ids = torch.randint(0, 50, (37,), generator=torch.Generator().manual_seed(0))
    a = corpus_idf(ids, 10)
    b = corpus_idf(ids, [(0, 10), (10, 20), (20, 30), (30, 37)])
    assert torch.equal(a.idf, b.idf) and torch.equal(a.df, b.df) and a.doc_lengths == (10, 10, 10, 7)
    assert a.vocab_size == int(ids.max()) + 1
    one = corpus_idf(ids, [(0, 37)])
    assert torch.all(one.idf == 0)  # log(1 / 1)


def test_corpus_idf_bm25_idf_formula():
    ids = T([1, 2, 3, 3, 1, 2, 4, 5, 1, 3, 3, 6])
    tab = corpus_idf(ids, 4)
    for t, df in enumerate(tab.df.tolist()):
        assert tab.bm25_idf()[t].item() == pytest.approx(math.log((3 - df + 0.5) / (df + 0.5) + 1))


# ------------------------------------------------------------------------------------------------- scorers
def _two_block_corpus():
    # block A (scored) and block B (only there to make tokens common). chunk_size 4.
    # token 9 appears only in A -> IDF log 2; tokens 1,2,3 in both -> 0; 5 only in A.
    a = [1, 2, 3, 1,   1, 9, 2, 3,   5, 5, 1, 2,   3, 1]
    b = [1, 2, 3, 7]
    ids = T(a + b)
    tab = corpus_idf(ids, [(0, len(a)), (len(a), len(a) + len(b))])
    return T(a), tab


def test_max_idf_rare_token_chunk_wins():
    blk, tab = _two_block_corpus()
    sc = chunk_scores(blk, tab, chunk_size=4, scorer="max_idf")
    l2 = math.log(2)
    assert sc.tolist() == pytest.approx([0.0, l2, l2, 0.0])
    # budget for 1 chunk: ceil(0.25 * 14 / 4) = 1 -> chunk 1 (ties with chunk 2, earlier wins)
    assert select_summary(blk, tab, chunk_size=4, budget=0.25, scorer="max_idf").tolist() == [4, 5, 6, 7]
    # a bare Eq. 2 tensor works as well
    assert torch.equal(chunk_scores(blk, tab.idf, chunk_size=4, scorer="max_idf"), sc)


def test_tfidf_matches_hand_formula():
    blk, tab = _two_block_corpus()
    sc = chunk_scores(blk, tab, chunk_size=4, scorer="tfidf")
    docs = [set(blk.tolist()), {1, 2, 3, 7}]
    toks = blk.tolist()
    chunks = [toks[i:i + 4] for i in range(0, len(toks), 4)]
    expect = [sum(hand_idf(docs, t) for t in c) / len(c) for c in chunks]  # Eq. 9, partial chunk |C| = 2
    assert_close(sc.tolist(), expect, what="fp64", msg="tfidf")
    # chunk 2 has two rare tokens (5, 5) -> highest mean; chunk 1 has one
    assert expect[2] > expect[1] > expect[0] == 0
    assert select_summary(blk, tab, chunk_size=4, budget=0.25, scorer="tfidf").tolist() == [8, 9, 10, 11]


def test_bm25_matches_hand_formula_with_corpus_mean_chunk_len():
    blk, tab = _two_block_corpus()
    toks = blk.tolist()
    chunks = [toks[i:i + 4] for i in range(0, len(toks), 4)]
    n_docs = 2
    df = {t: int(tab.df[t]) for t in set(toks)}
    # l_bar over the corpus: block A -> chunks of 4,4,4,2; block B -> 4 ; (18 tokens / 5 chunks)
    lbar = 18 / 5
    assert tab.mean_chunk_len(4) == pytest.approx(lbar)

    def bm25(c, lbar):
        s = 0.0
        for t, tf in Counter(c).items():
            idf = math.log((n_docs - df[t] + 0.5) / (df[t] + 0.5) + 1)
            s += idf * tf * (1.2 + 1) / (tf + 1.2 * (1 - 0.75 + 0.75 * len(c) / lbar))
        return s

    sc = chunk_scores(blk, tab, chunk_size=4, scorer="bm25")
    assert_close(sc.tolist(), [bm25(c, lbar) for c in chunks], what="fp64", msg="bm25")
    sc2 = chunk_scores(blk, tab, chunk_size=4, scorer="bm25", avg_chunk_len=4.0)
    assert_close(sc2.tolist(), [bm25(c, 4.0) for c in chunks], what="fp64", msg="bm25, avg_chunk_len 4")
    assert_differs(sc, sc2, msg="bm25 with another avg_chunk_len")
    with pytest.raises(ValueError, match="IdfTable"):
        chunk_scores(blk, tab.idf, chunk_size=4, scorer="bm25")


def test_entropy_type_token_ratio():
    # chunk_size 4: [1,1,1,1] -> 1/4, [1,2,1,2] -> 2/4, [1,2,3,4] -> 4/4, [5,5,6] partial -> 2/3
    blk = T([1, 1, 1, 1, 1, 2, 1, 2, 1, 2, 3, 4, 5, 5, 6])
    sc = chunk_scores(blk, None, chunk_size=4, scorer="entropy")
    assert sc.tolist() == pytest.approx([0.25, 0.5, 1.0, 2 / 3])
    assert select_summary(blk, None, chunk_size=4, budget=0.25, scorer="entropy").tolist() == [8, 9, 10, 11]
    # k = ceil(0.5 * 15 / 4) = 2 -> chunks 2 and 3 (partial), in positional order
    assert select_summary(blk, None, chunk_size=4, budget=0.5, scorer="entropy").tolist() == list(range(8, 15))


@pytest.mark.parametrize("L,chunk,budget",
                         [(100, 4, 0.125), (4096, 32, 0.125), (37, 5, 0.3), (7, 32, 0.5), (64, 8, 0.5)])
def test_even_is_floor_linspace(L, chunk, budget):
    blk = torch.arange(L) % 11
    got = select_summary(blk, None, chunk_size=chunk, budget=budget, scorer="even")
    s = min(num_summary_chunks(L, chunk, budget) * chunk, L)
    expect = torch.floor(torch.linspace(0, L - 1, s, dtype=torch.float64)).long()
    assert torch.equal(got, expect)
    assert got[0] == 0 and (s == 1 or got[-1] == L - 1)
    assert torch.all(got[1:] > got[:-1])  # distinct, ascending
    assert torch.equal(select_summary(blk, None, chunk_size=chunk, budget=1.0, scorer="even"), torch.arange(L))


def test_even_has_no_chunk_score():
    with pytest.raises(ValueError, match="Eq. 13"):
        chunk_scores(T([1, 2, 3]), None, chunk_size=1, scorer="even")


# -------------------------------------------------------------------------------- chunks, budget, ordering
@pytest.mark.parametrize(
    "L,chunk,budget,k",
    [
        (4096, 32, 0.125, 16),   # Table 9: 512 tokens -> 16 chunks
        (16384, 32, 0.125, 64),
        (4000, 32, 0.125, 16),   # 500 / 32 = 15.6 -> 16
        (1000, 32, 0.125, 4),    # 125 / 32 = 3.9 -> 4
        (100, 32, 0.125, 1),     # 12.5 / 32 -> 1
        (320, 32, 0.1, 1),       # exactly 1 despite float noise in 0.1 * 320
        (330, 32, 0.1, 2),       # 33 / 32 -> 2
        (100, 32, 1.0, 4),       # every chunk incl. the partial one
        (5, 32, 0.01, 1),        # at least one chunk
        (96, 32, 0.5, 2),        # 48 / 32 = 1.5 -> 2
    ],
)
def test_budget_rounding(L, chunk, budget, k):
    assert num_summary_chunks(L, chunk, budget) == k
    ids = torch.randint(0, 30, (L,), generator=torch.Generator().manual_seed(L))
    tab = corpus_idf(torch.cat([ids, torch.arange(30)]), [(0, L), (L, L + 30)])
    sel = select_summary(ids, tab, chunk_size=chunk, budget=budget, scorer="max_idf")
    chunks = torch.unique(sel // chunk)
    assert chunks.numel() == k
    # chunk boundaries respected: each chosen chunk is taken whole
    expect = torch.cat([torch.arange(c * chunk, min((c + 1) * chunk, L)) for c in chunks.tolist()])
    assert torch.equal(sel, expect)


def test_partial_last_chunk_is_scored_on_its_own_tokens():
    # chunk_size 4, 10 tokens: chunks [0:4] [4:8] [8:10]; the rare token 8 sits in the partial chunk.
    blk = T([1, 2, 1, 2, 2, 1, 2, 1, 1, 8])
    tab = corpus_idf(torch.cat([blk, T([1, 2])]), [(0, 10), (10, 12)])
    assert chunk_scores(blk, tab, chunk_size=4, scorer="max_idf").tolist() == pytest.approx([0, 0, math.log(2)])
    assert select_summary(blk, tab, chunk_size=4, budget=0.1).tolist() == [8, 9]
    tf = chunk_scores(blk, tab, chunk_size=4, scorer="tfidf")
    assert tf[2].item() == pytest.approx(math.log(2) / 2)  # divided by |C| = 2, not 4


def test_output_in_positional_order_and_ties_earlier_wins():
    # chunk_size 2; block 0's chunks pair one probe token with the common token 20 (df = 4 of 4 blocks).
    # df: 10 -> 1 (IDF log 4), 11 and 12 -> 3 (log 4/3, a tie), 13 -> 2 (log 2).
    d0 = [10, 20, 11, 20, 12, 20, 13, 20, 20, 20]
    docs = [d0, [11, 12, 13, 20], [11, 12, 20], [20]]
    bounds, s = [], 0
    for d in docs:
        bounds.append((s, s + len(d)))
        s += len(d)
    tab = corpus_idf(T(sum(docs, [])), bounds)
    ln = math.log
    sc = chunk_scores(T(d0), tab, chunk_size=2, scorer="max_idf")
    assert sc.tolist() == pytest.approx([ln(4), ln(4 / 3), ln(4 / 3), ln(2), 0.0])
    # k = 3 (0.6 * 10 / 2): chunks 0, 3 and the earlier of the tied chunks 1/2 -> chunk 1
    assert select_summary(T(d0), tab, chunk_size=2, budget=0.6).tolist() == [0, 1, 2, 3, 6, 7]
    # swap chunks 0 and 3: now the best chunk is second; output is positional, not by score
    d0b = [13, 20, 11, 20, 12, 20, 10, 20, 20, 20]
    assert chunk_scores(T(d0b), tab, chunk_size=2).tolist() == pytest.approx([ln(2), ln(4 / 3), ln(4 / 3), ln(4), 0.0])
    assert select_summary(T(d0b), tab, chunk_size=2, budget=0.4).tolist() == [0, 1, 6, 7]
    # a tie at the cut: k = 1 among [1, 1] -> the earlier chunk
    assert select_summary(T([11, 20, 12, 20]), tab, chunk_size=2, budget=0.5).tolist() == [0, 1]


def test_deterministic():
    ids = torch.randint(0, 200, (3000,), generator=torch.Generator().manual_seed(3))
    for scorer in SCORERS:
        a = plan_pulsar(ids, 700, chunk_size=16, scorer=scorer)
        b = plan_pulsar(ids.clone(), 700, chunk_size=16, scorer=scorer)
        for x, y in zip(a.blocks, b.blocks):
            assert torch.equal(x.input_indices, y.input_indices)


# -------------------------------------------------------------------------------------------------- prefix
def test_prefix_dedups_sink_and_sigma0():
    bounds = [(0, 8), (8, 16), (16, 24)]
    # summaries are global: Sigma_0 chunk [2,3] overlaps sink [0,1,2]; Sigma_1 = local [4,5] = global [12,13]
    sums = [T([2, 3]), T([12, 13]), T([16, 17])]
    assert pulsar_prefix(24, bounds, 0, sums, sink_size=3).tolist() == []
    assert pulsar_prefix(24, bounds, 1, sums, sink_size=3).tolist() == [0, 1, 2, 3]
    assert pulsar_prefix(24, bounds, 2, sums, sink_size=3).tolist() == [0, 1, 2, 3, 12, 13]
    assert pulsar_prefix(24, bounds, 2, sums[:2]).tolist() == list(range(8)) + [12, 13]  # default sink 64 -> B_0
    # sink_size 0: summaries only; sink larger than B_0 is clipped to B_0
    assert pulsar_prefix(24, bounds, 2, sums, sink_size=0).tolist() == [2, 3, 12, 13]
    assert pulsar_prefix(24, bounds, 2, sums, sink_size=100).tolist() == list(range(8)) + [12, 13]
    assert sink_indices(8, 100).tolist() == list(range(8))


@pytest.mark.parametrize("scorer", SCORERS)
@pytest.mark.parametrize("bounds,chunk,sink", [(37, 5, 64), ([(0, 50), (50, 53), (53, 120), (120, 131)], 32, 7),
                                               (16, 32, 0), ([(0, 1), (1, 90), (90, 131)], 3, 64)])
def test_budget_one_gives_full_prefix(scorer, bounds, chunk, sink):
    ids = torch.randint(0, 40, (131,), generator=torch.Generator().manual_seed(1))
    plan = plan_pulsar(ids, bounds, chunk_size=chunk, budget=1.0, scorer=scorer, sink_size=sink)
    for blk in plan.blocks:
        assert torch.equal(blk.prefix, torch.arange(blk.start))
        assert torch.equal(blk.input_indices, torch.arange(blk.end))
        assert torch.equal(blk.input_positions, torch.arange(blk.end))  # sparse == dense positions
    assert plan.query_start == 131


# ----------------------------------------------------------------------------------------------- positions
def test_sparse_vs_contiguous_worked_example():
    # The module docstring's example: 12 tokens, 3 blocks of 4, chunk 2, budget 0.5, sink 2.
    ids = T([5, 6, 7, 8, 5, 9, 7, 8, 5, 6, 7, 3])
    sp = plan_pulsar(ids, 4, chunk_size=2, budget=0.5, sink_size=2, position_mode="sparse")
    ct = plan_pulsar(ids, 4, chunk_size=2, budget=0.5, sink_size=2, position_mode="contiguous")
    assert [s.tolist() for s in sp.summaries] == [[0, 1], [4, 5], [10, 11]]  # global indices
    assert [b.prefix.tolist() for b in sp.blocks] == [[], [0, 1], [0, 1, 4, 5]]
    assert [b.prefix.tolist() for b in ct.blocks] == [[], [0, 1], [0, 1, 4, 5]]  # same tokens
    assert sp.blocks[2].input_indices.tolist() == [0, 1, 4, 5, 8, 9, 10, 11]
    assert sp.blocks[2].input_positions.tolist() == [0, 1, 4, 5, 8, 9, 10, 11]
    assert ct.blocks[2].input_positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert ct.blocks[1].input_positions.tolist() == [0, 1, 2, 3, 4, 5]
    assert sp.blocks[1].input_positions.tolist() == [0, 1, 4, 5, 6, 7]
    assert [b.assembled_len for b in ct.blocks] == [4, 6, 8]
    assert sp.query_start == 12 and ct.query_start == 8
    # block 0 is encoded alone at positions 0..3 in both modes
    assert sp.blocks[0].input_positions.tolist() == ct.blocks[0].input_positions.tolist() == [0, 1, 2, 3]


def test_prefix_positions_and_query_start():
    pp, bp = prefix_positions(T([0, 1, 4, 5]), 8, 4, mode="sparse")
    assert pp.tolist() == [0, 1, 4, 5] and bp.tolist() == [8, 9, 10, 11]
    pp, bp = prefix_positions(T([0, 1, 4, 5]), 8, 4, mode="contiguous")
    assert pp.tolist() == [0, 1, 2, 3] and bp.tolist() == [4, 5, 6, 7]
    pp, bp = prefix_positions(T([]), 0, 3, mode="contiguous")
    assert pp.tolist() == [] and bp.tolist() == [0, 1, 2]
    assert query_start_position(100, [25, 40, 33], mode="sparse") == 100
    assert query_start_position(100, [25, 40, 33], mode="contiguous") == 40


def test_plan_default_config_block_sizes():
    # Table 9 geometry, scaled down: 4 blocks, budget 0.125 of a 1024-token block = 4 chunks of 32, sink 64.
    ids = torch.randint(0, 5000, (4096,), generator=torch.Generator().manual_seed(2))
    plan = plan_pulsar(ids, 1024)
    assert (plan.chunk_size, plan.budget, plan.scorer, plan.sink_size, plan.position_mode) == (
        32, 0.125, "max_idf", 64, "sparse")
    assert all(s.numel() == 128 for s in plan.summaries)
    for blk in plan.blocks:
        # the kept KV entries (Appendix F) are the last block_len of the assembled input
        assert torch.equal(blk.input_indices[-blk.block_len:], torch.arange(blk.start, blk.end))
        assert torch.all(blk.prefix < blk.start)
    # prefix_i = sink U Sigma_0..i-1, at most 64 + 128 * i tokens
    assert [b.prefix_len <= 64 + 128 * b.index for b in plan.blocks] == [True] * 4
    assert plan.blocks[3].prefix_len >= 128 * 3


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_inputs_name_the_parameter():
    """The Pulsar options are checked once, by the config, naming the field; what only this module can tell (a
    table too small for the ids, a scorer given no table it needs) is its own error."""
    from magnetar.config import PulsarConfig

    for cs in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="chunk_size"):
            PulsarConfig(chunk_size=cs)
    for bud in (0, 0.0, -0.1, 1.5, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="summary_budget"):
            PulsarConfig(summary_budget=bud)
    with pytest.raises(ValueError, match="sink_size"):
        PulsarConfig(sink_size=-1)
    with pytest.raises(ValueError, match="positions"):
        PulsarConfig(positions="relative")
    blk = T([1, 2, 3, 4])
    with pytest.raises(ValueError, match="vocab_size"):
        corpus_idf(blk, 2, vocab_size=3)
    with pytest.raises(ValueError, match="idf"):
        select_summary(blk, None, chunk_size=2, scorer="max_idf")
    with pytest.raises(ValueError, match="idf table"):
        select_summary(T([1, 99]), corpus_idf(blk, 2), chunk_size=2)
