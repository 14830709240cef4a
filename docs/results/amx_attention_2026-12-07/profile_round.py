"""One served 8-client round (fresh ~1K documents, 48 tokens, ignore_eos, bf16 SmolLM2) under py-spy (200 Hz, raw
stacks to /tmp/round.txt) after one unprofiled round; profile_round.txt is the share of samples in each function
(inclusive). Run from the repo root."""
import shlex, statistics, sys, subprocess, time, os
sys.path.insert(0, "benchmarks")
import bench_serve as bs
from openai import OpenAI
args = bs.parse_args(["--method", "dense", "--ranks", "1", "--new-tokens", "48", "--dtype", "bfloat16", "--ignore-eos"])
model, tokenizer = bs.load(args)
port = bs.free_port(); url = f"http://127.0.0.1:{port}"
with bs._process(bs.serve_command(args, port), "serve", 120) as (serve, log):
    bs.wait_ready(url, serve, log, 600, path="/v1/models")
    api = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    bs._stream(api, "bench", "Warm-up. " * 20 + "\n\nSay hello.", 4)
    for r in range(2):
        docs = [d for d, _, _ in bs.documents(tokenizer, 1000, 8, args.seed + 300 + 8 * r)]
        contents = [d + "\n\n" + bs.QUESTIONS[i % len(bs.QUESTIONS)] for i, d in enumerate(docs)]
        spy = None
        if r == 1:
            spy = subprocess.Popen([".venv/bin/py-spy", "record", "-p", str(serve.pid), "-r", "200", "-f", "raw", "-o", "/tmp/round.txt", "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        t0 = time.perf_counter()
        results, wall = bs._clients(api, "bench", contents, 48, True, "r", extra_body={"ignore_eos": True})
        print(r, "tokens/s", sum(x["tokens"] for x in results) / wall, "ttft p50", statistics.median(x["ttft"] for x in results), "wall", wall, flush=True)
        if spy:
            spy.send_signal(2); spy.wait()
