"""benchmarks/bench_conversations.py on a tiny model: its JSON line, with ``--host-cache-mb`` the host tier's figures,
with ``--shed`` every conversation back from host memory, and with ``--context-store`` the disk tier's and a
restarted engine's answers loaded from it, equal to the first engine's -- the conversations sharing their document
again."""
from __future__ import annotations

import json

import pytest

from tests.conftest import load_benchmark
from tests.tiny_models import save_tiny


def test_the_tiers_figures_and_a_restarted_engines_answer(tmp_path, capsys):
    bench = load_benchmark("bench_conversations")
    save_tiny(tmp_path / "model", "llama")
    store = tmp_path / "store"
    # (the conversations share the document's KV: eight of them are needed to overflow a 1 MiB cache)
    assert bench.main(["--model", str(tmp_path / "model"), "--method", "dense", "--ranks", "1", "--context", "880",
                       "--conversations", "8", "--turns", "3", "--turn-tokens", "40", "--context-store",
                       str(store), "--context-cache-mb", "1", "--host-cache-mb", "8", "--shed"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["encoded_all"] == 880 + 8 * 3 * 40 and row["stored_contexts"] == 1 + 8 * 3
    files = [f for f in store.rglob("*") if f.is_file()]
    assert row["store_disk_bytes"] == sum(f.stat().st_size for f in files)
    # the document once, then each turn's 10 tokens: far less than the contexts' KV each alone
    assert row["store_counted_bytes"] < 0.5 * (row["alone_bytes"] + row["host_alone_bytes"])
    assert row["restart_loaded"] and row["restart_same"]
    # every conversation loaded back -- after the restart, and after the device shed them into host memory -- with its
    # answer, sharing the document again: the KV held far below what the contexts hold each alone
    for part in ("restart", "shed"):
        assert row[f"{part}_all_loaded" if part == "restart" else "shed_loaded"] == 8, part
        assert row[f"{part}_all_same" if part == "restart" else "shed_same"] == 8, part
        assert row[f"{part}_held_bytes"] < 0.5 * row[f"{part}_alone_bytes"], part
    # the 1 MiB cache evicted turns to the host tier, where a conversation's turns share one copy
    assert row["evictions"] > 0 and row["host_kept"] >= 2 and row["host_evictions"] == 0
    assert row["host_counted_bytes"] <= row["host_held_bytes"] < 0.5 * row["host_alone_bytes"]


def test_the_first_conversation_leaving_cuts_the_documents_arena(tmp_path, capsys):
    bench = load_benchmark("bench_conversations")
    save_tiny(tmp_path / "model", "llama")
    assert bench.main(["--model", str(tmp_path / "model"), "--method", "dense", "--ranks", "1", "--context", "200",
                       "--conversations", "3", "--turns", "4", "--turn-tokens", "100", "--release-first"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the document's arena held 600 tokens of the first conversation's turns: cut to the document's 200 and spare
    assert row["release_counted_after"] < row["release_counted_before"] - 0.5 * row["release_counted_before"] / 3
    assert row["release_held_after"] < row["release_held_before"]
    assert row["release_loaded"] == row["release_same"] == 2


def test_shed_without_a_host_tier_is_refused(capsys):
    bench = load_benchmark("bench_conversations")
    with pytest.raises(SystemExit):
        bench.main(["--shed"])
    assert "--shed sheds the device cache into the host tier: give it one with --host-cache-mb N" in \
        capsys.readouterr().err


def test_a_used_store_folder_is_refused(tmp_path, capsys):
    bench = load_benchmark("bench_conversations")
    (tmp_path / "old.json").write_text("{}")
    with pytest.raises(SystemExit):
        bench.main(["--context-store", str(tmp_path)])
    assert f"--context-store {tmp_path}: give a folder that is empty or does not exist" in capsys.readouterr().err
