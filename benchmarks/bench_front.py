"""Two data-parallel replicas behind the front port against a plain round-robin balancer (issue 49's third goal).

``magnetar serve --method dense --front-port F`` on 2 CPU ranks under torchrun (2 replicas of one rank each,
SmolLM2-135M-Instruct by default). Two documents of ``--context`` tokens (Paul Graham essays), ``--questions``
questions each, asked one after another as an unmodified client sends them (the document pasted before each
question), after one warm-up request on each replica: the first document's through the front port, the second's
alternating between the two replicas' own ports (what a load balancer that knows nothing of the caches does).
Reported for each: Phase 1s run (questions whose ``cached_tokens`` were 0), the replicas used, the total time, then
one JSON line.

    python benchmarks/bench_front.py --questions 10 --context 4000
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_store import serve, wait  # noqa: E402
from tests.dist_utils import free_ports  # noqa: E402


def _ask(url: str, document: str, question: str) -> tuple[float, int, str]:
    import httpx

    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", timeout=1800, json={
        "model": "m", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": f"{document}\n\n{question}"}]})
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], \
        r.headers.get("x-magnetar-replica", url)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--questions", type=int, default=10)
    p.add_argument("--context", type=int, default=4000)
    args = p.parse_args(argv)
    args.ranks = 2
    from transformers import AutoTokenizer

    from magnetar.data.texts import paul_graham_essays
    from magnetar.models import model_dir

    tokenizer = AutoTokenizer.from_pretrained(model_dir(args.model))
    ids = tokenizer("\n\n".join(paul_graham_essays()), add_special_tokens=False)["input_ids"]
    docs = [tokenizer.decode(ids[i * args.context:(i + 1) * args.context]) for i in (0, 1)]
    questions = [f"In one word, what is question {i} about?" for i in range(args.questions)]
    port, front = free_ports(2)  # the replicas on port and port + 1, the front elsewhere
    rows = {}
    with tempfile.TemporaryDirectory(prefix="magnetar-front-") as tmp:
        log = Path(tmp) / "server.log"
        job = serve(args, ["--method", "dense", "--front-port", str(front)], port, log)
        try:
            wait(f"http://127.0.0.1:{front}", job, log)
            for replica in (0, 1):  # a first request on each replica (its first forward pays one-off costs)
                _ask(f"http://127.0.0.1:{port + replica}", tokenizer.decode(ids[-600:]), "Warm up.")
            ways = {"front port (routed by cache)": lambda i: f"http://127.0.0.1:{front}",
                    "round robin over the replicas' ports": lambda i: f"http://127.0.0.1:{port + i % 2}"}
            for (name, url), doc in zip(ways.items(), docs):
                t0 = time.perf_counter()
                got = [_ask(url(i), doc, q) for i, q in enumerate(questions)]
                rows[name] = dict(seconds=time.perf_counter() - t0, phase1=sum(c == 0 for _, c, _ in got),
                                  replicas=sorted({str(int(r.rsplit(":", 1)[1]) - port) if ":" in r else r
                                                   for _, _, r in got}), first_s=got[0][0],
                                  others_s=sum(s for s, _, _ in got[1:]) / max(1, len(got) - 1))
                print(f"  {name}: {rows[name]}", file=sys.stderr)
        finally:
            os.killpg(job.pid, signal.SIGTERM)
            job.wait(600)
    print(f"| {args.questions} questions about one {args.context}-token document, 2 replicas | Phase 1s | replicas "
          f"used | total |\n|---|---:|---|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['phase1']} | {', '.join(map(str, r['replicas']))} | {r['seconds']:.1f} s |")
    print(json.dumps(dict(model=args.model, questions=args.questions, context=args.context, **{
        k.split(" (")[0].replace(" ", "_"): v for k, v in rows.items()})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
