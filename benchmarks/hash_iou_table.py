"""Table 1's shape from trained hash files: retrieval IoU with the oracle top-k before and after training,
averaged over groups of layers, one column pair per hash file (held-out sequences; numbers stored in the file
by ``magnetar-calibrate spotlight``).

    python benchmarks/hash_iou_table.py runs/hashes/smollm2-lsh-trained.pt runs/hashes/smollm2-spotlight.pt

Prints a markdown table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hashes", nargs="+", help="hash files written by magnetar-calibrate spotlight")
    p.add_argument("--groups", type=int, default=3, help="layer groups (Table 1 uses three)")
    args = p.parse_args(argv)
    from magnetar.sparse.hashing import HashBank

    banks = []
    for path in args.hashes:
        bank = HashBank.load(path)
        if "iou_after" not in bank.meta:
            raise SystemExit(f"{path}: no IoU recorded (train it to the end with magnetar-calibrate spotlight)")
        banks.append((path, bank.kind, {int(k): v for k, v in bank.meta["iou_before"].items()},
                      {int(k): v for k, v in bank.meta["iou_after"].items()}))
    layers = sorted(set.intersection(*(set(b[3]) for b in banks)))
    size = -(-len(layers) // args.groups)
    groups = [layers[i : i + size] for i in range(0, len(layers), size)] + [layers]
    head = " | ".join(f"{kind} before | {kind} after" for _, kind, _, _ in banks)
    print(f"| layers | {head} |\n|---|" + "---|---|" * len(banks))
    out = []
    for g in groups:
        name = f"{g[0]}–{g[-1]}" if g is not layers else f"all {len(g)}"
        cells, row = [], {"layers": name}
        for path, kind, before, after in banks:
            b, a = sum(before[i] for i in g) / len(g), sum(after[i] for i in g) / len(g)
            cells += [f"{b:.3f}", f"{a:.3f}"]
            row[kind] = {"before": round(b, 4), "after": round(a, 4)}
        out.append(row)
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(json.dumps({"benchmark": "hash_iou", "files": args.hashes, "rows": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
