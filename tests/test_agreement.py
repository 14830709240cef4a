"""Ranks of a CP group must agree on the request (hardening issue): every rank raises the same error naming what
differs and on which ranks -- the engine's request check (magnetar/engine/agree.py) and ring_attention's shapes and
dtypes. The multi-rank tests assert the error on every rank (each rank checks inside the spawned function)."""
from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import magnetar
from magnetar.config import EngineConfig, LukaConfig, SparseConfig
from magnetar.engine.agree import SLOTS, RequestMismatchError, describe_mismatch, digest, request_fields
from magnetar.parallel import init_groups, ring_attention
from tests.dist_utils import TEST_TIMEOUT, run_distributed
from tests.tiny_models import tiny_model

L, Q = 40, 4
TAIL = (r"\. Every rank of a model replica \(TP x CP group\) must get the same context, query, generation parameters "
        r"and config\.$")


def _ids(seed=0, length=L):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=g), torch.randint(0, 256, (Q,), generator=g)


def _needle(ctx, at=L // 2):
    other = ctx.clone()
    other[at] = (int(ctx[at]) + 1) % 256  # same length, one token differs
    return other


# -- the digest and the message, no processes ---------------------------------------------------------------

BASE = dict(entry="generate", contexts=None, queries=None, max_new_tokens=4, stop=None, return_logits=False)


def _request(config=None, **changes):
    ctx, q = _ids()
    req = dict(BASE, contexts=[ctx], queries=[q])
    req.update(changes)
    return request_fields(config or EngineConfig.create(method="star", cp_size=2), **req)


def _message(*per_rank):
    """The error for ranks holding ``per_rank`` field lists (each from :func:`request_fields`)."""
    return describe_mismatch([f.label for f in per_rank[0]], [digest(f) for f in per_rank])


STAR = EngineConfig.create(method="star", cp_size=2)
CTX, QUERY = _ids()
CASES = [  # (what rank 1 gets instead of rank 0's request, what the error must say)
    ("needle", dict(contexts=[_needle(CTX)]),
     r"context token ids differ \(rank 0: 40 tokens #[0-9a-f]{8}, rank 1: 40 tokens #[0-9a-f]{8}\)"),
    ("shorter context", dict(contexts=[CTX[:-1]]),
     r"context token ids differ \(rank 0: 40 tokens #\w+, rank 1: 39 tokens #\w+\)"),
    ("query", dict(queries=[QUERY.flip(0)]), r"query token ids differ \(rank 0: 4 tokens #\w+, rank 1: 4 tokens"),
    ("two requests", dict(contexts=[CTX, CTX], queries=[QUERY, QUERY]),
     r"number of requests differs \(rank 0: 1, rank 1: 2\); context token ids differ \(rank 0: 40 tokens #\w+, "
     r"rank 1: 80 tokens"),
    ("request boundary", dict(contexts=[CTX[:10], CTX[10:]], queries=[QUERY, QUERY]), r"number of requests differs"),
    ("max_new_tokens", dict(max_new_tokens=5), r"^ranks disagree on the request: max_new_tokens differs "
                                               r"\(rank 0: 4, rank 1: 5\)" + TAIL),
    ("stop", dict(stop=["\n"]), r"stop strings differ \(rank 0: None, rank 1: #\w+\)"),
    ("return_logits", dict(return_logits=True), r"return_logits differs \(rank 0: False, rank 1: True\)"),
    ("method", dict(config=EngineConfig.create(method="pulsar", cp_size=2)),
     r"^ranks disagree on the request: config field 'method' differs \(rank 0: 'star', rank 1: 'pulsar'\)" + TAIL),
    ("float option", dict(config=STAR.replace(summary_budget=0.25)),
     r"config field 'pulsar.summary_budget' differs \(rank 0: 0.125, rank 1: 0.25\)"),
    ("long known string", dict(config=STAR.replace(luka_mode="lined", luka_compressor="mean")),
     r"config field 'luka.luka_mode' differs \(rank 0: 'none', rank 1: 'lined'\); config field "
     r"'luka.luka_compressor' differs \(rank 0: 'attention_weighted', rank 1: 'mean'\)"),
    ("refinement scope", dict(config=STAR.replace(luka_mode="clustered", luka_refine_scope="per_kv_head")),
     r"config field 'luka.luka_refine_scope' differs \(rank 0: 'shared', rank 1: 'per_kv_head'\)"),
    ("path", dict(config=STAR.replace(hash_path="/some/where/hash.pt")),
     r"config field 'sparse.hash_path' differs \(rank 0: None, rank 1: #\w+\)"),
    ("timeout", dict(config=STAR.replace(timeout_s=30.0)),
     r"config field 'parallel.timeout_s' differs \(rank 0: 600.0, rank 1: 30.0\)"),
    ("score instead", dict(entry="score", max_new_tokens=None, stop=None, return_logits=None),
     r"^ranks disagree on the request: entry point \(generate or score\) differs \(rank 0: 'generate', "
     r"rank 1: 'score'\)" + TAIL),  # only that: the other fields mean different things
]


@pytest.mark.parametrize("changes,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_difference_is_named_with_its_ranks(changes, expected):
    msg = _message(_request(STAR), _request(**changes))
    assert msg is not None and re.search(expected, msg), msg
    assert _message(_request(STAR), _request(STAR)) is None, "the same request must agree"


def test_message_groups_agreeing_ranks_and_caps_the_list():
    star, pulsar = _request(STAR), _request(EngineConfig.create(method="pulsar", cp_size=2))
    msg = _message(star, pulsar, star)
    assert "config field 'method' differs (ranks 0,2: 'star', rank 1: 'pulsar')" in msg, msg
    many = STAR.replace(block_size=3, anchor_size=2, sink_size=1, chunk_size=2, scorer="bm25", positions="contiguous",
                        discard_summary_kv=False, sink_tokens=1)
    msg = _message(star, _request(many))
    assert msg.count("differs (") == 6 and "; and 2 more fields differ." in msg, msg


def test_digest_has_one_length_and_ignores_list_or_tuple():
    gen = _request(STAR)
    score = _request(STAR, entry="score", max_new_tokens=None, return_logits=None,
                     variants=[None, SparseConfig(sparse_policy="oracle_topk", sparse_budget=4), LukaConfig()])
    assert len(gen) <= SLOTS and len(digest(gen)) == len(digest(score)) == 1 + 3 * SLOTS
    assert _message(_request(STAR, stop=["a", "b"]), _request(STAR, stop=("a", "b"))) is None
    other_variants = _request(STAR, entry="score", max_new_tokens=None, return_logits=None,
                              variants=[None, SparseConfig(sparse_policy="oracle_topk", sparse_budget=8), LukaConfig()])
    assert re.search(r"variant configs differ \(rank 0: #\w+, rank 1: #\w+\)", _message(score, other_variants))
    assert "continuation token ids" in _message(score, _request(STAR, entry="score", max_new_tokens=None,
                                                                return_logits=None, queries=[QUERY.flip(0)]))
    # ranks running other versions (other fields): one clear sentence, not a misaligned comparison
    other_version = digest(gen)
    other_version[0] += 1
    msg = describe_mismatch([f.label for f in gen], [digest(gen), other_version])
    assert "the ranks run different versions of magnetar" in msg and "rank 0: #" in msg, msg


# -- the engine on 2 gloo ranks -----------------------------------------------------------------------------


def _expect_mismatch(rank, fn, pattern):
    with pytest.raises(RequestMismatchError, match=pattern) as info:
        fn()
    assert "block plan" not in str(info.value), f"[rank {rank}] {info.value}"


def _requests_worker(rank, world):
    eng = magnetar.init_inference(tiny_model("llama", seed=3), deepspeed_inference=False, method="star",
                                  cp_size=world, timeout_s=30)
    ctx, q = _ids(3)
    # another needle on rank 1 (same lengths)
    _expect_mismatch(rank, lambda: eng.generate(ctx if rank == 0 else _needle(ctx), q, max_new_tokens=2),
                     r"context token ids differ \(rank 0: 40 tokens #\w{8}, rank 1: 40 tokens #\w{8}\)" + TAIL)
    # another context length: before, "the block plan is inconsistent" or a gloo abort
    _expect_mismatch(rank, lambda: eng.generate(ctx[: L - 3 * rank], q, max_new_tokens=2),
                     r"^ranks disagree on the request: context token ids differ \(rank 0: 40 tokens #\w+, rank 1: "
                     r"37 tokens #\w+\)" + TAIL)
    _expect_mismatch(rank, lambda: eng.generate(ctx, q, max_new_tokens=2 + rank),
                     r"^ranks disagree on the request: max_new_tokens differs \(rank 0: 2, rank 1: 3\)" + TAIL)
    _expect_mismatch(rank, lambda: eng.score(ctx, q if rank == 0 else q.flip(0)),
                     r"continuation token ids differ \(rank 0: 4 tokens #\w+, rank 1: 4 tokens #\w+\)")
    _expect_mismatch(rank, lambda: eng.generate(ctx, q, max_new_tokens=2) if rank == 0 else eng.score(ctx, q),
                     r"entry point \(generate or score\) differs \(rank 0: 'generate', rank 1: 'score'\)" + TAIL)
    # the same request after the errors: the engine is intact and both ranks decode the same tokens
    res = eng.generate(ctx, q, max_new_tokens=3)
    tokens = [None] * world
    dist.all_gather_object(tokens, res.token_ids)
    assert len(res.token_ids) == 3 and tokens[0] == tokens[1], f"[rank {rank}] {tokens}"
    assert sum(res.context_kv_tokens_per_rank) == L


def test_ranks_given_different_requests_all_raise_naming_it():
    run_distributed(_requests_worker, 2)


def _methods_worker(rank, world):
    eng = magnetar.init_inference(tiny_model("llama", seed=3), deepspeed_inference=False,
                                  method="star" if rank == 0 else "pulsar", cp_size=world, timeout_s=30)
    ctx, q = _ids(3)
    _expect_mismatch(rank, lambda: eng.generate(ctx, q, max_new_tokens=2),
                     r"^ranks disagree on the request: config field 'method' differs \(rank 0: 'star', "
                     r"rank 1: 'pulsar'\)" + TAIL)


def test_star_on_one_rank_pulsar_on_the_other_raises_naming_method():
    run_distributed(_methods_worker, 2)


# -- ring_attention on 2 gloo ranks -------------------------------------------------------------------------


def _ring_call(rank, groups, *, dtype=torch.float32, D=8, k_dtype=None):
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, 4, 5, D, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, 5, D, generator=g).to(k_dtype or dtype) for _ in range(2))
    pos = torch.arange(5) + 5 * rank
    return ring_attention(q, k, v, group=groups.cp_group, q_pos=pos, k_pos=pos, timeout=groups.timeout)


def _ring_worker(rank, world):
    groups = init_groups(world, timeout=TEST_TIMEOUT)
    with pytest.raises(ValueError, match=r"^ring_attention: the ranks of the group disagree on q dtype \(rank 0: "
                                         r"torch.float32, rank 1: torch.float64\); k dtype \(rank 0: torch.float32, "
                                         r"rank 1: torch.float64\); v dtype \(.*\); every rank must pass q, k, v of "
                                         r"the same B, Hq, Hkv, D and dtype"):
        _ring_call(rank, groups, dtype=torch.float64 if rank else torch.float32)
    with pytest.raises(ValueError, match=r"disagree on D \(rank 0: 8, rank 1: 16\); q's D \(rank 0: 8, rank 1: 16\);"):
        _ring_call(rank, groups, D=8 + 8 * rank)
    # the same mistake on every rank (k/v float64, q float32) reaches the same verdict everywhere, before any exchange
    with pytest.raises(ValueError, match=r"q, k, v must share a dtype, got torch.float32, torch.float64"):
        _ring_call(rank, groups, k_dtype=torch.float64)
    out, lse = _ring_call(rank, groups)  # the group still works
    assert out.shape == (1, 4, 5, 8) and torch.isfinite(lse).all()


def test_ring_attention_ranks_with_other_dtype_or_shape_all_raise():
    run_distributed(_ring_worker, 2)
