"""Benchmark the rotary position embedding on the CPU: transformers' ``apply_rotary_pos_emb`` (nine torch ops a
tensor) against Magnetar's one-pass op (``magnetar.ops.rotary``, what ``magnetar.engine.rotary`` puts in a model), for
q and k as a Llama attention makes them (views of the projections' outputs), at a decode step's batch of tokens and a
query forward's thousands, in float32 and bfloat16.

    python benchmarks/bench_rotary.py                              # SmolLM2's heads (9 q, 3 kv, 64 wide)
    python benchmarks/bench_rotary.py --heads 32 --kv-heads 8 --head-dim 128 --tokens 1 8 4096 --threads 1

``--tokens`` counts a batch's tokens: up to 64 a decode step's (that many requests, one token each), more one query
forward's. The two are timed interleaved, round by round (``bench_ops.timed``); each row says in how many elements
the op differs from transformers' (none: it rounds as the function does). Prints a table, then one JSON line (times
are medians, in microseconds).
"""
from __future__ import annotations

import argparse

import torch

from bench_ops import add_cpu_op_args, cpu_machine, cpu_op_summary, timed
from magnetar.ops.rotary import rotary, rotary_unavailable

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DECODE_BATCH = 64  # --tokens up to this: a decode step of that many requests; above: one request's query forward


def bench(heads: int, kv_heads: int, D: int, tokens: int, dtype: torch.dtype, warmup: int, repeats: int) -> list[dict]:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(tokens)
    B, S = (tokens, 1) if tokens <= DECODE_BATCH else (1, tokens)
    q = (3 * torch.randn(B, S, heads * D, generator=g)).to(dtype).view(B, S, heads, D).transpose(1, 2)
    k = (3 * torch.randn(B, S, kv_heads * D, generator=g)).to(dtype).view(B, S, kv_heads, D).transpose(1, 2)
    cos, sin = (torch.randn(B, S, D, generator=g).to(dtype) for _ in range(2))
    fns = {"hf": lambda: apply_rotary_pos_emb(q, k, cos, sin)}
    if rotary_unavailable() is None:
        fns["magnetar"] = lambda: rotary(q, k, cos, sin)
    with torch.no_grad():
        own = fns["hf"]()
        times = timed(fns, torch.device("cpu"), warmup, repeats)
        out = []
        for name, ms in times.items():
            differ = sum(int((a != b).sum()) for a, b in zip(fns[name](), own))
            out.append({"impl": name, "tokens": tokens, "batch": B, "heads": heads, "kv_heads": kv_heads,
                        "head_dim": D, "dtype": str(dtype).removeprefix("torch."), "us": ms * 1e3,
                        "x_hf": ms / times["hf"], "differ_from_hf": differ, "elements": q.numel() + k.numel()})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2-135M: 9)")
    p.add_argument("--kv-heads", type=int, default=3, help="key/value heads (SmolLM2-135M: 3)")
    p.add_argument("--head-dim", type=int, default=64, help="head size D, even (SmolLM2-135M: 64)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 1000, 4000])
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    add_cpu_op_args(p)
    args = p.parse_args(argv)
    if min(args.heads, args.kv_heads, args.head_dim, *args.tokens) < 1 or args.head_dim % 2:
        p.error(f"--heads, --kv-heads, --head-dim and --tokens must be positive and --head-dim even, got --heads "
                f"{args.heads} --kv-heads {args.kv_heads} --head-dim {args.head_dim} --tokens {args.tokens}")
    if args.threads:
        torch.set_num_threads(args.threads)
    reason = rotary_unavailable()
    rows = [r for d in args.dtypes for n in args.tokens
            for r in bench(args.heads, args.kv_heads, args.head_dim, n, DTYPES[d], args.warmup, args.repeats)]
    machine = cpu_machine()
    print(f"# The rotary embedding on the CPU ({args.heads} q / {args.kv_heads} kv heads of {args.head_dim}; "
          f"{machine})" + (f"; Magnetar's op not run: {reason}" if reason else ""))
    print("| dtype | tokens | q shape | impl | us | x HF | elements differing from HF |")
    print("|---|---:|---|---|---:|---:|---:|")
    for r in rows:
        shape = f"{r['batch']} x {r['heads']} x {r['tokens'] // r['batch']} x {r['head_dim']}"
        print(f"| {r['dtype']} | {r['tokens']} | {shape} | {r['impl']} | {r['us']:.1f} | {r['x_hf']:.2f} | "
              f"{r['differ_from_hf']} of {r['elements']} |")
    return cpu_op_summary("rotary", reason, rows, args.json_out)


if __name__ == "__main__":
    main()
