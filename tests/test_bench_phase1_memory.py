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
