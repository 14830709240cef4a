"""Where a decode step goes: torch.profiler over decode steps, split by Magnetar's profiler ranges (issue 33, item 1).

    python benchmarks/profile_decode.py                              # SmolLM2-135M, 4K context, dense and 2-rank
                                                                     # pulsar (simulated), batch 1 and 8
    torchrun --nproc-per-node 2 benchmarks/profile_decode.py --configs pulsar   # real gloo ranks (rank 0 reports)

For each configuration (``dense``: one rank; ``pulsar``: 2 CP ranks, simulated in one process unless launched with
2 ranks) and batch size, one ``--context-tokens`` document is encoded once, ``--batch`` questions about it join one
decode batch (``ContinuousBatch``), a few warm-up steps run, then ``--steps`` steps are timed unprofiled
(ms/step, ms/token) and ``--steps`` more under ``torch.profiler`` (CPU). The profiled time of a step is split by
Magnetar's ranges (docs/profiling.md) and, outside them, by the outermost ATen op:

* **attention, local KV** -- ``magnetar/attention/*`` inside ``magnetar/phase2/layer{n}`` (the query over its
  context shard and over its own generated KV);
* **gather** / **merge** -- ``magnetar/phase2/gather`` (the packed all-gather of (out, lse), the wait for the
  other ranks included; none on one rank) and ``magnetar/phase2/merge``;
* **attention hook, rest** -- the rest of ``magnetar/phase2/layer{n}``: appending the new token's KV to the
  generated store (a concatenation every step), the per-request loop, slicing and stacking (its Python too);
* **model matmuls** -- ``aten::linear`` / ``mm`` / ``addmm`` / ``matmul`` / ``bmm`` outside the attention hook
  (q/k/v/o projections, MLP, the LM head);
* **other model ops** -- every other ATen op outside the hook and the sampler (norms, RoPE, activations,
  embedding, residual adds, casts);
* **sampler** -- ``magnetar/phase2/sample`` (choosing, broadcasting, the stop criteria);
* **Python / framework** -- the rest of the step: Python and the Hugging Face module calls outside the attention
  hook, dispatch, the profiler's own cost.

Prints a table per configuration, then one JSON line. The profiler adds overhead: the unprofiled ms/step is the
speed figure, the profiled split is the share.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
from bench_decode import engine_flat, launched  # benchmarks/: the script's own folder is first on sys.path

MATMULS = {"aten::linear", "aten::mm", "aten::addmm", "aten::matmul", "aten::bmm"}
BUCKETS = ("attention, local KV", "gather", "merge", "attention hook, rest", "model matmuls", "other model ops",
           "sampler", "Python / framework")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--configs", default="dense,pulsar", help="comma list of: dense, pulsar (2 CP ranks)")
    p.add_argument("--batches", default="1,8", help="decode batch sizes")
    p.add_argument("--context-tokens", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=12, help="steps timed, then as many profiled")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: the process's)")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not args.configs or any(c not in ("dense", "pulsar") for c in args.configs):
        p.error("--configs: a comma list of dense, pulsar")
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches: comma-separated ints, got {args.batches!r}")
    if min(args.batches) < 1 or args.steps < 2 or args.context_tokens < 64:
        p.error("--batches >= 1, --steps >= 2, --context-tokens >= 64")
    return args


def engine_for(config: str, model, tokenizer, distributed: bool):
    import magnetar

    return magnetar.init_inference(model, tokenizer=tokenizer, deepspeed_inference=False,
                                   **engine_flat(config, distributed))


def split_profile(prof, steps: int) -> dict[str, float]:
    """ms per step in each bucket, from the profiler's events: the ranged parts by their ranges' inclusive time
    (the collective's wait is inside ``gather``), the model's ops outside them by their outermost ATen op, and the
    rest of the step as Python / framework."""
    events = list(prof.events())
    total = {b: 0.0 for b in BUCKETS}

    def ancestors(e):
        out, parent = [], e.cpu_parent
        while parent is not None:
            out.append(parent.name)
            parent = parent.cpu_parent
        return out

    step_us = sum(e.cpu_time_total for e in events if e.name.startswith("magnetar/phase2/decode/step"))
    hook_us = 0.0
    for e in events:
        names = ancestors(e)
        if not any(n.startswith("magnetar/phase2/decode/step") for n in names):
            continue
        if e.name.startswith("magnetar/phase2/layer"):
            hook_us += e.cpu_time_total
        elif e.name.startswith("magnetar/attention/") and any(n.startswith("magnetar/phase2/layer") for n in names):
            total["attention, local KV"] += e.cpu_time_total
        elif e.name.startswith("magnetar/phase2/gather"):
            total["gather"] += e.cpu_time_total
        elif e.name.startswith("magnetar/phase2/merge"):
            total["merge"] += e.cpu_time_total
        elif e.name.startswith("magnetar/phase2/sample"):
            total["sampler"] += e.cpu_time_total
        elif e.name.startswith("aten::") and not any(n.startswith(("aten::", "magnetar/phase2/layer",
                                                                      "magnetar/phase2/sample")) for n in names):
            total["model matmuls" if e.name in MATMULS else "other model ops"] += e.cpu_time_total
    total["attention hook, rest"] = max(0.0, hook_us - total["attention, local KV"] - total["gather"] -
                                        total["merge"])
    total["Python / framework"] = max(0.0, step_us - hook_us - total["sampler"] - total["model matmuls"] -
                                      total["other model ops"])
    return {b: us / 1000 / steps for b, us in total.items()} | {"profiled step": step_us / 1000 / steps}


def run(config: str, batch: int, args, model, tokenizer, doc: str, questions: list[str], distributed: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    eng = engine_for(config, model, tokenizer, distributed)
    handle = eng.encode(doc)
    b = eng.open_batch()
    n = args.warmup + 2 * args.steps + 2
    for q in questions[:batch]:
        b.add(handle, q, eng.sampling_params(max_new_tokens=n, temperature=0.0))
    for _ in range(args.warmup):
        b.step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        b.step()
    ms = 1000 * (time.perf_counter() - t0) / args.steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            b.step()
    split = split_profile(prof, args.steps)
    for rid in list(b.active):
        b.cancel(rid)
    for rid in list(b.finished):
        b.pop(rid)
    return dict(config=config, batch=batch, ms_per_step=ms, ms_per_token=ms / batch, split=split,
                ranks=2 if config == "pulsar" else 1, simulated=config == "pulsar" and not distributed)


def main(argv=None) -> int:
    args = parse_args(argv)
    distributed = launched(args)
    from magnetar.data.niah import needle_prompt
    from magnetar.models import load_model

    model, tokenizer = load_model(args.model)
    s = needle_prompt(tokenizer, args.context_tokens, 0.5, seed=0)
    questions = [s.query] + [f"Question {i}: what does the text say about topic {i}?" for i in range(1, 16)]
    rows = [run(c, bsz, args, model, tokenizer, s.context, questions, distributed)
            for c in args.configs for bsz in args.batches]
    if distributed and int(os.environ.get("RANK", "0")) != 0:
        return 0
    for r in rows:
        where = f"{r['ranks']} rank(s){' simulated' if r['simulated'] else ''}"
        print(f"\n## {r['config']} ({where}), batch {r['batch']}: {r['ms_per_step']:.1f} ms/step unprofiled "
              f"({r['ms_per_token']:.1f} ms/token), {r['split']['profiled step']:.1f} ms/step profiled\n")
        print("| part | ms/step | share |")
        print("|---|---:|---:|")
        step = r["split"]["profiled step"] or 1.0
        for bucket in BUCKETS:
            print(f"| {bucket} | {r['split'][bucket]:.2f} | {100 * r['split'][bucket] / step:.0f} % |")
    print(json.dumps(dict(bench="profile_decode", model=args.model, context_tokens=args.context_tokens,
                          threads=torch.get_num_threads(), machine=f"{platform.machine()}", rows=rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
