"""What the evaluation runner needs of a suite: one sample type (:class:`EvalSample`), one protocol (:class:`Suite`)
and the lazy name -> suite registry (:data:`SUITES`, :func:`get_suite`; the ``ops/backends`` pattern).

    suite = get_suite("ruler")                                  # imports magnetar.eval.ruler on first use
    sample, extra = suite.make_sample("vt", tokenizer, 4096, index=3, seed=sample_seed(0, 3))
    suite.score(sample, prediction)                             # = sample.score(prediction), in [0, 1]

A suite knows its tasks, how to generate a sample (offline, seeded, sized in model tokens) and how to score an
answer; it knows nothing about engines, ranks, result files or reports. This module knows the suites only by
their "module:Class" strings, so loading one suite never imports another's corpus (and no suite module is
imported by this one: they import it).

Three kinds of suite share the registry: generation suites (ruler, niah, babilong, wikisalad) answer a sample with
the engine and score the text; the perplexity suite (``perplexity`` True: ppl) scores windows of text by their
likelihood with ``Engine.score`` (its ``window`` method) and has no samples to answer; the fidelity suite
(``fidelity`` True) compares each method's answer distributions with dense's on the same samples
(:mod:`magnetar.eval.fidelity`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Protocol

from magnetar.utils.registry import load_class

__all__ = ["SUITES", "EvalSample", "GenerationSuite", "Suite", "get_suite", "sample_seed"]

# name -> "module:Class" (the runner's --suite choices, in this order)
SUITES: dict[str, str] = {
    "ruler": "magnetar.eval.ruler:RulerSuite",
    "niah": "magnetar.eval.niah:NiahSuite",
    "babilong": "magnetar.eval.babilong:BabilongSuite",
    "wikisalad": "magnetar.eval.wikisalad:WikiSaladSuite",
    "ppl": "magnetar.eval.ppl:PerplexitySuite",
    "fidelity": "magnetar.eval.fidelity:FidelitySuite",
}


@dataclass(frozen=True, kw_only=True)
class EvalSample:
    """One evaluation prompt. ``context`` -> Phase 1; ``query`` (+ ``answer_prefix``) -> Phase 2.

    Attributes:
        task: the suite's task name.
        context: the long text (instruction and haystack, or the haystack alone; see the suite).
        query: the Phase-2 text (the question; for babilong and wikisalad also the instruction).
        answers: the accepted reference answers.
        answer_prefix: the answer's opening, put after the assistant header (RULER starts the answer for the
            model); "" for none.
        metric: RULER's rule, "all" (``string_match_all``) or "part" (``string_match_part``); the other suites
            score by their own rule and leave it at "all".
        max_new_tokens: the generation budget.
        metadata: the suite's details of the sample (needles, facts, question, instruction ...; see each suite).
        suite: the name (a key of :data:`SUITES`) of the suite that scores the sample and splits its prompt.
    """

    task: str
    context: str
    query: str
    answers: tuple[str, ...]
    answer_prefix: str = ""
    metric: str = "all"
    max_new_tokens: int = 128
    metadata: dict = field(default_factory=dict)
    suite: str = "ruler"

    def score(self, prediction: str) -> float:
        """The prediction's score in [0, 1] by the sample's suite (:meth:`Suite.score`)."""
        return get_suite(self.suite).score(self, prediction)

    def prompt_parts(self, *, instruction_in: str = "query") -> tuple[str, str]:
        """(Phase-1 text, Phase-2 text) by the sample's suite (:meth:`Suite.prompt_parts`)."""
        return get_suite(self.suite).prompt_parts(self, instruction_in=instruction_in)


class Suite(Protocol):
    """An evaluation suite, as the runner uses it.

    ``make_sample``, ``score`` and ``prompt_parts`` are those of a generation suite (``perplexity`` False); the
    perplexity suite has ``window`` instead (see :class:`magnetar.eval.ppl.PerplexitySuite`).
    """

    name: str  # the registry key
    tasks: tuple[str, ...]  # every task, in the order reports list them
    items_per_sample: int  # items per ``--samples`` unit (niah: one per needle depth)
    perplexity: bool  # True: items are text windows scored by likelihood, not answered samples
    fidelity: bool  # True: items compare each method's answer distributions with dense's (magnetar.eval.fidelity)
    own_lengths: bool  # True: length 0 (``--lengths 0``) means each task's own length (wikisalad)

    def make_sample(self, task: str, tokenizer, length: int, *, index: int,
                    seed: int) -> tuple[EvalSample, dict]:
        """Sample ``index`` of ``task`` whose prompt tokenizes to about ``length`` tokens, deterministic in ``seed``
        (:func:`sample_seed`), and the extra fields of its result record and key (niah: ``depth``; else {})."""
        ...

    def score(self, sample: EvalSample, prediction: str) -> float:
        """The prediction's score in [0, 1] (the report shows x 100)."""
        ...

    def prompt_parts(self, sample: EvalSample, *, instruction_in: str = "query") -> tuple[str, str]:
        """(Phase-1 text, Phase-2 text) with the instruction in the query (``"query"``) or, as in the Pulsar paper's
        Appendix B, in the context (``"context"``); ValueError for another ``instruction_in``."""
        ...


class GenerationSuite:
    """Defaults of a generation suite: one item per sample, and a prompt whose context already opens with the
    instruction and whose query is the question (RULER, NIAH), so both splits are ``(context, query)``."""

    name: str = ""
    tasks: tuple[str, ...] = ()
    items_per_sample: int = 1
    perplexity: bool = False
    fidelity: bool = False
    own_lengths: bool = False

    def prompt_parts(self, sample: EvalSample, *, instruction_in: str = "query") -> tuple[str, str]:
        if instruction_in not in ("query", "context"):
            raise ValueError(f"instruction_in must be 'query' or 'context', got {instruction_in!r}")
        return sample.context, sample.query


@cache
def get_suite(name: str) -> Suite:
    """The suite registered as ``name`` (imported on first use, one instance per name)."""
    target = SUITES.get(name)
    if target is None:
        raise ValueError(f"unknown suite {name!r}; valid options are {', '.join(SUITES)}")
    return load_class(target)()


def sample_seed(data_seed: int, index: int) -> int:
    """The generation seed of sample ``index`` in a run with ``--data-seed data_seed`` (every suite)."""
    return data_seed * 100003 + index
