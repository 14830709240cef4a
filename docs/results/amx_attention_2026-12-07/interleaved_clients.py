"""bench_serve's "8 concurrent clients" round against vLLM's CPU server and `magnetar serve`, both started and idle
between rounds, the rounds interleaved (vLLM, Magnetar, Magnetar, vLLM, ...): the VM's speed drifts over minutes, and
the peer part runs each server's workloads minutes apart. Each round gets eight fresh ~1K-token documents (the same
eight for both servers; neither has seen them), 48 new tokens with ignore_eos, bf16, SmolLM2-135M-Instruct. Prints each
round's tokens/s and TTFT p50, then the medians and their ratio. Run from the repo root:
.venv/bin/python docs/results/amx_attention_2026-12-07/interleaved_clients.py [rounds]"""
import shlex
import statistics
import sys

sys.path.insert(0, "benchmarks")
import bench_serve as bs  # noqa: E402
from openai import OpenAI  # noqa: E402

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
PEER = ("/work/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server --model "
        "/root/.cache/magnetar/models/smollm2-135m-instruct --served-model-name bench --dtype bfloat16 "
        "--max-model-len 8192 --enable-prefix-caching --gpu-memory-utilization 0.4 --host 127.0.0.1 --port 8100")
args = bs.parse_args(["--method", "dense", "--ranks", "1", "--new-tokens", "48", "--dtype", "bfloat16",
                      "--ignore-eos"])
model, tokenizer = bs.load(args)
port = bs.free_port()
urls = {"vllm": "http://127.0.0.1:8100", "magnetar": f"http://127.0.0.1:{port}"}
with bs._process(shlex.split(PEER), "peer", 60) as (peer, peer_log), \
        bs._process(bs.serve_command(args, port), "serve", 120) as (serve, serve_log):
    bs.wait_ready(urls["vllm"], peer, peer_log, 600, path="/v1/models")
    bs.wait_ready(urls["magnetar"], serve, serve_log, 600, path="/v1/models")
    apis = {k: OpenAI(base_url=u + "/v1", api_key="none", max_retries=0, timeout=3600) for k, u in urls.items()}
    for api in apis.values():
        bs._stream(api, "bench", "Warm-up. " * 20 + "\n\nSay hello.", 4)
    rows = {k: [] for k in apis}
    for r in range(ROUNDS):
        docs = [d for d, _, _ in bs.documents(tokenizer, 1000, 8, args.seed + 100 + 8 * r)]
        contents = [d + "\n\n" + bs.QUESTIONS[i % len(bs.QUESTIONS)] for i, d in enumerate(docs)]
        for name in (("vllm", "magnetar") if r % 2 == 0 else ("magnetar", "vllm")):
            results, wall = bs._clients(apis[name], "bench", contents, 48, True, f"{name} round {r}",
                                        extra_body={"ignore_eos": True})
            tokens = sum(x["tokens"] for x in results)
            rows[name].append((tokens / wall, statistics.median(x["ttft"] for x in results), wall))
            print(f"round {r} {name:8s}: {tokens / wall:6.2f} tokens/s, TTFT p50 {rows[name][-1][1]:.2f} s, "
                  f"wall {wall:.2f} s", flush=True)
tps = {k: statistics.median(x[0] for x in v) for k, v in rows.items()}
ttft = {k: statistics.median(x[1] for x in v) for k, v in rows.items()}
per_round = [m[0] / v[0] for m, v in zip(rows["magnetar"], rows["vllm"])]
print(f"median tokens/s: magnetar {tps['magnetar']:.2f}, vllm {tps['vllm']:.2f}: "
      f"{tps['magnetar'] / tps['vllm']:.2f}x; per round {' '.join(f'{x:.2f}' for x in per_round)} "
      f"(their median {statistics.median(per_round):.3f})")
print(f"median TTFT p50: magnetar {ttft['magnetar']:.2f} s, vllm {ttft['vllm']:.2f} s")
