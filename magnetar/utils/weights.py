"""Magnetar's own weights files (hash banks, prefill indexers): one writer and one signature-checked loader.

A weights file is a ``torch.save`` zip archive of one dict::

    {"format": "magnetar-<kind>-v<version>",   the kind/format tag, checked first
     "signature": model_signature(config),    the model the weights were made for (shapes, not values)
     "state": module.state_dict(),            the tensors
     <header fields>: plain int/float/str/list/dict values the bank needs to rebuild itself}

Loading never runs code from the file: it is read with ``torch.load(weights_only=True)``, whose unpickler
accepts tensors and plain containers only, so a crafted file (a pickled object whose ``__reduce__`` runs a
command) is refused before any of it executes. Files written before this loader existed have the same layout
and load unchanged. Every failure names the file and what to do: missing, empty, not a torch archive
(random bytes, text), damaged or truncated archive, objects other than tensors and plain data, another kind
or version of file, missing or mistyped header fields, another model, tensors whose names or shapes disagree
with the file's own header, or non-finite weights.

The loader knows nothing of what the weights compute: a bank declares its file with a :class:`WeightsFile`
and rebuilds itself from the checked header (``make``). Safetensors was considered and not used: the header
metadata (per-layer dicts with int keys, tuples) would have to be flattened to JSON strings, changing what
today's files hold and what the calibration CLIs read back.
"""
from __future__ import annotations

import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import torch

Module = TypeVar("Module", bound=torch.nn.Module)

_ZIP_MAGIC = b"PK\x03\x04"  # every torch.save archive (the default since torch 1.6) starts as a zip file

# the model dimensions a weights file depends on; ints are checked > 0
SIGNATURE_FIELDS = {"model_type": str, "num_hidden_layers": int, "num_attention_heads": int,
                    "num_key_value_heads": int, "head_dim": int, "hidden_size": int}


def model_signature(config) -> dict:
    """What per-layer weights depend on: the shapes of the model's attention (a Hugging Face config).

    Returns ``{model_type, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, hidden_size,
    name_or_path}``; ``name_or_path`` (the checkpoint's folder name) is informative and never compared."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {"model_type": config.model_type, "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
            "head_dim": head_dim, "hidden_size": config.hidden_size,
            "name_or_path": Path(str(getattr(config, "_name_or_path", "") or "")).name}


def _type_ok(value, want) -> bool:
    if want is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if want is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, want)


@dataclass(frozen=True)
class WeightsFile:
    """One kind of weights file.

    ``format``: the tag, ``magnetar-<kind>-v<version>``; ``what``: the file in words ("hash weights");
    ``option``: the config field / flag that names such a file; ``remake``: how to make a good one (``{path}``
    in it is the missing file's path, or ``FILE``); ``fields``: required header fields and their types (``int``,
    ``float``, ``str``, ``list``, ``dict``), besides ``format``, ``signature`` and ``state``; ``defaults``: optional
    fields and their values when absent. A ``trained_layers`` field, if declared, must list layers of the signature's
    model."""

    format: str
    what: str
    option: str
    remake: str
    fields: Mapping[str, type]
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def _fail(self, path: Path, problem: str) -> ValueError:
        # remake's --out is FILE here: the path given may be another kind of file, not one to overwrite
        return ValueError(f"{self.what} {path} ({self.option}): {problem}; {self.remake.format(path='FILE')}")

    # -- writing ----------------------------------------------------------------------------------------
    def save(self, path: str | Path, header: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> None:
        """Write ``{"format", **header, "state"}`` atomically (a temporary file renamed: never half-written).
        ``header`` holds ``signature`` and this kind's ``fields``, plain values only."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save({"format": self.format, **header, "state": state}, tmp)
        tmp.replace(path)

    # -- reading ----------------------------------------------------------------------------------------
    def read(self, path: str | Path, config=None) -> dict:
        """The checked contents of the file at ``path``: tag, header fields (defaults filled in), signature --
        against the model ``config`` when given. The tensors in ``state`` are checked by :meth:`build`."""
        path = Path(path)
        data = self._unpickle(path)
        if not isinstance(data, dict) or not isinstance(data.get("format"), str):
            what = f"a dict with keys {sorted(map(str, data))[:6]}" if isinstance(data, dict) else type(data).__name__
            raise self._fail(path, f"not a Magnetar weights file: a torch archive of {what}, without the "
                                   f"{self.format!r} format tag")
        fmt = data["format"]
        if fmt != self.format:
            kind, _, version = self.format.rpartition("-v")
            if fmt.startswith(kind + "-v"):
                problem = (f"written in format version {fmt.rpartition('-v')[2]!r}, this Magnetar reads version "
                           f"{version!r} ({self.format!r}) only")
            else:
                problem = f"the wrong kind of file: it is a {fmt!r} file, {self.option} needs {self.format!r}"
            raise self._fail(path, problem)
        data = {**self.defaults, **data}
        for name, want in {"signature": dict, "state": dict, **self.fields}.items():
            if name not in data:
                raise self._fail(path, f"field {name!r} is missing (the file is damaged or was not written by "
                                       f"Magnetar)")
            if not _type_ok(data[name], want):
                raise self._fail(path, f"field {name!r} is {type(data[name]).__name__} {data[name]!r:.60}, "
                                       f"expected {want.__name__}")
        self._check_signature(path, data["signature"], config)
        layers = data.get("trained_layers")
        if "trained_layers" in self.fields and any(not _type_ok(x, int) or not 0 <= x < data["signature"]
                                                   ["num_hidden_layers"] for x in layers):
            raise self._fail(path, f"trained_layers {layers} names layers the model of its signature does not have "
                                   f"({data['signature']['num_hidden_layers']} layers)")
        return data

    def load(self, path: str | Path, make: Callable[[dict], Module], config=None) -> tuple[Module, dict]:
        """:meth:`read` then :meth:`build`: returns ``(module, data)``."""
        data = self.read(path, config)
        return self.build(path, data, make), data

    def build(self, path: str | Path, data: dict, make: Callable[[dict], Module]) -> Module:
        """The module ``make(data)`` builds from the checked header ``data`` (from :meth:`read` of ``path``), with
        the file's tensors loaded after checking them against it: names, shapes, floating dtype, finite values."""
        path = Path(path)
        try:
            module = make(data)
        except (ValueError, TypeError, KeyError) as e:
            raise self._fail(path, f"its header is not valid ({e})") from e
        want = module.state_dict()
        got = data["state"]
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        if missing or extra:
            raise self._fail(path, f"its tensors do not match its header: missing {missing[:4]}, unexpected "
                                   f"{extra[:4]}")
        for name, ref in want.items():
            t = got[name]
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(ref.shape) or not t.is_floating_point():
                shown = (f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__)
                raise self._fail(path, f"tensor {name!r} is {shown}, its header implies {tuple(ref.shape)} "
                                       f"floating point (the file is damaged or was edited)")
            if not bool(torch.isfinite(t).all()):
                raise self._fail(path, f"tensor {name!r} holds NaN or inf values (a diverged run or a damaged file)")
        module.load_state_dict(got)
        return module

    def _unpickle(self, path: Path):
        if path.is_dir():
            raise self._fail(path, "this is a folder; give the weights file inside it")
        if not path.is_file():
            raise FileNotFoundError(f"{self.what} {path} ({self.option}) not found; {self.remake.format(path=path)}")
        with open(path, "rb") as f:
            head = f.read(len(_ZIP_MAGIC))
        if not head:
            raise self._fail(path, "the file is empty")
        if head != _ZIP_MAGIC:
            raise self._fail(path, "not a torch weights archive (it does not start like one: random bytes, text, "
                                   "a plain pickle or another format); it was not read")
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:  # weights_only's unpickler met something that is not plain data
            found = re.search(r"GLOBAL (\S+)", str(e)) or re.search(r"WeightsUnpickler error:\s*(.+)", str(e))
            detail = f" ({found.group(1).strip()})" if found else ""
            raise self._fail(path, f"refused: it holds Python objects other than tensors and plain data{detail}, "
                                   f"and loading those could run code from the file. Magnetar never writes them: "
                                   f"a file from an older or modified tool that holds them cannot be loaded "
                                   f"safely and must be made again") from None
        except Exception as e:  # torch's zip reader raises RuntimeError, OSError, EOFError... by kind of damage
            raise self._fail(path, f"a damaged or truncated torch archive ({type(e).__name__}: {str(e)[:120]})"
                             ) from None

    def _check_signature(self, path: Path, got: dict, config) -> None:
        for name, want in SIGNATURE_FIELDS.items():
            value = got.get(name)
            if not _type_ok(value, want) or (want is int and value <= 0):
                raise self._fail(path, f"signature field {name!r} is {value!r}, expected a "
                                       f"{'positive int' if want is int else want.__name__}")
        if config is None:
            return
        want = model_signature(config)
        diff = {k: (got.get(k), v) for k, v in want.items() if k != "name_or_path" and got.get(k) != v}
        if diff:
            raise self._fail(path, f"made for another model ({got.get('name_or_path') or got.get('model_type')}): "
                                   + ", ".join(f"{k} {a} != {b} here" for k, (a, b) in diff.items()))
