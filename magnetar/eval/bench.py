"""Benchmark the engine's methods end to end, beside the analytic cost model (magnetar.eval.cost).

    magnetar-bench --tiny --methods dense,star,pulsar --lengths 512 --cp 4 --simulate-ranks 4
    magnetar-bench --methods star,pulsar --lengths 4096 --simulate-ranks 4       # SmolLM2-135M-Instruct
    magnetar-bench --model dummy:llama-3.1-8b --dtype bfloat16 --lengths 32768 --simulate-ranks 4  # random weights
    magnetar-bench --tiny --methods dense,ring,star,pulsar --lengths 2048 --simulate-ranks 4,8 \
        --variant 'star+halo=star --halo-blocks 1' --links 450,50     # exact vs approximate CP at two links
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
  collectives). Ring's ranks exchange KV in every layer: one lock-step forward gives every rank's KV, then
  each rank runs alone against the others' KV in ring order (``parallel.rank_by_rank``: twice Phase 1's work,
  every rank its own time). Each step of a KV exchange (ring's, hybrid layers') is timed beside the bytes a
  ring moves during it, and ``--links`` prices them: a step costs max(its attention, its transfer). Several
  counts (``--simulate-ranks 4,8,16``) time every CP method at each. Dense and streaming run on one rank.
* ``--variant 'LABEL=METHOD FLAGS'`` adds a run of a method with other engine flags (Star with a halo, hybrid
  layers) beside ``--methods``.

Each row also shows the cost model's prediction (critical-path Phase-1 FLOPs, KV bytes) and
``s/PFLOP norm``: measured seconds per predicted FLOP, normalised to the dense row of the same length
(or the first row), i.e. 1.0 = "as fast per FLOP as dense". Inputs are random token ids (speed does not
depend on the text) or, with ``--text``, Paul Graham essays tokenised with the model's tokenizer.
Prints a table, then one JSON line with every measurement.
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from typing import Callable, Optional, Sequence

from magnetar.cli.args import ENGINE_FLAGS
from magnetar.config import DTYPES, METHODS
from magnetar.config.cli import add_field_args
from magnetar.eval.common import check_attention_backend, engine_config, parse_lengths, parse_links, parse_names
from magnetar.utils.cli import (ArgumentParser, check_output_file, fail, int_at_least, user_errors,
                                write_json_line)

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
    import torch

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
    p.add_argument("--simulate-ranks", default=None, metavar="W[,W...]",
                   help="run the W ranks' Phase 1 one after another in this process (see the module doc); several "
                        "counts (4,8,16) measure every CP method at each")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=METHOD [FLAGS]",
                   help="also time METHOD with these engine flags under LABEL, e.g. --variant 'star+halo=star "
                        "--halo-blocks 1' (repeatable; FLAGS are this command's engine flags)")
    p.add_argument("--links", default="450,50", metavar="GBPS[,GBPS...]",
                   help="simulated ranks: each rank's KV exchange (ring, hybrid layers) priced over these links in "
                        "GB/s, each step costing max(its attention, its transfer) (default NVLink ~450, a 50 GB/s "
                        "network)")
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
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="the model's dtype (default auto, as the engine's: the checkpoint's -- the magnetar.models "
                        "names are prepared in float32 --; a dummy: bf16 on a GPU, float32 on a CPU)")
    # the engine fields it times: flags made from the config (types, choices; default: the config's)
    add_field_args(p.add_argument_group("engine config (defaults in magnetar/config/sections.py)"), ENGINE_FLAGS)
    p.add_argument("--tp-size", type=int_at_least(1), default=1,
                   help="tensor-parallel ranks sharing each CP rank's weights (DeepSpeed AutoTP; under a launcher: "
                        "world size = tp x cp)")
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.add_argument("--json-out", default=None, help="also write the JSON line to this file (rewritten after every "
                   "row with \"complete\": false until the last: a run cut short keeps what it measured)")
    args = p.parse_args(argv)
    with user_errors(PROG):
        args.methods = parse_names(args.methods, tuple(METHODS), "--methods")
        args.lengths = parse_lengths(args.lengths)
        args.links = parse_links(args.links)
        if args.simulate_ranks is not None:
            args.simulate_ranks = parse_lengths(args.simulate_ranks, "--simulate-ranks")
        sim = args.simulate_ranks
        if sim is not None and args.cp is not None and [args.cp] != sim:
            raise ValueError(f"--cp ({args.cp}) and --simulate-ranks ({','.join(map(str, sim))}) differ: simulate "
                             "exactly the CP ranks you want (--simulate-ranks alone)")
        if sim is not None and args.tp_size > 1:
            raise ValueError(f"--tp-size {args.tp_size} needs one process per TP rank; --simulate-ranks runs the CP "
                             "ranks in one process: launch tp x cp ranks (torchrun/deepspeed) instead")
        args.entries = [(m, m, args) for m in args.methods] + [_parse_variant(args, v) for v in args.variant]
        labels = [label for label, _, _ in args.entries]
        if len(set(labels)) != len(labels):
            raise ValueError(f"--variant: label {next(x for x in labels if labels.count(x) > 1)!r} is taken (by a "
                             f"method of --methods or another --variant): give each run its own label")
        for _, method, eargs in args.entries:  # the engine options hold for every method (e.g. --block-size >= 1)
            check_attention_backend(engine_config(eargs, method, args.cp or (sim or [1])[0]))
        if args.text and args.tiny:
            raise ValueError("--text needs the model's tokenizer, which --tiny has not; drop one of them")
        if not args.tiny:
            from magnetar.models import check_model

            check_model(args.model, revision=args.revision)
        if args.json_out is not None:
            check_output_file(args.json_out, flag="--json-out")
    return args


def _parse_variant(args, text: str):
    """``"LABEL=METHOD [FLAGS]"`` -> ``(label, method, the command's arguments with FLAGS applied)``; ValueError
    naming ``--variant``."""
    import shlex

    label, eq, rest = text.partition("=")
    words = shlex.split(rest) if eq else []
    if not (label.strip() and words):
        raise ValueError(f"--variant {text!r}: write LABEL=METHOD [FLAGS], e.g. 'star+halo=star --halo-blocks 1'")
    method = parse_names(words[0], tuple(METHODS), f"--variant {label}")[0]

    class Flags(argparse.ArgumentParser):
        def error(self, message):
            raise ValueError(f"--variant {text!r}: {message} (its flags are this command's engine flags, e.g. "
                             f"--halo-blocks 1, --exact-layers 0-15)")

    flags = Flags(prog=f"--variant {label}", add_help=False)
    add_field_args(flags, ENGINE_FLAGS)
    given = flags.parse_args(words[1:])
    merged = copy.copy(args)
    for name, value in vars(given).items():
        if value is not None:
            setattr(merged, name, value)
    return label.strip(), method, merged


def _inputs(args, model, tokenizer, L: int):
    import torch

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
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _engine_run(engine, ctx, query, max_new_tokens: int, links) -> dict:
    _reset_peak(engine.device)
    res = engine.generate(ctx, query, max_new_tokens=max_new_tokens)
    return dict(phase1_seconds=res.phase1_seconds, ttft_seconds=res.ttft_seconds,
                phase1_seconds_at={f"{g:g}": res.phase1_seconds_at(g) for g in links},
                decode_seconds_per_token=res.decode_seconds_per_token,
                context_kv_tokens_per_rank=res.context_kv_tokens_per_rank, kv_bytes_per_rank=res.kv_bytes_per_rank,
                peak_memory_bytes_per_rank=res.peak_memory_bytes_per_rank,
                weight_bytes_per_rank=res.weight_bytes_per_rank)


def _median_runs(runs: list[dict]) -> dict:
    out = dict(runs[-1])
    out["phase1_seconds"] = [statistics.median(r["phase1_seconds"][i] for r in runs)
                             for i in range(len(runs[0]["phase1_seconds"]))]
    out["phase1_critical_path_seconds"] = statistics.median(max(r["phase1_seconds"]) for r in runs)
    # each link's critical path: the slowest rank with its exchange priced there (median over the runs)
    out["phase1_critical_path_at"] = {g: statistics.median(max(r["phase1_seconds_at"][g]) for r in runs)
                                      for g in runs[0]["phase1_seconds_at"]}
    out.pop("phase1_seconds_at")
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
        weights = " ".join(f"{b / 1e6:.3g}" for b in r["weight_bytes_per_rank"])
        per = " ".join(f"{t:.2f}" for t in r["phase1_seconds"])
        dec = f"{r['decode_ms_per_token']:.1f}" if r["decode_ms_per_token"] is not None else "-"
        kv = " ".join(f"{b / 1e6:.3g}" for b in r["kv_bytes_per_rank"])
        lines.append(
            f"| {_label(r)} | {r['context_len']} | {r['ranks']} | {per} | "
            f"{r['phase1_critical_path_seconds']:.2f} | {r['predicted']['critical_phase1_flops'] / 1e9:.4g} | "
            f"{r['time_per_flop_norm']:.2f} | {r['ttft_seconds']:.3f} | {dec} | {kv} | "
            f"{r['predicted']['max_kv_bytes'] / 1e6:.3g} | {max(r['peak_memory_bytes_per_rank']) / 1e6:.0f} | "
            f"{weights} |")
    return "\n".join(lines)


def _speedups(rows: list[dict]) -> None:
    """Add each measured row's Phase-1 critical-path speed-up over the reference row of its length (dense when
    measured, else the first method) as measured and as the cost model predicts it (FLOP ratio)."""
    for r in rows:
        same = [d for d in rows if d["context_len"] == r["context_len"]]
        ref = next((d for d in same if d["method"] == "dense"), same[0])
        r["speedup_ref"] = ref["method"]
        r["speedup_measured"] = ref["phase1_critical_path_seconds"] / r["phase1_critical_path_seconds"]
        r["speedup_predicted"] = ref["predicted"]["critical_phase1_flops"] / r["predicted"]["critical_phase1_flops"]
        r["measured_over_predicted"] = r["speedup_measured"] / r["speedup_predicted"]


def _fmt_vs_model(rows: list[dict]) -> str:
    """Phase-1 critical path: measured speed-up vs the cost model's, per length (Pulsar Table 4's comparison)."""
    lines = ["| method | L | ranks | P1 crit (s) | speed-up vs | measured | predicted (FLOP) | measured / predicted |",
             "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {_label(r)} | {r['context_len']} | {r['ranks']} | {r['phase1_critical_path_seconds']:.2f} | "
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
    cps = args.simulate_ranks or [args.cp or (world // args.tp_size if world else 1)]
    lead = world is None or dist.get_rank() == 0

    did_not_fit: list[dict] = []  # configurations that did not fit memory: said, not rows

    def partial(rows: list[dict]) -> None:  # the JSON after every row: a run cut short keeps what it measured
        if lead and args.json_out:
            done = copy.deepcopy(rows)
            _normalise(done)
            write_json_line(args.json_out, _record(args, model, name, done, cps, world, load_s, complete=False,
                                                   did_not_fit=did_not_fit))

    rows = _measure(args, model, tokenizer, cps, lead, on_row=partial, did_not_fit=did_not_fit)
    _normalise(rows)
    if lead:
        _report(args, model, name, rows, cps, world, load_s, did_not_fit)
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


def _jobs(args, cps: list[int]) -> list[tuple[int, str, str, object]]:
    """Every (ranks, label, method, its arguments) to time at each length: each CP method at each of ``cps``, a
    method on one rank (dense, streaming) once."""
    jobs, single = [], set()
    for cp in cps:
        for label, method, eargs in args.entries:
            if not METHODS[method].distributed:
                if label in single:
                    continue
                single.add(label)
            jobs.append((cp, label, method, eargs))
    return jobs


def _measure(args, model, tokenizer, cps: list[int], lead: bool,
             on_row: Optional[Callable[[list[dict]], None]] = None, did_not_fit: Optional[list] = None) -> list[dict]:
    """One row per (length, CP size, method or variant): the median of ``--repeats`` timed generate calls after
    ``--warmup``, with the cost model's prediction of the same configuration (a progress bar on rank 0's
    stderr); ``on_row(rows)`` after each. Simulated ranks of ring run rank by rank (``parallel.rank_by_rank``):
    every rank has its own time. A configuration that does not fit memory
    (:meth:`~magnetar.engine.engine.Engine.fit_failure`) is no row: it goes to ``did_not_fit`` and the run goes on
    (a 512K dense beside the methods that hold it)."""
    import magnetar
    from magnetar.engine.strategy import context_method
    from magnetar.eval.cost import estimate
    from tqdm import tqdm

    sim, engines, rows = args.simulate_ranks, {}, []

    def engine_for(label, cfg):
        key = (label, cfg.parallel.cp_size)
        if key not in engines:  # under --simulate-ranks the engine stands in for the ranks (config simulate)
            run_cfg = cfg.replace(simulate=True, rank_by_rank=True) if sim and cfg.parallel.cp_size > 1 else cfg
            engines[key] = magnetar.init_inference(model, run_cfg, tokenizer=tokenizer)
        return engines[key]

    jobs = _jobs(args, cps)
    # one tick per timed or warm-up generate call (stderr: the table and JSON line stay on stdout)
    bar = tqdm(total=len(args.lengths) * len(jobs) * (args.warmup + args.repeats), unit="run",
               dynamic_ncols=True, file=sys.stderr, desc="magnetar bench", disable=not lead)
    for L in args.lengths:
        ctx, query = _inputs(args, model, tokenizer, L)
        warm_ctx = ctx if args.warmup_length is None else ctx[: min(L, args.warmup_length)]
        for cp, label, method, eargs in jobs:
            cfg = engine_config(eargs, method, cp)
            ranks = cfg.parallel.cp_size
            row = dict(method=method, label=label, context_len=L, query_len=int(query.numel()), ranks=ranks,
                       simulated=bool(sim) and ranks > 1, options=context_method(method).label_options(cfg))
            engine = engine_for(label, cfg)
            runs = []
            try:
                for i in range(args.warmup + args.repeats):
                    bar.set_postfix_str(f"{label} x{ranks} L={L} {'warm-up' if i < args.warmup else 'run'}")
                    out = _engine_run(engine, warm_ctx if i < args.warmup else ctx, query, args.max_new_tokens,
                                      args.links)
                    bar.update(1)
                    if i >= args.warmup:
                        runs.append(out)
            except Exception as e:  # noqa: BLE001 - what does not fit memory is said; the rest is re-raised
                why = engine.fit_failure(e)
                (did_not_fit if did_not_fit is not None else []).append(dict(row, error=why))
                bar.write(f"{label} x{ranks} at {L} tokens did not fit memory: {why}")
                bar.update(args.warmup + args.repeats - i)  # the calls it will not make
                if on_row is not None:
                    on_row(rows)
                continue
            row.update(_median_runs(runs))
            pred = estimate(model.config, cfg, L, int(query.numel()), context_ids=ctx)
            row["_estimate"] = pred  # priced at the links once dense's FLOP/s is known (_normalise); not in the JSON
            row["predicted"] = dict(
                phase1_flops_per_rank=pred.phase1_flops, critical_phase1_flops=pred.critical_phase1_flops,
                critical_rank=pred.critical_rank, critical_input_len=pred.critical_input_len,
                phase1_input_lengths=pred.phase1_input_lengths, kv_bytes_per_rank=pred.kv_bytes,
                max_kv_bytes=pred.max_kv_bytes, decode_flops_per_token=pred.critical_decode_flops_per_token,
                decode_kv_read_bytes=pred.critical_decode_kv_read_bytes)
            row["seconds_per_pflop"] = row["phase1_critical_path_seconds"] / pred.critical_phase1_flops * 1e15
            rows.append(row)
            if on_row is not None:
                on_row(rows)
    bar.close()
    return rows


def _normalise(rows: list[dict]) -> None:
    """Seconds per predicted FLOP relative to the dense row of the same length (else the first measured row), each
    row's speedups over dense, and its critical path at each link beside ring's and the cost model's."""
    for r in rows:
        ref = next((d for d in rows if d["method"] == "dense" and d["context_len"] == r["context_len"]), rows[0])
        r["time_per_flop_norm"] = r["seconds_per_pflop"] / ref["seconds_per_pflop"]
    _speedups(rows)
    _at_links(rows)


def _at_links(rows: list[dict]) -> None:
    """Per row and link: the speed-up of its critical path over ring's at the same length and CP size (exact CP, when
    measured), and the cost model's critical path priced at that link (:func:`magnetar.eval.cost.priced_seconds`)
    at the TFLOP/s dense's row of the same length measured (its predicted FLOPs over its seconds): the model
    calibrated from the run."""
    from magnetar.eval.cost import priced_seconds

    for r in rows:
        est = r.pop("_estimate", None)
        same = [d for d in rows if d["context_len"] == r["context_len"]]
        ring = next((d for d in same if d["method"] == "ring" and d["ranks"] == r["ranks"]), None)
        r["vs_ring_at"] = {g: ring["phase1_critical_path_at"][g] / t if ring else None
                           for g, t in r["phase1_critical_path_at"].items()}
        dense = next((d for d in same if d["method"] == "dense"), None)
        r["calibrated_tflops"] = r["predicted_at"] = None
        if dense is not None and est is not None:
            tflops = dense["predicted"]["critical_phase1_flops"] / dense["phase1_critical_path_seconds"] / 1e12
            r["calibrated_tflops"] = tflops
            r["predicted_at"] = {g: max(priced_seconds(est, tflops, float(g))) for g in r["phase1_critical_path_at"]}


def _fmt_links(rows: list[dict]) -> str:
    """Phase-1 critical path per link (simulated ranks: each rank's exchange steps priced there), beside ring's
    (exact CP) and the cost model's (calibrated at dense's measured FLOP/s)."""
    links = list(rows[0]["phase1_critical_path_at"]) if rows else []
    head = "| method | L | ranks | " + " | ".join(f"P1 crit @ {g} GB/s (x ring) | model @ {g}" for g in links) + " |"
    lines = [head, "|" + "---|" * (3 + 2 * len(links))]
    for r in rows:
        cells = []
        for g in links:
            x = r["vs_ring_at"][g]
            model = r["predicted_at"][g] if r["predicted_at"] else None
            cells.append(f"{r['phase1_critical_path_at'][g]:.3f}" + (f" ({x:.2f}x)" if x else "") + " | "
                         + ("-" if model is None else f"{model:.3f}"))
        lines.append(f"| {_label(r)} | {r['context_len']} | {r['ranks']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _label(r: dict) -> str:
    """A row's name in the tables: its variant's label (or method), marked when its ranks were simulated."""
    return f"{r.get('label', r['method'])}{' (sim)' if r['simulated'] else ''}"


def _memory(model, args) -> dict:
    """What the engine's room check (:func:`magnetar.engine.memory.room_problem`) works from on this device: the
    KV bytes a context token keeps at least, the MLP activation bytes a token of a Phase-1 forward holds at least,
    the bytes the device holds beside this process's weights, and so the longest context one process can hold in
    one forward (dense; simulated ranks hold every rank's KV and their longest forward's activations)."""
    from magnetar.engine.memory import device_room, kv_bytes_per_token, mlp_bytes_per_token
    from magnetar.engine.tensor_parallel import weight_bytes

    per_token, act = kv_bytes_per_token(model, args.tp_size), mlp_bytes_per_token(model, args.tp_size)
    weights = weight_bytes(model)
    room = device_room(next(model.parameters()).device, weights)
    return dict(kv_bytes_per_token=per_token, mlp_activation_bytes_per_token=act, weight_bytes=weights,
                room_bytes=room, max_context_tokens_one_process=room // (per_token + act) if per_token else None)


def _dtype_name(model) -> str:
    """The dtype the model runs in (``--dtype auto``: the one it was loaded in)."""
    from magnetar.models.prepare import model_dtype

    return str(model_dtype(model)).removeprefix("torch.")


def _report(args, model, name: str, rows: list[dict], cps: list[int], world: Optional[int], load_s: float,
            did_not_fit: Sequence[dict] = ()) -> None:
    """The run's header, the table, the comparison with the cost model, the critical paths at each link (simulated
    ranks), then one JSON line (and ``--json-out``)."""
    import torch

    sim, tp = args.simulate_ranks, args.tp_size
    dev = next(model.parameters()).device
    ranks = ",".join(map(str, cps))
    print(f"model {name} ({_dtype_name(model)}{', --dtype auto' if args.dtype == 'auto' else ''}), device {dev.type}"
          f"{' ' + torch.cuda.get_device_name(dev) if dev.type == 'cuda' else ''}, "
          f"torch threads {torch.get_num_threads()}, cp {ranks}, tp {tp}"
          f"{f' simulated on one device ({ranks} ranks)' if sim else ''}, query {args.query_len}, "
          f"new tokens {args.max_new_tokens}, warmup {args.warmup}"
          f"{f' (at {args.warmup_length} tokens)' if args.warmup_length else ''}, repeats {args.repeats}")
    print(_fmt_table(rows))
    for r in did_not_fit:
        print(f"did not fit memory: {_label(r)} x{r['ranks']} at {r['context_len']} tokens ({r['error']})")
    print()
    print("Phase-1 critical path vs the cost model:")
    print(_fmt_vs_model(rows))
    if sim:
        print()
        print("Phase-1 critical path at each link (each simulated rank's KV exchange priced there: a step costs "
              "max(its attention, its transfer)), x ring = ring's over this row's; the cost model priced at dense's "
              "measured FLOP/s:")
        print(_fmt_links(rows))
    record = _record(args, model, name, rows, cps, world, load_s, complete=True, did_not_fit=did_not_fit)
    print(json.dumps(record))
    if args.json_out:
        write_json_line(args.json_out, record)


def _record(args, model, name: str, rows: list[dict], cps: list[int], world: Optional[int], load_s: float,
            complete: bool, did_not_fit: Sequence[dict] = ()) -> dict:
    """The run's JSON record; ``complete`` False while rows are still being measured (``--json-out`` is rewritten
    after each); ``did_not_fit``: the configurations that did not fit memory (method, length, ranks, error)."""
    import torch

    dev = next(model.parameters()).device
    return dict(bench="engine", model=name, dtype=_dtype_name(model), device=str(dev), memory=_memory(model, args),
                cp=cps, tp=args.tp_size,
                simulate_ranks=args.simulate_ranks, links_gbps=args.links, world_size=world or 1,
                load_seconds=load_s, platform=platform.platform(), torch=torch.__version__,
                threads=torch.get_num_threads(), complete=complete, rows=rows, did_not_fit=list(did_not_fit))


if __name__ == "__main__":
    sys.exit(main())
