"""The Megatron/DeepSpeed ``mpu`` interface and a ``torch.distributed`` DeviceMesh over :class:`ParallelGroups`.

Libraries built on Megatron's model-parallel unit (DeepSpeed's ``init_inference(mpu=...)``, ``deepspeed.initialize
(mpu=...)``, Ulysses sequence parallelism) ask an ``mpu`` object for their groups; torch's DTensor/FSDP2 APIs
take a :class:`~torch.distributed.device_mesh.DeviceMesh`. Both views here answer from the groups Magnetar
already created (:func:`magnetar.parallel.init_groups`): no new process group, the same ranks:

* sequence parallel  = Magnetar's CP group (the context is split over it);
* tensor / model parallel = the TP group (DeepSpeed reads "model parallel" as tensor parallel; there is no
  pipeline parallelism);
* data parallel = the DP group (replicas of the whole TP x CP unit).

This module knows nothing about models or attention.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from magnetar.parallel.groups import ParallelGroups, rank_grid

MESH_DIM_NAMES = ("dp", "cp", "tp")  # outermost first: global rank = (dp * cp_size + cp) * tp_size + tp


def _check_groups(groups) -> None:
    if not isinstance(groups, ParallelGroups):
        raise ValueError(f"groups must be a ParallelGroups from magnetar.parallel.init_groups(cp_size, tp_size=...),"
                         f" got {type(groups).__name__}")


class MPU:
    """Megatron-style ``mpu`` over one rank's :class:`ParallelGroups` (sizes and ranks come from the groups,
    not from collectives, so they are right on the world-size-1 path too).

    On the single-process layout (:func:`magnetar.parallel.local_groups`) the groups are None; handing None to
    a library that runs collectives would mean the WORLD group, so ``get_*_group`` refuses when a multi-rank
    world is initialised and the groups are local.
    """

    def __init__(self, groups: ParallelGroups):
        _check_groups(groups)
        self.groups = groups

    def _group(self, kind: str) -> Optional[dist.ProcessGroup]:
        group = getattr(self.groups, f"{kind}_group")
        if group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(f"these ParallelGroups are local to one process (local_groups): their {kind} group is "
                             f"None, which torch.distributed reads as the whole world of {dist.get_world_size()} "
                             f"ranks; build them with magnetar.parallel.init_groups(cp_size, tp_size=...)")
        return group

    # sequence parallel = context parallel
    def get_sequence_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self._group("cp")

    def get_sequence_parallel_world_size(self) -> int:
        return self.groups.cp_size

    def get_sequence_parallel_rank(self) -> int:
        return self.groups.cp_rank

    # tensor parallel
    def get_tensor_model_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self._group("tp")

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.groups.tp_size

    def get_tensor_model_parallel_rank(self) -> int:
        return self.groups.tp_rank

    # model parallel = tensor parallel (no pipeline stages), as DeepSpeed's mpu reads it
    def get_model_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self.get_tensor_model_parallel_group()

    def get_model_parallel_world_size(self) -> int:
        return self.get_tensor_model_parallel_world_size()

    def get_model_parallel_rank(self) -> int:
        return self.get_tensor_model_parallel_rank()

    # data parallel
    def get_data_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self._group("dp")

    def get_data_parallel_world_size(self) -> int:
        return self.groups.dp_size

    def get_data_parallel_rank(self) -> int:
        return self.groups.dp_rank


def device_mesh(groups: ParallelGroups, device_type: Optional[str] = None) -> DeviceMesh:
    """A 3-D :class:`DeviceMesh` with dims ``("dp", "cp", "tp")`` built from ``groups``' own process groups.

    ``mesh[d, c, t]`` is the global rank at dp/cp/tp index ``d, c, t`` (shape ``dp_size x cp_size x tp_size``);
    ``mesh["tp"]`` etc. give the 1-D sub-meshes whose ``get_group()`` are ``groups.tp_group`` and so on.
    ``device_type``: ``"cuda"`` when CUDA is available, else ``"cpu"`` (gloo), unless given. Every rank calls
    it (no collective is needed, but every rank needs its mesh). Needs groups from :func:`init_groups` under an
    initialised ``torch.distributed``.
    """
    _check_groups(groups)
    if groups.tp_group is None or groups.cp_group is None or groups.dp_group is None:
        raise ValueError("device_mesh needs the process groups of magnetar.parallel.init_groups(cp_size, tp_size=...) "
                         "under an initialised torch.distributed (launch with deepspeed or torchrun); these groups "
                         "are local to one process")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    grid = rank_grid(groups.world_size, groups.cp_size, groups.tp_size)
    return DeviceMesh.from_group([groups.dp_group, groups.cp_group, groups.tp_group], device_type,
                                 mesh=torch.tensor(grid.mesh, dtype=torch.int), mesh_dim_names=MESH_DIM_NAMES)
