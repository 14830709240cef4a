"""Config files: JSON or YAML, read only from a regular file and at most :data:`MAX_CONFIG_BYTES` of it, parsed with
every way a file can be wrong named (syntax with line and column, duplicate keys, huge integers, YAML alias bombs)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from magnetar.config.checks import short_repr

MAX_CONFIG_BYTES = 2**20


def read_file(path: Any) -> dict[str, Any]:
    """The top-level mapping of a JSON or YAML config file, with every way a file can be wrong named."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"a config file path is a str or Path, got {type(path).__name__} {short_repr(path)}")
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ValueError(f"config file {p} must end in .json, .yaml or .yml")
    if not p.exists():
        raise FileNotFoundError(f"config file {p} does not exist")
    if p.is_dir():
        raise ValueError(f"config file {p} is a directory; pass a .json or .yaml file")
    if not p.is_file():  # a FIFO would block forever, a device never end
        raise ValueError(f"config file {p} is not a regular file (a FIFO, device or socket); save the config to a "
                         f"file and pass that")
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ValueError(f"config file {p} cannot be read ({e.strerror})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ValueError(f"config file {p} is larger than {MAX_CONFIG_BYTES // 2**20} MiB, more than a config can "
                         f"be; pass the config file itself")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"config file {p} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                         "save it as UTF-8") from None
    if not text.strip():
        raise ValueError(f"config file {p} is empty; write a mapping of config fields (e.g. {{\"method\": \"star\"}}, "
                         "or {} for the defaults)")
    try:
        data = _parse_json(text) if suffix == ".json" else _parse_yaml(text)
    except RecursionError:
        raise ValueError(f"config file {p} is nested too deeply to be a config") from None
    except ValueError as e:
        raise ValueError(f"config file {p}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {p} must hold a mapping of config fields at the top level (e.g. "
                         f"{{\"method\": \"star\"}}), got {type(data).__name__} {short_repr(data)}")
    return data


def _parse_json(text: str) -> Any:
    def unique(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"key {k!r} appears twice in one object; keep one")
            seen.add(k)
        return dict(pairs)

    try:
        return json.loads(text, object_pairs_hook=unique, parse_int=_parse_int)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


MAX_INT_DIGITS = 100  # an integer of a config is far shorter; Python refuses to read ints past 4300 digits
MAX_YAML_NODES = 10_000  # the values of a config, aliases expanded: a billion-laughs file is refused before built


def _parse_int(text: str) -> int:
    if len(text.lstrip("+-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('+-'))} digits ({text[:20]}...); config values are far "
                         f"smaller -- fix the number")
    return int(text)


def _yaml_size(node, memo: dict) -> int:
    """Nodes of ``node`` with its aliases expanded (each shared node counted once per use, computed once); a
    recursive alias counts as too many."""
    import yaml

    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = MAX_YAML_NODES + 1  # a node reached again while being counted: a recursive value
    if isinstance(node, yaml.SequenceNode):
        n = 1 + sum(_yaml_size(child, memo) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        n = 1 + sum(_yaml_size(k, memo) + _yaml_size(v, memo) for k, v in node.value)
    else:
        n = 1
    memo[id(node)] = n
    return n


def _too_large_at(node, memo: dict) -> tuple[str, Any]:
    """Where a document too large with its aliases expanded is too large: the dotted path of the deepest field (or
    ``[i]`` item) whose value alone expands past :data:`MAX_YAML_NODES`, and the mark of that field's key (where it
    is written -- an alias's target is defined elsewhere); ``("", the document's mark)`` when no single field is."""
    import yaml

    path, mark, seen = "", node.start_mark, set()
    while id(node) not in seen:  # a recursive value leads back to a node already passed: stop there
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            children = [(k.value if isinstance(k, yaml.ScalarNode) else "?", k.start_mark, v) for k, v in node.value]
            children = [(f"{path}.{name}" if path else str(name), m, v) for name, m, v in children]
        elif isinstance(node, yaml.SequenceNode):
            children = [(f"{path}[{i}]", v.start_mark, v) for i, v in enumerate(node.value)]
        else:
            break
        big = [c for c in children if memo.get(id(c[2]), 0) > MAX_YAML_NODES]
        if not big:
            break
        path, mark, node = big[0]
    return path, mark


def _parse_yaml(text: str) -> Any:
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):  # PyYAML keeps the last of two equal keys without a word
        def construct_document(self, node):
            memo: dict = {}
            if _yaml_size(node, memo) > MAX_YAML_NODES:
                path, mark = _too_large_at(node, memo)
                where = f"the value of {path}" if path else "the document"
                raise yaml.constructor.ConstructorError(None, None, f"{where} expands to more than "
                                                        f"{MAX_YAML_NODES} values (aliases repeated or recursive); "
                                                        f"a config holds a few dozen -- write the values out", mark)
            return super().construct_document(node)

        def construct_yaml_int(self, node):
            digits = str(node.value).lstrip("+-").replace("_", "")
            if len(digits) > MAX_INT_DIGITS:
                raise yaml.constructor.ConstructorError(None, None, f"an integer of {len(digits)} digits; config "
                                                        f"values are far smaller -- fix the number",
                                                        node.start_mark)
            return super().construct_yaml_int(node)

        def construct_mapping(self, node, deep=False):
            self.flatten_mapping(node)
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, (str, int, float, bool)):
                    continue  # an unhashable key is refused by SafeLoader itself
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice in one mapping; "
                                                            "keep one", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", UniqueKeyLoader.construct_yaml_int)
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"invalid YAML{at}: {getattr(e, 'problem', None) or e}") from None
