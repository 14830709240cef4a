"""Does fidelity order methods as accuracy does, and how many items does each need to tell two methods apart?

Pairs a fidelity run (``magnetar-eval --suite fidelity``) with an accuracy run of the same RULER-style items (the
same ``--data-seed``, lengths and tasks: ``magnetar-eval --suite ruler``), item by item, and prints one table per
length (then one JSON line): per method the mean KL against dense and the accuracy change against dense, on the
items both runs hold and on all of the accuracy run's, each with its 95 % t interval; then for every pair of
methods the paired difference in each measure and about how many items each needs for a 95 % interval to
exclude 0 (normal approximation at the observed mean and spread).

    python benchmarks/fidelity_vs_accuracy.py --fidelity runs/fid4k --accuracy docs/results/ruler4k
"""
from __future__ import annotations

import argparse
import json
from itertools import combinations
from pathlib import Path

from magnetar.eval.fidelity import items_to_separate, t_interval
from magnetar.eval.report import label, tag_cp_sizes
from magnetar.eval.results import load


def _fmt(values, scale=1.0, digits=4) -> str:
    if len(values) < 2:
        return "-"
    m, h, n = t_interval(values)
    return f"{scale * m:+.{digits}f} ± {scale * h:.{digits}f} (n={n})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fidelity", required=True, help="the fidelity run's --out")
    p.add_argument("--accuracy", required=True, help="the accuracy run's --out (same items)")
    args = p.parse_args(argv)
    fid = [r for r in load(Path(args.fidelity)) if r.get("suite") == "fidelity"]
    acc = [r for r in load(Path(args.accuracy)) if r.get("score") is not None]
    # labelled as the report labels them: a fidelity folder holding several CP sizes (the frontier) names each
    # record's, so that a 4-rank accuracy record pairs with the 4-rank fidelity record, not the last one read
    tagged = tag_cp_sizes(fid + acc)
    fid, acc = tagged[:len(fid)], tagged[len(fid):]
    kl = {(label(r), r["length"], r["task"], r["index"]): r["kl"] for r in fid}
    score = {(label(r), r["length"], r["task"], r["index"]): r["score"] for r in acc}
    summary = []
    for length in sorted({r["length"] for r in fid}):
        methods = sorted({label(r) for r in fid if r["length"] == length})
        print(f"\n### {length} tokens\n")
        print("| method | KL vs dense (fidelity items) | Δ accuracy vs dense, same items (points) "
              "| Δ accuracy vs dense, all items (points) |")
        print("|---|---|---|---|")
        for m in methods:
            items = [k[2:] for k in kl if k[0] == m and k[1] == length]
            d_same = [score[(m, length, *i)] - score[("dense", length, *i)] for i in items
                      if (m, length, *i) in score and ("dense", length, *i) in score]
            d_all = [score[k] - score[("dense", *k[1:])] for k in score
                     if k[0] == m and k[1] == length and ("dense", *k[1:]) in score]
            print(f"| {m} | {_fmt([kl[(m, length, *i)] for i in items])} | {_fmt(d_same, 100, 1)} | "
                  f"{_fmt(d_all, 100, 1)} |")
            summary.append({"length": length, "method": m, "kl": t_interval([kl[(m, length, *i)] for i in items])[0],
                            "acc_delta_all": t_interval(d_all)[0] if d_all else None, "items": len(items),
                            "acc_items": len(d_all)})
        print("\n| methods | Δ KL (paired) | items to separate (KL) | Δ accuracy (paired, all items) "
              "| items to separate (accuracy) |")
        print("|---|---|---:|---|---:|")
        for a, b in combinations(methods, 2):
            shared = [k[2:] for k in kl if k[0] == a and k[1] == length and (b, length, *k[2:]) in kl]
            dkl = [kl[(a, length, *i)] - kl[(b, length, *i)] for i in shared]
            dacc = [score[k] - score[(b, *k[1:])] for k in score
                    if k[0] == a and k[1] == length and (b, *k[1:]) in score]
            n_kl, n_acc = items_to_separate(dkl), items_to_separate(dacc)
            print(f"| {a} − {b} | {_fmt(dkl)} | {n_kl or '-'} | {_fmt(dacc, 100, 1)} | {n_acc or '-'} |")
            summary.append({"length": length, "pair": f"{a}-{b}", "kl_items_to_separate": n_kl,
                            "accuracy_items_to_separate": n_acc, "kl_items": len(dkl), "acc_items": len(dacc)})
    print()
    print(json.dumps({"bench": "fidelity_vs_accuracy", "rows": summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
