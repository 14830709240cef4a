"""Time to first token of sparse prefill vs dense prefill (paper Sec. 7.4 / 8.5-8.7), with a submodule profile.

    python benchmarks/bench_prefill.py                                        # SmolLM2-135M, 2K/4K/8K, CPU
    python benchmarks/bench_prefill.py --lengths 8k,16k,32k --device cuda --dtype bfloat16 --indexer-path ix.pt
    python benchmarks/bench_prefill.py --tiny --lengths 1k --repeats 1        # random tiny Llama, seconds

Per context length, batch 1, method dense (one rank): for each mode -- ``dense`` (no sparse prefill),
``oracle`` per query (``b_sel 1``) and block-shared (``b_sel`` = ``--block``), ``indexer`` per query and
block-shared -- one warm-up request, then ``--repeats`` timed requests (default 5; the paper: one warm-up and 10,
median), the modes interleaved round by round. TTFT is the wall time of ``generate(context, query,
max_new_tokens=1)``: Phase 1 over the context (where sparse prefill acts), the query's forward and the first
token; the GPU is synchronised before and after. Also reported: the Phase-1 share, the speed-up vs dense at
the same length and the causal token-pair sparsity the engine realised. The budget ``k`` is ``--topk``, or by
default the paper's schedule by context length (``4096:256,8192:512,16384:1024,*:2048``).

The indexer uses ``--indexer-path`` (distilled: ``magnetar-calibrate indexer``) or, without it, random weights:
those rows are labelled "untrained stress test" -- they time the sparse path only and say nothing about
quality (Sec. 7.1).

Profile (a separate run after the timed ones, because it synchronises the GPU around every stage): per
patched layer, ``projection`` (indexer q/k projections, LayerNorm, RoPE), ``score + top-k`` (indexer:
ReLU(q k^T) scores, block max, causal mask, top-k; oracle: its two dense QK^T passes, head-averaged P and
top-k), ``sparse attention`` (gathering the support's K/V and attending to it) and ``accounting`` (counting
the realised pairs, bookkeeping only); for ``dense`` the same layers' ``dense attention``
(``attention_with_lse``, timed through the policy with a budget no layer reaches). Prints the tables, then one
JSON line. The oracle computes dense attention to choose its support: it is an instrument, not a speed-up.
On CPU the oracle's and the indexer's scoring + top-k and the sparse attention run in the fused DeepSpeed op
(``magnetar/ops/csrc/sparse_attention.cpp``: only the selected K/V rows are read); on CUDA all three are
PyTorch (no CUDA kernel for them yet).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

STAGES = ("projection", "score_topk", "sparse_attention", "dense_attention", "accounting")
NO_BUDGET = 2 ** 31 - 1  # a top-k no context reaches: the policy's dense path (for the dense profile)


def tiny_model(seed: int = 0):
    """A random Llama (4 layers, hidden 256, 8 query / 2 KV heads of 32) for smoke runs without weights."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=1 << 17,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


def modes(names: list[str], block: int, indexer_path) -> list[dict]:
    """``[{"mode", "label", "flat"}]``: the engine options of each requested mode."""
    out = []
    ix = {"prefill_indexer_path": indexer_path} if indexer_path else {"prefill_indexer_random_init": True}
    tag = "" if indexer_path else ", untrained stress test"
    for name in names:
        if name == "dense":
            out.append({"mode": name, "label": "dense", "flat": {}})
        elif name in ("oracle", "indexer"):
            for b in (1, block):
                extra = ix if name == "indexer" else {}
                kind = "per query" if b == 1 else "block-shared"
                label = f"{name} {kind} (b_sel {b}{tag if name == 'indexer' else ''})"
                out.append({"mode": name, "b_sel": b, "label": label,
                            "flat": {"prefill_policy": name, "prefill_b_sel": b, **extra}})
        else:
            raise SystemExit(f"unknown mode {name!r}; choose from dense, oracle, indexer")
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tiny", action="store_true", help="a random tiny Llama instead of --model (smoke runs)")
    p.add_argument("--lengths", default="2k,4k,8k")
    p.add_argument("--modes", default="dense,oracle,indexer")
    p.add_argument("--topk", type=int, default=0, help="keys per query (block); 0: the paper's schedule by length")
    p.add_argument("--block", type=int, default=64, help="b_sel of the block-shared rows")
    p.add_argument("--indexer-path", help="distilled indexer file; without it the indexer is an untrained stress test")
    p.add_argument("--d-idx", type=int, default=0, help="indexer width (0: the file's; random init: 128)")
    p.add_argument("--query-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-profile", action="store_true", help="skip the submodule profile")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int)
    p.add_argument("--beyond-trained-length", action="store_true",
                   help="allow contexts past the model's max_position_embeddings (timing only: outputs there are "
                        "meaningless; the real text's windows are used as they are)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")

    import magnetar
    from magnetar.config import EngineConfig
    from magnetar.eval.bench import allow_positions
    from magnetar.eval.common import parse_length
    from magnetar.utils.timing import SectionTimer

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.tiny:
        model, tokenizer, name = tiny_model().to(device=device, dtype=dtype), None, "tiny random Llama"
    else:
        from magnetar.models import load_model

        model, tokenizer = load_model(args.model, dtype=dtype, device=device)
        name = args.model

    longest = max(parse_length(x) for x in args.lengths.split(",") if x.strip()) + args.query_tokens + 1
    name = allow_positions(model, longest, name, "--lengths + --query-tokens + 1 generated token",
                           args.beyond_trained_length, prog=p.prog)
    mlist = modes([m.strip() for m in args.modes.split(",") if m.strip()], args.block, args.indexer_path)

    def engine(flat: dict):
        # context_cache_mb 0: every timed request runs its Phase 1
        cfg = EngineConfig.create(method="dense", dtype=args.dtype, context_cache_mb=0, **flat)
        if flat.get("prefill_policy"):
            cfg = cfg.replace(prefill_topk=flat.get("prefill_topk", args.topk), prefill_d_idx=args.d_idx)
        return magnetar.init_inference(model, cfg, tokenizer=tokenizer)

    engines = {m["label"]: engine(m["flat"]) for m in mlist}
    rows, profile = [], []
    for L in (parse_length(x) for x in args.lengths.split(",")):
        if tokenizer is not None:
            from magnetar.eval.ppl import ppl_window

            win = ppl_window(tokenizer, L, 0, target_tokens=max(16, args.query_tokens))
            ctx, query = win.context_ids, win.continuation_ids[:args.query_tokens]
        else:
            g = torch.Generator().manual_seed(L)
            ctx = torch.randint(0, model.config.vocab_size, (L,), generator=g)
            query = torch.randint(0, model.config.vocab_size, (args.query_tokens,), generator=g)

        def request(eng):  # synchronised on the engine's device (init_inference picks cuda:0 when there is one)
            _sync(eng.device)
            t0 = time.perf_counter()
            res = eng.generate(ctx, query, max_new_tokens=1)
            _sync(eng.device)
            return time.perf_counter() - t0, res

        for m in mlist:  # warm-up
            request(engines[m["label"]])
        times = {m["label"]: [] for m in mlist}
        phase1 = {m["label"]: [] for m in mlist}
        last = {}
        for _ in range(args.repeats):  # interleaved: drift on a shared machine hits every mode alike
            for m in mlist:
                t, res = request(engines[m["label"]])
                times[m["label"]].append(t)
                phase1[m["label"]].append(res.phase1_seconds[0])
                last[m["label"]] = res
        for m in mlist:
            st = last[m["label"]].prefill_stats or {}
            rows.append({"length": L, "context_tokens": int(ctx.numel()), "mode": m["mode"], "label": m["label"],
                         "b_sel": m.get("b_sel"), "topk": st.get("topk"),
                         "ttft_ms": 1e3 * statistics.median(times[m["label"]]),
                         "phase1_ms": 1e3 * statistics.median(phase1[m["label"]]),
                         "ttft_ms_all": [round(1e3 * t, 3) for t in times[m["label"]]],
                         "sparsity": st.get("sparsity"), "formula_sparsity": st.get("formula_sparsity"),
                         "patched_layers_per_request": st.get("patched_calls"), "empty_rows": st.get("empty_rows"),
                         "untrained_indexer": m["mode"] == "indexer" and not args.indexer_path})
            print(f"  {L} {m['label']}: TTFT {rows[-1]['ttft_ms']:.1f} ms", file=sys.stderr, flush=True)

        if args.no_profile:
            continue
        for m in mlist:
            if m["mode"] == "dense":
                eng = engine({"prefill_policy": "oracle", "prefill_topk": NO_BUDGET})  # dense path, timed
            else:
                eng = engines[m["label"]]
            timer = SectionTimer()
            eng.prefill.timer = timer
            try:
                _, res = request(eng)
            finally:
                eng.prefill.timer = None
            calls = max(1, res.prefill_stats["patched_calls"])
            profile.append({"length": L, "mode": m["mode"], "label": m["label"], "patched_calls": calls,
                            **{f"{s}_ms_per_layer": 1e3 * timer.seconds.get(s, 0.0) / calls for s in STAGES}})

    dense = {r["length"]: r["ttft_ms"] for r in rows if r["mode"] == "dense"}
    for r in rows:
        r["speedup_vs_dense"] = dense[r["length"]] / r["ttft_ms"] if r["length"] in dense else None
    cpu = platform.processor() or platform.machine()
    run_device = next(iter(engines.values())).device
    gpu = torch.cuda.get_device_name(run_device) if run_device.type == "cuda" else None
    print(f"\nSparse-prefill TTFT, {name}, {run_device} ({gpu or cpu}, {torch.get_num_threads()} threads), "
          f"{args.dtype}, batch 1, {args.query_tokens} query tokens, median of {args.repeats} after 1 warm-up, "
          f"k = {args.topk or 'schedule ' + '4096:256,8192:512,16384:1024,*:2048'}")
    print("| context | mode | k | TTFT ms | phase 1 ms | vs dense | realised sparsity |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        sp = "-" if r["sparsity"] is None else f"{100 * r['sparsity']:.1f} %"
        speed = "-" if r["speedup_vs_dense"] is None else f"{r['speedup_vs_dense']:.2f}x"
        print(f"| {r['length']} | {r['label']} | {r['topk'] or '-'} | {r['ttft_ms']:.1f} | {r['phase1_ms']:.1f} | "
              f"{speed} | {sp} |")
    if profile:
        print("\nSubmodule profile, ms per patched layer (one request, synchronised stage by stage)")
        print("| context | mode | projection | score + top-k | sparse attention | dense attention | accounting | sum |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for r in profile:
            cells = [r[f"{s}_ms_per_layer"] for s in STAGES]
            print(f"| {r['length']} | {r['label']} | " + " | ".join(f"{c:.2f}" for c in cells)
                  + f" | {sum(cells):.2f} |")
    print(json.dumps({"benchmark": "prefill_ttft", "model": name, "device": str(run_device), "device_name": gpu or cpu,
                      "dtype": args.dtype, "threads": torch.get_num_threads(), "repeats": args.repeats,
                      "topk": args.topk or "schedule", "block": args.block, "indexer_path": args.indexer_path,
                      "rows": rows, "profile": profile}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
