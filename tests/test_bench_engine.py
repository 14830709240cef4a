"""magnetar-bench (benchmarks/bench_engine.py) runs end to end on a tiny random model and prints one parseable JSON
line."""
import json

import pytest

def _bench():
    import magnetar.eval.bench as bench  # benchmarks/bench_engine.py is a shim over it

    return bench


def test_bench_engine_tiny(capsys):
    bench = _bench()
    rc = bench.main(["--tiny", "--methods", "dense,ring,star,pulsar", "--lengths", "96", "--simulate-ranks", "2",
                     "--max-new-tokens", "2", "--query-len", "4", "--warmup", "0", "--repeats", "1",
                     "--sink-size", "4", "--chunk-size", "4"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("| method |") for line in out)
    record = json.loads(out[-1])
    assert record["bench"] == "engine" and record["simulate_ranks"] == 2 and record["cp"] == 2
    rows = {r["method"]: r for r in record["rows"]}
    assert set(rows) == {"dense", "ring", "star", "pulsar"}
    assert "not simulated" in rows["ring"]["skipped"]
    assert rows["dense"]["time_per_flop_norm"] == pytest.approx(1.0)
    assert any(line.startswith("| method | L | P1 crit (s) | speed-up vs |") for line in out)
    assert rows["dense"]["speedup_measured"] == pytest.approx(1.0) == rows["dense"]["speedup_predicted"]
    for m in ("star", "pulsar"):  # speed-ups over dense: the cost model's is the FLOP ratio of the critical ranks
        r = rows[m]
        assert r["speedup_ref"] == "dense"
        assert r["speedup_predicted"] == pytest.approx(rows["dense"]["predicted"]["critical_phase1_flops"]
                                                       / r["predicted"]["critical_phase1_flops"])
        assert r["speedup_measured"] == pytest.approx(rows["dense"]["phase1_critical_path_seconds"]
                                                      / r["phase1_critical_path_seconds"])
        assert r["measured_over_predicted"] == pytest.approx(r["speedup_measured"] / r["speedup_predicted"])
    for m in ("star", "pulsar"):
        r = rows[m]
        assert r["simulated"] and r["ranks"] == 2 and len(r["phase1_seconds"]) == 2
        assert r["phase1_critical_path_seconds"] == pytest.approx(max(r["phase1_seconds"]))
        assert sum(r["context_kv_tokens_per_rank"]) == 96
        assert r["kv_bytes_per_rank"] == r["predicted"]["kv_bytes_per_rank"]  # cost model == engine's KV
        for key in ("ttft_seconds", "decode_ms_per_token", "peak_memory_bytes_per_rank", "seconds_per_pflop"):
            assert r[key] is not None
        assert r["predicted"]["critical_phase1_flops"] > 0
        # every simulated rank holds the whole model (tp 1): the same bytes as dense's one rank
        assert r["weight_bytes_per_rank"] == rows["dense"]["weight_bytes_per_rank"] * 2
    assert record["tp"] == 1 and rows["dense"]["weight_bytes_per_rank"][0] > 0
    # star's block 1 = anchor (48) + block (48); pulsar's = sink (4) + Σ_0 (2 chunks of 4, budget 1/8) + block
    assert rows["star"]["predicted"]["phase1_input_lengths"] == [[48], [96]]
    assert rows["pulsar"]["predicted"]["critical_input_len"] < 96


def test_bench_engine_bad_flags():
    bench = _bench()
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--methods", "nope"])
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--lengths", "x"])
    with pytest.raises(SystemExit):  # TP needs a process per rank
        bench.main(["--tiny", "--simulate-ranks", "2", "--tp-size", "2"])


def test_allow_positions_past_the_trained_length():
    """Both timing benchmarks (magnetar-bench, benchmarks/bench_prefill.py) share this check."""
    from types import SimpleNamespace

    from magnetar.eval.bench import allow_positions

    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=100))
    assert allow_positions(model, 100, "m", "--lengths", False) == "m"  # within: unchanged
    with pytest.raises(SystemExit, match="m was trained on 100 positions; --lengths need 101.*--beyond-trained"):
        allow_positions(model, 101, "m", "--lengths", False)
    assert model.config.max_position_embeddings == 100
    assert allow_positions(model, 101, "m", "--lengths", True) == "m (positions raised 100 -> 101 for timing)"
    assert model.config.max_position_embeddings == 101
