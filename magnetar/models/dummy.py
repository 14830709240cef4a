"""Dummy weights, as vLLM's ``--load-format dummy``: a model built from its configuration alone, random weights in the
requested dtype, nothing downloaded. Speeds measured on it are real speeds (the shapes are the model's); its outputs
are noise. Users benchmark a model before they fetch it, and the GPU kit times Llama-3.1-8B-sized work offline.

A model argument ``dummy:<what>`` (``--model``, ``init_inference``, ``load_model``) names the shape:

* ``dummy:<preset>`` -- one of :data:`PRESETS` (``dummy:llama-3.1-8b``, ``dummy:qwen2.5-7b`` ...), the published
  configurations' shapes (hidden size, layers, heads, vocabulary, positions, RoPE);
* ``dummy:<path>`` -- a ``config.json`` file, or a folder holding one (a Hugging Face model folder without its
  weights). A folder that also holds tokenizer files gives the tokenizer; presets have none (token ids only).

The model is built on the device it will run on (``load_model(device=...)``) in the requested dtype and initialised
there with the architecture's own ``_init_weights`` (normal, ``initializer_range``), so an 8B model on a GPU takes
seconds, not the minutes a CPU init and copy would. Nothing here reaches the network.

Before anything is allocated the config is checked as a real model's is: its file read through the bounded reader
(at most :data:`MAX_CONFIG_BYTES`, a regular file, nesting and integers bounded), its shapes through
:class:`~magnetar.models.dims.ModelDims` (every size a positive int, heads dividing evenly), and its weights' bytes
against the memory the device has free (:func:`check_dummy`) -- one ``ValueError`` naming the file and the field.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch

from magnetar.models.check import has_tokenizer_files
from magnetar.models.dims import ModelDims
from magnetar.utils.cli import read_bounded

PREFIX = "dummy:"
MAX_CONFIG_BYTES = 2**20  # a config.json is a few KB
_MAX_INT_DIGITS = 100  # an integer of a config is far shorter; Python refuses to read ints past 4300 digits

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

# The published config.json fields that decide the shapes (and RoPE); everything else is transformers' default.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
                         rms_norm_eps=1e-5, tie_word_embeddings=False),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling=dict(_LLAMA3_ROPE, factor=32.0), rms_norm_eps=1e-5, tie_word_embeddings=True),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, use_sliding_window=False),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False),
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32768,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5, sliding_window=None,
                       tie_word_embeddings=False),
    # a few MB: tests and the GPU kit's dry run
    "tiny-llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                       max_position_embeddings=65536, rope_theta=10000.0, tie_word_embeddings=False),
}


def is_dummy(name: object) -> bool:
    """True for a model argument ``dummy:<preset or path>``."""
    return isinstance(name, (str, os.PathLike)) and os.fsdecode(name).startswith(PREFIX)


def _what(name: str | os.PathLike) -> str:
    what = os.fsdecode(name)[len(PREFIX):]
    if not what:
        raise ValueError(f"model 'dummy:' names no shape: write dummy:<preset> ({', '.join(PRESETS)}) or "
                         f"dummy:<config.json or a folder holding one>")
    return what


def _source(name: str | os.PathLike) -> tuple[Optional[Path], dict[str, Any]]:
    """``(folder or None, config fields)`` of a ``dummy:`` argument; ``FileNotFoundError`` / ``ValueError`` naming
    what to change."""
    what = _what(name)
    if what.lower() in PRESETS:
        return None, dict(PRESETS[what.lower()])
    path = Path(what).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model {os.fsdecode(name)!r}: {what!r} is neither a dummy preset "
                                f"({', '.join(PRESETS)}) nor an existing config.json or model folder")
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"model {os.fsdecode(name)!r}: the folder {path} holds no config.json; give a "
                                f"config.json file or a folder with one (dummy weights need only the config)")
    fields = _read_config(file, os.fsdecode(name))
    if not isinstance(fields, dict) or not isinstance(fields.get("model_type"), str):
        raise ValueError(f"model {os.fsdecode(name)!r}: {file} has no \"model_type\" (e.g. \"llama\"); a Hugging "
                         f"Face config.json names its architecture there")
    return (path if path.is_dir() else None), fields


def _read_config(file: Path, name: str) -> Any:
    """The JSON of a dummy model's ``file``, read bounded (:func:`~magnetar.utils.cli.read_bounded`): ValueError naming
    the model and the file for one too large, not regular, not JSON, too deeply nested or with a huge integer."""
    data = read_bounded(str(file), flag=f"--model {name}:", max_bytes=MAX_CONFIG_BYTES, what="config.json")

    def bounded_int(text: str) -> int:
        if len(text.lstrip("+-")) > _MAX_INT_DIGITS:
            raise ValueError(f"an integer of {len(text)} digits")
        return int(text)

    try:
        return json.loads(data.decode("utf-8-sig"), parse_int=bounded_int)
    except RecursionError:
        raise ValueError(f"model {name!r}: {file} is nested too deeply to be a model config") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"model {name!r}: {file} is not a readable JSON config ({str(e)[:200]})") from None


def has_tokenizer(name: str | os.PathLike) -> bool:
    """Whether ``dummy:<what>`` brings a tokenizer: a folder holding a tokenizer's files (presets have none)."""
    return has_tokenizer_files(_source(name)[0])


def check_text_model(name: str | os.PathLike, flag: str = "--model", tokenizer: Optional[str] = None) -> None:
    """``ValueError`` naming ``flag`` when ``name`` is a dummy model without a tokenizer (none of its own and no
    ``tokenizer`` given: ``--tokenizer``): commands that take text (magnetar-run, magnetar serve, magnetar-eval)
    need one; magnetar-bench times token ids and needs none."""
    if is_dummy(name) and tokenizer is None and not has_tokenizer(name):
        raise ValueError(f"{flag} {os.fsdecode(name)}: dummy weights without a tokenizer (a preset, or a config.json "
                         f"alone) cannot read text: give one with --tokenizer NAME|FOLDER (e.g. --tokenizer "
                         f"smollm2-135m-instruct), or dummy:<a folder holding config.json and the tokenizer's "
                         f"files>, or time it on token ids with magnetar-bench")


def dummy_config(name: str | os.PathLike):
    """The transformers config of a ``dummy:`` argument (no weights are made)."""
    from transformers import AutoConfig

    _, fields = _source(name)
    fields = dict(fields)
    model_type = fields.pop("model_type")
    for key in ("architectures", "transformers_version", "torch_dtype", "dtype", "auto_map", "quantization_config"):
        fields.pop(key, None)
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # noqa: BLE001 -- ValueError, TypeError, huggingface_hub's strict-dataclass errors ...
        raise ValueError(f"model {os.fsdecode(name)!r}: {_where(name)}: transformers cannot build a {model_type!r} "
                         f"config from it ({' '.join(str(e).split())})") from None


def check_dummy(name: str | os.PathLike, config, dtype: Optional[torch.dtype] = None,
                device: Optional[torch.device] = None) -> ModelDims:
    """The shapes of ``config`` (the dummy model ``name``'s) checked as a real model's (:class:`ModelDims`), and, given
    ``dtype`` and ``device``, its weights' bytes in ``dtype`` against the memory ``device`` has free -- before
    anything is allocated; a ValueError naming the model, its file and the field to change otherwise."""
    where = _where(name)
    try:
        dims = ModelDims.from_config(config)
    except ValueError as e:
        raise ValueError(f"model {os.fsdecode(name)!r}: {where}: {e}") from None
    if dtype is None or device is None:
        return dims
    size = torch.empty((), dtype=dtype).element_size()
    need, have = dims.params * size, free_memory(device)
    if need > have:  # name the field that holds most of them: the vocabulary's embeddings, else the layers
        embeddings = dims.vocab * dims.hidden * (1 if dims.tied_embeddings else 2)
        field, value = (("vocab_size", dims.vocab) if embeddings > dims.params - embeddings else
                        ("num_hidden_layers", dims.layers) if dims.layers > 1 else ("hidden_size", dims.hidden))
        raise ValueError(f"model {os.fsdecode(name)!r}: {where}: its shapes make {dims.params / 1e9:.3g}B parameters, "
                         f"{need / 2**30:.3g} GiB in {str(dtype).replace('torch.', '')}, more than the "
                         f"{have / 2**30:.3g} GiB free on {device}; lower {field} ({value}) "
                         f"or pick a smaller preset ({', '.join(PRESETS)})")
    return dims


def free_memory(device: torch.device) -> int:
    """The bytes ``device`` has free: a GPU's free memory, else the host's available memory (psutil)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available)


def _where(name: str | os.PathLike) -> str:
    """Where a ``dummy:`` argument's config comes from: ``preset 'x'``, or its config.json file."""
    what = _what(name)
    if what.lower() in PRESETS:
        return f"preset {what!r}"
    path = Path(what).expanduser()
    return str(path / "config.json" if path.is_dir() else path)


def check_dtype_on(dtype: torch.dtype, device: torch.device) -> None:
    """``ValueError`` for a dtype the device cannot compute in (bf16 on a GPU before Ampere)."""
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(f"dtype bfloat16 is not supported by {torch.cuda.get_device_name(device)}: use float16 or "
                         f"float32 (--dtype)")


def build_dummy(name: str | os.PathLike, *, dtype: torch.dtype, device: str | torch.device = "cpu", seed: int = 0):
    """``(model, tokenizer or None)``: the architecture of ``name`` (``dummy:...``) with random weights in ``dtype``,
    made on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    check_dtype_on(dtype, device)
    folder, _ = _source(name)
    config = dummy_config(name)
    check_dummy(name, config, dtype, device)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None  # random weights: decode always runs its max_new_tokens
    model.config.name_or_path = os.fsdecode(name)
    tokenizer = None
    if has_tokenizer_files(folder):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model, tokenizer
