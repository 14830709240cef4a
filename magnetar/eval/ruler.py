"""RULER-style tasks (NVIDIA/RULER's 13 synthetic tasks), generated offline, seeded, sized in model tokens.

Tasks and their RULER settings (haystack / keys / values, needles):

    niah_single_1    noise  / words / numbers        niah_multikey_1   essay / words / numbers, 4 keys
    niah_single_2    essay  / words / numbers        niah_multikey_2   needle lines / words / numbers
    niah_single_3    essay  / words / uuids          niah_multikey_3   needle lines / uuids / uuids
    niah_multivalue  essay, 4 values for one key     niah_multiquery   essay, 4 keys asked at once
    vt               variable tracking: 1 chain of 4 hops hidden in noise
    cwe              common words extraction: 10 words x 30 among uncommon words x 3
    fwe              frequent words extraction: coded words drawn from a zeta(2) law, top 3
    qa_1, qa_2       SUBSTITUTES for SQuAD / HotpotQA (no registry ships them): single-hop and two-hop
                     questions about facts inserted into Paul Graham essays; labelled as such in reports

Scoring follows RULER: ``string_match_all`` (each reference found in the prediction, averaged) for NIAH,
VT, CWE and FWE; ``string_match_part`` (any reference found) for QA. Output budgets: niah 128, vt 30,
cwe 120, fwe 50, qa 32. A sample's ``context`` (instruction + haystack) is Phase 1; ``query`` (question) is
Phase 2, with ``answer_prefix`` appended after the assistant header (RULER starts the answer for the
model). The haystack is sized so that instruction + context + question + answer prefix tokenize to the
target length (chat-template tokens come on top).
"""
from __future__ import annotations

import random
import string
import uuid
from functools import lru_cache
from typing import Callable, Sequence

from magnetar.data.niah import build_haystack, count_tokens
from magnetar.eval.suite import EvalSample, GenerationSuite

TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
         "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
SUBSTITUTE_TASKS = {"qa_1": "SQuAD substitute: single-hop facts in essays",
                    "qa_2": "HotpotQA substitute: two-hop facts in essays"}

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NIAH_INSTRUCTION = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
                    "I will quiz you about the {kind} afterwards.")
NEEDLE = "One of the special magic {kind} for {key} is: {value}."


def string_match_all(prediction: str, refs: Sequence[str]) -> float:
    """RULER: the fraction of references that occur in the prediction (case-insensitive)."""
    p = prediction.lower()
    return sum(1.0 for r in refs if r.lower() in p) / len(refs)


def string_match_part(prediction: str, refs: Sequence[str]) -> float:
    """RULER: 1 if any reference occurs in the prediction (case-insensitive)."""
    p = prediction.lower()
    return max(1.0 if r.lower() in p else 0.0 for r in refs)


def score(sample: EvalSample, prediction: str) -> float:
    """RULER's score of ``prediction``: ``string_match_all`` or ``string_match_part`` by ``sample.metric``."""
    return (string_match_all if sample.metric == "all" else string_match_part)(prediction, sample.answers)


@lru_cache(maxsize=1)
def _words() -> tuple[str, ...]:
    """Nouns and adjectives from the wonderwords package (RULER's word source), lower-case, alphabetic."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("wonderwords")
    if spec is None:
        raise RuntimeError("the RULER tasks need word lists: pip install wonderwords==3.0.1 (make test installs it)")
    assets = os.path.join(os.path.dirname(spec.origin), "assets")
    words = set()
    for name in ("nounlist.txt", "adjectivelist.txt"):
        with open(os.path.join(assets, name), encoding="utf-8") as f:
            words.update(w.strip().lower() for w in f if w.strip().isalpha())
    return tuple(sorted(words))


def _fit(make: Callable[[int], str], budget: int, tokenizer, lo: int = 0) -> tuple[int, str]:
    """The largest n whose ``make(n)`` tokenizes to <= ``budget`` (exponential then binary search)."""
    if count_tokens(tokenizer, make(lo)) > budget:
        raise ValueError(f"the target length is too short for this task: even {lo} haystack units exceed {budget} "
                         f"tokens; raise the length")
    hi = max(lo + 1, 8)
    while count_tokens(tokenizer, make(hi)) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count_tokens(tokenizer, make(mid)) <= budget:
            lo = mid
        else:
            hi = mid
    return lo, make(lo)


def _insert_at_depths(units: list[str], needles: list[str], rng: random.Random) -> list[str]:
    """Insert needles between haystack units at uniformly random depths (RULER), keeping needle order."""
    slots = sorted(rng.randint(0, len(units)) for _ in needles)
    out, prev = [], 0
    for slot, needle in zip(slots, needles):
        out.extend(units[prev:slot])
        out.append(needle)
        prev = slot
    out.extend(units[prev:])
    return out


def _number(rng) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _uuid(rng) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _keys(rng, n, kind):
    if kind == "uuids":
        return [_uuid(rng) for _ in range(n)]
    return rng.sample(_words(), n)


def _niah(task: str, tokenizer, length: int, rng: random.Random) -> EvalSample:
    haystack = {"niah_single_1": "noise", "niah_multikey_2": "lines", "niah_multikey_3": "lines"}.get(task, "essay")
    key_kind = "uuids" if task == "niah_multikey_3" else "words"
    value_kind = "uuids" if task in ("niah_single_3", "niah_multikey_3") else "numbers"
    n_keys = 4 if task in ("niah_multikey_1", "niah_multiquery") else 1
    n_values = 4 if task == "niah_multivalue" else 1
    keys = _keys(rng, n_keys, key_kind)
    values = [[(_uuid(rng) if value_kind == "uuids" else _number(rng)) for _ in range(n_values)] for _ in keys]
    needles = [NEEDLE.format(kind=value_kind, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    asked = list(range(n_keys)) if task == "niah_multiquery" else [0]  # multikey: one key asked, others distract
    query_key = ", ".join(keys[i] for i in asked)
    answers = tuple(v for i in asked for v in values[i])
    instruction = NIAH_INSTRUCTION.format(kind=value_kind)
    question = f"What are all the special magic {value_kind} for {query_key} mentioned in the provided text?"
    prefix = f"The special magic {value_kind} for {query_key} mentioned in the provided text are"
    budget = length - count_tokens(tokenizer, f"{instruction}\n{question}\n{prefix}") - \
        sum(count_tokens(tokenizer, " " + n) for n in needles) - 4
    if haystack == "essay":
        text = build_haystack(tokenizer, max(0, budget), seed=rng.randint(0, 2**31))
        units = text.replace(". ", ".\x00").split("\x00")  # sentence units; joined back with spaces
        body = " ".join(_insert_at_depths(units, needles, rng))
    else:
        if haystack == "noise":
            unit = lambda i: NOISE  # noqa: E731
        else:  # distractor needles: other keys with other values
            distract_rng = random.Random(rng.randint(0, 2**31))
            pool = [(_keys(distract_rng, 1, key_kind)[0], _uuid(distract_rng) if value_kind == "uuids"
                     else _number(distract_rng)) for _ in range(4096)]
            pool = [(k, v) for k, v in pool if k not in keys]
            unit = lambda i: NEEDLE.format(kind=value_kind, key=pool[i % len(pool)][0], value=pool[i % len(pool)][1])  # noqa: E731
        n, _ = _fit(lambda m: " ".join(unit(i) for i in range(m)), max(0, budget), tokenizer)
        body = " ".join(_insert_at_depths([unit(i) for i in range(n)], needles, rng))
    return EvalSample(task=task, context=f"{instruction}\n{body}", query=f"\n{question}", answer_prefix=prefix,
                      answers=answers, metric="all", max_new_tokens=MAX_NEW_TOKENS["niah"],
                      metadata={"needles": needles, "haystack": haystack})


def _vt(tokenizer, length: int, rng: random.Random, hops: int = 4) -> EvalSample:
    names = set()
    while len(names) < hops + 1:
        names.add("".join(rng.choice(string.ascii_uppercase) for _ in range(5)))
    names = sorted(names)
    rng.shuffle(names)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[i + 1]} = VAR {names[i]}" for i in range(hops)]
    instruction = "Memorize and track the chain(s) of variable assignment hidden in the following text."
    question = f"Question: Find all variables that are assigned the value {value} in the text above."
    prefix = (f"Answer: According to the chain(s) of variable assignment in the text above, {hops + 1} variables "
              f"are assigned the value {value}, they are: ")
    budget = length - count_tokens(tokenizer, f"{instruction}\n{question}\n{prefix}") - \
        sum(count_tokens(tokenizer, " " + c + ".") for c in chain) - 4
    n, _ = _fit(lambda m: " ".join([NOISE] * m), max(0, budget), tokenizer)
    body = " ".join(_insert_at_depths([NOISE] * n, [c + "." for c in chain], rng))
    return EvalSample(task="vt", context=f"{instruction}\n{body}", query=f"\n{question}", answer_prefix=prefix,
                      answers=tuple(names), metric="all", max_new_tokens=MAX_NEW_TOKENS["vt"],
                      metadata={"chain": chain})


def _cwe(tokenizer, length: int, rng: random.Random, n_common: int = 10, freq_common: int = 30,
         freq_uncommon: int = 3) -> EvalSample:
    vocab = list(_words())
    rng.shuffle(vocab)
    common, uncommon_pool = vocab[:n_common], vocab[n_common:]
    instruction = ("Below is a numbered list of words. In these words, some appear more often than others. "
                   "Memorize the ones that appear most often.")
    question = f"Question: What are the {n_common} most common words in the above list?"
    prefix = f"Answer: The top {n_common} words that appear most often in the list are:"
    overhead = count_tokens(tokenizer, f"{instruction}\n{question}\n{prefix}") + 4
    order_seed = rng.randint(0, 2**31)

    def make(m: int, freq: int = freq_common) -> str:
        words = common * freq + uncommon_pool[:m] * freq_uncommon
        random.Random(order_seed + m).shuffle(words)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))

    # RULER lowers the common words' frequency for short contexts; keep it well above the uncommon ones' 3
    freq = next((f for f in (freq_common, 20, 10, 6) if f <= freq_common
                 and count_tokens(tokenizer, make(0, f)) <= length - overhead), None)
    if freq is None:
        raise ValueError(f"cwe needs more than {length} tokens for {n_common} words x 6; raise the length")
    _, body = _fit(lambda m: make(m, freq), length - overhead, tokenizer)
    return EvalSample(task="cwe", context=f"{instruction}\n{body}", query=f"\n{question}", answer_prefix=prefix,
                      answers=tuple(common), metric="all", max_new_tokens=MAX_NEW_TOKENS["cwe"],
                      metadata={"freq_common": freq})


def _fwe(tokenizer, length: int, rng: random.Random, alpha: float = 2.0, top: int = 3) -> EvalSample:
    vocab = ["".join(rng.choice(string.ascii_lowercase) for _ in range(6)) for _ in range(2000)]
    weights = [1.0 / (i + 1) ** alpha for i in range(len(vocab))]
    instruction = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                   "frequently appeared coded words.")
    question = ("Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                "frequently appeared words in the above coded text?")
    prefix = "Answer: According to the coded text above, the three most frequently appeared words are:"
    overhead = count_tokens(tokenizer, f"{instruction}\n{question}\n{prefix}") + 4
    seed = rng.randint(0, 2**31)

    def make(m: int) -> str:
        r = random.Random(seed)
        return " ".join(r.choices(vocab, weights=weights, k=m)) + " ...."

    _, body = _fit(make, length - overhead, tokenizer, lo=1)
    counts: dict[str, int] = {}
    for w in body.split()[:-1]:
        counts[w] = counts.get(w, 0) + 1
    ranked = sorted(counts, key=lambda w: (-counts[w], vocab.index(w)))
    return EvalSample(task="fwe", context=f"{instruction}\n{body}", query=f"\n{question}", answer_prefix=prefix,
                      answers=tuple(ranked[:top]), metric="all", max_new_tokens=MAX_NEW_TOKENS["fwe"],
                      metadata={"counts": {w: counts[w] for w in ranked[:top + 2]}})


_FIRST = ("Alice", "Bruno", "Chloe", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ingrid", "Jonas", "Keiko", "Luca")
_LAST = ("Varga", "Okafor", "Lindqvist", "Moreau", "Takahashi", "Novak", "Castillo", "Brennan", "Haddad", "Rossi")
_COMPANIES = ("Quillon Labs", "Brightwater Foundry", "Osprey Analytics", "Tessellate Systems", "Marigold Robotics",
              "Halcyon Materials", "Northwind Optics", "Copperleaf Bio")
_CITIES = ("Tallinn", "Porto", "Kraków", "Ljubljana", "Valparaíso", "Hobart", "Tromsø", "Cusco", "Nagano", "Zadar")


def _qa(task: str, tokenizer, length: int, rng: random.Random, n_docs: int = 6) -> EvalSample:
    """SQuAD/HotpotQA substitute: facts inserted into essay 'documents'; one- or two-hop questions."""
    people = rng.sample([f"{f} {l}" for f in _FIRST for l in _LAST], n_docs)
    companies = rng.sample(_COMPANIES, n_docs)
    cities = rng.sample(_CITIES, n_docs)
    works = [f"{p} works as an engineer at {c}." for p, c in zip(people, companies)]
    based = [f"{c} is headquartered in {city}." for c, city in zip(companies, cities)]
    target = rng.randrange(n_docs)
    if task == "qa_1":
        question, answer, facts = f"Which company does {people[target]} work for?", companies[target], works + based
    else:  # two hops: person -> company -> city, the two facts in different documents
        question = f"In which city is the company that {people[target]} works for headquartered?"
        answer, facts = cities[target], works + based
    rng.shuffle(facts)
    instruction = ("Answer the question based on the given documents. Only give me the answer and do not output any "
                   "other words.\n\nThe following are given documents.")
    q = ("Answer the question based on the given documents. Only give me the answer and do not output any other "
         f"words.\n\nQuestion: {question}")
    prefix = "Answer:"
    budget = length - count_tokens(tokenizer, f"{instruction}\n{q}\n{prefix}") - \
        sum(count_tokens(tokenizer, " " + f) for f in facts) - 8 * n_docs
    text = build_haystack(tokenizer, max(0, budget), seed=rng.randint(0, 2**31))
    units = text.replace(". ", ".\x00").split("\x00")
    body = " ".join(_insert_at_depths(units, facts, rng))
    # split into numbered documents at sentence boundaries
    sentences = body.replace(". ", ".\x00").split("\x00")
    per = max(1, len(sentences) // n_docs)
    docs = [" ".join(sentences[i * per:(i + 1) * per if i < n_docs - 1 else None]) for i in range(n_docs)]
    context = instruction + "\n\n" + "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
    return EvalSample(task=task, context=context, query=f"\n\n{q}", answer_prefix=prefix, answers=(answer,),
                      metric="part", max_new_tokens=MAX_NEW_TOKENS["qa"],
                      metadata={"substitute": SUBSTITUTE_TASKS[task], "facts": facts})


def ruler_sample(task: str, tokenizer, length: int, *, seed: int = 0) -> EvalSample:
    """One sample of ``task`` whose prompt tokenizes to about ``length`` tokens; deterministic for a seed."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; choose one of {TASKS}")
    if length < 64:
        raise ValueError(f"length must be >= 64 tokens, got {length}")
    rng = random.Random(f"{task}/{length}/{seed}")
    if task.startswith("niah"):
        return _niah(task, tokenizer, length, rng)
    if task == "vt":
        return _vt(tokenizer, length, rng)
    if task == "cwe":
        return _cwe(tokenizer, length, rng)
    if task == "fwe":
        return _fwe(tokenizer, length, rng)
    return _qa(task, tokenizer, length, rng)


def prompt_tokens(sample: EvalSample, tokenizer) -> int:
    """Tokens of instruction + context + question + answer prefix (no chat template)."""
    return count_tokens(tokenizer, f"{sample.context}{sample.query}\n{sample.answer_prefix}")


class RulerSuite(GenerationSuite):
    """The 13 RULER-style tasks (``--suite ruler``), scored by :func:`score`."""

    name = "ruler"
    tasks = TASKS

    def make_sample(self, task: str, tokenizer, length: int, *, index: int, seed: int) -> tuple[EvalSample, dict]:
        return ruler_sample(task, tokenizer, length, seed=seed), {}

    def score(self, sample: EvalSample, prediction: str) -> float:
        return score(sample, prediction)
