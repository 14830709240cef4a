"""Static decode steps: every request's KV in preallocated slots, one attention call per layer for the whole batch,
and a step that ``torch.compile`` (on CUDA with CUDA graphs) or a CUDA graph captured at start can hold (issue 33,
item 2; issue 47, item 1).

``runtime.decode_step`` chooses how a :class:`~magnetar.engine.phase2.DecodeBatch` runs its decode steps:

* ``eager`` -- :class:`~magnetar.engine.phase2.Phase2Context`: per layer, one attention call per request over its
  own context shard and generated-KV store, merged. Every decode policy (sparse decoding, LuKA) runs this way.
* ``static`` -- :class:`StaticSlots`: when a request joins (after its query forward, which stays eager), this rank's
  KV of it -- its context shard and, on the query rank, its query tokens' KV -- is copied once into a slot of
  preallocated per-layer buffers ``(slots, Hkv, capacity, D)``; each step writes the new token's KV in place and
  attends all slots in ONE call per layer (:mod:`magnetar.ops.slots`: the decode kernel of an attention backend,
  float32 scores, key positions decide what each query sees, the empty part of a slot sits at position
  :data:`~magnetar.ops.slots.FAR`), then the CP gather and merge as eager. No per-request Python, no per-call
  checks; the shapes change only when the slots or their capacity grow.
* ``compiled`` -- the static step under ``torch.compile`` (``mode="reduce-overhead"``: CUDA graphs, on CUDA): the
  first shape compiles static, the first other one with the sizes that changed dynamic, which later shapes reuse
  (``magnetar serve`` compiles a single request's graphs before its first request; a batch's first step compiles
  once more); the CP gather and merge stay outside the graph (a graph break per layer where cp_size > 1). If
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
the output through ``0 * NaN`` -- cannot arise: a slot's context KV is checked finite once when it is placed (a
request whose context KV is not finite makes the batch go back to ``eager``, which has the exact rules), and a
generated token's value is seen by its own query first, whose logits are checked every step.

Memory: a slot holds a copy of its request's context KV on this rank (the context cache keeps the original), so a
batch of requests over one cached context holds it once per request; capacity grows by doubling.
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from magnetar.engine.finite import HINT
from magnetar.engine.graphs import DecodeGraphs, SlotPool
from magnetar.engine.kv import KVShard
from magnetar.engine.strategy import LayerContext
from magnetar.models.dims import ModelDims
from magnetar.ops import merge_states
from magnetar.ops.backends import get_backend
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
                 graphs: bool = False, pool: Optional[SlotPool] = None):
        self.num_layers, self.slots, self.capacity, self.writes = num_layers, slots, capacity, writes
        self.graphs = graphs
        self.hkv, self.d, self.dtype, self.device = hkv, d, dtype, device
        self.pooled = pool is not None  # views over a SlotPool (decode_step graph: the addresses its graphs hold)
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


class StaticContext(LayerContext):
    """The layer context of one static decode step over ``slots`` (every slot steps; an empty slot's row is thrown
    away): ``positions (slots, 1)`` of the new tokens, ``write (slots,)`` the entry each writes its KV to."""

    layer_range = None  # no profiler range inside a compiled graph (magnetar_attention skips it)

    def __init__(self, slots: StaticSlots, positions: torch.Tensor, write: torch.Tensor, groups: ParallelGroups,
                 attention, used: Optional[int] = None):
        self.slots, self.positions, self.write, self.groups = slots, positions, write, groups
        self.attention, self.used = attention, used  # used: attend the slots' first `used` entries only (None: all)
        self.rows = torch.arange(write.shape[0], device=write.device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: Optional[int] = None) -> torch.Tensor:
        sl = self.slots
        kb, vb, kp = sl.k[layer], sl.v[layer], sl.pos[layer]
        if sl.writes:  # one new token per slot, at its write entry (index_put: the compiler updates it in place,
            rows = self.rows  # where a scatter_ became a copy of the whole buffer every layer)
            kb[rows, :, self.write] = k[:, :, 0]
            vb[rows, :, self.write] = v[:, :, 0]
            kp[rows, self.write] = self.positions[:, 0]
        if self.used is not None:  # the entries past every slot's fill are empty: not read (views, no copy)
            kb, vb, kp = kb[:, :, :self.used], vb[:, :, :self.used], kp[:, :self.used]
        out, lse = self.attention(q, kb, vb, self.positions, kp, scale, window)
        if self.groups.cp_size > 1:
            out = _gather_merge(out, lse, self.groups)
        return out


def _gather_merge_eager(out: torch.Tensor, lse: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """The CP gather of every rank's ``(out, lse)`` and their merge (outside any compiled graph)."""
    outs, lses = all_gather_states(out, lse, groups.cp_group, timeout=groups.timeout)
    return merge_states(outs, lses)[0]


# what StaticContext.attend calls: made ``torch.compiler.disable``'d (a graph break) by the first compiled step --
# not at import: ``torch.compiler.disable`` imports torch._dynamo, 1.4 s of every process's ``import magnetar``
_gather_merge = _gather_merge_eager


def _keep_out_of_graphs() -> None:
    global _gather_merge
    if _gather_merge is _gather_merge_eager:
        _gather_merge = torch.compiler.disable(_gather_merge_eager)


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
                 graphs: Optional[DecodeGraphs] = None):
        self.model, self.groups, self.device, self.mode = model, groups, device, mode
        self.graphs = graphs if mode == "graph" else None
        self.slots: Optional[StaticSlots] = None
        self.owner: dict[int, int] = {}  # rid -> slot
        self.fallback: Optional[str] = None  # why a compiled step runs static
        self._compiled = None
        self._off_plan = False  # a graph batch outgrew the plan (said once)
        # the attention backend whose decode kernel the steps run (magnetar.ops.slots: runtime.attention_backend when it
        # owns one, else flex for a compiled or captured step on CUDA, torch's float32 math otherwise)
        self.attention = decode_attention(attention_backend, device, mode)

    # ---------------------------------------------------------------------------------------------- slots
    def place(self, rid: int, shard: KVShard, gen: Optional[KVShard]) -> None:
        """Copy request ``rid``'s KV on this rank -- its context ``shard`` (a fork's segments one after another) and
        (query rank) its ``gen`` store -- into a free slot (more slots, or more capacity, when none is free or it
        does not fit)."""
        layers = [shard.segments(i) for i in range(shard.num_layers)]
        need = shard.tokens() + (gen.tokens() if gen is not None else 0) + 1
        if self.slots is None:
            hkv_d = next(((lk.k.shape[1], lk.k.shape[3]) for lk in (*(s for segs in layers for s in segs),
                                                                    *(gen.layers if gen else ()))
                          if lk.k is not None), None) or self._model_heads()
            self.slots = self._new_slots(len(layers), *(self._planned(1, need) or (1, _round(need))), *hkv_d)
        used = set(self.owner.values())
        free = [i for i in range(self.slots.slots) if i not in used]
        if not free or need > self.slots.capacity:
            self._relayout(*self._grow(len(self.owner) + 1, need))
            used = set(self.owner.values())
            free = [i for i in range(self.slots.slots) if i not in used]
        slot = free[0]
        for i, segs in enumerate(layers):
            parts = [(lk.k, lk.v, lk.pos) for lk in segs]
            if gen is not None and gen.layers[i].k is not None:
                g = gen.layers[i]
                parts.append((g.k, g.v, g.pos))
            self.slots.place(slot, parts, i)
        self.owner[rid] = slot

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
            g.give_back(self)
        writes = self.groups.is_cp_leader
        new = StaticSlots.over(g.pool, slots, capacity, writes) if pooled else \
            StaticSlots(num_layers, slots, capacity, hkv, d, self._dtype(), self.device, writes=writes,
                        graphs=self.mode == "compiled")
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
            self.graphs.give_back(self)
        self.owner, self.slots = target, new

    def generated(self, rid: int, shard: KVShard) -> tuple[torch.Tensor, ...]:
        """Request ``rid``'s query and generated KV on this (query) rank, per layer ``(k, v, pos)``: what its slot
        holds after its context ``shard``'s entries (the eager store's content, for :meth:`DecodeBatch` going
        back to eager)."""
        s, n, a = self.owner[rid], self.slots.fill[self.owner[rid]], shard.tokens()
        sl = self.slots
        return tuple((sl.k[i][s:s + 1, :, a:n], sl.v[i][s:s + 1, :, a:n], sl.pos[i][s, a:n])
                     for i in range(sl.num_layers))

    def close(self) -> None:
        """Drop the slots (the batch goes eager for good) and give the pool back."""
        self.slots, self.owner = None, {}
        if self.graphs is not None:
            self.graphs.give_back(self)

    @torch.inference_mode()  # the slots are inference tensors (made in a join)
    def release(self, rid: int) -> int:
        """Free request ``rid``'s slot; returns how many entries it held. The last one out frees the buffers (the
        next request gets slots sized for it, not for the largest batch or context seen so far; not compiled) and
        gives the pool back (``graph``)."""
        slot = self.owner.pop(rid)
        n = self.slots.fill[slot]
        if self.owner or self.compiles:
            self.slots.clear(slot)
        else:
            self.slots = None
            if self.graphs is not None:
                self.graphs.give_back(self)
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
        rows = []
        for r, t, p in zip(rids, tokens, positions):
            s = self.owner[r]
            ids[s, 0], pos[s, 0] = t, p
            rows.append(s)
        ids, pos, write, picked = (to_device(t, self.device) for t in (ids, pos, write, torch.tensor(rows)))
        # uncompiled, uncaptured steps read each slot up to the longest fill (a multiple of 64); compiled and captured
        # steps keep their shapes (the empty entries sit at FAR: invisible; a captured step's kernel skips them)
        used = min(sl.capacity, -(-(max(sl.fill) + 1) // 64) * 64)
        logits = self._run(ids, pos, write, used)
        if sl.writes:
            for s in rows:
                sl.fill[s] += 1
        return logits[picked]

    def _run(self, ids: torch.Tensor, pos: torch.Tensor, write: torch.Tensor, used: Optional[int]) -> torch.Tensor:
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
        return decode_forward(self.model, self.slots, self.groups, attention, ids, pos, write, used)


def decode_attention(attention_backend: str, device, mode: str) -> str:
    """The backend whose slot kernel a ``mode`` step runs (:func:`magnetar.ops.slots.slot_backend`)."""
    # a graph step is compiled and captured on CUDA; on a CPU nothing is captured: it runs as a static step does
    compiled = mode == "compiled" or (mode == "graph" and torch.device(device).type == "cuda")
    return slot_backend(attention_backend, device, compiled=compiled).name


def decode_forward(model, slots: StaticSlots, groups: ParallelGroups, attention: str, ids: torch.Tensor,
                   pos: torch.Tensor, write: torch.Tensor, used: Optional[int] = None) -> torch.Tensor:
    """One step of every slot (its token ``ids (B, 1)`` at positions ``pos (B, 1)``, its KV written at entry
    ``write (B,)``): the last position's logits ``(B, V)`` -- what a compiled step compiles and a graph captures."""
    ctx = StaticContext(slots, pos, write, groups, get_backend(attention).slot_forward, used)
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

    def step(slots, ids, pos, write):
        return decode_forward(model, slots, groups, attention, ids, pos, write)

    with torch.inference_mode():
        graphs.capture(step, lambda b, c: StaticSlots.over(graphs.pool, b, c, writes=True), rt.decode_graph_warmup_s)
    return graphs


def _round(n: int) -> int:
    """A slot capacity for ``n`` entries: the next multiple of :data:`MIN_CAPACITY` above it."""
    return (n // MIN_CAPACITY + 1) * MIN_CAPACITY
