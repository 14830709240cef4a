"""magnetar-bench (benchmarks/bench_engine.py) runs end to end on a tiny random model and prints one parseable JSON
line."""
import json

import pytest

from tests.conftest import spy_json_writes

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
    assert record["bench"] == "engine" and record["simulate_ranks"] == [2] and record["cp"] == [2]
    mem = record["memory"]  # the room check's figures on this device (the next GPU session's log reads them)
    assert mem["kv_bytes_per_token"] > 0 and 0 < mem["weight_bytes"] < mem["weight_bytes"] + mem["room_bytes"]
    assert mem["mlp_activation_bytes_per_token"] > 0
    assert mem["max_context_tokens_one_process"] == \
        mem["room_bytes"] // (mem["kv_bytes_per_token"] + mem["mlp_activation_bytes_per_token"])
    # --dtype auto (the default): the dtype the model was loaded in, named in the header and the record
    assert record["dtype"] == "float32" and any(line.startswith("model tiny-llama-random (float32, --dtype auto)")
                                                for line in out), out[:3]
    rows = {r["method"]: r for r in record["rows"]}
    assert set(rows) == {"dense", "ring", "star", "pulsar"}
    # ring's simulated ranks run one by one against the others' KV: each its own time, its exchange priced
    assert all(t > 0 for t in rows["ring"]["phase1_seconds"]) and record["links_gbps"] == [450.0, 50.0]
    assert rows["ring"]["vs_ring_at"] == {"450": 1.0, "50": 1.0}
    for r in rows.values():
        assert r["phase1_critical_path_at"]["50"] >= r["phase1_critical_path_at"]["450"] >= \
            r["phase1_critical_path_seconds"]
        assert r["predicted_at"]["450"] > 0 and r["calibrated_tflops"] > 0
    assert rows["dense"]["time_per_flop_norm"] == pytest.approx(1.0)
    assert any(line.startswith("| method | L | ranks | P1 crit (s) | speed-up vs |") for line in out)
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


def test_bench_engine_ranks_variants_and_links(capsys):
    """Several simulated CP sizes, a variant beside the methods, and a link so slow that ring's exchange shows."""
    bench = _bench()
    rc = bench.main(["--tiny", "--methods", "dense,ring,star", "--lengths", "64", "--simulate-ranks", "2,4",
                     "--variant", "hybrid=star --exact-layers 0 --anchor-size 4", "--links", "1e-4,450",
                     "--max-new-tokens", "1", "--query-len", "2", "--warmup", "0"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    record = json.loads(out[-1])
    rows = {(r["label"], r["ranks"]): r for r in record["rows"]}
    assert set(rows) == {("dense", 1), ("ring", 2), ("star", 2), ("hybrid", 2), ("ring", 4), ("star", 4),
                         ("hybrid", 4)}  # dense once, on one rank
    assert rows[("hybrid", 4)]["method"] == "star" and "exact layers 0" in rows[("hybrid", 4)]["options"]
    for key in (("ring", 4), ("hybrid", 4)):  # they exchange KV: at 1e-4 GB/s it is the time
        r = rows[key]
        assert r["phase1_critical_path_at"]["0.0001"] > r["phase1_critical_path_at"]["450"] + 0.01
    star = rows[("star", 4)]  # no exchange: every link alike
    assert star["phase1_critical_path_at"]["0.0001"] == star["phase1_critical_path_at"]["450"]
    assert star["vs_ring_at"]["0.0001"] > star["vs_ring_at"]["450"]
    assert any(line.startswith("| method | L | ranks | P1 crit @ 0.0001 GB/s (x ring)") for line in out)
    assert any(line.startswith("| hybrid (sim) | 64 | 4 |") for line in out)


@pytest.mark.parametrize("flags, message", [
    (["--variant", "halo"], "write LABEL=METHOD"),
    (["--variant", "x=nope"], "unknown 'nope'"),
    (["--variant", "x=star --no-such-flag 1"], "unrecognized arguments"),
    (["--variant", "star=star --halo-blocks 1"], "label 'star' is taken"),
    (["--links", "450,0"], "--links: '0' is not a link bandwidth"),
    (["--simulate-ranks", "2,2"], "--simulate-ranks"),
])
def test_bench_engine_flags_name_what_is_wrong(flags, message, capsys):
    bench = _bench()
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--methods", "star", *flags])
    assert message in capsys.readouterr().err


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


def test_the_json_is_rewritten_after_every_row(tmp_path, monkeypatch, capsys):
    # the GPU kit kills a bench step at its limit: the rows measured by then must be in --json-out (the cp_table
    # step's table at 16 ranks comes last, after minutes of 4 and 8)
    bench = _bench()
    out, seen = tmp_path / "b.json", []
    spy_json_writes(monkeypatch, bench, out, seen)
    rc = bench.main(["--tiny", "--methods", "dense,ring,star", "--lengths", "64", "--simulate-ranks", "2,4",
                     "--max-new-tokens", "1", "--query-len", "2", "--warmup", "0", "--json-out", str(out)])
    assert rc == 0
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [len(r["rows"]) for r in seen] == [1, 2, 3, 4, 5, 5]
    assert [r["complete"] for r in seen] == [False] * 5 + [True]
    assert seen[-1] == final
    # a partial record is already normalised as the final one is (speed-ups, the links, ring's ratio)
    part = {(r["method"], r["ranks"]): r for r in seen[2]["rows"]}
    assert set(part) == {("dense", 1), ("ring", 2), ("star", 2)}
    assert part[("star", 2)]["vs_ring_at"]["450"] > 0 and part[("dense", 1)]["speedup_measured"] == pytest.approx(1)
    assert all("_estimate" not in r for rec in seen for r in rec["rows"])
    assert not (tmp_path / "b.json.tmp").exists()


def test_a_configuration_that_does_not_fit_memory_is_said_and_the_run_goes_on(capsys, monkeypatch):
    # the kit's exact-vs-approximate table at 512K meets a dense Phase 1 the card cannot hold: that configuration is
    # said (table, JSON's did_not_fit), the others are measured; anything else still stops the run
    import torch

    from magnetar.engine.memory import ContextTooLarge

    bench = _bench()
    run, relieved = bench._engine_run, []

    def dense_runs_out(engine, ctx, *a, **kw):
        if engine.config.method == "dense" and ctx.numel() > 64:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")
        if engine.config.method == "pulsar" and ctx.numel() > 64:
            raise ContextTooLarge("context: its KV alone needs 70.0 GiB ... cannot fit")
        return run(engine, ctx, *a, **kw)

    monkeypatch.setattr(bench, "_engine_run", dense_runs_out)
    from magnetar.engine.engine import Engine

    monkeypatch.setattr(Engine, "relieve_memory", lambda self: relieved.append(self.config.method) or 0)
    assert bench.main(["--tiny", "--methods", "dense,star,pulsar", "--lengths", "96", "--simulate-ranks", "2",
                       "--max-new-tokens", "1", "--query-len", "2", "--warmup", "1", "--repeats", "1",
                       "--sink-size", "4", "--chunk-size", "4"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    record = json.loads(out[-1])
    assert [r["method"] for r in record["rows"]] == ["star"]
    assert [(r["method"], r["context_len"], r["error"].split(":")[0]) for r in record["did_not_fit"]] == \
        [("dense", 96, "OutOfMemoryError"), ("pulsar", 96, "ContextTooLarge")]
    said = "did not fit memory: dense x1 at 96 tokens (OutOfMemoryError: CUDA out of"
    assert any(line.startswith(said) for line in out), out
    assert relieved == ["dense", "pulsar"]
    monkeypatch.setattr(bench, "_engine_run", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        bench.main(["--tiny", "--methods", "dense", "--lengths", "96", "--max-new-tokens", "1", "--query-len", "2",
                    "--warmup", "0", "--repeats", "1"])
