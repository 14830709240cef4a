"""What the non-finite checks cost: ``runtime.check_finite`` on vs off, side by side in one process.

    python benchmarks/bench_check_finite.py                              # SmolLM2-135M, 2K/4K, dense + pulsar
    python benchmarks/bench_check_finite.py --lengths 8k --device cuda --dtype bfloat16

With ``check_finite`` on, each attention call records per layer, without a device sync, whether its output was
non-finite; Phase 1 agrees on the flags in the collective it already runs, and Phase 2 checks every step's
logits (``magnetar/engine/finite.py``). The always-on op-level NaN propagation is not switched by this flag and
is in both columns. Per length and method: two engines over the SAME loaded model, one with the check and one
without, called alternately (on, off, on, off, ...) ``--repeats`` times after one warm-up each, so drift of the
machine hits both alike. Reported: medians of the Phase-1 critical path and of decode ms/token, and their ratio
on / off. Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

import torch
from tqdm import tqdm


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--lengths", default="2k,4k")
    p.add_argument("--methods", default="dense,pulsar")
    p.add_argument("--simulate-ranks", type=int, default=4, help="ranks simulated in this process for pulsar/star")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)

    import magnetar
    from magnetar.config import METHODS
    from magnetar.data.texts import paul_graham_essays
    from magnetar.eval.common import parse_lengths, parse_names
    from magnetar.models import load_model

    lengths = parse_lengths(args.lengths)
    methods = parse_names(args.methods, tuple(METHODS), "--methods")
    dtype = getattr(torch, args.dtype)
    model, tok = load_model(args.model, dtype=dtype, device=args.device)
    text = "\n\n".join(paul_graham_essays())[: 8 * max(lengths)]  # ~4 characters a token: enough, not all
    text_ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    query = torch.tensor(tok("\nWhat is the main point of the text above?", add_special_tokens=False)["input_ids"])
    rows = []
    bar = tqdm(total=len(lengths) * len(methods) * 2 * (args.repeats + 1), desc="generate calls", unit="call",
               dynamic_ncols=True)
    for L in lengths:
        if text_ids.numel() < L:
            raise SystemExit(f"the essays hold {text_ids.numel()} tokens, fewer than --lengths {L}")
        context = text_ids[:L]
        for method in methods:
            distributed = METHODS[method].distributed
            engines = {on: magnetar.init_inference(
                model, tokenizer=tok, method=method, cp_size=args.simulate_ranks if distributed else 1,
                simulate=distributed, check_finite=on, dtype=args.dtype, context_cache_mb=0)  # every repeat: Phase 1
                for on in (True, False)}
            times = {on: {"phase1": [], "decode": []} for on in engines}
            for rep in range(args.repeats + 1):
                for on, engine in engines.items():
                    res = engine.generate(context, query, max_new_tokens=args.new_tokens)
                    bar.update()
                    bar.set_postfix(length=L, method=method, check_finite=on)
                    if rep == 0:  # warm-up
                        continue
                    times[on]["phase1"].append(res.phase1_critical_path_seconds)
                    times[on]["decode"].append(res.decode_seconds_per_token * 1e3)
            med = {on: {k: statistics.median(v) for k, v in t.items()} for on, t in times.items()}
            rows.append({"length": L, "method": method,
                         "phase1_s_on": med[True]["phase1"], "phase1_s_off": med[False]["phase1"],
                         "decode_ms_on": med[True]["decode"], "decode_ms_off": med[False]["decode"],
                         "phase1_ratio": med[True]["phase1"] / med[False]["phase1"],
                         "decode_ratio": med[True]["decode"] / med[False]["decode"]})
    bar.close()
    head = ("length", "method", "phase-1 s on/off", "ratio", "decode ms/token on/off", "ratio")
    table = [head] + [(str(r["length"]), r["method"], f"{r['phase1_s_on']:.3f} / {r['phase1_s_off']:.3f}",
                       f"{r['phase1_ratio']:.3f}", f"{r['decode_ms_on']:.1f} / {r['decode_ms_off']:.1f}",
                       f"{r['decode_ratio']:.3f}") for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    print(json.dumps({"bench": "check_finite", "model": args.model, "dtype": args.dtype, "device": args.device,
                      "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "machine": platform.machine(),
                      "repeats": args.repeats, "new_tokens": args.new_tokens, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
