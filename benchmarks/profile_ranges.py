"""A short workload for a profiler: one Phase 1 and a few decode steps with Magnetar's NVTX ranges on (issue 47,
item 7) -- what the GPU kit's ``nsight`` step runs under Nsight Compute to see which kernels fall in which range.

    MAGNETAR_NVTX=1 ncu --clock-control none --nvtx --print-summary per-nvtx --metrics gpu__time_duration.sum \\
        --launch-count 2000 python benchmarks/profile_ranges.py --model dummy:llama-3.1-8b --dtype bfloat16 \\
        --context-tokens 4096
    nsys profile --trace=cuda,nvtx -o magnetar python benchmarks/profile_ranges.py ...   # where Nsight Systems is

The engine runs dense on one rank with eager decode steps (each layer's Phase-2 attention is a range of its own; a
static or graph step is one range per step: docs/profiling.md). A warm-up request first (its Phase 1 and steps, so the
profiled request's kernels are the steady state's); ``--profile-from-start`` keeps it in the profile. Prints one JSON
line (the seconds of each part).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="dummy:tiny-llama", help="an installed model, a folder, or dummy:<preset>")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--context-tokens", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=3)
    p.add_argument("--decode-step", default="eager", choices=("eager", "static", "graph"))
    args = p.parse_args(argv)
    if args.context_tokens < 16 or args.new_tokens < 1:
        p.error("--context-tokens >= 16, --new-tokens >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("MAGNETAR_NVTX", "1")  # the ranges on under any profiler (Nsight Compute included)
    import magnetar
    from magnetar.models import load_model
    from magnetar.models.dummy import is_dummy

    device = "cuda" if torch.cuda.is_available() and is_dummy(args.model) else "cpu"
    t0 = time.perf_counter()
    model, _ = load_model(args.model, dtype=getattr(torch, args.dtype), device=device)
    eng = magnetar.init_inference(model, method="dense", dtype=args.dtype, deepspeed_inference=False,
                                  decode_step=args.decode_step, context_cache_mb=0)
    load_s = time.perf_counter() - t0
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    times = {}
    for label in ("warmup", "profiled"):
        ctx = torch.randint(0, vocab, (args.context_tokens,), generator=g)
        query = torch.randint(0, vocab, (8,), generator=g)
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        eng.generate(ctx, query, max_new_tokens=args.new_tokens, temperature=0.0)
        if device == "cuda":
            torch.cuda.synchronize()
        times[label] = time.perf_counter() - t
    print(json.dumps(dict(bench="profile_ranges", model=args.model, dtype=args.dtype, device=device,
                          context_tokens=args.context_tokens, new_tokens=args.new_tokens,
                          decode_step=args.decode_step, load_s=load_s, seconds=times)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
