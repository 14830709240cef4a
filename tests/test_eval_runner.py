"""The evaluation runner (resume, records) and the report (table, intervals, plots)."""
from __future__ import annotations

import json

import pytest

from magnetar.eval.report import mean_ci, table, write_report
from magnetar.eval.runner import load_done, main, parse_length


def test_parse_length_and_load_done(tmp_path):
    assert parse_length("4k") == 4096 and parse_length("1.5k") == 1536 and parse_length("3000") == 3000
    p = tmp_path / "results.jsonl"
    p.write_text('{"key": "a"}\n{"key": "b"}\n{"key": "c", "trunc')  # an interrupted last write
    assert load_done(p) == {"a", "b"}


def test_report_table_intervals_and_plots(tmp_path):
    rows = []
    for method, p_right in (("dense", 1.0), ("star", 0.5)):
        for i in range(4):
            for task in ("niah_single_1", "qa_1"):
                rows.append({"suite": "ruler", "task": task, "method": method, "length": 4096, "index": i,
                             "score": 1.0 if i < 4 * p_right else 0.0})
            rows.append({"suite": "niah", "task": "niah", "method": method, "length": 4096, "index": i,
                         "depth": [0.0, 0.5, 1.0, 0.5][i], "score": 1.0 if i < 4 * p_right else 0.0})
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    md = write_report(tmp_path)
    assert "| niah_single_1 | 100.0 ± 0.0 (n=4) | 50.0 ± 56.6 (n=4) |" in md
    assert "qa_1 (substitute)" in md and "**average** | **100.0** | **50.0**" in md
    for png in ("ruler_accuracy_vs_length.png", "ruler_per_task.png", "niah_heatmap_dense.png"):
        assert (tmp_path / png).stat().st_size > 1000
    m, h, n = mean_ci([1.0, 0.0, 1.0, 0.0])
    assert (m, n) == (50.0, 4) and abs(h - 100 * 1.96 * (1 / 3) ** 0.5 / 2) < 1e-9
    assert table([]) == ""


@pytest.mark.model
def test_runner_end_to_end_and_resume(tmp_path, capsys):
    args = ["--suite", "ruler", "--tasks", "niah_single_2", "--methods", "dense", "--lengths", "512", "--samples",
            "1", "--out", str(tmp_path), "--deepspeed-inference", "false"]
    try:
        assert main(args) == 0
    except RuntimeError as e:
        pytest.skip(f"model unavailable: {e}")
    rec = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rec) == 1 and rec[0]["task"] == "niah_single_2" and rec[0]["score"] in (0.0, 1.0)
    assert rec[0]["context_tokens"] > 400 and rec[0]["prediction"]
    capsys.readouterr()
    assert main(args) == 0  # resumes: nothing left to run
    assert "0 items to run (1 already in" in capsys.readouterr().out
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 1
    assert (tmp_path / "report.md").exists()
