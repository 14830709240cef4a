"""Command-line flags of the config: one ``--flag`` per field plus ``--config FILE``
(:meth:`magnetar.config.EngineConfig.from_cli` reads them back)."""
from __future__ import annotations

import argparse
from dataclasses import fields

from magnetar.config.checks import flag_of
from magnetar.config.registry import METHODS, field_choices
from magnetar.config.tree import FLAT_FIELDS, SECTIONS


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """One flag per config field (``--cp-size``, ``--summary-budget``, ...) plus ``--config FILE``."""
    g = parser.add_argument_group("engine config (defaults in magnetar/config/sections.py)")
    g.add_argument("--config", help="JSON/YAML file with config fields (flags override it)")
    g.add_argument("--method", choices=tuple(METHODS))
    add_field_args(g, FLAT_FIELDS)
    return parser


def add_field_args(parser, names) -> None:
    """A flag for each config field of ``names`` (default None: the field keeps the config's default), its type and
    choices read from the field; a bool flag alone means true (``--prefill-indexer-random-init``), or takes
    ``true`` / ``false``. ``magnetar bench`` declares the engine fields it times this way."""
    for name in names:
        f = next(f for f in fields(SECTIONS[FLAT_FIELDS[name]]) if f.name == name)
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if "bool" in kind:
            parser.add_argument(flag_of(name), type=_parse_bool, nargs="?", const=True, metavar="{true,false}")
        elif "int" in kind:
            parser.add_argument(flag_of(name), type=int)
        elif "float" in kind:
            parser.add_argument(flag_of(name), type=float)
        else:
            parser.add_argument(flag_of(name), choices=field_choices(name))


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
