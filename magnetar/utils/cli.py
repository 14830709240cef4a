"""The command lines' one convention for bad input, and the checks they share.

A bad flag, file or value found before any compute ends the command the way argparse ends it: one line
``PROG: error: MESSAGE`` on stderr (the message names the flag or file and what to change) and exit status 2
-- never a traceback. Internal failures during compute keep their traceback. Every CLI builds its parser with
:class:`ArgumentParser` (argparse's own errors then print the same one line plus a pointer to ``--help``
instead of the whole usage) and runs its input checks inside :func:`user_errors`.

This module knows nothing of magnetar's configs, models or engine; the callers pass what to check.
"""
from __future__ import annotations

import argparse
import codecs
import contextlib
import json
import os
import stat
import sys
from pathlib import Path
from typing import Iterator, NoReturn, Sequence

__all__ = ["ArgumentParser", "UsageError", "fail", "user_errors", "USER_ERRORS", "read_text_file", "read_bounded",
           "check_output_file", "check_input_file", "int_at_least", "write_json_line"]

# What a CLI reports as the user's error (the message already names the field, flag or file): bad values,
# files that are missing, directories or unreadable. Anything else is an internal failure with its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, IsADirectoryError,
                                                NotADirectoryError, PermissionError)


class UsageError(SystemExit):
    """A bad flag, file or value: ``str()`` is the ``PROG: error: MESSAGE`` line already printed on stderr;
    ``code`` is 2 (argparse's status for usage errors)."""

    def __init__(self, prog: str, message: str):
        super().__init__(2)
        self.prog, self.message = prog, message

    def __str__(self) -> str:
        return f"{self.prog}: error: {self.message}"


def fail(prog: str, message: str) -> NoReturn:
    """Print ``PROG: error: MESSAGE`` on stderr and exit with status 2 (raises :class:`UsageError`)."""
    err = UsageError(prog, message)
    print(err, file=sys.stderr, flush=True)
    raise err


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with its errors in the one-line convention (``PROG: error: MESSAGE``, see ``--help``)."""

    def error(self, message: str) -> NoReturn:
        fail(self.prog, f"{message} (see {self.prog} --help)")


@contextlib.contextmanager
def user_errors(prog: str, extra: Sequence[type[BaseException]] = ()) -> Iterator[None]:
    """Turn the :data:`USER_ERRORS` (and ``extra``, e.g. ``ModelNotInstalledError``) raised inside into
    :func:`fail`; wrap only input checks and the steps that validate a request before compute."""
    try:
        yield
    except (*USER_ERRORS, *extra) as e:
        fail(prog, str(e))


MAX_TEXT_FILE_BYTES = 64 * 2**20  # a context file: 16x a million-token English text


def read_bounded(path: str, *, flag: str, max_bytes: int, what: str = "file") -> bytes:
    """The bytes of the regular file ``path`` (given as ``flag``), at most ``max_bytes`` of them. Raises
    FileNotFoundError or ValueError naming the flag and file for a missing file, a directory, a FIFO, device or
    socket (reading one could block forever or never end), an unreadable file or one larger than ``max_bytes``.
    """
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{flag} {path}: no such file") from None
    except OSError as e:
        raise ValueError(f"{flag} {path} cannot be read ({e.strerror})") from None
    if stat.S_ISDIR(mode):
        raise ValueError(f"{flag} {path} is a directory; pass a {what}")
    if not stat.S_ISREG(mode):
        kind = "FIFO" if stat.S_ISFIFO(mode) else "device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else \
            "socket" if stat.S_ISSOCK(mode) else "special file"
        raise ValueError(f"{flag} {path} is a {kind}, not a regular file; save the {what} to a file and pass that")
    try:
        with open(p, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise ValueError(f"{flag} {path} cannot be read ({e.strerror})") from None
    if len(data) > max_bytes:
        raise ValueError(f"{flag} {path} is larger than {max_bytes // 2**20} MiB, more than a {what} can be; "
                         f"pass a shorter one")
    return data


def read_text_file(path: str, *, flag: str, encoding: str = "utf-8", max_bytes: int = MAX_TEXT_FILE_BYTES) -> str:
    """The text of ``path`` (given as ``flag``); a UTF-8 byte-order mark is dropped. Raises FileNotFoundError or
    ValueError naming the flag and file for a missing file, a directory or other non-regular file, an unreadable
    or undecodable file, one over ``max_bytes`` (:func:`read_bounded`), an unknown ``encoding`` and a file that
    holds only whitespace."""
    try:
        codec = codecs.lookup(encoding).name
    except LookupError:
        raise ValueError(f"--encoding {encoding!r} is not a text encoding Python knows (e.g. utf-8, latin-1, "
                         "utf-16)") from None
    data = read_bounded(path, flag=flag, max_bytes=max_bytes, what="text file")
    try:
        text = data.decode("utf-8-sig" if codec == "utf-8" else codec)
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path} is not {codec} text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                         f"convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or pass --encoding with its "
                         "encoding") from None
    if not text.strip():
        raise ValueError(f"{flag} {path} is empty (or only whitespace); it must hold the text")
    return text


def check_input_file(path: str, *, flag: str) -> None:
    """FileNotFoundError / ValueError naming ``flag`` when ``path`` is not an existing, readable file."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{flag} {path}: no such file")
    if not p.is_file():
        raise ValueError(f"{flag} {path} is not a file")
    if not os.access(p, os.R_OK):
        raise ValueError(f"{flag} {path} is not readable (permissions)")


def check_output_file(path: str, *, flag: str, make_parents: bool = False) -> None:
    """ValueError naming ``flag`` when a file cannot be written at ``path``: it is a directory, its directory
    does not exist (with ``make_parents``: the nearest existing one is not a writable directory) or is not
    writable. Checked before any compute; nothing is created."""
    p = Path(path)
    if not str(path) or p.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a directory; give a file name")
    parent = p.parent
    while make_parents and not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.exists():
        raise ValueError(f"{flag} {path}: the directory {parent} does not exist; create it first")
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ValueError(f"{flag} {path} is not writable (permissions); choose another path")


def add_launcher_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--local_rank`` / ``--local-rank`` (passed by the deepspeed launcher and old torch.distributed.launch).
    Here, below every layer and without torch, so that a command's ``--help`` and flag errors come at once
    (:mod:`magnetar.parallel.launcher` re-exports it)."""
    parser.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                        help="set by the launcher; do not pass by hand")
    return parser


def write_json_line(path, record: dict) -> None:
    """``record`` as one JSON line in ``path`` (a ``--json-out``), replaced atomically: a reader -- a benchmark's caller
    reading the rows so far of a run it killed -- sees the old file or the new one, never half of one."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(record) + "\n")
    os.replace(tmp, path)


def int_at_least(low: int):
    """An argparse ``type=`` for ints ``>= low`` (``--max-new-tokens 0`` is refused by argparse, naming the flag)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse
