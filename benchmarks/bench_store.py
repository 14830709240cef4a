"""A restarted server's first question about a stored context, against encoding it (issue 49's first goal).

``magnetar serve`` on ``--ranks`` CPU ranks under torchrun (``--method``, SmolLM2-135M-Instruct by default) with
``--context-store`` in a temporary folder. The first server is asked about a document of ``--context`` tokens
(Paul Graham essays, given in ``magnetar.context``): its Phase 1 runs, and the context is written to the store.
The server is stopped (SIGTERM: it drains and flushes the store) and started again on the same folder, and asked
the same question: the context now loads from the store. Both answers must be the same; the table gives each
request's time (the question's whole time, one new token: what a client waits for its first token) and the
ratio, then one JSON line.

    python benchmarks/bench_store.py --ranks 2 --context 8000
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.dist_utils import free_port, wait_serving  # noqa: E402  (the tests' helpers: a free port, a server up)


def serve(args, flags: list[str], port: int, log: Path) -> subprocess.Popen:
    """``magnetar serve`` of ``args.model`` on ``args.ranks`` CPU ranks under torchrun (``flags`` added), its output in
    ``log``; the ranks share the cores."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    cmd = [torchrun, "--nproc-per-node", str(args.ranks), "--master-addr", "127.0.0.1", "--master-port",
           str(free_port()), "-m", "magnetar.serve", "--model", args.model, *flags, "--port", str(port),
           "--served-model-name", "m", "--timeout-s", "600"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // args.ranks)))
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _ask(url: str, document: str) -> tuple[float, dict]:
    import httpx

    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", timeout=1800, json={
        "model": "m", "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the essay about?"}],
        "magnetar": {"context": document}})
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()


def wait(url: str, job: subprocess.Popen, log: Path) -> None:
    """Until ``url`` serves (the tests' :func:`~tests.dist_utils.wait_serving`, 600 s); the log's tail if it does
    not."""
    wait_serving(url, job, 600, lambda: log.read_text(errors="replace")[-4000:])


def _stop(job: subprocess.Popen, log: Path) -> int:
    """SIGTERM to the job (torchrun forwards it; its own status is then 1, docs/serving.md): how many ranks drained
    with exit status 0 (each flushed its store writes first)."""
    os.killpg(job.pid, signal.SIGTERM)
    job.wait(600)
    return log.read_text(errors="replace").count("drained: exit status 0")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--method", default="star")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--context", type=int, default=8000)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from magnetar.data.texts import paul_graham_essays
    from magnetar.models import model_dir

    tokenizer = AutoTokenizer.from_pretrained(model_dir(args.model))
    ids = tokenizer("\n\n".join(paul_graham_essays()), add_special_tokens=False)["input_ids"][: args.context]
    document = tokenizer.decode(ids)
    rows = []
    with tempfile.TemporaryDirectory(prefix="magnetar-store-") as store:
        for run in ("first server (Phase 1, stored)", "restarted server (loaded)"):
            port, log = free_port(), Path(store) / f"server-{len(rows)}.log"
            job = serve(args, ["--method", args.method, "--cp-size", str(args.ranks), "--context-store", store], port,
                        log)
            try:
                url = f"http://127.0.0.1:{port}"
                wait(url, job, log)
                seconds, body = _ask(url, document)
                drained = _stop(job, log)
            finally:
                if job.poll() is None:
                    os.killpg(job.pid, signal.SIGKILL)
            usage = body["usage"]
            rows.append(dict(run=run, seconds=seconds, answer=body["choices"][0]["message"]["content"],
                             context_tokens=body["magnetar"]["prompts"][0]["context_tokens"],
                             cached=usage["prompt_tokens_details"]["cached_tokens"], drained=drained))
            print(f"  {run}: {seconds:.2f} s, cached {rows[-1]['cached']} of {rows[-1]['context_tokens']} context "
                  f"tokens, {drained} of {args.ranks} ranks drained cleanly", file=sys.stderr)
        stored = sum(f.stat().st_size for f in Path(store).rglob("*.safetensors"))
    encode, load = rows
    if encode["answer"] != load["answer"] or load["cached"] != load["context_tokens"]:
        print(f"the restarted server answered otherwise: {rows}", file=sys.stderr)
        return 1
    print(f"| server | first question, one new token | context tokens from the store |\n|---|---:|---:|\n"
          f"| {encode['run']} | {encode['seconds']:.2f} s | 0 |\n"
          f"| {load['run']} | {load['seconds']:.2f} s | {load['cached']} |\n\n"
          f"speed-up {encode['seconds'] / load['seconds']:.1f}x; {stored / 2**20:.0f} MiB stored over "
          f"{args.ranks} ranks")
    print(json.dumps(dict(model=args.model, method=args.method, ranks=args.ranks, context_tokens=encode[
        "context_tokens"], encode_s=encode["seconds"], load_s=load["seconds"], speedup=encode["seconds"] /
        load["seconds"], stored_bytes=stored)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
