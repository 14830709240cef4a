"""The contexts a server pins (``POST /v1/contexts``): what the serving rank knows of each, and how many it holds.
With a context store (``--context-store DIR``) the list is kept in ``DIR/pinned-<replica>.json`` (rewritten whole,
atomically, on every change), so a restarted server pins them again -- their KV then loads from the store."""
from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from magnetar.serve.protocol import RequestError


@dataclass(frozen=True)
class PinnedContext:
    id: str
    key: str
    format: str
    tokens: int
    created: int
    # (L,) int64: its ids, which a request about it is checked with (Engine.check)
    context_ids: Optional[torch.Tensor] = field(default=None, repr=False)


class ContextRegistry:
    """The pinned contexts the serving rank knows about (thread-safe: HTTP handlers and the engine loop), at most
    ``limit`` of them counting those being encoded: :meth:`reserve` takes a place before the encode is queued
    (check and take in one step, so concurrent POSTs cannot pass the limit together), :meth:`add` fills it,
    :meth:`unreserve` gives it back when the encode fails."""

    def __init__(self, limit: int, path: Optional[Path] = None):
        self.limit, self.path = limit, path
        self._lock = threading.Lock()
        self._items: dict[str, PinnedContext] = {}
        self._reserved: dict[str, int] = {}  # cid -> POSTs of it being encoded

    def saved(self) -> list[PinnedContext]:
        """The contexts pinned when the list was last written (none without a file; an unreadable file is said
        and ignored)."""
        if self.path is None or not self.path.exists():
            return []
        try:
            return [PinnedContext(d["id"], d["key"], d["format"], int(d["tokens"]), int(d["created"]),
                                  torch.tensor(d["context_ids"], dtype=torch.long))
                    for d in json.loads(self.path.read_text())]
        except (OSError, ValueError, KeyError, TypeError) as e:
            logging.getLogger(__name__).warning("the pinned contexts' list %s is unreadable (%s): ignored",
                                                self.path, e)
            return []

    def _save(self) -> None:
        """Write the list (the lock held): to a temporary name, then renamed over the old one."""
        if self.path is None:
            return
        items = [{"id": p.id, "key": p.key, "format": p.format, "tokens": p.tokens, "created": p.created,
                  "context_ids": p.context_ids.tolist()} for p in self._items.values()]
        tmp = self.path.with_name(f"{self.path.name}.tmp-{uuid.uuid4().hex}")
        tmp.write_text(json.dumps(items))
        os.replace(tmp, self.path)

    def get(self, cid: str) -> Optional[PinnedContext]:
        with self._lock:
            return self._items.get(cid)

    def reserve(self, cid: str) -> None:
        """Take a place for ``cid`` (RequestError when the registry is full; a cid pinned or being encoded already
        takes no second place)."""
        with self._lock:
            if cid not in self._items and cid not in self._reserved and \
                    len(self._items) + len(self._reserved) >= self.limit:
                raise RequestError(f"this server pins at most {self.limit} contexts (--max-contexts); DELETE "
                                   f"/v1/contexts/{{id}} one first", "context")
            self._reserved[cid] = self._reserved.get(cid, 0) + 1

    def unreserve(self, cid: str) -> bool:
        """Give back a place :meth:`reserve` took; returns whether ``cid`` is now neither pinned nor being encoded
        (then nothing holds its encoded KV: the caller releases it)."""
        with self._lock:
            self._give_back(cid)
            return cid not in self._items and cid not in self._reserved

    def add(self, item: PinnedContext) -> None:
        """Pin ``item`` in the place :meth:`reserve` took for it."""
        with self._lock:
            self._items[item.id] = item
            self._give_back(item.id)
            self._save()

    def _give_back(self, cid: str) -> None:
        """One reservation of ``cid`` fewer (the lock held)."""
        n = self._reserved.get(cid, 0) - 1
        if n > 0:
            self._reserved[cid] = n
        else:
            self._reserved.pop(cid, None)

    def remove(self, cid: str) -> Optional[PinnedContext]:
        with self._lock:
            item = self._items.pop(cid, None)
            self._save()
            return item

    def items(self) -> list[PinnedContext]:
        with self._lock:
            return list(self._items.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


def context_id_of(key: str) -> str:
    """The id of a pinned context: from its cache key, so posting the same document twice gives the same id."""
    return f"ctx-{key}"
