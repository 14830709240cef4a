"""A local model folder checked before transformers reads it: a damaged file is one line naming the file and the fix.

A prepared folder can be damaged after its conversion completed (a disk that filled while another tool wrote, a
cut copy, an edit by hand); transformers then fails deep inside -- a JSON decoder, the Rust tokenizer, jinja, the
safetensors reader -- with a traceback that names none of the folder's files. :func:`check_folder` reads what
can be read cheaply (``config.json``, the tokenizer's JSON files, the chat template, every safetensors header and
its tensors' byte ranges against the file's size) and raises :class:`DamagedModelError` naming the first bad file
and what to do: for a registry model, ``python -m magnetar.models prepare NAME --force``; for a folder of the
user's own, to replace the file. Weights are not hashed (a safetensors file whose header and size agree can
still hold wrong numbers: ``runtime.check_finite`` catches the NaN kind at run time).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Optional

MAX_JSON_BYTES = 64 * 2**20  # a tokenizer.json of a 256k vocabulary is ~20 MB
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on a header


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")  # any one: a tokenizer's folder


def has_tokenizer_files(folder: Optional[Path]) -> bool:
    """Whether ``folder`` holds a tokenizer's files (what ``AutoTokenizer.from_pretrained`` reads)."""
    return folder is not None and any((Path(folder) / f).is_file() for f in TOKENIZER_FILES)


class DamagedModelError(ValueError):
    """A model folder's file is missing or damaged; the message names the file and the fix."""


def check_folder(folder: Path, fix: str) -> None:
    """:class:`DamagedModelError` for the first missing or damaged file of the Hugging Face model folder ``folder``
    (``fix``: what the user should run or do, e.g. ``python -m magnetar.models prepare NAME --force``)."""
    folder = Path(folder)

    def damaged(path: Path, why: str):
        return DamagedModelError(f"the model folder {folder} is damaged: {path.name} {why}; {fix}")

    config = folder / "config.json"
    if not config.is_file():
        raise damaged(config, "is missing")
    data = _json(config, damaged)
    if not isinstance(data, dict):
        raise damaged(config, f"holds a JSON {type(data).__name__}, not the model's config object")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        if (folder / name).is_file():
            _json(folder / name, damaged)
    template = folder / "chat_template.jinja"
    if template.is_file():
        _template(template, damaged)
    else:
        settings = _json(folder / "tokenizer_config.json", damaged) if (folder / "tokenizer_config.json").is_file() \
            else {}
        if isinstance(settings, dict) and isinstance(settings.get("chat_template"), str):
            _template_text(folder / "tokenizer_config.json", settings["chat_template"], damaged)
    shards = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        mapping = _json(index, damaged).get("weight_map", {})
        for name in sorted(set(mapping.values()) if isinstance(mapping, dict) else ()):
            if not (folder / name).is_file():
                raise damaged(folder / name, f"is missing (listed in {index.name})")
    for shard in shards:
        problem = safetensors_problem(shard)
        if problem is not None:
            raise damaged(shard, problem)


def safetensors_problem(path: Path) -> Optional[str]:
    """Why ``path`` is not a whole safetensors file (its header unreadable, or a tensor's bytes past the end of the
    file), or None. Reads the header only."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is cut short ({size} bytes, no header)"
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            return f"has a garbage header (it claims {n} header bytes in a file of {size})"
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return "has a garbage header (not JSON)"
    if not isinstance(header, dict):
        return "has a garbage header (not a JSON object)"
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return f"has a garbage header (tensor {name[:60]!r} has no data_offsets)"
        end = max(end, offsets[1])
    if 8 + n + end > size:
        return f"is cut short: its tensors end at byte {8 + n + end}, the file has {size}"
    return None


def _json(path: Path, damaged):
    if path.stat().st_size > MAX_JSON_BYTES:
        raise damaged(path, f"is larger than {MAX_JSON_BYTES // 2**20} MiB")
    try:
        return json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise damaged(path, f"is not valid JSON ({str(e)[:120]})") from None


def _template(path: Path, damaged) -> None:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise damaged(path, "is not UTF-8 text") from None
    _template_text(path, text, damaged)


def _template_text(path: Path, text: str, damaged) -> None:
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # transformers needs jinja2 for chat templates; without it there is nothing to check
        return
    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise damaged(path, f"holds a broken chat template (line {e.lineno}: {e.message})") from None
