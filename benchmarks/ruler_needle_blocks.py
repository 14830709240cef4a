"""Where the needle was: RULER-style NIAH scores per method by the context block that holds the asked needle.

Star and Pulsar encode block 0 exactly as dense does and every later block without (all of) the text
before it, so a method that loses items only when their needle sits in a later block loses them in Phase 1's
encoding of that block; one that also loses block-0 items loses them in Phase 2 (the later blocks' KV pull the
answer elsewhere). The records do not store needle positions: every sample is made again from its seed, as
the runner made it (``runner.fitted_sample``), and the asked needle (the one holding the first answer) is
located in the Phase-1 token ids; block = token offset // ceil(L / blocks), the engine's default plan.

    python benchmarks/ruler_needle_blocks.py docs/results/niah8k docs/results/ruler4k --blocks 4

Prints one markdown table (method x length rows, a column per block: right / items) and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def needle_block(sample, context_ids, tokenizer, blocks: int) -> int:
    """The block (of ``blocks`` equal ones over the Phase-1 ids) holding the needle of ``sample.answers[0]``."""
    needle = next(n for n in sample.metadata["needles"] if sample.answers[0] in n)
    before = sample.context[: sample.context.index(needle)]
    n_before = len(tokenizer(before, add_special_tokens=False)["input_ids"])
    n_context = len(tokenizer(sample.context, add_special_tokens=False)["input_ids"])
    offset = n_before + (int(context_ids.numel()) - n_context)  # the chat template's head comes first
    size = -(-int(context_ids.numel()) // blocks)
    return min(blocks - 1, max(0, offset // size))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="magnetar-eval output directories (results*.jsonl)")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="the model (registry name or folder) whose tokenizer made the samples")
    p.add_argument("--blocks", type=int, default=4, help="context blocks (the runs' CP size)")
    p.add_argument("--data-seed", type=int, default=0, help="the runs' --data-seed")
    args = p.parse_args(argv)
    from transformers import AutoConfig, AutoTokenizer

    from magnetar.eval.report import label, load, tag_cp_sizes
    from magnetar.eval.runner import fitted_sample
    from magnetar.models.prepare import model_path

    rows = tag_cp_sizes([r for d in args.runs for r in load(Path(d)) if r.get("suite") == "ruler"
                         and str(r.get("task", "")).startswith("niah") and r.get("score") is not None])
    if not rows:
        raise SystemExit(f"no RULER-style NIAH records in {args.runs}")
    path = str(model_path(args.model))  # the tokenizer and the positions are needed, not the weights
    tokenizer = AutoTokenizer.from_pretrained(path)
    positions = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
    where, cells = {}, defaultdict(list)  # (task, length, index) -> block; (label, length, block) -> scores
    for r in rows:
        item = (r["task"], r["length"], r["index"])
        if item not in where:
            sample, _, (context_ids, _) = fitted_sample("ruler", r["task"], tokenizer, r["length"], r["index"],
                                                        args.data_seed, positions)
            where[item] = needle_block(sample, context_ids, tokenizer, args.blocks)
        cells[(label(r), r["length"], where[item])].append(float(r["score"]))
    columns = sorted({(k[0], k[1]) for k in cells}, key=lambda c: (c[1], c[0]))
    print("| method | length | " + " | ".join(f"needle in block {b}" for b in range(args.blocks)) + " |")
    print("|---|---:|" + "---:|" * args.blocks)
    out = []
    for lab, length in columns:
        row = [cells.get((lab, length, b), []) for b in range(args.blocks)]
        print(f"| {lab} | {length // 1024}K | " + " | ".join(f"{sum(s):g} / {len(s)}" for s in row) + " |")
        out.append({"method": lab, "length": length, "right": [sum(s) for s in row], "items": [len(s) for s in row]})
    print(json.dumps({"needle_blocks": out, "blocks": args.blocks, "samples": len(where)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
