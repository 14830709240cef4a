"""Benchmark the engine's methods end to end, beside the analytic cost model (magnetar.eval.cost).

    magnetar-bench --tiny --methods dense,star,pulsar --lengths 512 --cp 4 --simulate-ranks 4
    magnetar-bench --methods star,pulsar --lengths 4096 --simulate-ranks 4       # SmolLM2-135M-Instruct
    magnetar-bench --model dummy:llama-3.1-8b --dtype bfloat16 --lengths 32768 --simulate-ranks 4  # random weights
    torchrun --nproc-per-node 4 -m magnetar.eval.bench --methods ring,star,pulsar --cp 4   # real ranks
    torchrun --nproc-per-node 4 -m magnetar.eval.bench --tiny --methods star --cp 2 --tp-size 2  # TP x CP

Per (method, length): Phase-1 seconds per rank and the critical path (the slowest rank), Phase-2 TTFT,
decode ms/token, context KV bytes per rank, peak memory and the weight bytes each rank holds (a shard of
them per rank with ``--tp-size``), medians over ``--repeats`` after ``--warmup``.

Two ways to get several ranks:

* under a launcher (``torchrun``/``deepspeed``, world size = ``--cp``): every rank runs ``Engine.generate``
  and the numbers are the engine's own ``GenerationResult`` (rank 0 prints);
* ``--simulate-ranks W`` in ONE process on one device (the engine's ``simulate`` option): every CP rank's
  Phase 1 runs one rank after another, each timed on its own, so one device stands in for W: the critical
  path is the max of the per-rank times (what W devices would take, with no contention between them).
  Phase 2 then attends to all the ranks' KV joined (the same result as the gather + merge, without the
  collectives). **Ring is skipped** under ``--simulate-ranks``: its ranks exchange KV in every layer, so
  its simulation is one lock-step forward with no per-rank time (run it under a launcher). Dense and
  streaming run on one rank as usual.

Each row also shows the cost model's prediction (critical-path Phase-1 FLOPs, KV bytes) and
``s/PFLOP norm``: measured seconds per predicted FLOP, normalised to the dense row of the same length
(or the first row), i.e. 1.0 = "as fast per FLOP as dense". Inputs are random token ids (speed does not
depend on the text) or, with ``--text``, Paul Graham essays tokenised with the model's tokenizer.
Prints a table, then one JSON line with every measurement.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Optional

import torch

from magnetar.cli.args import ENGINE_FLAGS
from magnetar.config import DTYPES, METHODS
from magnetar.config.cli import add_field_args
from magnetar.engine.strategy import context_method
from magnetar.eval.common import check_attention_backend, engine_config, parse_lengths, parse_names
from magnetar.utils.cli import ArgumentParser, check_output_file, fail, int_at_least, user_errors

PROG = "magnetar-bench"



def allow_positions(model, longest: int, name: str, what: str, beyond: bool, prog: str = PROG) -> str:
    """Let a timing run use ``longest`` positions: fine within the model's ``max_position_embeddings``; past it
    only with ``beyond`` (``--beyond-trained-length``: the limit is raised, outputs there are meaningless), else
    ``PROG: error: ...`` (exit 2) naming ``what`` needs them. Returns ``name``, marked when the limit was raised."""
    trained = getattr(model.config, "max_position_embeddings", None)
    if trained is None or longest <= trained:
        return name
    if not beyond:
        fail(prog, f"{name} was trained on {trained} positions; {what} need {longest}: shorten them, or pass "
                   f"--beyond-trained-length to time them anyway (outputs past {trained} positions are meaningless)")
    model.config.max_position_embeddings = longest
    return name + f" (positions raised {trained} -> {longest} for timing)"


def tiny_model(max_positions: int, seed: int = 0):
    """A small random Llama (2 layers, h=64): quick checks of the benchmark itself."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=max_positions, eos_token_id=None, bos_token_id=None,
                         pad_token_id=None)
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


def parse_args(argv):
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a magnetar.models name, a local HF folder or a Hub id org/name")
    p.add_argument("--revision", help="--model's Hub revision: a branch, tag or commit hash (default main)")
    p.add_argument("--trust-remote-code", action="store_true", help="let --model run its own modelling code")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of --model (quick runs)")
    p.add_argument("--methods", default="dense,star,pulsar", help=f"comma-separated, from {','.join(METHODS)}")
    p.add_argument("--lengths", default="4096,8192", help="context lengths in tokens, comma-separated")
    p.add_argument("--cp", type=int_at_least(1), default=None, help="CP size for ring/star/pulsar (default: "
                   "--simulate-ranks, or the launcher's world size)")
    p.add_argument("--simulate-ranks", type=int_at_least(1), default=None, metavar="W",
                   help="run the W ranks' Phase 1 one after another in this process (see the module doc)")
    p.add_argument("--query-len", type=int_at_least(1), default=32)
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=8)
    p.add_argument("--warmup", type=int_at_least(0), default=1)
    p.add_argument("--repeats", type=int_at_least(1), default=1)
    p.add_argument("--warmup-length", type=int_at_least(1), default=None, metavar="L",
                   help="warm-up runs use a context of L tokens instead of the timed length: kernels, compiled "
                        "graphs and the allocator warm up for a fraction of the time (default: the timed length)")
    p.add_argument("--text", action="store_true", help="Paul Graham essays instead of random token ids")
    p.add_argument("--beyond-trained-length", action="store_true",
                   help="allow contexts past the model's max_position_embeddings (timing only: the weights and "
                        "shapes are real, the outputs past the trained length are meaningless)")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    # the engine fields it times: flags made from the config (types, choices; default: the config's)
    add_field_args(p.add_argument_group("engine config (defaults in magnetar/config/sections.py)"), ENGINE_FLAGS)
    p.add_argument("--tp-size", type=int_at_least(1), default=1,
                   help="tensor-parallel ranks sharing each CP rank's weights (DeepSpeed AutoTP; under a launcher: "
                        "world size = tp x cp)")
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.add_argument("--json-out", default=None, help="also write the JSON line to this file")
    args = p.parse_args(argv)
    with user_errors(PROG):
        args.methods = parse_names(args.methods, tuple(METHODS), "--methods")
        args.lengths = parse_lengths(args.lengths)
        sim = args.simulate_ranks
        if sim is not None and args.cp is not None and args.cp != sim:
            raise ValueError(f"--cp ({args.cp}) and --simulate-ranks ({sim}) differ: simulate exactly the CP ranks "
                             "you want")
        if sim is not None and args.tp_size > 1:
            raise ValueError(f"--tp-size {args.tp_size} needs one process per TP rank; --simulate-ranks runs the CP "
                             "ranks in one process: launch tp x cp ranks (torchrun/deepspeed) instead")
        for method in args.methods:  # the engine options hold for every method (e.g. --block-size >= 1)
            check_attention_backend(engine_config(args, method, args.cp or sim or 1))
        if args.text and args.tiny:
            raise ValueError("--text needs the model's tokenizer, which --tiny has not; drop one of them")
        if not args.tiny:
            from magnetar.models import check_model

            check_model(args.model, revision=args.revision)
        if args.json_out is not None:
            check_output_file(args.json_out, flag="--json-out")
    return args


def _inputs(args, model, tokenizer, L: int):
    g = torch.Generator().manual_seed(args.seed + L)
    vocab = model.config.vocab_size
    if args.text:
        from magnetar.data.niah import build_haystack

        ids = tokenizer(build_haystack(tokenizer, L, seed=args.seed), add_special_tokens=False)["input_ids"]
        ctx = torch.tensor(ids[:L], dtype=torch.long)
        if ctx.numel() < L:  # the cut lands a little short: pad with random ids to the exact length
            ctx = torch.cat((ctx, torch.randint(0, vocab, (L - ctx.numel(),), generator=g)))
    else:
        ctx = torch.randint(0, vocab, (L,), generator=g)
    query = torch.randint(0, vocab, (args.query_len,), generator=g)
    return ctx, query


def _reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _engine_run(engine, ctx, query, max_new_tokens: int) -> dict:
    _reset_peak(engine.device)
    res = engine.generate(ctx, query, max_new_tokens=max_new_tokens)
    return dict(phase1_seconds=res.phase1_seconds, ttft_seconds=res.ttft_seconds,
                decode_seconds_per_token=res.decode_seconds_per_token,
                context_kv_tokens_per_rank=res.context_kv_tokens_per_rank, kv_bytes_per_rank=res.kv_bytes_per_rank,
                peak_memory_bytes_per_rank=res.peak_memory_bytes_per_rank,
                weight_bytes_per_rank=res.weight_bytes_per_rank)


def _median_runs(runs: list[dict]) -> dict:
    out = dict(runs[-1])
    out["phase1_seconds"] = [statistics.median(r["phase1_seconds"][i] for r in runs)
                             for i in range(len(runs[0]["phase1_seconds"]))]
    out["phase1_critical_path_seconds"] = statistics.median(max(r["phase1_seconds"]) for r in runs)
    out["ttft_seconds"] = statistics.median(r["ttft_seconds"] for r in runs)
    dec = [r["decode_seconds_per_token"] for r in runs if r["decode_seconds_per_token"] is not None]
    out["decode_ms_per_token"] = statistics.median(dec) * 1e3 if dec else None
    out.pop("decode_seconds_per_token")
    out["peak_memory_bytes_per_rank"] = [max(r["peak_memory_bytes_per_rank"][i] for r in runs)
                                         for i in range(len(runs[0]["peak_memory_bytes_per_rank"]))]
    return out


def _fmt_table(rows: list[dict]) -> str:
    head = ("| method | L | ranks | P1 per rank (s) | P1 crit (s) | pred. crit GFLOP | s/PFLOP norm | "
            "TTFT (s) | decode ms/tok | KV MB/rank | pred. KV MB (max) | peak MB (max) | weights MB/rank |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['method']} | {r['context_len']} | {r['ranks']} | {r['skipped']} |" + " |" * 9)
            continue
        weights = " ".join(f"{b / 1e6:.3g}" for b in r["weight_bytes_per_rank"])
        per = " ".join(f"{t:.2f}" for t in r["phase1_seconds"])
        dec = f"{r['decode_ms_per_token']:.1f}" if r["decode_ms_per_token"] is not None else "-"
        kv = " ".join(f"{b / 1e6:.3g}" for b in r["kv_bytes_per_rank"])
        lines.append(
            f"| {r['method']}{' (sim)' if r['simulated'] else ''} | {r['context_len']} | {r['ranks']} | {per} | "
            f"{r['phase1_critical_path_seconds']:.2f} | {r['predicted']['critical_phase1_flops'] / 1e9:.4g} | "
            f"{r['time_per_flop_norm']:.2f} | {r['ttft_seconds']:.3f} | {dec} | {kv} | "
            f"{r['predicted']['max_kv_bytes'] / 1e6:.3g} | {max(r['peak_memory_bytes_per_rank']) / 1e6:.0f} | "
            f"{weights} |")
    return "\n".join(lines)


def _speedups(rows: list[dict]) -> None:
    """Add each measured row's Phase-1 critical-path speed-up over the reference row of its length (dense when
    measured, else the first method) as measured and as the cost model predicts it (FLOP ratio)."""
    measured = [r for r in rows if not r.get("skipped")]
    for r in measured:
        same = [d for d in measured if d["context_len"] == r["context_len"]]
        ref = next((d for d in same if d["method"] == "dense"), same[0])
        r["speedup_ref"] = ref["method"]
        r["speedup_measured"] = ref["phase1_critical_path_seconds"] / r["phase1_critical_path_seconds"]
        r["speedup_predicted"] = ref["predicted"]["critical_phase1_flops"] / r["predicted"]["critical_phase1_flops"]
        r["measured_over_predicted"] = r["speedup_measured"] / r["speedup_predicted"]


def _fmt_vs_model(rows: list[dict]) -> str:
    """Phase-1 critical path: measured speed-up vs the cost model's, per length (Pulsar Table 4's comparison)."""
    lines = ["| method | L | P1 crit (s) | speed-up vs | measured | predicted (FLOP) | measured / predicted |",
             "|" + "---|" * 7]
    for r in rows:
        if r.get("skipped"):
            continue
        lines.append(f"| {r['method']} | {r['context_len']} | {r['phase1_critical_path_seconds']:.2f} | "
                     f"{r['speedup_ref']} | {r['speedup_measured']:.2f}x | {r['speedup_predicted']:.2f}x | "
                     f"{r['measured_over_predicted']:.2f} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """``magnetar bench``: the model (:func:`_load`), every (length, method) timed (:func:`_measure`), rows normalised
    to dense (:func:`_normalise`), then the tables and the JSON line on rank 0 (:func:`_report`)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from magnetar.parallel import ParallelGroups  # noqa: F401  (import check before the long load)

    t_load = time.perf_counter()
    model, tokenizer, name = _load(args)
    load_s = time.perf_counter() - t_load

    import torch.distributed as dist

    from magnetar.parallel.launcher import finish_distributed, init_distributed

    init_distributed()  # under a launcher (a no-op without one): the world size, and rank 0 prints
    world = dist.get_world_size() if dist.is_initialized() else None
    cp = args.cp or args.simulate_ranks or (world // args.tp_size if world else 1)
    lead = world is None or dist.get_rank() == 0
    rows = _measure(args, model, tokenizer, cp, lead)
    _normalise(rows)
    if lead:
        _report(args, model, name, rows, cp, world, load_s)
    finish_distributed()
    return 0


def _load(args):
    """``(model, tokenizer, its name in the report)``: a tiny random Llama (``--tiny``) or ``--model`` (the one
    loader of the engine), its positions raised for timing when ``--beyond-trained-length`` allows it."""
    longest = max(args.lengths) + args.query_len + args.max_new_tokens
    if args.tiny:
        return tiny_model(max(longest, 1024)), None, "tiny-llama-random"
    from magnetar.engine.load import load_weights
    from magnetar.models import ModelNotInstalledError

    with user_errors(PROG, extra=(ModelNotInstalledError,)):
        model, tokenizer = load_weights(args.model, args.dtype, revision=args.revision,
                                        trust_remote_code=args.trust_remote_code)
    if args.text and tokenizer is None:
        fail(PROG, f"--text needs a tokenizer, and {args.model} has none (a dummy preset builds weights only): "
                   f"drop --text, or give dummy:<a folder with config.json and tokenizer files>")
    name = allow_positions(model, longest, args.model, "--lengths + --query-len + --max-new-tokens",
                           args.beyond_trained_length)
    return model, tokenizer, name


def _measure(args, model, tokenizer, cp: int, lead: bool) -> list[dict]:
    """One row per (length, method): the median of ``--repeats`` timed generate calls after ``--warmup``, with the
    cost model's prediction of the same configuration (a progress bar on rank 0's stderr)."""
    import magnetar
    from magnetar.eval.cost import estimate
    from tqdm import tqdm

    sim, engines, rows = args.simulate_ranks, {}, []

    def engine_for(cfg):
        key = (cfg.method, cfg.parallel.cp_size)
        if key not in engines:  # under --simulate-ranks the engine stands in for the ranks (config simulate)
            run_cfg = cfg.replace(simulate=True) if sim and cfg.parallel.cp_size > 1 else cfg
            engines[key] = magnetar.init_inference(model, run_cfg, tokenizer=tokenizer)
        return engines[key]

    # one tick per timed or warm-up generate call (stderr: the table and JSON line stay on stdout)
    bar = tqdm(total=len(args.lengths) * len(args.methods) * (args.warmup + args.repeats), unit="run",
               dynamic_ncols=True, file=sys.stderr, desc="magnetar bench", disable=not lead)
    for L in args.lengths:
        ctx, query = _inputs(args, model, tokenizer, L)
        warm_ctx = ctx if args.warmup_length is None else ctx[: min(L, args.warmup_length)]
        for method in args.methods:
            cfg = engine_config(args, method, cp)
            ranks = cfg.parallel.cp_size
            row = dict(method=method, context_len=L, query_len=int(query.numel()), ranks=ranks,
                       simulated=bool(sim) and ranks > 1)
            if sim and context_method(method).lockstep_ranks and ranks > 1:
                row["skipped"] = (f"{method} is not simulated (its ranks exchange KV every layer, so one process "
                                  f"times them as one forward): run it under a launcher")
                rows.append(row)
                bar.update(args.warmup + args.repeats)
                continue
            engine = engine_for(cfg)
            runs = []
            for i in range(args.warmup + args.repeats):
                bar.set_postfix_str(f"{method} L={L} {'warm-up' if i < args.warmup else 'run'}")
                out = _engine_run(engine, warm_ctx if i < args.warmup else ctx, query, args.max_new_tokens)
                bar.update(1)
                if i >= args.warmup:
                    runs.append(out)
            row.update(_median_runs(runs))
            pred = estimate(model.config, cfg, L, int(query.numel()), context_ids=ctx)
            row["predicted"] = dict(
                phase1_flops_per_rank=pred.phase1_flops, critical_phase1_flops=pred.critical_phase1_flops,
                critical_rank=pred.critical_rank, critical_input_len=pred.critical_input_len,
                phase1_input_lengths=pred.phase1_input_lengths, kv_bytes_per_rank=pred.kv_bytes,
                max_kv_bytes=pred.max_kv_bytes, decode_flops_per_token=pred.critical_decode_flops_per_token,
                decode_kv_read_bytes=pred.critical_decode_kv_read_bytes)
            row["seconds_per_pflop"] = row["phase1_critical_path_seconds"] / pred.critical_phase1_flops * 1e15
            rows.append(row)
    bar.close()
    return rows


def _normalise(rows: list[dict]) -> None:
    """Seconds per predicted FLOP relative to the dense row of the same length (else the first measured row), and
    each row's speedups over dense."""
    measured = [r for r in rows if not r.get("skipped")]
    for r in measured:
        ref = next((d for d in measured if d["method"] == "dense" and d["context_len"] == r["context_len"]),
                   measured[0])
        r["time_per_flop_norm"] = r["seconds_per_pflop"] / ref["seconds_per_pflop"]
    _speedups(rows)


def _report(args, model, name: str, rows: list[dict], cp: int, world: Optional[int], load_s: float) -> None:
    """The run's header, the table, the comparison with the cost model, then one JSON line (and ``--json-out``)."""
    sim, tp = args.simulate_ranks, args.tp_size
    dev = next(model.parameters()).device
    print(f"model {name} ({args.dtype}), device {dev.type}"
          f"{' ' + torch.cuda.get_device_name(dev) if dev.type == 'cuda' else ''}, "
          f"torch threads {torch.get_num_threads()}, cp {cp}, tp {tp}"
          f"{f' simulated on one device ({sim} ranks)' if sim else ''}, query {args.query_len}, "
          f"new tokens {args.max_new_tokens}, warmup {args.warmup}"
          f"{f' (at {args.warmup_length} tokens)' if args.warmup_length else ''}, repeats {args.repeats}")
    print(_fmt_table(rows))
    print()
    print("Phase-1 critical path vs the cost model:")
    print(_fmt_vs_model(rows))
    record = dict(bench="engine", model=name, dtype=args.dtype, device=str(dev), cp=cp, tp=tp, simulate_ranks=sim,
                  world_size=world or 1, load_seconds=load_s, platform=platform.platform(),
                  torch=torch.__version__, threads=torch.get_num_threads(), rows=rows)
    line = json.dumps(record)
    print(line)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    sys.exit(main())
