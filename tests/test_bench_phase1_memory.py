"""benchmarks/bench_phase1_memory.py: one Phase 1's peak beside the room check's bound, the bound being the engine's
own figures for the model (KV of every context token and one forward's MLP activations, for dense)."""
from __future__ import annotations

import pytest

from tests.conftest import load_benchmark
from tests.tiny_models import save_tiny


def test_a_child_measures_one_phase1_beside_the_engines_bound(tmp_path):
    bench = load_benchmark("bench_phase1_memory")
    model = save_tiny(tmp_path, "llama")
    c = model.config
    n = 96
    row = bench.child(str(tmp_path), "dense", 1, "float32", n, 1)
    kv = c.num_hidden_layers * 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    act = (2 * c.hidden_size + 2 * c.intermediate_size) * 4
    assert row["bound_kv_bytes"] == n * kv and row["bound_activation_bytes"] == n * act
    assert row["bound_bytes"] == n * (kv + act) and row["measured_bytes"] >= 0
    assert (row["method"], row["cp_size"], row["dtype"], row["tokens"], row["device"]) == ("dense", 1, "float32", n,
                                                                                           "cpu")


def test_a_malformed_config_is_named(monkeypatch, capsys):
    bench = load_benchmark("bench_phase1_memory")
    monkeypatch.setattr("sys.argv", ["bench_phase1_memory.py", "--configs", "dense:one:float32"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--configs takes method:cp_size:dtype items" in capsys.readouterr().err


def test_a_child_encodes_in_chunks_as_the_server_does(tmp_path):
    bench = load_benchmark("bench_phase1_memory")
    save_tiny(tmp_path, "llama")
    row = bench.child(str(tmp_path), "dense", 1, "float32", 96, 1, chunk=40)
    assert row["chunk"] == 40 and row["seconds"] > 0 and row["measured_bytes"] >= 0


def test_a_negative_chunk_is_named(monkeypatch, capsys):
    bench = load_benchmark("bench_phase1_memory")
    monkeypatch.setattr("sys.argv", ["bench_phase1_memory.py", "--chunk", "-1"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--chunk takes a number of tokens >= 0" in capsys.readouterr().err
