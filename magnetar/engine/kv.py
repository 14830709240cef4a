"""The KV a rank holds: its context shard (from Phase 1) and, on the query rank only, the query's and the
generated tokens' KV (from Phase 2).

Per layer: ``k, v (B, Hkv, n, D)`` post-RoPE, exactly what the model's attention received, and the position
of every entry ``pos (n,)`` (the RoPE position, used for causality). Phase 1 appends pieces (a piece that is part
of a larger tensor -- Star's block after its anchor -- copied as it comes, so the rest is freed with its layer) and
:meth:`KVShard.freeze` concatenates them once (one piece is taken as it is); Phase 2 appends one step at a time to
a separate store so the context tensors are never copied during decoding. That store grows into buffers of doubling
capacity (``k``, ``v``, ``pos`` are views of their first ``n`` entries): a step writes its token's KV in place
instead of copying the whole store (issue 33's profile: the per-token concatenation was a sixth of a batch-8 decode
step).
"""
from __future__ import annotations

import weakref
from typing import Optional, TypeVar

import torch

from magnetar.ops.nonfinite import all_finite

T = TypeVar("T")


class PolicyState:
    """What decode policies derive from one layer's KV (key codes, page bounds, LuKA's mass and pages).

    Entries are keyed by the owning policy instance's ``uid`` and the entry's type, so policies sharing a shard
    (several scored variants over one Phase 1) keep their own, and a reader gets back the type it asked for.
    The store is cleared whenever the layer's KV changes.
    """

    __slots__ = ("_items",)

    def __init__(self):
        self._items: dict[tuple[int, type], object] = {}

    def get(self, owner: int, kind: type[T]) -> Optional[T]:
        """The ``kind`` entry of policy ``owner``, or None."""
        return self._items.get((owner, kind))  # type: ignore[return-value]

    def put(self, owner: int, value: T) -> T:
        """Store ``value`` as policy ``owner``'s entry of its type; returns it."""
        self._items[(owner, type(value))] = value
        return value

    def clear(self) -> None:
        self._items.clear()


def _whole(t: torch.Tensor) -> bool:
    """Whether ``t`` is contiguous and the whole of its storage."""
    return t.is_contiguous() and t.storage_offset() == 0 and \
        t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` if it is :func:`_whole`, else a contiguous copy of it (a view of part of a larger tensor would keep all
    of that tensor alive)."""
    return t if _whole(t) else t.clone(memory_format=torch.contiguous_format)


class LayerKV:
    """KV of one layer. Collecting (Phase 1): pieces kept in lists; frozen: single tensors, appended to."""

    __slots__ = ("_k", "_v", "_pos", "_mass", "frozen", "k", "v", "pos", "mass", "state", "_buf", "_facts")

    def __init__(self):
        self._k, self._v, self._pos, self._mass = [], [], [], []
        self.frozen = False
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None
        self.pos: Optional[torch.Tensor] = None
        # (B, Hkv, n) float32 attention mass each entry received in Phase 1 (LuKA), summed over its query heads;
        # None unless every piece came with one
        self.mass: Optional[torch.Tensor] = None
        self.state = PolicyState()  # what decode policies derive from this KV; cleared on append
        self._buf: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # the decode store's (k, v, pos)
        # [keys_finite(), values_finite(), span()] once per content, shared with this layer's views (every
        # request over one cached context reads the same answers); a new list when the content changes
        self._facts: list = [None, None, None]

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, mass: Optional[torch.Tensor] = None) -> None:
        self.state.clear()
        self._facts = [None, None, None]
        if not self.frozen:  # Phase 1's pieces: a part of a larger tensor (Star's block after its anchor) is copied
            self._k.append(_owned(k))  # now, so the rest (the anchor's KV) is freed with its layer, not at the end
            self._v.append(_owned(v))
            self._pos.append(pos)
            self._mass.append(mass)
        elif self.k is None:
            self.k, self.v, self.pos, self.mass = k, v, pos, mass
        elif self.mass is not None and mass is not None:  # a store with masses: concatenated (no decode path has one)
            self.k = torch.cat((self.k, k), dim=2)
            self.v = torch.cat((self.v, v), dim=2)
            self.pos = torch.cat((self.pos, pos))
            self.mass = torch.cat((self.mass, mass), dim=2)
        else:  # decode path: one step at a time, written in place into the store's buffers
            self.mass = None
            self._grow(k, v, pos)

    def _grow(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        n, add = self.k.shape[2], k.shape[2]
        buf = self._buf
        if buf is None or n + add > buf[0].shape[2] or self.k.data_ptr() != buf[0].data_ptr():
            cap = max(64, 2 * (n + add))  # doubling: amortized O(1) copies per token
            shape = (*self.k.shape[:2], cap, self.k.shape[3])
            buf = (self.k.new_empty(shape), self.v.new_empty((*self.v.shape[:2], cap, self.v.shape[3])),
                   self.pos.new_empty((cap,)))
            buf[0][:, :, :n] = self.k
            buf[1][:, :, :n] = self.v
            buf[2][:n] = self.pos
            self._buf = buf
        buf[0][:, :, n:n + add] = k
        buf[1][:, :, n:n + add] = v
        buf[2][n:n + add] = pos
        self.view_first(buf, n + add)

    def view_first(self, buf: tuple, n: int) -> None:
        """Make ``k``, ``v``, ``pos`` views of the first ``n`` entries of the buffers ``buf = (k, v, pos)`` (a decode
        store's, an arena's, a host copy's)."""
        self.k, self.v, self.pos = buf[0][:, :, :n], buf[1][:, :, :n], buf[2][:n]

    def freeze(self) -> None:
        if not self.frozen and self._k:  # one piece (a rank's one segment) is its own tensor already: not copied
            join = (lambda parts, dim: parts[0]) if len(self._k) == 1 else torch.cat
            # the positions always copied: every layer's piece is the same segment's tensor (a file's tensors may
            # not share memory), and they are small
            self.k, self.v, self.pos = join(self._k, 2), join(self._v, 2), torch.cat(self._pos)
            if all(m is not None for m in self._mass):
                self.mass = join(self._mass, 2)
        self._k, self._v, self._pos, self._mass = [], [], [], []
        self.frozen = True

    def view(self) -> "LayerKV":
        """This frozen layer's KV (the same tensors, never copied) with a policy state of its own: what one
        request decodes over, so that what its decode policy derives or accumulates (LuKA's pages and masses,
        sparse codes) never reaches another request reading the same context."""
        if not self.frozen:
            raise RuntimeError("LayerKV.view() needs a frozen layer (after Phase 1)")
        out = LayerKV()
        out.frozen = True
        out.k, out.v, out.pos, out.mass = self.k, self.v, self.pos, self.mass
        out._facts = self._facts
        return out

    def keys_finite(self) -> bool:
        """Whether every key of this frozen layer is finite: one pass the first time, remembered until the
        layer changes (a decode step's attention over a context shard then checks only its query and output:
        issue 33's profile found the per-step check over the whole shard's keys a sixth of a batch-8 step)."""
        return self._checked(0, self.k)

    def values_finite(self) -> bool:
        """Whether every value of this frozen layer is finite (as :meth:`keys_finite`: once, remembered until the
        layer changes; a static decode step places a context's KV only when both are)."""
        return self._checked(1, self.v)

    def span(self) -> Optional[tuple[int, int, bool]]:
        """``(first, last, consecutive)`` of this frozen layer's positions -- its first entry's, the largest, and
        whether entry i sits at ``first + i`` -- or None when it holds none: one read the first time, remembered until
        the layer changes. Whether a decode step's token follows every key of a cached context, and which of them a
        sliding window keeps (:meth:`magnetar.engine.phase2.Phase2Context._paged` reads a request's KV as pages
        then)."""
        if self._facts[2] is None and self.pos is not None and len(self.pos):
            pos = self.pos
            steps = pos[1:] - pos[:-1]
            first, last, consecutive = torch.stack((pos[0], pos.max(), (steps == 1).all().long())).tolist()
            self._facts[2] = (first, last, bool(consecutive))
        return self._facts[2]

    def _checked(self, i: int, t: Optional[torch.Tensor]) -> bool:
        if self._facts[i] is None:
            self._facts[i] = t is None or all_finite(t)
        return self._facts[i]

    def __len__(self) -> int:
        if self.frozen:
            return 0 if self.k is None else self.k.shape[2]
        return sum(t.shape[2] for t in self._k)

    def nbytes(self) -> int:
        ts = ([self.k, self.v] if self.k is not None else []) if self.frozen else self._k + self._v
        return sum(t.numel() * t.element_size() for t in ts)


ARENA_SPARE = 8  # an arena's buffers are made with 1/ARENA_SPARE of their tokens to spare (a conversation's turns)


class KVArena:
    """The buffers a chain of contexts shares, each a prefix of the next (a conversation's turns over one document).

    Per layer ``(k, v, pos)`` of a capacity at least the longest member's KV on this rank; a member shard's layers
    are views of their first entries. An extension of the chain's longest context (its ``tip``) writes its new KV
    after the tip's, in place, so a turn costs the memory of its new tokens, not a copy of the whole context; when
    a layer's buffer is full, all of them are made anew (1/:data:`ARENA_SPARE` to spare) and every member is
    pointed at the new ones. An extension of a shorter member (a fork) starts an arena of its own: the positions
    after the member belong to the tip.

    Every decision of which arena a shard joins reads context tokens (``tip``: the longest member's), the same on
    every rank of a replica, never a rank's own KV counts, so the ranks' caches group contexts alike; ``charged``
    (bytes: the largest rank's buffers, set by the encoder after its gather) is what a cache counts for the arena
    while any member is kept.
    """

    __slots__ = ("bufs", "tip", "charged", "members", "__weakref__")

    def __init__(self, tip: int, num_layers: int):
        self.bufs: list[Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [None] * num_layers
        self.tip = tip
        self.charged = 0
        self.members: "weakref.WeakSet[KVShard]" = weakref.WeakSet()

    def nbytes(self) -> int:
        """The bytes of this rank's buffers (their whole capacity)."""
        return sum(t.numel() * t.element_size() for buf in self.bufs if buf is not None for t in buf)

    def capacity(self, i: int) -> int:
        buf = self.bufs[i]
        return 0 if buf is None else buf[0].shape[2]

    def trim(self, tokens: int, keep: "KVShard") -> bool:
        """Cut the buffers down to ``keep``'s entries (a member of ``tokens`` context tokens, the longest a cache still
        keeps: the turns after it were evicted) and 1/:data:`ARENA_SPARE` to spare, when that frees a quarter of the
        buffers or more; ``tokens`` is then the tip (an extension of ``keep`` writes after it in place -- in the new
        buffers, never where an evicted turn still being read lies). The members no longer than ``keep`` view the new
        buffers; a longer one still alive (an evicted turn a request reads) keeps the old ones and leaves the arena
        (an extension of it starts an arena of its own). Returns whether it trimmed."""
        sizes = [(i, len(keep.own[i]), buf[0].shape[2]) for i, buf in enumerate(self.bufs) if buf is not None]
        caps = {i: n + max(64, n // ARENA_SPARE) for i, n, _ in sizes}
        if not sizes or any(4 * caps[i] > 3 * have for i, _, have in sizes):
            return False
        old = list(self.bufs)
        for i, _, _ in sizes:
            self.bufs[i] = tuple(t[..., :caps[i], :].clone() if t.dim() == 4 else t[:caps[i]].clone() for t in old[i])
        for m in list(self.members):
            if all(len(m.own[i]) <= n for i, n, _ in sizes):
                for i, _, _ in sizes:
                    if _prefix_of(m.own[i].k, old[i][0]):
                        m.own[i].view_first(self.bufs[i], len(m.own[i]))
            else:  # reads entries past keep's: its views stay on the old buffers, which nothing writes any more
                m.arena = None
                self.members.discard(m)
        self.tip = tokens
        return True


def _prefix_of(t: Optional[torch.Tensor], buf: Optional[torch.Tensor]) -> bool:
    """Whether ``t`` is a view of the first entries of ``buf`` (along the sequence)."""
    return t is not None and buf is not None and t.data_ptr() == buf.data_ptr() and t.stride() == buf.stride()


class KVShard:
    """One rank's KV for every layer. ``arena``: the :class:`KVArena` whose buffers its layers view (a
    conversation's turn, :meth:`extended`), else None (the shard's own tensors).

    A fork (a conversation's first turn off a document another conversation extended already) holds its KV in
    segments: ``head``, the shard it extends (shared with every other reader, read and never written here), then
    its own entries (``own``, in an arena of its own). Its per-layer KV is then no single tensor, so ``layers``
    refuses to answer for it -- a reader that would see only the own entries fails loudly -- and the readers take
    :meth:`segments` (each a :class:`LayerKV`, in order: attention over them merged equals attention over their
    concatenation), :meth:`whole` (one layer joined, on a request's view) or :meth:`entries`."""

    def __init__(self, num_layers: int):
        self._layers = [LayerKV() for _ in range(num_layers)]
        self.arena: Optional[KVArena] = None
        self.head: Optional[KVShard] = None  # a fork's first entries: the shard it extends, shared
        self.head_tokens = 0  # the context tokens the head holds (the same on every rank; 0: no head)
        self._joined: dict[int, LayerKV] = {}  # whole(i) of a fork's view, made once per layer

    @property
    def layers(self) -> list[LayerKV]:
        """Every layer's KV -- of a shard in one segment (not a fork: :meth:`segments`)."""
        if self.head is not None:
            raise RuntimeError("KVShard.layers: this shard is a fork whose KV is in segments (a shared head's, then "
                               "its own): read segments(i), whole(i) or entries(i)")
        return self._layers

    @layers.setter
    def layers(self, value: list[LayerKV]) -> None:
        self._layers = value

    @property
    def own(self) -> list[LayerKV]:
        """Every layer's own entries (after the ``head``'s; without a head: every entry)."""
        return self._layers

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def segments(self, i: int) -> list[LayerKV]:
        """Layer ``i``'s KV as the stores that hold some of it, in order (the head's, then the own entries)."""
        out = [] if self.head is None else self.head.segments(i)
        if len(self._layers[i]):
            out.append(self._layers[i])
        return out

    def whole(self, i: int) -> LayerKV:
        """Layer ``i``'s KV as one store: the layer itself, or a fork's segment when only one holds entries here;
        else the segments joined (a copy, made once per layer of this shard -- read it on a request's
        :meth:`view`, which lives as long as the request: a decode policy's path and the rare readers that need
        one tensor)."""
        if self.head is None:
            return self._layers[i]
        segs = self.segments(i)
        if len(segs) == 1:
            return segs[0]
        if i not in self._joined:
            out = LayerKV()
            out.frozen = True
            if segs:
                out.k, out.v, out.pos = self.entries(i)[:3]
            self._joined[i] = out
        return self._joined[i]

    def entries(self, i: int, start: int = 0) -> Optional[tuple[torch.Tensor, ...]]:
        """Layer ``i``'s ``(k, v, pos, mass)`` from entry ``start`` on (None: none there), joined over the segments
        only where they span it -- a fork's entries after its head's are its own tensors, not a copy."""
        parts, at = [], 0
        for seg in self.segments(i):
            n = len(seg)
            if at + n > start:
                cut = max(start - at, 0)
                parts.append((seg.k[:, :, cut:], seg.v[:, :, cut:], seg.pos[cut:],
                              None if seg.mass is None else seg.mass[:, :, cut:]))
            at += n
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        masses = [p[3] for p in parts]
        return (torch.cat([p[0] for p in parts], dim=2), torch.cat([p[1] for p in parts], dim=2),
                torch.cat([p[2] for p in parts]),
                torch.cat(masses, dim=2) if all(m is not None for m in masses) else None)

    def lengths(self) -> tuple[int, ...]:
        """The entries each layer holds (a fork's: its head's and its own)."""
        return tuple(sum(len(s) for s in self.segments(i)) for i in range(len(self._layers)))

    def reach(self, arena: KVArena, tokens: int) -> tuple[int, Optional["KVShard"]]:
        """How far into ``arena`` this shard's KV reaches -- ``(context tokens, the member of the arena that holds
        them)``: itself (``tokens``, its context tokens) when its own entries are there, else the head of its that
        is, or ``(0, None)``."""
        shard, n = self, tokens
        while shard is not None:
            if shard.arena is arena:
                return n, shard
            shard, n = shard.head, shard.head_tokens
        return 0, None

    def arenas(self) -> tuple[KVArena, ...]:
        """The arenas whose buffers this shard's KV views: its head's (a fork's document), then its own."""
        out = () if self.head is None else self.head.arenas()
        return out + ((self.arena,) if self.arena is not None and self.arena not in out else ())

    def freeze(self) -> None:
        for layer in self._layers:
            layer.freeze()

    def tokens(self) -> int:
        """KV entries held per layer (the same for every layer)."""
        mine = len(self._layers[0]) if self._layers else 0
        return mine + (0 if self.head is None else self.head.tokens())

    def nbytes(self) -> int:
        mine = sum(layer.nbytes() for layer in self._layers)
        return mine + (0 if self.head is None else self.head.nbytes())

    def view(self) -> "KVShard":
        """Every layer's :meth:`LayerKV.view`: one request's own window on a frozen shard (no copy); a fork's
        view keeps its segments (its head's view, then its own)."""
        out = KVShard(0)
        out._layers = [layer.view() for layer in self._layers]
        out.head = None if self.head is None else self.head.view()
        out.head_tokens = self.head_tokens
        return out

    def clone(self) -> "KVShard":
        """A frozen copy of this frozen shard whose tensors are its own (the same values, on the same device): what
        a request reads over it is another context's KV to every per-shard test (the shared-context read keys on the
        tensors) -- a benchmark's B contexts of one length from one Phase 1."""
        out = KVShard(len(self.layers))
        out.freeze()
        for src, dst in zip(self.layers, out.layers):
            if not src.frozen:
                raise RuntimeError("KVShard.clone() needs a frozen shard (after Phase 1)")
            if src.k is not None:
                mass = None if src.mass is None else src.mass.clone()
                dst.append(src.k.clone(), src.v.clone(), src.pos.clone(), mass)
        return out

    def split(self, sizes: "list[int]") -> "list[KVShard]":
        """This frozen shard cut along the sequence into consecutive frozen parts of ``sizes`` tokens (views of its
        tensors, no copy): the inverse of :meth:`join`."""
        if sum(sizes) != self.tokens() or any(n < 0 for n in sizes):
            raise ValueError(f"KVShard.split: sizes {sizes} do not cut a shard of {self.tokens()} tokens")
        parts, start = [], 0
        for n in sizes:
            part = KVShard(len(self.layers))
            part.freeze()  # frozen and empty: an append takes the views as they are
            for src, dst in zip(self.layers, part.layers):
                if n:
                    dst.append(src.k[:, :, start:start + n], src.v[:, :, start:start + n], src.pos[start:start + n],
                               None if src.mass is None else src.mass[:, :, start:start + n])
            parts.append(part)
            start += n
        return parts

    @classmethod
    def join(cls, shards: "list[KVShard]", *, consume: bool = False) -> "KVShard":
        """One frozen shard holding the KV of all ``shards`` (each frozen), in order, per layer.

        Attention over the joined KV equals the merge of the attentions over the parts (positions, not order,
        decide causality), so simulated ranks are joined this way for Phase 2. ``consume``: the parts are not read
        again -- each layer of theirs is emptied once copied, so the join holds the joined KV and one layer of the
        parts at once, not the KV twice (simulated ranks' Phase 1 near the device's memory: 2 x 64 GiB at 512K on
        an 8B model).
        """
        out = cls(len(shards[0].layers))
        for i, layer in enumerate(out.layers):
            parts = [s.layers[i] for s in shards if s.layers[i].k is not None]
            # the parts' tensors as the pieces (no _owned copy: they are concatenated, or one is taken as it is)
            layer._k, layer._v = [p.k for p in parts], [p.v for p in parts]
            layer._pos, layer._mass = [p.pos for p in parts], [p.mass for p in parts]
            layer.freeze()
            if consume:
                del parts
                for s in shards:
                    s.layers[i] = LayerKV()
                    s.layers[i].freeze()
        return out

    @classmethod
    def extended(cls, base: "KVShard", part: Optional["KVShard"], base_tokens: int, tokens: int) -> "KVShard":
        """A frozen shard holding ``base``'s KV followed by ``part``'s (None: no new KV on this rank) -- the KV of a
        context of ``tokens`` tokens extending ``base``'s of ``base_tokens`` -- in a :class:`KVArena`: the content of
        ``join([base, part])``, without a copy of ``base``. Where ``base`` is its arena's tip (a conversation's next
        turn) the new KV is written after it, in place. A ``base`` with no arena joins the new one (its layers then
        view its buffers: the same values; its own tensors are freed once no request reads them). A fork off a
        shorter member (the positions after it belong to the tip) shares ``base`` as its ``head`` and keeps only
        the new KV, in an arena of its own. ``base`` is frozen; masses are not carried (no configuration that
        extends records them)."""
        arena, adopt = base.arena, base.arena is None
        out = cls(len(base.own))
        out.freeze()
        if arena is not None and arena.tip != base_tokens:  # a fork: base read as it is, never written
            out.head, arena, adopt, own = base, KVArena(tokens, len(base.own)), False, [LayerKV() for _ in base.own]
            out.head_tokens = base_tokens
            for layer in own:
                layer.freeze()
        else:
            out.head, arena, own = base.head, KVArena(tokens, len(base.own)) if arena is None else arena, base.own
            out.head_tokens = base.head_tokens
        for i, (have, layer) in enumerate(zip(own, out.own)):
            new = None if part is None or part.own[i].k is None else part.own[i]
            n, add = len(have), 0 if new is None else len(new)
            buf = arena.bufs[i]
            if n + add == 0:
                continue
            if buf is None and add == 0 and _whole(have.k) and _whole(have.v):
                buf = arena.bufs[i] = (have.k, have.v, have.pos)  # nothing to add here: base's tensors as they are
            elif buf is None or n + add > buf[0].shape[2] or (n and not _prefix_of(have.k, buf[0])):
                buf = arena.bufs[i] = _grown(arena, i, have, have if n else new, n + add, adopt)
            if add:  # after the entries of every member (base is the tip): read by no one yet
                buf[0][:, :, n:n + add], buf[1][:, :, n:n + add], buf[2][n:n + add] = new.k, new.v, new.pos
            layer.view_first(buf, n + add)
        arena.tip = tokens
        if adopt:
            base.arena = arena
            arena.members.add(base)
        out.arena = arena
        arena.members.add(out)
        return out


def _grown(arena: KVArena, i: int, have: LayerKV, like: LayerKV, need: int, adopt: bool) -> tuple:
    """New buffers for ``arena``'s layer ``i`` (shaped as ``like``'s KV) with room for ``need`` entries and
    1/:data:`ARENA_SPARE` more, holding ``have``'s entries first; every member that viewed the old buffers (and
    ``have``, when its shard joins the arena) now views the new ones."""
    cap = need + max(64, need // ARENA_SPARE)
    k = like.k.new_empty((*like.k.shape[:2], cap, like.k.shape[3]))
    v = like.v.new_empty((*like.v.shape[:2], cap, like.v.shape[3]))
    pos = like.pos.new_empty((cap,))
    n = len(have)
    if n:
        k[:, :, :n], v[:, :, :n], pos[:n] = have.k, have.v, have.pos
    old = arena.bufs[i]
    viewers = [] if old is None else [m.own[i] for m in list(arena.members) if _prefix_of(m.own[i].k, old[0])]
    if adopt and n:
        viewers.append(have)
    for layer in viewers:
        layer.view_first((k, v, pos), len(layer))
    return k, v, pos
