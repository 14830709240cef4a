"""Static decode steps: every request's KV in preallocated slots, one attention call per layer for the whole batch,
and a step that ``torch.compile`` (on CUDA with CUDA graphs) or a CUDA graph captured at start can hold (issue 33,
item 2; issue 47, item 1).

``runtime.decode_step`` chooses how a :class:`~magnetar.engine.phase2.DecodeBatch` runs its decode steps:

* ``eager`` -- :class:`~magnetar.engine.phase2.Phase2Context`: per layer, one attention call per request over its
  own context shard and generated-KV store, merged. Every decode policy (sparse decoding, LuKA) runs this way.
* ``static`` -- :class:`StaticSlots`: when a request joins (after its query forward, which stays eager), it takes a
  slot of preallocated per-layer buffers ``(slots, Hkv, capacity, D)``, into which the query rank copies its query
  tokens' KV; each step writes the new token's KV in place and attends all slots in ONE call per layer
  (:mod:`magnetar.ops.slots`: the decode kernel of an attention backend, float32 scores, key positions decide what
  each query sees, the empty part of a slot sits at position :data:`~magnetar.ops.slots.FAR`). The requests' cached
  contexts are read where the context cache holds them, never copied: through a table of their addresses
  (:mod:`magnetar.ops.pointers`: Triton's kernel on CUDA, one launch per layer, which a CUDA graph holds) or, where
  no such kernel runs (a CPU), as pages of one call per layer (:mod:`magnetar.ops.pages`, the eager step's reads;
  where that call is one launch, the slots' own entries are pages of it too, and no slot call is made); the states
  are merged (:func:`~magnetar.ops.merge_states`), then the CP gather and merge as eager. No
  per-request Python in a step through the table, no per-call checks; the shapes change only when the slots or
  their capacity grow.
* ``compiled`` -- the static step under ``torch.compile`` (``mode="reduce-overhead"``: CUDA graphs, on CUDA): the
  first shape compiles static, the first other one with the sizes that changed dynamic, which later shapes reuse
  (``magnetar serve`` compiles a single request's graphs before its first request; a batch's first step compiles
  once more); the context part and the CP gather and merge stay outside the graph (a graph break per layer: what
  the context part reads is chosen per request, and traced it would recompile at every join). If
  compiling fails, the batch says why (:attr:`StaticDecode.fallback`) and runs ``static``.
* ``graph`` -- the static step over shapes planned when the engine starts, each captured then as a CUDA graph
  (:mod:`magnetar.engine.graphs`: the plan, the one slot pool all shapes view, the captures); a batch takes the
  smallest planned shape that holds it and replays its graph. On the CPU the planned shapes run uncaptured.

What ``static``, ``compiled`` and ``graph`` cannot run, a batch runs ``eager`` and says why (:func:`static_problem`): a
decode policy (its choice of KV differs per token and request); ``compiled`` with tensor parallelism (DeepSpeed's
all-reduce inside the layers) and ``graph`` with tensor parallelism or real CP ranks (a collective between the
layers) run ``static``.

The rules of :func:`magnetar.ops.attention_with_lse` hold: a row seeing no key is ``(0, -inf)``; a NaN in q or in a
key the row sees makes the row NaN. The one difference -- a NaN in the *value* of a key no query sees would reach
the output through ``0 * NaN`` -- cannot arise: a request's context KV is checked finite once when it joins (a
request whose context KV is not finite makes the batch go back to ``eager``, which has the exact rules), and a
generated token's value is seen by its own query first, whose logits are checked every step.

Memory: a slot holds its request's own tokens (query and generated) on the query rank; its context stays where the
context cache keeps it, read in place (an 8B model's batch of 8 at 32K needs its 32 GiB of KV once, where copies into
the slots needed it twice and did not fit an 80 GB card); capacity grows by doubling.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

from magnetar.engine.finite import HINT
from magnetar.engine.graphs import DecodeGraphs, SlotPool
from magnetar.engine.kv import KVShard
from magnetar.engine.strategy import LayerContext
from magnetar.models.dims import ModelDims
from magnetar.ops import merge_states
from magnetar.ops.backends import get_backend
from magnetar.ops.pages import PageByPage, page_backend
from magnetar.ops.pointers import PAGES, PointerTable, pointer_backend
from magnetar.ops.slots import FAR, slot_backend
from magnetar.parallel import ParallelGroups, all_gather_states
from magnetar.utils.sync import to_device

log = logging.getLogger(__name__)

MIN_CAPACITY = 256  # a slot's first capacity is a multiple of this (tokens)


def static_problem(mode: str, policy, groups: ParallelGroups) -> tuple[str, Optional[str]]:
    """The decode step a batch runs for ``runtime.decode_step`` = ``mode``, and why it is not ``mode`` (None: it is)."""
    if mode == "eager":
        return "eager", None
    if policy is not None:
        return "eager", (f"the decode policy {type(policy).__name__} chooses each token's KV per request and step: "
                         f"decode steps run eager")
    if mode == "compiled" and groups.tp_size > 1:
        return "static", ("tensor parallelism's all-reduce inside the layers is not compiled: decode steps run static "
                          "(batched, uncompiled)")
    if mode == "graph" and (groups.tp_size > 1 or groups.cp_size > 1):
        what = "tensor parallelism's all-reduce" if groups.tp_size > 1 else "the CP ranks' gather and merge"
        return "static", (f"{what} between the layers is a collective outside a CUDA graph: decode steps run static "
                          f"(batched, uncaptured)")
    return mode, None


class StaticSlots:
    """Per-layer KV buffers ``(slots, Hkv, capacity, D)`` and key positions ``(slots, capacity)`` (:data:`FAR` where
    empty) of this rank, and how many entries each slot holds (``fill``). ``writes``: this rank stores the new
    tokens' KV (the CP rank holding the query's and generated KV: the CP leader)."""

    def __init__(self, num_layers: int, slots: int, capacity: int, hkv: int, d: int, dtype, device, writes: bool,
                 graphs: bool = False, pool: Optional[SlotPool] = None, table: Optional[PointerTable] = None):
        self.num_layers, self.slots, self.capacity, self.writes = num_layers, slots, capacity, writes
        self.graphs = graphs
        self.hkv, self.d, self.dtype, self.device = hkv, d, dtype, device
        self.pooled = pool is not None  # views over a SlotPool (decode_step graph: the addresses its graphs hold)
        # the slots' contexts by address (a step whose context part runs through a pointer kernel; None: as pages)
        self.table = pool.table if pool is not None else table
        if pool is not None:  # the empties are marked by whoever fills the views (StaticDecode._relayout)
            self.k, self.v, self.pos = pool.views(slots, capacity)
        else:
            self.k = [torch.zeros(slots, hkv, capacity, d, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v = [torch.zeros(slots, hkv, capacity, d, dtype=dtype, device=device) for _ in range(num_layers)]
            self.pos = [torch.full((slots, capacity), FAR, dtype=torch.long, device=device) for _ in range(num_layers)]
        self.fill = [0] * slots
        if graphs:  # compiled steps: fixed addresses, CUDA graphs read and write them in place
            for t in (*self.k, *self.v, *self.pos):
                torch._dynamo.mark_static_address(t)

    @classmethod
    def over(cls, pool: SlotPool, slots: int, capacity: int, writes: bool) -> "StaticSlots":
        """Slots viewing ``pool``'s first ``slots x capacity`` entries (the pool's layers, heads, dtype and device;
        their empties marked by the caller)."""
        k = pool.k[0]
        return cls(len(pool.k), slots, capacity, pool.hkv, pool.d, k.dtype, k.device, writes, pool=pool)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *self.pos))

    def place(self, slot: int, parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], layer: int) -> None:
        """Fill ``slot`` of ``layer`` with ``parts`` (``(k (1, Hkv, n, D), v, pos (n,))`` each, in order)."""
        n = 0
        for k, v, pos in parts:
            m = k.shape[2]
            self.k[layer][slot, :, n:n + m] = k[0]
            self.v[layer][slot, :, n:n + m] = v[0]
            self.pos[layer][slot, n:n + m] = pos
            n += m
        self.pos[layer][slot, n:] = FAR
        if layer == 0:
            self.fill[slot] = n

    def clear(self, slot: int) -> None:
        """Empty ``slot`` (its entries become invisible; the buffers keep their values until overwritten)."""
        for pos in self.pos:
            pos[slot] = FAR
        self.fill[slot] = 0


class ContextKernelFailed(RuntimeError):
    """The pointer kernel of a static step's context part failed (a kernel that does not build or launch on this
    card; not out of memory): :class:`~magnetar.engine.phase2.DecodeBatch` runs the step, and the batch's later
    ones, eager."""


class PointerPart:
    """A static step's context part through the slots' pointer table (:mod:`magnetar.ops.pointers`): ``backend``'s
    kernel over ``table_of()``'s rows. Its own tokens are not read here (the slot kernel's part)."""

    takes_own = False

    def __init__(self, backend, table_of: Callable[[], PointerTable]):
        self.backend, self.table_of = backend, table_of

    def __call__(self, layer: int, q: torch.Tensor, pos: torch.Tensor, scale: float, window: Optional[int],
                 kb: Optional[torch.Tensor], vb: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return self.backend.pointers_forward(q, pos, self.table_of(), layer, scale, window)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - any kernel failure: the batch goes eager, saying why
            raise ContextKernelFailed(f"the {self.backend.name} context kernel failed ({type(e).__name__}: "
                                      f"{str(e).splitlines()[0][:300] if str(e) else ''})") from e


class PagePart:
    """A static step's context part as pages (the eager step's reads, :mod:`magnetar.ops.pages`): what
    ``static``'s :meth:`StaticDecode.step` set up on the host for this step -- the slots stepping, their contexts and
    positions, and (``takes_own``: a paged kernel of one launch reads them) their own entries of the slot buffers
    ``kb``, ``vb`` as pages of the same call: one softmax, rounded once, as an eager step's."""

    def __init__(self, static: "StaticDecode"):
        self.static = static

    @property
    def takes_own(self) -> bool:
        return self.static.own_in_pages

    def __call__(self, layer: int, q: torch.Tensor, pos: torch.Tensor, scale: float, window: Optional[int],
                 kb: Optional[torch.Tensor], vb: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        st = self.static
        own = None
        if kb is not None and st.own_in_pages:  # slot s's first n entries: its own tokens, the new one last
            own = [(kb[s:s + 1, :, :n], vb[s:s + 1, :, :n]) if n else None for s, n in enumerate(st.step_own)]
        return st.step_pages(layer, q, scale, window, own)


# the context part of a static step, called per layer outside any compiled graph: (layer, q, pos, scale, window, kb, vb)
# -> (out (slots, Hq, 1, D), lse (slots, Hq, 1)) over the slots' contexts -- and, ``takes_own``, their own tokens
Contexts = PointerPart | PagePart


class StaticContext(LayerContext):
    """The layer context of one static decode step over ``slots`` (every slot steps; an empty slot's row is thrown
    away): ``positions (slots, 1)`` of the new tokens, ``write (slots,)`` the entry each writes its KV to;
    ``contexts`` the step's context part (the slots' cached contexts, read where they lie: :class:`PointerPart` or
    :class:`PagePart`); where it ``takes_own`` the slots' own tokens too, no slot call is made, else the slot kernel's
    state of them is merged with it."""

    layer_range = None  # no profiler range inside a compiled graph (magnetar_attention skips it)

    def __init__(self, slots: StaticSlots, positions: torch.Tensor, write: torch.Tensor, groups: ParallelGroups,
                 attention, contexts: Contexts, used: Optional[int] = None):
        self.slots, self.positions, self.write, self.groups = slots, positions, write, groups
        self.attention, self.contexts = attention, contexts
        self.used = used  # attend the slots' first `used` entries only (None: all)
        self.rows = torch.arange(write.shape[0], device=write.device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: Optional[int] = None) -> torch.Tensor:
        sl = self.slots
        kb = vb = None
        if sl.writes:  # this rank holds the requests' own tokens: one new token per slot, at its write entry
            kb, vb, kp = sl.k[layer], sl.v[layer], sl.pos[layer]
            rows = self.rows  # (index_put: the compiler updates it in place, where a scatter_ became a copy of the
            kb[rows, :, self.write] = k[:, :, 0]  # whole buffer every layer)
            vb[rows, :, self.write] = v[:, :, 0]
            kp[rows, self.write] = self.positions[:, 0]
        out, lse = _context_state(self.contexts, layer, q, self.positions, scale, window, kb, vb)
        if sl.writes and not self.contexts.takes_own:  # the slots' part, merged with the contexts'
            if self.used is not None:  # the entries past every slot's fill are empty: not read (views, no copy)
                kb, vb, kp = kb[:, :, :self.used], vb[:, :, :self.used], kp[:, :self.used]
            own = self.attention(q, kb, vb, self.positions, kp, scale, window)
            out, lse = merge_states([out, own[0]], [lse, own[1]])
        return self._gathered(out, lse)

    def _gathered(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """This rank's state merged with the other CP ranks' (one rank: its output)."""
        if self.groups.cp_size > 1:
            out = _gather_merge(out, lse, self.groups)
        return out


def _context_state_eager(contexts: Contexts, layer: int, q: torch.Tensor, pos: torch.Tensor, scale: float,
                         window: Optional[int], kb: Optional[torch.Tensor], vb: Optional[torch.Tensor]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    return contexts(layer, q, pos, scale, window, kb, vb)


def _gather_merge_eager(out: torch.Tensor, lse: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """The CP gather of every rank's ``(out, lse)`` and their merge (outside any compiled graph)."""
    outs, lses = all_gather_states(out, lse, groups.cp_group, timeout=groups.timeout)
    return merge_states(outs, lses)[0]


# what StaticContext.attend calls: made ``torch.compiler.disable``'d (a graph break) by the first compiled step --
# not at import: ``torch.compiler.disable`` imports torch._dynamo, 1.4 s of every process's ``import magnetar``. The
# context part too: its pages are chosen on the host, its pointer kernel a Triton launch of its own
_gather_merge = _gather_merge_eager
_context_state = _context_state_eager


def _keep_out_of_graphs() -> None:
    global _gather_merge, _context_state
    if _gather_merge is _gather_merge_eager:
        _gather_merge = torch.compiler.disable(_gather_merge_eager)
        _context_state = torch.compiler.disable(_context_state_eager)


def _bucket(n: int) -> int:
    """Slots for ``n`` requests: the next power of two (few shapes: a new one can mean a recompile)."""
    return 1 << max(0, n - 1).bit_length()


class StaticDecode:
    """The static (compiled, graph) decode steps of one :class:`~magnetar.engine.phase2.DecodeBatch` on this rank:
    which request holds which slot, the slots, and the step function. Every rank of the replica makes the same
    calls (the batch's are replicated), so the slots' layout is the same on every rank. ``graphs``: the engine's
    :class:`~magnetar.engine.graphs.DecodeGraphs` (``graph`` steps: the planned shapes, the pool, the captured
    graphs)."""

    def __init__(self, model, groups: ParallelGroups, device, mode: str, attention_backend: str = "auto",
                 graphs: Optional[DecodeGraphs] = None, pages: Optional[Callable] = None):
        self.model, self.groups, self.device, self.mode = model, groups, device, mode
        self.graphs = graphs if mode == "graph" else None
        self.slots: Optional[StaticSlots] = None
        self.owner: dict[int, int] = {}  # rid -> slot
        self.context: dict[int, KVShard] = {}  # rid -> its context shard on this rank (read in place, never copied)
        self._pointed: dict[int, int] = {}  # table row -> the rid whose context it points at
        self._table: Optional[PointerTable] = None  # the table _pointed is about
        # the context part: through a pointer table where a kernel reads one (CUDA; a step a graph holds must), else
        # as pages (magnetar.ops.pages), made per step by `pages(positions, shards, starts)` (the DecodeBatch's)
        captured = self.graphs is not None and self.graphs.captures
        self.pointers = pointer_backend(attention_backend, device, required=captured)
        self.pages = pages
        # read as pages by a kernel of one launch (cpu_decode's), the own tokens are pages of the same call; else
        # (pages one call each) the backend's slot kernel reads them, merged after
        self.own_in_pages = not isinstance(page_backend(attention_backend, torch.device(device)), PageByPage)
        self._empty: Optional[KVShard] = None  # an idle slot's context
        # the context part (one object each for the batch's life: a compiled step guards on nothing that changes),
        # and what the page part reads in a step, set by step() on the host: the pages' call, each slot's own entries
        self._part = PointerPart(self.pointers, lambda: self.slots.table) if self.pointers is not None else None
        self._page_part = PagePart(self)
        self.step_pages: Optional[Callable] = None
        self.step_own: list[int] = []
        if self.pointers is None and pages is None:
            raise ValueError("StaticDecode: no pointer kernel runs here, so pass pages (the context part as pages)")
        self.fallback: Optional[str] = None  # why a compiled step runs static
        self._compiled = None
        self._off_plan = False  # a graph batch outgrew the plan (said once)
        # the attention backend whose decode kernel the steps run (magnetar.ops.slots: runtime.attention_backend when it
        # owns one, else flex for a compiled or captured step on CUDA, torch's float32 math otherwise)
        self.attention = decode_attention(attention_backend, device, mode)

    # ---------------------------------------------------------------------------------------------- slots
    def place(self, rid: int, shard: KVShard, gen: Optional[KVShard]) -> None:
        """Give request ``rid`` a free slot (more slots, or more capacity, when none is free or it does not fit):
        (query rank) its ``gen`` store's KV copied into it; its context ``shard`` is read where it lies, never
        copied."""
        need = (gen.tokens() if gen is not None else 0) + 1
        if self.slots is None:
            self.slots = self._new_slots(shard.num_layers, *(self._planned(1, need) or (1, _round(need))),
                                         *self._model_heads())
        used = set(self.owner.values())
        free = [i for i in range(self.slots.slots) if i not in used]
        if not free or need > self.slots.capacity:
            self._relayout(*self._grow(len(self.owner) + 1, need))
            used = set(self.owner.values())
            free = [i for i in range(self.slots.slots) if i not in used]
        slot = free[0]
        for i in range(shard.num_layers):
            g = gen.layers[i] if gen is not None else None
            self.slots.place(slot, [(g.k, g.v, g.pos)] if g is not None and g.k is not None else [], i)
        self.owner[rid] = slot
        self.context[rid] = shard
        self._point()

    def _point(self) -> None:
        """Point the table's rows at the contexts of the requests holding them now (rows whose request changed
        only); the others empty."""
        table = self.slots.table if self.slots is not None else None
        if table is None:
            return
        if table is not self._table:  # new slots (or the pool's table, which another batch may have pointed)
            table.clear_all()
            self._pointed, self._table = {}, table
        at = {slot: rid for rid, slot in self.owner.items()}
        for row in range(table.rows):
            rid = at.get(row)
            if self._pointed.get(row) == rid:
                continue
            if rid is None:
                table.clear(row)
                self._pointed.pop(row, None)
                continue
            shard, layers = self.context[rid], []
            for i in range(shard.num_layers):
                segs = shard.segments(i)
                if len(segs) > PAGES:  # more pieces than a row holds: joined (a copy, once, on the request's view)
                    segs = [shard.whole(i)]
                layers.append([(lk.k, lk.v, lk.pos) for lk in segs])
            table.put(row, layers)
            self._pointed[row] = rid

    def _planned(self, requests: int, need: int) -> Optional[tuple[int, int]]:
        """A ``graph`` batch's smallest planned shape for ``requests`` slots of ``need`` entries (None: not a graph
        batch, or none fits -- said once: it runs uncaptured)."""
        if self.graphs is None:
            return None
        shape = self.graphs.plan.fit(requests, need)
        if shape is None and not self._off_plan:
            self._off_plan = True
            log.warning("decode_step graph: %d requests of up to %d KV entries fit no planned shape (%s): they run "
                        "uncaptured; raise runtime.decode_graph_tokens (--decode-graph-tokens) or "
                        "decode_graph_batches (--decode-graph-batches) to plan for them", requests, need,
                        self.graphs.plan.describe())
        return shape

    def _grow(self, requests: int, need: int) -> tuple[int, int]:
        """The shape for ``requests`` slots of ``need`` entries from today's: a planned one (``graph``), else as many
        slots (the next power of two when more are needed) and as much capacity (doubled when more is needed)."""
        sl = self.slots
        shape = self._planned(requests, max(need, sl.capacity))
        if shape is not None:
            return shape
        slots = sl.slots if requests <= sl.slots else _bucket(requests)
        return slots, sl.capacity if need <= sl.capacity else _round(max(need, 2 * sl.capacity))

    def _new_slots(self, num_layers: int, slots: int, capacity: int, hkv: int, d: int, mark: bool = True
                   ) -> StaticSlots:
        """Empty slots of that shape: the pool's views for a ``graph`` batch whose shape the pool holds (and no other
        batch holds the pool; their entries marked empty unless not ``mark``), else buffers of their own."""
        g = self.graphs
        pooled = g is not None and g.pool is not None and slots * capacity <= g.pool.tokens and g.take(self)
        if g is not None and not pooled:
            self._give_back()
        writes = self.groups.is_cp_leader
        table = None if pooled or self.pointers is None else \
            PointerTable(num_layers, slots, PAGES, hkv, self.device)
        new = StaticSlots.over(g.pool, slots, capacity, writes) if pooled else \
            StaticSlots(num_layers, slots, capacity, hkv, d, self._dtype(), self.device, writes=writes,
                        graphs=self.mode == "compiled", table=table)
        if pooled and mark:
            for pos in new.pos:
                pos.fill_(FAR)
        return new

    def _relayout(self, slots: int, capacity: int) -> None:
        """Move the held slots into ``slots`` x ``capacity`` (each slot's entries kept, renumbered in order where a
        slot index would not fit); views over the same pool go through a copy of what is held, layer by layer --
        unless only the number of slots changes and every held slot keeps its index: the same addresses then."""
        old = self.slots
        held = sorted(self.owner.items(), key=lambda x: x[1])
        keep = all(s < slots for _, s in held)
        target = {rid: s if keep else i for i, (rid, s) in enumerate(held)}
        was_pooled = old.pooled
        new = self._new_slots(old.num_layers, slots, capacity, old.hkv, old.d, mark=not was_pooled)
        same = was_pooled and new.pooled  # the old views and the new ones share memory: copy out first
        if same and keep and capacity == old.capacity:  # slot s sits at the same addresses in both views:
            for layer in range(old.num_layers):  # nothing moves; the slots added start empty
                new.pos[layer][old.slots:] = FAR
            for _, s in held:
                new.fill[s] = old.fill[s]
            self.owner, self.slots = target, new
            self._point()
            return
        for layer in range(old.num_layers):
            parts = {}
            for rid, s in held:
                n = old.fill[s]
                part = (old.k[layer][s:s + 1, :, :n], old.v[layer][s:s + 1, :, :n], old.pos[layer][s, :n])
                parts[rid] = tuple(t.clone() for t in part) if same else part
            if same:
                new.pos[layer].fill_(FAR)
            for rid, part in parts.items():
                new.place(target[rid], [part], layer)
        if was_pooled and not new.pooled:
            self._give_back()
        self.owner, self.slots = target, new
        self._point()

    def generated(self, rid: int) -> tuple[torch.Tensor, ...]:
        """Request ``rid``'s query and generated KV on this (query) rank, per layer ``(k, v, pos)``: what its slot
        holds (the eager store's content, for :meth:`DecodeBatch` going back to eager)."""
        s, n = self.owner[rid], self.slots.fill[self.owner[rid]]
        sl = self.slots
        return tuple((sl.k[i][s:s + 1, :, :n], sl.v[i][s:s + 1, :, :n], sl.pos[i][s, :n])
                     for i in range(sl.num_layers))

    def close(self) -> None:
        """Drop the slots (the batch goes eager for good) and give the pool back."""
        self._give_back()
        self.slots, self.owner, self.context, self._pointed, self._table = None, {}, {}, {}, None

    def _give_back(self) -> None:
        """Give the pool back (``graph``), its table's rows emptied first (no context is held through it)."""
        if self.graphs is None:
            return
        pool = self.graphs.pool
        if self.graphs.holder is self and pool is not None and pool.table is not None:
            pool.table.clear_all()
            self._pointed, self._table = {}, None
        self.graphs.give_back(self)

    @torch.inference_mode()  # the slots are inference tensors (made in a join)
    def release(self, rid: int) -> int:
        """Free request ``rid``'s slot; returns how many entries it held. The last one out frees the buffers (the
        next request gets slots sized for it, not for the largest batch or context seen so far; not compiled) and
        gives the pool back (``graph``)."""
        slot = self.owner.pop(rid)
        self.context.pop(rid)
        n = self.slots.fill[slot]
        if self.owner or self.compiles:
            self.slots.clear(slot)
            self._point()
        else:
            self._give_back()
            self.slots, self._pointed, self._table = None, {}, None  # the table goes with them, and its references
        return n

    @property
    def compiles(self) -> bool:
        """Whether the steps run compiled (its graphs keep their buffers: no freeing, no repacking -- new shapes
        would compile anew)."""
        return self.mode == "compiled" and self.fallback is None

    def _compact(self) -> None:
        """Repack the slots held into fewer when there are at least twice too many for the requests holding them
        (a batch's last requests: every step computes every slot's row), each slot's capacity fitted to what is
        held (``graph``: into the smallest planned shape that holds them with room to double). The rule reads the
        requests only, so every rank of the replica repacks alike (the gathered rows must stay the same requests).
        Not compiled (a compiled graph keeps its shapes)."""
        if self.compiles:
            return
        sl = self.slots
        room = 2 * max(sl.fill[s] for s in self.owner.values())
        if self.graphs is not None:
            shape = self.graphs.plan.fit(len(self.owner), room)
            if shape is not None and (2 * shape[0] <= sl.slots or 2 * shape[1] <= sl.capacity):
                self._relayout(*shape)
            return
        slots = _bucket(len(self.owner))
        if slots * 2 > sl.slots:
            return
        self._relayout(slots, min(sl.capacity, _round(room)))

    def _dtype(self):
        return next(self.model.parameters()).dtype

    def _model_heads(self) -> tuple[int, int]:
        dims = ModelDims.from_config(self.model.config)
        return dims.kv_heads // self.groups.tp_size, dims.head_dim

    # ---------------------------------------------------------------------------------------------- steps
    def nonfinite_message(self, what: str) -> str:
        """Why a static step's logits were not finite (no per-layer flags are kept inside the step; every rank
        says the same, with no collective)."""
        return (f"non-finite logits in Phase 2 ({what}; static decode step: which layer first turned non-finite is "
                f"not recorded, runtime.decode_step=eager records it); {HINT}")

    def step(self, rids: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """One decode step of requests ``rids`` (their last tokens and the positions of the new ones): their logits
        ``(len(rids), V)``, in order. The slots that hold none of them step too (their rows are dropped). Nothing
        here waits for the device (the inputs are copied to it, the logits stay there; tests/test_static_decode.py
        checks it): the batch reads the chosen tokens and the finite flags once, after the step."""
        self._compact()
        sl = self.slots
        need = max(sl.fill[self.owner[r]] for r in rids) + 1
        if need > sl.capacity:
            self._relayout(*self._grow(len(self.owner), need))
            sl = self.slots
        ids = torch.zeros(sl.slots, 1, dtype=torch.long)
        pos = torch.zeros(sl.slots, 1, dtype=torch.long)
        # an idle slot (empty, or its request finished) writes where nothing of it is read
        write = torch.tensor([min(f, sl.capacity - 1) for f in sl.fill], dtype=torch.long)
        rows, starts = [], {}
        for r, t, p in zip(rids, tokens, positions):
            s = self.owner[r]
            ids[s, 0], pos[s, 0] = t, p
            rows.append(s)
            starts[s] = p
        ids, pos, write, picked = (to_device(t, self.device) for t in (ids, pos, write, torch.tensor(rows)))
        if sl.table is None:  # the contexts as pages: the slots stepping now, their contexts and own entries
            self._set_pages(pos, starts)
        # uncompiled, uncaptured steps read each slot up to the longest fill (a multiple of 64); compiled and captured
        # steps keep their shapes (the empty entries sit at FAR: invisible; a captured step's kernel skips them)
        used = min(sl.capacity, -(-(max(sl.fill) + 1) // 64) * 64)
        logits = self._run(ids, pos, write, used)
        if sl.writes:
            for s in rows:
                sl.fill[s] += 1
        return logits[picked]

    def _run(self, ids: torch.Tensor, pos: torch.Tensor, write: torch.Tensor, used: Optional[int]) -> torch.Tensor:
        if self.slots.table is not None:  # the rows changed by joins and leaves reach the device (queued)
            self.slots.table.sync()
        if self.graphs is not None:
            logits = self.graphs.replay(self.slots, ids, pos, write)
            if logits is not None:
                return logits
        if self.compiles:
            if self._compiled is None:
                from magnetar.ops.backends.flex import allow_recompiles

                allow_recompiles()  # every batch (and every growth of its slots) brings new static buffers
                mode = "reduce-overhead" if ids.device.type == "cuda" else None
                # dynamic=None (torch's default): the first shape compiles static, the first other one with the
                # sizes that changed dynamic, and later shapes reuse it (measured on CPU: a capacity-dynamic graph
                # at batch 1, a slot-dynamic one at batch 8, each at the static graph's speed; with both sizes
                # dynamic -- dynamic=True, or a warm-up changing both -- a served step was 1.7x slower)
                _keep_out_of_graphs()
                self._compiled = torch.compile(self._forward, mode=mode, dynamic=None)
            try:
                if ids.device.type == "cuda":
                    torch.compiler.cudagraph_mark_step_begin()
                return self._compiled(ids, pos, write).clone()
            except Exception as e:  # noqa: BLE001 - any compiler failure: say why, then run the same step uncompiled
                self.fallback = f"torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:300]})"
                log.warning("decode_step compiled: %s; decode steps run static (batched, uncompiled)", self.fallback)
        if self.attention == "flex" and self.fallback is None and not self.compiles:
            try:
                return self._forward(ids, pos, write, used)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - the compiled slot kernel failed here: say why, use torch's
                self.fallback = f"the flex slot kernel failed ({type(e).__name__}: {str(e).splitlines()[0][:300]})"
                log.warning("decode_step %s: %s; decode steps use torch's slot kernel", self.mode, self.fallback)
                # the step again: its KV writes land where they did, with the same values
        return self._forward(ids, pos, write, used)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, write: torch.Tensor, used: Optional[int] = None
                 ) -> torch.Tensor:
        attention = self.attention if self.fallback is None else "torch"
        part = self._part if self.slots.table is not None else self._page_part
        return decode_forward(self.model, self.slots, self.groups, attention, ids, pos, write, part, used)

    def _set_pages(self, pos: torch.Tensor, starts: dict[int, int]) -> None:
        """The page part's reads in this step: the slots stepping (``starts``: slot -> its token's position; an idle
        slot's row reads nothing) over their contexts, and each one's own entries after this step's write."""
        at = {slot: rid for rid, slot in self.owner.items()}
        if self._empty is None:
            self._empty = KVShard(self.slots.num_layers)
            self._empty.freeze()
        n = self.slots.slots
        shards = [self.context[at[s]] if s in starts else self._empty for s in range(n)]
        self.step_pages = self.pages(pos, shards, [starts.get(s, 0) for s in range(n)])
        self.step_own = [self.slots.fill[s] + 1 if s in starts else 0 for s in range(n)]


def decode_attention(attention_backend: str, device, mode: str) -> str:
    """The backend whose slot kernel a ``mode`` step runs (:func:`magnetar.ops.slots.slot_backend`)."""
    # a graph step is compiled and captured on CUDA; on a CPU nothing is captured: it runs as a static step does
    compiled = mode == "compiled" or (mode == "graph" and torch.device(device).type == "cuda")
    return slot_backend(attention_backend, device, compiled=compiled).name


def decode_forward(model, slots: StaticSlots, groups: ParallelGroups, attention: str, ids: torch.Tensor,
                   pos: torch.Tensor, write: torch.Tensor, contexts: Contexts, used: Optional[int] = None
                   ) -> torch.Tensor:
    """One step of every slot (its token ``ids (B, 1)`` at positions ``pos (B, 1)``, its KV written at entry
    ``write (B,)``, its context part ``contexts``): the last position's logits ``(B, V)`` -- what a compiled step
    compiles and a graph captures."""
    ctx = StaticContext(slots, pos, write, groups, get_backend(attention).slot_forward, contexts, used)
    out = model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1, magnetar=ctx)
    return out.logits[:, -1]


def prepare_graphs(model, config, groups: ParallelGroups, device, policy, max_positions: Optional[int]
                   ) -> Optional[DecodeGraphs]:
    """The engine's :class:`~magnetar.engine.graphs.DecodeGraphs` when its steps run ``graph`` (None otherwise),
    its graphs captured now on CUDA (the warm-up's time logged, bounded by ``runtime.decode_graph_warmup_s``)."""
    rt = config.runtime
    if static_problem(rt.decode_step, policy, groups)[0] != "graph":
        return None
    graphs = DecodeGraphs.for_model(model, rt, device, max_positions, MIN_CAPACITY)
    attention = decode_attention(rt.attention_backend, device, "graph")
    pointers = pointer_backend(rt.attention_backend, device, required=True)
    part = PointerPart(pointers, lambda: graphs.pool.table)
    if graphs.captures:  # the graphs read the slots' contexts through one table at the addresses they hold
        dims = ModelDims.from_config(model.config)
        rows = graphs.pool.tokens // MIN_CAPACITY  # the most slots any view of the pool has
        graphs.pool.table = PointerTable(dims.layers, rows, PAGES, dims.kv_heads, device)

    def step(slots, ids, pos, write):
        return decode_forward(model, slots, groups, attention, ids, pos, write, part)

    with torch.inference_mode():
        graphs.capture(step, lambda b, c: StaticSlots.over(graphs.pool, b, c, writes=True), rt.decode_graph_warmup_s)
    return graphs


def _round(n: int) -> int:
    """A slot capacity for ``n`` entries: the next multiple of :data:`MIN_CAPACITY` above it."""
    return (n // MIN_CAPACITY + 1) * MIN_CAPACITY
