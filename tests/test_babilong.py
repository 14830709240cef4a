"""BABILong-style samples (magnetar.eval.babilong): stories, answers, context assembly, prompt, scoring.

Answers are checked by an independent re-simulation: the fact sentences are parsed back here with
regular expressions and the world is replayed, so a bug in the generator's state tracking cannot hide
behind the same bug in the check. A whitespace tokenizer stub keeps the suite fast and exact.
"""
from __future__ import annotations

import random
import re

import pytest

from magnetar.eval.babilong import (
    MAX_NEW_TOKENS,
    TASKS,
    babilong_sample,
    instruction_block,
    score_babilong,
    simulate_story,
)
from magnetar.eval.suite import EvalSample

SEEDS = range(25)


class WhitespaceTokenizer:
    """One token per whitespace-separated word; not callable (no offsets), like a minimal tokenizer."""

    def encode(self, text, add_special_tokens=False):
        return [len(w) for w in text.split()]

    def decode(self, ids):
        return " ".join("x" * i for i in ids)


TOK = WhitespaceTokenizer()
_DIRS = {"north": (0, 1), "south": (0, -1), "east": (1, 0), "west": (-1, 0)}
_MOVE = re.compile(r"^(\w+) (?:went|moved|journeyed|travelled|went back) to the (\w+)\.$")
_GET = re.compile(r"^(\w+) (?:got|picked up|grabbed|took) the (\w+) there\.$")
_DROP = re.compile(r"^(\w+) (?:dropped|discarded|put down|left) the (\w+)\.$")
_GIVE = re.compile(r"^(\w+) (?:gave|handed|passed) the (\w+) to (\w+)\.$")
_REL = re.compile(r"^The (\w+) is (north|south|east|west) of the (\w+)\.$")


def replay(facts):
    """Parse and replay the facts: person locations, each object's location path, and the gives."""
    where, holder, path, gives = {}, {}, {}, []
    for fact in facts:
        if m := _MOVE.match(fact):
            p, loc = m.groups()
            where[p] = loc
            for o, h in holder.items():
                if h == p and path[o][-1] != loc:
                    path[o].append(loc)
        elif m := _GET.match(fact):
            p, o = m.groups()
            assert p in where, f"{p} picks up the {o} before being anywhere: {fact!r}"
            assert holder.get(o) is None, f"{o} is already held: {fact!r}"
            holder[o] = p
            if not path.get(o) or path[o][-1] != where[p]:
                path.setdefault(o, []).append(where[p])
        elif m := _DROP.match(fact):
            p, o = m.groups()
            assert holder.get(o) == p, f"{p} drops the {o} without holding it: {fact!r}"
            holder[o] = None
        elif m := _GIVE.match(fact):
            p, o, r = m.groups()
            assert holder.get(o) == p and where.get(r) == where.get(p), f"impossible give: {fact!r}"
            holder[o] = r
            gives.append((p, o, r))
        else:
            raise AssertionError(f"unparsed fact {fact!r}")
    return where, holder, path, gives


def expected_answers(task, facts, question):
    """Every answer the facts allow for the question (a well-posed question has exactly one)."""
    if task == "qa4":
        rels = [_REL.match(f).groups() for f in facts]
        pos = {rels[0][2]: (0, 0)}
        for _ in range(2):  # place every location relative to a placed one
            for x, d, y in rels:
                (dx, dy) = _DIRS[d]
                if y in pos:
                    pos.setdefault(x, (pos[y][0] + dx, pos[y][1] + dy))
                elif x in pos:
                    pos.setdefault(y, (pos[x][0] - dx, pos[x][1] - dy))
        at = {xy: loc for loc, xy in pos.items()}
        if m := re.match(r"^What is (\w+) of the (\w+)\?$", question):
            (dx, dy), y = _DIRS[m[1]], pos[m[2]]
            return {at[(y[0] + dx, y[1] + dy)]}
        m = re.match(r"^What is the (\w+) (\w+) of\?$", question)
        (dx, dy), x = _DIRS[m[2]], pos[m[1]]
        return {at[(x[0] - dx, x[1] - dy)]}
    where, holder, path, gives = replay(facts)
    if task == "qa1":
        return {where[re.match(r"^Where is (\w+)\?$", question)[1]]}
    if task == "qa2":
        o = re.match(r"^Where is the (\w+)\?$", question)[1]
        return {path[o][-1]}
    if task == "qa3":
        o, loc = re.match(r"^Where was the (\w+) before the (\w+)\?$", question).groups()
        return {path[o][k - 1] for k in range(1, len(path[o])) if path[o][k] == loc}
    if m := re.match(r"^Who gave the (\w+) to (\w+)\?$", question):
        return {g for g, o, r in gives if (o, r) == m.groups()}
    if m := re.match(r"^Who gave the (\w+)\?$", question):
        return {g for g, o, _ in gives if o == m[1]}
    if m := re.match(r"^Who did (\w+) give the (\w+) to\?$", question):
        return {r for g, o, r in gives if (g, o) == m.groups()}
    if m := re.match(r"^Who received the (\w+)\?$", question):
        return {r for _, o, r in gives if o == m[1]}
    m = re.match(r"^What did (\w+) give to (\w+)\?$", question)
    return {o for g, o, r in gives if (g, r) == m.groups()}


@pytest.mark.parametrize("task", TASKS)
def test_answer_follows_from_the_facts(task):
    for seed in SEEDS:
        story = simulate_story(task, random.Random(seed))
        assert expected_answers(task, story.facts, story.question) == {story.answer}, (seed, story)
        assert story.answer.lower() not in story.question.lower()  # BABILong never scores question words
        # the supporting facts exist and are enough: replaying only them gives the same answer
        assert story.supporting and all(0 <= i < len(story.facts) for i in story.supporting)
        if task in ("qa1", "qa4", "qa5"):
            support = [story.facts[i] for i in story.supporting]
            if task == "qa5":  # a give needs its participants placed; check the give itself names the answer
                assert all(story.answer in f for f in support)
            else:
                assert story.answer in " ".join(support)


def test_qa3_and_qa2_need_several_facts():
    for seed in SEEDS:
        assert len(simulate_story("qa2", random.Random(seed)).supporting) == 2
        assert len(simulate_story("qa3", random.Random(seed)).supporting) >= 3


@pytest.mark.parametrize("task", TASKS)
def test_sample_is_deterministic_and_seed_dependent(task):
    a = babilong_sample(task, TOK, 600, seed=7)
    b = babilong_sample(task, TOK, 600, seed=7)
    c = babilong_sample(task, TOK, 600, seed=8)
    assert a == b
    assert (a.context, a.query) != (c.context, c.query)
    assert isinstance(a, EvalSample) and a.task == task and a.max_new_tokens == MAX_NEW_TOKENS == 128


@pytest.mark.parametrize("target", [400, 1000, 4000])
@pytest.mark.parametrize("task", TASKS)
def test_context_length_and_fact_order(task, target):
    s = babilong_sample(task, TOK, target, seed=target)
    n = len(TOK.encode(s.context))
    assert n == s.metadata["context_tokens"]
    assert target - max(32, target // 100) <= n <= target, (n, target)
    facts, offsets = s.metadata["facts"], s.metadata["fact_offsets"]
    assert list(offsets) == sorted(offsets)
    for fact, off in zip(facts, offsets):
        assert s.context[off:off + len(fact)] == fact
    pos = 0  # facts appear in story order in the text
    for fact in facts:
        pos = s.context.index(fact, pos) + len(fact)
    assert all(0.0 <= d <= 1.0 for d in s.metadata["fact_depths"])


def test_depth_range_confines_the_facts():
    s = babilong_sample("qa2", TOK, 3000, seed=1, depth_range=(0.4, 0.6))
    depths = s.metadata["fact_depths"]
    assert min(depths) > 0.3 and max(depths) < 0.7, depths


def test_prompt_follows_babilong_template():
    s = babilong_sample("qa1", TOK, 400, seed=2)
    q = s.metadata["question"]
    p1, p2 = s.prompt_parts()
    assert p1 == f"<context>\n{s.context}\n</context>\n" and p2 == s.query[2:]
    assert s.query.endswith(f"\nQuestion: {q}") and s.query.startswith("\n\n" + instruction_block("qa1"))
    assert s.answer_prefix == ""
    assert s.query.count("<example>") == 2 and "The most recent location of" in s.query
    c1, c2 = s.prompt_parts(instruction_in="context")
    assert c1 + c2 == f"{instruction_block('qa1')}\n<context>\n{s.context}\n</context>\nQuestion: {q}"
    zero = babilong_sample("qa1", TOK, 400, seed=2, examples=False)
    assert "<example>" not in zero.query and zero.context == s.context
    with pytest.raises(ValueError, match="instruction_in"):
        s.prompt_parts(instruction_in="middle")


def test_scorer_matches_babilong_compare_answers():
    # the reference answer and typical phrasings
    assert score_babilong("kitchen", ("kitchen",)) == 1.0
    assert score_babilong("Mary is in the kitchen.", ("kitchen",), question="Where is Mary?", task="qa1") == 1.0
    assert score_babilong("The most recent location of Mary is Kitchen. Earlier she was in the garden.",
                          ("kitchen",), question="Where is Mary?", task="qa1") == 1.0
    assert score_babilong("Before the kitchen the apple was in the garden.", ("garden",),
                          question="Where was the apple before the kitchen?", task="qa3") == 1.0
    assert score_babilong("Jeff", ("Jeff",), question="Who gave the apple to Fred?", task="qa5") == 1.0
    # wrong, hedged, or right only after the first sentence
    assert score_babilong("Mary is in the garden.", ("kitchen",), question="Where is Mary?", task="qa1") == 0.0
    assert score_babilong("The kitchen or the garden.", ("kitchen",), question="Where is Mary?", task="qa1") == 0.0
    assert score_babilong("I am not sure. Kitchen.", ("kitchen",), question="Where is Mary?", task="qa1") == 0.0
    assert score_babilong("<example> kitchen", ("kitchen",)) == 0.0
    assert score_babilong("Fred", ("Jeff",), question="Who gave the apple to Fred?", task="qa5") == 0.0
    # yes/no are labels like any other
    assert score_babilong("Yes, he is.", ("yes",), question="Is John in the garden?", task="qa6") == 1.0
    assert score_babilong("No.", ("yes",), question="Is John in the garden?", task="qa6") == 0.0
    with pytest.raises(ValueError, match="unknown task"):
        score_babilong("x", ("x",), task="qa99")


@pytest.mark.parametrize("task", TASKS)
def test_sample_scores_its_own_answer_sentence(task):
    s = babilong_sample(task, TOK, 600, seed=4)
    assert s.score(s.answers[0]) == 1.0
    assert s.score(s.answers[0].capitalize() + ". And more text.") == 1.0
    wrong = next(w for w in ("bathroom", "hallway", "garden", "Bill", "Fred", "milk", "apple")
                 if w != s.answers[0] and w.lower() not in s.metadata["question"].lower())
    assert s.score(wrong) == 0.0


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown BABILong task 'qa6'"):
        babilong_sample("qa6", TOK, 1000, seed=0)
    with pytest.raises(ValueError, match="context_tokens must be >= 0"):
        babilong_sample("qa1", TOK, -1, seed=0)
    with pytest.raises(ValueError, match="cannot hold the .* facts"):
        babilong_sample("qa3", TOK, 20, seed=0)
    with pytest.raises(ValueError, match="cannot hold the .* facts"):
        babilong_sample("qa1", TOK, 0, seed=0)
    with pytest.raises(ValueError, match="depth_range"):
        babilong_sample("qa1", TOK, 1000, seed=0, depth_range=(0.8, 0.2))
    with pytest.raises(ValueError, match="n_facts"):
        babilong_sample("qa4", TOK, 1000, seed=0, n_facts=5)
