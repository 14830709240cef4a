"""The :class:`EngineConfig` tree: its sections by name, flat access to every field (``config.cp_size``), and
building it from flat or nested mappings, files (:mod:`magnetar.config.files`) and command lines."""
from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from magnetar.config import checks
from magnetar.config.checks import check_types, check_choice, require, short_repr, suggest
from magnetar.config.files import read_file
from magnetar.config.registry import (DECODE_SECTIONS, DISTRIBUTED_METHODS, LUKA_METHODS, METHOD_OPTIONS, METHODS,
                                      PREFILL_METHODS)
from magnetar.config.sections import (BlockConfig, DecodeConfig, EncodingSection, LukaConfig, ParallelConfig,
                                      PolicySection, PrefillConfig, PulsarConfig, RuntimeConfig, SparseConfig,
                                      StreamingConfig)

SECTIONS = {
    "parallel": ParallelConfig,
    "blocks": BlockConfig,
    "pulsar": PulsarConfig,
    "streaming": StreamingConfig,
    "decode": DecodeConfig,
    "runtime": RuntimeConfig,
    "sparse": SparseConfig,
    "luka": LukaConfig,
    "prefill": PrefillConfig,
}
FLAT_FIELDS = checks.FLAT_FIELDS  # one dict: the checks name fields by it
FLAT_FIELDS.update({f.name: sec for sec, cls in SECTIONS.items() for f in fields(cls)})
# the options a request may set for itself (Engine.variant): the method and the fields of the sections of how a
# context is encoded (EncodingSection: blocks, pulsar, streaming)
REQUEST_OPTIONS = ("method",) + tuple(f.name for cls in SECTIONS.values() if issubclass(cls, EncodingSection)
                                      for f in fields(cls))


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    method: str = "dense"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    blocks: BlockConfig = field(default_factory=BlockConfig)
    pulsar: PulsarConfig = field(default_factory=PulsarConfig)
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    sparse: SparseConfig = field(default_factory=SparseConfig)
    luka: LukaConfig = field(default_factory=LukaConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)

    def __post_init__(self):
        check_types(self)
        check_choice("method", self.method, tuple(METHODS), "method")
        if self.luka.luka_mode != "none":
            require(self.sparse.sparse_policy == "none", "luka_mode",
                     f"LuKA and sparse decoding ({self.sparse.sparse_policy!r}) both choose the context KV a step "
                     "attends to; use one of them (set sparse_policy none or luka_mode none)")
            require(self.method in LUKA_METHODS, "luka_mode",
                     f"LuKA needs every context token's attention mass from a local Phase 1; use method "
                     f"{' / '.join(LUKA_METHODS)}, not {self.method!r}")
        if self.prefill.prefill_policy != "none":
            require(self.method in PREFILL_METHODS, "prefill_policy",
                     f"sparse prefill replaces the attention of a local Phase 1; use method "
                     f"{' / '.join(PREFILL_METHODS)}, not {self.method!r}")
            require(self.luka.luka_mode == "none", "prefill_policy",
                     "LuKA's Phase-1 attention mass assumes dense prefill attention; use sparse prefill or LuKA "
                     "(set prefill_policy none or luka_mode none)")
        for option, (owners, what) in METHOD_OPTIONS.items():
            value = getattr(self, option)
            if value:
                unset = '""' if isinstance(value, str) else "0"
                require(self.method in owners, option,
                         f"{option} is an option of {' / '.join(owners)} ({what}); use method "
                         f"{' or '.join(owners)}, or {option} {unset}, not method {self.method!r}")
        if self.blocks.exact_layers.strip():
            require(self.prefill.prefill_policy == "none", "exact_layers",
                     f"hybrid layers attend exactly over the CP group, sparse prefill sparsely within a block; use "
                     f"one (set exact_layers \"\" or prefill_policy none, not {self.prefill.prefill_policy!r})")
        if not METHODS[self.method].distributed:
            require(self.parallel.cp_size == 1, "cp_size",
                     f"method {self.method!r} runs on one rank; use cp_size=1 (or method "
                     f"{'/'.join(DISTRIBUTED_METHODS)} to spread it)")

    @property
    def decode_config(self) -> PolicySection:
        """The section of the decode-time policy the Phase-2 attention asks (one of :data:`DECODE_SECTIONS`: at
        most one names a policy -- the checks above; the last section, naming ``none``, when none does)."""
        sections = [getattr(self, name) for name in DECODE_SECTIONS]
        return next((s for s in sections if s.policy != "none"), sections[-1])

    # -- flat access to the names used throughout the docs ------------------------------------------------
    def __getattr__(self, name):  # only called when normal lookup fails: config.cp_size, config.scorer, ...
        section = FLAT_FIELDS.get(name)
        if section is None:
            raise AttributeError(f"EngineConfig has no field {name!r}")
        return getattr(object.__getattribute__(self, section), name)

    @classmethod
    def create(cls, **kwargs) -> "EngineConfig":
        """Build from flat keyword names (``cp_size=4, scorer="bm25"``) and/or section dicts/objects."""
        return cls.from_dict(kwargs)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "EngineConfig":
        """Nested (``{"pulsar": {"scorer": ...}}``) or flat (``{"scorer": ...}``) keys. Unknown keys, a field given
        twice (flat and nested), a section that is not a mapping and a value of the wrong type are errors that
        name the field (``pulsar.scorer``) and its flag; nothing is converted."""
        return cls._build(*_split(data))

    @classmethod
    def _build(cls, top: dict[str, Any], per_section: dict[str, dict[str, Any]]) -> "EngineConfig":
        return cls(**top, **{s: SECTIONS[s](**vals) for s, vals in per_section.items()})

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "EngineConfig":
        """Load a ``.json`` or ``.yaml``/``.yml`` file (UTF-8; nested or flat keys). FileNotFoundError for a
        missing file; ValueError naming the file (and line and column of a syntax error) for anything else."""
        data = read_file(path)
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"config file {path}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **flat) -> "EngineConfig":
        """A copy with flat fields changed (the original is never mutated)."""
        top, per = {"method": self.method}, _sections_of(self)
        for key, value in flat.items():
            if key in SECTIONS:
                raise ValueError(f"replace takes flat fields (e.g. scorer='bm25'), not the section {key!r}; "
                                 "use EngineConfig.from_dict for nested values")
            _put(top, per, None, key, value, key)
        return EngineConfig._build(top, per)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> "EngineConfig":
        """From flags added by :func:`add_cli_args`; ``--config FILE`` values are overridden by explicit flags
        (the file and the flags are validated together, once)."""
        top, per = {}, {s: {} for s in SECTIONS}
        path = getattr(args, "config", None)
        if path is not None:
            data = read_file(path)
            try:
                top, per = _split(data)
            except ValueError as e:
                raise ValueError(f"config file {path}: {e}") from None
        from_file = {*top, *(k for vals in per.values() for k in vals)}
        for name in ["method", *FLAT_FIELDS]:
            value = getattr(args, name, None)
            if value is not None:
                _put(top, per, None, name, value, name)
                from_file.discard(name)
        try:
            return cls._build(top, per)
        except ValueError as e:
            if getattr(e, "field", None) in from_file:
                raise ValueError(f"config file {path}: {e}") from None
            raise


def _fields_of(section: Any) -> dict[str, Any]:
    return {f.name: getattr(section, f.name) for f in fields(section)}


def _sections_of(config: EngineConfig) -> dict[str, dict[str, Any]]:
    return {s: _fields_of(getattr(config, s)) for s in SECTIONS}


def _unknown(key: Any, section: Optional[str] = None) -> str:
    """The error for a key that is no config field (of ``section``): the nearest names, where it belongs."""
    if not isinstance(key, str):
        return f"config keys are field names (strings), got {type(key).__name__} {short_repr(key)}"
    if section is not None:
        names = [f.name for f in fields(SECTIONS[section])]
        home = FLAT_FIELDS.get(key)
        where = f"; {key!r} belongs in section {home!r}" if home else suggest(key, names)
        return f"unknown field {short_repr(key)} in config section {section!r}{where} (its fields: {', '.join(names)})"
    return (f"unknown config field {short_repr(key)}{suggest(key, ['method', *SECTIONS, *FLAT_FIELDS])} (fields: "
            f"'method', the sections {', '.join(SECTIONS)} and their fields {', '.join(sorted(FLAT_FIELDS))})")


def _put(top: dict, per: dict[str, dict], given: Optional[dict[str, str]], key: Any, value: Any, as_: str) -> None:
    """Set field ``key`` (``method`` or a section's field) to ``value``. With ``given`` (field -> how it was
    written, e.g. ``pulsar.scorer``) a field set twice is an error; without, the later value wins (a flag over
    its config file)."""
    if key == "method":
        top["method"] = value
        return
    if not isinstance(key, str) or key not in FLAT_FIELDS:
        raise ValueError(_unknown(key))
    if given is not None:
        if key in given:
            raise ValueError(f"config field {key!r} is given twice, as {given[key]!r} and as {as_!r}; keep one")
        given[key] = as_
    per[FLAT_FIELDS[key]][key] = value


def _split(data: Any) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """A config mapping (nested and/or flat keys) -> ``(top-level fields, {section: {field: value}})``."""
    if not isinstance(data, Mapping):
        raise ValueError(f"a config is a mapping of field names to values (e.g. {{'method': 'star', "
                         f"'cp_size': 4}}), got {type(data).__name__}")
    top: dict[str, Any] = {}
    per: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    given: dict[str, str] = {}
    for key, value in data.items():
        if key in SECTIONS:
            if isinstance(value, SECTIONS[key]):
                value = _fields_of(value)
            if not isinstance(value, Mapping):
                first = fields(SECTIONS[key])[0].name
                raise ValueError(f"config section {key!r} must be a mapping of its fields (e.g. {{{first!r}: ...}}) "
                                 f"or a {SECTIONS[key].__name__}, got {type(value).__name__} {short_repr(value)}")
            for k, v in value.items():
                if not isinstance(k, str) or FLAT_FIELDS.get(k) != key:
                    raise ValueError(_unknown(k, key))
                _put(top, per, given, k, v, f"{key}.{k}")
        else:
            _put(top, per, given, key, value, key)
    return top, per
