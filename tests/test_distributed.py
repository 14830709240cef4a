"""Multi-rank tests (2 and 4 CPU processes on gloo): gather + merge and ring attention == dense fp64 reference."""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch

from magnetar.ops import attention_with_lse, merge_states
from magnetar.parallel import (
    all_gather_states, contiguous_indices, init_groups, ring_attention, shard, unshard, zigzag_indices,
)
from magnetar.parallel.ring import ExchangeClock, exposed_seconds, ring_attention_local
from tests.conftest import assert_close
from tests.dist_utils import run_distributed
from tests.reference import dense_attention_fp64


def _inputs(seed, B, Hq, Hkv, Sq, Sk, D, dtype):
    g = torch.Generator().manual_seed(seed)  # same seed on every rank: identical global tensors
    q = torch.randn(B, Hq, Sq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Sk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Sk, D, generator=g).to(dtype)
    return q, k, v


def _uneven_indices(seq_len, world, rank):
    # lengths [3, 0, 9, ..., rest]: short, empty (from 3 ranks on) and long shards
    sizes = ([3, 0] + [9] * world)[: world - 1]
    sizes.append(seq_len - sum(sizes))
    start = sum(sizes[:rank])
    return torch.arange(start, start + sizes[rank])


def _gather_merge_cases(rank, world, groups):
    """Star/Pulsar Phase 2: the same queries on every rank, KV sharded; gather + merge == dense."""
    for dtype in (torch.float32, torch.bfloat16):
        for name, idx_fn in (("equal", contiguous_indices), ("uneven", _uneven_indices)):
            q, k, v = _inputs(1, 2, 8, 2, 5, 41, 16, dtype)
            # queries: two inside the context (causality across shards) and three after it
            q_pos = torch.tensor([7, 20, 41, 42, 43])
            idx = idx_fn(41, world, rank)
            out, lse = attention_with_lse(q, shard(k, idx, 2), shard(v, idx, 2), q_pos=q_pos, k_pos=idx)
            outs, lses = all_gather_states(out, lse, groups.cp_group, timeout=groups.timeout)
            assert outs.shape == (world, *out.shape) and lses.shape == (world, *lse.shape)
            assert torch.equal(outs[rank], out) and torch.equal(lses[rank], lse), "gather must not alter data"
            m_out, m_lse = merge_states(outs, lses)
            ref_out, ref_lse = dense_attention_fp64(q, k, v, q_pos=q_pos)
            msg = f"[rank {rank}/{world} gather+merge {name} {dtype}]"
            assert_close(m_out, ref_out, dtype, "out", msg)
            assert_close(m_lse, ref_lse, dtype, "lse", msg)


def _ring_cases(rank, world, groups):
    S = 53
    shardings = {"equal": contiguous_indices, "uneven": _uneven_indices, "zigzag": zigzag_indices}
    for dtype in (torch.float32, torch.bfloat16):
        for causal in (True, False):
            for name, idx_fn in shardings.items():
                q, k, v = _inputs(2, 1, 6, 3, S, S, 8, dtype)
                idx = idx_fn(S, world, rank)
                out, lse = ring_attention(
                    shard(q, idx, 2), shard(k, idx, 2), shard(v, idx, 2), group=groups.cp_group,
                    q_pos=idx, k_pos=idx, causal=causal, timeout=groups.timeout,
                )
                ref_out, ref_lse = dense_attention_fp64(q, k, v, causal=causal)
                msg = f"[rank {rank}/{world} ring {name} causal={causal} {dtype}]"
                assert_close(out, shard(ref_out, idx, 2), dtype, "out", msg)
                assert_close(lse, shard(ref_lse, idx, 2), dtype, "lse", msg)
                # the same rank simulated in one process (the other shards in the order the ring brings them):
                # the same steps and merges as the real exchange
                others = [idx_fn(S, world, (rank - s) % world) for s in range(1, world)]
                clock = ExchangeClock(torch.device("cpu"))
                sim_out, sim_lse = ring_attention_local(
                    shard(q, idx, 2), shard(k, idx, 2), shard(v, idx, 2), q_pos=idx, k_pos=idx, causal=causal,
                    received=[(shard(k, o, 2), shard(v, o, 2), o) for o in others], clock=clock)
                assert_close(sim_out, out, what="same_computation", msg=msg + " simulated")
                assert_close(sim_lse, lse, what="same_computation", msg=msg + " simulated")
                per_token = 2 * 3 * 8 * k.element_size() + 8
                assert [n for _, n in clock.steps()] == [len(o) * per_token for o in others] + [0], msg


def test_exposed_seconds_is_the_transfer_a_step_leaves_uncovered():
    steps = [(0.5, 100 * 10**9), (2.0, 100 * 10**9), (0.0, 0)]  # 2 s of transfer at 50 GB/s each
    assert exposed_seconds(steps, 50) == pytest.approx(1.5)  # step 1: 2 - 0.5; step 2 hides under 2 s of compute
    assert exposed_seconds(steps, 450) == 0.0
    with pytest.raises(ValueError, match="link_gbps"):
        exposed_seconds(steps, 0)


def test_ring_attention_local_takes_invisible_shards_by_size():
    # rank 0 of 3 contiguous shards: the later shards are after its queries (a count stands for each), the same
    # answer as attention over its own shard; the clock still counts their bytes
    q, k, v = _inputs(5, 1, 2, 1, 12, 12, 4, torch.float32)
    own = torch.arange(4)
    clock = ExchangeClock(torch.device("cpu"))
    out, lse = ring_attention_local(q[:, :, :4], k[:, :, :4], v[:, :, :4], q_pos=own, k_pos=own,
                                    received=[4, 4], clock=clock)
    ref_out, ref_lse = dense_attention_fp64(q[:, :, :4], k[:, :, :4], v[:, :, :4])
    assert_close(out, ref_out, torch.float32, "out")
    assert_close(lse, ref_lse, torch.float32, "lse")
    per_token = 2 * 1 * 4 * 4 + 8
    assert [n for _, n in clock.steps()] == [4 * per_token, 4 * per_token, 0]
    with pytest.raises(ValueError, match=r"received\[0\] is a token count"):
        ring_attention_local(q, k, v, q_pos=torch.arange(12), k_pos=torch.arange(12), received=[3], causal=False)


def _ring_queries_differ_from_keys(rank, world, groups):
    # Star-style: queries are only the last block (on the last rank), keys everywhere; decode-like Sq=1 too
    q, k, v = _inputs(3, 2, 4, 1, 1, 30, 8, torch.float32)
    idx = contiguous_indices(30, world, rank)
    mine = rank == world - 1
    q_local = q if mine else q[:, :, :0]
    q_pos = torch.tensor([29]) if mine else torch.zeros(0, dtype=torch.long)
    out, lse = ring_attention(q_local, shard(k, idx, 2), shard(v, idx, 2), group=groups.cp_group,
                              q_pos=q_pos, k_pos=idx)
    if mine:
        ref_out, ref_lse = dense_attention_fp64(q, k, v, q_pos=torch.tensor([29]))
        assert_close(out, ref_out, torch.float32, "out", "[ring decode query]")
        assert_close(lse, ref_lse, torch.float32, "lse", "[ring decode query]")
    else:
        assert out.shape == (2, 4, 0, 8) and lse.shape == (2, 4, 0)


def _worker(rank, world):
    groups = init_groups(world, timeout=timedelta(seconds=60))
    assert (groups.rank, groups.world_size, groups.cp_size, groups.cp_rank) == (rank, world, world, rank)
    _gather_merge_cases(rank, world, groups)
    _ring_cases(rank, world, groups)
    _ring_queries_differ_from_keys(rank, world, groups)


@pytest.mark.parametrize("world", [2, 4])
def test_gather_merge_and_ring_equal_dense(world):
    run_distributed(_worker, world)


def _groups_worker(rank, world):
    g = init_groups(2)
    expect_cp = [0, 1] if rank < 2 else [2, 3]
    expect_dp = [rank % 2, rank % 2 + 2]
    assert g.cp_ranks == tuple(expect_cp) and g.dp_ranks == tuple(expect_dp), (rank, g)
    assert (g.cp_size, g.dp_size, g.cp_rank, g.dp_rank) == (2, 2, rank % 2, rank // 2)
    # the groups really are those ranks: a gather on the CP group sees exactly its members
    outs, _ = all_gather_states(torch.full((1, 1, 1, 1), float(rank)), torch.zeros(1, 1, 1), g.cp_group)
    assert outs.flatten().tolist() == [float(r) for r in expect_cp]
    # ring on CP groups of 2 inside a world of 4 (peers addressed by global rank)
    q, k, v = _inputs(4, 1, 2, 2, 10, 10, 4, torch.float32)
    idx = zigzag_indices(10, 2, g.cp_rank)
    out, lse = ring_attention(shard(q, idx, 2), shard(k, idx, 2), shard(v, idx, 2), group=g.cp_group,
                              q_pos=idx, k_pos=idx)
    ref_out, _ = dense_attention_fp64(q, k, v)
    assert_close(out, shard(ref_out, idx, 2), torch.float32, "out", f"[rank {rank} cp ring]")
    with pytest.raises(ValueError, match="world size 4 is not divisible by cp_size 3"):
        init_groups(3)


def test_groups_cp2_dp2_on_four_ranks():
    run_distributed(_groups_worker, 4)


def _timeout_worker(rank, world):
    from magnetar.parallel.collectives import all_gather_objects

    groups = init_groups(world)
    # objects of different sizes from each rank, in rank order (the engine's data-parallel answers travel so)
    got = all_gather_objects({"rank": rank, "text": "x" * (rank * 1000 + 3)}, groups.cp_group, torch.device("cpu"),
                             timeout=timedelta(seconds=30))
    assert got == [{"rank": r, "text": "x" * (r * 1000 + 3)} for r in range(world)]
    if rank == 0:
        with pytest.raises(TimeoutError, match="all_gather over 2 ranks"):  # its lengths first: their gather waits
            all_gather_objects([1, 2], groups.cp_group, torch.device("cpu"), timeout=timedelta(seconds=2))
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="all_gather_states"):
            all_gather_states(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1), groups.cp_group,
                              timeout=timedelta(seconds=2))
        assert time.monotonic() - t0 < 30, "the timeout must end the wait"
    else:
        time.sleep(7)  # never joins the collectives


def test_collective_times_out_instead_of_hanging():
    run_distributed(_timeout_worker, 2)


def test_world_size_one_path():
    g = init_groups(1)
    assert g.world_size == 1 and g.cp_group is None and g.cp_ranks == (0,)
    out, lse = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3)
    outs, lses = all_gather_states(out, lse, g.cp_group)
    assert torch.equal(outs[0], out) and torch.equal(lses[0], lse)
    q, k, v = _inputs(5, 1, 2, 1, 6, 6, 4, torch.float32)
    idx = torch.arange(6)
    r_out, r_lse = ring_attention(q, k, v, group=None, q_pos=idx, k_pos=idx)
    ref_out, ref_lse = dense_attention_fp64(q, k, v)
    assert_close(r_out, ref_out, torch.float32)
    with pytest.raises(ValueError, match="needs torch.distributed"):
        init_groups(2)


def test_shard_helpers_roundtrip():
    x = torch.arange(23).view(1, 1, 23, 1)
    for fn in (contiguous_indices, zigzag_indices, _uneven_indices):
        idx = [fn(23, 4, r) for r in range(4)]
        assert sorted(torch.cat(idx).tolist()) == list(range(23)), fn.__name__
        assert torch.equal(unshard([shard(x, i, 2) for i in idx], idx, 2), x)
    assert zigzag_indices(8, 2, 0).tolist() == [0, 1, 6, 7] and zigzag_indices(8, 2, 1).tolist() == [2, 3, 4, 5]


def _store_barrier_worker(rank, world):
    from magnetar.parallel.collectives import store_barrier

    if rank == 1:
        time.sleep(1.5)  # still computing: the store answers rank 0's polls meanwhile
    store_barrier("uneven", timeout=timedelta(seconds=30))
    if rank == 0:
        with pytest.raises(TimeoutError, match=r"barrier 'late': 1 of 2 ranks arrived within 0:00:00.300000"):
            store_barrier("late", timeout=timedelta(seconds=0.3))
    else:
        time.sleep(1.0)
        store_barrier("late", timeout=timedelta(seconds=30))  # its own count: it finds rank 0's arrival


def test_a_store_barrier_waits_for_uneven_ranks_and_times_out_naming_the_count():
    """The barrier an evaluation's dealt shares end on: bounded by its own timeout, not the group's transport."""
    run_distributed(_store_barrier_worker, 2)
