"""Command-line flags of the config: one ``--flag`` per field plus ``--config FILE``
(:meth:`magnetar.config.EngineConfig.from_cli` reads them back)."""
from __future__ import annotations

import argparse
import functools
import inspect
import io
import tokenize
from dataclasses import MISSING, fields

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
        section = SECTIONS[FLAT_FIELDS[name]]
        f = next(f for f in fields(section) if f.name == name)
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        text = field_help(section).get(name, "")
        default = "" if f.default is MISSING or f.default is None else f"default: {f.default!r}"
        help_text = (f"{text} ({default})" if text and default else text or default).replace("%", "%%")
        if "bool" in kind:
            parser.add_argument(flag_of(name), type=_parse_bool, nargs="?", const=True, metavar="{true,false}",
                                help=help_text)
        elif "int" in kind:
            parser.add_argument(flag_of(name), type=int, help=help_text)
        elif "float" in kind:
            parser.add_argument(flag_of(name), type=float, help=help_text)
        else:
            parser.add_argument(flag_of(name), choices=field_choices(name), help=help_text)


@functools.lru_cache(maxsize=None)
def field_help(section: type) -> dict[str, str]:
    """Each field of the config ``section`` -> the comment that documents it in magnetar/config/sections.py: the
    comment lines just above it and the one after it on its line, joined (the flags' help says what the code's
    reader reads; {} when the source cannot be read, e.g. a frozen build)."""
    try:
        source = inspect.getsource(section)
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    code_rows: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_rows.add(tok.start[0])
    lines = source.splitlines()
    names = {f.name for f in fields(section)}
    out = {}
    for row, line in enumerate(lines, start=1):
        stripped = line.strip()
        name = stripped.split(":", 1)[0].strip()
        if not line.startswith("    ") or line.startswith("     ") or name not in names or ":" not in stripped:
            continue
        above, r = [], row - 1
        while r in comments and r not in code_rows:  # a comment block of its own lines, right above the field
            above.insert(0, comments[r])
            r -= 1
        parts = above + ([comments[row]] if row in comments else [])
        if parts:
            out[name] = " ".join(parts)
    return out


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
