"""The engine on tiny random models of every supported architecture, 2 and 4 CPU ranks on gloo.

Independent reference: Hugging Face's own dense forward/generate (sdpa attention, its own KV cache) on an
identical copy of the model. Exact methods (dense, ring, star with one block, pulsar with the whole budget)
must give the same first-token logits within the logits tolerance and identical greedy tokens; the Phase-2
merge over W ranks must equal the same Phase 2 on one rank holding all the KV.
"""
from __future__ import annotations

import copy

import pytest
import torch

import magnetar
from tests.conftest import assert_close, assert_differs
from tests.dist_utils import run_distributed
from tests.tiny_models import ARCHS, reference, tiny_model

L, Q, NEW = 61, 5, 6  # context, query, generated tokens (L is odd: uneven blocks and shards)


def _ids(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (L,), generator=g), torch.randint(0, 256, (Q,), generator=g)


def _run(model, ctx, q, **flat):
    eng = magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=flat.pop("ds", False), **flat)
    return eng.generate(ctx, q, max_new_tokens=NEW, return_logits=True)


def _same(res, ref_logits, ref_tokens, what):
    assert_close(res.first_token_logits, ref_logits, what="logits", msg=what)
    assert res.token_ids == ref_tokens, f"{what}: tokens {res.token_ids} != reference {ref_tokens}"


def _exact_methods_worker(rank, world):
    for i, arch in enumerate(ARCHS):
        model = tiny_model(arch, seed=i)
        ctx, q = _ids(100 + i)
        ref_logits, ref_tokens = reference(model, ctx, q, NEW)
        for name, flat in [
            ("ring zigzag", dict(method="ring", cp_size=world, ds=(i == 0))),
            ("ring contiguous", dict(method="ring", cp_size=world, zigzag=False)),
            ("star one block", dict(method="star", cp_size=world, block_size=L)),
            ("pulsar budget 1.0", dict(method="pulsar", cp_size=world, summary_budget=1.0, sink_size=4,
                                       chunk_size=8)),
        ]:
            res = _run(model, ctx, q, **flat)
            _same(res, ref_logits, ref_tokens, f"[rank {rank}/{world} {arch} {name}]")
            assert sum(res.context_kv_tokens_per_rank) == L, (name, res.context_kv_tokens_per_rank)
        if world == 2:
            res = _run(model, ctx, q, method="dense")  # every rank runs its own dense engine (cp_size 1)
            _same(res, ref_logits, ref_tokens, f"[{arch} dense]")


@pytest.mark.parametrize("world", [2, 4])
def test_exact_methods_equal_hf_dense(world):
    run_distributed(_exact_methods_worker, world)


def _spread_worker(rank, world):
    # Star with W blocks: KV spread over W ranks vs the same blocks encoded on one rank (cp_size 1)
    model = tiny_model("llama", seed=7)
    ctx, q = _ids(7)
    bs = -(-L // world)
    spread = _run(model, ctx, q, method="star", cp_size=world, block_size=bs, anchor_size=4)
    single = _run(model, ctx, q, method="star", cp_size=1, block_size=bs, anchor_size=4)
    assert_close(spread.first_token_logits, single.first_token_logits, what="same_computation",
                 msg="[spread vs single]")
    assert spread.token_ids == single.token_ids
    assert spread.context_kv_tokens_per_rank == [min(bs, L - r * bs) for r in range(world)]
    assert single.context_kv_tokens_per_rank == [L]
    # only the query rank holds the query/generated KV
    gen = [t - c for t, c in zip(spread.kv_tokens_per_rank, spread.context_kv_tokens_per_rank)]
    assert gen[0] == Q + NEW - 1 and all(g == 0 for g in gen[1:]), gen
    # a short anchor makes Star a real approximation: it must differ from dense (so this test can fail)
    ref_logits, _ = reference(model, ctx, q, 1)
    assert_differs(spread.first_token_logits, ref_logits, msg="star, anchor 4")


def _batch_worker(rank, world):
    # three requests of different context and query lengths, decoded as one batch == one at a time
    model = tiny_model("qwen3", seed=11)
    g = torch.Generator().manual_seed(11)
    reqs = [(torch.randint(0, 256, (n,), generator=g), torch.randint(0, 256, (m,), generator=g))
            for n, m in ((61, 5), (40, 2), (75, 7))]
    for flat in (dict(method="ring", cp_size=world), dict(method="star", cp_size=world, anchor_size=4)):
        eng = magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, **flat)
        batch = eng.generate_batch(reqs, max_new_tokens=NEW, return_logits=True)
        for i, (c, q) in enumerate(reqs):
            one = eng.generate(c, q, max_new_tokens=NEW, return_logits=True)
            assert_close(batch[i].first_token_logits, one.first_token_logits, what="same_computation",
                         msg=f"[{flat['method']} request {i}]")
            assert batch[i].token_ids == one.token_ids, (flat, i)
            assert batch[i].context_kv_tokens_per_rank == one.context_kv_tokens_per_rank
        if flat["method"] == "ring":  # exact: each request also equals HF's dense decoding
            for (c, q), res in zip(reqs, batch):
                ref_logits, ref_tokens = reference(model, c, q, NEW)
                _same(res, ref_logits, ref_tokens, f"[batched ring rank {rank}]")


def test_batch_of_requests_equals_one_at_a_time():
    run_distributed(_batch_worker, 2)


@pytest.mark.parametrize("world", [2, 4])
def test_phase2_over_spread_kv_equals_single_rank(world):
    run_distributed(_spread_worker, world)


def _simulated_worker(rank, world):
    # one process standing in for `world` ranks (config simulate) == the real distributed run over `world` ranks,
    # for approximate methods too (so a wrong plan or a lost shard shows), and ring == HF dense
    model = tiny_model("llama", seed=13)
    ctx, q = _ids(13)
    bs = -(-L // (2 * world))  # two blocks per rank
    prefill = [dict(method="star", block_size=bs, anchor_size=5, prefill_policy="oracle", prefill_topk=6,
                    prefill_dense_layers=0)] if world == 2 else []  # the counts' gather: one world size is enough
    for flat in (dict(method="star", block_size=bs, anchor_size=5),
                 dict(method="pulsar", sink_size=4, chunk_size=4, summary_budget=0.25),
                 *prefill, dict(method="ring"), dict(method="ring", rank_by_rank=True),
                 dict(method="star", block_size=-(-L // world), anchor_size=5, exact_layers="0")):
        real = _run(model, ctx, q, cp_size=world, **flat)
        sim = _run(model, ctx, q, cp_size=world, simulate=True, **flat)
        what = f"[rank {rank} simulated {flat} x{world}]"
        assert_close(sim.first_token_logits, real.first_token_logits, what="same_computation", msg=what)
        assert sim.token_ids == real.token_ids, what
        assert sim.simulated and not real.simulated
        assert sim.context_kv_tokens_per_rank == real.context_kv_tokens_per_rank, what
        assert sim.kv_tokens_per_rank == real.kv_tokens_per_rank, what
        assert len(sim.phase1_seconds) == world and sim.phase1_critical_path_seconds > 0
        # the ranks' figures travel in one integer gather: the same sizes and counts as measured in one process
        assert sim.kv_bytes_per_rank == real.kv_bytes_per_rank and sim.prefill_stats == real.prefill_stats, what
        assert len(real.phase1_seconds) == world and all(t > 0 for t in real.phase1_seconds), what
        if "prefill_policy" in flat:
            assert real.prefill_stats["patched_calls"] > 0 and real.prefill_stats["sparse_calls"] > 0, what
        # ring's ranks alone (rank_by_rank) and hybrid layers time every exchange step: W - 1 moves per such layer
        layers = model.config.num_hidden_layers if flat["method"] == "ring" else 1
        if flat["method"] == "ring" and not flat.get("rank_by_rank"):  # one lock-step forward: its time on rank 0
            assert sim.phase1_exchange == [[]] * world and sim.phase1_seconds[1:] == [0.0] * (world - 1), what
        elif not (flat["method"] == "ring" or flat.get("exact_layers")):  # no exchange at all
            assert sim.phase1_exchange == [[]] * world, what
        else:
            assert [len(s) for s in sim.phase1_exchange] == [layers * world] * world, what
            assert all(t > 0 for t in sim.phase1_seconds), what
            slow = sim.phase1_seconds_at(1e-6)  # a link so slow that every move shows
            assert all(a > b for a, b in zip(slow, sim.phase1_seconds)), what
            assert sim.phase1_seconds_at(1e9) == pytest.approx(sim.phase1_seconds, abs=1e-9), what
        assert real.phase1_seconds_at(1e-6) == real.phase1_seconds, what  # real ranks measured their own link
        # ring, and hybrid layers everywhere the last layer's KV depends on (the tiny model has 2 layers), are exact
        if flat["method"] == "ring" or flat.get("exact_layers"):
            assert model.config.num_hidden_layers == 2
            ref_logits, ref_tokens = reference(model, ctx, q, NEW)
            _same(sim, ref_logits, ref_tokens, what)
        else:  # approximate methods must differ from dense (else this comparison could not fail)
            ref_logits, _ = reference(model, ctx, q, 1)
            assert_differs(sim.first_token_logits, ref_logits, msg=what)


@pytest.mark.parametrize("world", [2, 4])
def test_simulated_ranks_equal_distributed(world):
    run_distributed(_simulated_worker, world)


def test_simulated_ranks_need_no_process_group():
    model = tiny_model("qwen2", seed=3)
    ctx, q = _ids(3)
    res = _run(model, ctx, q, method="star", cp_size=3, simulate=True, anchor_size=6)
    assert res.simulated and len(res.phase1_seconds) == 3 and sum(res.context_kv_tokens_per_rank) == L
    with pytest.raises(ValueError, match="needs torch.distributed"):
        magnetar.init_inference(copy.deepcopy(model), method="star", cp_size=3, deepspeed_inference=False)


def _dead_peer_worker(rank, world):
    # rank 1 never joins the request (as if it had crashed): rank 0 must fail fast, not hang
    import time

    model = tiny_model("llama", seed=9)
    ctx, q = _ids(9)
    eng = magnetar.init_inference(copy.deepcopy(model), method="star", cp_size=world, timeout_s=3,
                                  deepspeed_inference=False)
    if rank == 0:
        t0 = time.monotonic()
        with pytest.raises((TimeoutError, RuntimeError)):
            eng.generate(ctx, q, max_new_tokens=2)
        assert time.monotonic() - t0 < 30
    else:
        time.sleep(6)


def test_dead_peer_times_out():
    run_distributed(_dead_peer_worker, 2)
