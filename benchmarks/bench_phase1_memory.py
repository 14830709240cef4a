"""One Phase 1's peak memory against the room check's lower bound (``Encoder.phase1_need``).

    python benchmarks/bench_phase1_memory.py --configs dense:1:float32,star:4:float32 --lengths 2048,8192

The engine refuses, before a Phase 1, a context whose KV kept so far beside the running forward's MLP activations
certainly exceed the device (docs/serving.md, "Shutdown and faults"). The bound must stay below what a Phase 1
really holds, or a context that fits would be refused. Each configuration (``method:cp_size:dtype``; cp_size > 1:
simulated ranks, every rank's KV in this one process) runs in a fresh child process: the model loaded and warmed
up, the kernel's peak resident set (``VmHWM``) reset to the current one (``/proc/self/clear_refs``), ONE Phase 1 of
random token ids, then the peak read. On a CPU that peak is the process's (Linux only), with glibc told to map every
allocation of 64 KiB or more on its own and give it back when freed (``MALLOC_MMAP_THRESHOLD_``: else the memory a
cast to bfloat16 freed is reused unseen and the peak reads low); on CUDA the allocator's ``max_memory_allocated``
above what was allocated before. Prints a table (MiB), then one JSON line.

``--chunk N``: the context is encoded as a server's ``--prefill-chunk N`` encodes it instead -- a Phase 1 of its first
N tokens, then each next N extending the last (``Encoder.encode(..., base=...)``); the bound columns stay the whole
Phase 1's, for reference.

    python benchmarks/bench_phase1_memory.py --configs dense:1:float32 --lengths 7000 --chunk 1024
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = "--child"


def _rss(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}: this benchmark reads Linux's process status")


def child(model: str, method: str, cp: int, dtype: str, n: int, threads: int, chunk: int = 0) -> dict:
    import gc
    import time

    import torch

    import magnetar

    torch.set_num_threads(threads)
    eng = magnetar.init_inference(model, method=method, cp_size=cp, simulate=cp > 1, dtype=dtype, context_cache_mb=0)
    vocab = int(eng.model.config.vocab_size)
    ids = torch.randint(min(100, vocab // 2), min(20000, vocab), (n,))  # ordinary tokens of the vocabulary
    eng.generate(ids[:64], torch.tensor([5, 6]), max_new_tokens=1)  # ops loaded, first calls made
    gc.collect()
    cuda = eng.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(eng.device)
        before = torch.cuda.memory_allocated(eng.device)
    else:
        before = _rss("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
    t0 = time.perf_counter()
    if chunk:  # as the server's --prefill-chunk: each chunk extends the context so far (not cached)
        handle = None
        for end in range(chunk, n + chunk, chunk):
            handle, _ = eng.encoder.encode(ids[:min(end, n)], base=handle, keep=False)
    else:
        eng.encoder.phase1(ids)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(eng.device) if cuda else _rss("VmHWM")
    need, kv, act = eng.encoder.phase1_need(n)  # the engine's own bound (its room check's)
    return dict(model=model, method=method, cp_size=cp, dtype=dtype, tokens=n, chunk=chunk, device=str(eng.device),
                seconds=seconds, measured_bytes=peak - before, bound_bytes=need, bound_kv_bytes=kv,
                bound_activation_bytes=act)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--configs", default="dense:1:float32,dense:1:bfloat16,star:4:float32,pulsar:4:float32,"
                                        "ring:4:float32", help="method:cp_size:dtype, comma-separated")
    p.add_argument("--lengths", default="2048,8192", help="context tokens, comma-separated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chunk", type=int, default=0, help="encode in chunks of this many tokens, each extending the "
                                                        "last, as the server's --prefill-chunk (0: one Phase 1)")
    p.add_argument(_CHILD, nargs=4, metavar=("METHOD", "CP", "DTYPE", "TOKENS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.chunk < 0:
        p.error(f"--chunk takes a number of tokens >= 0 (0: one Phase 1), got {args.chunk}")
    if args.child:
        method, cp, dtype, n = args.child
        print(json.dumps(child(args.model, method, int(cp), dtype, int(n), args.threads, args.chunk)))
        return
    try:
        configs = [(m, int(c), d) for m, c, d in (x.split(":") for x in args.configs.split(","))]
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        p.error("--configs takes method:cp_size:dtype items (e.g. star:4:float32), --lengths whole numbers")
    rows = []
    print(f"{'config':<24} {'tokens':>7} {'chunk':>6} {'seconds':>8} {'measured':>9} {'bound':>8} {'KV':>7} "
          f"{'MLP act':>8} {'bound/measured':>15}")
    for method, cp, dtype in configs:
        for n in lengths:
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--threads", str(args.threads),
                                  "--chunk", str(args.chunk), _CHILD, method, str(cp), dtype, str(n)],
                                 capture_output=True, text=True, env=dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536"))
            if out.returncode:
                raise SystemExit(f"{method}:{cp}:{dtype} at {n} tokens failed:\n{out.stderr[-2000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            mib = {k: row[k] / 2**20 for k in ("measured_bytes", "bound_bytes", "bound_kv_bytes",
                                                "bound_activation_bytes")}
            print(f"{method + ':' + str(cp) + ':' + dtype:<24} {n:>7} {args.chunk or '-':>6} {row['seconds']:>8.2f} "
                  f"{mib['measured_bytes']:>9.0f} "
                  f"{mib['bound_bytes']:>8.0f} {mib['bound_kv_bytes']:>7.0f} {mib['bound_activation_bytes']:>8.0f} "
                  f"{row['bound_bytes'] / max(1, row['measured_bytes']):>15.2f}", flush=True)
    print(json.dumps(dict(bench="phase1_memory", rows=rows)))


if __name__ == "__main__":
    main()
