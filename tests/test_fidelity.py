"""Fidelity against dense (magnetar.eval.fidelity, Engine.score_answer): the measure against its formula, the
teacher-forced distributions against Hugging Face's forward, exact methods at KL 0, and the suite end to end."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import magnetar
from magnetar.eval.fidelity import compare, items_to_separate, question_from_text, t_interval
from tests.conftest import assert_close
from tests.tiny_models import tiny_model


def _engine(model, **kw):
    return magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, **kw)


def _ids(seed=1, n=120, q=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g), torch.randint(0, 256, (q,), generator=g)


def test_compare_matches_the_formulas_written_out():
    from scipy.stats import entropy

    g = torch.Generator().manual_seed(0)
    ref = torch.log_softmax(torch.randn(4, 11, generator=g, dtype=torch.float64), -1).float()
    got = torch.log_softmax(torch.randn(4, 11, generator=g, dtype=torch.float64), -1).float()
    ref[2, 3] = float("-inf")  # dense gives a token no mass: it adds nothing to the KL
    ref = torch.log_softmax(ref, -1)
    answer = ref.argmax(-1)
    m = compare(ref, got, answer)
    want = [entropy(ref[t].double().exp().numpy(), got[t].double().exp().numpy()) for t in range(4)]
    assert m["kl"] == pytest.approx(sum(want) / 4, rel=1e-6) and m["kl_max"] == pytest.approx(max(want), rel=1e-6)
    assert m["top1"] == (got.argmax(-1) == answer).double().mean().item()
    assert m["logp_diff"] == pytest.approx(float(got.double().gather(1, answer[:, None]).sum()
                                                 - ref.double().gather(1, answer[:, None]).sum()), rel=1e-9)
    assert m["identical"] == bool((got.argmax(-1) == answer).all()) and m["answer_tokens"] == 4
    same = compare(ref, ref, answer)
    assert same["kl"] == 0.0 and same["top1"] == 1.0 and same["identical"] and same["logp_diff"] == 0.0
    bad = got.clone()
    bad[1, 0] = float("nan")  # NaN never turns into a finite fidelity
    assert not math.isfinite(compare(ref, bad, answer)["kl"])


def test_score_answer_is_the_hf_distribution_and_exact_methods_have_kl_zero():
    model = tiny_model("llama", seed=3)
    ctx, q = _ids()
    dense = _engine(model)
    res = dense.generate(ctx, q, max_new_tokens=6)
    sc = dense.score_answer(ctx, q, res.token_ids)
    assert sc.cached and sc.phase1_seconds == [0.0], "Phase 1 came from the context cache generate filled"
    with torch.no_grad():
        full = torch.cat((ctx, q, torch.tensor(res.token_ids)))
        ref = torch.log_softmax(model(full[None]).logits[0].float(), -1)[len(ctx) + len(q) - 1:-1]
    assert_close(sc.logprobs, ref, what="logits", msg="teacher-forced rows vs HF")
    assert sc.logprobs.argmax(-1).tolist() == res.token_ids  # greedy: the answer is its own top-1 path
    ring = _engine(model, method="ring", cp_size=3, simulate=True).score_answer(ctx, q, res.token_ids)
    m = compare(sc.logprobs, ring.logprobs, ring.answer_ids)
    assert_close(torch.tensor(m["kl"]), torch.tensor(0.0), what="kl_exact", msg="ring")
    assert m["identical"] and not ring.cached and len(ring.phase1_seconds) == 3
    star = _engine(model, method="star", cp_size=3, simulate=True).score_answer(ctx, q, res.token_ids)
    assert compare(sc.logprobs, star.logprobs, star.answer_ids)["kl"] > 10 * max(m["kl"], 1e-7), "star approximates"


def test_score_answer_refuses_bad_answers():
    model = tiny_model("llama", seed=3)
    ctx, q = _ids()
    eng = _engine(model)
    with pytest.raises(ValueError, match="answer must be token ids.*not text"):
        eng.score_answer(ctx, q, "Paris")
    with pytest.raises(ValueError, match="the answer is empty"):
        eng.score_answer(ctx, q, [])
    with pytest.raises(ValueError, match="answer holds token id 999"):
        eng.score_answer(ctx, q, [3, 999])
    with pytest.raises(ValueError, match="answer must be token ids"):
        eng.score_answer(ctx, q, [3, 1.5])
    # a context fitted for generating the answer (context + query + answer = every position) is scored; one token
    # more is refused, naming the positions
    room = model.config.max_position_embeddings
    fitted = torch.randint(0, 256, (room - len(q) - 3,), generator=torch.Generator().manual_seed(5))
    assert eng.score_answer(fitted, q, [3, 4, 5]).logprobs.shape[0] == 3
    with pytest.raises(ValueError, match="exceeds the model's .* positions"):
        eng.score_answer(torch.cat((fitted, fitted[:1])), q, [3, 4, 5])


def test_intervals_and_items_to_separate():
    from scipy import stats

    xs = [0.1, 0.4, 0.35, 0.2, 0.3]
    m, h, n = t_interval(xs)
    lo, hi = stats.t.interval(0.95, 4, loc=sum(xs) / 5, scale=stats.sem(xs))
    assert n == 5 and m == pytest.approx((lo + hi) / 2) and h == pytest.approx((hi - lo) / 2)
    # mean 1, sd 2: (1.96 * 2 / 1)^2 = 15.4 -> 16 items
    d = [1 + 2 * z for z in (-1.2649, 1.2649, -1.2649, 1.2649, 0.0, 0.0)]
    assert items_to_separate(d) == math.ceil((stats.norm.ppf(0.975) * stats.tstd(d) / 1.0) ** 2)
    assert items_to_separate([0.0, 0.0]) is None and items_to_separate([1.0]) is None


def test_questions_made_from_the_text():
    text = " ".join(f"Sentence number {i} tells the reader about the topic of item {i} in detail." for i in range(30))
    qs = [question_from_text(text, i) for i in range(10)]
    assert len(set(qs)) == 10 and all(q.startswith("What does the document say right after:") for q in qs)
    assert '"Sentence number 1 tells the reader about the"' in qs[0]
    with pytest.raises(ValueError, match="--questions"):
        question_from_text("Too short.", 0)


@pytest.mark.model
def test_fidelity_suite_end_to_end(tmp_path, capsys, smollm2_path, monkeypatch):
    from magnetar.eval.runner import main

    out = tmp_path / "fid"
    # 4 ranks: Star's last blocks see the first block only (at 2 ranks its anchor is the whole first block: exact)
    args = ["--suite", "fidelity", "--tasks", "qa_1", "--methods", "dense,ring,star", "--lengths", "512",
            "--samples", "2", "--simulate-ranks", "4", "--accuracy", "--out", str(out),
            "--deepspeed-inference", "false"]
    assert main(args) == 0
    rec = {(r["method"], r["index"]): r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert len(rec) == 6
    for i in range(2):
        assert rec[("dense", i)]["kl"] == 0.0 and rec[("dense", i)]["identical"]  # the same computation
        assert rec[("ring", i)]["kl"] < 1e-6 and rec[("ring", i)]["prediction"] == rec[("ring", i)]["dense_answer"]
        assert rec[("star", i)]["kl"] > 100 * max(rec[("ring", i)]["kl"], 1e-9), "star approximates at 4 ranks"
        assert rec[("star", i)]["dense_answer"] == rec[("dense", i)]["dense_answer"]
        assert rec[("star", i)]["cp_size"] == 4 and len(rec[("star", i)]["phase1_s_per_rank"]) == 4
        assert rec[("dense", i)]["phase1_flops_vs_dense"] == 1.0 and rec[("star", i)]["phase1_flops_vs_dense"] < 0.5
        assert rec[("star", i)]["score"] in (0.0, 1.0) and rec[("star", i)]["dense_score"] in (0.0, 1.0)
    md = (out / "report.md").read_text()
    assert "### Fidelity against dense" in md and "| 512 | star | 2 |" in md and "| 512 | ring − star | 2 |" in md
    assert (out / "fidelity_vs_phase1.png").stat().st_size > 0
    capsys.readouterr()
    import magnetar.engine.load as load

    with monkeypatch.context() as m:  # resuming a finished run writes the report again and loads no model
        m.setattr(load, "load_weights", lambda *a, **k: pytest.fail("a finished run loaded its model again"))
        assert main(args) == 0 and "0 items to run (6 already in" in capsys.readouterr().out
    # the user's own text, with their questions
    text = tmp_path / "doc.txt"
    text.write_text(" ".join(f"The report for week {i} says the river rose by {i} centimetres near the mill."
                             for i in range(60)))
    questions = tmp_path / "q.txt"
    questions.write_text("How much did the river rise in week 7?\n\nWhere was the river measured?\n")
    own = ["--suite", "fidelity", "--context-file", str(text), "--questions", str(questions), "--methods", "star",
           "--lengths", "400", "--samples", "2", "--simulate-ranks", "4", "--out", str(tmp_path / "own"),
           "--deepspeed-inference", "false"]
    assert main(own) == 0
    rows = [json.loads(x) for x in (tmp_path / "own" / "results.jsonl").read_text().splitlines()]
    assert [r["task"] for r in rows] == ["file", "file"] and all(r["dense_score"] is None for r in rows)
    assert all(r["kl"] >= 0 and 0 <= r["top1"] <= 1 for r in rows) and "score" not in rows[0]
    capsys.readouterr()  # records without a score are complete fidelity records: the resume keeps them
    assert main(own) == 0 and "0 items to run (2 already in" in capsys.readouterr().out


def test_fidelity_flags_are_checked_before_loading(tmp_path):
    from magnetar.eval.runner import main

    base = ["--methods", "star", "--lengths", "512", "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit, match="--context-file is an option of --suite fidelity"):
        main(["--suite", "ruler", "--context-file", str(tmp_path / "x.txt")] + base)
    with pytest.raises(SystemExit, match="--questions asks about --context-file"):
        main(["--suite", "fidelity", "--questions", str(tmp_path / "q.txt")] + base)
    with pytest.raises(SystemExit, match="--context-file"):
        main(["--suite", "fidelity", "--context-file", str(tmp_path / "missing.txt")] + base)
