"""What one hostile request costs every other client (issue 28, items 1 and 2), before and after, side by side.

    python benchmarks/bench_hostile.py                                   # this tree alone
    git worktree add /tmp/magnetar-before 1894ffd                         # the code before the hardening
    python benchmarks/bench_hostile.py --before /tmp/magnetar-before      # both, one after the other, in one run

For each source tree a ``magnetar serve`` process (SmolLM2-135M-Instruct, dense, one rank, 127.0.0.1) is started
from that tree. A probe client sends small chat requests back to back (a one-line context, ``max_tokens`` 2) and
records each one's latency; after a quiet baseline, a hostile client sends one request of each kind below while
the probe goes on:

* ``body N MB``: a chat request whose ``magnetar.context`` is N MB of English text (item 1: no body limit, the
  whole text tokenized under one lock before its length was compared with the model's 8192 positions);
* ``stop K``: a request with K distinct stop strings (item 2: transformers' StopStringCriteria walked the
  vocabulary per stop string on the engine loop). K = 4 is what OpenAI allows (accepted by both trees); K = 64
  is refused by the hardened server, and run again on a third server (``after+``) started with
  ``--max-stop-strings 64``: what 64 stop strings cost the engine now.

Reported per tree and request: the hostile request's status and time, the **stall** seen by the probe (its
longest latency while the hostile request was in flight, minus the baseline median) and the server's **peak
RSS growth** over its idle RSS (psutil, sampled every 50 ms). Both servers share the 2 cores with the clients;
run it on a quiet machine. Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
LAUNCH = ("import runpy, sys; "
          "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
          "sys.path.insert(0, sys.argv.pop(1)); runpy.run_module('magnetar.serve', run_name='__main__')")
SENTENCE = "The quick brown fox jumps over the lazy dog while the river keeps running to the sea. "


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tree: Path, model: str, log: Path, flags=()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH="")
        cmd = [sys.executable, "-c", LAUNCH, str(tree), "--model", model, "--method", "dense", "--port",
               str(self.port), "--served-model-name", "m", "--max-tokens", "2", *flags]
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server from {tree} exited ({self.proc.returncode}); see {log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        else:
            raise RuntimeError(f"the server from {tree} did not start; see {log}")
        self.ps = psutil.Process(self.proc.pid)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def chat(url: str, context: str, *, stop=None, timeout: float = 600.0) -> tuple[int, float]:
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": " What runs?"}],
            "magnetar": {"context": context}}
    if stop is not None:
        body["stop"] = stop
    t0 = time.perf_counter()
    try:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)
        status = r.status_code
    except httpx.HTTPError as e:
        status = type(e).__name__
    return status, time.perf_counter() - t0


class Probe(threading.Thread):
    """Small requests back to back; (start, latency) of each."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.samples, self.halt = url, [], threading.Event()

    def run(self):
        while not self.halt.is_set():
            t = time.monotonic()
            status, dt = chat(self.url, SENTENCE, timeout=600)
            self.samples.append((t, dt, status))


class RSS(threading.Thread):
    def __init__(self, ps: psutil.Process):
        super().__init__(daemon=True)
        self.ps, self.peak, self.halt = ps, 0, threading.Event()

    def run(self):
        while not self.halt.is_set():
            try:
                self.peak = max(self.peak, self.ps.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.05)


def hostile_cases(sizes_mb, stops):
    text = SENTENCE * 64
    for mb in sizes_mb:
        doc = (text * (int(mb * 2**20) // len(text) + 1))[: int(mb * 2**20)]
        yield f"body {mb:g} MB", dict(context=doc)
    for k in stops:
        yield f"stop {k}", dict(context=SENTENCE * 4, stop=[f"<<{i}>>" for i in range(k)])


def measure(tree: Path, label: str, args, flags=(), sizes=None, stops=None) -> list[dict]:
    server = Server(tree, args.model, Path(args.log_dir) / f"bench_hostile_{label}.log", flags)
    rows = []
    try:
        for _ in range(3):  # warm up
            chat(server.url, SENTENCE)
        for name, kw in hostile_cases(args.sizes_mb if sizes is None else sizes, args.stops if stops is None
                                      else stops):
            probe = Probe(server.url)
            probe.start()
            time.sleep(args.baseline_s)
            base = [dt for _, dt, _ in probe.samples]
            idle_rss = server.ps.memory_info().rss
            rss = RSS(server.ps)
            rss.start()
            t0 = time.monotonic()
            status, took = chat(server.url, **kw)
            t1 = time.monotonic()
            time.sleep(0.5)  # the probe request that spanned the end
            rss.halt.set()
            probe.halt.set()
            probe.join(600)
            during = [dt for t, dt, _ in probe.samples if t < t1 and t + dt > t0]
            median = statistics.median(base) if base else float("nan")
            rows.append(dict(tree=label, request=name, status=status, seconds=round(took, 2),
                             probe_median_s=round(median, 3),
                             stall_s=round(max(during, default=0.0) - median, 2),
                             probe_errors=sum(1 for *_, s in probe.samples if s != 200),
                             peak_rss_growth_mib=round((rss.peak - idle_rss) / 2**20)))
            print(f"  {label:7s} {name:12s} status {status}  {took:7.2f} s  stall {rows[-1]['stall_s']:6.2f} s  "
                  f"+{rows[-1]['peak_rss_growth_mib']} MiB", flush=True)
    finally:
        server.stop()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--before", type=Path, help="a source tree of the code before (a git worktree)")
    p.add_argument("--sizes-mb", type=lambda s: [float(x) for x in s.split(",")], default=[4.0, 20.0])
    p.add_argument("--stops", type=lambda s: [int(x) for x in s.split(",")], default=[4, 64])
    p.add_argument("--baseline-s", type=float, default=3.0)
    p.add_argument("--log-dir", default="/tmp")
    args = p.parse_args(argv)
    rows = []
    if args.before is not None:
        rows += measure(args.before.resolve(), "before", args)
    rows += measure(REPO, "after", args)
    big = [k for k in args.stops if k > 4]
    if big:  # the engine's own cost of many stop strings, with the server's bound raised to allow them
        rows += measure(REPO, "after+", args, flags=("--max-stop-strings", str(max(big))), sizes=[], stops=big)
    print(f"\n{'tree':7s} {'request':12s} {'status':>9s} {'time s':>8s} {'probe p50 s':>11s} {'stall s':>8s} "
          f"{'peak RSS +MiB':>13s}")
    for r in rows:
        print(f"{r['tree']:7s} {r['request']:12s} {str(r['status']):>9s} {r['seconds']:8.2f} "
              f"{r['probe_median_s']:11.3f} {r['stall_s']:8.2f} {r['peak_rss_growth_mib']:13d}")
    print(json.dumps({"bench": "hostile", "model": args.model, "machine": platform.machine(),
                      "cpus": os.cpu_count(), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
