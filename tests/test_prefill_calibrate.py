"""Sparse prefill tooling: ``magnetar-calibrate indexer`` (streamed, resumable KL distillation of the indexer) and
the gap report's table (``magnetar.eval.experiments.prefill_gap``) on synthetic result rows.

The calibration runs end to end on a tiny random Llama whose q/k projections are scaled x10 (so its attention
has a peaked support worth learning): it writes an indexer file, resumes a run cut after its first layer (the
trained layer untouched, the result identical to an uncut run), gives the same weights with the on-disk teacher
cache, improves the recall of the oracle support on held-out sequences, and the engine loads the file.
"""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import magnetar
from magnetar.calibrate.distill import random_text_ids, support_recall, validation_kl
from magnetar.calibrate.indexer import IndexerTrainConfig, calibrate_indexer, metrics_table, sample_rows
from magnetar.prefill.indexer import IndexerBank
from tests.conftest import assert_close
from tests.tiny_models import peaked_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


CFG = IndexerTrainConfig(d_idx=64, seq_len=128, sequences=6, held_out=2, rows=32, passes=10, lr=1e-2, topk=16,
                         layers_per_pass=2)


def _seqs():
    return random_text_ids(8, 128, 256, seed=0)


def test_calibrate_indexer_writes_trains_resumes_and_loads(tmp_path, monkeypatch):
    import magnetar.calibrate.indexer as train

    model = peaked_tiny_model(num_hidden_layers=3)
    path = tmp_path / "new" / "ix.pt"
    logs = []
    full = calibrate_indexer(model, _seqs(), path, CFG, progress=False, log=logs.append)
    assert full.trained_layers == [0, 1, 2] and not full.untrained
    m = full.meta
    for layer in (0, 1, 2):
        assert m["kl_after"][layer] < m["kl_before"][layer] - 0.05, (layer, m["kl_before"], m["kl_after"])
    assert sum(m["recall_after"].values()) > sum(m["recall_before"].values()) + 0.15, (m["recall_before"],
                                                                                        m["recall_after"])
    # the stored metrics are the ones the held-out data gives (fresh collection, fresh init for "before")
    from magnetar.calibrate.distill import collect_teacher

    seqs = _seqs()
    held = collect_teacher(model, seqs[6:], [1], row_index=sample_rows([128] * 8, 32, 0)[6:])
    init = IndexerBank(full.signature, 64, theta=full.theta, seed=0)
    assert support_recall(init[1], held, 1, 16) == pytest.approx(m["recall_before"][1])
    assert_close(validation_kl(full[1], held, 1), m["kl_after"][1], what="recomputed_metric", msg="kl_after")
    back = IndexerBank.load(path, model.config, d_idx=64)
    assert torch.equal(back[2].wq, full[2].wq) and back.meta["recall_after"] == m["recall_after"]

    # a run cut in its second layer: the file holds layer 0 only, and the engine refuses it
    cut = tmp_path / "cut.pt"
    calls = []
    real = train.distill_layer

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(train, "distill_layer", flaky)
    with pytest.raises(KeyboardInterrupt):
        calibrate_indexer(model, _seqs(), cut, CFG, progress=False, log=logs.append)
    monkeypatch.setattr(train, "distill_layer", real)
    part = IndexerBank.load(cut, model.config)
    assert part.trained_layers == [0] and torch.equal(part[0].wq, full[0].wq)
    with pytest.raises(ValueError, match=r"distilled for layers \[0\] but sparse prefill patches layers \[1, 2\]"):
        magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, prefill_policy="indexer",
                                prefill_topk=8, prefill_indexer_path=str(cut))
    seen = []
    monkeypatch.setattr(train, "distill_layer", lambda ix, data, layer, **kw: seen.append(layer) or real(
        ix, data, layer, **kw))
    again = calibrate_indexer(model, _seqs(), cut, CFG, progress=False, log=logs.append)
    assert any("resuming" in x for x in logs) and seen == [1, 2]  # layer 0 was not trained again
    for layer in (0, 1, 2):  # ... and the result is the uncut run's
        assert torch.equal(again[layer].wq, full[layer].wq) and torch.equal(again[layer].wk, full[layer].wk)
    assert again.meta["kl_after"] == pytest.approx(m["kl_after"])

    # other options start over; the on-disk teacher cache gives the same weights as the in-memory streaming
    other = IndexerTrainConfig(**dict(vars(CFG), layers_per_pass=1))
    cached = calibrate_indexer(model, _seqs(), tmp_path / "cached.pt", other, cache_dir=tmp_path / "cache",
                               progress=False, log=logs.append)
    assert len(list((tmp_path / "cache").glob("*/L*-S*.pt"))) == 3 * 8
    for layer in (0, 1, 2):
        assert torch.equal(cached[layer].wq, full[layer].wq)
    logs.clear()
    calibrate_indexer(model, _seqs(), tmp_path / "cached.pt", IndexerTrainConfig(**dict(vars(CFG), passes=1)),
                      cache_dir=tmp_path / "cache", progress=False, log=logs.append)
    assert any("starting over" in x for x in logs)

    # the engine loads the file (signature, d_idx) and runs sparse prefill with it
    eng = magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, prefill_policy="indexer",
                                  prefill_topk=8, prefill_indexer_path=str(path))
    res = eng.generate(torch.arange(40) % 256, torch.arange(5), max_new_tokens=2)
    assert res.prefill_stats["policy"] == "indexer" and res.prefill_stats["sparse_calls"] == 3
    table, means = metrics_table(back)
    assert table.count("\n| ") == 5 and means["recall_after"] > means["recall_before"]


def test_calibrate_indexer_cli_and_errors(tmp_path, monkeypatch, capsys):
    import magnetar.calibrate.cli as cal
    import magnetar.models

    class WordTokenizer:  # one id per word
        def __call__(self, text, add_special_tokens=False):
            import zlib

            return {"input_ids": [zlib.crc32(w.encode()) % 256 for w in text.split()]}

    model = peaked_tiny_model(num_hidden_layers=2)
    monkeypatch.setattr(magnetar.models, "load_model", lambda name, **kw: (model, WordTokenizer()))
    words = [f"w{(i * 7) % 41}" for i in range(1200)]
    monkeypatch.setattr(cal, "corpus_texts", lambda name: [" ".join(words)])
    out = tmp_path / "ix.pt"
    argv = ["indexer", "--out", str(out), "--d-idx", "64", "--seq-len", "96", "--sequences", "4", "--held-out", "2",
            "--rows", "8", "--passes", "2", "--topk", "8", "--dense-layers", "1"]
    assert cal.main(argv) == 0
    text = capsys.readouterr().out
    assert "| layer | val. KL before" in text and "| 1 |" in text and "| 0 |" not in text
    line = json.loads(text.strip().splitlines()[-1])
    assert line["kind"] == "indexer" and line["layers"] == 1 and line["topk"] == 8
    assert all(math.isfinite(line[k]) for k in ("kl_before", "kl_after", "recall_before", "recall_after"))
    bank = IndexerBank.load(out, model.config, d_idx=64)
    assert bank.trained_layers == [1] and bank.meta["train_config"]["dense_layers"] == 1
    # an engine keeping layer 0 dense accepts the file; one patching layer 0 would need it trained
    magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, prefill_policy="indexer",
                            prefill_topk=8, prefill_dense_layers=1, prefill_indexer_path=str(out))
    with pytest.raises(ValueError, match="patches layers \\[0\\]"):
        magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, prefill_policy="indexer",
                                prefill_topk=8, prefill_indexer_path=str(out))
    with pytest.raises(ValueError, match="corpus holds"):
        cal.main(argv[:-2] + ["--sequences", "40"])
    with pytest.raises(ValueError, match="leaves no global attention layer"):
        calibrate_indexer(model, _seqs(), tmp_path / "x.pt", IndexerTrainConfig(d_idx=64, dense_layers=2),
                          progress=False)
    with pytest.raises(ValueError, match="8 sequences given"):
        calibrate_indexer(model, _seqs(), tmp_path / "x.pt", IndexerTrainConfig(d_idx=64, sequences=8),
                          progress=False)
    with pytest.raises(ValueError, match="prefill_d_idx"):
        IndexerTrainConfig(d_idx=100)
    with pytest.raises(ValueError, match="--rows"):
        IndexerTrainConfig(rows=0)
    with pytest.raises(SystemExit):
        cal.main(["indexer", "--out", str(out), "--d-idx", "32"])


# -- the gap report ------------------------------------------------------------------------------------------------
def _fake_rows(args, extra, scores: dict, lengths=(4096,), tasks=("vt", "cwe"), n=5, prefill=True):
    """Result rows as the runner writes them, for each variant in ``scores``: (variant) -> per-item 0/1 list."""
    from magnetar.eval.experiments import prefill_gap as gap
    from magnetar.eval.runner import item_key

    rows = []
    for v, vals in scores.items():
        ck, _ = gap.variant_key(args, v, extra)
        for L in lengths:
            for t_i, task in enumerate(tasks):
                for i in range(n):
                    row = {"key": item_key("ruler", task, "dense", L, i, ck), "suite": "ruler", "task": task,
                           "method": "dense", "length": L, "index": i, "score": vals[t_i * n + i]}
                    if prefill and v.policy != "none":
                        S = L - 100
                        kept = v.topk * S - v.topk * (v.topk - 1) // 2
                        row["prefill"] = {"kept_pairs": kept * (1 if v.b_sel == 1 else 2),
                                          "causal_pairs": S * (S + 1) // 2,
                                          "formula_sparsity": 1 - kept / (S * (S + 1) / 2),
                                          "empty_rows": 3 if v.b_sel > 1 else 0}
                    rows.append(row)
    return rows


def test_gap_report_table_from_result_rows(tmp_path, capsys):
    from magnetar.eval.experiments import prefill_gap as gap
    from magnetar.eval.experiments.prefill_gap import Variant

    model = peaked_tiny_model(num_hidden_layers=2)
    ixp = tmp_path / "ix.pt"
    bank = IndexerBank.random(model.config, 64)
    bank.trained_layers = [0, 1]
    bank.meta = {"train_config": {"d_idx": 64, "topk": 16, "b_sel": 1, "seq_len": 128}, "layers": [0, 1],
                 "kl_before": {0: 1.0, 1: 2.0}, "kl_after": {0: 0.5, 1: 0.7},
                 "recall_before": {0: 0.1, 1: 0.2}, "recall_after": {0: 0.6, 1: 0.8}, "metrics_note": "synthetic"}
    bank.save(ixp)
    out = tmp_path / "runs"
    argv = ["--report", "--suite", "ruler", "--lengths", "4k", "--topk", "128,256", "--samples", "5",
            "--indexer-path", str(ixp), "--out", str(out), "--batch", "2"]
    args, extra = gap.parse_args(argv)
    assert extra == ["--batch", "2"]
    ones = [1.0] * 10
    scores = {Variant("none"): ones,
              Variant("oracle", 128, 1): [0.0] + [1.0] * 9,  # one miss: oracle gap -10 points
              Variant("oracle", 128, 64): [0.0, 0.0, 0.0] + [1.0] * 7,  # realization gap -20
              Variant("indexer", 128, 1): [0.0] * 5 + [1.0] * 5,  # indexer gap -40
              Variant("indexer", 128, 64): [1.0] * 10,  # +30 vs the block-shared oracle
              Variant("oracle", 256, 1): ones}  # k 256: only this row exists
    rows = _fake_rows(args, extra, scores)
    # a run with other engine options in the same directory is not pooled in
    args_other, extra_other = gap.parse_args(argv + ["--prefill-dense-layers", "1"])
    rows += _fake_rows(args_other, extra_other, {Variant("none"): [0.0] * 10})
    out.mkdir()
    (out / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    assert gap.main(argv) == 0
    md = capsys.readouterr().out
    assert (out / "gap.md").read_text().strip() == md.strip()
    lines = {ln.split(" | ")[0].strip("| "): ln for ln in md.splitlines() if ln.startswith("| ")}
    assert "| 100.0 ± 0.0 (n=10) | - |" in lines["dense"]
    assert "90.0 ± 19.6 (n=10)" in lines["oracle per query (k 128, b_sel 1)"]  # sd 0.316 -> 1.96 * 0.1 * 100
    assert lines["indexer block-shared (k 256, b_sel 64)"].count(" - ") == 2  # missing row: '-'
    kept = 128 * 3996 - 128 * 127 // 2
    real = 1 - kept / (3996 * 3997 / 2)
    assert f"{100 * real:.1f} % (formula {100 * real:.1f} %)" in lines["oracle per query (k 128, b_sel 1)"]
    assert f"{100 * (1 - 2 * kept / (3996 * 3997 / 2)):.1f} %" in lines["oracle block-shared (k 128, b_sel 64)"]
    assert "30 empty rows" in lines["oracle block-shared (k 128, b_sel 64)"]
    gaps = [ln for ln in md.splitlines() if ln.startswith("| 128 | 4K |") or ln.startswith("| 256 | 4K |")]
    cells = [c.strip() for c in gaps[0].strip("|").split("|")]
    assert cells[2].startswith("-10.0 ± 19.6 (n=10)") and cells[3].startswith("-20.0 ±")
    assert cells[4].startswith("-40.0 ±") and cells[5].startswith("+30.0 ±")
    cells = [c.strip() for c in gaps[1].strip("|").split("|")]
    assert cells[2].startswith("+0.0 ± 0.0 (n=10)") and cells[3:] == ["-", "-", "-"]
    assert "| validation KL(P ‖ softmax(z)) (nats) | 1.5000 | 0.6000 |" in md
    assert "| recall of the oracle top-16 support (b_sel 1) | 0.150 | 0.700 |" in md

    # items outside --tasks / beyond --samples in the same directory (a dense run of more tasks, larger n) are
    # left out of every row, so all rows average the same item set
    from magnetar.eval.runner import item_key

    ck, _ = gap.variant_key(args, Variant("none"), extra)
    more = [{"key": item_key("ruler", t, "dense", 4096, i, ck), "suite": "ruler", "task": t, "method": "dense",
             "length": 4096, "index": i, "score": 0.0} for t, i in (("vt", 5), ("fwe", 0))]
    with open(out / "results.jsonl", "a") as f:
        f.write("\n".join(json.dumps(r) for r in more) + "\n")
    assert gap.main(argv + ["--tasks", "vt,cwe"]) == 0
    md = capsys.readouterr().out
    assert "| dense | 100.0 ± 0.0 (n=10) | - |" in md and "5 samples per task of vt,cwe" in md
    assert gap.main(argv) == 0
    # without --tasks fwe counts; vt #5 never (beyond --samples)
    assert "| dense | 90.9 ± 17.8 (n=11) |" in capsys.readouterr().out

    # without an indexer file the indexer rows are skipped, with a note
    assert gap.main([a for a in argv if a not in ("--indexer-path", str(ixp))]) == 0
    md = capsys.readouterr().out
    assert "indexer rows skipped: no --indexer-path" in md and "| indexer per query" not in md
    with pytest.raises(SystemExit, match="sets these itself"):
        gap.parse_args(argv + ["--prefill-topk", "9"])
    with pytest.raises(SystemExit, match="unknown flag"):
        gap.parse_args(argv + ["--no-such-flag"])


def test_gap_runs_one_runner_call_per_row(tmp_path, monkeypatch, capsys):
    """Run mode: one magnetar-eval call per row, with the row's flags; the rows the (stand-in) runner writes
    under its own keys are the ones the table finds."""
    import argparse as ap

    import magnetar.eval.runner as runner
    from magnetar.config import EngineConfig
    from magnetar.eval.experiments import prefill_gap as gap

    calls = []

    def fake_main(argv):  # the runner's own key derivation (runner.run), then one row per item
        calls.append(argv)
        a = runner.build_parser().parse_args(argv)
        base = EngineConfig.from_cli(ap.Namespace(**{k: v for k, v in vars(a).items() if k != "method"}))
        cfg = base.replace(method="dense", cp_size=1)
        with open(f"{a.out}/results.jsonl", "a") as f:
            for i in range(a.samples):
                key = runner.item_key(a.suite, "vt", "dense", 2048, i, runner.config_key(cfg))
                f.write(json.dumps({"key": key, "suite": a.suite, "task": "vt", "method": "dense", "length": 2048,
                                    "index": i, "score": float(cfg.prefill.prefill_b_sel == 1)}) + "\n")
        print("a whole report the gap report does not repeat")
        return 0

    monkeypatch.setattr(runner, "main", fake_main)
    (tmp_path / "r").mkdir()
    assert gap.main(["--lengths", "2k", "--topk", "64", "--samples", "3", "--out", str(tmp_path / "r"),
                     "--tasks", "vt", "--indexer-path", str(tmp_path / "missing.pt")]) == 0
    md = capsys.readouterr().out
    assert len(calls) == 3 and all("--tasks" in c for c in calls)  # dense, oracle b_sel 1 and 64
    assert ["--prefill-policy", "oracle", "--prefill-topk", "64", "--prefill-b-sel", "64"] == calls[2][-6:]
    assert "does not exist" in md and "whole report" not in md
    gaps = [ln for ln in md.splitlines() if ln.startswith("| 64 | 2K |")][0]
    assert "| +0.0 ± 0.0 (n=3) | -100.0 ± 0.0 (n=3) | - | - |" in gaps


# -- the TTFT benchmark ----------------------------------------------------------------------------------------------
def test_bench_prefill_tiny(tmp_path, capsys):
    from tests.conftest import load_benchmark

    bench = load_benchmark("bench_prefill")
    argv = ["--tiny", "--lengths", "192", "--topk", "32", "--repeats", "2", "--block", "16", "--query-tokens", "4"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert any(ln.startswith("| context | mode | k | TTFT ms") for ln in out)
    rec = json.loads(out[-1])
    rows = {r["label"]: r for r in rec["rows"]}
    assert list(rows) == ["dense", "oracle per query (b_sel 1)", "oracle block-shared (b_sel 16)",
                          "indexer per query (b_sel 1, untrained stress test)",
                          "indexer block-shared (b_sel 16, untrained stress test)"]
    assert rows["dense"]["speedup_vs_dense"] == 1.0 and rows["dense"]["sparsity"] is None
    for r in rec["rows"]:
        assert len(r["ttft_ms_all"]) == 2 and r["ttft_ms"] >= r["phase1_ms"] > 0
    per_query = rows["oracle per query (b_sel 1)"]
    assert per_query["topk"] == 32 and per_query["sparsity"] == pytest.approx(per_query["formula_sparsity"])
    assert per_query["patched_layers_per_request"] == 4
    prof = {r["label"]: r for r in rec["profile"]}
    assert prof["dense"]["dense_attention_ms_per_layer"] > 0 and prof["dense"]["sparse_attention_ms_per_layer"] == 0
    ix = prof["indexer per query (b_sel 1, untrained stress test)"]
    assert all(ix[f"{s}_ms_per_layer"] > 0 for s in ("projection", "score_topk", "sparse_attention"))
    assert prof["oracle per query (b_sel 1)"]["projection_ms_per_layer"] == 0
    # with an indexer file the rows are not labelled a stress test
    bank = IndexerBank.random(bench.tiny_model().config, 64)
    bank.trained_layers = [0, 1, 2, 3]
    bank.save(tmp_path / "ix.pt")
    assert bench.main(argv[:3] + ["--modes", "indexer", "--no-profile", "--repeats", "1", "--topk", "32",
                                  "--indexer-path", str(tmp_path / "ix.pt")]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["label"] for r in rec["rows"]] == ["indexer per query (b_sel 1)", "indexer block-shared (b_sel 64)"]
    assert rec["profile"] == [] and not rec["rows"][0]["untrained_indexer"]
