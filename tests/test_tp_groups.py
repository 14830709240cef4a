"""The TP x CP x DP layout: pure rank math, real groups on 4 gloo ranks, the mpu interface and the DeviceMesh."""
from __future__ import annotations

import argparse
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import magnetar
from magnetar.config import EngineConfig, add_cli_args
from magnetar.parallel import MESH_DIM_NAMES, MPU, device_mesh, init_groups, local_groups, rank_grid, rank_layout
from tests.dist_utils import TEST_TIMEOUT, run_distributed


def test_worked_example_world8_tp2_cp2():
    g = rank_grid(8, cp_size=2, tp_size=2)
    assert (g.tp_size, g.cp_size, g.dp_size) == (2, 2, 2)
    assert g.mesh == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert g.tp_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.cp_groups == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.dp_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.coords(5) == (1, 0, 1)  # dp_rank 1 in [1, 5], cp_rank 0 in [5, 7], tp_rank 1 in [4, 5]
    assert rank_layout(8, 2, 2) == (g.cp_groups, g.dp_groups)


def test_tp1_is_the_cp_dp_layout_of_before():
    g = rank_grid(8, 4)
    assert g.cp_groups == [[0, 1, 2, 3], [4, 5, 6, 7]] and g.dp_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.tp_groups == [[r] for r in range(8)]
    assert rank_layout(8, 4) == (g.cp_groups, g.dp_groups) == rank_layout(8, 4, tp_size=1)


@pytest.mark.parametrize("world,cp,tp", [(1, 1, 1), (4, 1, 4), (4, 4, 1), (8, 2, 2), (12, 3, 2), (12, 2, 3),
                                         (16, 2, 4), (24, 3, 4)])
def test_every_rank_in_one_group_of_each_kind_and_coords_agree(world, cp, tp):
    g = rank_grid(world, cp, tp)
    dp = world // (cp * tp)
    assert torch.tensor(g.mesh).flatten().tolist() == list(range(world))  # row-major (dp, cp, tp)
    for kind, groups, size in (("tp", g.tp_groups, tp), ("cp", g.cp_groups, cp), ("dp", g.dp_groups, dp)):
        assert sorted(r for grp in groups for r in grp) == list(range(world)), kind
        assert all(len(grp) == size and grp == sorted(grp) for grp in groups), kind
    for grp in g.tp_groups:  # TP innermost: consecutive ranks
        assert grp == list(range(grp[0], grp[0] + tp))
    for grp in g.cp_groups:  # CP next: stride tp_size
        assert grp == list(range(grp[0], grp[0] + cp * tp, tp))
    for r in range(world):
        d, c, t = g.coords(r)
        assert r == (d * cp + c) * tp + t
        tp_g = next(x for x in g.tp_groups if r in x)
        cp_g = next(x for x in g.cp_groups if r in x)
        dp_g = next(x for x in g.dp_groups if r in x)
        assert (tp_g.index(r), cp_g.index(r), dp_g.index(r)) == (t, c, d)
        # a CP group shares the TP index, a DP group the (CP, TP) index
        assert {g.coords(x)[2] for x in cp_g} == {t} and {g.coords(x)[1:] for x in dp_g} == {(c, t)}


@pytest.mark.parametrize("call,parts", [
    (lambda: rank_grid(6, 2, 4), ("world size 6 is not divisible by tp_size 4", "cp_size 2",
                                  "tp_size x cp_size x dp_size", "[1, 2, 3, 6]", "multiple of 8 ranks")),
    (lambda: rank_grid(8, 3, 2), ("world size 8 is not divisible by cp_size 3 x tp_size 2 = 6",
                                  "tp_size x cp_size x dp_size", "with tp_size 2 choose cp_size from [1, 2, 4]",
                                  "multiple of 6 ranks")),
    (lambda: rank_layout(6, 4), ("world size 6 is not divisible by cp_size 4 x tp_size 1", "[1, 2, 3, 6]")),
    (lambda: rank_grid(4, 1, 0), ("tp_size must be >= 1", "sharing one model's weights")),
    (lambda: rank_grid(4, 1, True), ("tp_size must be an int", "bool True")),
    (lambda: rank_grid(4, 1, 2.0), ("tp_size must be an int", "float 2.0")),
    (lambda: rank_grid(4, 1, "2"), ("tp_size must be an int", "str '2'")),
    (lambda: rank_grid(4, 0, 2), ("cp_size must be >= 1",)),
    (lambda: rank_grid(0, 1, 1), ("world_size must be >= 1",)),
    (lambda: rank_grid(4, 2, 2).coords(4), ("rank must be an int in [0, 4)", "int 4")),
    (lambda: rank_grid(4, 2, 2).coords(True), ("rank must be an int", "bool True")),
    (lambda: init_groups(1, tp_size=0), ("tp_size must be >= 1",)),
    (lambda: init_groups(1, tp_size=2), ("tp_size=2 needs torch.distributed", "tp_size=1")),
    (lambda: MPU("groups"), ("groups must be a ParallelGroups", "str")),
    (lambda: device_mesh(local_groups()), ("device_mesh needs the process groups", "init_groups")),
], ids=lambda x: x[0] if isinstance(x, tuple) else None)
def test_errors_name_every_degree_and_what_to_change(call, parts):
    with pytest.raises(ValueError) as err:
        call()
    for p in parts:
        assert p in str(err.value), (p, str(err.value))


def test_local_groups_and_their_mpu():
    g = local_groups()
    assert (g.tp_size, g.tp_rank, g.tp_group, g.tp_ranks) == (1, 0, None, (0,))
    assert init_groups(1, tp_size=1) == init_groups(1) == g
    m = MPU(g)
    assert m.get_tensor_model_parallel_group() is None and m.get_model_parallel_world_size() == 1
    assert (m.get_sequence_parallel_world_size(), m.get_data_parallel_rank()) == (1, 0)


def test_config_tp_size_field_and_simulate_refusal():
    cfg = EngineConfig.create(method="star", cp_size=2, tp_size=2)
    assert cfg.parallel.tp_size == 2 and EngineConfig.create().tp_size == 1
    args = add_cli_args(argparse.ArgumentParser()).parse_args(["--tp-size", "4"])
    assert EngineConfig.from_cli(args).parallel.tp_size == 4
    with pytest.raises(ValueError, match=r"parallel.tp_size \(--tp-size\): must be an int >= 1, got 0"):
        EngineConfig.create(tp_size=0)
    # checked before the model is touched: a model name that is never loaded is enough
    with pytest.raises(ValueError, match="tp_size 2 needs one process per TP rank, but simulate"):
        magnetar.init_inference("no-model-needed", method="star", cp_size=2, simulate=True, tp_size=2)


def _all_gather_ranks(group, size):
    got = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(got, torch.tensor([dist.get_rank()]), group=group)
    return tuple(int(t) for t in got)


def _worker(rank, world):
    timeout = timedelta(seconds=30)
    # tp 2 x cp 2 x dp 1 on 4 ranks: tp [0, 1] [2, 3], cp [0, 2] [1, 3], dp [r]
    g = init_groups(2, tp_size=2, timeout=timeout)
    grid = rank_grid(4, 2, 2)
    d, c, t = grid.coords(rank)
    assert (g.tp_size, g.cp_size, g.dp_size, g.tp_rank, g.cp_rank, g.dp_rank) == (2, 2, 1, t, c, d), g
    assert g.tp_ranks == ((0, 1) if rank < 2 else (2, 3)) and g.cp_ranks == ((0, 2) if rank % 2 == 0 else (1, 3))
    assert g.dp_ranks == (rank,) and g.timeout == timeout
    for kind in ("tp", "cp", "dp"):  # every member of a group sees the same members, in group order
        group, ranks = getattr(g, f"{kind}_group"), getattr(g, f"{kind}_ranks")
        assert _all_gather_ranks(group, len(ranks)) == ranks, (rank, kind)
        assert dist.get_process_group_ranks(group) == list(ranks)
    assert g.replica_ranks == (0, 1, 2, 3) and g.replica_size == 4  # one replica: tp 2 x cp 2
    assert _all_gather_ranks(g.replica_group, 4) == g.replica_ranks
    m = MPU(g)
    assert m.get_sequence_parallel_group() is g.cp_group and m.get_tensor_model_parallel_group() is g.tp_group
    assert m.get_model_parallel_group() is g.tp_group and m.get_data_parallel_group() is g.dp_group
    assert (m.get_sequence_parallel_world_size(), m.get_sequence_parallel_rank()) == (2, c)
    assert (m.get_tensor_model_parallel_world_size(), m.get_tensor_model_parallel_rank()) == (2, t)
    assert (m.get_model_parallel_world_size(), m.get_model_parallel_rank()) == (2, t)
    assert (m.get_data_parallel_world_size(), m.get_data_parallel_rank()) == (1, d)
    mesh = device_mesh(g)
    assert mesh.device_type == "cpu" and mesh.mesh_dim_names == MESH_DIM_NAMES
    assert mesh.mesh.tolist() == grid.mesh and tuple(mesh.shape) == (1, 2, 2)
    assert list(mesh.get_coordinate()) == [d, c, t], (rank, mesh.get_coordinate())
    for kind in MESH_DIM_NAMES:  # the mesh's dims are the groups themselves, not new ones over other ranks
        sub = mesh[kind]
        assert sub.mesh.tolist() == list(getattr(g, f"{kind}_ranks")), (rank, kind)
        assert mesh.get_group(kind) is getattr(g, f"{kind}_group"), (rank, kind)

    # tp 1 gives today's groups: cp [0, 1] [2, 3], dp [0, 2] [1, 3], each rank its own TP group
    g1 = init_groups(2, timeout=timeout)
    assert (g1.cp_ranks, g1.dp_ranks, g1.tp_ranks) == ((0, 1) if rank < 2 else (2, 3), (rank % 2, rank % 2 + 2),
                                                       (rank,))
    assert (g1.cp_rank, g1.dp_rank, g1.tp_rank, g1.tp_size) == (rank % 2, rank // 2, 0, 1)
    assert _all_gather_ranks(g1.cp_group, 2) == g1.cp_ranks and _all_gather_ranks(g1.tp_group, 1) == (rank,)
    assert g1.replica_group is g1.cp_group and g1.replica_ranks == g1.cp_ranks  # tp 1: the replica is the CP group
    g2 = init_groups(1, tp_size=2, timeout=timeout)  # cp 1: the replica is the TP group
    assert g2.replica_group is g2.tp_group and g2.replica_ranks == g2.tp_ranks == ((0, 1) if rank < 2 else (2, 3))
    assert MPU(g1).get_model_parallel_world_size() == 1
    assert dist.get_process_group_ranks(MPU(g1).get_model_parallel_group()) == [rank]
    with pytest.raises(ValueError, match="world size 4 is not divisible by cp_size 2 x tp_size 4|tp_size 4"):
        init_groups(2, tp_size=4)
    with pytest.raises(ValueError, match="local to one process"):  # None would mean WORLD to torch.distributed
        MPU(local_groups()).get_tensor_model_parallel_group()


def test_tp2_cp2_groups_mpu_and_device_mesh_on_four_ranks():
    assert TEST_TIMEOUT.total_seconds() > 0
    run_distributed(_worker, 4)
