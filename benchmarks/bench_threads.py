"""CPU serving threads: decode ms/token of ``magnetar serve`` with each thread setting, on an idle and a busy host.

    python benchmarks/bench_threads.py                      # SmolLM2-135M, dense, one 4K document, 16 new tokens
    python benchmarks/bench_threads.py --busy 4 --new-tokens 32

For each host state (``idle``; ``busy``: ``--busy`` processes spinning on the CPU beside the server, by default
one per usable CPU) and each thread setting, a fresh server process (``python -m magnetar.serve``, one rank) is
started, warmed up with a short request, then asked one question about a ``--context-tokens`` document
(``magnetar.context``, streamed, greedy). Settings:

* ``default``: the server's own choice (``--threads`` unset, no ``OMP_NUM_THREADS``): the usable CPUs for Phase 1;
  for the decode steps every usable CPU while the host's other processes leave them idle, one fewer while they keep
  one busy (``magnetar.serve.cli.choose_threads``, ``magnetar.serve.threads``);
* ``omp1``: ``OMP_NUM_THREADS=1``, the usual advice (one thread throughout);
* ``torch``: ``--threads`` = torch's own default in a fresh process (the physical cores), throughout: what the
  server used before it chose.

Reported: the threads each server logged, the time to the first token (Phase 1 of the document included) and
the decode ms/token (first to last streamed token). Timings on a shared VM vary by tens of percent: compare
settings within one run. Prints the table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
SPIN = "while True: pass"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="registry name or folder")
    p.add_argument("--context-tokens", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the served model's dtype")
    p.add_argument("--busy", type=int, default=None, help="spinning processes of the busy runs (default: the usable "
                                                          "CPUs)")
    p.add_argument("--settings", default="default,omp1,torch", help="comma list of: default, omp1, torch")
    p.add_argument("--states", default="idle,busy", help="comma list of: idle, busy")
    p.add_argument("--port", type=int, default=8321)
    args = p.parse_args(argv)
    args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    args.states = [s.strip() for s in args.states.split(",") if s.strip()]
    bad = [s for s in args.settings if s not in ("default", "omp1", "torch")] + \
        [s for s in args.states if s not in ("idle", "busy")]
    if bad or not args.settings or not args.states:
        p.error(f"unknown settings/states {bad}: --settings from default,omp1,torch; --states from idle,busy")
    if args.context_tokens < 64 or args.new_tokens < 2:
        p.error("--context-tokens must be >= 64 and --new-tokens >= 2")
    return args


def torch_default_threads() -> int:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], capture_output=True,
                         text=True, env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, check=True)
    return int(out.stdout.strip())


def document(model: str, tokens: int) -> tuple[str, str]:
    from transformers import AutoTokenizer

    from magnetar.data.niah import needle_prompt
    from magnetar.models.prepare import model_path

    s = needle_prompt(AutoTokenizer.from_pretrained(model_path(model)), tokens, 0.5, seed=0)
    return s.context, s.query


def serve(args, setting: str, torch_threads: int, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(REPO), MAGNETAR_DISABLE_DS_SHM="1")
    cmd = [sys.executable, "-m", "magnetar.serve", "--model", args.model, "--method", "dense", "--port",
           str(args.port), "--served-model-name", "bench", "--log-level", "warning", "--dtype", args.dtype]
    if setting == "omp1":
        env["OMP_NUM_THREADS"] = "1"
    elif setting == "torch":
        cmd += ["--threads", str(torch_threads)]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_ready(url: str, proc: Optional[subprocess.Popen] = None, log: Optional[Path] = None, limit_s: float = 600,
               path: str = "/health") -> None:
    """Until ``url + path`` answers 200; RuntimeError (with the end of ``log``) if ``proc`` exits or time runs out."""
    import httpx

    def tail() -> str:
        return log.read_text()[-3000:] if log is not None and log.is_file() else ""

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{tail()}")
        try:
            if httpx.get(url + path, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not start within {limit_s:g} s:\n{tail()}")


def stream_chat(api, model: str, messages: list, max_tokens: int, extra_body: Optional[dict] = None) -> dict:
    """One streamed greedy chat request with the ``openai`` client ``api``: ``t0`` (its start), ``stamps`` (the
    arrival of each chunk with text: the text a token made final), ``end``, ``tokens`` (completion tokens), ``text``."""
    t0 = time.perf_counter()
    stamps, text, used = [], [], 0
    stream = api.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                         stream=True, stream_options={"include_usage": True}, extra_body=extra_body)
    for chunk in stream:
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
    return dict(t0=t0, stamps=stamps, end=time.perf_counter(), tokens=used, text="".join(text))


def ask(url: str, context: str, question: str, new_tokens: int, timed: bool = True) -> dict:
    """One streamed request: (ttft s, decode ms/token, tokens, text); ``timed=False``: a warm-up, not timed."""
    from openai import OpenAI

    api = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1800)
    r = stream_chat(api, "bench", [{"role": "user", "content": question}], new_tokens,
                    extra_body={"magnetar": {"context": context}})
    stamps, used = [t - r["t0"] for t in r["stamps"]], r["tokens"]
    if not timed:
        return {}
    if used < 2 or len(stamps) < 2:
        raise RuntimeError(f"too few tokens to time decoding ({used}); raise --new-tokens")
    # chunks carry the text a token made final: the last chunk's stamp is the last token's
    return dict(ttft_s=stamps[0], decode_ms_per_token=1000 * (stamps[-1] - stamps[0]) / (used - 1), tokens=used,
                text=r["text"])


def main(argv=None) -> int:
    args = parse_args(argv)
    from magnetar.parallel.launcher import usable_cpus

    cpus = usable_cpus()
    busy = cpus if args.busy is None else args.busy
    torch_threads = torch_default_threads()
    context, question = document(args.model, args.context_tokens)
    url = f"http://127.0.0.1:{args.port}"
    rows, workdir = [], Path(tempfile.mkdtemp(prefix="magnetar-bench-threads-"))
    for state in args.states:
        spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy if state == "busy" else 0)]
        try:
            for setting in args.settings:
                log = workdir / f"{state}-{setting}.log"
                proc = serve(args, setting, torch_threads, log)
                try:
                    wait_ready(url, proc, log)
                    ask(url, "Warm-up text. " * 20, "Say ok.", 2, timed=False)
                    r = ask(url, context, question, args.new_tokens)
                finally:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(60)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                text = log.read_text()
                found = re.search(r"(\d+) intra-op threads per rank, (\d+) in Phase 1 \((.*)\)\n", text)
                follows = re.search(r"(\d+) intra-op threads per rank in decode steps while the host's other "
                                    r"processes leave its CPUs idle, (\d+) while they keep one busy; (\d+) in Phase 1 "
                                    r"\((.*)\)\n", text)
                if follows:  # the count follows the host's load (magnetar.serve.threads)
                    threads, phase1, why = f"{follows.group(1)} idle, {follows.group(2)} busy", \
                        int(follows.group(3)), follows.group(4)
                else:
                    threads, phase1, why = (int(found.group(1)), int(found.group(2)), found.group(3)) if found \
                        else (None, None, "?")
                r.update(state=state, setting=setting, threads=threads, phase1_threads=phase1, why=why,
                         spinners=len(spinners))
                rows.append(r)
                print(f"{state:5s} {setting:8s} threads {r['threads']} (Phase 1 {r['phase1_threads']}): "
                      f"TTFT {r['ttft_s']:.1f} s, decode "
                      f"{r['decode_ms_per_token']:.0f} ms/token", flush=True)
        finally:
            for s in spinners:
                s.kill()
                s.wait()
    print(f"\n## Decode with each thread setting ({args.model} {args.dtype}, dense, one rank, a "
          f"{args.context_tokens}-token document, {args.new_tokens} new tokens; {cpus} usable CPUs; busy = {busy} "
          f"spinning processes)\n")
    print("| host | setting | threads (decode / Phase 1) | TTFT s | decode ms/token | decode vs default |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        base = next((x for x in rows if x["state"] == r["state"] and x["setting"] == "default"), r)
        print(f"| {r['state']} | {r['setting']} | {r['threads']} / {r['phase1_threads']} | {r['ttft_s']:.1f} | "
              f"{r['decode_ms_per_token']:.0f} "
              f"| {r['decode_ms_per_token'] / base['decode_ms_per_token']:.2f}x |")
    same = len({r["text"] for r in rows}) == 1
    print(f"\nanswers identical across settings: {'yes' if same else 'NO'}")
    print(json.dumps(dict(bench="threads", model=args.model, dtype=args.dtype, cpus=cpus, busy=busy,
                          torch_default_threads=torch_threads,
                          machine=f"{platform.machine()} {platform.processor() or ''}".strip(), same_answers=same,
                          rows=[{k: v for k, v in r.items() if k != "text"} for r in rows])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
