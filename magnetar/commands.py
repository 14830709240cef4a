"""``magnetar COMMAND [ARGS]``: the one command of every tool. The ``magnetar-*`` console scripts are aliases of its
subcommands, kept for launchers that need a script path (``deepspeed "$(which magnetar-run)" ...``).

    magnetar run ...         alias magnetar-run        (magnetar.launch.run)
    magnetar serve ...       = python -m magnetar.serve
    magnetar eval ...        alias magnetar-eval       (magnetar.eval.runner)
    magnetar bench ...       alias magnetar-bench      (magnetar.eval.bench)
    magnetar calibrate ...   alias magnetar-calibrate  (magnetar.calibrate.cli)
    magnetar store DIR       what a context store holds (magnetar.launch.store)
    magnetar demo ...        alias magnetar-demo       (magnetar.launch.niah_demo)
    magnetar ops-demo ...    alias magnetar-ops-demo   (magnetar.launch.demo)

The subcommand's module is imported only when it is run (the server's dependencies are not needed to evaluate).
Under a launcher: ``torchrun --nproc-per-node 4 -m magnetar.commands serve ...``; ``python -m magnetar ...`` is the
same command. ``magnetar --version`` names Magnetar's version and the installed torch, transformers and DeepSpeed
(what a bug report needs; read from the installed packages' metadata: nothing is imported).
"""
from __future__ import annotations

import importlib
import sys

from magnetar.utils.cli import fail

# subcommand -> (module with main(argv), what it does)
COMMANDS = {
    "run": ("magnetar.launch.run", "answer one question about a long context"),
    "serve": ("magnetar.serve.cli", "an OpenAI-compatible server"),
    "eval": ("magnetar.eval.runner", "RULER / BABILong / NIAH / perplexity / fidelity suites"),
    "bench": ("magnetar.eval.bench", "speed and memory per method and length"),
    "calibrate": ("magnetar.calibrate.cli", "train Spotlight hashes or the sparse-prefill indexer"),
    "store": ("magnetar.launch.store", "what a context store folder holds (--context-store DIR)"),
    "demo": ("magnetar.launch.niah_demo", "the needle demo of make demo"),
    "ops-demo": ("magnetar.launch.demo", "the attention and merge ops on this machine"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return "usage: magnetar COMMAND [ARGS]  |  magnetar --version\n\ncommands:\n" + "\n".join(lines) + \
        "\n\n`magnetar COMMAND --help` shows a command's flags."


def version() -> str:
    """``magnetar X (Python Y; torch Z, transformers W, deepspeed V)``: the installed distributions' versions (not
    installed: said so), read without importing them."""
    from importlib import metadata

    from magnetar.version import __version__

    def installed(name: str) -> str:
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            return f"{name} not installed"

    deps = ", ".join(installed(n) for n in ("torch", "transformers", "deepspeed"))
    return f"magnetar {__version__} (Python {sys.version.split()[0]}; {deps})"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(version())
        return 0
    if argv[0] not in COMMANDS:
        fail("magnetar", f"unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)} (see magnetar --help)")
    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
