"""Fidelity against dense attention (``magnetar-eval --suite fidelity``): how far a method's answer distribution is
from dense's on the same context and question -- a measure that needs far fewer items than accuracy to tell two
methods apart.

For each item, dense answers once (greedy); its answer is then teacher-forced through dense and through the method
under test (:meth:`magnetar.Engine.score_answer`: one Phase 1 -- dense's comes from the context cache -- and one
Phase-2 forward each), and the two distributions over every answer token are compared:

* ``kl`` -- mean over the answer's tokens of KL(dense ‖ method) in nats (0: the same distributions);
* ``top1`` -- the fraction of answer tokens where the method's most likely token is dense's;
* ``logp_diff`` -- the method's log-probability of dense's whole answer minus dense's own (<= 0 typically);
* ``identical`` -- every answer token is the method's top-1 too: greedy decoding with the method would give
  dense's answer exactly (teacher forcing on that answer is then its own greedy path).

Items are the RULER-style tasks (``--tasks``, default all 13), or the user's own text (``--context-file FILE``,
with ``--questions FILE``, one question per line, or questions made from the text: "What does the document say
right after: '...'?" at evenly spaced depths). ``--accuracy`` also answers greedily with each method and scores
the answer by the task's rule (and dense's), so that the two measures can be compared on the same items.
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from magnetar.eval.suite import EvalSample, GenerationSuite, get_suite

__all__ = ["FidelitySuite", "Reference", "compare", "file_sample", "question_from_text", "FILE_TASK", "t_interval",
           "items_to_separate", "question_lines"]

FILE_TASK = "file"  # the task name of items made from --context-file
FILE_MAX_NEW_TOKENS = 32


@dataclass
class Reference:
    """Dense's answer to one item: its token ids and text, its distributions over them, its score (None when the
    item has no reference answers) and its Phase-1 critical path."""

    answer_ids: torch.Tensor  # (T,)
    text: str
    logprobs: torch.Tensor  # (T, V) float32
    score: Optional[float]
    phase1_s: float


def compare(ref: torch.Tensor, got: torch.Tensor, answer_ids: torch.Tensor) -> dict:
    """The fidelity of distributions ``got (T, V)`` (log-probabilities, the method's) to ``ref (T, V)`` (dense's)
    over the answer ``answer_ids (T,)``: ``kl`` (mean KL(ref ‖ got) per token, nats), ``kl_max``, ``top1``
    (fraction of tokens whose argmax agrees), ``logp_diff`` (Σ log got - Σ log ref of the answer's tokens),
    ``identical`` (the method's argmax is the answer token at every position) and ``answer_tokens``.

    Computed in float64; a token dense gives probability 0 adds nothing. A non-finite ``got`` where dense has
    mass gives an infinite (or NaN) KL, never a finite one."""
    r, g = ref.double(), got.double()
    p = r.exp()
    # (T,); float rounding can leave an exact method a -1e-9: clamped to 0 (clamp keeps a NaN a NaN)
    kl = torch.where(p > 0, p * (r - g), torch.zeros_like(p)).sum(-1).clamp(min=0.0)
    a = answer_ids.reshape(-1, 1).to(r.device)
    top_g = g.argmax(-1)
    return {"kl": float(kl.mean()), "kl_max": float(kl.max()), "top1": float((top_g == r.argmax(-1)).double().mean()),
            "logp_diff": float(g.gather(1, a).sum() - r.gather(1, a).sum()),
            "identical": bool((top_g == a.reshape(-1)).all()), "answer_tokens": int(answer_ids.numel())}


# -- the user's own text ---------------------------------------------------------------------------------------
_SENTENCE = re.compile(r"[^.!?\n]+[.!?]")


def question_from_text(text: str, index: int, n: int = 10) -> str:
    """A question answerable from ``text`` alone, about the sentence at depth ``(index % n + 0.5) / n``: what the
    document says right after its opening words (deterministic)."""
    sentences = [s.strip() for s in _SENTENCE.findall(text) if len(s.split()) >= 8]
    if not sentences:
        raise ValueError("the context file has no sentence of 8 words or more to ask about; pass --questions FILE "
                         "(one question per line)")
    s = sentences[min(len(sentences) - 1, int((index % n + 0.5) / n * len(sentences)))]
    words = s.split()
    return f"What does the document say right after: \"{' '.join(words[:8])}\"? Answer in one sentence."


def file_sample(text: str, tokenizer, length: int, *, index: int, questions: Sequence[str] = ()) -> EvalSample:
    """Item ``index`` of the user's own text: the first ``length`` tokens of ``text`` (all of it when shorter) as
    the context, the question ``questions[index % len]`` (or one made from the text) as the query."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    context = text if len(ids) <= length else tokenizer.decode(ids[:length])
    question = questions[index % len(questions)] if questions else question_from_text(context, index)
    return EvalSample(task=FILE_TASK, context=context, query=question, answers=(),
                      max_new_tokens=FILE_MAX_NEW_TOKENS, metadata={"question": question}, suite="fidelity")


def question_lines(text: str) -> list[str]:
    """The questions of a ``--questions`` file: its non-empty lines, stripped, in order."""
    questions = [line.strip() for line in text.splitlines() if line.strip()]
    if not questions:
        raise ValueError("the --questions file has no question: write one question per line")
    return questions


class FidelitySuite(GenerationSuite):
    """The fidelity suite: the RULER-style tasks' samples (and their scoring rule, for ``--accuracy``), compared
    against dense by :func:`compare`; the runner drives it (``fidelity`` True)."""

    name = "fidelity"
    tasks = get_suite("ruler").tasks
    fidelity = True

    def make_sample(self, task: str, tokenizer, length: int, *, index: int, seed: int) -> tuple[EvalSample, dict]:
        return get_suite("ruler").make_sample(task, tokenizer, length, index=index, seed=seed)

    def score(self, sample: EvalSample, prediction: str) -> Optional[float]:
        """The task's own rule (RULER's), None for an item without reference answers (the user's text)."""
        if not sample.answers:
            return None
        return get_suite("ruler").score(sample, prediction)


def t_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, int]:
    """(mean, half-width of the two-sided Student-t interval, n) of ``values`` (half-width 0 for one value)."""
    from scipy import stats

    n, m = len(values), statistics.fmean(values)
    if n < 2:
        return m, 0.0, n
    return m, float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * statistics.stdev(values) / math.sqrt(n), n


def items_to_separate(diffs: Sequence[float], confidence: float = 0.95) -> Optional[int]:
    """About how many paired items a ``confidence`` interval of the mean of ``diffs`` needs to exclude 0, from their
    mean and spread (normal approximation: (z sd / |mean|)^2); None when the mean is 0."""
    from scipy import stats

    if len(diffs) < 2 or statistics.fmean(diffs) == 0:
        return None
    z = float(stats.norm.ppf(0.5 + confidence / 2))
    return max(2, math.ceil((z * statistics.stdev(diffs) / abs(statistics.fmean(diffs))) ** 2))


# -- the report ------------------------------------------------------------------------------------------------
def _by_label(rows: list[dict]) -> dict:
    """{(length, label): {(task, index): record}} of fidelity records."""
    out: dict = {}
    for r in rows:
        if r.get("suite") == "fidelity" and r.get("kl") is not None:
            out.setdefault((r["length"], r.get("label") or r["method"]), {})[(r["task"], r["index"])] = r
    return out


def _ci(values: Sequence[float], scale: float = 1.0, digits: int = 4) -> str:
    m, h, n = t_interval(values)
    return f"{scale * m:.{digits}f} ± {scale * h:.{digits}f}"


def _cost(rs: list[dict]) -> str:
    """The mean of the records' cost-model Phase-1 critical path relative to dense ("-" for records without)."""
    xs = [r["phase1_flops_vs_dense"] for r in rs if r.get("phase1_flops_vs_dense") is not None]
    return f"{sum(xs) / len(xs):.3f}" if xs else "-"


def report(rows: list[dict]) -> str:
    """The fidelity tables of a run's records: per method (mean KL with its 95 % t interval, top-1 agreement,
    identical answers, the answer's log-probability change, the Phase-1 critical path, and with ``--accuracy`` the
    accuracy change vs dense on the same items), then every pair of methods on their shared items: the paired
    difference of KL and of accuracy, and about how many items each needs to separate the two."""
    cells = _by_label(rows)
    if not cells:
        return ""
    out = ["### Fidelity against dense\n",
           "Dense's greedy answer teacher-forced through each method: mean per-token KL(dense ‖ method) in nats "
           "[95 % t interval over items], top-1 agreement, items whose greedy answer would be dense's (identical), "
           "Σ log p(answer) method − dense, the Phase-1 critical path (s, measured) and by the cost model relative "
           "to dense's (FLOPs of the slowest rank, the items' own token ids). With --accuracy: the "
           "method's own accuracy and its paired change vs dense's on the same items (points).\n",
           "| length | method | n | KL (nats) | top-1 % | identical % | Δ log p | Phase-1 s | cost × dense | accuracy "
           "| Δ acc vs dense |",
           "|---|---|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for (length, lab), items in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        rs = list(items.values())
        acc, dacc = "-", "-"
        scored = [r for r in rs if r.get("score") is not None and r.get("dense_score") is not None]
        if scored:
            acc = _ci([r["score"] for r in scored], 100, 1)
            dacc = _ci([r["score"] - r["dense_score"] for r in scored], 100, 1)
        out.append(f"| {length} | {lab} | {len(rs)} | {_ci([r['kl'] for r in rs])} | "
                   f"{100 * sum(r['top1'] for r in rs) / len(rs):.1f} | "
                   f"{100 * sum(r['identical'] for r in rs) / len(rs):.0f} | "
                   f"{sum(r['logp_diff'] for r in rs) / len(rs):+.3f} | "
                   f"{sum(r['phase1_critical_path_s'] for r in rs) / len(rs):.2f} | {_cost(rs)} | {acc} | {dacc} |")
    out += ["", "Separating two methods on the same items: the paired difference (row − column method) of KL and of "
            "accuracy, [95 % t interval], and about how many items a 95 % interval needs to exclude 0 at the "
            "observed mean and spread.\n",
            "| length | methods | n | Δ KL | items to separate (KL) | Δ accuracy | items to separate (accuracy) |",
            "|---|---|---:|---|---:|---|---:|"]
    labels = sorted(cells)
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            if a[0] != b[0]:
                continue
            shared = sorted(set(cells[a]) & set(cells[b]))
            if len(shared) < 2:
                continue
            dkl = [cells[a][k]["kl"] - cells[b][k]["kl"] for k in shared]
            accs = [(cells[a][k].get("score"), cells[b][k].get("score")) for k in shared]
            dacc = [x - y for x, y in accs if x is not None and y is not None]
            need_kl, need_acc = items_to_separate(dkl), items_to_separate(dacc) if len(dacc) > 1 else None
            out.append(f"| {a[0]} | {a[1]} − {b[1]} | {len(shared)} | {_ci(dkl)} | {need_kl or '-'} | "
                       f"{_ci(dacc, 100, 1) if len(dacc) > 1 else '-'} | {need_acc or '-'} |")
    return "\n".join(out) + "\n"


def figure(rows: list[dict]):
    """The figure of ``fidelity_vs_phase1.png`` (None without fidelity records): each method's mean KL (with its
    95 % interval) against its Phase-1 critical path, measured (top) and by the cost model relative to dense
    (bottom), one column per length -- the run's speed/fidelity frontier."""
    import matplotlib.pyplot as plt

    cells = _by_label(rows)
    if not cells:
        return None
    lengths = sorted({length for length, _ in cells})
    xs = [("phase1_critical_path_s", "Phase-1 critical path (s, measured)"),
          ("phase1_flops_vs_dense", "Phase-1 critical path / dense's (cost model)")]
    # each configuration is a number beside its point and a line of the key at the right: a frontier of many
    # option sets would bury the points under their labels
    number = {lab: i + 1 for i, lab in enumerate(sorted({lab for _, lab in cells}))}
    fig = plt.figure(figsize=(5.5 * len(lengths) + 4.5, 8))
    grid = fig.add_gridspec(2, len(lengths) + 1, width_ratios=[5.5] * len(lengths) + [4.5])
    axes = [[fig.add_subplot(grid[row, col]) for col in range(len(lengths))] for row in range(2)]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for col, length in enumerate(lengths):
        for row, (field, xlabel) in enumerate(xs):
            ax = axes[row][col]
            for (ln, lab), items in sorted(cells.items()):
                rs = [r for r in items.values() if r.get(field) is not None]
                if ln != length or not rs:
                    continue
                m, h, _ = t_interval([r["kl"] for r in rs])
                x = sum(r[field] for r in rs) / len(rs)
                # KL >= 0: the interval's lower end is cut at 0 (a linear axis: an interval reaching 0 would
                # stretch a log axis over decades no method is near)
                ax.errorbar([x], [m], yerr=[[min(h, m)], [h]], fmt="o", capsize=3,
                            color=colors[(number[lab] - 1) % len(colors)])
                ax.annotate(str(number[lab]), (x, m), fontsize=7, xytext=(3, 3), textcoords="offset points")
            ax.set_ylim(bottom=0)
            ax.set(xlabel=xlabel, ylabel="mean KL(dense ‖ method), nats, 95 % interval",
                   title=f"fidelity vs Phase-1 cost, {length // 1024}K" if length else "fidelity vs Phase-1 cost")
            ax.grid(alpha=0.3)
    counts = {lab: max(len(items) for (_, lb), items in cells.items() if lb == lab) for lab in number}
    key = "\n".join(f"{i:>2}  {lab} (n={counts[lab]})" for lab, i in number.items())
    key_ax = fig.add_subplot(grid[:, len(lengths)])
    key_ax.axis("off")
    key_ax.text(0, 0.5, key, fontsize=7, va="center", family="monospace", transform=key_ax.transAxes)
    return fig
