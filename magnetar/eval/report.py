"""Reports from ``results.jsonl``: a markdown table (task x method x length, with averages as in the Pulsar
paper's Tables 1-2, every cell with its sample count and a 95 % interval) and PNG plots (accuracy vs length
per method, per-task bars, and for the NIAH suite a depth x length heat-map per method).

The interval is the normal approximation of the mean score over the cell's samples, clipped to [0, 100];
with scores in {0, 1} and few samples it is wide, which is the point of printing it.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path


def load(path: Path) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return rows


def mean_ci(scores: list[float]) -> tuple[float, float, int]:
    """(mean x 100, half-width of the 95 % interval x 100, n)."""
    n = len(scores)
    m = sum(scores) / n
    var = sum((s - m) ** 2 for s in scores) / (n - 1) if n > 1 else 0.0
    return 100 * m, 100 * 1.96 * math.sqrt(var / n), n


def _fmt(cell) -> str:
    m, h, n = cell
    return f"{m:.1f} ± {h:.1f} (n={n})"


def table(rows: list[dict]) -> str:
    by = defaultdict(list)
    for r in rows:
        by[(r["suite"], r["task"], r["method"], r["length"])].append(float(r["score"]))
    suites = sorted({k[0] for k in by})
    out = []
    for suite in suites:
        keys = [k for k in by if k[0] == suite]
        tasks = sorted({k[1] for k in keys})
        cols = sorted({(k[3], k[2]) for k in keys})  # (length, method)
        out.append(f"### {suite}\n")
        out.append("| task | " + " | ".join(f"{m} @ {length // 1024}K" if length % 1024 == 0 else f"{m} @ {length}"
                                           for length, m in cols) + " |")
        out.append("|---|" + "---:|" * len(cols))
        for t in tasks:
            cells = [_fmt(mean_ci(by[(suite, t, m, length)])) if by.get((suite, t, m, length)) else "-"
                     for length, m in cols]
            label = t + (" (substitute)" if t in ("qa_1", "qa_2") else "")
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        avgs = []
        for length, m in cols:  # Pulsar Table 1: the average over tasks of per-task means
            means = [mean_ci(by[(suite, t, m, length)])[0] for t in tasks if by.get((suite, t, m, length))]
            missing = len(tasks) - len(means)
            avgs.append(f"**{sum(means) / len(means):.1f}**" + (f" ({missing} task(s) missing)" if missing else ""))
        out.append("| **average** | " + " | ".join(avgs) + " |\n")
    return "\n".join(out)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plots(rows: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    by = defaultdict(list)
    for r in rows:
        by[(r["suite"], r["method"], r["length"], r["task"])].append(float(r["score"]))
    for suite in sorted({k[0] for k in by}):
        methods = sorted({k[1] for k in by if k[0] == suite})
        lengths = sorted({k[2] for k in by if k[0] == suite})
        tasks = sorted({k[3] for k in by if k[0] == suite})
        fig, ax = plt.subplots(figsize=(6, 4))
        for m in methods:
            ys = []
            for length in lengths:
                means = [100 * sum(v) / len(v) for (s, mm, ll, t), v in by.items() if s == suite and mm == m and ll == length]
                ys.append(sum(means) / len(means) if means else float("nan"))
            ax.plot([x / 1024 for x in lengths], ys, marker="o", label=m)
        ax.set(xlabel="context length (K tokens)", ylabel="average score", title=f"{suite}: accuracy vs length",
               ylim=(0, 100))
        ax.legend()
        made.append(_save(fig, out_dir / f"{suite}_accuracy_vs_length.png"))

        fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(tasks) * len(methods) / 2), 4))
        width = 0.8 / max(1, len(methods))
        longest = lengths[-1]
        for i, m in enumerate(methods):
            ys = [100 * sum(by[(suite, m, longest, t)]) / len(by[(suite, m, longest, t)]) if by.get((suite, m, longest, t))
                  else 0 for t in tasks]
            ax.bar([j + i * width for j in range(len(tasks))], ys, width=width, label=m)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tasks))], tasks, rotation=45, ha="right")
        ax.set(ylabel="score", title=f"{suite} per task at {longest // 1024}K", ylim=(0, 100))
        ax.legend()
        made.append(_save(fig, out_dir / f"{suite}_per_task.png"))

    niah = [r for r in rows if r["suite"] == "niah" and "depth" in r]
    for m in sorted({r["method"] for r in niah}):
        cells = defaultdict(list)
        for r in niah:
            if r["method"] == m:
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


def write_report(out_dir: Path) -> str:
    """Write ``report.md`` and the PNGs into ``out_dir``; returns the markdown."""
    path = Path(out_dir) / "results.jsonl"
    if not path.exists():
        raise SystemExit(f"no results in {path}: run magnetar-eval with --out {out_dir} first")
    rows = load(path)
    md = table(rows)
    pngs = plots(rows, Path(out_dir))
    md += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in pngs) + "\n"
    (Path(out_dir) / "report.md").write_text(md)
    return md
