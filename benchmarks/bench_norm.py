"""Benchmark RMSNorm on the CPU: Hugging Face's ``LlamaRMSNorm`` (eight torch ops), torch's fused
``F.rms_norm`` and Magnetar's one-pass op (``magnetar.ops.rms_norm``, what ``magnetar.engine.norms`` swaps into a
model), at a decode step's few rows and a query forward's thousand, in float32 and bfloat16.

    python benchmarks/bench_norm.py                          # SmolLM2's width (576), 1 / 8 / 1000 rows
    python benchmarks/bench_norm.py --width 4096 --rows 1 8 4096 --threads 1

The three are timed interleaved, round by round (``bench_ops.timed``). Each row also says in how many elements the
two others differ from Hugging Face's values (Magnetar's op: none in bfloat16, the rounding of a float32 sum taken
in another order in float32; ``F.rms_norm`` rounds the normalized row once less). Prints a table, then one JSON line
(times are medians, in microseconds).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench_ops import add_cpu_op_args, cpu_machine, cpu_op_summary, timed
from magnetar.ops.rms_norm import rms_norm, rms_norm_unavailable

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def bench(width: int, rows: int, dtype: torch.dtype, warmup: int, repeats: int) -> list[dict]:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(rows)
    norm = LlamaRMSNorm(width, eps=1e-5).to(dtype).eval()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=g))
    x = (3 * torch.randn(1, rows, width, generator=g)).to(dtype)
    fns = {"hf": lambda: norm(x), "torch_fused": lambda: F.rms_norm(x, (width,), norm.weight, 1e-5)}
    if rms_norm_unavailable() is None:
        fns["magnetar"] = lambda: rms_norm(x, norm.weight, 1e-5)
    with torch.no_grad():
        own = norm(x)
        times = timed(fns, torch.device("cpu"), warmup, repeats)
        out = []
        for name, ms in times.items():
            differ = int((fns[name]() != own).sum())
            out.append({"impl": name, "rows": rows, "width": width, "dtype": str(dtype).removeprefix("torch."),
                        "us": ms * 1e3, "x_hf": ms / times["hf"], "differ_from_hf": differ, "elements": x.numel()})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=576, help="the hidden size H (SmolLM2-135M: 576)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 1000])
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    add_cpu_op_args(p)
    args = p.parse_args(argv)
    if args.width < 1 or any(r < 1 for r in args.rows):
        p.error(f"--width and --rows must be positive, got --width {args.width} --rows {args.rows}")
    if args.threads:
        torch.set_num_threads(args.threads)
    reason = rms_norm_unavailable()
    rows = [r for d in args.dtypes for n in args.rows for r in bench(args.width, n, DTYPES[d], args.warmup,
                                                                     args.repeats)]
    machine = cpu_machine()
    print(f"# RMSNorm on the CPU (H={args.width}; {machine})"
          + (f"; Magnetar's op not run: {reason}" if reason else ""))
    print("| dtype | rows | impl | us | x HF | elements differing from HF |")
    print("|---|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['dtype']} | {r['rows']} | {r['impl']} | {r['us']:.1f} | {r['x_hf']:.2f} | "
              f"{r['differ_from_hf']} of {r['elements']} |")
    return cpu_op_summary("norm", reason, rows, args.json_out)


if __name__ == "__main__":
    main()
