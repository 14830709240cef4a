"""WikiSalad-style interleaved-topic QA (magnetar.eval.wikisalad): patterns, topics, facts, sizing, EM scoring.

The checks go back to the essays: every segment, facts taken out, must be a run of its own topic's essay
text, so a mix-up of topics or of segment labels cannot pass. A whitespace tokenizer stub keeps the suite
fast and exact; one test sizes with SmolLM2's real tokenizer when it is prepared.
"""
from __future__ import annotations

import pytest

from magnetar.data.texts import paul_graham_essays
from magnetar.eval.suite import EvalSample
from magnetar.eval.wikisalad import (
    INSTRUCTION,
    LABEL,
    MAX_NEW_TOKENS,
    NAMES,
    PAPER_TOKENS,
    TASKS,
    TEMPLATES,
    clean_essay,
    n_topics,
    normalize_answer,
    pattern,
    score_wikisalad,
    split_sentences,
    wikisalad_sample,
)
from tests.test_models_data import WhitespaceTokenizer

PAPER_PATTERNS = {"easy": "ABAB", "medium": "AABBAABB", "hard": "ABCABC", "very_hard": "AAABBBCCC"}


@pytest.fixture(scope="module")
def tok():
    return WhitespaceTokenizer()


def n_tokens(tok, text):
    return len(tok.encode(text))


def essay_text(i):
    """The cleaned essay as the generator joins it: sentences separated by single spaces."""
    return " ".join(s for p in clean_essay(paul_graham_essays()[i]) for s in split_sentences(p))


def segments_without_facts(s):
    segs = s.context.split("\n\n")
    out = []
    for seg in segs:
        for f in s.metadata["facts"]:
            seg = seg.replace(" " + f["sentence"], "").replace(f["sentence"] + " ", "")
        out.append(seg)
    return segs, out


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_and_seed_dependent(task, tok):
    a = wikisalad_sample(task, tok, seed=3, index=0)
    b = wikisalad_sample(task, tok, seed=3, index=0)
    c = wikisalad_sample(task, tok, seed=4, index=0)
    assert a == b, "the same seed must give the same sample"
    assert a.context != c.context, "another seed must give another context"
    assert isinstance(a, EvalSample) and a.task == task and a.max_new_tokens == MAX_NEW_TOKENS
    assert len(a.answers) == 1 and a.metadata["label"] == LABEL
    # RULER-style answer opening made from the question: the model's first words are then the answer
    q = a.metadata["question"]
    assert a.answer_prefix == "The " + q[len("What was the "):-1] + " was"
    assert score_wikisalad(" " + a.answers[0] + ".", a.answers) == 1.0


@pytest.mark.parametrize("task", TASKS)
def test_pattern_and_topics_match_the_difficulty(task, tok):
    for seed in range(4):
        s = wikisalad_sample(task, tok, seed=seed, index=seed)
        pat = s.metadata["pattern"]
        assert pat == PAPER_PATTERNS[task] == "".join(s.metadata["segment_topics"])
        assert set(pat) == set("ABC"[:n_topics(task)]) == set(s.metadata["topics"])
        segs, plain = segments_without_facts(s)
        assert len(segs) == len(pat), "one blank-line separated paragraph per segment"
        assert [s.context[o:o + len(seg)] for o, seg in zip(s.metadata["segment_offsets"], segs)] == segs
        idx = s.metadata["topic_indices"]
        assert len(set(idx.values())) == len(idx), "every topic is a different essay"
        texts = {label: essay_text(i) for label, i in idx.items()}
        last = {label: -1 for label in idx}
        for label, seg in zip(pat, plain):
            pos = texts[label].find(seg)
            assert pos >= 0, f"{task} seed {seed}: a segment labelled {label} is not text of essay {idx[label]}"
            assert pos > last[label], "a topic's segments follow its essay in order"
            last[label] = pos
            for other, text in texts.items():
                if other != label:
                    assert seg not in text


def test_longer_targets_repeat_the_pattern(tok):
    assert pattern("easy", 4096) == "AB" * 6 and pattern("medium", 4096) == "AABB" * 4
    assert pattern("hard", 4096) == "ABC" * 4 and pattern("very_hard", 4096) == "AAABBBCCC"
    assert pattern("very_hard", 8192) == "A" * 6 + "B" * 6 + "C" * 6, "very_hard keeps one block per topic"
    assert pattern("easy", 1024) == pattern("easy") == pattern("easy", 0) == "ABAB"
    s = wikisalad_sample("very_hard", tok, 8192, seed=1, index=0)
    assert s.metadata["pattern"] == "A" * 6 + "B" * 6 + "C" * 6 and len(s.context.split("\n\n")) == 18


@pytest.mark.parametrize("task", TASKS)
def test_every_answer_once_and_questions_from_the_right_topic(task, tok):
    k = n_topics(task)
    asked_topics = set()
    for index in range(2 * k):
        s = wikisalad_sample(task, tok, seed=10 + index, index=index)
        md, ctx = s.metadata, s.context
        facts = md["facts"]
        assert len(facts) == 3 * k and len({f["answer"] for f in facts}) == len(facts)
        assert len({f["question"] for f in facts}) == len(facts), "each question has one answer"
        for f in facts:
            assert ctx.lower().count(f["answer"].lower()) == 1, f"{f['answer']} must occur exactly once"
            assert ctx[f["offset"]:f["offset"] + len(f["sentence"])] == f["sentence"]
            assert md["segment_topics"][f["segment"]] == f["topic"], "a fact sits in its own topic's segment"
        assert sorted(f["topic"] for f in facts) == sorted("ABC"[:k] * 3)
        asked = facts[md["asked"]]
        assert md["asked_topic"] == "ABC"[index % k] == asked["topic"]
        assert s.answers == (asked["answer"],) and md["question"] == asked["question"]
        assert s.query == f"\n\n{INSTRUCTION}\nQuestion: {asked['question']}"
        assert ctx[md["answer_offset"]:md["answer_offset"] + len(s.answers[0])] == s.answers[0]
        seg = md["asked_segment"]
        start = md["segment_offsets"][seg]
        end = md["segment_offsets"][seg + 1] if seg + 1 < len(md["segment_offsets"]) else len(ctx)
        assert start <= md["answer_offset"] < end and md["segment_topics"][seg] == md["asked_topic"]
        assert s.answers[0] not in s.query
        asked_topics.add(md["asked_topic"])
        if task == "very_hard" and md["asked_topic"] == "A":  # answered after the whole of B and C
            assert md["answer_offset"] < md["segment_offsets"][md["segment_topics"].index("B")]
    assert asked_topics == set("ABC"[:k]), "a run asks about every topic"


@pytest.mark.parametrize("target", [None, 1024, 4096, 8192])
@pytest.mark.parametrize("task", TASKS)
def test_prompt_length_near_the_target(task, target, tok):
    goal = PAPER_TOKENS[task] if target is None else target
    for seed in range(2):
        s = wikisalad_sample(task, tok, target, seed=seed, index=seed)
        n = n_tokens(tok, s.context + s.query + "\n" + s.answer_prefix)
        assert n == s.metadata["prompt_tokens"] and s.metadata["target_tokens"] == goal
        assert s.metadata["context_tokens"] == n_tokens(tok, s.context)
        assert 0.97 * goal <= n <= goal, f"{task}: {n} tokens for a {goal}-token target"
        seg_sizes = [n_tokens(tok, seg) for seg in segments_without_facts(s)[1]]
        assert max(seg_sizes) < 3 * min(seg_sizes), f"segments should be of similar size: {seg_sizes}"
    assert wikisalad_sample(task, tok, 0, seed=0, index=0) == wikisalad_sample(task, tok, None, seed=0, index=0)


def test_scorer_is_strict_squad_em():
    assert score_wikisalad("Juniper", ("Juniper",)) == 1.0
    for variant in ("juniper", "JUNIPER.", "Answer: Juniper", "answer:juniper.", "  **Juniper**  ", '"Juniper"',
                    "\n\nJuniper\nBecause the text says so.", "The Juniper."):
        assert score_wikisalad(variant, ("Juniper",)) == 1.0, variant
    for wrong in ("Ortega", "It was Juniper.", "Juniper or Ortega", "", "\n", "Jun iper", "Answer\nJuniper"):
        assert score_wikisalad(wrong, ("Juniper",)) == 0.0, wrong
    assert score_wikisalad("juniper", "Juniper") == 1.0  # a single reference string
    assert normalize_answer("The  Quick, brown fox!") == "quick brown fox"  # SQuAD's normalize_answer
    assert normalize_answer("an apple a day") == "apple day"


def test_sample_scores_its_reference_and_prompt_parts(tok):
    s = wikisalad_sample("hard", tok, seed=2, index=1)
    ans = s.answers[0]
    assert s.score(ans) == s.score(ans.lower() + ".") == s.score(f"Answer: {ans}") == 1.0
    assert s.score(next(n for n in NAMES if n != ans)) == 0.0
    assert s.prompt_parts() == (s.context, s.query)
    c1, c2 = s.prompt_parts(instruction_in="context")
    assert c1 == f"{INSTRUCTION}\n\n{s.context}" and c2 == f"\n\nQuestion: {s.metadata['question']}"
    with pytest.raises(ValueError, match="instruction_in"):
        s.prompt_parts(instruction_in="middle")


def test_names_and_templates_cannot_collide():
    corpus = " ".join(paul_graham_essays()).lower()
    fixed = " ".join([INSTRUCTION, *(f for pair in TEMPLATES for f in pair)]).lower()
    assert len(set(NAMES)) == len(NAMES) >= 3 * len(TEMPLATES)
    for name in NAMES:
        assert name.lower() not in corpus and name.lower() not in fixed, name
        assert not any(name.lower() in other.lower() for other in NAMES if other != name), name
    assert all(t[0].count("{a}") == 1 and "{a}" not in t[1] for t in TEMPLATES)


def test_essay_cleaning_recovers_paragraphs():
    raw = ("\n\nWant to start a startup?  Get funded by\nY Combinator.\n\n\n\n\nMay 2004(This essay is derived "
           "from a talk (at a school).)First point is\nhere.  It ends.[1]Second paragraph \"quoted.\"  Still "
           "the second. As E. B. White said, it goes on.Third paragraph.\nNotes[1] A note.\nThanks to X.")
    paras = clean_essay(raw)
    assert paras == ["First point is here. It ends.",
                     "Second paragraph \"quoted.\" Still the second. As E. B. White said, it goes on.",
                     "Third paragraph."]
    assert split_sentences(paras[1]) == ["Second paragraph \"quoted.\"", "Still the second.",
                                         "As E. B. White said, it goes on."]


def test_bad_inputs_raise_clear_errors(tok):
    with pytest.raises(ValueError, match="unknown WikiSalad task 'hardest'; choose one of easy, medium"):
        wikisalad_sample("hardest", tok, seed=0)
    with pytest.raises(ValueError, match="context_tokens must be >= 0"):
        wikisalad_sample("easy", tok, -5, seed=0)
    with pytest.raises(ValueError, match=r"too small for very_hard \(AAABBBCCC\).*raise context_tokens to at least"):
        wikisalad_sample("very_hard", tok, 300, seed=0)
    with pytest.raises(ValueError, match="too large for hard.*lower context_tokens"):
        wikisalad_sample("hard", tok, 200_000, seed=0)
    with pytest.raises(ValueError, match="facts_per_topic"):
        wikisalad_sample("hard", tok, seed=0, facts_per_topic=6)
    with pytest.raises(ValueError, match="unknown WikiSalad task"):
        pattern("qa1")


def test_runner_and_report_know_the_suite(tok):
    from magnetar.eval.common import parse_length
    from magnetar.eval.report import compression_table, table
    from magnetar.eval.runner import make_sample
    from magnetar.eval.suite import SUITES, get_suite

    suite = get_suite("wikisalad")
    assert "wikisalad" in SUITES and suite.tasks == TASKS and parse_length("0", minimum=0) == 0
    for index in range(3):
        sample, extra = make_sample("wikisalad", "hard", tok, 0, index, 5)
        assert extra == {} and sample == wikisalad_sample("hard", tok, seed=5 * 100003 + index, index=index)
        assert sample.metadata["asked_topic"] == "ABC"[index]
        assert suite.score(sample, f"Answer: {sample.answers[0]}.") == 1.0
        assert suite.score(sample, "no idea") == 0.0
    at4k, _ = make_sample("wikisalad", "easy", tok, 4096, 0, 0)
    assert at4k.metadata["target_tokens"] == 4096 and at4k.metadata["pattern"] == "AB" * 6
    rows = [{"suite": "wikisalad", "task": t, "method": "dense", "length": 0, "index": i, "score": float(i % 2)}
            for t in TASKS for i in range(2)]
    md = table(rows)
    assert "### wikisalad" in md and all(f"| {t} |" in md for t in TASKS)
    assert compression_table(rows) == ""  # no decode policy: nothing to report
    luka = {"luka": {"luka_mode": "clustered", "luka_compressor": "mean"}}
    rows = [dict(r, config=luka, decode_stats={"compressed_fraction": 0.5 + 0.25 * r["index"]}) for r in rows]
    md = compression_table(rows)
    assert md.count("| 62.5 [50.0, 75.0] (2) |") == len(TASKS), md


@pytest.mark.model
def test_sizing_with_the_real_tokenizer(smollm2_tokenizer):
    real = smollm2_tokenizer
    for task in TASKS:
        for target in (None, 4096):
            s = wikisalad_sample(task, real, target, seed=1, index=0)
            goal = target or PAPER_TOKENS[task]
            n = len(real(s.context + s.query + "\n" + s.answer_prefix, add_special_tokens=False)["input_ids"])
            assert n == s.metadata["prompt_tokens"] and 0.97 * goal <= n <= goal, (task, goal, n)
            assert s.context.count(s.answers[0]) == 1
