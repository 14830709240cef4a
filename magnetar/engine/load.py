"""Loading: ``init_inference(model, config) -> Engine`` -- a loaded model, a registry name, a local folder or a Hub
id; the dtype; the process groups; tensor parallelism (DeepSpeed AutoTP, each rank reading only its shard)."""
from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from magnetar.config import EngineConfig
from magnetar.engine import hf, inputs
from magnetar.engine.engine import Engine
from magnetar.engine.tensor_parallel import checkpoint_index, load_shard, shard_tensor_parallel
from magnetar.models import load_model, model_dtype, model_kind, model_path, prepare_model
from magnetar.parallel import ParallelGroups, init_groups, local_groups
from magnetar.parallel.collectives import barrier
from magnetar.parallel.launcher import DEFAULT_TIMEOUT, device_for_rank, init_distributed
from magnetar.parallel.shm import enable as enable_shm_gather

log = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_weights(name, dtype: str = "auto", *, revision: Optional[str] = None, trust_remote_code: bool = False,
                 cache_dir=None, timeout: timedelta = DEFAULT_TIMEOUT):
    """``(model, tokenizer)`` of a model given by name -- the one loader of ``init_inference``, ``magnetar eval``
    and ``magnetar bench``: a ``magnetar.models`` registry name (converted once: under a launcher the first rank
    converts while the others wait, up to ``timeout``), a local folder or a Hub id (:func:`magnetar.models.load_model`;
    ``revision``, ``trust_remote_code``, ``cache_dir`` go there), or ``dummy:<preset or config>`` (random weights,
    made on this rank's device at once: an 8B model never passes through the CPU). ``dtype``: a
    ``runtime.dtype`` name (``auto``: the checkpoint's, but float16 on a CPU runs as bfloat16:
    :func:`cpu_half`). Every rank calls it."""
    device = "cpu"
    kind = model_kind(name)
    if kind == "dummy":
        init_distributed(timeout=timeout)  # sets this rank's GPU
        device = device_for_rank()
    elif kind == "registry":
        init_distributed(timeout=timeout)
        if not dist.is_initialized() or dist.get_rank() == 0:
            prepare_model(os.fsdecode(name), cache_dir)
        barrier(timeout=timeout)  # a no-op without a process group
    model, tokenizer = load_model(name, dtype=_TORCH_DTYPES.get(dtype, "auto"), revision=revision,
                                  trust_remote_code=trust_remote_code, cache_dir=cache_dir, device=device)
    if dtype not in _TORCH_DTYPES:  # auto
        half = cpu_half(model_dtype(model), torch.device(device), name)
        if half != model_dtype(model):
            model = model.to(half)
    return model, tokenizer


def cpu_half(dtype: torch.dtype, device: torch.device, name) -> torch.dtype:
    """``runtime.dtype: auto``'s dtype for a checkpoint stored in ``dtype`` loaded onto ``device``: its own, but a
    float16 checkpoint on a CPU runs as bfloat16 (logged), as vLLM's CPU build does -- torch's CPU kernels run
    float16 products ~10x slower than bfloat16 (a 512-row Phase-1 product on an AVX-512 EPYC: 47 ms against 4.9) and
    Magnetar's CPU ops take float32 and bfloat16 only. ``--dtype float16`` keeps float16; ``--dtype float32`` runs
    it exactly."""
    if device.type != "cpu" or dtype != torch.float16:
        return dtype
    log.warning("%s is a float16 checkpoint: on a CPU it runs as bfloat16 (runtime.dtype auto; torch's CPU float16 "
                "products are ~10x slower); pass --dtype float16 to keep it, --dtype float32 to run it exactly",
                os.fsdecode(name))
    return torch.bfloat16


def init_inference(model, config: Optional[EngineConfig] = None, *, tokenizer=None,
                   groups: Optional[ParallelGroups] = None, revision: Optional[str] = None,
                   trust_remote_code: bool = False, cache_dir=None, **flat) -> Engine:
    """Prepare ``model`` (a loaded HF causal LM, a ``magnetar.models`` name, a local directory or a Hugging Face
    Hub id ``org/name``, told apart in that order: :func:`magnetar.models.load_model`) for Magnetar.

    ``config`` (or flat fields, e.g. ``method="star", cp_size=4``) picks the method. Under a launcher the
    process group is started here if needed; the TP/CP/DP groups come from :func:`magnetar.parallel.init_groups`.
    With ``tp_size > 1`` the model is sharded over its TP group by DeepSpeed AutoTP
    (:func:`shard_tensor_parallel`; ``runtime.deepspeed_inference`` must be on) and ``tp_size`` must divide
    its KV heads. At ``tp_size`` 1 DeepSpeed is not called: with kernel injection off it has nothing to do
    (docs/engine.md, "What DeepSpeed does in Magnetar"). ``tokenizer`` (needed for string prompts; loaded with a
    model given by name or directory) is a Hugging Face tokenizer, or any object whose ``__call__(text,
    add_special_tokens=False, split_special_tokens=True)`` returns ``{"input_ids": [...]}`` and that has
    ``decode`` (user text is tokenized with ``split_special_tokens``: it never yields a control token).
    A model given by name is loaded in ``config.runtime.dtype``; ``revision``, ``trust_remote_code`` and
    ``cache_dir`` (the Hub cache of a Hub id, the prepared-model cache of a registry name) go to its loading; a
    missing Hub model raises ``magnetar.models.ModelNotFoundError`` saying how to get it (``HF_HUB_OFFLINE=1``:
    cache only). ``dtype="auto"`` keeps the checkpoint's dtype (float16 on a CPU runs as bfloat16:
    :func:`cpu_half`), or a given model's own: a given model is not cast.
    """
    inputs.check_init(model, config, tokenizer, groups, revision=revision, trust_remote_code=trust_remote_code,
                      cache_dir=cache_dir)
    given_tokenizer = tokenizer  # one given must fit the model's vocabulary (one loaded with the model does)
    if config is None:
        config = EngineConfig.create(**flat)
    elif flat:
        config = config.replace(**flat)
    tp = config.parallel.tp_size
    _check_tp_config(config, groups)  # before any model loading or process-group work
    dtype = _TORCH_DTYPES.get(config.runtime.dtype)  # None: "auto"
    folder = None  # under TP, a local folder with safetensors: each rank loads only its shard, below
    if inputs.is_model_path(model):
        name = os.fsdecode(model)
        if tp > 1 and model_kind(name) not in ("hub", "dummy") and not trust_remote_code:
            folder = model_path(name, cache_dir)
        if folder is not None and checkpoint_index(folder) is not None:
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(folder, local_files_only=True)
            dtype = dtype or _checkpoint_dtype(hf_config)
        else:  # from_pretrained: resolves (downloads) Hub ids, runs remote code, reads any format; whole (cut by TP)
            model, loaded_tok = load_weights(folder or name, config.runtime.dtype, revision=revision,
                                             trust_remote_code=trust_remote_code, cache_dir=cache_dir,
                                             timeout=_timedelta(config.parallel.timeout_s))
            tokenizer = tokenizer or loaded_tok
            folder = None
    if folder is None:
        hf_config = model.config
        dtype = dtype or model_dtype(model)
    hf.check_supported(hf_config)
    if given_tokenizer is not None:
        inputs.check_tokenizer_fits(given_tokenizer, hf_config)
    hf.check_tensor_parallel(hf_config, tp)
    if folder is None and tp == 1 and getattr(model, "_magnetar_tp", None) is not None:
        raise ValueError(f"the model was sharded by an engine with tp_size {len(model._magnetar_tp)}: give tp_size "
                         f"{len(model._magnetar_tp)}, or pass an unsharded model (a copy of it) for tp_size 1")
    init_distributed(timeout=_timedelta(config.parallel.timeout_s))
    if groups is None:  # simulated ranks live in this process: no group, no collective (even under a launcher)
        timeout = _timedelta(config.parallel.timeout_s)
        groups = local_groups(timeout=timeout) if config.parallel.simulate else \
            init_groups(config.parallel.cp_size, tp_size=tp, timeout=timeout)
    want = 1 if config.parallel.simulate else config.parallel.cp_size
    if groups.cp_size != want:
        raise ValueError(f"groups.cp_size ({groups.cp_size}) != {want} (config cp_size {config.parallel.cp_size}"
                         f"{', simulated in this process' if config.parallel.simulate else ''})")
    device = device_for_rank()
    if folder is not None:
        if config.runtime.dtype not in _TORCH_DTYPES:  # auto
            dtype = cpu_half(dtype, device, folder)
        model, loaded_tok = load_shard(folder, dtype, groups)
        tokenizer = tokenizer or loaded_tok
    else:
        own = model_dtype(model)
        if own != dtype and own in (torch.bfloat16, torch.float16) and dtype == torch.float32:
            # a half-precision model object made float32 doubles its memory (seen: an 8B bf16 model run in fp32)
            log.warning("the given model is %s; runtime.dtype %r casts it to float32 (twice the memory): pass "
                        "dtype='auto' to keep its own", str(own).replace("torch.", ""), config.runtime.dtype)
        model = model.to(device=device, dtype=dtype)
        if tp > 1:
            model = shard_tensor_parallel(model, groups, dtype)
    hf.prepare_model(model)
    if config.parallel.shm_gather:  # a collective of the CP group (every rank loads the engine)
        enable_shm_gather(groups.cp_group, groups.timeout)
    return Engine(model, config, groups, tokenizer)


def _checkpoint_dtype(hf_config) -> torch.dtype:
    """``dtype="auto"`` for a checkpoint folder: the dtype its config names (``dtype`` / ``torch_dtype``), else
    float32."""
    named = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(named, str):
        named = getattr(torch, named, None)
    return named if isinstance(named, torch.dtype) else torch.float32


def _check_tp_config(config: EngineConfig, groups: Optional[ParallelGroups]) -> None:
    tp = config.parallel.tp_size
    if groups is not None and groups.tp_size != tp:
        raise ValueError(f"groups.tp_size ({groups.tp_size}) != config tp_size ({tp}): build the groups with "
                         f"init_groups(cp_size, tp_size={tp}) or set tp_size={groups.tp_size}")
    if tp == 1:
        return
    if config.parallel.simulate:
        raise ValueError(f"tp_size {tp} needs one process per TP rank, but simulate runs the CP ranks in this one "
                         f"process: set simulate false (launch tp_size x cp_size ranks) or tp_size 1")
    if not config.runtime.deepspeed_inference:
        raise ValueError(f"tp_size {tp} shards the model with DeepSpeed AutoTP (deepspeed.init_inference): set "
                         f"runtime.deepspeed_inference true (--deepspeed-inference) or tp_size 1")


def _timedelta(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)
