"""The one build step pyproject.toml cannot state: prebuilding Magnetar's fused ops at install time.

Metadata, dependencies, extras and console scripts live in pyproject.toml. A plain ``pip install .`` (or ``-e .``)
builds no C++: the ops are JIT-compiled on first use. With ``DS_BUILD_MAGNETAR_OPS=1`` (every op compatible with
this machine) or ``DS_BUILD_MAGNETAR_<OP>=1`` (one op; ``=0`` leaves one out) the ops' DeepSpeed builders are
compiled here, as DeepSpeed's ``DS_BUILD_OPS=1`` does for its own ops::

    DS_BUILD_MAGNETAR_OPS=1 pip install --no-build-isolation .

Prebuilding compiles against the installed torch and imports DeepSpeed's builders, so both must already be
installed and pip must not isolate the build (``--no-build-isolation``). torch is deliberately *not* an install
requirement (pyproject.toml says why). The built modules and ``magnetar/ops/prebuilt_ops.json`` (what was built,
against which torch, from which sources) are installed with the package; ``python -m magnetar.ops`` reports them.
"""
import importlib.util
import json
import os
import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
OP_BUILDER = HERE / "magnetar" / "ops" / "op_builder.py"


def _requested() -> bool:
    return any(k.startswith("DS_BUILD_MAGNETAR_") and v != "0" for k, v in os.environ.items())


def _load_op_builder():
    """magnetar/ops/op_builder.py alone (it imports only torch and DeepSpeed), not the magnetar package."""
    try:
        import deepspeed  # noqa: F401
        import torch  # noqa: F401
    except ImportError as err:
        sys.exit(f"magnetar setup.py: prebuilding ops (DS_BUILD_MAGNETAR_*) compiles against the installed torch and "
                 f"uses DeepSpeed's op builders, but {err.name} is not importable here ({err}). Install torch and "
                 f"deepspeed first and run pip with --no-build-isolation, or unset DS_BUILD_MAGNETAR_*.")
    spec = importlib.util.spec_from_file_location("_magnetar_op_builder", OP_BUILDER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def _prebuild():
    """``(ext_modules, cmdclass)`` of the requested ops; nothing (and no torch import) when none is."""
    if not _requested():
        return [], {}
    ops = _load_op_builder()
    ops.STAGE_SOURCES = False  # the package's own sources: setuptools builds them relative to this folder
    try:
        plan = ops.prebuild_plan(os.environ)
    except ValueError as err:
        sys.exit(f"magnetar setup.py: {err}")
    builders = []
    for builder, skipped in plan:
        if skipped:
            print(f"magnetar setup.py: not prebuilding {builder.NAME} (it stays JIT-built): {skipped}; "
                  f"{builder.BUILD_VAR}=0 silences this", file=sys.stderr)
        else:
            builders.append(builder)
    if not builders:
        return [], {}

    from torch.utils.cpp_extension import BuildExtension

    class BuildOps(BuildExtension):
        """torch's BuildExtension, then the record of what it built, next to the built modules (the package
        folder in build/ for a wheel, the source folder for ``pip install -e``)."""

        def run(self):
            super().run()
            path = Path(self.get_ext_fullpath(builders[0].absolute_name())).parent / ops.PREBUILT_RECORD.name
            path.write_text(json.dumps(ops.prebuilt_record(builders), indent=1) + "\n", encoding="utf-8")

        def get_outputs(self):
            path = Path(self.get_ext_fullpath(builders[0].absolute_name())).parent / ops.PREBUILT_RECORD.name
            return super().get_outputs() + [str(path)]

    print(f"magnetar setup.py: prebuilding {', '.join(b.NAME for b in builders)}", file=sys.stderr)
    extensions = [b.builder() for b in builders]
    for ext in extensions:  # the builders' sources are absolute (JIT needs that); setuptools wants them relative
        ext.sources = [Path(s).relative_to(HERE).as_posix() for s in ext.sources]
    return extensions, {"build_ext": BuildOps}


ext_modules, cmdclass = _prebuild()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
