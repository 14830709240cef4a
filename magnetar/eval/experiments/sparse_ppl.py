"""Perplexity of sparse decoding (Spotlight Attention Table 2's shape) on long real text.

    python -m magnetar.eval.experiments.sparse_ppl --policies oracle_topk,lsh,quest,spotlight --pruning 0.9,0.95,0.98 \\
        --hash-path hashes/smollm2-spotlight.pt --lengths 4k --windows 16 --out runs/sparse_ppl
    python -m magnetar.eval.experiments.sparse_ppl --report --out runs/sparse_ppl

Windows are those of the ``ppl`` suite (:mod:`magnetar.eval.ppl`: Shakespeare, context ``L`` then 256 scored
tokens). Each window's context is encoded ONCE per method (dense, or star/pulsar with simulated ranks), then
its continuation is scored teacher-forced with dense decoding and with every (policy, pruning) variant
(:meth:`magnetar.Engine.score_variants`): each scored token attends, in every layer from ``dense_layers`` on,
to its budget of the context KV -- as a decoded token would -- plus the continuation before it. (The paper
instead runs the whole sequence sparsely without a dense prefill; ours measures the decoding policy alone.)
Results are appended to ``OUT/results.jsonl`` (an interrupted run resumes); the report is a markdown table of
perplexity [95 % CI] per (method, policy) x pruning and a PNG plot.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from magnetar.config import METHODS, SPARSE_DEFAULT_SINKS_WINDOW, EngineConfig, SparseConfig, policy_choices
from magnetar.eval.report import load
from magnetar.eval.results import append_records  # ends a cut last line first


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m magnetar.eval.experiments.sparse_ppl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--methods", default="dense", help="Phase-1 methods: dense, star, pulsar (simulated ranks)")
    p.add_argument("--cp", type=int, default=4, help="ranks simulated for star/pulsar")
    p.add_argument("--policies", default="oracle_topk,lsh,quest,spotlight")
    p.add_argument("--pruning", default="0.9,0.95,0.98", help="pruning rates (fraction of the context KV dropped)")
    p.add_argument("--hash-path", help="spotlight hash weights (magnetar-calibrate spotlight)")
    p.add_argument("--lsh-hash-path", help="optional trained LSH weights (default: random rotations)")
    p.add_argument("--dense-layers", type=int, default=2)
    p.add_argument("--sinks", type=int, default=-1,
                   help="first context tokens always attended, on top of the budget (-1: the policy default, lsh 4)")
    p.add_argument("--window", type=int, default=-1,
                   help="last context tokens always attended, on top of the budget (-1: the policy default, lsh 64)")
    p.add_argument("--lengths", default="4k")
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--target-tokens", type=int, default=256)
    p.add_argument("--threads", type=int)
    p.add_argument("--out", required=True)
    p.add_argument("--report", action="store_true", help="only write the report from OUT/results.jsonl")
    return p


def variants(args) -> list[SparseConfig]:
    out = [SparseConfig()]
    for policy in (x.strip() for x in args.policies.split(",") if x.strip()):
        if policy not in policy_choices("sparse") or policy == "none":
            raise SystemExit(f"unknown policy {policy!r}; choose from {policy_choices('sparse')[1:]}")
        for rate in (float(x) for x in args.pruning.split(",")):
            path = args.hash_path if policy == "spotlight" else args.lsh_hash_path if policy == "lsh" else None
            if policy == "spotlight" and not path:
                raise SystemExit("policy spotlight needs --hash-path (train it with `magnetar-calibrate spotlight`)")
            out.append(SparseConfig(sparse_policy=policy, sparse_pruning=rate, dense_layers=args.dense_layers,
                                    hash_path=path, sparse_sinks=args.sinks, sparse_window=args.window))
    return out


def run(args) -> int:
    import torch

    import magnetar
    from magnetar.eval.common import parse_length
    from magnetar.eval.ppl import ppl_window
    from magnetar.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    vs = variants(args)
    done = {(r["method"], r["length"], r["index"], r["variant_key"]) for r in load(out)}
    model, tokenizer = load_model(args.model)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    lengths = [parse_length(x) for x in args.lengths.split(",")]
    jobs = [(m, L, i) for m in methods for L in lengths for i in range(args.windows)]
    from tqdm import tqdm

    engines = {}
    bar = tqdm(jobs, desc="windows", unit="window", dynamic_ncols=True)
    for method, L, i in bar:
        todo = [v for v in vs if (method, L, i, _vkey(v)) not in done]
        if not todo:
            continue
        if method not in engines:
            distributed = METHODS[method].distributed
            cfg = EngineConfig.create(method=method, cp_size=args.cp if distributed else 1, simulate=distributed,
                                      deepspeed_inference=False)
            engines[method] = magnetar.init_inference(model, cfg, tokenizer=tokenizer)
        win = ppl_window(tokenizer, L, i, target_tokens=args.target_tokens)
        t0 = time.perf_counter()
        results = engines[method].score_variants(win.context_ids, win.continuation_ids, todo)
        append_records(out / "results.jsonl", [
            {"method": method, "length": L, "index": i, "variant_key": _vkey(v), "policy": v.sparse_policy,
             "pruning": v.sparse_pruning, "budget": v.budget(L) if v.sparse_policy != "none" else L,
             "dense_layers": v.dense_layers, "hash_path": v.hash_path, "sinks": v.sinks, "window": v.window,
             **win.metadata, "nll_sum": res.nll_sum, "tokens": res.tokens, "ppl": res.perplexity,
             "phase2_s": res.phase2_seconds, "window_s": time.perf_counter() - t0}
            for v, res in zip(todo, results)])
        bar.set_postfix(method=method, length=L)
    print(write_report(out))
    return 0


def _vkey(v: SparseConfig) -> str:
    key = f"{v.sparse_policy}/{v.sparse_pruning:g}/{v.dense_layers}/{Path(v.hash_path).name if v.hash_path else ''}"
    if v.sparse_policy != "none" and (v.sparse_sinks != -1 or v.sparse_window != -1):
        key += f"/s{v.sinks}w{v.window}"  # policy defaults keep the key they always had
    return key


def _paired(rows: list[dict], base: list[dict] | None) -> str:
    """The change vs dense decoding on the same windows (see :func:`magnetar.eval.ppl.paired_change`)."""
    from magnetar.eval.ppl import paired_change

    ch = paired_change({r["index"]: r["nll_sum"] / r["tokens"] for r in rows},
                       {r["index"]: r["nll_sum"] / r["tokens"] for r in base or ()})
    return "" if ch is None else f"; {ch[0]:+.1f} % [{ch[1]:+.1f}, {ch[2]:+.1f}] vs dense"


def _row_label(r: dict) -> str:
    """The policy, the hash file for hashed policies (random and trained LSH are different rows) and the
    sinks / window attended on top of the budget."""
    hp, pol = r.get("hash_path"), r["policy"]
    label = pol + (f" [{Path(hp).stem}]" if hp and pol in ("lsh", "spotlight") else "")
    if pol != "none":
        default = SPARSE_DEFAULT_SINKS_WINDOW.get(pol, (0, 0))  # records written before sinks/window were stored
        sinks, window = r.get("sinks", default[0]), r.get("window", default[1])
        if sinks or window:
            label += f" +{sinks} sinks +{window} window"
    return label


def write_report(out: Path) -> str:
    from magnetar.eval.ppl import perplexity_ci

    rows = load(Path(out))
    if not rows:
        return f"no results in {out}"
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["method"], r["length"], _row_label(r), r["pruning"]), []).append(r)
    lengths = sorted({r["length"] for r in rows})
    methods = sorted({r["method"] for r in rows}, key=lambda m: (m != "dense", m))
    rates = sorted({r["pruning"] for r in rows if r["policy"] != "none"})
    order = {p: i for i, p in enumerate(policy_choices("sparse"))}
    policies = sorted({_row_label(r) for r in rows}, key=lambda x: (order.get(x.split(" ")[0], 99), x))
    lines = ["# Sparse decoding: perplexity (Shakespeare windows)", "",
             "Perplexity [95 % CI] of the scored tokens; n = windows. Pruning = fraction of the context KV each "
             "decoded token does NOT attend to (in layers from `dense_layers` on); sinks / window (when a row names "
             "them) are attended on top of that budget, as MagicPIG runs. `lsh` alone uses random SO(d) "
             "rotations; a name in brackets is the hash file used. The change vs dense decoding is paired "
             "(same windows): exp(mean per-window NLL difference) - 1 with its 95 % interval.", ""]
    plot = {}
    for L in lengths:
        for method in methods:
            lines += [f"## context {L} tokens, Phase 1 `{method}`", "",
                      "| decoding | " + " | ".join(f"{100 * r:g} % pruned" for r in rates) + " |",
                      "|---|" + "---|" * max(1, len(rates))]
            base = groups.get((method, L, "none", 0.0))
            if base:
                p, lo, hi, n = perplexity_ci([r["nll_sum"] for r in base], [r["tokens"] for r in base])
                lines.append(f"| dense (0 % pruned) | {p:.3f} [{lo:.3f}, {hi:.3f}] (n={n}) |" + " |" * (len(rates) - 1))
            for pol in policies:
                if pol == "none":
                    continue
                cells = []
                for rate in rates:
                    g = groups.get((method, L, pol, rate))
                    if not g:
                        cells.append("-")
                        continue
                    p, lo, hi, n = perplexity_ci([r["nll_sum"] for r in g], [r["tokens"] for r in g])
                    cells.append(f"{p:.3f} [{lo:.3f}, {hi:.3f}] (n={n})" + _paired(g, base))
                    plot.setdefault((L, method, pol), []).append((rate, p))
                if any(c != "-" for c in cells):  # a policy not run over this Phase 1 gets no row
                    lines.append(f"| {pol} | " + " | ".join(cells) + " |")
            lines.append("")
    md = "\n".join(lines)
    (Path(out) / "report.md").write_text(md + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for (L, method, pol), pts in sorted(plot.items()):
            xs, ys = zip(*sorted(pts))
            ax.plot([100 * x for x in xs], ys, marker="o", label=f"{pol} ({method}, {L})")
        for (method, L, pol, rate), g in groups.items():
            if pol == "none":
                p = perplexity_ci([r["nll_sum"] for r in g], [r["tokens"] for r in g])[0]
                ax.axhline(p, ls="--", color="gray", lw=1)
        ax.set_xlabel("context KV pruned (%)")
        ax.set_ylabel("perplexity")
        ax.set_yscale("log")
        ax.set_title("sparse decoding vs dense (dashed)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(Path(out) / "sparse_ppl.png", dpi=120)
        plt.close(fig)
    except ImportError:
        pass
    return md


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.report:
        print(write_report(Path(args.out)))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
