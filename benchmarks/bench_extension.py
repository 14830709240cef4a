"""A long document after a cached prompt: its extension spread over the CP ranks against a fresh Phase 1.

Run under a launcher, one process per CP rank (``--method`` ring by default; SmolLM2-135M-Instruct):

    torchrun --nproc-per-node 2 benchmarks/bench_extension.py --prompt 1024 --document 5000

A ``--prompt``-token system prompt is encoded and cached; then the prompt followed by a ``--document``-token document
is asked one token, twice side by side: by the same engine (the document extends the cached prompt: each rank
encodes its share over the cached KV) and by an engine without a cache (a fresh Phase 1 of the whole context). The
two answers must be the same (exact methods); rank 0 prints the table (seconds, each rank's KV tokens) and one
JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--method", default="ring")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--document", type=int, default=5000)
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist

    import magnetar
    from magnetar.data.texts import paul_graham_essays

    flat = dict(method=args.method, cp_size=int(os.environ.get("WORLD_SIZE", "1")), timeout_s=1800)  # one CP group
    cached = magnetar.init_inference(args.model, **flat)
    cp = cached.groups.cp_size
    fresh = magnetar.init_inference(args.model, context_cache_mb=0, **flat)
    ids = cached.tokenizer("\n\n".join(paul_graham_essays()), add_special_tokens=False)["input_ids"]
    prompt = torch.tensor(ids[: args.prompt])
    context = torch.tensor(ids[: args.prompt + args.document])
    query = torch.tensor(cached.tokenizer(" Summarise it.", add_special_tokens=False)["input_ids"])
    cached.generate(prompt, query, max_new_tokens=1)
    rows = {}
    for name, engine in (("extension of the cached prompt", cached), ("fresh Phase 1", fresh)):
        dist.barrier()
        t0 = time.perf_counter()
        r = engine.generate(context, query, max_new_tokens=1)
        rows[name] = dict(seconds=time.perf_counter() - t0, token=r.token_ids, cached=r.cached_context_tokens,
                          kv=r.context_kv_tokens_per_rank)
    if cached.groups.rank == 0:
        ext, new = rows["extension of the cached prompt"], rows["fresh Phase 1"]
        same = ext["token"] == new["token"]
        print(f"| {args.method}, {cp} ranks: {args.prompt}-token prompt cached, then {args.document} more | seconds | "
              f"cached tokens | KV tokens per rank |\n|---|---:|---:|---|")
        for name, r in rows.items():
            print(f"| {name} | {r['seconds']:.2f} | {r['cached']} | {r['kv']} |")
        print(f"\nsame answer: {same}; extension / fresh: {ext['seconds'] / new['seconds']:.2f}x the time")
        print(json.dumps(dict(model=args.model, method=args.method, ranks=cp, prompt=args.prompt,
                              document=args.document, extension_s=ext["seconds"], fresh_s=new["seconds"],
                              same=same, kv_extension=ext["kv"], kv_fresh=new["kv"])))
        if not same:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
