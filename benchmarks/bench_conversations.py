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
what the kept contexts would hold each on its own, and the mean wall time of a turn; then one JSON line.

    python benchmarks/bench_conversations.py --conversations 10 --turns 5 --context 8000
    python benchmarks/bench_conversations.py --conversations 1 --turns 20 --context 8000 --context-cache-mb 1024
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
    args = p.parse_args(argv)
    import torch

    import magnetar
    from magnetar.data.texts import paul_graham_essays

    engine = magnetar.init_inference(args.model, method=args.method, cp_size=args.ranks, simulate=args.ranks > 1,
                                     prefix_reuse=args.prefix_reuse, context_cache_mb=args.context_cache_mb,
                                     timeout_s=3600)
    text = "\n\n".join(paul_graham_essays())
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    doc = torch.tensor(ids[: args.context])
    pool = torch.tensor(ids[args.context:])  # the turns' tokens: later text of the essays
    query = torch.tensor(engine.tokenizer(" What next?", add_special_tokens=False)["input_ids"])
    t0 = time.perf_counter()
    first = engine.generate(doc, query, max_new_tokens=1)
    encoded, shards, per_conversation, turn_seconds = [first.context_tokens], [], [], []
    for c in range(args.conversations):
        ctx, mine = doc, 0
        for t in range(args.turns):
            start = (c * args.turns + t) * args.turn_tokens
            ctx = torch.cat((ctx, pool[start:start + args.turn_tokens]))
            t1 = time.perf_counter()
            r = engine.generate(ctx, query, max_new_tokens=1)
            turn_seconds.append(time.perf_counter() - t1)
            mine += r.context_tokens - r.cached_context_tokens
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
    held = _held(engine.cache)
    mib = 2 ** 20
    print(f"\n| contexts kept | evicted | cache counts | KV tensors held | kept contexts each alone | mean turn |\n"
          f"|---:|---:|---:|---:|---:|---:|\n"
          f"| {held['kept']} | {engine.cache.evictions} | {engine.cache.nbytes / mib:.0f} MiB | "
          f"{held['held_bytes'] / mib:.0f} MiB | {held['alone_bytes'] / mib:.0f} MiB | "
          f"{sum(turn_seconds) / len(turn_seconds):.3f} s |")
    print(json.dumps(dict(model=args.model, method=args.method, ranks=args.ranks, context=args.context,
                          conversations=args.conversations, turns=args.turns, turn_tokens=args.turn_tokens,
                          encoded_one=one, encoded_all=total, ratio=total / one, shard_ratio=ratio,
                          seconds=seconds, context_cache_mb=args.context_cache_mb,
                          evictions=engine.cache.evictions, cache_counted_bytes=engine.cache.nbytes,
                          turn_seconds_mean=sum(turn_seconds) / len(turn_seconds), **held)))
    return 0


def _held(cache) -> dict:
    """The contexts ``cache`` keeps; the bytes of the distinct storages their KV tensors view (what this process
    holds for them, however they share it); and the sum of their own KV bytes (what each would hold alone)."""
    storages, alone, handles = {}, 0, cache.handles()
    for h in handles:
        for layer in h.shard.layers:
            for t in (layer.k, layer.v, layer.pos):
                if t is not None:
                    s = t.untyped_storage()
                    storages[(s.device.type, s.data_ptr())] = s.nbytes()
                    alone += t.numel() * t.element_size()
    return dict(kept=len(handles), held_bytes=sum(storages.values()), alone_bytes=alone)


if __name__ == "__main__":
    sys.exit(main())
