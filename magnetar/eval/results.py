"""The results files of ``magnetar-eval``: ``OUT/results.jsonl`` (and the ``results.rank<N>.jsonl`` of
data-parallel runs), one JSON record per line, appended item by item.

Files are read line by line (bytes up to ``\\n``), so a line cut by an interrupted write is never joined to
the next one. A line that is not a record -- not UTF-8, not JSON, not a JSON object -- is skipped by
:func:`load` (the report) with a warning naming the file and line. The runner's resume
(:func:`set_aside_bad_lines`) is stricter: a line must hold a complete runner record (:data:`RECORD_FIELDS`
with their types, and a ``score``, an ``nll_sum`` with its ``tokens``, a fidelity record's ``kl``, or
``out_of_memory`` with its ``error``: an item that did not fit memory); any
other line is moved, as it was,
to ``<file>.rejected`` (appended) with a warning naming the file and line, and the file is rewritten without
it (a temporary file renamed over it), so its item runs again and the file parses line by line afterwards.
:func:`append_records` first ends a cut last line with a newline, so a cut line never swallows the next
record.
"""
from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Iterator, Optional, Sequence

RESULTS_GLOB = "results*.jsonl"
REJECTED_SUFFIX = ".rejected"
# The fields of every record the runner writes, with their types (a bool is not an int).
RECORD_FIELDS = {"key": str, "suite": str, "task": str, "method": str, "length": int, "index": int}


def result_files(out_dir: Path) -> list[Path]:
    """``results.jsonl`` and the per-rank ``results.rank<N>.jsonl`` of data-parallel runs, in name order."""
    return sorted(Path(out_dir).glob(RESULTS_GLOB))


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line without its ``\\n``) of every non-blank line of ``path``."""
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        if raw.strip():
            yield number, raw


def parse_line(raw: bytes) -> tuple[Optional[dict], str]:
    """(the JSON object of one line, "") or (None, why it is not one)."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    except json.JSONDecodeError as e:
        return None, f"not JSON ({e.msg} at column {e.colno}; a write cut short?)"
    if not isinstance(obj, dict):
        return None, f"a JSON {type(obj).__name__}, not an object"
    return obj, ""


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def record_problem(row: dict) -> Optional[str]:
    """Why ``row`` is not a complete runner record, or None."""
    for name, kind in RECORD_FIELDS.items():
        if name not in row:
            return f"no {name!r} field"
        if isinstance(row[name], bool) or not isinstance(row[name], kind):
            return f"{name!r} is a {type(row[name]).__name__}, not a {kind.__name__}"
    if row.get("out_of_memory") is True:  # an item that did not fit memory: a result without a score
        return None if isinstance(row.get("error"), str) else "an out_of_memory record without its 'error'"
    if "score" in row:
        return None if _is_number(row["score"]) else f"'score' is a {type(row['score']).__name__}, not a number"
    if "nll_sum" in row and "tokens" in row:
        if _is_number(row["nll_sum"]) and isinstance(row["tokens"], int) and not isinstance(row["tokens"], bool):
            return None
        return "'nll_sum' is not a number or 'tokens' not an int"
    if "kl" in row:  # a fidelity record (without --accuracy)
        return None if _is_number(row["kl"]) else f"'kl' is a {type(row['kl']).__name__}, not a number"
    return "no 'score' (nor 'nll_sum' and 'tokens', nor 'kl')"


def load(out_dir: Path) -> list[dict]:
    """Every JSON object of every results file of ``out_dir``, once per key; other lines are skipped with a
    warning naming the file and line."""
    rows, seen = [], set()
    for path in result_files(out_dir):
        for number, raw in _lines(path):
            row, why = parse_line(raw)
            if row is None:
                warnings.warn(f"{path}:{number}: skipped, {why}", stacklevel=2)
                continue
            key = row.get("key")
            if key is not None and key in seen:
                continue
            seen.add(key)
            rows.append(row)
    return rows


def set_aside_bad_lines(out_dir: Path) -> list[dict]:
    """The complete records of every results file of ``out_dir``, once per key (first wins). Lines that are not
    complete records are moved to ``<file>.rejected`` with a warning naming the file and line (see the module
    docstring); the results file is rewritten without them."""
    rows, seen = [], set()
    for path in result_files(out_dir):
        good, bad = [], []
        for number, raw in _lines(path):
            row, why = parse_line(raw)
            why = why or record_problem(row)
            if why:
                bad.append(raw)
                warnings.warn(f"{path}:{number}: not a complete record ({why}); moved to {path.name}{REJECTED_SUFFIX}, "
                              "its item runs again", stacklevel=2)
                continue
            good.append(raw)
            if row["key"] not in seen:
                seen.add(row["key"])
                rows.append(row)
        if bad:
            with open(path.with_name(path.name + REJECTED_SUFFIX), "ab") as f:
                f.write(b"".join(raw + b"\n" for raw in bad))
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(b"".join(raw + b"\n" for raw in good))
            os.replace(tmp, path)
    return rows


def append_records(path: Path, records: Sequence[dict]) -> None:
    """Append ``records`` to ``path``, one JSON line each, after a newline if the file ends without one."""
    with open(path, "a+b") as f:
        if f.seek(0, os.SEEK_END):
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write(b"".join(json.dumps(r).encode() + b"\n" for r in records))


LOCK_NAME = ".magnetar-eval.lock"
_HELD: dict = {}  # out_dir -> the open lock file of this process (kept open while the run lasts)


def lock_output(out_dir: Path) -> Optional[str]:
    """Take ``out_dir``'s run lock (``flock`` on :data:`LOCK_NAME`, released by the kernel when this process ends)
    so that two runs never append the same items to one folder; the reason it is held by another run (naming its
    pid, host and start), or None once taken. Call after :func:`write_problem` (the folder exists)."""
    import fcntl
    import socket
    import time

    out_dir = Path(out_dir).resolve()
    if out_dir in _HELD:
        return None
    path = out_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as e:
        return f"cannot create its lock file {path} ({e.strerror or e})"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "a process that wrote no details"
        os.close(fd)
        return (f"another magnetar-eval run writes to it ({holder}); wait for it to end (the lock goes with it) "
                f"or pass another --out")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, started "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0)
    _HELD[out_dir] = fd
    return None


def unlock_output(out_dir: Path) -> None:
    fd = _HELD.pop(Path(out_dir).resolve(), None)
    if fd is not None:
        os.close(fd)


def write_problem(out_dir: Path, names: Sequence[str]) -> Optional[str]:
    """Why the files ``names`` of ``out_dir`` cannot be appended to (``out_dir`` is created if missing), or None;
    the reason speaks of ``out_dir`` as "it".
    Nothing is written: an existing file is opened for appending, a missing one probed by a temporary file."""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return "it exists and is not a directory"
    except OSError as e:
        return f"cannot create it as a directory ({e.strerror or e})"
    for name in names:
        path = out_dir / name
        try:
            if path.exists() or path.is_symlink():
                with open(path, "ab"):
                    pass
            else:
                with tempfile.TemporaryFile(dir=out_dir):
                    pass
        except OSError as e:
            return f"cannot append to {path} ({e.strerror or e})"
    return None
