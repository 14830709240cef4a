"""The analytic cost model (magnetar.eval.cost): hand-computed tiny cases and Pulsar's Table 4/5 numbers."""

import pytest
import torch

from magnetar.config import EngineConfig
from magnetar.eval.cost import attention_pairs, estimate, format_table, paper_phase1_flops_per_layer
from magnetar.models.dims import ModelDims
from tests.conftest import assert_close

# 2 layers, h=8, H_Q=2, H_KV=1, d_h=4 -> E=8, K=4; linear FLOPs/token/layer = 2(8*8 + 2*8*4 + 8*8 + 3*8*16) = 1152
TINY = dict(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
            intermediate_size=16, vocab_size=32)
LIN = 2 * 1152  # per token, both layers
PAIR = 2 * 4 * 8  # per visible pair, both layers: 4 * E FLOPs per layer
KV_TOK = 2 * 2 * 4 * 4  # K and V, 2 layers, K=4, fp32

LLAMA_8B = dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=14336, vocab_size=128256)


def cfg(method, **kw):
    return EngineConfig.create(method=method, **kw)


def test_dims_from_config():
    d = ModelDims.from_config(TINY)
    assert (d.q_dim, d.kv_dim, d.linear_flops_per_token_layer) == (8, 4, 1152)
    d = ModelDims.from_config(dict(TINY, head_dim=None, num_key_value_heads=None))  # defaults: h/H, H_KV = H_Q
    assert (d.head_dim, d.kv_heads) == (4, 2)
    d = ModelDims.from_config(dict(TINY, sliding_window=3, layer_types=["sliding_attention", "full_attention"]))
    assert d.windows == (3, None)


def test_dense_hand_computed():
    e = estimate(TINY, cfg("dense"), 16, query_len=4)
    assert e.phase1_input_lengths == [[16]]
    assert e.phase1_attention_pairs == [2 * 136]  # 16*17/2 per layer
    assert e.phase1_attention_flops == [136 * PAIR]
    assert e.phase1_linear_flops == [16 * LIN]
    assert e.kv_tokens == [16] and e.kv_bytes == [16 * KV_TOK]
    assert e.activation_bytes_per_layer == [16 * (8 + 8 + 8) * 4]
    # query: 4 x 16 context keys + 4*5/2 causal query keys, per layer; 4 tokens of linear; one LM-head row
    assert e.phase2_query_flops == [74 * PAIR + 4 * LIN + 2 * 8 * 32]
    assert e.decode_flops_per_token == [(16 + 5) * PAIR + LIN + 2 * 8 * 32]
    assert e.decode_kv_read_bytes_per_token == [(16 + 5) * KV_TOK]
    assert e.phase2_comm_bytes_per_layer_decode == 0  # one rank, no gather
    nf = estimate(TINY, cfg("dense"), 16, query_len=4, flash=False)
    assert nf.activation_bytes_per_layer == [16 * 24 * 4 + 2 * 16 * 16 * 4]


def test_tensor_parallel_is_per_tp_rank():
    one, two = (estimate(LLAMA_8B, cfg("star", cp_size=2, tp_size=tp), 4096, query_len=8) for tp in (1, 2))
    assert two.kv_bytes == [b // 2 for b in one.kv_bytes]  # 8 KV heads, 4 per TP rank
    assert two.phase1_attention_flops == [f // 2 for f in one.phase1_attention_flops]
    assert two.phase1_linear_flops == [f // 2 for f in one.phase1_linear_flops]
    emb = 128256 * 4096 * 4
    assert two.weight_bytes == (one.weight_bytes - emb) // 2 + emb  # embeddings whole, the rest halved
    assert two.phase2_comm_bytes_per_layer_decode * 2 == one.phase2_comm_bytes_per_layer_decode
    assert any("tp_size 2" in a for a in two.assumptions) and not any("tp_size" in a for a in one.assumptions)


def test_ring_zigzag_hand_computed():
    e = estimate(TINY, cfg("ring", cp_size=2), 16, query_len=4)
    # chunks of 4: rank 0 holds [0,4) + [12,16): (1+2+3+4) + (13+14+15+16) = 68; rank 1 [4,12): 26 + 42 = 68
    assert e.phase1_input_lengths == [[8], [8]]
    assert e.phase1_attention_pairs == [2 * 68, 2 * 68]
    assert sum(e.kv_tokens) == 16
    # one ring step per layer: each rank sends the other's... its own shard once (KV + int64 positions)
    assert e.phase1_comm_bytes_per_layer == [8 * (2 * 4 * 4 + 8)] * 2
    assert e.phase2_comm_bytes_per_layer_decode == 2 * (4 * 4 + 4)  # H_Q (d_h*4 + 4 lse) bytes
    assert e.phase2_comm_bytes_per_layer_query == 4 * 2 * (4 * 4 + 4)
    contiguous = estimate(TINY, cfg("ring", cp_size=2, zigzag=False), 16)
    assert contiguous.phase1_attention_pairs == [2 * 36, 2 * (136 - 36)]
    assert contiguous.critical_rank == 1


def test_star_hand_computed():
    e = estimate(TINY, cfg("star", cp_size=2), 16, query_len=4)
    assert e.phase1_input_lengths == [[8], [16]]  # block 1 = anchor (8) + block (8)
    assert e.phase1_attention_pairs == [2 * 36, 2 * 136]  # the anchor is fully visible to the block
    assert e.phase1_linear_flops == [8 * LIN, 16 * LIN]
    assert e.kv_tokens == [8, 8] and sum(e.kv_tokens) == 16  # anchor KV discarded
    assert e.critical_rank == 1 and e.critical_input_len == 16
    assert e.critical_phase1_flops == max(e.phase1_flops) == 136 * PAIR + 16 * LIN
    # Phase 2: rank 0 holds context 0..7 plus the query; rank 1 only context 8..15
    assert e.phase2_query_flops == [(4 * 8 + 10) * PAIR + 4 * LIN + 512, 4 * 8 * PAIR + 4 * LIN + 512]
    small = estimate(TINY, cfg("star", cp_size=2, anchor_size=2), 16)
    assert small.phase1_input_lengths == [[8], [10]]


def test_pulsar_hand_computed():
    kw = dict(cp_size=2, sink_size=2, chunk_size=2, summary_budget=0.25)  # k = ceil(0.25*8/2) = 1 chunk of 2
    e = estimate(TINY, cfg("pulsar", **kw), 16, query_len=4)
    assert e.phase1_input_lengths == [[8], [12]]  # sink 2 + Σ_0 2 + block 8
    assert e.phase1_attention_pairs == [2 * 36, 2 * 78]
    assert e.kv_tokens == [8, 8]
    assert e.assumptions  # the no-overlap assumption is stated
    # even scorer (Eq. 13): 2 tokens at floor(linspace(0, 7, 2)) = [0, 7]; 0 is in the sink -> prefix [0, 1, 7]
    even = estimate(TINY, cfg("pulsar", scorer="even", **kw), 16)
    assert even.phase1_input_lengths == [[8], [11]]
    # summaries kept: rank 1 keeps prefix + block KV, so the sum exceeds L
    keep = estimate(TINY, cfg("pulsar", discard_summary_kv=False, **kw), 16)
    assert keep.kv_tokens == [8, 12]
    # contiguous positions: the query starts after the longest assembled block (12), not at L
    cont = estimate(TINY, cfg("pulsar", positions="contiguous", **kw), 16)
    assert cont.phase1_attention_pairs == e.phase1_attention_pairs


def test_pulsar_exact_with_ids_matches_engine_plan():
    from magnetar.engine.strategy import plan_rank

    kw = dict(cp_size=4, sink_size=4, chunk_size=4, summary_budget=0.25)
    ids = torch.randint(0, 50, (96,), generator=torch.Generator().manual_seed(0))
    c = cfg("pulsar", **kw)
    exact = estimate(TINY, c, 96, context_ids=ids)
    assert exact.phase1_input_lengths == [[int(s.indices.numel()) for s in plan_rank(c, ids, r).segments]
                                          for r in range(4)]
    bound = estimate(TINY, c, 96)
    for a, b in zip(exact.phase1_input_lengths, bound.phase1_input_lengths):
        assert a[0] <= b[0]  # the analytic prefix is the no-overlap upper bound
    assert bound.phase1_input_lengths == [[24], [24 + 4 + 8], [24 + 4 + 16], [24 + 4 + 24]]


def test_streaming_hand_computed():
    e = estimate(TINY, cfg("streaming", sink_tokens=1, window_size=4), 16, query_len=4)
    # chunks of 4: 10 | 10 + 4*4 | 10 + 4*|{0,4..7}| | 10 + 4*|{0,8..11}|  = 96 pairs per layer
    assert e.phase1_input_lengths == [[4, 4, 4, 4]]
    assert e.phase1_attention_pairs == [2 * 96]
    assert e.kv_tokens == [5]  # the sink and the last window after eviction


def test_sliding_window_layers():
    d = dict(TINY, sliding_window=3, layer_types=["full_attention", "sliding_attention"])
    e = estimate(d, cfg("dense"), 16)
    assert e.phase1_attention_pairs == [136 + (1 + 2 + 3 * 14)]
    assert attention_pairs(torch.tensor([5]), torch.arange(16), window=3) == 3


def test_critical_path_is_max_and_kv_partitions_context():
    for method, kw in [("ring", {}), ("star", {}), ("pulsar", {}), ("star", dict(block_size=100)),
                       ("pulsar", dict(block_size=100)), ("ring", dict(zigzag=False))]:
        e = estimate(TINY, cfg(method, cp_size=3, **kw), 1000, query_len=7)
        assert e.critical_phase1_flops == max(e.phase1_flops)
        assert e.critical_rank == e.phase1_flops.index(max(e.phase1_flops))
        assert e.critical_input_len == max(max(x) for x in e.phase1_input_lengths)
        assert sum(e.kv_tokens) == 1000
        assert e.max_kv_bytes == max(e.kv_bytes)
        assert e.critical_decode_kv_read_bytes == max(e.decode_kv_read_bytes_per_token)
        assert e.to_dict()["method"] == method


def test_bad_input():
    with pytest.raises(ValueError, match="context_len"):
        estimate(TINY, cfg("dense"), 0)
    with pytest.raises(ValueError, match="query_len"):
        estimate(TINY, cfg("dense"), 16, query_len=0)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        estimate(dict(TINY, num_hidden_layers=0), cfg("dense"), 16)
    with pytest.raises(ValueError, match="hidden_size"):
        estimate({k: v for k, v in TINY.items() if k != "hidden_size"}, cfg("dense"), 16)
    with pytest.raises(ValueError, match="multiple"):
        estimate(dict(TINY, num_key_value_heads=3), cfg("dense"), 16)
    with pytest.raises(ValueError, match="cp_size"):
        estimate(TINY, cfg("star", cp_size=4), 3)
    with pytest.raises(TypeError):
        estimate(TINY, {"method": "dense"}, 16)
    with pytest.raises(ValueError, match="context_ids"):
        estimate(TINY, cfg("pulsar", cp_size=2), 16, context_ids=torch.zeros(8, dtype=torch.long))


# ------------------------------------------------------------------------------ Pulsar Table 4 / Table 5
TABLE4 = {  # L: (n_star, n_pulsar, paper GFLOPs/layer dense, star, pulsar)
    16384: (8192, 5696, 2749, 687, 332),
    32768: (16384, 9792, 10995, 2749, 982),
    65536: (32768, 17984, 43981, 10995, 3312),
}


def _paper_setting(method, L):
    # Llama-3.1-8B fp16, B = 4 blocks (one per GPU), sink k = 64, summaries s = 512 tokens per block
    kw = dict(method=method, cp_size=1 if method == "dense" else 4, dtype="float16")
    if method == "pulsar":
        kw.update(sink_size=64, chunk_size=32, summary_budget=512 / (L // 4))
    return estimate(LLAMA_8B, EngineConfig.create(**kw), L)


@pytest.mark.parametrize("L", sorted(TABLE4))
def test_pulsar_table4(L):
    n_star, n_pulsar, f_dense, f_star, f_pulsar = TABLE4[L]
    dense, star, pulsar = (_paper_setting(m, L) for m in ("dense", "star", "pulsar"))
    assert (dense.critical_input_len, star.critical_input_len, pulsar.critical_input_len) == (L, n_star, n_pulsar)
    assert pulsar.critical_input_len == L // 4 + 64 + 3 * 512  # Eq. 4
    for e, f in ((dense, f_dense), (star, f_star), (pulsar, f_pulsar)):
        assert abs(e.paper_flops_per_layer / 1e9 - f) < 1  # F = 2 n^2 (H_Q + H_KV) d_h (paper: 43,980.5 -> 43,981)
        assert e.critical_activation_bytes_per_layer == e.critical_input_len * 20480  # 20 KiB/token (fp16)
    # the paper prints Dense/Star activations in MiB (320 MB at 16K) and Pulsar's in decimal MB (117 MB at 16K)
    assert dense.critical_activation_bytes_per_layer == 320 * 2**20 * (L // 16384)
    assert round(pulsar.critical_activation_bytes_per_layer / 1e6) == {16384: 117, 32768: 201, 65536: 368}[L]
    # Eq. 5: 128 KiB of KV per token; L/B per GPU after the discard (2.15 GB vs 8.59 GB at 64K)
    assert star.max_kv_bytes == pulsar.max_kv_bytes == L // 4 * 128 * 1024 == dense.max_kv_bytes // 4
    # Eq. 6 and Table 4's "reduction vs Star": exact causal attention FLOPs give the n^2 ratio within 0.1%
    eq6 = (2 * L / (L + 6400)) ** 2
    ratio = star.critical_attention_flops / pulsar.critical_attention_flops
    assert_close(ratio, eq6, what="paper_formula", msg="Eq. 6")
    assert round(f_star / f_pulsar, 1) == round(eq6, 1) == {16384: 2.1, 32768: 2.8, 65536: 3.3}[L]
    assert_close(dense.critical_attention_flops / star.critical_attention_flops, 4.0, what="paper_formula",
                 msg="dense / star")
    # Table 5: est. r_Pulsar = r_Star * n_Star^2 / n_Pulsar^2 with Star's 1.1 / 1.2 / 1.8x
    r_star = {16384: 1.1, 32768: 1.2, 65536: 1.8}[L]
    assert round(r_star * ratio, 1) == {16384: 2.3, 32768: 3.4, 65536: 6.0}[L]
    # ... but counting the linear layers too, Pulsar's Phase-1 advantage over Star is smaller
    assert star.critical_phase1_flops / pulsar.critical_phase1_flops < ratio


def test_paper_flops_formula_and_table():
    assert paper_phase1_flops_per_layer(16384, 32, 8, 128) == 2 * 16384**2 * 5120
    ests = [_paper_setting(m, 16384) for m in ("dense", "star", "pulsar")]
    table = format_table(ests)
    assert table.count("\n") == 4 and "| pulsar | 16384 | 4 | 5696 |" in table


def test_cli_any_config_json(tmp_path, capsys):
    import json

    from magnetar.eval.cost import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(LLAMA_8B, model_type="llama", max_position_embeddings=131072)))
    assert main(["--model", str(path), "--methods", "dense,star,pulsar", "--lengths", "16k,1m", "--cp", "4",
                 "--chunk-size", "32", "--summary-budget", "0.125"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert "| star | 16384 | 4 | 8192 |" in "\n".join(out)  # anchor 4096 + block 4096
    record = json.loads(out[-1])
    ests = {(e["method"], e["context_len"]): e for e in record["estimates"]}
    assert set(ests) == {(m, L) for m in ("dense", "star", "pulsar") for L in (16384, 1 << 20)}
    # the same numbers as the library call
    direct = estimate(LLAMA_8B, cfg("pulsar", cp_size=4, chunk_size=32, summary_budget=0.125, dtype="bfloat16"),
                      1 << 20, 32)
    assert ests[("pulsar", 1 << 20)]["critical_phase1_flops"] == direct.critical_phase1_flops
    assert ests[("dense", 1 << 20)]["phase1_input_lengths"] == [[1 << 20]]


def test_priced_seconds_overlap_ring_traffic_with_compute(tmp_path, capsys):
    # issue 48, item 4's cost-model column: a layer that exchanges KV costs max(compute, transfer)
    import json

    from magnetar.eval.cost import main, priced_seconds

    L, layers = 131072, LLAMA_8B["num_hidden_layers"]
    dense = estimate(LLAMA_8B, cfg("dense", dtype="bfloat16"), L)
    assert priced_seconds(dense, 100, 1e-9) == pytest.approx([dense.phase1_flops[0] / 100e12])  # no traffic
    ring = estimate(LLAMA_8B, cfg("ring", cp_size=16, dtype="bfloat16"), L)
    fast, slow = priced_seconds(ring, 350, 1e6), priced_seconds(ring, 350, 1.0)
    assert fast == pytest.approx([f / 350e12 for f in ring.phase1_flops])  # compute-bound
    assert slow == pytest.approx([layers * b / 1e9 for b in ring.phase1_comm_bytes_per_layer])  # link-bound
    star = estimate(LLAMA_8B, cfg("star", cp_size=16, dtype="bfloat16"), L)
    assert priced_seconds(star, 350, 1.0) == priced_seconds(star, 350, 1e6)  # no Phase-1 traffic
    with pytest.raises(ValueError, match="must be > 0"):
        priced_seconds(ring, 0, 50)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(LLAMA_8B, model_type="llama", max_position_embeddings=131072)))
    assert main(["--model", str(path), "--methods", "dense,ring", "--lengths", "16k", "--cp", "4", "--tflops", "100",
                 "--links", "450,0.01"]) == 0
    assert "crit. P1 s @ 450 GB/s (vs dense) | crit. P1 s @ 0.01 GB/s (vs dense)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--model", str(path), "--tflops", "100", "--links", "fast"])


def test_cli_bad_input():
    from magnetar.eval.cost import main

    with pytest.raises(SystemExit, match="neither a registered model"):
        main(["--model", "/nonexistent/llama", "--lengths", "4k"])
    with pytest.raises(SystemExit):
        main(["--methods", "nope"])
    with pytest.raises(SystemExit):
        main(["--lengths", "four"])
