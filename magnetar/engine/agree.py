"""Before Phase 1, the ranks of a model replica (its TP x CP ranks) check that they serve the same request (one
small collective).

Every rank of a CP group encodes its own blocks of ONE context and Phase 2 merges their KV, and the TP ranks
of a CP rank each compute some of its heads, so every rank must get the same context, query, generation
parameters and config. Given different ones (another needle on one rank, star on one and pulsar on the other,
another context length) the ranks would merge two requests into a plausible answer, or their block plans would
disagree and a collective abort. :func:`check_request` makes every rank raise the same :class:`RequestMismatchError`
instead, naming what differs and on which ranks.

What is compared: the entry point (generate or score), the number of requests, the context and the query (or scored
continuation) token ids (count and a blake2b digest), ``max_new_tokens``, the stop strings, ``return_logits``, the
sampling parameters, score's variant configs, and every leaf field of the :class:`EngineConfig` (``method``,
``pulsar.scorer``, ...; ``parallel.timeout_s`` included). Each is one field of three int64 ``(tag, a, b)``: small
values (None, bools, ints, floats, strings up to 8 bytes) exactly, so the error can print them; anything else as a
digest (printed as a name when it is one of the config's known choices, else as ``#`` + hex). The fields fill a
vector of fixed length (:data:`SLOTS` fields) whose first element is a digest of the fields' keys, so ranks running
different versions get an error too, never a collective of mismatched sizes.

Cost per request: hashing the token ids (blake2b, ~1 GB/s: about 10 ms for a million tokens) and one all_gather
of ``3 * SLOTS + 1`` int64 (3 KiB) per rank -- negligible next to Phase 1. Nothing is checked for a one-rank replica
(``tp_size`` = ``cp_size`` = 1) or simulated ranks (one process: nothing to disagree with).

This module knows nothing of the model, the plan or the methods.
"""
from __future__ import annotations

import hashlib
import struct
from datetime import timedelta
from itertools import chain
from typing import Any, NamedTuple, Optional, Sequence

import torch

from magnetar.config import FIELD_CHOICES, METHODS, POLICIES, EngineConfig
from magnetar.parallel import ParallelGroups
from magnetar.parallel.collectives import all_gather_ints, describe_per_rank

SLOTS = 128  # fields in the gathered vector (request ~10 + config ~60); fixed so every rank sends the same size
MAX_LISTED = 6  # differing fields named in the error (then "and N more")
_NONE, _BOOL, _INT, _FLOAT, _TEXT, _HASH, _IDS = range(7)
_UNUSED = (-1, 0, 0)  # the padding after the last field


class RequestMismatchError(ValueError):
    """The ranks of a model replica were given different requests or configs (raised on every rank alike)."""


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _canonical(value: Any) -> Any:
    """Lists and tuples alike (a stop list and a stop tuple are the same request)."""
    if isinstance(value, (list, tuple)):
        return tuple(_canonical(v) for v in value)
    return value


def _hash_value(value: Any) -> int:
    return _digest(repr(_canonical(value)).encode("utf-8", "surrogatepass"))


def encode(value: Any) -> tuple[int, int, int]:
    """``(tag, a, b)`` of one field: the value itself when small, else its digest."""
    if value is None:
        return _NONE, 0, 0
    if isinstance(value, bool):
        return _BOOL, int(value), 0
    if isinstance(value, int) and -(2 ** 63) <= value < 2 ** 63:
        return _INT, value, 0
    if isinstance(value, float):  # its bits: exact, NaN included
        return _FLOAT, struct.unpack("<q", struct.pack("<d", value))[0], 0
    if isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
        if len(raw) <= 8:
            return _TEXT, int.from_bytes(raw.ljust(8, b"\0"), "little", signed=True), len(raw)
    return _HASH, _hash_value(value), 0


def encode_ids(ids: Sequence[torch.Tensor]) -> tuple[int, int, int]:
    """``(_IDS, total tokens, digest)`` of the token ids of one or more requests (each one's length included, so
    the requests' boundaries count too)."""
    h = hashlib.blake2b(digest_size=8)
    total = 0
    for t in ids:
        flat = t.reshape(-1).to(dtype=torch.int64, device="cpu").contiguous()
        h.update(int(flat.numel()).to_bytes(8, "little"))
        h.update(flat.numpy().tobytes())
        total += int(flat.numel())
    return _IDS, total, int.from_bytes(h.digest(), "little", signed=True)


def _known_string(code: int) -> Optional[str]:
    """The string of a config field (a method, a policy -- registered now --, a choice) whose digest is ``code``."""
    return next((s for s in chain(METHODS, POLICIES, ("none",), *FIELD_CHOICES.values()) if _hash_value(s) == code),
                None)


def show(code: Sequence[int]) -> str:
    """The printable form of one field's ``(tag, a, b)`` (the same on every rank)."""
    tag, a, b = (int(x) for x in code)
    if tag == _NONE:
        return "None"
    if tag == _BOOL:
        return str(bool(a))
    if tag == _INT:
        return str(a)
    if tag == _FLOAT:
        return repr(struct.unpack("<d", struct.pack("<q", a))[0])
    if tag == _TEXT:
        return repr(a.to_bytes(8, "little", signed=True)[:b].decode("utf-8", "replace"))
    if tag == _IDS:
        return f"{a} tokens #{b & 0xFFFFFFFF:08x}"
    if tag == _HASH:
        known = _known_string(a)
        return repr(known) if known is not None else f"#{a & 0xFFFFFFFF:08x}"
    return f"(unknown field encoding {tag})"


def _config_fields(config: EngineConfig) -> list[tuple[str, Any]]:
    """Every leaf field of ``config``: ``("method", "star"), ("pulsar.scorer", "bm25"), ...``."""
    out = []
    for key, value in config.to_dict().items():
        if isinstance(value, dict):
            out += [(f"{key}.{k}", v) for k, v in value.items()]
        else:
            out.append((key, value))
    return out


class Field(NamedTuple):
    """One thing the ranks must agree on: ``key`` (the same for every request kind), ``label`` (for the error),
    ``code`` (its ``(tag, a, b)``)."""

    key: str
    label: str
    code: tuple[int, int, int]


def request_fields(config: EngineConfig, *, entry: str, contexts: Sequence[torch.Tensor],
                   queries: Sequence[torch.Tensor], max_new_tokens: Any = None, stop: Any = None,
                   return_logits: Any = None, variants: Any = None, sampling: Any = None) -> list[Field]:
    """Everything the ranks must agree on; ``entry`` "generate" or "score" (then ``queries`` are the scored
    continuations and ``variants`` score_variants' decode configs). Fields a kind has not are None."""
    n_variants = len(variants) if isinstance(variants, (list, tuple)) else None
    fields = [
        Field("entry", "entry point (generate or score)", encode(entry)),
        Field("requests", "number of requests", encode(len(contexts))),
        Field("context", "context token ids", encode_ids(contexts)),
        Field("query", "continuation token ids" if entry == "score" else "query token ids", encode_ids(queries)),
        Field("max_new_tokens", "max_new_tokens", encode(max_new_tokens)),
        Field("stop", "stop strings", encode(stop)),
        Field("return_logits", "return_logits", encode(return_logits)),
        Field("sampling", "sampling parameters (temperature, top_p, top_k, seed, grammar)", encode(sampling)),
        Field("n_variants", "number of variants", encode(n_variants)),
        Field("variants", "variant configs", encode(variants)),
    ]
    return fields + [Field(f"config.{name}", f"config field '{name}'", encode(value))
                     for name, value in _config_fields(config)]


_PLURAL = ("context token ids", "continuation token ids", "query token ids", "stop strings", "variant configs")


def digest(fields: Sequence[Field]) -> list[int]:
    """The fixed-length vector gathered over the ranks: a digest of the field keys, then ``SLOTS`` fields."""
    if len(fields) > SLOTS:
        raise RuntimeError(f"the request agreement has {len(fields)} fields but room for {SLOTS}; raise "
                           "magnetar.engine.agree.SLOTS")
    codes = [f.code for f in fields] + [_UNUSED] * (SLOTS - len(fields))
    return [_hash_value([f.key for f in fields])] + [x for code in codes for x in code]


def describe_mismatch(labels: Sequence[str], rows: Sequence[Sequence[int]]) -> Optional[str]:
    """The error message for the gathered vectors ``rows`` (one per rank, from :func:`digest`), None when all agree.

    ``labels`` are this rank's field labels: every rank's fields have the same keys once the first element (their
    digest) agrees, and the same labels once the entry point (the first field) agrees, so every rank builds the
    same message.
    """
    rows = [[int(x) for x in r] for r in rows]
    if all(r == rows[0] for r in rows):
        return None
    if len({r[0] for r in rows}) > 1:
        keys = describe_per_rank([f"#{r[0] & 0xFFFFFFFF:08x}" for r in rows])
        diffs = [(f"the fields checked differ ({keys}): the ranks run different versions of magnetar; install the "
                  "same version on every rank")]
    else:
        diffs = []
        for i, label in enumerate(labels):
            codes = [tuple(r[1 + 3 * i: 4 + 3 * i]) for r in rows]
            if len(set(codes)) > 1:
                diffs.append(f"{label} {'differ' if label in _PLURAL else 'differs'} "
                             f"({describe_per_rank([show(c) for c in codes])})")
                if i == 0:  # generate on one rank, score on another: the other fields mean different things
                    break
    if len(diffs) > MAX_LISTED:
        diffs = diffs[:MAX_LISTED] + [f"and {len(diffs) - MAX_LISTED} more fields differ"]
    return ("ranks disagree on the request: " + "; ".join(diffs) + ". Every rank of a model replica (TP x CP "
            "group) must get the same context, query, generation parameters and config.")


def check_request(groups: ParallelGroups, config: EngineConfig, device: torch.device, *, across: str = "replica",
                  **request) -> None:
    """Raise :class:`RequestMismatchError` on every rank of the model replica (TP x CP ranks) unless all got the
    same request (``request``: the keywords of :func:`request_fields`). One all_gather over
    ``groups.replica_group`` with ``config.parallel.timeout_s``; nothing for a one-rank replica or simulated
    ranks. ``across="dp"``: the same over this rank's DP group (the replicas were given the same requests)."""
    group, size = (groups.replica_group, groups.replica_size) if across == "replica" else \
        (groups.dp_group, groups.dp_size)
    if size == 1 or config.parallel.simulate:
        return
    fields = request_fields(config, **request)
    rows = all_gather_ints(digest(fields), group, device, timeout=timedelta(seconds=config.parallel.timeout_s))
    message = describe_mismatch([f.label for f in fields], rows.tolist())
    if message is not None:
        raise RequestMismatchError(message if across == "replica" else
                                   f"the data-parallel replicas were given different request lists: {message}")
