"""The CPU's matrix products at a model's own shapes, by kernel: which one a decode step (a few rows: one per
request) and a prefill (many rows) should reach.

    python benchmarks/bench_gemm.py                                  # SmolLM2-135M's shapes, 1 / 4 / 8 / 16 / 1024 rows
    python benchmarks/bench_gemm.py --rows 1,8,64 --threads 2
    python benchmarks/bench_gemm.py --dtype bfloat16                # bf16 weights (MKL's packed GEMM is fp32-only)

For each distinct ``(out, in)`` shape of the model's ``nn.Linear`` layers, the siblings a decode step fuses
(q/k/v, gate/up: ``magnetar.engine.gemv``) as one shape, and each row count of ``--rows``, the seconds of one product
``x (rows, in) -> (rows, out)`` by:

* ``linear``: ``F.linear(x, W)`` with ``W (out, in)`` row-major, as ``nn.Linear`` keeps it (MKL's sgemm);
* ``transposed``: ``x @ W.T`` with ``W.T`` stored ``(in, out)`` row-major (the layout ``relayout_for_decode`` keeps
  where a timed pass says so);
* ``mkl_packed``: MKL's packed GEMM (``torch.ops.mkl._mkl_linear`` over ``_mkl_reorder_linear_weight``; fp32 only);
* ``onednn_packed``: oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise`` over ``_reorder_linear_weight``, the
  path torch.compile's CPU backend takes) -- a second copy of the weights in oneDNN's blocked layout;
* ``small_gemm``: Magnetar's few-row bf16 op (``magnetar.ops.small_gemm``, AVX-512 BF16 CPUs; bf16 only) over its own
  blocked copy -- the other kind of copy ``magnetar.engine.gemv`` times for a bf16 decode step.

Each product reads ``--copies`` distinct weight matrices in turn (so the weights come from memory, as in a decode
step, not from the caches), best of ``--passes``. Prints a table (microseconds per product and the rate: GB/s of
weights read for few rows, GFLOP/s for many), then one JSON line. Every kernel's result is checked against
``linear``'s (the dtype's tolerance) first.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

KERNELS = ("linear", "transposed", "mkl_packed", "onednn_packed", "small_gemm")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="an installed model name or a folder")
    p.add_argument("--rows", default="1,4,8,16,1024", help="comma list of row counts (requests of a decode step)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the weights' and rows' dtype")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a decode step runs on one here)")
    p.add_argument("--copies", type=int, default=24, help="distinct weight matrices cycled through (cold reads)")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--json-out", default=None, help="also write the JSON record to this file")
    args = p.parse_args(argv)
    try:
        args.rows = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        p.error(f"--rows: comma-separated ints, got {args.rows!r}")
    if not args.rows or min(args.rows) < 1 or args.copies < 1 or args.passes < 1 or args.threads < 1:
        p.error("--rows >= 1 each, --copies, --passes and --threads >= 1")
    return args


def model_shapes(model) -> list[tuple[str, int, int]]:
    """``(name, out, in)`` of each distinct linear shape of ``model``, the fused siblings' as one (out summed), and
    the LM head's."""
    from magnetar.engine.gemv import SIBLINGS  # the layers a decode step fuses

    shapes: dict[tuple[int, int], str] = {}
    for name, m in model.named_modules():
        for group in SIBLINGS:
            kids = [getattr(m, g, None) for g in group]
            if all(isinstance(k, nn.Linear) for k in kids):
                key = (sum(k.out_features for k in kids), kids[0].in_features)
                shapes.setdefault(key, "+".join(g.split("_")[0] for g in group))
        if isinstance(m, nn.Linear):
            shapes.setdefault((m.out_features, m.in_features), name.rsplit(".", 1)[-1])
    return [(n, o, i) for (o, i), n in shapes.items()]


def kernels(weights: list[torch.Tensor], rows: int) -> dict:
    """Each kernel as ``f(x, k)`` over the ``k``-th of ``weights`` (its operands prepared once, as a model would)."""
    out = {"linear": lambda x, k: F.linear(x, weights[k])}
    wt = [w.t().contiguous() for w in weights]
    out["transposed"] = lambda x, k: x @ wt[k]
    if hasattr(torch.ops.mkl, "_mkl_linear") and weights[0].dtype == torch.float32:
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
        out["mkl_packed"] = lambda x, k: torch.ops.mkl._mkl_linear(x, mkl[k], weights[k], None, rows)
    if torch.backends.mkldnn.is_available():
        dnn = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
        out["onednn_packed"] = lambda x, k: torch.ops.mkldnn._linear_pointwise(x, dnn[k], None, "none", [], "")
    from magnetar.ops.small_gemm import SmallGemm, small_gemm_unavailable, weight_reason

    if weight_reason(weights[0]) is None:

        if small_gemm_unavailable() is None:
            small = [SmallGemm(w) for w in weights]
            out["small_gemm"] = lambda x, k: small[k](x)
    return out


def time_kernel(f, x: torch.Tensor, copies: int, passes: int) -> float:
    """Seconds of one product, the best of ``passes`` passes over the ``copies`` matrices (one unmeasured first)."""
    best = float("inf")
    with torch.no_grad():
        for i in range(passes + 1):
            t0 = time.perf_counter()
            for k in range(copies):
                f(x, k)
            if i:
                best = min(best, (time.perf_counter() - t0) / copies)
    return best


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from magnetar.models import load_model
    from magnetar.utils.machine import cpu_description

    model, _ = load_model(args.model)
    dtype = getattr(torch, args.dtype)
    size = torch.finfo(dtype).bits // 8
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # two kernels' roundings of one product (bf16: 8 mantissa bits)
    g = torch.Generator().manual_seed(0)
    rows_out = []
    for name, o, i in model_shapes(model):
        copies = max(1, min(args.copies, (256 << 20) // (size * o * i)))  # at most ~256 MiB of copies
        weights = [(torch.randn(o, i, generator=g) * i ** -0.5).to(dtype) for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, i, generator=g).to(dtype)
            ks = kernels(weights, m)
            want = F.linear(x, weights[0])
            for k, f in ks.items():
                torch.testing.assert_close(f(x, 0), want, rtol=tol, atol=tol, msg=f"{k} at {name} {m} rows")
            for k, f in ks.items():
                s = time_kernel(f, x, copies, args.passes)
                rows_out.append(dict(shape=name, out=o, inp=i, rows=m, kernel=k, us=1e6 * s,
                                     gbps=size * o * i / s / 1e9, gflops=2 * m * o * i / s / 1e9))
            done = [r for r in rows_out if r["shape"] == name and r["rows"] == m]
            print(f"[bench_gemm] {name} ({o} x {i}), {m} rows: " +
                  ", ".join(f"{r['kernel']} {r['us']:.0f} us" for r in done), file=sys.stderr, flush=True)
    print(f"\n{args.model} shapes, {args.dtype}, {args.threads} thread(s), {cpu_description()}, torch "
          f"{torch.__version__}\n")
    print("| shape (out x in) | rows | " + " | ".join(f"{k} us" for k in KERNELS) + " | fastest | vs linear |")
    print("|---|---:|" + "---:|" * len(KERNELS) + "---|---:|")
    for name, o, i in model_shapes(model):
        for m in args.rows:
            got = {r["kernel"]: r for r in rows_out if r["shape"] == name and r["rows"] == m}
            best = min(got.values(), key=lambda r: r["us"])
            cells = " | ".join("-" if k not in got else f"{got[k]['us']:.0f}" for k in KERNELS)
            print(f"| {name} ({o} x {i}) | {m} | {cells} | {best['kernel']} | "
                  f"{got['linear']['us'] / best['us']:.2f}x |")
    record = dict(bench="gemm", model=args.model, dtype=args.dtype, threads=args.threads, cpu=cpu_description(),
                  torch=torch.__version__, rows=rows_out)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(record, f)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
