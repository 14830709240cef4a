"""``magnetar store DIR``: a context store folder described from its manifests -- the contexts, their chains, the
bytes -- and every file a store would refuse, named."""
from __future__ import annotations

import json

import pytest
import torch

import magnetar
from magnetar.launch.store import main
from tests.tiny_models import save_tiny

CTX = torch.arange(10, 210)


def _conversation(model_dir, store, turns: int = 3):
    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60, context_store=str(store))
    ctx = CTX
    for t in range(turns + 1):
        if t:
            ctx = torch.cat((ctx, (torch.arange(40) * 7 + t) % 250 + 3))
        engine.encode(ctx)
    engine.flush_store()
    return engine


def test_a_store_is_described_and_its_bad_files_named(tmp_path, capsys):
    model_dir, store = tmp_path / "model", tmp_path / "store"
    save_tiny(model_dir, "llama")
    engine = _conversation(model_dir, store)
    capsys.readouterr()
    assert main([str(store), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    (g,) = found["groups"]
    assert (g["contexts"], g["whole"], g["continuing"], g["longest_chain"], g["largest_tokens"]) == (4, 1, 3, 4, 320)
    assert g["counted_bytes"] == engine.cache_stats()["store"]["bytes"] and not found["problems"]
    assert g["by_replica"] == {"0": 4}  # one replica wrote them all
    files = sorted(p for p in store.rglob("*") if p.is_file())
    assert found["disk_bytes"] == g["disk_bytes"] == sum(p.stat().st_size for p in files)
    assert main([str(store)]) == 0
    out = capsys.readouterr().out
    assert "| folder | weights | format | contexts |" in out and "| 4 | 1 / 3 | 4 | 320 tokens |" in out
    assert out.count(" MiB | 0: 4 |") == 1
    # what a store would refuse: each named by file
    folder = store / g["folder"]
    root = engine.cache_key(CTX)
    data = folder / f"{root}.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 0xFF  # corrupt, same size: only --verify reads it
    data.write_bytes(bytes(raw))
    (folder / "0123.safetensors").write_bytes(b"x")  # no manifest
    turn = engine.cache_key(torch.cat((CTX, (torch.arange(40) * 7 + 1) % 250 + 3)))
    (folder / f"{turn}.json").unlink()  # the first turn's manifest gone: its data alone, the next turn orphaned
    assert main([str(store), "--json"]) == 0
    problems = "\n".join(json.loads(capsys.readouterr().out)["problems"])
    assert "0123.safetensors: no manifest" in problems and f"{turn}.safetensors: no manifest" in problems
    assert f"continues {turn}, which is not stored" in problems and "checksum" not in problems
    assert main([str(store), "--verify", "--json"]) == 0
    assert f"{root}.safetensors: its checksum differs" in "\n".join(json.loads(capsys.readouterr().out)["problems"])


def test_a_missing_folder_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nowhere")])
    assert f"magnetar store: error: {tmp_path / 'nowhere'}: not a folder" in capsys.readouterr().err
