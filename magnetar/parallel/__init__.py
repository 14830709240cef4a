"""Process groups, collectives on attention states, and ring attention. Depends on ``magnetar.ops`` only."""
from magnetar.parallel.collectives import all_gather_states
from magnetar.parallel.groups import (
    DEFAULT_TIMEOUT, ParallelGroups, RankGrid, init_groups, local_groups, rank_grid, rank_layout,
)
from magnetar.parallel.mpu import MESH_DIM_NAMES, MPU, device_mesh
from magnetar.parallel.ring import contiguous_indices, ring_attention, shard, unshard, zigzag_indices

__all__ = [
    "ParallelGroups", "init_groups", "local_groups", "rank_layout", "rank_grid", "RankGrid", "DEFAULT_TIMEOUT",
    "MPU", "device_mesh", "MESH_DIM_NAMES", "all_gather_states", "ring_attention",
    "zigzag_indices", "contiguous_indices", "shard", "unshard",
]
