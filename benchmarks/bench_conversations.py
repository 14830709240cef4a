"""Conversations forking from one long document: how many tokens are encoded, and how the turns spread over the
CP ranks (issue 49's second goal).

SmolLM2-135M-Instruct (or ``--model``), ``--method`` over ``--ranks`` CP ranks (simulated in this process, which
keeps the same per-rank accounting as real ranks; ``--prefix-reuse`` as a server would set it): one document of
``--context`` tokens (Paul Graham essays), then ``--conversations`` conversations of ``--turns`` turns each, every
turn appending a question and the previous answer (``--turn-tokens`` tokens) to its conversation's context and
asking one token. Encoded tokens are each turn's context tokens less those its cache hit or prefix reuse supplied
(``cached_context_tokens``); the table compares them with one conversation's, and gives the largest and smallest
shard of every conversation's last context; then what the context cache holds at the end: the contexts kept, the
bytes it counts, the bytes of the distinct tensors their KV views (this process's memory, read off the tensors) and
what the kept contexts would hold each on its own, and the mean wall time of a turn; with ``--release-first`` the
first conversation's contexts then leave the cache (what it counts and holds before and after, the others asked
again); with ``--host-cache-mb N`` the same of the host-memory tier (what the cache evicted) -- and with ``--shed``
the device cache then sheds every context into it and every conversation's last turn is asked again (how many came
back from host memory with their answers, the KV the host tier and then the device hold); with ``--context-store DIR``
(a fresh folder; its bound: ``--context-store-mb``) also what the disk tier holds -- the contexts stored and
evicted, its files' bytes on disk, what its bound counts -- and a restarted engine's answer to the first
conversation's last turn (seconds; whether it was loaded from the disk, not encoded, and equals the answer before
the restart), then every other conversation's (how many loaded with their answers from before, their time, and the
KV the restarted engine's cache then holds); then one JSON line.

    python benchmarks/bench_conversations.py --conversations 10 --turns 5 --context 8000
    python benchmarks/bench_conversations.py --conversations 1 --turns 20 --context 8000 --context-cache-mb 1024
    python benchmarks/bench_conversations.py --conversations 10 --turns 5 --context 8000 --context-cache-mb 1024 \
        --host-cache-mb 4096
    python benchmarks/bench_conversations.py --conversations 10 --turns 5 --context 8000 --host-cache-mb 8192 --shed
    python benchmarks/bench_conversations.py --conversations 4 --turns 20 --turn-tokens 150 --context 4000 \
        --release-first
    python benchmarks/bench_conversations.py --conversations 2 --turns 10 --context 7000 --context-store /tmp/store \
        --context-store-mb 1024
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--method", default="ring")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--prefix-reuse", default="exact")
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--conversations", type=int, default=10)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--turn-tokens", type=int, default=30)
    p.add_argument("--context-cache-mb", type=int, default=4096)
    p.add_argument("--host-cache-mb", type=int, default=0, help="the host-memory tier's budget (0: none)")
    p.add_argument("--release-first", action="store_true", help="after the run, the first conversation's contexts "
                   "leave the cache (the others, forks of the document, stay) and the others are asked again")
    p.add_argument("--shed", action="store_true", help="after the run, the device cache sheds every context into the "
                   "host tier (--host-cache-mb) and every conversation's last turn is asked again")
    p.add_argument("--context-store", default=None, help="a fresh folder: the disk tier's figures and a restart")
    p.add_argument("--context-store-mb", type=int, default=None, help="the disk tier's bound (default: the engine's)")
    args = p.parse_args(argv)
    if args.shed and args.host_cache_mb <= 0:
        p.error("--shed sheds the device cache into the host tier: give it one with --host-cache-mb N")
    if args.context_store is not None:
        from pathlib import Path

        if Path(args.context_store).exists() and any(Path(args.context_store).iterdir()):
            p.error(f"--context-store {args.context_store}: give a folder that is empty or does not exist (the "
                    f"figures are this run's files)")
    import torch

    import magnetar
    from magnetar.data.texts import paul_graham_essays

    store_mb = {} if args.context_store_mb is None else {"context_store_mb": args.context_store_mb}

    def make_engine():
        return magnetar.init_inference(args.model, method=args.method, cp_size=args.ranks, simulate=args.ranks > 1,
                                       prefix_reuse=args.prefix_reuse, context_cache_mb=args.context_cache_mb,
                                       host_cache_mb=args.host_cache_mb,
                                       timeout_s=3600, context_store=args.context_store, **store_mb)

    engine = make_engine()
    text = "\n\n".join(paul_graham_essays())
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    doc = torch.tensor(ids[: args.context])
    pool = torch.tensor(ids[args.context:])  # the turns' tokens: later text of the essays
    query = torch.tensor(engine.tokenizer(" What next?", add_special_tokens=False)["input_ids"])
    t0 = time.perf_counter()
    first = engine.generate(doc, query, max_new_tokens=1)
    encoded, shards, per_conversation, turn_seconds, lasts = [first.context_tokens], [], [], [], []
    first_turns = []  # the first conversation's contexts (it extends the document in place; the others fork)
    for c in range(args.conversations):
        ctx, mine = doc, 0
        for t in range(args.turns):
            start = (c * args.turns + t) * args.turn_tokens
            ctx = torch.cat((ctx, pool[start:start + args.turn_tokens]))
            t1 = time.perf_counter()
            r = engine.generate(ctx, query, max_new_tokens=1)
            turn_seconds.append(time.perf_counter() - t1)
            mine += r.context_tokens - r.cached_context_tokens
            if c == 0:
                first_turns.append(ctx)
        lasts.append((ctx, r.token_ids))
        per_conversation.append(mine)
        encoded.append(mine)
        shards.append(r.context_kv_tokens_per_rank)
        print(f"  conversation {c}: {mine} tokens encoded over {args.turns} turns, last context's shards "
              f"{r.context_kv_tokens_per_rank}", file=sys.stderr)
    seconds = time.perf_counter() - t0
    one = first.context_tokens + per_conversation[0]
    total = sum(encoded)
    ratio = max(max(s) / min(s) for s in shards)
    print(f"| | tokens encoded | vs one conversation |\n|---|---:|---:|\n"
          f"| the document + one conversation ({args.turns} turns) | {one} | 1.00x |\n"
          f"| the document + {args.conversations} conversations | {total} | {total / one:.2f}x |\n\n"
          f"largest / smallest shard of a conversation's last context, worst of {args.conversations}: {ratio:.3f} "
          f"({args.method}, {args.ranks} ranks); {seconds:.0f} s")
    held = _held(engine.cache.handles())
    evictions, counted, mib = engine.cache.evictions, engine.cache.nbytes, 2 ** 20  # the run's (before --shed)
    print(f"\n| contexts kept | evicted | cache counts | KV tensors held | kept contexts each alone | mean turn |\n"
          f"|---:|---:|---:|---:|---:|---:|\n"
          f"| {held['kept']} | {evictions} | {counted / mib:.0f} MiB | "
          f"{held['held_bytes'] / mib:.0f} MiB | {held['alone_bytes'] / mib:.0f} MiB | "
          f"{sum(turn_seconds) / len(turn_seconds):.3f} s |")
    host = {} if engine.host is None else _host(engine)
    if args.release_first:
        host |= _release_first(engine, query, first_turns, lasts[1:])
    if args.shed:
        host |= _shed(engine, query, lasts)
    stored = {} if args.context_store is None else _restart(engine, make_engine, query, lasts)
    print(json.dumps(dict(model=args.model, method=args.method, ranks=args.ranks, context=args.context,
                          conversations=args.conversations, turns=args.turns, turn_tokens=args.turn_tokens,
                          encoded_one=one, encoded_all=total, ratio=total / one, shard_ratio=ratio,
                          seconds=seconds, context_cache_mb=args.context_cache_mb,
                          evictions=evictions, cache_counted_bytes=counted,
                          turn_seconds_mean=sum(turn_seconds) / len(turn_seconds), **held, **host,
                          **stored)))
    return 0


def _restart(engine, make_engine, query, lasts) -> dict:
    """The disk tier after the run (its writes flushed): its files, their bytes on disk, what its budget counts; then
    a new engine on the same folder answers the first conversation's last turn (loaded, not encoded), then every
    other conversation's: how many were loaded with the answer they had before the restart, their seconds, and the
    KV the restarted engine's cache then holds (the distinct tensors) against what the contexts hold each alone."""
    from pathlib import Path

    engine.flush_store()
    stats = engine.cache_stats()["store"]
    files = [f for f in Path(engine.config.runtime.context_store).rglob("*") if f.is_file()]
    disk = sum(f.stat().st_size for f in files)
    again = make_engine()
    answers = _ask_all(again, query, lasts)
    seconds, loaded, same = answers[0]
    mib = 2 ** 20
    print(f"\n| stored contexts | evicted | files on disk | store counts | restart: last turn answered | loaded | "
          f"same answer |\n|---:|---:|---:|---:|---:|---|---|\n"
          f"| {stats['contexts']} | {stats['evictions']} | {disk / mib:.0f} MiB | {stats['bytes'] / mib:.0f} MiB | "
          f"{seconds:.2f} s | {'yes' if loaded else 'no: encoded'} | {'yes' if same else 'NO'} |")
    held = _held(again.cache.handles())
    rest = answers[1:]
    print(f"\n| restart: every conversation's last turn | loaded | same answer | seconds (first; the others' mean) | "
          f"cache counts | KV tensors held | kept contexts each alone |\n|---:|---:|---:|---:|---:|---:|---:|\n"
          f"| {len(answers)} | {sum(a[1] for a in answers)} | {sum(a[2] for a in answers)} | {seconds:.2f}; "
          f"{sum(a[0] for a in rest) / max(1, len(rest)):.2f} | {again.cache.nbytes / mib:.0f} MiB | "
          f"{held['held_bytes'] / mib:.0f} MiB | {held['alone_bytes'] / mib:.0f} MiB |")
    return dict(stored_contexts=stats["contexts"], store_disk_bytes=disk, store_counted_bytes=stats["bytes"],
                store_evictions=stats["evictions"], restart_seconds=seconds, restart_loaded=loaded,
                restart_same=same, restart_all=len(answers), restart_all_loaded=sum(a[1] for a in answers),
                restart_all_same=sum(a[2] for a in answers),
                restart_others_seconds_mean=sum(a[0] for a in rest) / max(1, len(rest)),
                restart_cache_counted_bytes=again.cache.nbytes, restart_held_bytes=held["held_bytes"],
                restart_alone_bytes=held["alone_bytes"], restart_kept=held["kept"])


def _release_first(engine, query, first_turns, others) -> dict:
    """The first conversation's contexts (written after the document in its arena) leave the cache: what the cache
    counts and the KV tensors it holds before and after (the document's arena cut to the document), then the other
    conversations' last turns asked again (loaded, the same answers)."""
    mib = 2 ** 20
    before, held = engine.cache.nbytes, _held(engine.cache.handles())["held_bytes"]
    for ctx in first_turns:
        engine.cache.release(engine.cache_key(ctx))
    after, held_after = engine.cache.nbytes, _held(engine.cache.handles())["held_bytes"]
    answers = _ask_all(engine, query, others)
    print(f"\n| the first conversation leaves | cache counts | KV tensors held | then the others asked again: "
          f"loaded, same answer |\n|---|---:|---:|---:|\n| before | {before / mib:.0f} MiB | {held / mib:.0f} MiB | |\n"
          f"| after | {after / mib:.0f} MiB | {held_after / mib:.0f} MiB | {sum(a[1] for a in answers)}, "
          f"{sum(a[2] for a in answers)} of {len(answers)} |")
    return dict(release_counted_before=before, release_held_before=held, release_counted_after=after,
                release_held_after=held_after, release_loaded=sum(a[1] for a in answers),
                release_same=sum(a[2] for a in answers))


def _ask_all(engine, query, lasts) -> list[tuple[float, bool, bool]]:
    """Each conversation's last turn asked of ``engine``: (seconds, loaded rather than encoded, the same answer)."""
    answers = []
    for ctx, token_ids in lasts:
        t0 = time.perf_counter()
        r = engine.generate(ctx, query, max_new_tokens=1)
        answers.append((time.perf_counter() - t0, r.cached_context_tokens == r.context_tokens,
                        r.token_ids == token_ids))
    return answers


def _shed(engine, query, lasts) -> dict:
    """The device cache sheds every context into the host tier (as a rank out of device memory does), then every
    conversation's last turn is asked again: how many came back from host memory with the answer they had, and the
    KV the device cache then holds against what the contexts hold each alone."""
    engine.cache.shed()
    stats, on_host = engine.cache_stats()["host"], _held(engine.host.handles())
    loads = stats["loads"]
    answers = _ask_all(engine, query, lasts)
    held, mib = _held(engine.cache.handles()), 2 ** 20
    print(f"\n| shed: host tier contexts | it counts | KV tensors held |\n|---:|---:|---:|\n"
          f"| {stats['contexts']} | {stats['bytes'] / mib:.0f} MiB | {on_host['held_bytes'] / mib:.0f} MiB |")
    print(f"\n| shed, then every conversation's last turn | loaded | host loads | same answer | mean seconds | "
          f"cache counts | KV tensors held | kept contexts each alone |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n"
          f"| {len(answers)} | {sum(a[1] for a in answers)} | {engine.cache_stats()['host']['loads'] - loads} | "
          f"{sum(a[2] for a in answers)} | {sum(a[0] for a in answers) / len(answers):.2f} | "
          f"{engine.cache.nbytes / mib:.0f} MiB | {held['held_bytes'] / mib:.0f} MiB | "
          f"{held['alone_bytes'] / mib:.0f} MiB |")
    return dict(shed_host_contexts=stats["contexts"], shed_host_counted_bytes=stats["bytes"],
                shed_host_held_bytes=on_host["held_bytes"], shed_loaded=sum(a[1] for a in answers),
                shed_host_loads=engine.cache_stats()["host"]["loads"] - loads,
                shed_same=sum(a[2] for a in answers), shed_seconds_mean=sum(a[0] for a in answers) / len(answers),
                shed_cache_counted_bytes=engine.cache.nbytes, shed_held_bytes=held["held_bytes"],
                shed_alone_bytes=held["alone_bytes"], shed_kept=held["kept"])


def _host(engine) -> dict:
    """What the host-memory tier keeps at the end (the contexts the cache evicted), as :func:`_held` reads it."""
    stats, held = engine.cache_stats()["host"], _held(engine.host.handles())
    mib = 2 ** 20
    print(f"\n| host tier: contexts kept | evicted | it counts | KV tensors held | kept contexts each alone |\n"
          f"|---:|---:|---:|---:|---:|\n"
          f"| {held['kept']} | {stats['evictions']} | {stats['bytes'] / mib:.0f} MiB | "
          f"{held['held_bytes'] / mib:.0f} MiB | {held['alone_bytes'] / mib:.0f} MiB |")
    return {f"host_{k}": v for k, v in held.items()} | dict(host_counted_bytes=stats["bytes"],
                                                            host_evictions=stats["evictions"])


def _held(handles) -> dict:
    """The contexts of ``handles``; the bytes of the distinct storages their KV tensors view (what this process
    holds for them, however they share it); and the sum of their own KV bytes (what each would hold alone)."""
    storages, alone = {}, 0
    for h in handles:
        for layer in (seg for i in range(h.shard.num_layers) for seg in h.shard.segments(i)):  # a fork's head too
            for t in (layer.k, layer.v, layer.pos):
                if t is not None:
                    s = t.untyped_storage()
                    storages[(s.device.type, s.data_ptr())] = s.nbytes()
                    alone += t.numel() * t.element_size()
    return dict(kept=len(handles), held_bytes=sum(storages.values()), alone_bytes=alone)


if __name__ == "__main__":
    sys.exit(main())
