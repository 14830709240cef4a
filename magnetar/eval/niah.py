"""The needle-in-a-haystack suite (``--suite niah``): one magic number in Paul Graham essays, asked at 5 depths.

Sample ``index`` puts the needle at depth ``DEPTHS[index % 5]`` (so ``--samples N`` runs ``5 N`` items, N per
depth) of a context of ``length`` tokens built by :func:`magnetar.data.niah.needle_prompt`; RULER's instruction
opens the context (Phase 1), the question is the query (Phase 2). Scored by RULER's ``string_match_all``: right
when the prediction contains the number. Records and item keys carry the ``depth``. Knows nothing about engines.
"""
from __future__ import annotations

from magnetar.data.niah import INSTRUCTION, needle_prompt
from magnetar.eval.ruler import string_match_all
from magnetar.eval.suite import EvalSample, GenerationSuite

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
MAX_NEW_TOKENS = 32


class NiahSuite(GenerationSuite):
    """One task, ``niah``; ``items_per_sample`` = one item per needle depth."""

    name = "niah"
    tasks = ("niah",)
    items_per_sample = len(DEPTHS)

    def make_sample(self, task: str, tokenizer, length: int, *, index: int, seed: int) -> tuple[EvalSample, dict]:
        depth = DEPTHS[index % len(DEPTHS)]
        s = needle_prompt(tokenizer, length, depth, seed=seed)
        return EvalSample(task="niah", context=f"{INSTRUCTION}\n\n{s.context}", query=f"\n\n{s.query}",
                          answers=(s.answer,), answer_prefix="", metric="all", max_new_tokens=MAX_NEW_TOKENS,
                          metadata={"depth": depth}, suite=self.name), {"depth": depth}

    def score(self, sample: EvalSample, prediction: str) -> float:
        return string_match_all(prediction, sample.answers)
