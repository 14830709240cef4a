"""benchmarks/bench_conversations.py on a tiny model: its JSON line, and with ``--context-store`` the disk tier's
figures and a restarted engine's answer loaded from it, equal to the first engine's."""
from __future__ import annotations

import json

import pytest

from tests.conftest import load_benchmark
from tests.tiny_models import save_tiny


def test_the_store_figures_and_a_restarted_engines_answer(tmp_path, capsys):
    bench = load_benchmark("bench_conversations")
    save_tiny(tmp_path / "model", "llama")
    store = tmp_path / "store"
    assert bench.main(["--model", str(tmp_path / "model"), "--method", "dense", "--ranks", "1", "--context", "120",
                       "--conversations", "2", "--turns", "3", "--turn-tokens", "10", "--context-store",
                       str(store)]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["encoded_all"] == 120 + 2 * 3 * 10 and row["stored_contexts"] == 1 + 2 * 3
    files = [f for f in store.rglob("*") if f.is_file()]
    assert row["store_disk_bytes"] == sum(f.stat().st_size for f in files)
    # the document whole, each turn its 10 tokens: the disk holds about what the last contexts' KV would alone
    assert row["store_counted_bytes"] < 0.5 * row["alone_bytes"]
    assert row["restart_loaded"] and row["restart_same"]


def test_a_used_store_folder_is_refused(tmp_path, capsys):
    bench = load_benchmark("bench_conversations")
    (tmp_path / "old.json").write_text("{}")
    with pytest.raises(SystemExit):
        bench.main(["--context-store", str(tmp_path)])
    assert f"--context-store {tmp_path}: give a folder that is empty or does not exist" in capsys.readouterr().err
