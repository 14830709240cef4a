"""The sparse-prefill gap report (paper Sec. 3's error decomposition, Sec. 8.8's "matched frontier", Sec. 9.1's
support-level diagnostics): on ONE model, suite, sample set and budget list,

* rows: dense; the per-query oracle (``b_sel 1``); the block-shared oracle (``b_sel`` = ``--block``, 64 as in the
  paper's fused path); the distilled indexer per query and block-shared -- each at every ``k`` of ``--topk``;
* gaps, all paired over the same samples (the same generated items answered by both rows):
  **oracle gap** = oracle(b_sel 1) − dense, **realization gap** = oracle(b_sel block) − oracle(b_sel 1),
  **indexer gap** = indexer − oracle at the same ``k`` and ``b_sel``;
* the causal token-pair sparsity each sparse row realised (counted by the engine, against the Sec. 5.1 formula);
* the support-level diagnostics of the indexer file (held-out validation KL and recall of the oracle top-k
  support, before/after distillation, as ``magnetar-calibrate indexer`` stored them).

    python -m magnetar.eval.experiments.prefill_gap --model smollm2-135m-instruct --suite ruler --lengths 4k,8k \\
        --topk 128,256,512 --samples 10 --indexer-path indexers/smollm2.pt --out runs/gap
    python -m magnetar.eval.experiments.prefill_gap --report --suite ruler --lengths 4k,8k --topk 128,256,512 \\
        --indexer-path indexers/smollm2.pt --out runs/gap           # the table only, from the results there

It runs :mod:`magnetar.eval.runner` (``magnetar-eval``) once per row with the matching ``--prefill-*`` flags into
``--out``: the runner's item keys contain the engine config, so the rows coexist there and an interrupted report
resumes. Any other flag (``--batch``, ``--tasks``, ``--dtype``, ``--prefill-dense-layers``,
``--data-seed`` ...) is handed to every runner call, and a result counts for a row only if its key is the one
the runner would give that row with these flags -- so a directory holding other runs is never pooled in
(``--indexer-path`` is made absolute first: rows run by hand with ``magnetar-eval`` and a relative path have
another key).
Without ``--indexer-path`` (or with a missing file) the indexer rows are skipped with a note. Method: dense
(single rank), as in the paper's tables. Writes ``OUT/gap.md`` and prints it.

Scores: ruler / niah as in ``magnetar-eval`` (0-100, mean ± 95 % normal interval, n samples); ppl as
perplexity [95 % interval] and the gaps as the paired change of perplexity in %. Missing rows show ``-``.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

SUITES = ("ruler", "niah", "ppl")
OWN_FLAGS = ("--prefill-policy", "--prefill-topk", "--prefill-b-sel", "--prefill-indexer-path", "--methods",
             "--prefill-indexer-random-init", "--method", "--model", "--suite", "--lengths", "--samples", "--out",
             "--report", "--tasks")


@dataclass(frozen=True)
class Variant:
    """One row of the report: ``policy`` none (dense) / oracle / indexer at ``topk`` keys and ``b_sel``."""

    policy: str
    topk: int = 0
    b_sel: int = 1

    @property
    def label(self) -> str:
        if self.policy == "none":
            return "dense"
        kind = "per query" if self.b_sel == 1 else "block-shared"
        return f"{self.policy} {kind} (k {self.topk}, b_sel {self.b_sel})"

    def flags(self, indexer_path: Optional[str]) -> list[str]:
        if self.policy == "none":
            return []
        out = ["--prefill-policy", self.policy, "--prefill-topk", str(self.topk), "--prefill-b-sel", str(self.b_sel)]
        if self.policy == "indexer":
            out += ["--prefill-indexer-path", str(indexer_path)]
        return out


def variants(topks: Sequence[int], block: int, indexer: bool) -> list[Variant]:
    out = [Variant("none")]
    for k in topks:
        out += [Variant("oracle", k, 1), Variant("oracle", k, block)]
        if indexer:
            out += [Variant("indexer", k, 1), Variant("indexer", k, block)]
    return out


def runner_argv(args, variant: Variant, extra: Sequence[str]) -> list[str]:
    argv = ["--model", args.model, "--suite", args.suite, "--methods", "dense", "--lengths", args.lengths,
            "--samples", str(args.samples), "--out", str(args.out)]
    if args.tasks:
        argv += ["--tasks", args.tasks]
    return argv + list(extra) + variant.flags(args.indexer_path)


def variant_key(args, variant: Variant, extra: Sequence[str]) -> tuple[str, Optional[str]]:
    """The config part of the runner's item keys for ``variant`` (and ppl's ``T<target tokens>`` suffix)."""
    from magnetar.config import EngineConfig
    from magnetar.eval.runner import build_parser, config_key

    ns = build_parser().parse_args(runner_argv(args, variant, extra))
    base = EngineConfig.from_cli(argparse.Namespace(**{k: v for k, v in vars(ns).items() if k != "method"}))
    suffix = f"T{ns.target_tokens}" if args.suite == "ppl" else None
    return config_key(base.replace(method="dense", cp_size=1)), suffix


# -- statistics ----------------------------------------------------------------------------------------------
def _mean_ci(values: Sequence[float]) -> tuple[float, float, int]:
    """Mean, half-width of the 95 % normal interval, n (no clipping: also for differences)."""
    n = len(values)
    m = sum(values) / n
    var = sum((v - m) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return m, 1.96 * math.sqrt(var / n), n


def _len(length: int) -> str:
    return f"{length // 1024}K" if length % 1024 == 0 else str(length)


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


# -- the report ------------------------------------------------------------------------------------------------
def select_rows(rows: Sequence[dict], keys: dict[Variant, tuple[str, Optional[str]]], suite: str,
                tasks: Optional[Sequence[str]] = None, samples: Optional[int] = None
                ) -> dict[tuple[Variant, int], dict[tuple[str, int], dict]]:
    """``{(variant, length): {(task, index): row}}`` for the rows whose runner key is a variant's; only the
    ``tasks`` asked for and sample indices below ``samples`` (the directory may hold more: e.g. a dense run of
    every task at n = 10), so every row is averaged over the same item set."""
    by_key = {}
    for v, (ck, suffix) in keys.items():
        by_key[(ck, suffix)] = v
    out: dict = defaultdict(dict)
    for r in rows:
        parts = str(r.get("key", "")).split("/")
        if len(parts) < 6 or parts[0] != suite or parts[2] != "dense":
            continue
        v = by_key.get((parts[5], parts[6] if len(parts) > 6 else None))
        if tasks and r["task"] not in tasks or samples is not None and int(r["index"]) >= samples:
            continue
        if v is not None:
            out[(v, int(r["length"]))][(r["task"], int(r["index"]))] = r
    return out


def _value(row: dict, suite: str) -> float:
    """Per-item value: the score x 100 (ruler/niah) or the mean NLL per scored token (ppl)."""
    if suite == "ppl":
        return float(row["nll_sum"]) / int(row["tokens"])
    return 100.0 * float(row["score"])


def score_cell(items: dict, suite: str) -> str:
    if not items:
        return "-"
    if suite == "ppl":
        from magnetar.eval.ppl import perplexity_ci

        rs = list(items.values())
        ppl, lo, hi, n = perplexity_ci([float(r["nll_sum"]) for r in rs], [int(r["tokens"]) for r in rs])
        return f"{ppl:.3f} [{lo:.3f}, {hi:.3f}] (n={n})"
    m, h, n = _mean_ci([_value(r, suite) for r in items.values()])
    return f"{m:.1f} ± {h:.1f} (n={n})"


def gap_cell(a: dict, b: dict, suite: str) -> str:
    """``a − b`` paired over the items both hold: points (ruler/niah) or the change of perplexity in % (ppl)."""
    shared = [i for i in a if i in b]
    if not shared:
        return "-"
    d = [_value(a[i], suite) - _value(b[i], suite) for i in shared]
    m, h, n = _mean_ci(d)
    if suite == "ppl":
        lo, mid, hi = (100 * (math.exp(x) - 1) for x in (m - h, m, m + h))
        return f"{mid:+.2f} % [{lo:+.2f}, {hi:+.2f}] (n={n})"
    return f"{m:+.1f} ± {h:.1f} (n={n})"


def sparsity_cell(items: dict) -> str:
    """Realised causal token-pair sparsity of the patched layers over the cell's items, vs the formula."""
    stats = [r["prefill"] for r in items.values() if r.get("prefill")]
    if not stats:
        return "-"
    kept, causal = sum(s["kept_pairs"] for s in stats), sum(s["causal_pairs"] for s in stats)
    real = 1 - kept / causal if causal else 0.0
    formula = sum(s["formula_sparsity"] for s in stats) / len(stats)
    empty = sum(s.get("empty_rows", 0) for s in stats)
    return f"{_pct(real)} (formula {_pct(formula)})" + (f", {empty} empty rows" if empty else "")


def diagnostics(meta: Optional[dict], path: Optional[str]) -> list[str]:
    """The indexer file's support-level diagnostics (Sec. 9.1), as stored by ``magnetar-calibrate indexer``."""
    if not path:
        return []
    if meta is None:
        return [f"Indexer file {path}: not found, no support-level diagnostics."]
    if not meta.get("kl_after"):
        return [f"Indexer file {path}: no stored distillation metrics (not written by magnetar-calibrate indexer, "
                f"or untrained)."]
    cfg = meta.get("train_config", {})
    layers = sorted(meta["kl_after"])
    mean = {m: sum(meta[m][layer] for layer in layers) / len(layers)
            for m in ("kl_before", "kl_after", "recall_before", "recall_after")}
    lo = {m: min(meta[m][x] for x in layers) for m in ("recall_before", "recall_after")}
    hi = {m: max(meta[m][x] for x in layers) for m in ("recall_before", "recall_after")}
    missing = [layer for layer in meta.get("layers", layers) if layer not in layers]
    out = ["### Support-level diagnostics of the indexer (held-out, from the file)\n",
           f"{path}: d_idx {cfg.get('d_idx')}, {len(layers)} layers distilled"
           + (f" ({len(missing)} not yet: {missing})" if missing else "")
           + f"; {meta.get('metrics_note', '')}. Measured at the calibration's sequence length "
             f"({cfg.get('seq_len')} tokens) and k = {cfg.get('topk')}, not at the rows' lengths and budgets.\n",
           "| metric (mean over layers) | random init | distilled |", "|---|---:|---:|",
           f"| validation KL(P ‖ softmax(z)) (nats) | {mean['kl_before']:.4f} | {mean['kl_after']:.4f} |",
           f"| recall of the oracle top-{cfg.get('topk')} support (b_sel {cfg.get('b_sel')}) | "
           f"{mean['recall_before']:.3f} | {mean['recall_after']:.3f} |",
           f"| min / max recall over layers | {lo['recall_before']:.3f} / {hi['recall_before']:.3f} | "
           f"{lo['recall_after']:.3f} / {hi['recall_after']:.3f} |",
           ""]
    return out


def build_report(rows: Sequence[dict], keys: dict[Variant, tuple[str, Optional[str]]], *, suite: str,
                 lengths: Sequence[int], topks: Sequence[int], block: int, notes: Sequence[str] = (),
                 indexer_meta: Optional[dict] = None, indexer_path: Optional[str] = None,
                 title: str = "", tasks: Optional[Sequence[str]] = None, samples: Optional[int] = None) -> str:
    """The markdown report from result rows (see the module docstring); ``keys``: the variants to show;
    ``tasks`` / ``samples``: the item set (see :func:`select_rows`)."""
    cells = select_rows(rows, keys, suite, tasks, samples)
    vs = list(keys)
    what = "perplexity [95 % interval] (n windows)" if suite == "ppl" else \
        "score 0-100, mean ± 95 % interval (n samples)"
    out = [f"## Sparse-prefill gap report{': ' + title if title else ''}\n",
           f"Suite {suite}, method dense, patched layers: every global attention layer (see the runs' config). "
           f"Cells: {what}; sparsity: the causal token-pair sparsity the engine counted over the patched layers "
           f"(and the Sec. 5.1 per-query formula at the rows' context lengths). `-`: no result.\n"]
    out += [f"Note: {n}\n" for n in notes]
    out.append("| row | " + " | ".join(f"{_len(L)} | {_len(L)} sparsity" for L in lengths) + " |")
    out.append("|---|" + "---:|---|" * len(lengths))
    for v in vs:
        out.append(f"| {v.label} | " + " | ".join(
            f"{score_cell(cells.get((v, L), {}), suite)} | "
            f"{'-' if v.policy == 'none' else sparsity_cell(cells.get((v, L), {}))}" for L in lengths) + " |")
    out.append("")
    unit = "paired change of perplexity, % [95 % interval]" if suite == "ppl" else \
        "paired difference in points ± 95 % interval"
    out.append(f"### Gaps ({unit}; negative = worse than the reference{' for scores' if suite != 'ppl' else ''}"
               f"{'; positive = higher perplexity' if suite == 'ppl' else ''})\n")
    out.append("| k | length | oracle gap: oracle(b_sel 1) − dense | realization gap: oracle(b_sel "
               f"{block}) − oracle(b_sel 1) | indexer gap, b_sel 1: indexer − oracle | indexer gap, b_sel {block}: "
               "indexer − oracle |")
    out.append("|---:|---|---:|---:|---:|---:|")
    dense = Variant("none")
    for k in topks:
        o1, ob, i1, ib = (Variant("oracle", k, 1), Variant("oracle", k, block), Variant("indexer", k, 1),
                          Variant("indexer", k, block))
        for L in lengths:
            def c(v, L=L):
                return cells.get((v, L), {}) if v in keys else {}

            out.append(f"| {k} | {_len(L)} | {gap_cell(c(o1), c(dense), suite)} | {gap_cell(c(ob), c(o1), suite)} | "
                       f"{gap_cell(c(i1), c(o1), suite)} | {gap_cell(c(ib), c(ob), suite)} |")
    out.append("")
    out += diagnostics(indexer_meta, indexer_path)
    return "\n".join(out)


# -- command line ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m magnetar.eval.experiments.prefill_gap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--suite", choices=SUITES, default="ruler")
    p.add_argument("--lengths", default="4k,8k", help="context lengths, e.g. 4k,8k (k = 1024 tokens)")
    p.add_argument("--topk", default="128,256,512", help="budgets k (keys per query or per selection block)")
    p.add_argument("--block", type=int, default=64, help="b_sel of the block-shared rows (the paper's fused path: 64)")
    p.add_argument("--samples", type=int, default=10, help="samples per task (niah: per depth; ppl: windows)")
    p.add_argument("--tasks", help="comma-separated subset of the suite's tasks (default: all)")
    p.add_argument("--indexer-path", help="distilled indexer file (magnetar-calibrate indexer); without it the "
                                          "indexer rows are skipped")
    p.add_argument("--out", required=True, help="results directory (shared by every row; resumable)")
    p.add_argument("--report", action="store_true", help="only build the table from the results in --out")
    return p


def parse_args(argv=None):
    args, extra = build_parser().parse_known_args(argv)
    bad = [a for a in extra if a.split("=")[0] in OWN_FLAGS]
    if bad:
        raise SystemExit(f"{bad}: the gap report sets these itself (one runner call per row); see --help")
    try:
        args.topks = [int(x) for x in args.topk.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--topk must be comma-separated ints, got {args.topk!r}") from None
    if not args.topks or min(args.topks) < 1 or args.block < 2:
        raise SystemExit("--topk needs budgets >= 1 and --block a b_sel >= 2")
    from magnetar.eval.common import parse_length
    from magnetar.eval.runner import build_parser as runner_parser

    args.length_list = [parse_length(x) for x in args.lengths.split(",") if x.strip()]
    if args.indexer_path:
        args.indexer_path = str(Path(args.indexer_path).expanduser().resolve())
    try:  # the hand-over flags must be ones the runner knows (checked before anything runs)
        runner_parser().parse_args(["--out", str(args.out), *extra])
    except SystemExit:
        raise SystemExit(f"unknown flag(s) among {extra} (passed to magnetar-eval)") from None
    return args, extra


def main(argv=None) -> int:
    args, extra = parse_args(argv)
    notes, meta = [], None
    have_indexer = bool(args.indexer_path) and Path(args.indexer_path).is_file()
    if not args.indexer_path:
        notes.append("indexer rows skipped: no --indexer-path (distil one with magnetar-calibrate indexer).")
    elif not have_indexer:
        notes.append(f"indexer rows skipped: {args.indexer_path} does not exist.")
    if have_indexer:
        from magnetar.prefill.indexer import INDEXER_FILE

        data = INDEXER_FILE.read(args.indexer_path)
        meta = dict(data.get("meta", {}))
        if not data.get("trained_layers"):
            notes.append(f"{args.indexer_path} is UNTRAINED (random init): its rows are a stress test, not quality "
                         "evidence (Sec. 7.1).")
    vs = variants(args.topks, args.block, have_indexer)
    keys = {v: variant_key(args, v, extra) for v in vs}
    if not args.report:
        from magnetar.eval import runner

        for i, v in enumerate(vs, 1):
            print(f"[{i}/{len(vs)}] {v.label}", file=sys.stderr, flush=True)
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):  # the runner prints its whole report after every call
                runner.main(runner_argv(args, v, extra))
            first = buf.getvalue().strip().splitlines()[:1]
            if first:
                print(f"    {first[0]}", file=sys.stderr, flush=True)
    from magnetar.eval.report import load

    rows = load(Path(args.out))
    md = build_report(rows, keys, suite=args.suite, lengths=args.length_list, topks=args.topks, block=args.block,
                      notes=notes, indexer_meta=meta, indexer_path=args.indexer_path,
                      tasks=[t.strip() for t in args.tasks.split(",")] if args.tasks else None, samples=args.samples,
                      title=f"{args.model}, {args.samples} samples per task"
                            + (f" of {args.tasks}" if args.tasks else "")
                            + (f", extra flags {' '.join(extra)}" if extra else ""))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gap.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
