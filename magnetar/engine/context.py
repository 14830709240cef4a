"""Encoded contexts: :class:`ContextHandle` (one context's Phase 1, kept on every rank) and :class:`ContextCache`.

Phase 1 of Star, Pulsar, Ring and dense does not depend on the question, so a context encoded once can answer
any number of questions (``Engine.ask``). The engine keeps recent handles in a :class:`ContextCache` under a byte
budget (``runtime.context_cache_mb``); a request whose context token ids match a cached handle reuses it and
skips Phase 1. A request whose context *starts with* a cached context (the next turn of a conversation, a shared
document with more after it) can reuse that prefix: :meth:`ContextCache.longest_prefix` finds it and the encoder
extends it (``Encoder.encode``: only the new tokens are run).

Every rank of a replica holds its own handle object (its own KV shard) under the same key, and every rank makes
the same cache decisions: the budget counts a handle's largest shard over the ranks (gathered once at encode),
so no rank evicts what another keeps -- a rank that skipped Phase 1 while its peers ran it would leave them
waiting in a collective.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import torch

from magnetar.engine.kv import KVArena, KVShard


def context_key(context_ids: torch.Tensor, options: str = "") -> str:
    """The cache key of a context: a blake2b digest of its int64 token ids (and their count) and of ``options``,
    the engine options that shape its KV (``Engine.cache_key`` passes them: method, blocks, pulsar, ...)."""
    ids = context_ids.reshape(-1).to(torch.int64).cpu().contiguous()
    h = hashlib.blake2b(digest_size=16)
    h.update(int(ids.numel()).to_bytes(8, "little"))
    h.update(ids.numpy().tobytes())
    h.update(options.encode())
    return h.hexdigest()


@dataclass(eq=False)
class ContextHandle:
    """One context encoded by Phase 1 on every rank of the replica; this object holds this rank's part.

    ``shard`` is frozen and never changed by a question: each question decodes over its own
    :meth:`~magnetar.engine.kv.KVShard.view`. ``stats`` are the Phase-1 figures this process measured (one per
    CP rank when simulated, else this rank's); ``nbytes`` the most KV bytes a process of the replica holds for it --
    the largest shard over the ranks; simulated, every rank's (one process holds them) -- what the cache and store
    budgets count, the same on every rank.
    """

    key: str
    context_ids: torch.Tensor  # (L,) int64 on CPU
    shard: KVShard
    query_position: int  # the RoPE position of the first query token
    stats: list = field(repr=False)  # list[magnetar.engine.engine.RankStats]
    prefill_stats: Optional[dict]
    nbytes: int
    method: str = ""  # the method that encoded it (an engine's variant may encode with another than its own)
    # the engine that encoded it (Engine.identity, shared with its variants): a handle answers on that engine only
    engine: str = ""
    options: str = ""  # a digest of the encoding options (Encoder.kv_options): a prefix extends only its own kind
    reused_tokens: int = 0  # its first tokens' KV came from a cached prefix handle (0: all encoded by Phase 1)
    # (V,) float32 on CPU: the logits at the context's last position, where Phase 1 (one CP rank, no TP) or an
    # extension computed them -- what a scored prompt's first query token is given; None elsewhere
    last_logits: Optional[torch.Tensor] = field(default=None, repr=False)
    # the context it extends (Encoder.extend): that context's key and this rank's KV entries of it per layer -- the
    # first entries of this shard; None: encoded whole. A lower tier files it so that a copy loaded back rejoins the
    # cached context it extends (Encoder._stored) instead of holding that context's KV again
    base: Optional[tuple[str, tuple[int, ...]]] = field(default=None, repr=False)

    @property
    def context_tokens(self) -> int:
        return int(self.context_ids.numel())


def _arenas(handle: ContextHandle) -> tuple[KVArena, ...]:
    """The arenas whose buffers ``handle``'s KV views (a fork's: its document's, then its own), or () (its own
    tensors)."""
    return () if handle.shard is None else handle.shard.arenas()


PREFIX_BLOCK = 64  # tokens per block of the prefix index's chained hashes


class Prefixes:
    """The chained block hashes of one id sequence, computed as far as asked: ``digest(n)`` names its first ``n``
    tokens in O(n mod PREFIX_BLOCK) once the blocks before are hashed (each block once)."""

    def __init__(self, ids: torch.Tensor):
        self.data = ids.reshape(-1).to(torch.int64).cpu().contiguous().numpy().tobytes()
        self.chain = [b""]  # chain[k]: the hash of the first k blocks

    def digest(self, n: int) -> bytes:
        m, width = n // PREFIX_BLOCK, PREFIX_BLOCK * 8
        while len(self.chain) <= m:
            k = len(self.chain) - 1
            self.chain.append(hashlib.blake2b(self.chain[k] + self.data[k * width:(k + 1) * width],
                                              digest_size=16).digest())
        tail = self.data[m * width:n * 8]
        return hashlib.blake2b(self.chain[m] + tail + n.to_bytes(8, "little"), digest_size=16).digest()


def prefix_digest(ids: torch.Tensor, n: int) -> str:
    """The hex digest naming the first ``n`` tokens of ``ids`` (:class:`Prefixes`; the disk tier files it)."""
    return Prefixes(ids).digest(n).hex()


class ContextCache:
    """Handles by key, least recently used first out, within ``budget_bytes`` (0: nothing is kept).

    A handle larger than the whole budget is not kept. Eviction only drops the cache's reference: a question
    still decoding over an evicted handle keeps it alive until it is done.

    Finding the longest cached prefix of a context is indexed, not a scan of every handle: each handle is filed
    under its engine, options, length and a chained hash of its ids (blocks of :data:`PREFIX_BLOCK` tokens), so a
    look-up hashes the context's blocks once and then tries each distinct cached length, longest first -- a server
    holding thousands of small contexts no longer slows every tick. The byte total is kept as handles come and go.

    Handles whose shards share a :class:`~magnetar.engine.kv.KVArena` (a conversation's turns: each extends the last
    in place) are counted once: the arena's ``charged`` bytes while any of them is kept -- evicting one turn frees
    nothing while a later one views the same buffers. A fork (another conversation's turn off the same document:
    :meth:`~magnetar.engine.kv.KVShard.extended`) is counted in the document's arena and in its own, so the
    document's KV is counted while any conversation over it is kept, and once however many there are. Every figure
    counted is the same on every rank (a handle's ``nbytes``, an arena's ``charged``: both the largest rank's), and
    so is which handles share an arena.
    """

    def __init__(self, budget_bytes: int):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be an int >= 0, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._handles: OrderedDict[str, ContextHandle] = OrderedDict()
        self._nbytes = 0
        self._index: dict[tuple, str] = {}  # (engine, options, length, prefix digest) -> key
        self._filed: dict[str, tuple] = {}  # key -> its index entry
        self._lengths: dict[tuple, dict[int, int]] = {}  # (engine, options) -> {length: handles of that length}
        self._counted: dict[str, tuple[KVArena, ...]] = {}  # key -> the arenas it is counted in (none: alone)
        self._arenas: dict[KVArena, list] = {}  # arena -> [the keys of its handles kept, the bytes counted for it]
        self._by_shard: dict[int, str] = {}  # id(handle.shard) -> key (an arena's members, found by their shards)
        self.hits = self.misses = self.evictions = self.prefix_hits = 0
        self.warned = False  # the encoder said once that a context larger than the budget is not kept
        self.on_evict = None  # called with each handle the budget evicts (the host-memory tier keeps it)

    def __len__(self) -> int:
        return len(self._handles)

    def __contains__(self, key: str) -> bool:
        return key in self._handles

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def handles(self) -> list[ContextHandle]:
        """The kept handles, least recently used first (not counted as hits)."""
        return list(self._handles.values())

    def get(self, key: str) -> Optional[ContextHandle]:
        """The cached handle of ``key`` (now the most recently used; counted as a hit), or None (a miss)."""
        handle = self._handles.get(key)
        if handle is None:
            self.misses += 1
            return None
        self._handles.move_to_end(key)
        self.hits += 1
        return handle

    def peek(self, key: str) -> Optional[ContextHandle]:
        """The cached handle of ``key`` or None, as it is: not counted, not made the most recently used."""
        return self._handles.get(key)

    def longest_prefix(self, context_ids: torch.Tensor, engine: str, options: str) -> Optional[ContextHandle]:
        """The cached handle of the same engine and options whose context is the longest proper prefix of
        ``context_ids`` (now the most recently used), or None. Not counted as a hit or a miss: the caller counts
        ``prefix_hits`` when it extends it."""
        best = self._longest_prefix(context_ids, engine, options)
        if best is not None:
            self._handles.move_to_end(best.key)
        return best

    def prefix_tokens(self, context_ids: torch.Tensor, engine: str, options: str) -> int:
        """How many first tokens of ``context_ids`` the longest cached proper prefix of the same engine and options
        holds (0: none), without touching the recency order (a server's leader plans with it; the ranks' caches
        must stay alike)."""
        best = self._longest_prefix(context_ids, engine, options)
        return 0 if best is None else best.context_tokens

    def _longest_prefix(self, context_ids: torch.Tensor, engine: str, options: str) -> Optional[ContextHandle]:
        lengths = self._lengths.get((engine, options))
        ids = context_ids.reshape(-1)
        if not lengths:
            return None
        prefixes = Prefixes(ids)
        for n in sorted((n for n in lengths if n < ids.numel()), reverse=True):
            key = self._index.get((engine, options, n, prefixes.digest(n)))
            handle = self._handles.get(key) if key is not None else None
            if handle is not None and torch.equal(ids[:n], handle.context_ids):  # a hash collision is no prefix
                return handle
        return None

    def put(self, handle: ContextHandle) -> bool:
        """Keep ``handle`` (most recently used), evicting the least recently used ones until the budget holds;
        returns whether it is kept."""
        self._remove(handle.key)
        arenas = _arenas(handle)
        for arena in arenas:
            self.regroup(arena)
        if (sum(a.charged for a in arenas) if arenas else handle.nbytes) > self.budget_bytes:
            return False
        while self._handles and self._nbytes + self._adds(handle) > self.budget_bytes:
            self._evict_oldest(spare=arenas)
        self._handles[handle.key] = handle
        self._count(handle)
        n, kind = handle.context_tokens, (handle.engine, handle.options)
        entry = (*kind, n, Prefixes(handle.context_ids).digest(n))
        self._index[entry], self._filed[handle.key] = handle.key, entry
        counts = self._lengths.setdefault(kind, {})
        counts[n] = counts.get(n, 0) + 1
        return True

    def regroup(self, arena: KVArena) -> None:
        """``arena`` grew or took in a kept handle (an extension just made, kept or not): its kept members are
        counted in it, at its ``charged`` bytes now, evicting the least recently used handles while the total
        exceeds the budget."""
        self._regroup(arena)
        while self._handles and self._nbytes > self.budget_bytes:
            self._evict_oldest(spare=(arena,))

    def _regroup(self, arena: KVArena) -> None:
        for shard in list(arena.members):
            key = self._by_shard.get(id(shard))
            if key is not None and arena not in self._counted[key]:  # counted alone before it joined the arena
                handle = self._handles[key]
                self._uncount(handle)
                self._count(handle)
        group = self._arenas.get(arena)
        if group is not None:
            self._nbytes += arena.charged - group[1]
            group[1] = arena.charged

    def _adds(self, handle: ContextHandle) -> int:
        """The bytes keeping ``handle`` adds to the total."""
        arenas = _arenas(handle)
        if not arenas:
            return handle.nbytes
        return sum(a.charged - (0 if a not in self._arenas else self._arenas[a][1]) for a in arenas)

    def _count(self, handle: ContextHandle) -> None:
        arenas = _arenas(handle)
        self._counted[handle.key] = arenas
        if handle.shard is not None:
            self._by_shard[id(handle.shard)] = handle.key
        if not arenas:
            self._nbytes += handle.nbytes
        for arena in arenas:  # a fork is counted in its document's arena too: kept while the fork is
            group = self._arenas.setdefault(arena, [set(), 0])
            group[0].add(handle.key)
            self._nbytes += arena.charged - group[1]
            group[1] = arena.charged

    def _uncount(self, handle: ContextHandle) -> None:
        arenas = self._counted.pop(handle.key)
        self._by_shard.pop(id(handle.shard), None)
        if not arenas:
            self._nbytes -= handle.nbytes
        for arena in arenas:
            group = self._arenas[arena]
            group[0].discard(handle.key)
            if not group[0]:
                self._nbytes -= group[1]
                del self._arenas[arena]

    def release(self, handle_or_key) -> bool:
        """Drop a handle (or key) from the cache; returns whether it was there."""
        key = handle_or_key.key if isinstance(handle_or_key, ContextHandle) else handle_or_key
        handle = self._handles.get(key)
        if not self._remove(key):
            return False
        self._trim(handle)
        return True

    def _trim(self, gone: ContextHandle, spare: tuple = ()) -> None:
        """After ``gone`` left: each arena it was counted in whose kept handles now reach less far than its tip (a
        conversation's later turns evicted while its document, or an earlier turn, is kept -- say for the
        conversations forking from it) is cut down to what they reach (:meth:`KVArena.trim`), and counted at its
        ``charged`` bytes scaled by the tokens kept (an estimate the same on every rank). Decided from the kept
        handles' context tokens: every rank trims alike."""
        for arena in _arenas(gone):
            group = self._arenas.get(arena)
            if group is None or arena in spare:  # nothing of it kept (it goes with its last reader), or growing
                continue
            reach, keep = max((self._handles[k].shard.reach(arena, self._handles[k].context_tokens)
                               for k in sorted(group[0])), key=lambda r: r[0])
            if keep is None or not 0 < reach < arena.tip:
                continue
            tip = arena.tip
            if arena.trim(reach, keep):
                arena.charged = -(-arena.charged * reach // tip)
                self._nbytes += arena.charged - group[1]
                group[1] = arena.charged

    def shed(self) -> int:
        """Evict every handle, least recently used first, as the budget would (``on_evict`` -- the host-memory tier
        -- gets each): what a rank that ran out of device memory drops (:func:`magnetar.engine.memory.relieve`).
        Returns the bytes dropped."""
        dropped = self._nbytes
        while self._handles:
            self._evict_oldest(trim=False)  # nothing is kept: no arena is cut (a copy, where memory ran out)
        return dropped

    def _evict_oldest(self, spare: tuple = (), trim: bool = True) -> None:
        """Evict the least recently used handle (``on_evict`` gets it), then cut the arenas it leaves (but those in
        ``spare``: the arena of a handle being kept, whose newest turn is not counted yet)."""
        victim = self._handles[next(iter(self._handles))]
        self._remove(victim.key)
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(victim)
        if trim:
            self._trim(victim, spare)

    def clear(self) -> None:
        self._handles.clear()
        self._index.clear()
        self._filed.clear()
        self._lengths.clear()
        self._counted.clear()
        self._arenas.clear()
        self._by_shard.clear()
        self._nbytes = 0

    def _remove(self, key: str) -> bool:
        handle = self._handles.pop(key, None)
        if handle is None:
            return False
        self._uncount(handle)
        entry = self._filed.pop(key)
        if self._index.get(entry) == key:
            del self._index[entry]
        n, kind = handle.context_tokens, (handle.engine, handle.options)
        counts = self._lengths[kind]
        counts[n] -= 1
        if not counts[n]:
            del counts[n]
        if not counts:
            del self._lengths[kind]
        return True

    def stats(self) -> dict:
        return dict(handles=len(self._handles), bytes=self._nbytes, budget_bytes=self.budget_bytes, hits=self.hits,
                    misses=self.misses, evictions=self.evictions, prefix_hits=self.prefix_hits)
