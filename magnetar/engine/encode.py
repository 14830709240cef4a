"""Context ids -> :class:`~magnetar.engine.context.ContextHandle`: the context cache and Phase 1, distributed or
simulated, behind one return type.

:class:`Encoder` holds what Phase 1 needs (model, config, groups, the decode policy whose Phase-1 mass it may
record, the sparse-prefill policy) and the context cache it shares with the engine's variants. :meth:`Encoder.phase1`
runs this rank's Phase 1 -- or, with ``simulate``, every CP rank's in turn in this process -- and returns a
:class:`Phase1Output`; ``if simulated`` lives here alone. The ranks agree on the block plan, on finiteness and on the
largest shard in one gather. This module knows strategies only through :mod:`magnetar.engine.strategy`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from magnetar.config import METHODS, EngineConfig, FieldError
from magnetar.engine.context import ContextCache, ContextHandle, Prefixes, context_key, prefix_digest
from magnetar.engine.finite import HINT, NonFiniteError, describe
from magnetar.engine.kv import KVShard
from magnetar.engine.memory import ContextTooLarge, phase1_need, room_problem
from magnetar.engine.phase1 import run_extension, run_phase1
from magnetar.engine.phase2 import run_teacher_forced
from magnetar.engine.plan import kept_in, kept_token_count
from magnetar.engine.results import RankStats, peak_memory
from magnetar.engine.store import ContextStore, HostTier
from magnetar.engine.strategy import (DecodePolicy, PrefillPolicy, PrefillStats, SimulatedRing, check_model,
                                      context_method, plan_for_length, plan_rank)
from magnetar.parallel import ParallelGroups, contiguous_indices, zigzag_indices
from magnetar.parallel.collectives import all_gather_ints, all_gather_numbers, broadcast_tensor
from magnetar.parallel.ring import ExchangeClock

log = logging.getLogger(__name__)


SPREAD_BLOCK = 64  # an extension's new tokens are dealt to the CP ranks in blocks of this many


def spread_blocks(counts: Sequence[int], n: int, block: int = SPREAD_BLOCK) -> torch.Tensor:
    """Which CP rank keeps each of ``n`` new tokens ``(n,)``: blocks of ``block`` tokens in order, each to the rank
    holding the fewest context tokens so far (``counts``, one per rank; ties to the first), counted as they are
    dealt -- the same on every rank."""
    load, owners = list(counts), torch.empty(n, dtype=torch.long)
    for a in range(0, n, block):
        r = min(range(len(load)), key=lambda i: (load[i], i))
        b = min(block, n - a)
        owners[a:a + b] = r
        load[r] += b
    return owners


def kv_options(config: EngineConfig) -> str:
    """The options of ``config`` that shape an encoded context's KV, as a stable string (a cache-key part): all
    but the decoding (and how its steps run), the timeout, how simulated ranks are timed, the cache budget and the
    finiteness check."""
    d = config.to_dict()
    d.pop("decode", None)
    for name in ("timeout_s", "rank_by_rank"):
        d["parallel"].pop(name, None)
    for name in ("context_cache_mb", "host_cache_mb", "context_store", "context_store_mb", "check_finite",
                 "prefix_reuse", "decode_step", "decode_graph_batches", "decode_graph_tokens", "decode_graph_warmup_s"):
        d["runtime"].pop(name, None)
    return json.dumps(d, sort_keys=True, default=str)


@dataclass(frozen=True)
class Phase1Output:
    """One context's Phase 1 on this process: its KV ``shard`` (this rank's; simulated: every rank's joined), the
    RoPE position of the first query token, per-rank figures (``stats``: this rank's, or every simulated rank's),
    the most KV bytes a process of the replica holds for it (``held_bytes``: the largest shard over the CP ranks;
    simulated: every rank's, which the one process holds -- what the cache and store budgets count, the same on every
    rank) and the sparse-prefill counts of every rank summed (``prefill_stats``, a ``PrefillStats``; None without
    sparse prefill)."""

    shard: KVShard
    query_position: int
    stats: list[RankStats]
    held_bytes: int
    prefill_stats: Optional[PrefillStats] = None
    last_logits: Optional[torch.Tensor] = None  # (V,): the context's last position (one CP rank only, else None)


@dataclass(frozen=True)
class KVRoom:
    """What a fresh Phase 1 checks first (:func:`magnetar.engine.memory.room_problem`): at least ``per_token`` KV
    bytes a context token keeps, the ``room`` bytes the smallest device of the replica holds beside the weights
    (the same on every rank: one gather when the engine starts) and at least ``act_per_token`` activation bytes a
    token of a Phase-1 forward holds at a layer's MLP (:func:`~magnetar.engine.memory.mlp_bytes_per_token`).
    ``per_token`` 0: nothing is checked."""

    per_token: int = 0
    room: int = 0
    act_per_token: int = 0


class Encoder:
    """Phase 1 and the context cache for one engine configuration (an engine's variants each have their own
    encoder over the same model, groups, policies and cache). ``identity`` is stamped on every handle it makes."""

    def __init__(self, model, config: EngineConfig, groups: ParallelGroups, device: torch.device,
                 cache: ContextCache, identity: str, *, policy: Optional[DecodePolicy] = None,
                 prefill: Optional[PrefillPolicy] = None, store: Optional[ContextStore] = None,
                 host: Optional[HostTier] = None, room: KVRoom = KVRoom()):
        self.model, self.config, self.groups, self.device = model, config, groups, device
        self.cache, self.identity, self.policy, self.prefill = cache, identity, policy, prefill
        self.room = room
        # the cache's lower tiers, shared with the variants: host memory (what the cache evicts), then disk
        self.store, self.host = store, host
        self.tiers = tuple(t for t in (host, store) if t is not None)
        check_model(config, model.config.num_hidden_layers)  # e.g. a hybrid layer outside the model: before compute
        self.kv_options = kv_options(config)
        self.options_digest = hashlib.blake2b(self.kv_options.encode(), digest_size=8).hexdigest()

    def with_config(self, config: EngineConfig) -> "Encoder":
        """This encoder with another configuration (a per-request variant): the same cache, policies, identity."""
        return Encoder(self.model, config, self.groups, self.device, self.cache, self.identity, policy=self.policy,
                       prefill=self.prefill, store=self.store, host=self.host, room=self.room)

    @property
    def simulated(self) -> bool:
        """True when this process stands in for ``cp_size`` ranks (``config.parallel.simulate``)."""
        return self.config.parallel.simulate and self.config.parallel.cp_size > 1

    def key(self, context_ids: torch.Tensor) -> str:
        """The cache key of ``context_ids`` encoded with this configuration."""
        return context_key(context_ids, self.kv_options)

    def check_handle(self, h, name: str) -> None:
        """ValueError naming ``name`` unless ``h`` is a handle this engine (or one of its variants) encoded: its KV
        belongs to that engine's model and weights."""
        if not isinstance(h, ContextHandle) or h.shard is None:
            raise FieldError(f"{name} must be a ContextHandle from this engine's encode(), got {type(h).__name__}",
                             name)
        if h.engine != self.identity:
            made = h.engine.rsplit(":", 1)[0] if h.engine else "no engine"
            raise FieldError(f"{name} was encoded by another engine ({made}), not this one "
                             f"({self.identity.rsplit(':', 1)[0]}): its KV belongs to that engine's model and "
                             f"weights, so it answers only there; encode the context with this engine "
                             f"(engine.encode(context)) and ask with that handle", name)

    def encode(self, context_ids: torch.Tensor, key: Optional[str] = None, *, base: Optional[ContextHandle] = None,
               keep: bool = True) -> tuple[ContextHandle, bool]:
        """(the handle of ``context_ids``, whether it came from the cache); Phase 1 runs on a miss (every rank of
        the replica calls it with the same ids). ``key``: :meth:`key` of the ids, when the caller has it.

        ``base``: a handle of a proper prefix of ``context_ids`` that the caller holds (a request's own earlier
        Phase-1 chunk): extended whatever the cache keeps, where this configuration extends prefixes
        (:meth:`can_extend`), instead of looking for a cached prefix. ``keep=False``: the handle is not put in the
        cache (a partial context only its request extends)."""
        key = self.key(context_ids) if key is None else key
        cached = self.cache.get(key) if keep else None
        if cached is not None:
            return cached, True
        stored = self._stored(key, context_ids) if keep and base is None else None
        if stored is not None:  # a lower tier had it on every rank: no Phase 1
            self.cache.put(stored)
            return stored, True
        if base is not None and self.can_extend() is not None:
            base = None
        base = self._prefix(context_ids) if base is None else base
        if base is not None:
            handle = self.extend(base, context_ids, key)
            self.cache.prefix_hits += 1
        else:
            out = self.phase1(context_ids)
            prefill = None if out.prefill_stats is None else out.prefill_stats.as_dict()
            handle = ContextHandle(key, context_ids, out.shard, out.query_position, out.stats, prefill,
                                   out.held_bytes, self.config.method, engine=self.identity,
                                   options=self.options_digest, last_logits=out.last_logits)
        budget = self.cache.budget_bytes  # 0: the user keeps nothing on purpose
        if keep and not self.cache.put(handle) and handle.nbytes > budget > 0 and not self.cache.warned:
            self.cache.warned = True  # once per cache: every such context would say it again
            log.warning("a context of %d tokens holds %.0f MiB of KV in a process (its largest rank), more than the "
                        "whole context cache (runtime.context_cache_mb = %d MiB, --context-cache-mb): it is not kept, "
                        "and its next question runs its Phase 1 again; raise the budget to keep such contexts",
                        handle.context_tokens, handle.nbytes / 2**20, budget // 2**20)
        if keep and self.store is not None:
            self.store.save(handle, prefix_digest(context_ids, handle.context_tokens), base=base)
        return handle, False

    # -- the lower tiers: host memory, disk --------------------------------------------------------------------
    def _agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank of the replica (one gather; simulated: this process's)."""
        if self.simulated:
            return flag
        g = self.groups
        return bool(all_gather_ints([int(flag)], g.replica_group, self.device, timeout=g.timeout).min() == 1)

    def _stored(self, key: str, context_ids: torch.Tensor) -> Optional[ContextHandle]:
        """The handle of ``key`` from the first lower tier (host memory, then disk) where every rank holds it and it
        loads (a gather per tier asked, another when one has it), else None. Every rank of the replica calls it
        alike (a cache miss)."""
        for tier in self.tiers:
            if not self._agree(key in tier):
                continue
            rejoined, tried = self._rejoined(tier, key, context_ids)
            if rejoined is not None:
                return rejoined
            if tried and not self._agree(key in tier):  # a damaged context on its way, removed with what continues it
                continue
            loaded = tier.load(key, context_ids, self.device)
            if not self._agree(loaded is not None and loaded["options"] == self.options_digest):
                continue
            return self._handle_of(key, loaded, loaded["shard"], loaded["nbytes"])
        return None

    def _handle_of(self, key: str, loaded: dict, shard: KVShard, nbytes: int,
                   base: Optional[tuple] = None) -> ContextHandle:
        """The handle of ``key`` from what a lower tier loaded (:meth:`ContextStore.load`), holding ``shard``."""
        return ContextHandle(key, loaded["context_ids"], shard, loaded["query_position"], loaded["stats"],
                             loaded["prefill_stats"], nbytes, loaded["method"], engine=self.identity,
                             options=self.options_digest, last_logits=loaded["last_logits"], base=base)

    def comes_back(self, key: str, seen: frozenset = frozenset()) -> bool:
        """Whether ``key``'s context comes back on this rank without a Phase 1: the cache holds it, a lower tier holds
        it loadable alone (a disk file with the files it continues, a whole host copy), or a tier holds the KV it adds
        to a context that comes back so (a fork's own entries in host memory, after its document). ``seen``: the
        keys on the way (a loop guard)."""
        return key in self.cache or any(self._loads_from(t, key, seen) for t in self.tiers)

    def _loads_from(self, tier, key: str, seen: frozenset) -> bool:
        """Whether ``tier`` holds ``key``'s context and it loads from there: alone, or after a context that comes
        back (:meth:`comes_back`)."""
        if key not in tier or key in seen:
            return False
        if tier.loads_alone(key):
            return True
        link = tier.parent(key)
        return link is not None and self.comes_back(link[0], seen | {key})

    def _lineage(self, tier, key: str) -> tuple[list[tuple[str, object]], Optional[ContextHandle]]:
        """The stored contexts that lead to ``key`` (in ``tier``), each extending the one before, with the lower tier
        each is taken from (the first that holds it: host memory, then disk), ``key`` last; and the cached handle the
        first extends -- or None: the first is loaded whole (it extends nothing, or what it extends is neither cached
        nor in a lower tier). This rank's view: the caller agrees on it."""
        way, seen = [(key, tier)], {key}
        link = tier.parent(key)
        while link is not None and link[0] not in seen and link[0] not in self.cache:
            holder = next((t for t in self.tiers if link[0] in t), None)
            if holder is None:
                break
            way.append((link[0], holder))
            seen.add(link[0])
            link = holder.parent(link[0])
        base = self.cache.peek(link[0]) if link is not None else None
        return way[::-1], base

    def _rejoined(self, tier, key: str, context_ids: torch.Tensor) -> tuple[Optional[ContextHandle], bool]:
        """``key``'s context loaded from ``tier`` as the extension it was (:attr:`ContextHandle.base`), or None (the
        caller loads it whole); and whether a load was tried. Each context a lower tier holds on the way from a cached
        one (or from one that extends nothing) to ``key`` is loaded as the KV it adds, written after the one before
        as :meth:`extend` writes a turn (:meth:`KVShard.extended`: in place at its arena's tip, else a fork sharing
        it) and kept in the cache -- so conversations over one document, loaded back after an eviction or a restart,
        share its KV again (and their turns one arena each) instead of holding a copy each. Only where this
        configuration extends prefixes (the KV a context adds then joins any encoding of its prefix, as it did when
        it was made); every rank agrees on the way first (one gather), then on each load."""
        if self.can_extend() is not None or tier.parent(key) is None:
            return None, False
        way, base = self._lineage(tier, key)
        if base is None and len(way) == 1:
            return None, False  # nothing to rejoin: the whole load
        if not self.simulated:
            named = [f"{k}@{self.tiers.index(t)}" for k, t in way] + ["" if base is None else base.key]
            sign = hashlib.blake2b("|".join(named).encode(), digest_size=7)
            mine = [len(way), int.from_bytes(sign.digest(), "little")]
            g = self.groups
            got = all_gather_ints(mine, g.replica_group, self.device, timeout=g.timeout)
            if not bool((got == got[0]).all()):
                return None, False
        prev = base
        for k, holder in way:
            link = holder.parent(k) if prev is not None else None
            if prev is not None and (link is None or link[0] != prev.key):  # changed meanwhile (another thread)
                loaded = None
            else:
                loaded = holder.load(k, None, self.device, after=None if link is None else link[1])
            ids = None if loaded is None else loaded["context_ids"]
            ok = loaded is not None and loaded["options"] == self.options_digest
            if ok and prev is not None:  # it continues what it is written after
                n = prev.context_tokens
                ok = ids.numel() > n and torch.equal(ids[:n], prev.context_ids)
            if ok and k == key:
                ok = torch.equal(ids, context_ids.reshape(-1).cpu())
            if not self._agree(ok):
                return None, True
            if prev is None:
                handle = self._handle_of(k, loaded, loaded["shard"], loaded["nbytes"])
            else:
                shard = KVShard.extended(prev.shard, loaded["shard"], prev.context_tokens, int(ids.numel()))
                handle = self._handle_of(k, loaded, shard, self._largest(shard), (prev.key, prev.shard.lengths()))
            if k != key:  # an earlier turn, or the document: what the next ones (and other conversations) extend
                self.cache.put(handle)
            prev = handle
        return prev, True

    def tier_prefix_tokens(self, context_ids: torch.Tensor) -> int:
        """The length of the longest proper prefix of ``context_ids`` (of this engine's options) that a lower tier
        holds on this rank (0: none)."""
        if not self.tiers:
            return 0
        ids = context_ids.reshape(-1)
        prefixes = Prefixes(ids)
        return max(t.longest_prefix(ids, self.options_digest, lambda m: prefixes.digest(m).hex(), self.comes_back)
                   for t in self.tiers)

    def held_tokens(self, context_ids: torch.Tensor, key: str) -> int:
        """How many first tokens of ``context_ids`` (cache key ``key``) a kept context holds on this rank, for the
        admission (:meth:`check_room`'s ``cached``): all of them when a lower tier holds the context itself (loaded,
        not encoded); else the longest proper prefix the cache or a lower tier holds, where this configuration
        extends prefixes; else 0. The tiers keep and drop alike on every rank (each context counted the same), as
        the cache does; where one rank's differs, the encoding agrees before it loads (a rank may then run a Phase 1
        the admission counted as a load -- a failed allocation then fails that request alone)."""
        if self.comes_back(key):  # (a fork's own entries in host memory: only while its document comes back)
            return int(context_ids.numel())
        if self.can_extend() is not None:
            return 0
        return max(self.cache.prefix_tokens(context_ids, self.identity, self.options_digest),
                   self.tier_prefix_tokens(context_ids))

    def _stored_prefix(self, context_ids: torch.Tensor) -> Optional[ContextHandle]:
        """The longest proper prefix of ``context_ids`` that a lower tier holds on every rank, loaded (into the
        memory cache too), or None. The ranks agree on its length first (each may have dropped other entries)."""
        if not self.tiers:
            return None
        ids = context_ids.reshape(-1)
        n = self.tier_prefix_tokens(ids)
        lengths = [n] if self.simulated else all_gather_ints(
            [n], self.groups.replica_group, self.device, timeout=self.groups.timeout)[:, 0].tolist()
        if n == 0 or len(set(lengths)) != 1:
            return None
        handle = self._stored(self.key(ids[:n]), ids[:n])
        if handle is not None:
            self.cache.put(handle)
        return handle

    # -- prefix reuse -----------------------------------------------------------------------------------------
    def can_extend(self) -> Optional[str]:
        """Why this configuration does not extend cached prefixes (``runtime.prefix_reuse``), or None."""
        mode, method = self.config.runtime.prefix_reuse, self.config.method
        if mode == "off":
            return "runtime.prefix_reuse is off"
        # the registry's facts: "exact" extends a method whose Phase 1 is exact attention (the extension is then the
        # fresh Phase 1); "all" also one whose KV partitions the context (every token kept once: new KV can join it)
        spec = METHODS[method]
        if not (spec.exact if mode == "exact" else spec.partitions):
            return (f"method {method!r} is not extended with prefix_reuse {mode!r}" +
                    (" (its Phase 1 is approximate: prefix_reuse 'all' extends it)" if spec.partitions else ""))
        if self.prefill is not None:
            return "sparse prefill chooses Phase 1's keys; an extension would attend to all of them"
        if self._mass() is not None:
            return "the decode policy (LuKA) needs every key's Phase-1 attention mass, which an extension has not"
        return None

    def _prefix(self, context_ids: torch.Tensor) -> Optional[ContextHandle]:
        """The cached handle to extend into ``context_ids``: the longest cached (or lower-tier) proper prefix of it,
        of this engine and options, when this configuration extends prefixes -- however many new tokens follow it
        (:meth:`extend` spreads a long extension's work over the CP ranks)."""
        if self.can_extend() is not None:
            return None
        base = self.cache.longest_prefix(context_ids, self.identity, self.options_digest)
        if base is None:  # a lower tier's, when every rank holds it (an earlier turn, evicted or from before a restart)
            base = self._stored_prefix(context_ids)
        return base

    def extend(self, base: ContextHandle, context_ids: torch.Tensor, key: Optional[str] = None) -> ContextHandle:
        """The handle of ``context_ids`` from ``base`` (a handle of its first tokens). New tokens no more than the
        prefix's (a conversation's turn) run as one Phase-2 query over ``base``'s distributed KV (exact attention
        over it, causal among themselves), and their KV is dealt to the CP ranks in blocks of :data:`SPREAD_BLOCK`
        tokens, each block to the rank holding the fewest context tokens (:func:`spread_blocks`; the first CP rank
        computed it and sends each rank its part), so a long conversation's turns do not pile onto one rank; each
        rank writes its part after ``base``'s KV in their shared arena (:meth:`KVShard.extended`: no copy of
        ``base`` when it is the latest turn). More
        (a long document after a cached system prompt), on real CP ranks: each rank encodes its share, as a
        Phase 1 would (:meth:`_extend_spread`). Every rank of the replica calls it alike (the forward is
        collective)."""
        n = base.context_tokens
        new = context_ids.reshape(-1)[n:]
        if new.numel() < 1 or not torch.equal(context_ids.reshape(-1)[:n], base.context_ids):
            raise ValueError("extend: base must hold a proper prefix of context_ids")
        g, added = self.groups, int(new.numel())
        if not self.simulated and g.cp_size > 1 and added > n and added >= 2 * g.cp_size:
            return self._extend_spread(base, context_ids, key)
        t0 = time.perf_counter()
        gen = KVShard(self.model.config.num_hidden_layers) if self.groups.is_cp_leader else None
        logits = run_teacher_forced(self.model, self.config, base.shard.view(), new, base.query_position,
                                    self.groups, self.device, context_tokens=n, gen=gen, every=False)
        if self.simulated:
            counts = [st.context_kv_tokens for st in base.stats]
        else:
            counts = all_gather_ints([base.shard.tokens()], g.cp_group, self.device, timeout=g.timeout)[:, 0].tolist()
        owners = spread_blocks(counts, added)
        # one process holds every rank's KV (the union grows), or this rank keeps what it is dealt
        mine = gen if self.simulated or g.cp_size == 1 else self._deal(base, gen, owners, base.query_position)
        per_token = 0 if mine is None else mine.nbytes() // mine.tokens()
        shard = KVShard.extended(base.shard, mine, n, n + added)  # after base's KV, in place when base is the tip
        seconds = time.perf_counter() - t0
        # stats: this rank's (simulated: every rank's, the first CP rank's first), each grown by the tokens dealt to it
        ranks = range(len(base.stats)) if self.simulated else [g.cp_rank]
        stats = [dataclasses.replace(st, phase1_seconds=seconds if (r == 0 or not self.simulated) else 0.0,
                                     exchange=(), context_kv_tokens=st.context_kv_tokens + int((owners == r).sum()),
                                     kv_bytes=st.kv_bytes + int((owners == r).sum()) * per_token)
                 for r, st in zip(ranks, base.stats)]
        largest = self._largest(shard)
        return ContextHandle(self.key(context_ids) if key is None else key, context_ids.reshape(-1).clone(), shard,
                             base.query_position + added, stats, base.prefill_stats, largest, base.method,
                             engine=self.identity, options=self.options_digest, reused_tokens=n,
                             last_logits=logits[-1].float().cpu(), base=(base.key, base.shard.lengths()))

    def _extend_spread(self, base: ContextHandle, context_ids: torch.Tensor, key: Optional[str]) -> ContextHandle:
        """An extension longer than its prefix, on real CP ranks: each rank encodes its share of the new tokens
        (zigzag or contiguous, as ring's Phase 1 deals a context) in one forward whose every layer attends, exactly,
        to every rank's cached shard and every rank's share (:func:`~magnetar.engine.phase1.run_extension`), and
        keeps its share's KV -- the work spread as a Phase 1's, the prefix's KV reused."""
        g, n = self.groups, base.context_tokens
        new = context_ids.reshape(-1)[n:]
        added = int(new.numel())
        idx = zigzag_indices(added, g.cp_size, g.cp_rank) if self.config.parallel.zigzag else \
            contiguous_indices(added, g.cp_size, g.cp_rank)
        out = run_extension(self.model, self.config, base.shard.view(), new[idx], base.query_position + idx, g,
                            self.device)
        rows = all_gather_ints([-1 if out.nonfinite_layer is None else out.nonfinite_layer, out.shard.tokens()],
                               g.cp_group, self.device, timeout=g.timeout).tolist()
        _check_finite([None if r[0] < 0 else r[0] for r in rows])
        _check_kept([r[1] for r in rows], added)
        shard = KVShard.extended(base.shard, out.shard, n, n + added)
        stats = [dataclasses.replace(st, phase1_seconds=out.seconds,
                                     context_kv_tokens=st.context_kv_tokens + out.shard.tokens(),
                                     kv_bytes=st.kv_bytes + out.shard.nbytes()) for st in base.stats]
        largest = self._largest(shard)
        return ContextHandle(self.key(context_ids) if key is None else key, context_ids.reshape(-1).clone(), shard,
                             base.query_position + added, stats, base.prefill_stats, largest, base.method,
                             engine=self.identity, options=self.options_digest, reused_tokens=n,
                             base=(base.key, base.shard.lengths()))

    def _largest(self, shard: KVShard) -> int:
        """The KV bytes of an extension's ``shard`` on the replica's largest rank (simulated: this process's, which
        holds every rank's) -- its handle's ``nbytes`` -- after raising its arena's ``charged`` to the largest rank's
        buffers (one gather of both): the figures every rank's cache counts alike."""
        mine = [shard.nbytes(), shard.arena.nbytes()]
        if not self.simulated:
            g = self.groups
            mine = all_gather_ints(mine, g.cp_group, self.device, timeout=g.timeout).max(dim=0).values.tolist()
        shard.arena.charged = max(shard.arena.charged, int(mine[1]))
        self.cache.regroup(shard.arena)  # a kept turn before it now lives in the arena, which may have grown
        return int(mine[0])

    def _deal(self, base: ContextHandle, gen: Optional[KVShard], owners: torch.Tensor,
              start: int) -> Optional[KVShard]:
        """This rank's part of an extension's KV: the first CP rank (which holds ``gen``, every new token's KV)
        sends it to every rank of the CP group (one broadcast of all layers' keys and values), and each keeps the
        tokens ``owners`` gives it (at RoPE positions ``start ...``); None when it is given none."""
        g, n = self.groups, int(owners.numel())
        layers = base.shard.num_layers
        ref = next(seg.k for i in range(layers) for seg in base.shard.segments(i))
        shape = (layers, 2, ref.shape[0], ref.shape[1], n, ref.shape[3])
        if gen is not None:
            packed = torch.stack([torch.stack((layer.k, layer.v)) for layer in gen.layers]).contiguous()
        else:
            packed = torch.empty(shape, dtype=ref.dtype, device=ref.device)
        broadcast_tensor(packed, g.cp_ranks[0], g.cp_group, timeout=g.timeout,
                         what=f"the extension's KV broadcast over {g.cp_size} ranks")
        idx = (owners == g.cp_rank).nonzero().reshape(-1).to(packed.device)
        if idx.numel() == 0:
            return None
        pos = (start + torch.arange(n, device=ref.device))[idx.to(ref.device)]
        mine = KVShard(layers)
        for i, layer in enumerate(mine.layers):
            layer.append(packed[i, 0].index_select(2, idx), packed[i, 1].index_select(2, idx), pos)
        mine.freeze()
        return mine

    def phase1(self, context_ids: torch.Tensor, variants: Sequence[Optional[DecodePolicy]] = ()) -> Phase1Output:
        """Phase 1 of ``context_ids`` (no cache); ``variants``: other decode policies the shard will serve (LuKA's
        need the Phase-1 attention mass). A context whose KV and Phase-1 activations certainly cannot fit the device
        is refused first (:meth:`check_room`)."""
        self.check_room(int(context_ids.numel()))
        if self.simulated:
            return self._simulated(context_ids, variants)
        return self._distributed(context_ids, variants)

    def check_room(self, context_tokens: int, chunk: int = 0, cached: int = 0) -> None:
        """:class:`~magnetar.engine.memory.ContextTooLarge` (a ValueError naming ``context``) when a context of
        ``context_tokens`` certainly cannot fit: a method whose KV keeps every context token once (the registry's
        ``partitions``) and no decode policy (which may keep less). The least a process holds at once
        (:func:`~magnetar.engine.memory.phase1_need`): the KV kept so far and the running forward's MLP activations,
        over the forwards of every rank's plan in turn where one process runs them all (simulated ranks, one rank),
        else over the largest CP rank's -- against what the smallest device of the replica holds beside the weights
        (:class:`KVRoom`). Every rank decides alike on the same figures: no collective. ``chunk``: the caller encodes
        a longer context in chunks of this many tokens, each extending the last (a server's ``--prefill-chunk``,
        where :meth:`Engine.chunk_problem` is None): one process runs them in turn, the KV so far beside the running
        chunk's activations (its KV grows in place: :meth:`~magnetar.engine.kv.KVShard.extended`). ``cached``: the
        first tokens a kept handle holds already (:meth:`extend` runs only the rest: a conversation's next turn), so
        the activations are the new tokens' (or their chunks'), beside the whole context's KV -- on real CP ranks at
        least the largest rank's share of it (the KV keeps every token once) beside the new tokens' forward (its
        share when :meth:`_extend_spread` deals them); all of them (a lower tier holds the context itself): its KV
        alone, loaded (:meth:`held_tokens`)."""
        room = self.room
        if not room.per_token or self.policy is not None or not METHODS[self.config.method].partitions:
            return
        # a forward processes at most twice the context (its block and a prefix of other context tokens -- an
        # anchor, a halo, a sink, summaries of fewer tokens than they sum up): when even that fits, no share can
        # be larger (the common case: no plans built)
        if context_tokens * (room.per_token + 2 * room.act_per_token) <= room.room:
            return
        cached = max(0, cached)
        added = context_tokens - cached
        if added <= 0:  # held whole by a lower tier: loading it needs its KV, no forward
            kv = context_tokens if self._one_process else -(-context_tokens // self.config.parallel.cp_size)
            need = phase1_need([(kv, 0)], room.per_token, room.act_per_token)
            whole = context_tokens * room.per_token
        elif cached and not self._one_process:  # real CP ranks extend the kept prefix
            W = self.config.parallel.cp_size
            share = -(-added // W) if added > cached and added >= 2 * W else added
            need = phase1_need([(-(-context_tokens // W), share)], room.per_token, room.act_per_token)
            whole = phase1_need([(context_tokens, context_tokens)], room.per_token, room.act_per_token)[0]
        elif (0 < chunk < added or cached) and self._one_process:
            step = chunk if 0 < chunk < added else added  # the new tokens in chunks, or in one forward
            chunks = [(cached, 0)] if cached else []
            chunks += [(min(step, context_tokens - a),) * 2 for a in range(cached, context_tokens, step)]
            need = phase1_need(chunks, room.per_token, room.act_per_token)
            whole = need[0]  # what a shorter context needs encoded the same way
        else:
            need = self.phase1_need(context_tokens)
            whole = phase1_need([(context_tokens, context_tokens)], room.per_token, room.act_per_token)[0]
        problem = room_problem(context_tokens, need, whole, room.room, self.device,
                               one_process=self._one_process, per_token=room.per_token,
                               act_per_token=room.act_per_token)
        if problem is not None:
            raise ContextTooLarge(f"context: {problem}")

    @property
    def _one_process(self) -> bool:
        """Whether this process holds the whole context's Phase 1 (simulated ranks, or one rank)."""
        return self.simulated or self.config.parallel.cp_size == 1

    def phase1_need(self, context_tokens: int) -> tuple[int, int, int]:
        """``(need, kv, activations)``: the least bytes a process holds at once beside the weights during the Phase 1
        of a ``context_tokens``-token context (:func:`~magnetar.engine.memory.phase1_need`, from :class:`KVRoom`'s
        figures): over the forwards of every rank's plan in turn where one process runs them all (simulated ranks --
        ring's one lock-step forward over the whole context --, one rank), else the largest CP rank's."""
        room, W = self.room, self.config.parallel.cp_size
        plans = [plan_for_length(self.config, context_tokens, r) for r in range(W)]
        lockstep = context_method(self.config.method).lockstep(plans) if self.simulated else None
        if lockstep is not None:  # simulated ring: one forward over the whole context first (_simulated)
            plans = [lockstep]
        forwards = [[(kept_in(seg), int(seg.indices.numel())) for seg in plan.segments] for plan in plans]
        if self._one_process:
            return phase1_need([f for rank in forwards for f in rank], room.per_token, room.act_per_token)
        return max(phase1_need(rank, room.per_token, room.act_per_token) for rank in forwards)

    def seconds_per_rank(self, stats: list[RankStats]) -> list[float]:
        """Every CP rank's Phase-1 seconds of one context from its ``stats`` (a Phase1Output's or a handle's: a
        gather unless simulated)."""
        if self.simulated:
            return [s.phase1_seconds for s in stats]
        g = self.groups
        seconds = all_gather_numbers([stats[0].phase1_seconds], g.cp_group, self.device, timeout=g.timeout)
        return seconds[:, 0].tolist()

    # -- the two ways ---------------------------------------------------------------------------------------
    def _distributed(self, context_ids: torch.Tensor, variants) -> Phase1Output:
        plan = plan_rank(self.config, context_ids, self.groups.cp_rank)
        # the context's last logits (a scored prompt's first query token) where they need no collective: one CP
        # rank, its weights whole (a TP rank's LM head may hold a slice of the vocabulary)
        whole = self.groups.cp_size == 1 and self.config.parallel.tp_size == 1
        p1 = run_phase1(self.model, self.config, plan, context_ids, self.groups, self.device,
                        mass=self._mass(variants), prefill=self.prefill, last_logits=whole)
        # one integer gather for the checks, the shard sizes and the sparse-prefill counts
        mine = [kept_token_count(plan), -1 if p1.nonfinite_layer is None else p1.nonfinite_layer, p1.shard.nbytes()]
        if self.prefill is not None:  # a local Phase 1 on every rank: every rank has counts
            mine += p1.prefill_stats.counts()
        g = self.groups
        rows = all_gather_ints(mine, g.cp_group, self.device, timeout=g.timeout).tolist()
        _check_kept([r[0] for r in rows], int(context_ids.numel()))
        _check_finite([None if r[1] < 0 else r[1] for r in rows])
        prefill_stats = None
        if self.prefill is not None:  # every rank's counts of this request, summed
            prefill_stats = p1.prefill_stats.with_counts([sum(col) for col in zip(*(r[3:] for r in rows))])
        stats = RankStats(p1.seconds, p1.shard.tokens(), p1.shard.nbytes())
        return Phase1Output(p1.shard, plan.query_position, [stats], max(r[2] for r in rows), prefill_stats,
                            p1.last_logits)

    def _simulated(self, context_ids: torch.Tensor, variants) -> Phase1Output:
        """Every rank's Phase 1 in turn on this device; their KV joined (Phase 2 over the union equals the merge
        over ranks). A method whose ranks run in lock-step (ring: they exchange KV in every layer) gives one plan
        for all of them, run as one forward: one time for all of them -- or, with ``parallel.rank_by_rank``, that
        forward only supplies every rank's KV, and each rank then runs alone against the others' in the order the
        ring brings them, timed on its own. Each rank's exchange steps (ring's layers, hybrid layers) are timed
        beside the bytes a ring would move (``RankStats.exchange``)."""
        cfg, W = self.config, self.config.parallel.cp_size
        plans = [plan_rank(cfg, context_ids, r) for r in range(W)]
        sizes = [kept_token_count(p) for p in plans]
        _check_kept(sizes, int(context_ids.numel()))
        lockstep, union = context_method(cfg.method).lockstep(plans), None
        if lockstep is not None:  # attention by position over the union: exactly what the ranks compute
            p1 = run_phase1(self.model, cfg.replace(method="dense", cp_size=1), lockstep, context_ids, self.groups,
                            self.device)
            _check_finite([p1.nonfinite_layer])
            if not cfg.parallel.rank_by_rank:
                per_token = p1.shard.nbytes() / max(1, sum(sizes))
                stats = [RankStats(p1.seconds if r == 0 else 0.0, n, int(n * per_token))
                         for r, n in enumerate(sizes)]
                return Phase1Output(p1.shard, plans[0].query_position, stats, p1.shard.nbytes())
            lock, union = p1.shard, p1.shard.split(sizes)  # each rank's part, as the ring would bring it
        parts, stats, prefill_stats = [], [], None
        mass = self._mass(variants)
        # the ranks' own KV is the result, unless the lock-step forward's equals it: then only each rank's time and
        # exchange steps are kept, never the KV twice (a recorded attention mass, a sparse prefill: not in it)
        own = union is None or mass is not None or self.prefill is not None
        for plan in plans:
            r = plan.cp_rank
            if union is not None:  # every other rank's part of the lock-step forward, in ring order
                ring = SimulatedRing([union[(r - s) % W] for s in range(1, W)], ExchangeClock(self.device))
            else:  # the blocks of r-1, ..., 0 (encoded already), then those of W-1, ..., r+1, which follow its
                # queries (only their sizes matter: the ring moves them all the same)
                ring = SimulatedRing(parts[::-1] + sizes[:r:-1], ExchangeClock(self.device))
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            p1 = run_phase1(self.model, cfg, plan, context_ids, self.groups, self.device, mass=mass,
                            prefill=self.prefill, ring=ring)
            if p1.prefill_stats is not None:
                prefill_stats = p1.prefill_stats if prefill_stats is None else prefill_stats.merge(p1.prefill_stats)
            _check_finite([None] * r + [p1.nonfinite_layer])
            if own:
                parts.append(p1.shard)
            stats.append(RankStats(p1.seconds, p1.shard.tokens(), p1.shard.nbytes(), peak_memory(self.device),
                                   exchange=tuple(ring.clock.steps())))
        if len({p.query_position for p in plans}) != 1:
            raise RuntimeError(f"simulated ranks disagree on the query position: {[p.query_position for p in plans]}")
        joined = KVShard.join(parts, consume=True) if own else lock
        return Phase1Output(joined, plans[0].query_position, stats, joined.nbytes(), prefill_stats)

    def _mass(self, variants: Sequence[Optional[DecodePolicy]] = ()):
        """The recorder of the Phase-1 attention mass of every kept key when the decode policy or one of
        ``variants`` needs it (LuKA), else None."""
        for p in (self.policy, *variants):
            if p is not None and p.needs_prefill_mass:
                return p.prefill_mass
        return None


def _check_kept(kept: list[int], context_len: int) -> None:
    if sum(kept) != context_len:  # the KV shards must partition the context exactly
        raise RuntimeError(f"Phase 1 kept {sum(kept)} context tokens over the ranks ({kept}) for a "
                           f"{context_len}-token context; the block plan is inconsistent")


def _check_finite(per_rank: list[Optional[int]]) -> None:
    """Every rank raises the same error when any rank's Phase-1 attention turned non-finite."""
    if any(layer is not None for layer in per_rank):
        raise NonFiniteError(f"non-finite values in Phase 1: {describe(per_rank)}; {HINT}")
