"""LuKA perplexity figures on long real text (the LuKA paper's Figures 4-6, our windows).

    python -m magnetar.eval.experiments.luka_ppl --figure compressors --lengths 2k --windows 8 --out runs/luka_ppl
    python -m magnetar.eval.experiments.luka_ppl --figure values      --lengths 2k --windows 8 --out runs/luka_ppl
    python -m magnetar.eval.experiments.luka_ppl --figure modes       --lengths 2k,4k --windows 8 --out runs/luka_ppl
    python -m magnetar.eval.experiments.luka_ppl --report --out runs/luka_ppl

* ``compressors`` (Figure 4): clustered attention in every layer with the ``top_fraction`` rule and the paper's
  mass-preserving refinement (Eq. 3, ``luka_refine_mass=preserve``), perplexity vs the fraction rho of pages
  refined per step, one curve per compressor (attention_weighted, mean, random);
* ``values`` (Figure 6): the same for attention_weighted and mean with summary values set to 0;
* ``exact`` (the authors' code, Magnetar's default): the same for attention_weighted and mean with
  ``luka_refine_mass=exact`` -- a refined page's tokens get their own mass instead of sharing the summary's, so
  rho = 1 is dense attention exactly;
* ``modes`` (Figure 5): lined-only, clustered-only and mixed with the paper's settings (top_k 3, pages of
  16, raw tail 128, heavy hitters 1/8, mixed = ``--lined-layers`` first and last layers lined).

Windows are those of the ``ppl`` suite (:mod:`magnetar.eval.ppl`: Shakespeare, a context of ``L`` tokens,
then 256 scored tokens). The context is encoded once per window (dense Phase 1, recording each key's attention
mass); the continuation is then scored teacher-forced with dense decoding and with every variant
(:meth:`magnetar.Engine.score_variants`), in chunks of ``luka_compress_every`` (16) tokens: LuKA's state
(accumulated mass, pages) advances after each chunk, as it would after 16 decoded tokens, and each token of a
chunk chooses its own refined pages, as its decode step would. The paper measures
512 / 1024 tokens of one PG-19 book; ours are many windows of longer contexts, with 95 % intervals.
Results are appended to ``OUT/results.jsonl`` (resumable); the report is ``OUT/report.md`` and PNGs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from magnetar.config import LUKA_COMPRESSORS, EngineConfig, LukaConfig
from magnetar.eval.report import load  # the runner's resumable results*.jsonl reader (a cut last line is redone)
from magnetar.eval.results import append_records  # ends a cut last line first

FIGURES = ("compressors", "values", "exact", "modes")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m magnetar.eval.experiments.luka_ppl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--figure", default="compressors", help=f"comma list of {FIGURES}")
    p.add_argument("--fractions", default="0,0.05,0.1,0.25,0.5,1", help="refinement fractions (compressors, values)")
    p.add_argument("--lined-layers", type=int, default=8, help="modes: first and last layers lined in 'mixed'")
    p.add_argument("--lengths", default="2k")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--target-tokens", type=int, default=256)
    p.add_argument("--threads", type=int)
    p.add_argument("--out", required=True)
    p.add_argument("--report", action="store_true", help="only write the report from OUT/results.jsonl")
    return p


def variants(figure: str, fractions: list[float], lined_layers: int) -> list[tuple[str, LukaConfig]]:
    """``(series, config)`` pairs of one figure; the series names a curve / bar."""
    if figure in ("compressors", "values", "exact"):
        comps = LUKA_COMPRESSORS if figure == "compressors" else ("attention_weighted", "mean")
        suffix = {"compressors": "", "values": " V=0", "exact": " exact mass"}[figure]
        return [(c + suffix, LukaConfig(luka_mode="clustered", luka_compressor=c, luka_refine="top_fraction",
                                        luka_refine_fraction=f, luka_zero_values=figure == "values",
                                        luka_refine_mass="exact" if figure == "exact" else "preserve"))
                for c in comps for f in fractions]
    if figure == "modes":
        return [(m, LukaConfig(luka_mode=m, luka_lined_layers=lined_layers)) for m in ("lined", "clustered", "mixed")]
    raise SystemExit(f"unknown figure {figure!r}; choose from {FIGURES}")


def variant_key(cfg: LukaConfig) -> str:
    return json.dumps(dataclasses.asdict(cfg), sort_keys=True)


def run(args) -> int:
    import torch
    from tqdm import tqdm

    import magnetar
    from magnetar.eval.common import parse_length
    from magnetar.eval.ppl import ppl_window
    from magnetar.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fractions = [float(x) for x in args.fractions.split(",") if x.strip()]
    todo_v = [(fig, series, cfg) for fig in (f.strip() for f in args.figure.split(",") if f.strip())
              for series, cfg in variants(fig, fractions, args.lined_layers)]
    done = {(r["length"], r["index"], r["variant_key"]) for r in load(out)}
    model, tokenizer = load_model(args.model)
    lengths = [parse_length(x) for x in args.lengths.split(",")]
    engine = magnetar.init_inference(model, EngineConfig.create(method="dense", deepspeed_inference=False),
                                     tokenizer=tokenizer)
    jobs = [(L, i) for L in lengths for i in range(args.windows)]
    bar = tqdm(jobs, desc="windows", unit="window", dynamic_ncols=True)
    for L, i in bar:
        dense_key = "dense"
        todo = [(fig, s, c) for fig, s, c in todo_v if (L, i, variant_key(c)) not in done]
        need_dense = (L, i, dense_key) not in done
        if not todo and not need_dense:
            continue
        win = ppl_window(tokenizer, L, i, target_tokens=args.target_tokens)
        cfgs = ([None] if need_dense else []) + [c for _, _, c in todo]
        t0 = time.perf_counter()
        results = engine.score_variants(win.context_ids, win.continuation_ids, cfgs)
        labels = ([("dense", "dense", None)] if need_dense else []) + todo
        append_records(out / "results.jsonl", [
            {"figure": fig, "series": series, "length": L, "index": i,
             "variant_key": dense_key if cfg is None else variant_key(cfg),
             "luka": None if cfg is None else dataclasses.asdict(cfg), **win.metadata,
             "nll_sum": res.nll_sum, "tokens": res.tokens, "ppl": res.perplexity,
             "phase2_s": res.phase2_seconds, "window_s": time.perf_counter() - t0}
            for (fig, series, cfg), res in zip(labels, results)])
        bar.set_postfix(length=L)
    print(write_report(out))
    return 0


def write_report(out: Path) -> str:
    from magnetar.eval.ppl import paired_change, perplexity_ci

    rows = load(Path(out))
    if not rows:
        return f"no results in {out}"
    dense = {}
    for r in rows:
        if r["variant_key"] == "dense":
            dense.setdefault(r["length"], {})[r["index"]] = r
    lines = ["# LuKA: perplexity (Shakespeare windows)", "",
             "Perplexity [95 % CI] of 256 scored tokens after a context of L tokens; n = windows. The change vs "
             "dense decoding is paired (same windows): exp(mean per-window NLL difference) - 1 [95 % CI].", ""]

    def cell(g, L):
        p, lo, hi, n = perplexity_ci([r["nll_sum"] for r in g], [r["tokens"] for r in g])
        ch = paired_change({r["index"]: r["nll_sum"] / r["tokens"] for r in g},
                           {i: r["nll_sum"] / r["tokens"] for i, r in dense.get(L, {}).items()})
        return p, (f"{p:.3f} [{lo:.3f}, {hi:.3f}] (n={n})"
                   + ("" if ch is None else f"; {ch[0]:+.1f} % [{ch[1]:+.1f}, {ch[2]:+.1f}]"))

    lengths = sorted({r["length"] for r in rows})
    plots = {}
    for L in lengths:
        if L in dense:
            g = list(dense[L].values())
            p, lo, hi, n = perplexity_ci([r["nll_sum"] for r in g], [r["tokens"] for r in g])
            lines += [f"Dense decoding, context {L}: {p:.3f} [{lo:.3f}, {hi:.3f}] (n={n})", ""]
        for fig in ("compressors", "values", "exact"):
            g_rows = [r for r in rows if r.get("figure") == fig and r["length"] == L]
            if not g_rows:
                continue
            fracs = sorted({r["luka"]["luka_refine_fraction"] for r in g_rows})
            series = sorted({r["series"] for r in g_rows})
            title = {"compressors": "Figure 4: clustered attention, refinement fraction x compressor",
                     "values": "Figure 6: the same with summary values V = 0",
                     "exact": "The same with exact mass for refined pages (the authors' code)"}[fig]
            lines += [f"## {title}, context {L}", "",
                      "| compressor | " + " | ".join(f"rho = {f:g}" for f in fracs) + " |",
                      "|---|" + "---|" * len(fracs)]
            for s in series:
                cells = []
                for f in fracs:
                    g = [r for r in g_rows if r["series"] == s and r["luka"]["luka_refine_fraction"] == f]
                    if not g:
                        cells.append("-")
                        continue
                    p, text = cell(g, L)
                    cells.append(text)
                    plots.setdefault((fig, L), {}).setdefault(s, []).append((f, p))
                lines.append(f"| {s} | " + " | ".join(cells) + " |")
            lines.append("")
        m_rows = [r for r in rows if r.get("figure") == "modes" and r["length"] == L]
        if m_rows:
            lines += [f"## Figure 5: attention modes, context {L}", "", "| mode | perplexity |", "|---|---|"]
            for s in ("lined", "clustered", "mixed"):
                g = [r for r in m_rows if r["series"] == s]
                if g:
                    p, text = cell(g, L)
                    lines.append(f"| {s} | {text} |")
                    plots.setdefault(("modes", L), {})[s] = [(0, p)]
            lines.append("")
    md = "\n".join(lines)
    (Path(out) / "report.md").write_text(md + "\n")
    _plots(Path(out), plots, {L: perplexity_ci([r["nll_sum"] for r in d.values()], [r["tokens"] for r in d.values()])[0]
                              for L, d in dense.items()})
    return md


def _plots(out: Path, plots: dict, dense_ppl: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    for fig_name in ("compressors", "values", "exact"):
        keys = [k for k in plots if k[0] == fig_name]
        if not keys:
            continue
        fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
        for ax, key in zip(axes[0], sorted(keys)):
            for s, pts in sorted(plots[key].items()):
                xs, ys = zip(*sorted(pts))
                ax.plot(xs, ys, marker="o", label=s)
            if key[1] in dense_ppl:
                ax.axhline(dense_ppl[key[1]], ls="--", color="gray", lw=1, label="dense")
            ax.set_xlabel("refinement fraction rho (top_fraction)")
            ax.set_ylabel("perplexity")
            ax.set_title(f"clustered attention, context {key[1]}")
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"luka_ppl_{fig_name}.png", dpi=120)
        plt.close(fig)
    keys = sorted(k for k in plots if k[0] == "modes")
    if keys:
        fig, ax = plt.subplots(figsize=(6, 4))
        modes = ("lined", "clustered", "mixed")
        width = 0.8 / (len(modes) + 1)
        for j, name in enumerate(("dense",) + modes):
            ys = [dense_ppl.get(k[1], float("nan")) if name == "dense"
                  else plots[k].get(name, [(0, float("nan"))])[0][1]
                  for k in keys]
            ax.bar([i + j * width for i in range(len(keys))], ys, width, label=name)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))], [f"context {k[1]}" for k in keys])
        ax.set_ylabel("perplexity")
        ax.set_title("LuKA attention modes vs dense")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "luka_ppl_modes.png", dpi=120)
        plt.close(fig)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.report:
        print(write_report(Path(args.out)))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
