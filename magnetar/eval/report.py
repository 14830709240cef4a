"""Reports from ``results*.jsonl``: a markdown table (task x method x length, with averages as in the Pulsar
paper's Tables 1-2, every cell with its sample count and a 95 % interval; one row per method variant when
an ablation has many), a perplexity table (with the change vs dense) and PNG plots (accuracy vs length per
method, per-task bars, perplexity vs length, and for the NIAH suite a depth x length heat-map per method).
Methods run with non-default options are reported under their label, e.g. ``pulsar(bm25, budget 0.25)``.

The interval is the normal approximation of the mean score over the cell's samples, clipped to [0, 100];
with scores in {0, 1} and few samples it is wide, which is the point of printing it.
"""
from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Optional, Sequence

from magnetar.config import SCORERS
from magnetar.eval.results import load, result_files  # the reader of results*.jsonl (also for scripts)


def mean_ci(scores: list[float]) -> tuple[float, float, int]:
    """(mean x 100, half-width of the 95 % interval x 100, n)."""
    n = len(scores)
    m = sum(scores) / n
    var = sum((s - m) ** 2 for s in scores) / (n - 1) if n > 1 else 0.0
    return 100 * m, 100 * 1.96 * math.sqrt(var / n), n


def _fmt(cell) -> str:
    m, h, n = cell
    return f"{m:.1f} ± {h:.1f} (n={n})"


def label(row: dict) -> str:
    """The report column of a record: the method and its non-default options (see runner.method_label)."""
    return row.get("label") or row["method"]


def tag_cp_sizes(rows: list[dict]) -> list[dict]:
    """``rows`` as the report reads them: where the context-parallel records (``cp_size`` > 1) hold more than one CP
    size -- a frontier over cp 2 / 4 / 8 in one folder -- each such record's label gains ``, cp N`` so that the
    sizes are not pooled into one column; a folder of one CP size keeps its labels."""
    sizes = {r.get("cp_size") for r in rows if (r.get("cp_size") or 1) > 1}
    if len(sizes) < 2:
        return rows
    return [dict(r, label=f"{label(r)}, cp {r['cp_size']}") if (r.get("cp_size") or 1) > 1 else r for r in rows]


def _ordered_tasks(suite: str, tasks) -> list:
    """The suite's own task order (RULER's 13, easy -> very_hard, ...), unknown tasks after, by name."""
    from magnetar.eval.suite import get_suite

    try:
        order = list(get_suite(suite).tasks)
    except ValueError:  # an unknown suite in old records: by name
        order = []
    return sorted(tasks, key=lambda t: (order.index(t) if t in order else len(order), t))


def _len(length: int) -> str:
    if length == 0:
        return "paper length"  # a suite run at each task's own length (wikisalad --lengths 0)
    return f"{length // 1024}K" if length % 1024 == 0 else str(length)


def _task_label(t: str) -> str:
    return t + (" (substitute)" if t in ("qa_1", "qa_2") else "")


# A suite with more method variants than this is printed one row per (variant, length) -- e.g. a scorer x
# budget ablation -- instead of one column each.
WIDE_LABELS = 4


def table(rows: list[dict], oom: Sequence[dict] = ()) -> str:
    """Markdown tables of the scored suites: task x (method, length) with the average over tasks. ``oom``: the
    records of items that did not fit memory (``out_of_memory``): a cell of those alone reads "OOM", one with some
    of them says how many ("(2 OOM)": its mean is over the others)."""
    by, items, ooms = defaultdict(list), defaultdict(dict), defaultdict(int)
    for r in rows:
        if r.get("suite") != "ppl" and r.get("score") is not None:
            by[(r["suite"], r["task"], label(r), r["length"])].append(float(r["score"]))
            items[(r["suite"], r["task"], label(r), r["length"])][(r.get("index"), r.get("depth"))] = float(r["score"])
    for r in oom:
        if r.get("suite") != "ppl":
            ooms[(r["suite"], r["task"], label(r), r["length"])] += 1
            by.setdefault((r["suite"], r["task"], label(r), r["length"]), [])  # its column and task are shown
    out = []
    for suite in sorted({k[0] for k in by}):
        keys = [k for k in by if k[0] == suite]
        tasks = _ordered_tasks(suite, {k[1] for k in keys})
        cols = sorted({(k[3], k[2]) for k in keys})  # (length, label)

        def cell(t, lab, length):
            k, n_oom = (suite, t, lab, length), ooms.get((suite, t, lab, length), 0)
            if not by.get(k):
                return "OOM" if n_oom else "-"
            return _fmt(mean_ci(by[k])) + (f" ({n_oom} OOM)" if n_oom else "")

        def average(lab, length):  # Pulsar Table 1: the average over tasks of per-task means
            means = [mean_ci(by[(suite, t, lab, length)])[0] for t in tasks if by.get((suite, t, lab, length))]
            if not means:
                return "OOM" if any(ooms.get((suite, t, lab, length)) for t in tasks) else "-"
            missing = len(tasks) - len(means)
            return f"**{sum(means) / len(means):.1f}**" + (f" ({missing} task(s) missing)" if missing else "")

        out.append(f"### {suite}\n")
        note = prompt_note([r for r in rows if r.get("suite") == suite])
        if note:
            out.append(note + "\n")
        if len({lab for _, lab in cols}) > WIDE_LABELS:
            out.append("| method | length | " + " | ".join(_task_label(t) for t in tasks) + " | **average** |")
            out.append("|---|---:|" + "---:|" * (len(tasks) + 1))
            for length, lab in sorted(cols, key=lambda c: (c[1], c[0])):
                out.append(f"| {lab} | {_len(length)} | " + " | ".join(cell(t, lab, length) for t in tasks)
                           + f" | {average(lab, length)} |")
            out.append("")
            continue
        out.append("| task | " + " | ".join(f"{lab} @ {_len(length)}" for length, lab in cols) + " |")
        out.append("|---|" + "---:|" * len(cols))
        for t in tasks:
            out.append(f"| {_task_label(t)} | " + " | ".join(cell(t, lab, length) for length, lab in cols) + " |")
        out.append("| **average** | " + " | ".join(average(lab, length) for length, lab in cols) + " |")
        if any(lab == "dense" for _, lab in cols):
            out.append("| **average − dense** (paired) | " + " | ".join(
                _fmt_delta(paired_average_delta([items[(suite, t, lab, length)] for t in tasks],
                                                [items[(suite, t, "dense", length)] for t in tasks]))
                if lab != "dense" else "" for length, lab in cols) + " |")
        out.append("")
    return "\n".join(out)


def oom_table(oom: Sequence[dict]) -> str:
    """The items that did not fit memory (records with ``out_of_memory``, written by the runner instead of a
    result): per suite, method and length, how many and the first reason."""
    by = defaultdict(list)
    for r in oom:
        by[(r.get("suite"), label(r), r["length"])].append(r)
    out = ["### Did not fit memory\n",
           "Items refused before their Phase 1 (their KV and Phase-1 activations certainly exceed the device) or "
           "out of memory while they ran, on this run's machine: no score, shown as OOM above.\n",
           "| suite | method | length | items | reason (the first) |", "|---|---|---:|---:|---|"]
    for (suite, lab, length), rs in sorted(by.items(), key=lambda kv: (str(kv[0][0]), kv[0][1], kv[0][2])):
        why = str(rs[0].get("error", "")).replace("|", "/")[:200]
        out.append(f"| {suite} | {lab} | {_len(length)} | {len(rs)} | {why} |")
    out.append("")
    return "\n".join(out)


def compression_table(rows: list[dict]) -> str:
    """How much of the context a decode policy held compressed when each answer was produced (the records'
    ``decode_stats``, LuKA's ``compressed_fraction``): mean % per task and variant, with the range over the
    items. A cell that compressed nothing measures nothing, so this table goes with every LuKA result."""
    by = defaultdict(list)
    for r in rows:
        stats = r.get("decode_stats") or {}
        if r.get("suite") != "ppl" and stats.get("compressed_fraction") is not None:
            by[(r["suite"], r["task"], label(r), r["length"])].append(100.0 * float(stats["compressed_fraction"]))
    out = []
    for suite in sorted({k[0] for k in by}):
        keys = [k for k in by if k[0] == suite]
        tasks = _ordered_tasks(suite, {k[1] for k in keys})
        cols = sorted({(k[3], k[2]) for k in keys})
        out += [f"### {suite}: context held compressed when the answer was produced\n",
                "Mean % of the context held as page summaries (clustered layers) or not attended (lined layers) at "
                "the last generated token, averaged over the layers [min, max over the items] (n).\n",
                "| task | " + " | ".join(f"{lab} @ {_len(length)}" for length, lab in cols) + " |",
                "|---|" + "---:|" * len(cols)]
        for t in tasks:
            cells = []
            for length, lab in cols:
                v = by.get((suite, t, lab, length))
                cells.append(f"{sum(v) / len(v):.1f} [{min(v):.1f}, {max(v):.1f}] ({len(v)})" if v else "-")
            out.append(f"| {_task_label(t)} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def prompt_note(rows: list[dict]) -> str:
    """Prompt tokens (context + query, chat template included) per length column, and how many samples were
    shortened so that prompt + output budget fit the model's positions (``fitted_length``, see
    :func:`magnetar.eval.runner.fitted_sample`). Empty for records without ``prompt_tokens``."""
    by = defaultdict(list)
    for r in rows:
        if r.get("prompt_tokens") is not None:
            by[r["length"]].append(r)
    parts = []
    for length in sorted(by):
        n = [int(r["prompt_tokens"]) for r in by[length]]
        fitted = {(r["task"], r.get("index"), r.get("depth")) for r in by[length] if r.get("fitted_length")}
        samples = {(r["task"], r.get("index"), r.get("depth")) for r in by[length]}
        parts.append(f"{_len(length)}: {min(n)}–{max(n)}" + (
            f" ({len(fitted)} of {len(samples)} samples shortened so that prompt + output budget fit the model's "
            "positions)" if fitted else ""))
    return ("Prompt tokens (context + query) per length — " + "; ".join(parts) + ".") if parts else ""


def paired_average_delta(method: list[dict], reference: list[dict]):
    """The change of the average over tasks (x 100) against a reference answered on the same items, with the
    half-width of its 95 % interval: per task the mean of the item-by-item differences, averaged over tasks;
    the variance sums the tasks' variances of their mean difference. ``method`` and ``reference`` hold one
    {item key: score} per task. Returns (delta, half-width, items paired, tasks) or None when a task has no
    common item."""
    means, var, n_items = [], 0.0, 0
    for a, b in zip(method, reference):
        common = sorted(set(a) & set(b), key=repr)
        if not common:
            return None
        d = [a[k] - b[k] for k in common]
        m = sum(d) / len(d)
        means.append(m)
        var += (sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d)) if len(d) > 1 else 0.0
        n_items += len(d)
    if not means:
        return None
    T = len(means)
    return 100 * sum(means) / T, 100 * 1.96 * math.sqrt(var) / T, n_items, T


def _fmt_delta(d) -> str:
    return "-" if d is None else f"{d[0]:+.1f} ± {d[1]:.1f} ({d[2]} items)"


def ppl_table(rows: list[dict]) -> str:
    """Perplexity per method and context length, with the windows' 95 % interval, and the change vs dense on
    the same windows (paired, with its own interval)."""
    from magnetar.eval.ppl import paired_change, perplexity_ci

    by = defaultdict(dict)  # (label, length) -> window index -> (nll_sum, tokens)
    for r in rows:
        if r.get("suite") == "ppl":
            by[(label(r), r["length"])][r["index"]] = (float(r["nll_sum"]), int(r["tokens"]))
    if not by:
        return ""
    lengths = sorted({k[1] for k in by})
    labels = sorted({k[0] for k in by}, key=lambda m: (m != "dense", m))
    out = ["### ppl\n", "Perplexity of the scored continuation tokens, exp(Σ NLL / Σ tokens) [95 % interval over "
           "windows] (n windows, scored tokens); then the change vs dense on the same windows, exp(mean per-window "
           "NLL difference) − 1 [95 % interval of the paired differences].\n",
           "| method | " + " | ".join(f"context {_len(length)}" for length in lengths) + " |",
           "|---|" + "---:|" * len(lengths)]
    for lab in labels:
        cells = []
        for length in lengths:
            win = by.get((lab, length))
            if not win:
                cells.append("-")
                continue
            ppl, lo, hi, n = perplexity_ci([v[0] for v in win.values()], [v[1] for v in win.values()])
            cell = f"{ppl:.3f} [{lo:.2f}, {hi:.2f}] (n={n}, {sum(v[1] for v in win.values())} tok)"
            ref = by.get(("dense", length))
            if ref and lab != "dense":
                ch = paired_change({k: a / b for k, (a, b) in win.items()}, {k: a / b for k, (a, b) in ref.items()})
                if ch is not None:
                    cell += f"; {ch[0]:+.2f} % [{ch[1]:+.2f}, {ch[2]:+.2f}] vs dense" + (
                        f" (n={ch[3]} paired)" if ch[3] != n else "")
            cells.append(cell)
        out.append(f"| {lab} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def _window_nll(rows: list[dict]) -> dict:
    """{window index: mean NLL per scored token} of perplexity records."""
    return {r["index"]: r["nll_sum"] / r["tokens"] for r in rows}


def scorer_ablation_table(rows: list[dict]) -> str:
    """Pulsar Table 3's shape when Pulsar ran with several scorers or summary budgets: one row per scorer, one
    column per budget. Perplexity rows give the paired change vs dense at the same length (lower is better),
    task rows the mean score over every task with its n (higher is better). Empty when there is no ablation."""
    from magnetar.eval.ppl import paired_change

    pul = [r for r in rows if r.get("method") == "pulsar" and isinstance(r.get("config"), dict)]
    cells = defaultdict(list)
    for r in pul:
        cfg = r["config"].get("pulsar", {})
        cells[(r.get("suite"), r["length"], cfg.get("scorer"), cfg.get("summary_budget"))].append(r)
    scorers = {k[2] for k in cells}
    budgets = {k[3] for k in cells}
    if len(scorers) * len(budgets) < 2:
        return ""
    dense = defaultdict(dict)
    for r in rows:
        if r.get("method") == "dense" and r.get("suite") == "ppl":
            dense[r["length"]][r["index"]] = r["nll_sum"] / r["tokens"]
    order = list(SCORERS)
    scorers = sorted(scorers, key=lambda x: (order.index(x) if x in order else 99, str(x)))
    budgets = sorted(budgets)
    out = []
    for suite, length in sorted({(k[0], k[1]) for k in cells}):
        ppl = suite == "ppl"
        what = ("perplexity change vs dense on the same windows, % [95 % interval] (lower is better)" if ppl
                else "mean score over the tasks ± 95 % interval (n) (higher is better)")
        out += [f"### Pulsar scorer × summary budget, {suite} @ {_len(length)}\n", f"{what}.\n",
                "| scorer | " + " | ".join(f"budget {b:g}" for b in budgets) + " |", "|---|" + "---:|" * len(budgets)]
        for sc in scorers:
            line = []
            for b in budgets:
                g = cells.get((suite, length, sc, b))
                if not g:
                    line.append("-")
                elif ppl:
                    ch = paired_change(_window_nll(g), dense[length])
                    line.append("no dense rows" if ch is None
                                else f"{ch[0]:+.2f} [{ch[1]:+.2f}, {ch[2]:+.2f}] (n={ch[3]})")
                else:
                    sc_ = [float(r["score"]) for r in g if r.get("score") is not None]
                    line.append(_fmt(mean_ci(sc_)) if sc_ else "-")
            out.append(f"| {sc} | " + " | ".join(line) + " |")
        out.append("")
        if ppl and "even" in scorers and len(scorers) > 1:  # the scorers against even spacing, window by window
            out += ["Change vs `even` at the same budget, paired on the windows, % [95 % interval] "
                    "(negative: the scorer's summaries serve later blocks better than evenly spaced chunks).\n",
                    "| scorer | " + " | ".join(f"budget {b:g}" for b in budgets) + " |",
                    "|---|" + "---:|" * len(budgets)]
            for sc in (x for x in scorers if x != "even"):
                line = []
                for b in budgets:
                    g, e = cells.get((suite, length, sc, b)), cells.get((suite, length, "even", b))
                    ch = paired_change(_window_nll(g), _window_nll(e)) if g and e else None
                    line.append("-" if ch is None else f"{ch[0]:+.2f} [{ch[1]:+.2f}, {ch[2]:+.2f}] (n={ch[3]})")
                out.append(f"| {sc} | " + " | ".join(line) + " |")
            out.append("")
    return "\n".join(out) + "\n"


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def length_curves(scores: dict, methods, lengths, tasks) -> tuple[list, dict]:
    """Accuracy vs length: ``scores[(method, length, task)]`` = 0/1 scores -> (the tasks averaged, {method: [(mean
    over those tasks x 100, half-width of its 95 % interval) per length]}). Every point averages the same
    tasks, those answered in every (method, length) column, so a run cut short or a length run on a subset
    of the tasks does not move a line by changing its tasks; with no task in all columns, each point averages
    its own (and the tasks returned are ``[]``). The interval of an average of T task means: sqrt(sum h²) / T."""
    common = [t for t in tasks if all(scores.get((m, length, t)) for m in methods for length in lengths)]
    curves = {}
    for m in methods:
        curves[m] = []
        for length in lengths:
            cells = [mean_ci(scores[(m, length, t)]) for t in (common or tasks) if scores.get((m, length, t))]
            n = len(cells)
            curves[m].append((sum(c[0] for c in cells) / n, math.sqrt(sum(c[1] ** 2 for c in cells)) / n) if n
                             else (float("nan"), 0.0))
    return common, curves


def plots(rows: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    by = defaultdict(list)
    for r in rows:
        if r.get("suite") != "ppl" and r.get("score") is not None:
            by[(r["suite"], label(r), r["length"], r["task"])].append(float(r["score"]))
    for suite in sorted({k[0] for k in by}):
        methods = sorted({k[1] for k in by if k[0] == suite})
        lengths = sorted({k[2] for k in by if k[0] == suite})
        tasks = _ordered_tasks(suite, {k[3] for k in by if k[0] == suite})
        common, curves = length_curves({k[1:]: v for k, v in by.items() if k[0] == suite}, methods, lengths, tasks)
        fig, ax = plt.subplots(figsize=(6, 4))
        dodge = 0.02 * max(1.0, (lengths[-1] - lengths[0]) / 1024)  # methods side by side: equal points stay visible
        for i, m in enumerate(methods):
            ys, hs = zip(*curves[m])
            shift = (i - (len(methods) - 1) / 2) * dodge
            ax.errorbar([x / 1024 + shift for x in lengths], ys, yerr=hs, marker="o", capsize=3, label=m)
        what = f"{len(common)} task{'s' if len(common) > 1 else ''}" if common else "tasks differ by column"
        ax.set(xlabel="context length (K tokens)", ylabel="average score (95 % interval)",
               title=f"{suite}: accuracy vs length ({what})", ylim=(0, 100))
        ax.legend()
        made.append(_save(fig, out_dir / f"{suite}_accuracy_vs_length.png"))

        fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(tasks) * len(methods) / 2), 4))
        width = 0.8 / max(1, len(methods))
        longest = lengths[-1]
        for i, m in enumerate(methods):
            ys = [100 * sum(by[(suite, m, longest, t)]) / len(by[(suite, m, longest, t)])
                  if by.get((suite, m, longest, t)) else 0 for t in tasks]
            ax.bar([j + i * width for j in range(len(tasks))], ys, width=width, label=m)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tasks))], tasks, rotation=45, ha="right")
        ax.set(ylabel="score", title=f"{suite} per task at {longest // 1024}K", ylim=(0, 100))
        ax.legend()
        made.append(_save(fig, out_dir / f"{suite}_per_task.png"))

    ppl = [r for r in rows if r.get("suite") == "ppl"]
    if ppl:
        from magnetar.eval.ppl import perplexity_ci

        fig, ax = plt.subplots(figsize=(6, 4))
        for lab in sorted({label(r) for r in ppl}):
            pts = []
            for length in sorted({r["length"] for r in ppl if label(r) == lab}):
                sel = [r for r in ppl if label(r) == lab and r["length"] == length]
                pts.append((length / 1024, perplexity_ci([r["nll_sum"] for r in sel], [r["tokens"] for r in sel])[0]))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=lab)
        ax.set(xlabel="context length (K tokens)", ylabel="perplexity", title="perplexity vs context length")
        ax.legend()
        made.append(_save(fig, out_dir / "ppl_vs_length.png"))

    niah = [r for r in rows if r["suite"] == "niah" and "depth" in r]
    for m in sorted({label(r) for r in niah}):
        cells = defaultdict(list)
        for r in niah:
            if label(r) == m:
                cells[(r["depth"], r["length"])].append(float(r["score"]))
        depths = sorted({d for d, _ in cells})
        lengths = sorted({length for _, length in cells})
        grid = [[100 * sum(cells[(d, length)]) / len(cells[(d, length)]) if cells.get((d, length)) else float("nan")
                 for length in lengths] for d in depths]
        fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2, 0.5 * len(depths) + 2))
        im = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [f"{x // 1024}K" for x in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set(xlabel="context length", ylabel="needle depth", title=f"NIAH: {m}")
        fig.colorbar(im, ax=ax, label="score")
        made.append(_save(fig, out_dir / f"niah_heatmap_{m}.png"))
    return made


def write_report(out_dir: Path, also: Sequence[Path] = (), tasks: Optional[Sequence[str]] = None,
                 samples: Optional[int] = None) -> str:
    """Write ``report.md`` and the PNGs into ``out_dir``; returns the markdown. ``also``: other runs' directories
    whose records join this report (e.g. a 4K run beside an 8K one, for accuracy vs length); ``tasks``: only
    these tasks' records (of every directory), so that averages over lengths cover the same tasks; ``samples``:
    only each task's first ``samples`` items (index below it), so that every method is averaged on the same ones."""
    for d in (out_dir, *also):
        if not result_files(d):
            raise SystemExit(f"no results*.jsonl in {d}: run magnetar-eval with --out {d} first")
    rows = [r for d in (out_dir, *also) for r in load(d) if (tasks is None or r.get("task") in tasks)
            and (samples is None or r.get("index", 0) < samples)]
    if not rows:
        raise SystemExit(f"no records of the tasks {list(tasks or [])} in {[str(d) for d in (out_dir, *also)]}")
    rows = tag_cp_sizes(rows)
    oom = [r for r in rows if r.get("out_of_memory")]  # items that did not fit memory: no score (oom_table)
    rows = [r for r in rows if not r.get("out_of_memory")]
    md = table(rows, oom) + ("\n" + ppl_table(rows) if any(r.get("suite") == "ppl" for r in rows) else "")
    md += ("\n" + oom_table(oom)) if oom else ""
    compressed = compression_table(rows)
    md += ("\n" + compressed) if compressed else ""
    ablation = scorer_ablation_table(rows)
    md += ("\n" + ablation) if ablation else ""
    pngs = plots(rows, Path(out_dir))
    if any(r.get("suite") == "fidelity" for r in rows):
        from magnetar.eval import fidelity

        md += "\n" + fidelity.report(rows)
        fig = fidelity.figure(rows)
        if fig is not None:
            pngs.append(_save(fig, Path(out_dir) / "fidelity_vs_phase1.png"))
    md += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in pngs) + "\n"
    (Path(out_dir) / "report.md").write_text(md)
    return md
