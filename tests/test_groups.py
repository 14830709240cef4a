"""Pure rank math of the CP x DP layout (the process-group side is in test_distributed.py)."""
from __future__ import annotations

import pytest

from magnetar.parallel import rank_layout


def test_worked_example_world8_cp4():
    cp, dp = rank_layout(8, 4)
    assert cp == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dp == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("world,cp_size", [(1, 1), (6, 3), (8, 1), (8, 8), (16, 4)])
def test_every_rank_in_exactly_one_group_of_each_kind(world, cp_size):
    cp, dp = rank_layout(world, cp_size)
    assert sorted(r for g in cp for r in g) == list(range(world))
    assert sorted(r for g in dp for r in g) == list(range(world))
    assert all(len(g) == cp_size for g in cp) and all(len(g) == world // cp_size for g in dp)
    for g in cp:  # CP groups are consecutive ranks (one node when cp_size divides GPUs per node)
        assert g == list(range(g[0], g[0] + cp_size))


def test_errors_name_both_numbers():
    with pytest.raises(ValueError, match="world size 6 is not divisible by cp_size 4.*\\[1, 2, 3, 6\\]"):
        rank_layout(6, 4)
    with pytest.raises(ValueError, match="cp_size must be >= 1"):
        rank_layout(4, 0)
