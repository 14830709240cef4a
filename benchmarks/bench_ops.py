"""Benchmark the ops: attention_with_lse (every backend that accepts the call) vs torch SDPA, and merge_states
(fused DeepSpeed op vs torch).

    python benchmarks/bench_ops.py                       # CPU, fp32, the default grid
    python benchmarks/bench_ops.py --device cuda --dtype bf16
    python benchmarks/bench_ops.py --sk 4096 --sq 1 --repeats 20

SDPA is the honest baseline for the *same* attention: no mask for decode (Sq=1, the query sees every key),
``is_causal=True`` for a causal square (Sq = Sk: Phase 1's shape) and a boolean bottom-right causal mask for
1 < Sq < Sk (``is_causal=True`` would align the mask top-left: wrong). Pairs with Sq > Sk are skipped. Each row's
TFLOP/s counts the visible (query, key) pairs, 4 x H x D FLOPs each (the GPU kit's ``kernels`` step: which backend
runs Phase 1's causal attention fastest on the card). A decode row (Sq = 1) also says the GB/s of K and V read -- the
figure a decode kernel is held to -- and adds the paged kernel of a decode step where one runs here
(``magnetar.ops.pages``: ``cpu_decode`` on a CPU, ``triton_decode`` on CUDA; named ``<backend>/pages``).
SDPA does not return the log-sum-exp, so it does strictly less work than attention_with_lse.
Prints a table, then one JSON line with every measurement (times are medians, in milliseconds).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from magnetar.ops import attention_with_lse, merge_states
from magnetar.ops.attention import AttentionCall, _classify
from magnetar.ops.backends import explain
from magnetar.ops.pages import Page, PageByPage, attend_pages, page_backend
from magnetar.utils.cli import write_json_line

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fns: dict, device, warmup: int, repeats: int, min_seconds: float = 0.5) -> dict:
    """Median wall time in ms of each ``fns[name]()``, device-synchronised.

    The implementations are timed interleaved, round by round, so drift in the machine's speed (other
    processes, frequency scaling) hits all of them alike; rounds continue until ``repeats`` rounds and at least
    ``min_seconds`` have passed.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    samples = {name: [] for name in fns}
    start = time.perf_counter()
    rounds = 0
    while rounds < repeats or (time.perf_counter() - start < min_seconds and rounds < 50 * repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            _sync(device)
            samples[name].append((time.perf_counter() - t0) * 1e3)
        rounds += 1
    return {name: statistics.median(v) for name, v in samples.items()}


def add_cpu_op_args(p: argparse.ArgumentParser) -> None:
    """The flags every CPU op benchmark takes beside its shapes (bench_norm.py, bench_rotary.py)."""
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json-out", default=None, metavar="FILE", help="also write the JSON record to this file")


def cpu_machine() -> str:
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def cpu_op_summary(bench: str, reason, rows: list, json_out) -> dict:
    """A CPU op benchmark's JSON record (``reason``: why Magnetar's op did not run, or None), printed as one line and
    written to ``json_out`` if given."""
    summary = {"bench": bench, "machine": cpu_machine(), "torch": torch.__version__,
               "threads": torch.get_num_threads(), "op_unavailable": reason, "rows": rows}
    print(json.dumps(summary))
    if json_out is not None:
        write_json_line(json_out, summary)
    return summary


def bench_attention(args, device, dtype, on_rows=None):
    """Rows of every backend against SDPA per (Sq, Sk); ``on_rows(rows)`` after each shape (the rows so far)."""
    rows = []
    for sk in args.sk:
        for sq in args.sq:
            if sq > sk:
                continue
            g = torch.Generator(device="cpu").manual_seed(0)
            q = torch.randn(1, args.heads, sq, args.head_dim, generator=g).to(device, dtype)
            k = torch.randn(1, args.kv_heads, sk, args.head_dim, generator=g).to(device, dtype)
            v = torch.randn(1, args.kv_heads, sk, args.head_dim, generator=g).to(device, dtype)
            group = args.heads // args.kv_heads
            kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # SDPA's GQA input
            if sq == 1 or sq == sk:
                mask = None
            else:
                pos_q, pos_k = torch.arange(sk - sq, sk, device=device), torch.arange(sk, device=device)
                mask = pos_k[None, :] <= pos_q[:, None]
            repeats = args.repeats if sk * sq <= 4096 * 128 else max(3, args.repeats // 2)
            square = sq == sk and sq > 1
            fns = {"sdpa": lambda: F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask, is_causal=square)}
            call = AttentionCall(q, k, v, None, None, 1.0, _classify(None, None, sq, sk, True))
            for name, reasons in sorted(explain(call).items()):
                if reasons:
                    continue
                if name == "torch" and sq * sk * args.heads > 2**26 and device.type == "cpu":
                    continue  # the reference materialises the full score matrix; skip where it would be silly
                fns[name] = lambda name=name: attention_with_lse(q, k, v, backend=name)
            paged = page_backend("auto", device) if sq == 1 else None
            pages = [[Page(k, v, k_finite=True)]]
            if paged is not None and not isinstance(paged, PageByPage) and attend_pages(q, pages, 1.0) is not None:
                fns[f"{paged.name}/pages"] = lambda: attend_pages(q, pages, 1.0)  # an eager decode step's call
            times = timed(fns, device, args.warmup, repeats)
            pairs = sk if sq == 1 else sq * (sk - sq) + sq * (sq + 1) // 2  # bottom-right causal
            flops = 4 * args.heads * args.head_dim * pairs
            kv_bytes = 2 * k.numel() * k.element_size()  # a decode call reads K and V once
            for name, ms in times.items():
                rows.append({"op": "attention", "impl": name, "sq": sq, "sk": sk, "ms": ms,
                             "x_sdpa": ms / times["sdpa"], "tflops": flops / (ms * 1e-3) / 1e12,
                             "gb_s": kv_bytes / (ms * 1e-3) / 1e9 if sq == 1 else None})
            if on_rows is not None:
                on_rows(rows)
    return rows


def bench_merge(args, device, dtype):
    rows = []
    for s in args.merge_s:
        for n in args.merge_n:
            g = torch.Generator(device="cpu").manual_seed(1)
            outs = torch.randn(n, 1, args.heads, s, args.head_dim, generator=g).to(device, dtype)
            lses = torch.randn(n, 1, args.heads, s, generator=g).to(device)
            fns = {"torch": lambda: merge_states(outs, lses, backend="torch")}
            try:
                merge_states(outs, lses, backend="fused")
                fns["fused"] = lambda: merge_states(outs, lses, backend="fused")
            except RuntimeError as e:
                rows.append({"op": "merge", "impl": "fused", "n": n, "s": s, "error": str(e)[:200]})
            times = timed(fns, device, args.warmup, args.repeats)
            for name, ms in times.items():
                rows.append({"op": "merge", "impl": name, "n": n, "s": s, "ms": ms, "x_torch": ms / times["torch"]})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--sq", type=int, nargs="+", default=[1, 128])
    p.add_argument("--sk", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--merge-n", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--merge-s", type=int, nargs="+", default=[1, 128, 4096])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json-out", default=None, metavar="FILE", help="also write the JSON record here, rewritten "
                   "after each attention shape (\"complete\": false until the end: a run cut short keeps its rows)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]

    machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
               else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    head = {"bench": "ops", "device": str(device), "machine": machine, "dtype": args.dtype, "torch": torch.__version__}

    def partial(rows):
        if args.json_out is not None:
            write_json_line(args.json_out, {**head, "complete": False, "attention": rows, "merge": []})

    attn = bench_attention(args, device, dtype, on_rows=partial)
    merge = bench_merge(args, device, dtype)
    print(f"# attention_with_lse vs SDPA  (B=1, H={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}, "
          f"{args.dtype}, {machine})")
    print(f"{'impl':<20}{'Sq':>7}{'Sk':>8}{'ms':>11}{'TFLOP/s':>9}{'x SDPA':>9}{'KV GB/s':>9}")
    for r in attn:
        gbs = "-" if r["gb_s"] is None else f"{r['gb_s']:.0f}"
        print(f"{r['impl']:<20}{r['sq']:>7}{r['sk']:>8}{r['ms']:>11.3f}{r['tflops']:>9.1f}{r['x_sdpa']:>9.2f}{gbs:>9}")
    print(f"\n# merge_states (B=1, H={args.heads}, D={args.head_dim}, {args.dtype})")
    print(f"{'impl':<8}{'N':>4}{'S':>7}{'ms':>11}{'x torch':>9}")
    for r in merge:
        if "error" in r:
            print(f"{r['impl']:<8}{r['n']:>4}{r['s']:>7}   unavailable: {r['error']}")
        else:
            print(f"{r['impl']:<8}{r['n']:>4}{r['s']:>7}{r['ms']:>11.4f}{r['x_torch']:>9.2f}")
    summary = {
        **head, "complete": True, "attention": attn, "merge": merge,
        "fast_backend_worst_x_sdpa": max((r["x_sdpa"] for r in attn if r["impl"] in ("cpu_flash", "flash_attn")),
                                         default=None),
    }
    print(json.dumps(summary))
    if args.json_out is not None:
        write_json_line(args.json_out, summary)


if __name__ == "__main__":
    main()
