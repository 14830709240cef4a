"""Decode speed of LuKA vs dense decoding, with the latency breakdown the LuKA paper's Figure 3 shows.

    python benchmarks/bench_luka.py                                   # SmolLM2-135M, 2K/4K/8K, CPU
    python benchmarks/bench_luka.py --lengths 8k,32k --device cuda --dtype bfloat16

Per context length: ONE dense Phase 1 (recording each key's attention mass), then, for dense decoding and each
LuKA mode (lined, clustered, mixed; the paper's settings: top_k 3, pages of 16, raw tail 128, heavy hitters
1/8, compression every 16 steps; the defaults' refinement and regime: the 8-token question is read exactly and
the pages are cut at the first generated token's forward, a one-off cost inside the mean), a greedy decode of
``--new-tokens`` tokens, ``--repeats`` times after one warm-up, each with fresh LuKA state. Reported: decode ms/token
and tokens/s (median over repeats of the mean over the tokens after the first), the speed-up vs dense, the fraction of
the context LuKA held compressed at the last token (``decode_stats``), and per token (summed over layers) the time in
the context attention and in LuKA's own parts -- ``select`` (heavy hitters), ``refine`` (choosing pages,
gathering and weighting their tokens), ``compress`` (segmenter + compressor, every 16 steps) and ``mass``
(accumulating attention mass). The breakdown synchronises the GPU around each part, so it is measured in a
separate run from the speed. Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys

import torch


class _DenseTimed:
    """Dense decoding through the decode-policy hook (a DecodePolicy), so its context attention is timed like
    LuKA's."""

    needs_prefill_mass = False
    score_chunk = 0

    def __init__(self, timer):
        self.timer = timer

    def check(self, context_tokens):
        pass

    def after_merge(self, layer, lse):
        pass

    def prefill_mass(self, q, k, lse, *, scale, q_pos, k_pos, window=None):
        raise NotImplementedError("dense decoding records no Phase-1 mass")

    def applies(self, layer, window):
        return window is None

    def attend_context(self, layer, b, q, kv, q_pos, scale, context_tokens, *, backend="auto", valid=None):
        from magnetar.ops import attention_with_lse

        with self.timer("attention"):
            return attention_with_lse(q, kv.k, kv.v, q_pos=q_pos, k_pos=kv.pos, scale=scale, backend=backend)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--lengths", default="2k,4k,8k")
    p.add_argument("--modes", default="dense,lined,clustered,mixed")
    p.add_argument("--lined-layers", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import magnetar
    from magnetar.config import EngineConfig, LukaConfig
    from magnetar.engine.phase2 import DecodeBatch, Phase2Request
    from magnetar.eval.common import parse_length
    from magnetar.eval.ppl import ppl_window
    from magnetar.luka.decoder import LukaDecoder
    from magnetar.utils.timing import SectionTimer
    from magnetar.models import load_model

    device = torch.device(args.device)
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), device=device)
    eng = magnetar.init_inference(model,
                                  EngineConfig.create(method="dense", deepspeed_inference=False, dtype=args.dtype),
                                  tokenizer=tokenizer)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]

    def decoder(mode, timer=None):
        if mode == "dense":
            return _DenseTimed(timer) if timer is not None else None
        return LukaDecoder(LukaConfig(luka_mode=mode, luka_lined_layers=args.lined_layers), model.config, timer=timer)

    rows = []
    for L in (parse_length(x) for x in args.lengths.split(",")):
        win = ppl_window(tokenizer, L, 0, target_tokens=16)
        query = win.continuation_ids[:8]
        p1 = eng.encoder.phase1(win.context_ids, variants=[decoder("lined")])  # LuKA's mass
        shard, qpos = p1.shard, p1.query_position

        def decode(dec, n):
            sampler = eng.sampler(eng.sampling_params(max_new_tokens=n))
            request = Phase2Request(shard.view(), query, qpos, L, sampler)
            batch = DecodeBatch(model, eng.config, eng.groups, eng.device, policy=dec)  # this decoder's own batch
            [rid] = batch.join([request])
            while batch.step():
                pass
            return batch.pop(rid)

        for mode in modes:
            decode(decoder(mode), 4)  # warm-up
            per_token = []
            for _ in range(args.repeats):
                d = decode(decoder(mode), args.new_tokens)
                per_token.append(sum(d.decode_seconds) / len(d.decode_seconds))
            timer = SectionTimer()
            d = decode(decoder(mode, timer), args.new_tokens)
            steps = len(d.decode_seconds) + 1
            ms = 1e3 * statistics.median(per_token)
            compressed = (d.decode_stats or {}).get("compressed_fraction")  # at the last token; None for dense
            rows.append({"length": L, "mode": mode, "decode_ms_per_token": ms, "tokens_per_s": 1e3 / ms,
                         "compressed_fraction": compressed,
                         **{f"{k}_ms_per_token": 1e3 * v / steps for k, v in sorted(timer.seconds.items())}})
            print(f"  {L} {mode}: {ms:.2f} ms/token", file=sys.stderr, flush=True)

    dense = {r["length"]: r["decode_ms_per_token"] for r in rows if r["mode"] == "dense"}
    parts = ("attention", "select", "refine", "compress", "mass")
    print(f"\nLuKA decode speed, {args.model}, {args.device} ({platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads), {args.dtype}, {args.new_tokens} new tokens, median of {args.repeats}")
    print("| context | mode | compressed | ms/token | tokens/s | vs dense | " + " | ".join(f"{x} ms" for x in parts)
          + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(parts))
    for r in rows:
        speed = dense.get(r["length"], float("nan")) / r["decode_ms_per_token"]
        r["speedup_vs_dense"] = speed
        cells = [f"{r.get(f'{x}_ms_per_token', 0.0):.2f}" for x in parts]
        held = "-" if r["compressed_fraction"] is None else f"{100 * r['compressed_fraction']:.0f} %"
        print(f"| {r['length']} | {r['mode']} | {held} | {r['decode_ms_per_token']:.2f} | {r['tokens_per_s']:.1f} | "
              f"{speed:.2f}x | " + " | ".join(cells) + " |")
    print(json.dumps({"benchmark": "luka_decode", "model": args.model, "device": args.device, "dtype": args.dtype,
                      "threads": torch.get_num_threads(), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
