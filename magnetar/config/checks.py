"""The config's generic checks: every field's type before its range (nothing is converted), choices with the nearest
valid name, cheap descriptions of hostile values, and errors that name the field as ``section.field (--flag)``.

:data:`FLAT_FIELDS` (field -> section) is filled by :mod:`magnetar.config.tree` once the sections exist (this module
is imported by them, so it cannot import them)."""
from __future__ import annotations

import difflib
import math
import numbers
from dataclasses import fields
from functools import cache
from typing import Any, Optional, Sequence, get_args, get_type_hints

FLAT_FIELDS: dict[str, str] = {}  # field name -> its section; filled by magnetar.config.tree


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def _where(name: str) -> str:
    """``pulsar.scorer (--scorer)`` for a field, ``method (--method)``, or the bare name of a section."""
    if name in FLAT_FIELDS:
        return f"{FLAT_FIELDS[name]}.{name} ({flag_of(name)})"
    return f"{name} ({flag_of(name)})" if name == "method" else name


class FieldError(ValueError):
    """A bad value of one named field: the config's (``block_size``), an engine argument's (``context``,
    ``query``, ``max_new_tokens``, a sampling field) or a per-request option's (``options.method``). Callers map
    ``field`` to their own names (a CLI flag, the file a field came from, an OpenAI ``param``) without reading the
    message; it is a ValueError, so code that catches those keeps working."""

    def __init__(self, message: str, field: str, *, setting: Optional[str] = None):
        super().__init__(message)
        self.field = field
        self.setting = setting  # the config field whose value made ``field``'s fail (a block larger than the context)


def require(cond: bool, name: str, msg: str) -> None:
    if not cond:
        # EngineConfig.from_cli names the config file when the field came from it
        raise FieldError(f"{_where(name)}: {msg}", name)


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: a hostile value must not make a megabyte message (a huge int
    by its size, a container by its length, a string's start). The one describer of client and config values in
    error messages (the engine's and the server's too)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<a {value.bit_length()}-bit int>"  # repr of a huge int is slow, or refused past 4300 digits
    if isinstance(value, (list, tuple, dict, set)):  # never the repr of a whole value: a YAML alias bomb is huge
        return f"<{type(value).__name__} of {len(value)} items>"
    if isinstance(value, (str, bytes)) and len(value) > limit:
        value = value[:limit]
    text = repr(value)
    if len(text) <= limit:
        return text
    return text[: limit - 4] + "...'" if isinstance(value, str) else text[:limit] + "..."


def describe(value: Any) -> str:
    """A value's type and (short) value for an error message -- ``int 5``, ``str 'abc'``, ``list of 3 items``, a bare
    type name for other objects -- never the repr of a whole hostile value (:func:`short_repr` cuts it). The one
    describer of "got ..." in the config's, the engine's and the template's messages."""
    if isinstance(value, (list, tuple, dict, set)):
        return f"{type(value).__name__} of {len(value)} items"
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value).bit_length() > 128:
        return f"int of {int(value).bit_length()} bits"  # its repr is slow, or refused past 4300 digits
    if not isinstance(value, (bool, numbers.Number, str, bytes)):
        return type(value).__name__
    if isinstance(value, (str, bytes)) and len(value) > 80:
        return f"{type(value).__name__} of {len(value)} characters {short_repr(value[:50], 57)}..."
    return f"{type(value).__name__} {short_repr(value)}"


def suggest(word: Any, options) -> str:
    """``"; did you mean 'scorer'?"`` when ``word`` is close to one of ``options``, else ``""``."""
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, [str(o) for o in options], n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_choice(name: str, value: Any, options: Sequence, noun: str) -> None:
    """``value`` must be one of ``options``; the error lists them (and the nearest one)."""
    require(value in options, name, f"unknown {noun} {short_repr(value)}{suggest(value, options)} "
                                     f"(choose one of {', '.join(map(str, options))})")


def _type_problem(value: Any, want: type) -> Optional[str]:
    """Why ``value`` cannot be a ``want`` (bool, int, float, str or a config section), or None if it can.
    Nothing is converted: a bool is not a number, 2.5 is not the int 2, the text "4" is not the number 4."""
    if want is bool:
        ok = isinstance(value, bool)
        expected = "true or false"
    elif want is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        expected = "an int"
    elif want is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        try:
            finite = ok and math.isfinite(value)
        except OverflowError:  # an int too large for a float
            finite = False
        if ok and not finite:
            return f"expected a finite number, got {short_repr(value)}"
        expected = "a number"
    elif want is str:
        ok, expected = isinstance(value, str), "a string"
    else:  # a config section
        if isinstance(value, want):
            return None
        return (f"expected a {want.__name__}, got {type(value).__name__}; build the config from a mapping with "
                f"EngineConfig.from_dict / EngineConfig.create, or pass {want.__name__}(...)")
    if ok:
        return None
    msg = f"expected {expected}, got {type(value).__name__} {short_repr(value)}"
    if want in (int, float) and isinstance(value, bool):
        return msg + " (a bool is not a number)"
    if want is int and isinstance(value, numbers.Real):
        return msg + " (write a whole number; nothing is rounded)"
    if want is not str and isinstance(value, str) and value.strip():
        return msg + " (a value in quotes is text: write it without quotes)"
    return msg


@cache
def _field_types(cls: type) -> dict[str, tuple[type, bool]]:
    """``{field: (type, None allowed)}`` of a config dataclass, from its annotations."""
    out = {}
    for name, hint in get_type_hints(cls).items():
        args = [a for a in get_args(hint) if a is not type(None)]
        out[name] = (args[0], True) if args else (hint, False)
    return out


def check_types(obj: Any) -> None:
    """Every field of the config dataclass ``obj`` has its annotated type (ValueError naming the field and
    flag); numpy-style scalars become plain ``int`` / ``float`` so that the config serialises as given."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        want, optional = _field_types(type(obj))[f.name]
        if value is None and optional:
            continue
        problem = _type_problem(value, want)
        if problem is None and want is int and not -_MAX_INT <= value < _MAX_INT:
            problem = f"must fit in 64 bits, got {short_repr(value)}"
        require(problem is None, f.name, problem or "")
        if want in (int, float) and type(value) not in (int, float):
            object.__setattr__(obj, f.name, int(value) if want is int else float(value))


_MAX_INT = 2**63  # every int field ends up in a torch int64 or a C long (seeds: torch.Generator.manual_seed)
MAX_TIMEOUT_S = 1e9  # about 31 years: a timedelta and every process group backend still hold it
MIN_TIMEOUT_S = 1e-3  # seconds: a process-group timeout rounds to whole milliseconds
# Stop strings are looked for in the decoded tail of the answer after every token (engine.sampling.StopStrings):
# the longest one sets how much is decoded. The server allows fewer (--max-stop-strings, OpenAI's 4 by default).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 512


def check_seed(name: str, value: int) -> None:
    require(value >= 0, name, f"must be an int >= 0, got {value}")


def check_path(name: str, value: Optional[str]) -> None:
    require(value is None or bool(value.strip()), name, "must be a file path (or unset), got an empty string")
