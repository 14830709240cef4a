"""RULER-style task generators and scorers (magnetar.eval.ruler)."""
from __future__ import annotations

import pytest

from magnetar.eval.ruler import (
    SUBSTITUTE_TASKS, TASKS, prompt_tokens, ruler_sample, score, string_match_all, string_match_part,
)
from magnetar.eval.suite import EvalSample
from tests.test_models_data import WhitespaceTokenizer


@pytest.fixture(scope="module")
def tok():
    return WhitespaceTokenizer()


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_sized_and_scored(task, tok):
    a = ruler_sample(task, tok, 2000, seed=3)
    b = ruler_sample(task, tok, 2000, seed=3)
    c = ruler_sample(task, tok, 2000, seed=4)
    assert a == b, "same seed must give the same sample"
    assert a.context != c.context or a.answers != c.answers, "another seed must give another sample"
    n = prompt_tokens(a, tok)
    assert 0.95 * 2000 <= n <= 2000, f"{task}: {n} tokens for a 2000-token target"
    assert score(a, " and ".join(a.answers)) == 1.0, "the reference answer must score 100"
    assert score(a, "I do not know.") == 0.0, "a wrong answer must score 0"
    for ans in a.answers:  # every answer is really in the context (or derivable from it)
        if task not in ("cwe", "fwe", "qa_2"):
            assert ans in a.context, (task, ans)
    assert a.max_new_tokens == {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}[task.split("_")[0]]


def test_task_details(tok):
    s = ruler_sample("niah_multivalue", tok, 3000, seed=0)
    assert len(s.answers) == 4 and all(f"is: {v}." in s.context for v in s.answers)
    s = ruler_sample("niah_multikey_1", tok, 3000, seed=0)
    assert len(s.metadata["needles"]) == 4 and len(s.answers) == 1  # 3 distracting keys
    s = ruler_sample("vt", tok, 3000, seed=0)
    chain = s.metadata["chain"]
    assert len(chain) == 5 and all(f"VAR {v} " in s.context for v in s.answers)
    assert [s.context.index(c) for c in chain] == sorted(s.context.index(c) for c in chain), "chain order kept"
    s = ruler_sample("cwe", tok, 4000, seed=0)
    words = [w for w in s.context.split() if w.isalpha()]
    counts = {w: words.count(w) for w in set(words)}
    top = sorted(counts, key=lambda w: -counts[w])[:10]
    assert set(top) == set(s.answers)
    s = ruler_sample("fwe", tok, 3000, seed=0)
    coded = s.context.split("\n", 1)[1].split()[:-1]
    freq = {w: coded.count(w) for w in set(coded)}
    assert all(freq[a] >= max(freq[w] for w in freq if w not in s.answers) for a in s.answers)
    for task in ("qa_1", "qa_2"):
        s = ruler_sample(task, tok, 3000, seed=0)
        assert s.metric == "part" and task in SUBSTITUTE_TASKS and s.metadata["substitute"]


def test_metrics_match_ruler_definitions():
    assert string_match_all("alpha and beta", ["alpha", "BETA", "gamma", "delta"]) == 0.5
    assert string_match_part("the answer is Beta", ["alpha", "beta"]) == 1.0
    assert string_match_part("nothing", ["alpha", "beta"]) == 0.0
    s = EvalSample(task="qa_1", context="", query="", answers=("Porto", "Oporto"), metric="part")
    assert score(s, "It is Porto.") == 1.0


def test_bad_input(tok):
    with pytest.raises(ValueError, match="unknown RULER task"):
        ruler_sample("niah_single_9", tok, 2000)
    with pytest.raises(ValueError, match="length must be"):
        ruler_sample("vt", tok, 10)
    with pytest.raises(ValueError, match="cwe needs more than"):
        ruler_sample("cwe", tok, 100)


@pytest.mark.model
def test_sizing_with_the_real_tokenizer(smollm2_tokenizer):
    tok = smollm2_tokenizer
    for task in TASKS:
        n = prompt_tokens(ruler_sample(task, tok, 4096, seed=1), tok)
        assert 0.96 * 4096 <= n <= 4096, (task, n)


@pytest.mark.model
def test_samples_fit_the_model_positions_with_the_output_budget(smollm2_tokenizer):
    # At the model's whole window (8K for SmolLM2's 8192 positions) the prompt sized to the length leaves no
    # room for the answer: the runner makes the sample again, shorter, until prompt + output budget fit.
    from magnetar.eval.runner import encode, fitted_sample

    tok = smollm2_tokenizer
    for task, positions in (("niah_single_2", 2048), ("niah_multikey_3", 2048), ("qa_1", 2048), ("vt", 1100)):
        sample, extra, (c, q) = fitted_sample("ruler", task, tok, positions, 3, 0, positions)
        total = int(c.numel() + q.numel()) + sample.max_new_tokens
        assert positions - 48 <= total <= positions, (task, total)  # fits, and not shortened much further
        assert extra["fitted_length"] < positions
        assert [x.tolist() for x in encode(tok, sample)] == [c.tolist(), q.tolist()]
        assert score(sample, " and ".join(sample.answers)) == 1.0
    # with room to spare nothing changes: the same sample as made directly, no fitted_length
    sample, extra, _ = fitted_sample("ruler", "niah_single_2", tok, 1024, 3, 0, 8192)
    assert extra == {} and sample == ruler_sample("niah_single_2", tok, 1024, seed=0 * 100003 + 3)
    with pytest.raises(ValueError, match="do not fit the model's 100 positions"):
        fitted_sample("ruler", "niah_single_2", tok, 1024, 3, 0, 100)


@pytest.mark.model
def test_needle_block_of_the_benchmark(smollm2_tokenizer):
    # benchmarks/ruler_needle_blocks.py: the block holding the asked needle, checked against the block where
    # the needle's own token ids ("...is: <value>.") are found in the Phase-1 ids
    from magnetar.eval.runner import fitted_sample
    from tests.conftest import load_benchmark

    bench = load_benchmark("ruler_needle_blocks")
    tok = smollm2_tokenizer
    seen = set()
    for index in range(6):
        sample, _, (ids, _) = fitted_sample("ruler", "niah_single_1", tok, 2048, index, 0, 8192)
        value = tok(" " + sample.answers[0], add_special_tokens=False)["input_ids"]
        hits = [i for i in range(len(ids) - len(value)) if ids[i : i + len(value)].tolist() == value]
        assert len(hits) == 1, (index, hits)
        block, size = bench.needle_block(sample, ids, tok, 4), -(-len(ids) // 4)
        # the block of the needle's start, ~15 tokens before its value: the two differ only when the value
        # sits just past a block boundary
        assert block == min(3, hits[0] // size) or hits[0] % size < 40, index
        seen.add(block)
    assert len(seen) > 1  # the needles of 6 samples do not all sit in one block
