"""Tensor parallelism for the engine: shard a model over the TP group with DeepSpeed AutoTP
(:func:`shard_tensor_parallel`), and load only this rank's shard straight from the checkpoint's safetensors
(:func:`load_shard`).

``from_pretrained`` followed by AutoTP would build the whole model on every rank -- in host memory, or on the GPU
when moved there before cutting -- and then cut it: the peak per rank is the full model (plus a converted copy
when the dtype changes) however large ``tp_size`` is. Here:

1. the model is built from its config with parameters on the ``meta`` device (``accelerate.init_empty_weights``,
   buffers real: RoPE's ``inv_freq`` is computed, not stored);
2. DeepSpeed AutoTP shards that empty model over the TP group (:func:`shard_tensor_parallel`);
   its inference engine then gives every parameter uninitialised storage of the sharded shape on the rank's
   device (``Module.to_empty``) -- and the buffers too, which are put back;
3. each parameter is read from the safetensors files as the slice this rank owns (``safe_open(...).get_slice``:
   only those bytes are read), cast to the engine's dtype and copied in.

The slice comes from the replaced layer itself: DeepSpeed's tensor-parallel layers keep ``_partition_sizes``
(the split of the sharded dimension over the TP ranks) and ``tp_index``; the sharded dimension is the one whose
local size differs from the checkpoint's. A parameter of an unreplaced module (embeddings, norms) is read
whole. An LM head tied to the embeddings (no ``lm_head.weight`` in the file) is read from the embedding.

DeepSpeed's own checkpoint loading is not used: it reads pickled ``.pt`` shards with ``weights_only=False``,
which Magnetar never does (docs/design.md, "untrusted files"). Only safetensors checkpoints load this way;
:func:`magnetar.engine.init_inference` loads others with ``from_pretrained`` (whole, then cut). At ``tp_size`` 1 it
uses ``from_pretrained`` too: on CPU a checkpoint already in the engine's dtype then stays a read-only mapping of
the file (page cache, shared by the ranks of a host) instead of a private copy per rank (docs/results.md,
"Per-rank loading").
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from magnetar.parallel import ParallelGroups
from magnetar.parallel.launcher import import_deepspeed
from magnetar.parallel.mpu import MPU

log = logging.getLogger(__name__)


def shard_tensor_parallel(model, groups: ParallelGroups, dtype: torch.dtype):
    """Split ``model``'s weights over ``groups.tp_group`` with DeepSpeed AutoTP; returns the sharded module.

    ``deepspeed.init_inference(tensor_parallel={"tp_size", "tp_group"}, replace_with_kernel_inject=False)``
    replaces, in place, q/k/v and gate/up projections by column-parallel layers (each rank its heads' / its
    slice of the intermediate units) and o/down by row-parallel layers followed by an all-reduce on the TP
    group, and splits the LM head's input features (its partial logits all-reduced, so every rank has all of
    them). Embeddings and norms stay whole on every rank. The attention function then sees this rank's
    heads only. Every rank of the world calls it (DeepSpeed broadcasts its RNG state over the world here).
    The model is changed in place (pass a copy to keep it whole); a model already sharded for this TP group is
    returned as it is, so several engines can share it.
    """
    done = getattr(model, "_magnetar_tp", None)
    if done is not None:  # a model already sharded for this TP group (several engines over one model) is kept
        if done != groups.tp_ranks:
            raise ValueError(f"the model is already sharded over TP ranks {list(done)}, not this engine's TP group "
                             f"{list(groups.tp_ranks)}: pass an unsharded model (a copy of it)")
        return model
    deepspeed = import_deepspeed()
    if not deepspeed.comm.is_initialized():  # torch.distributed started without DeepSpeed: let it wrap that group
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False)
    # Both the mpu and tp_group: without an mpu, DeepSpeed 0.19.8 makes its own group of global ranks
    # [0, tp_size) (wrong for every other TP group, and cached on the class for later engines); with the mpu
    # alone, its layer replacement reads tensor_parallel.tp_group, left None, and shards nothing.
    tp = {"tp_size": groups.tp_size, "tp_group": groups.tp_group, "mpu": MPU(groups)}
    with contextlib.redirect_stdout(io.StringIO()) as said:  # DeepSpeed prints its AutoTP plan on stdout
        engine = deepspeed.init_inference(model, tensor_parallel=tp, dtype=dtype, replace_with_kernel_inject=False)
    log.info("tp rank %d/%d: %s", groups.tp_rank, groups.tp_size, said.getvalue().strip())
    engine.module._magnetar_tp = groups.tp_ranks
    return engine.module


def weight_bytes(model) -> int:
    """Bytes of the parameters and buffers this process holds for ``model`` (its shard under TP)."""
    tensors = [*model.parameters(), *model.buffers()]
    seen, total = set(), 0
    for t in tensors:  # tied weights (embedding = LM head) count once
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total



def checkpoint_index(folder: Path) -> Optional[dict[str, Path]]:
    """``{tensor name: safetensors file}`` of a Hugging Face model folder (single file or sharded index), or None
    when it has no safetensors weights."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index (a JSON object with a 'weight_map'): {e}") from None
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        return None
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def _owner_slice(module, local: torch.Size, full: list[int]) -> tuple[slice, ...]:
    """The index of this rank's part of a checkpoint tensor of shape ``full`` for a parameter of shape ``local``."""
    if list(local) == list(full):
        return tuple(slice(None) for _ in full)
    differ = [d for d, (a, b) in enumerate(zip(local, full)) if a != b]
    sizes, index = getattr(module, "_partition_sizes", None), getattr(module, "tp_index", None)
    if len(local) != len(full) or len(differ) != 1 or sizes is None or index is None:
        raise ValueError(f"{type(module).__name__}: cannot tell this rank's slice of a {full} checkpoint tensor for "
                         f"a {list(local)} parameter")
    dim = differ[0]
    start = sum(sizes[:index])
    if local[dim] != sizes[index] or sum(sizes) != full[dim]:
        raise ValueError(f"{type(module).__name__}: partition {list(sizes)} (rank {index}) does not cut a {full} "
                         f"tensor into a {list(local)} parameter")
    return tuple(slice(start, start + local[dim]) if d == dim else slice(None) for d in range(len(full)))


def load_shard(folder: Path, dtype: torch.dtype, groups: ParallelGroups):
    """``(model, tokenizer)``: the model of the local Hugging Face folder ``folder`` in ``dtype`` holding only this
    rank's TP shard of every layer (``groups.tp_size > 1``), on the device DeepSpeed's accelerator names, built
    from its safetensors (see the module docstring); no whole copy is ever built, in host or device memory."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    folder = Path(folder)
    files = checkpoint_index(folder)
    if files is None:
        raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json (per-rank loading "
                                f"reads safetensors; save the model with "
                                f"save_pretrained(..., safe_serialization=True))")
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model = shard_tensor_parallel(model, groups, dtype)  # DeepSpeed gives the shards empty storage on the device
    device = next(model.parameters()).device
    for name, b in buffers.items():  # to_empty gave the buffers fresh storage too: put the computed ones back
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = b.to(device)
    tied = {}
    if getattr(config, "tie_word_embeddings", False):
        out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
        names = {id(m): n for n, m in model.named_modules()}
        tied[f"{names[id(out_emb)]}.weight"] = f"{names[id(in_emb)]}.weight"
    with torch.no_grad():
        for mod_name, module in model.named_modules():
            for leaf, param in module.named_parameters(recurse=False):
                name = f"{mod_name}.{leaf}" if mod_name else leaf
                key = name if name in files else tied.get(name)
                if key not in files:
                    raise ValueError(f"{folder}: the checkpoint has no tensor {name!r} for the model's parameter "
                                     f"(files: {sorted({p.name for p in files.values()})})")
                # one mapping per tensor: the file pages a slice touches (all of them for a column cut) leave the
                # process's resident memory with it, instead of piling up to the whole file
                with safe_open(files[key], framework="pt") as f:
                    part = f.get_slice(key)
                    param.copy_(part[_owner_slice(module, param.shape, part.get_shape())].to(dtype))
    log.info("tp rank %d/%d: loaded its shard of %s in %.1f s", groups.tp_rank, groups.tp_size, folder,
             time.perf_counter() - t0)
    return model, tokenizer
