"""Benchmark the Hamming similarity search of Spotlight/LSH decoding: one query's packed code against N keys'
codes, scores + top-k, fused DeepSpeed op vs the torch reference, against the memory-bandwidth floor.

    python benchmarks/bench_hamming.py                              # 512K keys x 128-bit codes, one query, CPU
    python benchmarks/bench_hamming.py --keys 65536,524288 --bits 128 --topk 2%
    python benchmarks/bench_hamming.py --device cuda                # the paper's "< 100 us on A100" claim

The floor is the time to read the key codes once (N x bits / 8 bytes) at this machine's streaming read
bandwidth, measured here by summing a large tensor. Prints a table, then one JSON line (times are medians in
microseconds).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ops import timed  # noqa: E402

from magnetar.sparse.codes import HAMMING_OP, hamming_topk, pack_bits  # noqa: E402


def read_bandwidth(device, nbytes: int = 512 << 20) -> float:
    """Bytes per second of a streaming read (sum of a large float32 tensor: vectorised, one pass)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    ms = timed({"read": lambda: x.sum()}, device, warmup=2, repeats=5)["read"]
    return nbytes / (ms / 1e3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keys", default="524288", help="comma-separated key counts")
    p.add_argument("--bits", type=int, default=128)
    p.add_argument("--group", type=int, default=1, help="query heads per KV head (GQA), scores summed")
    p.add_argument("--topk", default="2%", help="keys selected: a count or a percentage of the keys")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    bw = read_bandwidth(device)
    op_ok = HAMMING_OP.available(device)
    rows = []
    for n in (int(x) for x in args.keys.split(",")):
        kk = max(1, int(n * float(args.topk[:-1]) / 100)) if args.topk.endswith("%") else int(args.topk)
        g = torch.Generator().manual_seed(0)
        q = pack_bits(torch.rand(1, 1, args.group, args.bits, generator=g) > 0.5, backend="torch").to(device)
        k = pack_bits(torch.rand(1, n, args.bits, generator=g) > 0.5, backend="torch").to(device)
        fns = {"torch": lambda: hamming_topk(q, k, kk, backend="torch")}
        if op_ok:
            fns["op"] = lambda: hamming_topk(q, k, kk, backend="op")
            assert all(torch.equal(a, b) for a, b in zip(fns["op"](), fns["torch"]())), "op != torch reference"
        ms = timed(fns, device, warmup=2, repeats=args.repeats)
        floor_us = n * args.bits / 8 / bw * 1e6
        rows.append({"keys": n, "bits": args.bits, "group": args.group, "topk": kk, "floor_us": floor_us,
                     **{f"{name}_us": v * 1e3 for name, v in ms.items()}})
    print(f"device {device} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), "
          f"read bandwidth {bw / 1e9:.1f} GB/s; fused op {'available' if op_ok else 'UNAVAILABLE'}")
    print("| keys | bits | top-k | bytes read | floor (us) | op (us) | op / floor | torch (us) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        op = r.get("op_us")
        print(f"| {r['keys']} | {r['bits']} | {r['topk']} | {r['keys'] * r['bits'] // 8} | {r['floor_us']:.0f} | "
              f"{op:.0f} | {op / r['floor_us']:.1f}x | {r['torch_us']:.0f} |" if op is not None else
              f"| {r['keys']} | {r['bits']} | {r['topk']} | {r['keys'] * r['bits'] // 8} | {r['floor_us']:.0f} | "
              f"- | - | {r['torch_us']:.0f} |")
    print(json.dumps({"bench": "hamming_topk", "device": str(device), "threads": torch.get_num_threads(),
                      "read_GBps": bw / 1e9, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
