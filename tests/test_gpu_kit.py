"""The GPU kit (benchmarks/gpu_check.py, ``make gpu-check``): its dry run on CPU end to end (what ``make gpu-check
DRY=1`` runs), the report's shape check, the parsers of pytest's output, and a step killed at its limit."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import load_benchmark, spy_json_writes
from tests.test_cpu_decode import RUNS

REPO = Path(__file__).resolve().parents[1]


def _kit():
    return load_benchmark("gpu_check")


@pytest.fixture(scope="module")
def dry_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("kit") / "gpu_check.json"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(out.read_text()), out, res.stdout


def test_dry_run_passes_every_step_and_has_the_report_shape(dry_report):
    kit = _kit()
    report, out, stdout = dry_report
    assert kit.check_report(report) == []
    assert report["dry_run"] is True and report["elapsed_s"] < report["budget_s"]
    steps = {s["name"]: s for s in report["steps"]}
    assert [n for n in steps] == ["wheels", "environment", "ops_build", "decode_1K", "serve_512", "kernels_256",
                                  "phase1_1K", "cp_table_512", "sparse_prefill_1K", "quest_1K", "nsight_256",
                                  "pytest_gpu"]
    assert all(s["ok"] and s["error"] is None for s in steps.values()), [s["error"] for s in steps.values()]
    # the decode step, configuration by configuration and shape by shape: dense and Star over 4 simulated ranks,
    # static and graph steps (uncaptured on the CPU, said in the row) ran as asked and chose eager's tokens for every
    # request; each row against the floor of the bandwidth measured in the run
    dec = steps["decode_1K"]["result"]["decode_rows"]
    assert [(r["config"], r["mode"], r["ran"], r["batch"], r["context_tokens"]) for r in dec] == [
        (c, m, m, b, n) for c in ("dense", "star") for b, n in ((1, 1024), (2, 512))
        for m in ("eager", "static", "graph")]
    assert all(not r["captured"] and "nothing is captured on cpu" in r["why"] for r in dec if r["mode"] == "graph")
    assert all(r["same_tokens"] == r["batch"] and r["ms_per_step"] > 0 for r in dec), dec
    assert all(0 < r["floor_ms"] and r["pct_of_floor"] == pytest.approx(100 * r["floor_ms"] / r["ms_per_step"])
               for r in dec), dec
    assert steps["decode_1K"]["result"]["copy_bandwidth_gbps"] > 0
    # a static step of greedy requests reads the device once (tokens and finite flags), whatever the batch; so does an
    # eager one whose batch is read as KV pages (cpu_decode's paged call, where this CPU runs it: magnetar.ops.pages)
    assert [r["host_syncs_per_step"] == 1 for r in dec] == [RUNS, True, True] * 4, dec
    # the kernels step: every backend that accepts a causal square and a decode call, timed beside SDPA
    kern = steps["kernels_256"]["result"]["rows"]
    assert {(r["impl"], r["sq"]) for r in kern} >= {("sdpa", 1), ("sdpa", 256), ("cpu_flash", 256)}
    assert all(r["ms"] > 0 and r["tflops"] > 0 for r in kern)
    # decode rows say the KV's GB/s, and the decode step's paged kernel is among them where it runs (on a card:
    # triton_decode/pages)
    assert all((r["gb_s"] > 0) == (r["sq"] == 1) for r in kern if r["gb_s"] is not None)
    assert all(r["gb_s"] is not None for r in kern if r["sq"] == 1)
    assert (("cpu_decode/pages", 1) in {(r["impl"], r["sq"]) for r in kern}) == RUNS
    order = steps["kernels_256"]["result"]["measured_order"]
    assert "cpu_flash" in order and "sdpa" not in order
    # the Nsight step: no ncu on the CPU machine, the workload (a Phase 1 and eager decode steps, ranges on) ran alone
    ns = steps["nsight_256"]["result"]
    assert ns["ncu"] is None and ns["workload"]["seconds"]["profiled"] > 0
    # on CPU every GPU test is collected and skips with its reason
    py = steps["pytest_gpu"]["result"]
    assert py["tests"] > 50 and py["skipped"] == py["tests"] and py["failed"] == py["errors"] == 0
    assert all("CUDA" in reason for reason in py["skip_reasons"]), py["skip_reasons"]
    # the served step: dummy weights with a byte-level tokenizer made on the spot, one long request and clients
    served = steps["serve_512"]["result"]
    assert served["one"]["tokens"] == 4 and served["one"]["ttft"] > 0 and served["one"]["ms_per_token"] > 0
    assert [c["clients"] for c in served["clients"]] == [2] and served["clients"][0]["tokens"] == 8
    assert "serve_512: served (OpenAI API, graph decode steps)" in stdout
    rows = {r["method"]: r for r in steps["phase1_1K"]["result"]["rows"]}
    assert set(rows) == {"dense", "star", "pulsar"}
    assert len(rows["star"]["phase1_per_rank_s"]) == 4
    assert rows["star"]["phase1_critical_path_s"] == pytest.approx(max(rows["star"]["phase1_per_rank_s"]), abs=1e-3)
    # exact vs approximate CP: every method and variant at 2 and 4 simulated ranks, ring's ranks each timed, each
    # critical path at both links beside ring's and the calibrated cost model's
    table = {(r["method"], r["ranks"]): r for r in steps["cp_table_512"]["result"]["rows"]}
    assert set(table) == {("dense", 1)} | {(m, h) for m in ("ring", "star", "pulsar", "star+halo", "hybrid")
                                           for h in (2, 4)}
    assert all(t > 0 for t in table[("ring", 4)]["phase1_per_rank_s"])
    assert table[("ring", 4)]["vs_ring_at"] == {"450": 1.0, "50": 1.0}
    assert all(set(r["phase1_critical_path_at"]) == {"450", "50"} and r["predicted_at"]["50"] > 0
               for r in table.values())
    assert "cp_table_512: exact vs approximate CP" in stdout and "| hybrid | 4 |" in stdout
    assert steps["sparse_prefill_1K"]["result"]["options"][:2] == ["--prefill-policy", "indexer"]
    env = steps["environment"]["result"]
    assert env["cuda_available"] is False and env["attention_auto_order"][0] == "flash_attn"
    assert [r["op"] for r in env["ops"]["ops"]][0] == "magnetar_merge_states"
    assert "cpu_flash" in env["ops"]["environment"]["attention (auto)"]
    assert "phase1_1K | star | 1K |" in stdout  # the tables printed at the end
    assert "decode_1K: decode steps (float32); the floor" in stdout and "| star x4 | 2 | 512 | static |" in stdout
    # every command's output is kept beside the report; the steps' commands ran as forks of one process that
    # imported the packages once (benchmarks/step_forks.py)
    log = out.with_suffix(".log").read_text()
    assert "magnetar.eval.bench" in log and report["forks"]["ready"] is True
    assert log.count(" (forked)\n===== exit") >= 10, log.count(" (forked)")
    table = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--table", str(out)],
                           capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and "| phase1_1K | dense | 1K |" in table.stdout


def test_check_report_names_what_is_wrong(dry_report):
    kit = _kit()
    report = copy.deepcopy(dry_report[0])
    report["steps"] = [s for s in report["steps"] if not s["name"].startswith("quest")]
    report["steps"][1]["ok"], report["steps"][1]["error"] = False, None
    del report["steps"][2]["timeout_s"]
    step = {s["name"]: s for s in report["steps"]}
    step["phase1_1K"]["result"]["rows"][0].pop("ttft_s")  # phase1_1K's dense row
    step["decode_1K"]["result"]["decode_rows"][0].pop("first_step_s")  # decode_1K's eager batch-1 row
    step["serve_512"]["result"].pop("one")  # serve_512's long request
    problems = kit.check_report(report)
    assert any("no step 'quest'" in p for p in problems)
    assert any("failed without an error" in p for p in problems)
    assert any("has keys" in p for p in problems)
    assert any("lacks 'ttft_s'" in p for p in problems)
    assert any("decode_1K' row eager lacks 'first_step_s'" in p for p in problems)
    assert any("'serve_512' lacks 'one'" in p for p in problems)
    assert kit.check_report(report, complete=False) != [] and not any("no step" in p
                                                                       for p in kit.check_report(report, False))


def test_pytest_output_parsers(tmp_path):
    kit = _kit()
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite name="pytest">'
                   '<testcase classname="tests.test_gpu" name="a"/>'
                   '<testcase classname="tests.test_gpu" name="b"><failure message="AssertionError: x&#10;more"/>'
                   '</testcase><testcase classname="tests.test_gpu" name="c"><skipped message="needs CUDA"/>'
                   '</testcase><testcase classname="t" name="d"><error message="boom"/></testcase>'
                   '</testsuite></testsuites>')
    res = kit._junit(xml)
    assert (res["tests"], res["passed"], res["failed"], res["errors"], res["skipped"]) == (4, 1, 1, 1, 1)
    assert res["failures"][0] == dict(test="tests.test_gpu::b", kind="failure", message="AssertionError: x")
    assert res["skip_reasons"] == {"needs CUDA": 1}
    verbose = ("tests/test_gpu.py::a PASSED [ 10%]\ntests/test_gpu.py::b FAILED [ 20%]\n"
               "tests/test_gpu.py::c SKIPPED (needs CUDA) [ 30%]\nnoise\n")
    res = kit._verbose_counts(verbose)
    assert (res["tests"], res["passed"], res["failed"], res["skipped"], res["partial"]) == (3, 1, 1, 1, True)


def test_a_step_past_its_limit_is_killed_and_the_kit_goes_on(tmp_path):
    kit = _kit()
    k = kit.Kit(tmp_path / "r.json", budget_s=60, dry_run=True, env=dict(__import__("os").environ))
    k.min_step_s = 1
    slow = k.step("slow", 2, lambda t: (lambda rc: (rc[0] == 0, None, rc[2][-80:], ["sleep"]))(
        k.run([sys.executable, "-c", "import time; time.sleep(30)"], t)))
    assert not slow["ok"] and "killed at its time limit" in slow["error"] and slow["seconds"] < 10
    fine = k.step("fine", 5, lambda t: (True, {"x": 1}, None, None))
    assert fine["ok"]
    saved = json.loads((tmp_path / "r.json").read_text())
    assert [s["name"] for s in saved["steps"]] == ["slow", "fine"]
    broken = k.step("raises", 5, lambda t: 1 / 0)  # an exception in a step is its error, not the kit's end
    assert not broken["ok"] and "ZeroDivisionError" in broken["error"]
    k.deadline = 0  # no budget left: the step is recorded as skipped
    late = k.step("late", 5, lambda t: (True, None, None, None))
    assert not late["ok"] and late["error"].startswith("skipped")


def test_a_decode_step_cut_short_keeps_its_rows(tmp_path, monkeypatch):
    # bench_decode rewrites its JSON after every row; killed at the step's limit, the kit reports what it measured
    kit = _kit()
    k = kit.Kit(tmp_path / "r.json", budget_s=60, dry_run=True, env=dict(__import__("os").environ))
    row = dict(config="dense", ranks=1, mode="eager", ran="eager", why=None, batch=1, context_tokens=32768,
               ms_per_step=9.0, ms_per_token=9.0, tokens_per_s=111.1, floor_ms=4.5, pct_of_floor=50.0,
               first_step_s=0.1, host_syncs_per_step=25, vs_eager=1.0, same_tokens=1, simulated=False, captured=False,
               capture_s=None, contexts="own")

    def killed(cmd, timeout):
        out = Path(cmd[cmd.index("--json-out") + 1])
        out.write_text(json.dumps(dict(model="m", dtype="bfloat16", device="d", context_tokens=32768, torch="t",
                                       copy_bandwidth_gbps=4000.0, rows=[row])))
        return 124, "", "(killed at its time limit, 5 s)"

    monkeypatch.setattr(k, "run", killed)
    rec = kit.step_decode(k, kit.FULL)
    assert not rec["ok"] and "killed at its time limit" in rec["error"]
    assert rec["result"]["decode_rows"] == [{key: row[key] for key in row if key != "simulated"}]
    table = kit.tables(k.report)
    assert "decode_32K: decode steps (bfloat16)" in table and "(4000.0 GB/s), cut short" in table
    assert "| dense | 1 | 32K | eager | 9.0 | 111.1 | 4.50 | 50 | 1.00x |" in table
    assert kit.check_report(k.report, complete=False) == []


def test_the_nsight_summary_is_read_range_by_range():
    # the kernels listed under each Magnetar range of ncu's per-NVTX summary (its layout is Nsight Compute's: the
    # reading is best effort, the raw tail is kept beside it)
    kit = _kit()
    text = "\n".join([
        "==PROF== Connected to process 1",
        "  magnetar/generate/magnetar/phase1/magnetar/phase1/block0/magnetar/phase1/layer0",
        "    sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64 (132, 1, 1)x(384, 1, 1)  3",
        "    flash_fwd_kernel (8, 32, 1)x(128, 1, 1)  1",
        "  magnetar/generate/magnetar/phase2/decode/step1",
        "    triton_poi_fused_0 (64, 1, 1)x(128, 1, 1)  2",
    ])
    got = kit.nvtx_kernels(text)
    assert list(got) == ["magnetar/phase1/layer0", "magnetar/phase2/decode/step1"]
    assert any("gemm" in k for k in got["magnetar/phase1/layer0"]) and any("flash" in k for k in
                                                                            got["magnetar/phase1/layer0"])
    assert kit.nvtx_kernels("no ranges here") == {}


def test_the_served_stream_is_set_against_the_engines_step():
    # issue 47's goal: a served single stream within 1.2x the engine's step at the same context (the decode step's
    # dense graph row at batch 1); nothing to say when the decode step measured no such row
    kit = _kit()
    rows = [dict(config="dense", batch=1, mode="graph", context_tokens=32768, ms_per_token=6.0),
            dict(config="star", batch=1, mode="graph", context_tokens=32768, ms_per_token=5.0)]
    report = {"steps": [{"name": "decode_32K", "result": {"decode_rows": rows}}]}
    line = kit.served_against_engine(report, {"context_tokens": 32768}, {"ms_per_token": 6.9})
    assert line.startswith("served stream 6.9 ms/token against the engine's graph step 6.0") and "1.15x" in line
    assert kit.served_against_engine(report, {"context_tokens": 512}, {"ms_per_token": 6.9}) is None
    assert kit.served_against_engine(report, {"context_tokens": 32768}, {"ms_per_token": None}) is None


def test_the_decode_goals_are_read_off_the_rows():
    kit = _kit()

    def row(config, b, n, ms, floor, ranks=1):
        return dict(config=config, ranks=ranks, mode="graph", batch=b, context_tokens=n, ms_per_step=ms,
                    floor_ms=floor, pct_of_floor=100 * floor / ms)

    rows = [row("dense", 1, 32768, 7.0, 5.0), row("dense", 1, 131072, 12.0, 7.0), row("dense", 8, 32768, 40.0, 20.0),
            row("star", 1, 32768, 8.0, 5.0, 4), row("pulsar", 1, 32768, 9.0, 5.0, 4),
            dict(row("dense", 1, 32768, 99.0, 5.0), mode="eager")]
    assert kit.decode_goals(rows) == [
        "met: dense batch 1 at 32K: 1.40x the floor (goal <= 1.5x)",
        "NOT met: dense batch 1 at 128K: 1.71x the floor (goal <= 1.5x)",
        "NOT met: dense batch 8 at 32K: 50 % of the floor's tokens/s (goal >= 60 %)",
        "met: star x4 batch 1 at 32K: 1.14x dense's step (goal <= 1.2x)",
        "NOT met: pulsar x4 batch 1 at 32K: 1.29x dense's step (goal <= 1.2x)"]


def test_the_phase1_goals_are_read_off_the_steps():
    kit = _kit()

    def step(name, rows):
        return dict(name=name, ok=True, result=dict(rows=rows))

    report = {"steps": [
        step("phase1_64K", [dict(method="dense", context_len=65536, phase1_critical_path_s=6.0),
                            dict(method="pulsar", context_len=65536, phase1_critical_path_s=1.4,
                                 speedup_measured=4.3, speedup_predicted=4.6)]),
        step("sparse_prefill_64K", [dict(method="dense", context_len=65536, phase1_critical_path_s=5.0)]),
        step("cp_table_128K", [dict(method="ring", ranks=16, vs_ring_at={"50": 1.0}),
                               dict(method="hybrid", ranks=16, vs_ring_at={"50": 2.5}),
                               dict(method="star", ranks=16, vs_ring_at={"50": 3.1}),
                               dict(method="star", ranks=4, vs_ring_at={"50": 9.0})])]}
    assert kit.phase1_goals(report) == [
        "met: pulsar at 64K: 0.93x its cost model's speed-up (goal >= 0.9x)",
        "NOT met: sparse prefill at 64K: 1.20x faster than dense (goal >= 1.5x)",
        "met: at 16 ranks, star is 3.10x faster than ring at 50 GB/s (goal >= 2x; accuracy: docs/results.md's "
        "Gemma-3 32K table)"]


def test_a_call_can_narrow_the_runs_shapes(tmp_path):
    # a device session with little time left: fewer decode shapes or modes, or the exact-vs-approximate table at
    # another length or rank counts, without editing the kit; bad values name their flag
    import argparse

    kit = _kit()

    def args(**kw):
        base = dict(decode_shapes=None, decode_modes=None, cp_len=None, cp_ranks=None)
        return argparse.Namespace(**{**base, **kw})

    assert kit.override_shape(args()) == {}
    assert kit.override_shape(args(decode_shapes="1@32K,8@32K", decode_modes="graph, static", cp_len="256K",
                                   cp_ranks="8,16,32")) == dict(decode_shapes="1@32K,8@32K",
                                                                decode_modes="graph,static", cp_len=262144,
                                                                cp_ranks="8,16,32")
    # a lease's one call shares its budget out: each named step's limit replaced, phase1's for every length
    limits = kit.override_shape(args(limits="decode=240, phase1=90,cp_table=120.5"))["limits"]
    assert limits == {**kit.FULL["limits"], "decode": 240.0, "cp_table": 120.5,
                      "phase1": (90.0,) * len(kit.FULL["limits"]["phase1"])}
    assert kit.FULL["limits"]["decode"] == 480  # the run's own table is not changed
    # every step takes its limit from the run's shape -- the wheels step, run before the others, too
    k = kit.Kit(tmp_path / "r.json", budget_s=60, dry_run=True, env={})
    k.run = lambda cmd, timeout: (0, "", "")  # every module imports: nothing to install
    shape = {**kit.DRY, "limits": {**kit.DRY["limits"], "wheels": 7.0}}
    assert kit.step_wheels(k, shape, REPO / ".gpu-site", REPO / ".whl")["timeout_s"] == 7.0
    for bad, flag in ((dict(decode_shapes="8@x"), "--decode-shapes"), (dict(decode_modes="fast"), "--decode-modes"),
                      (dict(cp_len="big"), "--cp-len"), (dict(cp_ranks="1,4"), "--cp-ranks"),
                      (dict(limits="decode=0"), "--limits"), (dict(limits="warp=10"), "--limits"),
                      (dict(limits="decode"), "--limits")):
        with pytest.raises(ValueError, match=flag):
            kit.override_shape(args(**bad))


def test_a_step_name_that_names_no_step_is_refused_before_anything_runs(tmp_path, capsys):
    """A typo in --steps or --order ran nothing of a card's call, silently; now it is refused (exit 2), naming it
    and the run's steps, before the wheels step or any other."""
    kit = _kit()
    for flags, bad in ((["--steps", "decode,phase1_128k"], "'phase1_128k'"), (["--order", "cp-table"], "'cp-table'")):
        with pytest.raises(SystemExit) as e:
            kit.main(["--dry-run", "--out", str(tmp_path / "r.json"), *flags])
        err = capsys.readouterr().err
        assert e.value.code == 2 and bad in err and "names no step" in err and "environment, ops_build" in err, err
        assert not (tmp_path / "r.json").exists()


def test_every_package_the_wheels_step_needs_is_a_gpu_wheel():
    # the kit's wheels step checks these modules on the card and installs `.whl/` when one is missing; `make
    # gpu-wheels` must put each there (the H200 run's list lacked the served step's openai, FastAPI, uvicorn and the
    # essays: its serve step would have failed on the card -- found by `make gpu-check-image`)
    import re

    text = (REPO / "Makefile").read_text()
    block = re.search(r"^GPU_WHEELS = (.*?)(?<!\\)\n", text, re.S | re.M)
    assert block is not None, "the Makefile has no GPU_WHEELS"
    pins = {w.split("==")[0].lower() for w in block.group(1).replace("\\\n", " ").split()}
    built = set(re.findall(r"pip wheel .*? ([\w-]+)==[\d.]+ -w \.whl", text))
    assert built == {"deepspeed"}
    missing = [m for m in _kit().NEEDED_MODULES if m not in pins | built]
    assert not missing, f"gpu_check.NEEDED_MODULES not in the Makefile's GPU_WHEELS: {missing}"
    # their own needs come along (--no-deps installs): what the image lacks beside them (KINDS.md's package list)
    for dist, needs in (("fastapi", {"starlette", "opentelemetry-api", "pydantic"}),
                        ("openai", {"jiter", "distro", "sniffio", "httpx2", "httpcore2", "truststore"})):
        assert needs <= pins, f"{dist} needs {sorted(needs - pins)} in GPU_WHEELS"


def test_a_bench_step_cut_short_keeps_its_rows(tmp_path, monkeypatch):
    # magnetar-bench rewrites --json-out after every row: the cp_table step killed at its limit (or a later row
    # failing) still reports -- and tabulates -- the rank counts it measured
    import magnetar.eval.bench as bench

    partial = tmp_path / "partial.json"
    seen = []
    monkeypatch.setattr(bench, "write_json_line", lambda path, record: seen.append(record))
    assert bench.main(["--tiny", "--methods", "dense,ring,star", "--lengths", "64", "--simulate-ranks", "2,4",
                       "--max-new-tokens", "1", "--query-len", "2", "--warmup", "0", "--json-out",
                       str(partial)]) == 0
    cut = next(r for r in seen if len(r["rows"]) == 3)  # dense, ring x2, star x2: killed during the 4 ranks
    assert cut["complete"] is False
    kit = _kit()
    k = kit.Kit(tmp_path / "r.json", budget_s=60, dry_run=True, env=dict(__import__("os").environ))

    def killed(cmd, timeout):
        Path(cmd[cmd.index("--json-out") + 1]).write_text(json.dumps(cut) + "\n")
        return 124, "", "(killed at its time limit, 5 s)"

    monkeypatch.setattr(k, "run", killed)
    rec = kit.step_bench(k, kit.DRY, "cp_table_64", 60, [64], "dense,ring,star", ["--simulate-ranks", "2,4"])
    assert not rec["ok"] and "killed at its time limit" in rec["error"]
    assert rec["result"]["complete"] is False
    assert [(r["method"], r["ranks"]) for r in rec["result"]["rows"]] == [("dense", 1), ("ring", 2), ("star", 2)]
    table = kit.tables(k.report)
    assert "cp_table_64 (cut short: the rows it measured): exact vs approximate CP" in table
    assert "| cp_table_64 (cut short: the rows it measured) | star x2 | 64 |" in table
    assert kit.check_report(k.report, complete=False) == []
    # killed before its first row: nothing to keep, the step failed with the output's tail
    monkeypatch.setattr(k, "run", lambda cmd, timeout: (124, "", "(killed at its time limit, 5 s)"))
    rec = kit.step_bench(k, kit.DRY, "cp_table_64", 60, [64], "dense", [])
    assert not rec["ok"] and rec["result"] is None and "killed" in rec["error"]


def test_a_serve_step_cut_short_keeps_the_single_stream(tmp_path, monkeypatch):
    # killed during the 32-client round: the single stream's TTFT and ms/token and the 8-client round stay
    kit = _kit()
    k = kit.Kit(tmp_path / "r.json", budget_s=60, dry_run=True, env=dict(__import__("os").environ))
    served = dict(context_tokens=32768, one=dict(ttft=2.5, ms_per_token=9.0, tokens=64), client_context_tokens=2048,
                  clients=[dict(clients=8, tokens=512, seconds=4.0, tokens_per_s=128.0, ttft_p50=1.0, ttft_p99=2.0)],
                  server_status=None, complete=False)

    def killed(cmd, timeout):
        Path(cmd[cmd.index("--json-out") + 1]).write_text(json.dumps(dict(device="cuda:0", dtype="bfloat16",
                                                                          served=served)) + "\n")
        return 124, "", "(killed at its time limit, 5 s)"

    monkeypatch.setattr(k, "run", killed)
    rec = kit.step_serve(k, kit.FULL)
    assert not rec["ok"] and "killed at its time limit" in rec["error"]
    assert rec["result"]["one"]["ms_per_token"] == 9.0 and rec["result"]["complete"] is False
    table = kit.tables(k.report)
    assert "serve_32K (cut short: the rows it measured): served" in table
    assert "| one request, 32K document | 2.50 | 9.0 | - |" in table and "| 8 clients, 2K documents each |" in table
    assert kit.check_report(k.report, complete=False) == []


def test_a_kernels_step_cut_short_keeps_the_shapes_timed(tmp_path, monkeypatch, capsys):
    # bench_ops rewrites --json-out after each attention shape: killed during the largest square (last), the kit keeps
    # the smaller shapes' rows and reads the measured order off the largest square it has
    ops = load_benchmark("bench_ops")
    out, seen = tmp_path / "ops.json", []
    spy_json_writes(monkeypatch, ops, out, seen)
    ops.main(["--device", "cpu", "--sq", "1", "64", "--sk", "64", "128", "--heads", "4", "--kv-heads", "2",
              "--head-dim", "16", "--warmup", "0", "--repeats", "1", "--merge-n", "2", "--merge-s", "1",
              "--json-out", str(out)])
    shapes = [sorted({(r["sq"], r["sk"]) for r in rec["attention"]}) for rec in seen]
    assert shapes == [[(1, 64)], [(1, 64), (64, 64)], [(1, 64), (1, 128), (64, 64)],
                      [(1, 64), (1, 128), (64, 64), (64, 128)], [(1, 64), (1, 128), (64, 64), (64, 128)]]
    assert [r["complete"] for r in seen] == [False] * 4 + [True] and seen[-1]["merge"]
    assert seen[-1] == json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    kit = _kit()
    k = kit.Kit(tmp_path / "r.json", budget_s=60, dry_run=True, env=dict(__import__("os").environ))

    def killed(cmd, timeout):
        Path(cmd[cmd.index("--json-out") + 1]).write_text(json.dumps(seen[1]) + "\n")
        return 124, "", "(killed at its time limit, 5 s)"

    monkeypatch.setattr(k, "run", killed)
    rec = kit.step_kernels(k, kit.DRY)
    assert not rec["ok"] and rec["result"]["complete"] is False
    assert {(r["sq"], r["sk"]) for r in rec["result"]["rows"]} == {(1, 64), (64, 64)}
    assert rec["result"]["measured_order"]  # off the 64 square
    assert "kernels_256 (cut short: the rows it measured): attention kernels" in kit.tables(k.report)


def _forks(env=None, preload=()):
    load_benchmark("gpu_check")  # puts benchmarks/ on sys.path
    import step_forks

    return step_forks.Forks(dict(env or __import__("os").environ), REPO, subprocess.DEVNULL, preload=preload)


def test_a_forked_step_runs_as_python_would(tmp_path):
    import os

    (tmp_path / "sibling.py").write_text("WHAT = 'sibling'\n")
    (tmp_path / "script.py").write_text("import os, sys, sibling\nprint(sibling.WHAT, sys.argv[1:], os.getcwd())\n"
                                        "print('to stderr', file=sys.stderr)\nsys.exit(int(os.environ['CODE']))\n")
    cmds = [[sys.executable, str(tmp_path / "script.py"), "a", "b"],
            [sys.executable, "-c", "import sys; print(sys.argv, sys.path[0] == ''); raise SystemExit('said')", "x"],
            [sys.executable, "-m", "json.tool", "--no-such-flag"],
            [sys.executable, "-c", "raise ValueError('boom')"]]
    env = dict(os.environ, CODE="3")
    forks = _forks()
    try:
        assert forks.wait_ready(60), forks.why
        for cmd in cmds:
            fresh = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
            rc, out, err = forks.run(cmd, 60, env)
            assert (rc, out) == (fresh.returncode, fresh.stdout), cmd
            assert err.strip().splitlines()[-1] == fresh.stderr.strip().splitlines()[-1], (err, fresh.stderr)
        assert forks.run(cmds[0], 60, dict(env, CODE="0"))[0] == 0  # each step's own environment
        assert not forks.can_run([sys.executable, "-m", "pip", "install", "x"]) and not forks.can_run(["sleep", "1"])
    finally:
        forks.close()


def test_a_forked_step_past_its_limit_is_killed_and_nothing_outlives_the_kit(tmp_path):
    import os
    import signal
    import time

    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"

    forks = _forks()
    try:
        assert forks.wait_ready(60), forks.why
        t = time.monotonic()
        rc, out, err = forks.run([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); "
                                  "time.sleep(60)"], 2, dict(os.environ))
        assert rc == 124 and "killed at its time limit" in err and time.monotonic() - t < 20
        assert not alive(int(out.split()[0]))
        assert forks.run([sys.executable, "-c", "print('next')"], 60, dict(os.environ))[:2] == (0, "next\n")
    finally:
        forks.close()
    # the kit killed mid-step: its server and the step go with it
    pids = tmp_path / "pids"
    kit = subprocess.Popen([sys.executable, "-c", f"""
import os, sys
sys.path.insert(0, {str(REPO / 'benchmarks')!r})
import step_forks
f = step_forks.Forks(dict(os.environ), {str(REPO)!r}, None, preload=())
assert f.wait_ready(60)
open({str(pids)!r}, 'w').write(str(f._proc.pid))
f.run([sys.executable, '-c', "import os, time; open({str(pids)!r}, 'a').write(' %d' % os.getpid()); time.sleep(60)"],
      120, dict(os.environ))
"""], cwd=REPO)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(pids.read_text().split() if pids.exists() else []) < 2:
        time.sleep(0.1)
    server, step = map(int, pids.read_text().split())
    kit.send_signal(signal.SIGKILL)
    kit.wait(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (alive(server) or alive(step)):
        time.sleep(0.1)
    assert not alive(server) and not alive(step)


def test_a_server_that_may_not_fork_says_why_and_the_kit_runs_steps_afresh(tmp_path, monkeypatch):
    import os

    (tmp_path / "spins.py").write_text("import threading, time\n"
                                       "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    kit = _kit()
    k = kit.Kit(tmp_path / "r.json", budget_s=60, dry_run=True, env=env)
    k.forks = _forks(env, preload=("spins",))
    rc, out, _ = k.run([sys.executable, "-c", "print('afresh')"], 30)
    assert (rc, out) == (0, "afresh\n")
    assert k.report["forks"]["ready"] is False and "the imports started threads" in k.report["forks"]["why"]
    assert "(forked)" not in (tmp_path / "r.log").read_text()


def test_a_probe_that_fails_in_a_fork_keeps_the_steps_afresh():
    import os

    forks = _forks()
    forks._probe = [sys.executable, "-c", "import sys; sys.exit('no CUDA here')"]  # as a card's would fail
    assert not forks.wait_ready(60) and "a forked probe failed (exit 1: no CUDA here)" in forks.why
    passing = _forks()
    passing._probe = [sys.executable, "-c", "print('ok')"]
    try:
        assert passing.wait_ready(60), passing.why
        assert passing.run([sys.executable, "-c", "print(1)"], 30, dict(os.environ))[:2] == (0, "1\n")
    finally:
        passing.close()


def test_a_step_failing_early_forked_on_a_card_runs_again_afresh_and_forking_stops(tmp_path):
    import os

    kit = _kit()
    k = kit.Kit(tmp_path / "r.json", budget_s=120, dry_run=False, env=dict(os.environ))
    k.forks = _forks()
    # exits 1 in a fork (its parent is the step server), 0 when the kit starts it
    cmd = [sys.executable, "-c", "import os, sys; sys.exit(0 if os.getppid() == int(sys.argv[1]) else 1)",
           str(os.getpid())]
    assert k.run(cmd, 60)[0] == 0
    assert k.forks is None and "failed forked (exit 1): run afresh" in k.report["forks"]["given_up"]
    log = (tmp_path / "r.log").read_text()
    assert log.count("===== exit 1") == 1 and log.count("===== exit 0") == 1
    assert k.run([sys.executable, "-c", "print('afresh')"], 30)[:2] == (0, "afresh\n")  # no fork any more
    k.dry_run = True  # the dry run (the CPU) keeps a failing step's result: no fork is suspected there
    k.forks = _forks()
    try:
        assert k.run(cmd, 60)[0] == 1 and k.forks is not None
    finally:
        k.close()
