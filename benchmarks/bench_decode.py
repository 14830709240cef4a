"""Decode steps side by side: eager, static (slots), compiled (issue 33, item 2) and graph (shapes planned and captured
at start, issue 47) -- ms per step, tokens/s, the first step's seconds (a compiled step's compile and CUDA-graph
capture), the graphs' capture time, and whether every mode chose eager's tokens.

    python benchmarks/bench_decode.py                                  # SmolLM2-135M-Instruct fp32, 4K context,
                                                                       # dense and 2-rank Pulsar (simulated), batch 1, 8
    python benchmarks/bench_decode.py --model dummy:llama-3.1-8b --dtype bfloat16 --configs dense,star,pulsar \\
        --ranks 4 --shapes 1@32K,8@32K,1@64K,1@128K,64@4K --json-out decode.json   # the GPU kit's step
    torchrun --nproc-per-node 2 benchmarks/bench_decode.py --configs pulsar   # real gloo ranks (rank 0 reports)

For each configuration (``dense``: one rank; ``star`` / ``pulsar``: ``--ranks`` CP ranks, simulated in one process
unless launched with 2 ranks) one engine -- made with ``decode_step=graph`` and a plan fitted to ``--shapes`` when
``graph`` is among ``--modes``: its graphs are captured as it starts -- encodes the documents of each length once and
runs each mode in turn (``runtime.decode_step`` set before each batch); it is dropped before the next configuration.
For each shape (``B@L``: B requests about L-token documents; or every ``--batches`` at ``--context-tokens``), B
requests join one decode batch (``Engine.open_batch``): with ``--contexts copies`` (the default) each about a context
of its own -- one document encoded per length and copied B-1 times on the device (``KVShard.clone``: the same KV
values in tensors of their own, read apart as another document's would be, without B Phase 1s: on a GPU 8 x 32K and
64 x 4K documents per configuration took minutes of the kit's budget) --, so a step reads B contexts' KV as the floor
below counts; ``own``: B documents each encoded (different texts); ``shared``: B questions about one document (the
eager step reads it once per step for all of them); ``forks``: B conversations about one document, each its turn of
:data:`FORK_TURN` tokens after it (the first extends the document's KV in place, the others fork, sharing it: a step
reads the document once and each turn's own KV). ``--warmup`` steps run (the first one timed apart:
compiling happens there), then ``--steps`` steps are timed. Greedy, so every mode must choose the same tokens as eager
(fp32; in bf16 a near-tie may differ: the table says how many requests agree).

**The floor**: a decode step must read the weights the step uses (all but the input embedding) and every distinct
context's KV once (with ``--contexts shared``, one context's); the device's copy bandwidth is measured in the same
run (a buffer copied on the device: bytes read + written over the time), so each row's floor is ``(weight bytes + C
x L x KV bytes per token) / bandwidth`` (C = B contexts, or 1 shared; forks: 1, plus B turns' KV), and ``% floor`` =
floor / measured step. Prints a table, then one JSON line. Speed goals live here, not in tests.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

MODES = ("eager", "static", "compiled", "graph")
CONFIGS = ("dense", "star", "pulsar")


def parse_args(argv=None) -> argparse.Namespace:
    from magnetar.ops.backends import list_backends

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="an installed model name, a folder, or dummy:<preset> (random weights made on the device)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--attention-backend", default="auto", choices=("auto", *list_backends()),
                   help="runtime.attention_backend: the kernel of every attention call (a named one without paged "
                        "calls serves an eager step's batch page by page: magnetar.ops.pages)")
    p.add_argument("--configs", default="dense,pulsar", help="comma list of: dense, star, pulsar (--ranks CP ranks)")
    p.add_argument("--ranks", type=int, default=2, help="CP ranks of star and pulsar (simulated unless launched)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of: {', '.join(MODES)}")
    p.add_argument("--batches", default="1,8", help="decode batch sizes (at --context-tokens)")
    p.add_argument("--context-tokens", type=int, default=4096)
    p.add_argument("--shapes", default=None, metavar="B@L[,B@L...]",
                   help="batch@context pairs instead of --batches x --context-tokens, e.g. 1@32K,8@32K,64@4K")
    p.add_argument("--contexts", default="copies", choices=("copies", "own", "shared", "forks"),
                   help="copies: each request its own copy of one encoded document's KV (a batch reads B contexts' "
                        "KV; one Phase 1 per length); own: B documents, each encoded; shared: B questions about one "
                        f"document; forks: B conversations about one document, each a turn of {FORK_TURN} tokens "
                        "of its own after it")
    p.add_argument("--warmup", type=int, default=3, help="steps before the timed ones (the first includes compiling)")
    p.add_argument("--steps", type=int, default=12, help="steps timed")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: the process's)")
    p.add_argument("--shm-gather", default="true", choices=("true", "false"),
                   help="2 real ranks: parallel.shm_gather (their per-layer gather through shared memory, else gloo)")
    p.add_argument("--json-out", type=Path, default=None, help="also write the JSON record to this file")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not args.configs or any(c not in CONFIGS for c in args.configs):
        p.error(f"--configs: a comma list of {', '.join(CONFIGS)}; got {args.configs}")
    if args.ranks < 2:
        p.error(f"--ranks: star and pulsar need at least 2 CP ranks, got {args.ranks}")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in MODES for m in args.modes):
        p.error(f"--modes: a comma list of {', '.join(MODES)}; got {args.modes}")
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches: comma-separated ints, got {args.batches!r}")
    if min(args.batches) < 1 or args.steps < 2 or args.warmup < 1 or args.context_tokens < 64:
        p.error("--batches >= 1, --steps >= 2, --warmup >= 1, --context-tokens >= 64")
    args.shapes = [(b, args.context_tokens) for b in args.batches] if args.shapes is None else \
        _parse_shapes(p, args.shapes)
    return args


def _parse_shapes(p, text: str) -> list[tuple[int, int]]:
    """``"1@32K,64@4K"`` -> ``[(1, 32768), (64, 4096)]``; ``--shapes: ...`` errors through ``p``."""
    from magnetar.cli.args import parse_length

    shapes = []
    for part in text.split(","):
        b, at, n = part.strip().partition("@")
        try:
            shape = (int(b), parse_length(n, 64))
        except ValueError:
            shape = None
        if not at or shape is None or shape[0] < 1:
            p.error(f"--shapes: {part.strip()!r} is not BATCH@CONTEXT (e.g. 8@32K; batch >= 1, context >= 64)")
        shapes.append(shape)
    return shapes


def _inputs(model, tokenizer, n: int, batch: int, own: bool) -> list[tuple]:
    """``batch`` (document, question) pairs of ``n``-token documents: each its own document (``own``; seeded apart)
    or one document and ``batch`` questions -- a needle text and questions with a tokenizer, random ids without."""
    docs = batch if own else 1
    if tokenizer is not None:
        from magnetar.data.niah import needle_prompt

        made = [needle_prompt(tokenizer, n, 0.5, seed=i) for i in range(docs)]
        questions = [made[0].query] + [f"Question {i}: what does the text say about topic {i}?"
                                       for i in range(1, batch)]
        return [(made[i % docs].context, made[i].query if own else questions[i]) for i in range(batch)]
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    contexts = [torch.randint(0, vocab, (n,), generator=g) for _ in range(docs)]
    return [(contexts[i % docs], torch.randint(0, vocab, (8 + i,), generator=g)) for i in range(batch)]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _say(msg: str) -> None:
    print(f"[bench_decode] {msg}", file=sys.stderr, flush=True)


def engine_flat(config: str, distributed: bool, ranks: int = 2) -> dict:
    """The engine fields of ``config``: dense on one rank, or Star / Pulsar on ``ranks`` CP ranks (simulated unless
    launched)."""
    return dict(method="dense") if config == "dense" else dict(method=config, cp_size=ranks, simulate=not distributed)


def copy_bandwidth(device, nbytes: int) -> float:
    """The device's copy bandwidth in bytes/s: a ``nbytes`` buffer copied on it (read + written), the best of five
    after one warm-up."""
    device = torch.device(device)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for i in range(6):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        if i:
            best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def floor_bytes(model, contexts: int, context: int) -> int:
    """What one decode step must read: every weight but the input embedding (a step reads B of its rows), and each
    of the batch's ``contexts`` distinct contexts' KV (every layer's keys and values of ``context`` tokens)."""
    cfg = model.config
    emb = model.get_input_embeddings().weight
    tied = emb.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    weights = sum(t.numel() * t.element_size() for t in model.parameters()) - (0 if tied else emb.numel() *
                                                                               emb.element_size())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * emb.element_size()
    return weights + contexts * context * kv


def launched(args) -> bool:
    """Set the torch threads (``--threads``); under a launcher (2 real ranks) keep only ``pulsar`` of
    ``--configs``. Whether this process is one of several ranks."""
    if args.threads:
        torch.set_num_threads(args.threads)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        args.configs = [c for c in args.configs if c != "dense"]
        if not args.configs:
            raise SystemExit("under a launcher only --configs star / pulsar run (on the launched ranks)")
        args.ranks = int(os.environ["WORLD_SIZE"])
    return distributed


def graph_plan(args) -> dict:
    """The engine fields of ``graph`` steps for the benchmark's shapes: its batch sizes, and a slot pool just big
    enough for the largest batch (each request's question and new tokens, padded to a planned capacity: a slot holds
    a request's own tokens, its context is read where the cache keeps it)."""
    from magnetar.engine.graphs import capacities_up_to
    from magnetar.engine.static import MIN_CAPACITY

    extra = 64 + max(b for b, _ in args.shapes) + args.warmup + args.steps + 4  # a question, the new tokens
    tokens = max(b for b, _ in args.shapes) * capacities_up_to(extra, MIN_CAPACITY)[-1]
    return dict(decode_graph_batches=",".join(str(b) for b in sorted({b for b, _ in args.shapes})),
                decode_graph_tokens=tokens)


def engine_for(config: str, args, model, tokenizer, distributed: bool):
    """One engine per configuration, its modes run by it in turn (:func:`run` sets ``runtime.decode_step`` before
    opening each batch): one encoded copy of each context, and -- with ``graph`` among ``--modes`` -- the graphs of
    :func:`graph_plan` captured when it starts (logged, and in each graph row)."""
    import magnetar

    # dtype: named, so the engine runs the bench's --dtype whatever runtime.dtype's default (an 8B model cast to fp32
    # by the old float32 default spent a GPU run's whole step in its first Phase 1, 2026-11-27)
    plan = dict(decode_step="graph", **graph_plan(args)) if "graph" in args.modes else {}
    t0 = time.perf_counter()
    eng = magnetar.init_inference(model, tokenizer=tokenizer, deepspeed_inference=False, context_cache_mb=1 << 20,
                                  dtype=args.dtype, shm_gather=args.shm_gather == "true",
                                  attention_backend=args.attention_backend,
                                  **engine_flat(config, distributed, args.ranks), **plan)
    got = next(eng.model.parameters()).dtype
    if got != getattr(torch, args.dtype):
        raise SystemExit(f"bench_decode: the engine runs {got}, not --dtype {args.dtype}")
    if eng.decode_graphs is not None:
        g = eng.decode_graphs
        _say(f"{config}: {len(g.graphs)} decode graphs captured in {g.warmup_s:.1f} s (engine made in "
             f"{time.perf_counter() - t0:.1f} s; {g.plan.describe()})" + (f"; {g.why_not}" if g.why_not else ""))
    return eng


def copy_handle(handle, i: int):
    """``handle`` with a copy of its KV (``KVShard.clone``: the values in tensors of their own, on its device) under
    a key of its own: a request about it reads another context's KV, as about another document of that length."""
    import dataclasses

    return dataclasses.replace(handle, shard=handle.shard.clone(), key=f"{handle.key}:copy{i}")


FORK_TURN = 32  # tokens of each conversation's own turn with --contexts forks


def fork_context(eng, doc, i: int):
    """Request ``i``'s context with ``--contexts forks``: ``doc``'s token ids and a turn of :data:`FORK_TURN` ids of
    its own."""
    ids = eng.requests.context_ids(doc)
    turn = torch.randint(0, eng.model.config.vocab_size, (FORK_TURN,), generator=torch.Generator().manual_seed(i))
    return torch.cat((ids, turn))


def run(config: str, mode: str, bsz: int, context: int, args, model, tokenizer, eng, handles: dict) -> dict:
    """One row: ``bsz`` requests about ``context``-token documents (``--contexts``) in one batch of ``config``'s
    engine, its steps run ``mode`` (each length's documents encoded once per configuration: ``handles``)."""
    from magnetar.utils.sync import host_syncs

    eng.config = eng.config.replace(decode_step=mode)  # read by open_batch (the one field that differs per mode)
    if context not in handles:
        pairs = _inputs(model, tokenizer, context, max(b for b, n in args.shapes if n == context),
                        args.contexts == "own")
        t0 = time.perf_counter()
        encoded: dict[int, object] = {}  # one handle per distinct document
        for doc, _ in pairs:
            if id(doc) not in encoded:
                encoded[id(doc)] = eng.encode(doc)
        handles[context] = [(encoded[id(doc)], q) for doc, q in pairs]
        if args.contexts == "copies":  # the first request's handle, then a copy of its KV for each other one
            handles[context] = [(h if i == 0 else copy_handle(h, i), q) for i, (h, q) in enumerate(handles[context])]
        elif args.contexts == "forks":  # the document, then each request's turn after it (a fork but the first)
            handles[context] = [(eng.encode(fork_context(eng, doc, i)), q) for i, (doc, q) in enumerate(pairs)]
        _say(f"{config}: {len(encoded)} {context}-token context(s) encoded" +
             (f", {len(pairs) - 1} copied" if args.contexts == "copies" else "") +
             f" in {time.perf_counter() - t0:.1f} s")
    b = eng.open_batch()
    n = args.warmup + args.steps + 3
    t0 = time.perf_counter()
    rids = [b.add(handle, q, eng.sampling_params(max_new_tokens=n, temperature=0.0))[0]
            for handle, q in handles[context][:bsz]]
    _sync(eng.device)
    t1 = time.perf_counter()
    b.step()
    _sync(eng.device)
    first = time.perf_counter() - t1
    _say(f"{config} {mode} batch {bsz}: joined in {t1 - t0:.2f} s, first step {first:.2f} s")
    for _ in range(args.warmup - 1):
        b.step()
    # one untimed step: how often a whole step made the host wait for the device (on CPU every tensor read counts)
    with host_syncs("count", eng.device) as seen:
        b.step()
    _sync(eng.device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        b.step()
    _sync(eng.device)
    ms = 1000 * (time.perf_counter() - t0) / args.steps
    inner = b._batch  # the DecodeBatch: how its steps ran
    ran, why = inner.decode_step, inner.why_not or (inner.static.fallback if inner.static is not None else None)
    g, sl = eng.decode_graphs, inner.static.slots if inner.static is not None else None
    captured = ran == "graph" and sl is not None and sl.pooled and (sl.slots, sl.capacity) in g.graphs
    if ran == "graph" and not captured and why is None:
        why = g.why_not or (f"shape {sl.slots} x {sl.capacity} not captured" if sl is not None else "no slots")
    for rid in list(b.active):
        b.cancel(rid)
    tokens = [b.pop(rid).token_ids for rid in rids]
    _say(f"{config} {mode} batch {bsz}: {ms:.1f} ms/step" + (f" (ran {ran}: {why})" if why else ""))
    floor = floor_bytes(model, 1 if args.contexts in ("shared", "forks") else bsz, context)
    if args.contexts == "forks":  # each turn's own KV beside the document's
        floor += floor_bytes(model, bsz, FORK_TURN) - floor_bytes(model, 0, FORK_TURN)
    floor_ms = 1000 * floor / args.bandwidth
    return dict(config=config, mode=mode, ran=ran, why=why, captured=captured,
                capture_s=g.warmup_s if ran == "graph" else None, batch=bsz, context_tokens=context, ms_per_step=ms,
                ms_per_token=ms / bsz, tokens_per_s=1000 * bsz / ms, first_step_s=first,
                host_syncs_per_step=len(seen.calls), tokens=tokens, floor_ms=floor_ms,
                pct_of_floor=100 * floor_ms / ms, contexts=args.contexts, ranks=1 if config == "dense" else args.ranks,
                simulated=eng.simulated)


def main(argv=None) -> int:
    args = parse_args(argv)
    distributed = launched(args)
    from magnetar.models import load_model
    from magnetar.models.dummy import is_dummy
    from magnetar.parallel.launcher import device_for_rank, init_distributed
    from magnetar.utils.cli import write_json_line

    init_distributed()
    device = device_for_rank() if is_dummy(args.model) else "cpu"
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), device=device)
    load_s = time.perf_counter() - t0
    dev = torch.cuda.get_device_name() if str(device).startswith("cuda") else platform.processor() or "cpu"
    # the floor's bandwidth, measured on this device now (a GPU: 1 GiB copied; a CPU: 256 MiB)
    args.bandwidth = copy_bandwidth(device, (1 << 30) if str(device).startswith("cuda") else (1 << 28))
    _say(f"copy bandwidth {args.bandwidth / 1e9:.0f} GB/s")
    rows, skipped = [], []
    # configuration by configuration (one engine each, dropped before the next: an 8B model's contexts and slots at
    # 32K-128K do not fit a card three times), shape by shape, every mode side by side; a context leaves the cache
    # after its last shape; the JSON is rewritten after every row, so a run cut short keeps what it measured
    for c in args.configs:
        eng, handles = engine_for(c, args, model, tokenizer, distributed), {}
        for i, (bsz, n) in enumerate(args.shapes):
            for m in args.modes:
                try:
                    rows.append(run(c, m, bsz, n, args, model, tokenizer, eng, handles))
                except torch.OutOfMemoryError as e:  # this row does not fit the card beside the engine's
                    first = str(e).splitlines()[0][:200] if str(e) else ""  # pool and contexts: the others go on
                    skipped.append(dict(config=c, mode=m, batch=bsz, context_tokens=n, error=f"out of memory: {first}"))
                    _say(f"{c} {m} batch {bsz} @ {n}: out of memory, row skipped")
                    gc.collect()
                    torch.cuda.empty_cache()
                _compare(rows)
                if args.json_out is not None and int(os.environ.get("RANK", "0")) == 0:
                    write_json_line(args.json_out, _record(args, dev, load_s, rows, skipped))  # atomic: the kit may
                    # read the rows so far of a run it cut short
            if n in handles and all(later != n for _, later in args.shapes[i + 1:]):
                for handle in {id(h): h for h, _ in handles.pop(n)}.values():
                    eng.release(handle)
        del eng, handles
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if distributed and int(os.environ.get("RANK", "0")) != 0:
        return 0
    from magnetar.utils.machine import cpu_description

    print(f"\n{args.model} {args.dtype}, {dev}, {torch.get_num_threads()} threads, copy bandwidth "
          f"{args.bandwidth / 1e9:.0f} GB/s (measured); {cpu_description()}\n")
    print("| config | batch | context | decode step (ran) | ms/step | ms/token | tokens/s | floor ms | % floor | "
          "speed-up vs eager | first step s | host syncs / step | requests with eager's tokens |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ran = r["mode"] if r["ran"] == r["mode"] else f"{r['mode']} ({r['ran']})"
        vs = "-" if r["vs_eager"] is None else f"{r['vs_eager']:.2f}x"
        same = "-" if r["same_tokens"] is None else f"{r['same_tokens']}/{r['batch']}"
        where = "" if r["ranks"] == 1 else f", {r['ranks']} ranks{' sim.' if r['simulated'] else ''}"
        print(f"| {r['config']}{where} | {r['batch']} | {r['context_tokens']} | {ran} | {r['ms_per_step']:.1f} | "
              f"{r['ms_per_token']:.1f} | {r['tokens_per_s']:.1f} | {r['floor_ms']:.2f} | {r['pct_of_floor']:.0f} | "
              f"{vs} | {r['first_step_s']:.2f} | {r['host_syncs_per_step']} | {same} |")
    for r in rows:
        if r["why"]:
            print(f"- {r['config']} {r['mode']} batch {r['batch']}: {r['why']}")
    for r in skipped:
        print(f"- {r['config']} {r['mode']} batch {r['batch']} @ {r['context_tokens']}: not run ({r['error']})")
    print(json.dumps(_record(args, dev, load_s, rows, skipped)))
    return 0


def _compare(rows: list[dict]) -> None:
    """Each row's speed-up over eager's row of the same configuration and batch, and how many of its requests got
    eager's tokens (None where eager did not run)."""
    eager = {(r["config"], r["batch"], r["context_tokens"]): r for r in rows if r["mode"] == "eager"}
    for r in rows:
        ref = eager.get((r["config"], r["batch"], r["context_tokens"]))
        r["vs_eager"] = None if ref is None else ref["ms_per_step"] / r["ms_per_step"]
        r["same_tokens"] = None if ref is None else sum(a == b for a, b in zip(r["tokens"], ref["tokens"]))


def _record(args, dev: str, load_s: float, rows: list[dict], skipped: list[dict]) -> dict:
    from magnetar.utils.machine import cpu_description

    return dict(bench="bench_decode", model=args.model, dtype=args.dtype, context_tokens=args.context_tokens,
                attention_backend=args.attention_backend,
                cpu=cpu_description(), shapes=args.shapes, copy_bandwidth_gbps=args.bandwidth / 1e9,
                device=dev, threads=torch.get_num_threads(), load_seconds=load_s, torch=torch.__version__,
                rows=[{k: v for k, v in r.items() if k != "tokens"} for r in rows], skipped=skipped)


if __name__ == "__main__":
    sys.exit(main())
