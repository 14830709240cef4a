"""Needle-in-a-haystack prompts in the style of RULER's ``niah_single_2``: a magic number in essays.

The haystack is the Paul Graham essays (:func:`magnetar.data.texts.paul_graham_essays`), cut at a sentence
(else word) boundary so that it tokenizes to at most, and close to, the requested number of tokens. The
needle is "One of the special magic numbers for {word} is: {number}." with a 7-digit number, inserted at a
sentence boundary at a relative depth; the question asks for the number; a prediction is right when it
contains the number (RULER's ``string_match_all``).

A tokenizer here is anything with ``encode(text) -> list[int]`` and ``decode(ids) -> str``; counts never
include special tokens (``add_special_tokens=False`` where ``encode`` takes it). Everything is
deterministic for a seed. This module does not know about chat templates or models: build the model input
from :meth:`NeedleSample.prompt` (or :meth:`NeedleSample.messages` for a chat template).
"""
from __future__ import annotations

import bisect
import random
import re
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from magnetar.data.texts import paul_graham_essays

NEEDLE = "One of the special magic numbers for {word} is: {number}."
QUESTION = "What is the special magic number for {word} mentioned in the provided text?"
ANSWER_PREFIX = "The special magic number for {word} mentioned in the provided text is"
INSTRUCTION = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the numbers afterwards.")
ESSAY_SEPARATOR = "\n\n"

# Keys of the needles: common, single-token-ish, unlikely to be in the essays as "magic number" keys.
WORDS: tuple[str, ...] = (
    "apple", "river", "violin", "lantern", "harbor", "falcon", "meadow", "copper", "glacier", "orchid",
    "compass", "thunder", "saffron", "pyramid", "walrus", "canyon", "marble", "tornado", "lemon", "cobalt",
    "penguin", "velvet", "volcano", "anchor", "bamboo", "crystal", "dolphin", "emerald", "feather", "garnet",
    "hammock", "iceberg", "jasmine", "kettle", "lobster", "magnet", "nutmeg", "oyster", "parrot", "quartz",
)

# A sentence ends after . ! or ? (and any closing quotes/brackets) followed by whitespace or the end.
_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*(?=\s|$)")
_WORD_END = re.compile(r"\S(?=\s|$)")


class Tokenizer(Protocol):
    def encode(self, text: str, *args, **kwargs) -> list[int]: ...

    def decode(self, ids: Sequence[int], *args, **kwargs) -> str: ...


@dataclass(frozen=True, kw_only=True)
class NeedleSample:
    """One needle question.

    Attributes:
        context: the haystack with the needle sentence inserted.
        query: the question about the needle.
        answer: the expected answer (the 7-digit number as a string).
        needle: the inserted sentence.
        depth: where the needle landed, as a fraction of the haystack's characters (the requested depth
            snapped to the nearest sentence boundary).
        answer_prefix: RULER's start of the answer, for base models without a chat template to continue.
    """

    context: str
    query: str
    answer: str
    needle: str
    depth: float
    answer_prefix: str

    def prompt(self, *, with_answer_prefix: bool = False) -> str:
        """The full user turn: RULER's instruction, the context, then the question.

        ``with_answer_prefix`` appends RULER's answer prefix on a new line, for base models (RULER's
        template for models without a chat template).
        """
        text = f"{INSTRUCTION}\n\n{self.context}\n\n{self.query}"
        return f"{text}\n{self.answer_prefix}" if with_answer_prefix else text

    def messages(self) -> list[dict[str, str]]:
        """The prompt as a one-message chat for ``tokenizer.apply_chat_template``."""
        return [{"role": "user", "content": self.prompt()}]


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    """Number of tokens of ``text`` without special tokens."""
    return len(_encode(tokenizer, text))


def build_haystack(tokenizer: Tokenizer, n_tokens: int, *, seed: int = 0,
                   texts: Sequence[str] | None = None) -> str:
    """Essays concatenated in a seeded order, cut to tokenize to at most ``n_tokens`` (and close to it).

    The cut is at the last sentence end that fits, or at a word end when that loses more than
    ``max(32, n_tokens // 100)`` tokens (long sentences, small budgets). Essays repeat, in the same order,
    if the corpus is shorter than ``n_tokens``.

    Args:
        tokenizer: see the module docstring.
        n_tokens: the token budget (>= 0).
        seed: shuffles the essay order; the same seed gives the same text.
        texts: the corpus (default: :func:`paul_graham_essays`).
    """
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    if n_tokens == 0:
        return ""
    texts = list(paul_graham_essays() if texts is None else texts)
    if not texts or not any(t.strip() for t in texts):
        raise ValueError("build_haystack needs at least one non-empty text")
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)

    # Take whole essays until their token counts cover the budget with a margin, then cut the join.
    parts, total, i = [], 0, 0
    while total < n_tokens + 64 + n_tokens // 20:
        text = texts[order[i % len(order)]]
        parts.append(text)
        total += count_tokens(tokenizer, text)
        i += 1
        if i == len(order) and total == 0:
            raise ValueError("build_haystack: the texts tokenize to no tokens")
    joined = ESSAY_SEPARATOR.join(parts)

    def fits(end: int) -> bool:
        return count_tokens(tokenizer, joined[:end]) <= n_tokens

    # Start the search where token n_tokens ends in the joined text; a few prefix counts then settle it.
    guess = _char_at_token(tokenizer, joined, n_tokens)
    sentence_ends = [m.end() for m in _SENTENCE_END.finditer(joined)]
    end = _last_fitting(sentence_ends, fits, floor=0, start=bisect.bisect_right(sentence_ends, guess) - 1)
    slack = max(32, n_tokens // 100)
    if n_tokens - count_tokens(tokenizer, joined[:end]) > slack:
        # Refine to a word end between this sentence end and the next one.
        nxt = bisect.bisect_right(sentence_ends, end)
        limit = sentence_ends[nxt] if nxt < len(sentence_ends) else len(joined)
        word_ends = [m.end() for m in _WORD_END.finditer(joined, end, limit)]
        end = _last_fitting(word_ends, fits, floor=end, start=bisect.bisect_right(word_ends, guess) - 1)
    return joined[:end]


def needle_prompt(tokenizer: Tokenizer, context_tokens: int, depth: float, *, seed: int = 0,
                  texts: Sequence[str] | None = None) -> NeedleSample:
    """A needle question whose context (haystack + needle) tokenizes to about ``context_tokens``.

    Args:
        tokenizer: see the module docstring.
        context_tokens: token budget of the context, needle included (the prompt adds the instruction and
            question, ~45 tokens, and a chat template adds its own).
        depth: where to put the needle, 0.0 (start) to 1.0 (end) of the haystack; snapped to the nearest
            sentence boundary.
        seed: picks the key word, the 7-digit number and the essay order.
        texts: the corpus (default: :func:`paul_graham_essays`).
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(seed)
    word = rng.choice(WORDS)
    answer = str(rng.randint(1_000_000, 9_999_999))
    needle = NEEDLE.format(word=word, number=answer)
    budget = max(0, context_tokens - count_tokens(tokenizer, " " + needle))
    haystack = build_haystack(tokenizer, budget, seed=seed, texts=texts)

    # Candidate positions: the start, every sentence end, the end; take the one nearest the target.
    positions = [0, *(m.end() for m in _SENTENCE_END.finditer(haystack)), len(haystack)]
    target = depth * len(haystack)
    at = min(positions, key=lambda p: (abs(p - target), p))
    if at == 0:
        context = needle + (" " + haystack if haystack else "")
    else:
        context = haystack[:at] + " " + needle + haystack[at:]
    return NeedleSample(context=context, query=QUESTION.format(word=word), answer=answer, needle=needle,
                        depth=at / len(haystack) if haystack else 0.0,
                        answer_prefix=ANSWER_PREFIX.format(word=word))


def score_answer(prediction: str, answer: str | Sequence[str]) -> bool:
    """True if every reference string occurs in the prediction, case-insensitively (string_match_all)."""
    refs = [answer] if isinstance(answer, str) else list(answer)
    pred = prediction.lower()
    return all(ref.strip().lower() in pred for ref in refs)


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    try:
        return tokenizer.encode(text, add_special_tokens=False)
    except TypeError:  # a tokenizer without special tokens (or the option)
        return tokenizer.encode(text)


def _char_at_token(tokenizer: Tokenizer, text: str, n: int) -> int:
    """About where token ``n`` of ``text`` ends, in characters: exact from the offsets of a fast HF
    tokenizer, else proportional to the token count."""
    try:
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    except (TypeError, KeyError, NotImplementedError, ValueError):  # not callable / no offsets (slow tokenizer)
        return len(text) * n // max(1, count_tokens(tokenizer, text))
    return offsets[min(n, len(offsets)) - 1][1] if offsets else 0


def _last_fitting(candidates: list[int], fits: Callable[[int], bool], *, floor: int, start: int = 0) -> int:
    """The largest candidate for which ``fits`` holds (token counts grow with the prefix); ``floor`` if none.

    Gallops from index ``start`` (a guess) to bracket the answer, then bisects: a good guess costs two or
    three ``fits`` calls. ``fits(floor)`` is assumed true; a returned candidate was always checked.
    """
    if not candidates:
        return floor
    n = len(candidates)
    start = min(max(start, 0), n - 1)
    # Bracket: good = index known to fit (-1: none), bad = index known not to fit (n: past the end).
    if fits(candidates[start]):
        good, step, probe = start, 1, start + 1
        while probe < n and fits(candidates[probe]):
            good, step = probe, step * 2
            probe = good + step
        bad = min(probe, n)
    else:
        bad, step, probe = start, 1, start - 1
        while probe >= 0 and not fits(candidates[probe]):
            bad, step = probe, step * 2
            probe = bad - step
        good = max(probe, -1)
    lo, hi = good + 1, bad  # candidates[lo - 1] fits (or lo == 0); candidates[hi] does not (or hi == n)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(candidates[mid]):
            lo = mid + 1
        else:
            hi = mid
    return candidates[lo - 1] if lo > 0 else floor
