"""Decode steps whose shapes are fixed up front and, on CUDA, captured as CUDA graphs once, at start
(``runtime.decode_step`` = ``graph``; issue 47, item 1).

A ``static`` step (:mod:`magnetar.engine.static`) picks its shapes as requests come: slots in powers of two, capacity
doubling -- and a ``compiled`` one compiles anew for every shape a server meets (the first question about an 8K
document waited 105 s on CPU). vLLM captures its graphs once at start for a fixed set of batch sizes and pads to the
next one; this module does that for Magnetar's slots:

* :class:`GraphPlan` -- the shapes, decided from the config before any request: the batch sizes
  ``runtime.decode_graph_batches`` (slots; default 1, 2, 4, ..., 64) times the capacities (from
  :data:`~magnetar.engine.static.MIN_CAPACITY` up to the model's positions, at most a quarter apart from 1024 on:
  :func:`capacities_up_to`), every pair whose slots x capacity fits the pool (``runtime.decode_graph_tokens`` KV
  entries per layer; 0: an eighth of the device's free memory on CUDA, no bound on the CPU). A slot holds its
  request's own tokens -- its query's and the generated ones' KV --, not its context, which the step reads where the
  context cache holds it, through the pool's :class:`~magnetar.ops.pointers.PointerTable` (the addresses the graphs
  read). A batch takes the smallest planned shape that holds it: a request's slot is padded to the next capacity, a
  batch to the next batch size (idle slots step too; their rows are thrown away).
* :class:`SlotPool` -- one flat KV buffer per layer (``tokens x Hkv x D``, and the key positions), allocated once;
  each planned shape ``(B, C)`` views its first ``B x C`` entries as ``(B, Hkv, C, D)``. A graph reads and writes the
  addresses it was captured with, so every shape's views must sit in one allocation; a batch moving to another shape
  of the same capacity keeps every held slot where it is, and one whose capacity changes has its entries copied into
  the new layout through a temporary of one layer's held KV at a time (:meth:`StaticDecode._relayout`).
* :class:`DecodeGraphs` -- the engine's plan, pool and, on CUDA, one ``torch.cuda.CUDAGraph`` per planned shape,
  captured when the engine starts (each shape's eager step run twice on a side stream first -- the FlexAttention
  slot kernel compiles there -- then captured into one shared memory pool): a step copies its token ids, positions
  and write entries into the graph's input buffers and replays it. The warm-up's time is logged and bounded
  (``runtime.decode_graph_warmup_s``: the shapes left when it runs out are not captured and run uncaptured). One
  decode batch holds the pool at a time; another one at the same time gets buffers of its own and runs uncaptured.

On the CPU nothing is captured (there is no graph to launch): the same planned shapes run eagerly, the step a graph
would hold -- which is what CI tests (tokens equal eager's; no host synchronization inside a step). A capture that
fails (a synchronization inside the step, a kernel that cannot be captured) leaves every shape uncaptured and says
why (:attr:`DecodeGraphs.why_not`). Real CP ranks and tensor parallelism run ``static`` (a collective between the
layers stays outside a graph: :func:`~magnetar.engine.static.static_problem`).
"""
from __future__ import annotations

import functools
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from magnetar.config.sections import parse_batches
from magnetar.models.dims import ModelDims
from magnetar.ops.slots import FAR

log = logging.getLogger(__name__)

MAX_PLANNED_CAPACITY = 1 << 21  # capacities stop here when the model states no positions


def capacities_up_to(limit: int, first: int) -> tuple[int, ...]:
    """Slot capacities from ``first`` up to the first one >= ``limit``: powers of two times ``first``, and from
    ``4 x first`` on quarter steps between them (P, 1.25P, 1.5P, 1.75P, 2P, ...): a slot is padded by at most a
    quarter beyond ``4 x first`` (the padding costs memory, not reads: the slot kernel skips the empty blocks)."""
    caps, p = [], first
    while not caps or caps[-1] < limit:
        steps = (4, 5, 6, 7) if p >= 4 * first else (4,)
        caps += [p * s // 4 for s in steps]
        p *= 2
    return tuple(c for i, c in enumerate(caps) if i == 0 or caps[i - 1] < limit)


@dataclass(frozen=True)
class GraphPlan:
    """The decode shapes ``(slots B, capacity C)`` an engine runs: every batch size of ``batches`` with every
    capacity of ``capacities`` whose ``B x C`` entries fit ``tokens`` (None: no bound)."""

    batches: tuple[int, ...]
    capacities: tuple[int, ...]
    tokens: Optional[int] = None

    @classmethod
    def make(cls, batches: tuple[int, ...], max_positions: Optional[int], tokens: Optional[int],
             first: int) -> "GraphPlan":
        limit = max_positions or MAX_PLANNED_CAPACITY
        if tokens is not None:
            limit = min(limit, tokens)
        return cls(batches, capacities_up_to(max(limit, first), first), tokens)

    def shapes(self) -> list[tuple[int, int]]:
        """Every planned shape, batch sizes first then capacities, ascending."""
        return list(self._shapes)

    @functools.cached_property
    def _shapes(self) -> tuple[tuple[int, int], ...]:
        return tuple((b, c) for b in self.batches for c in self.capacities
                     if self.tokens is None or b * c <= self.tokens)

    def fit(self, requests: int, need: int) -> Optional[tuple[int, int]]:
        """The smallest planned shape with at least ``requests`` slots of at least ``need`` entries each (fewest
        entries, then fewest slots), or None when none holds them (a batch's every step asks: one pass)."""
        best = None
        for b, c in self._shapes:
            if b >= requests and c >= need and (best is None or (b * c, b) < (best[0] * best[1], best[0])):
                best = (b, c)
        return best

    def describe(self) -> str:
        bound = "no bound" if self.tokens is None else f"{self.tokens} entries"
        return (f"batch sizes {','.join(map(str, self.batches))} x capacities {self.capacities[0]}.."
                f"{self.capacities[-1]} (slots x capacity within {bound}: {len(self.shapes())} shapes)")


class SlotPool:
    """One flat KV buffer per layer (``tokens x hkv x d``) and its key positions (``tokens``, :data:`FAR` when
    empty), allocated once; :meth:`views` are a planned shape's slots over them."""

    def __init__(self, num_layers: int, tokens: int, hkv: int, d: int, dtype, device):
        self.tokens, self.hkv, self.d = tokens, hkv, d
        self.k = [torch.zeros(tokens * hkv * d, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(tokens * hkv * d, dtype=dtype, device=device) for _ in range(num_layers)]
        self.pos = [torch.full((tokens,), FAR, dtype=torch.long, device=device) for _ in range(num_layers)]
        self.table = None  # captured steps: the slots' contexts by address (magnetar.ops.pointers.PointerTable)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *self.pos))

    def views(self, slots: int, capacity: int) -> tuple[list, list, list]:
        """Per layer ``k, v (slots, hkv, capacity, d)`` and ``pos (slots, capacity)`` over the pool's first
        ``slots x capacity`` entries (the same addresses whenever the same shape is asked for)."""
        n = slots * capacity
        if n > self.tokens:
            raise ValueError(f"{slots} slots x {capacity} entries exceed the slot pool ({self.tokens} entries)")
        e = n * self.hkv * self.d
        k = [t[:e].view(slots, self.hkv, capacity, self.d) for t in self.k]
        v = [t[:e].view(slots, self.hkv, capacity, self.d) for t in self.v]
        return k, v, [t[:n].view(slots, capacity) for t in self.pos]


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"  # anything with replay()
    ids: torch.Tensor
    pos: torch.Tensor
    write: torch.Tensor
    logits: torch.Tensor


@dataclass
class DecodeGraphs:
    """An engine's decode plan, its slot pool and (CUDA) the graphs captured for the plan's shapes."""

    plan: GraphPlan
    pool: Optional[SlotPool]
    device: torch.device
    graphs: dict = field(default_factory=dict)  # (slots, capacity) -> _Graph
    _holder: Optional[weakref.ref] = None  # the StaticDecode whose slots are the pool's views now
    warmup_s: float = 0.0
    uncaptured: list = field(default_factory=list)  # planned shapes the warm-up's time bound left out
    why_not: Optional[str] = None  # why nothing is captured (None: the graphs run)

    @classmethod
    def for_model(cls, model, runtime, device, max_positions: Optional[int], first: int) -> "DecodeGraphs":
        """The plan of ``runtime`` (``decode_graph_batches``, ``decode_graph_tokens``) for ``model`` on ``device``;
        the pool is allocated on CUDA (an eighth of the free memory when ``decode_graph_tokens`` is 0: it holds the
        requests' own tokens, the contexts stay in the cache) or where ``decode_graph_tokens`` is given."""
        device = torch.device(device)
        dims = ModelDims.from_config(model.config)
        dtype = next(model.parameters()).dtype
        hkv, d = dims.kv_heads, dims.head_dim
        batches = parse_batches(runtime.decode_graph_batches)
        per_token = dims.layers * (2 * hkv * d * dtype.itemsize + 8)
        tokens: Optional[int] = runtime.decode_graph_tokens or None
        if tokens is None and device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            tokens = max(first, (free // 8) // per_token // first * first)
        plan = GraphPlan.make(batches, max_positions, tokens, first)
        if tokens is not None:
            top = max(b * c for b, c in plan.shapes()) if plan.shapes() else first
            tokens = min(tokens, top)
        pool = SlotPool(dims.layers, tokens, hkv, d, dtype, device) if tokens is not None else None
        graphs = cls(plan, pool, device)
        if pool is not None:
            log.info("decode_step graph: %s; a slot pool of %.1f MiB", plan.describe(), pool.nbytes() / 2**20)
        return graphs

    @property
    def captures(self) -> bool:
        """Whether this engine's decode graphs are captured (CUDA, a pool): their steps read the contexts through the
        pool's pointer table."""
        return self.pool is not None and _can_capture(self.device)

    # ------------------------------------------------------------------------------------------- the pool
    @property
    def holder(self):
        """The StaticDecode holding the pool (None: free; a batch dropped without releasing it holds it no more)."""
        return self._holder() if self._holder is not None else None

    def take(self, holder) -> bool:
        """Give ``holder`` (a StaticDecode) the pool if no other holds it; whether it has it."""
        if self.pool is None:
            return False
        if self.holder is None:
            self._holder = weakref.ref(holder)
        return self.holder is holder

    def give_back(self, holder) -> None:
        if self.holder is holder:
            self._holder = None

    # ------------------------------------------------------------------------------------------- graphs
    def capture(self, step: Callable, make_slots: Callable, budget_s: float) -> None:
        """Capture one CUDA graph per planned shape (CUDA only): ``make_slots(B, C)`` the pool's slots of that
        shape, ``step(slots, ids, pos, write)`` the step's logits. Shapes in order (batch sizes, then capacities,
        ascending), until ``budget_s`` seconds have gone; the pool is left empty."""
        t0 = time.perf_counter()
        if not _can_capture(self.device) or self.pool is None:
            self.why_not = f"nothing is captured on {self.device.type} (no CUDA graphs): the planned shapes run eagerly"
            return
        try:
            mempool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
            for b, c in self.plan.shapes():
                if time.perf_counter() - t0 > budget_s:
                    self.uncaptured.append((b, c))
                    continue
                ids = torch.zeros(b, 1, dtype=torch.long, device=self.device)
                pos = torch.zeros(b, 1, dtype=torch.long, device=self.device)
                write = torch.zeros(b, dtype=torch.long, device=self.device)
                graph, logits = _record(step, make_slots(b, c), ids, pos, write, mempool)
                self.graphs[(b, c)] = _Graph(graph, ids, pos, write, logits)
        except Exception as e:  # noqa: BLE001 - any capture failure: say why, run every shape uncaptured
            self.graphs.clear()
            self.why_not = f"capturing a decode graph failed ({type(e).__name__}: {str(e).splitlines()[0][:300]})"
            log.warning("decode_step graph: %s; the planned shapes run uncaptured", self.why_not)
        finally:
            for pos in self.pool.pos:
                pos.fill_(FAR)
            self.warmup_s = time.perf_counter() - t0
        if self.graphs:
            left = f"; {len(self.uncaptured)} shapes left uncaptured by runtime.decode_graph_warmup_s " \
                   f"(--decode-graph-warmup-s {budget_s:g})" if self.uncaptured else ""
            log.warning("decode_step graph: captured %d decode graphs in %.1f s (%s)%s", len(self.graphs),
                        self.warmup_s, self.plan.describe(), left)

    def replay(self, slots, ids: torch.Tensor, pos: torch.Tensor, write: torch.Tensor) -> Optional[torch.Tensor]:
        """The logits of the graph captured for ``slots``' shape (its inputs copied in, replayed; the returned buffer
        is the graph's, overwritten by its next replay), or None when that shape has none (run it uncaptured)."""
        g = self.graphs.get((slots.slots, slots.capacity)) if slots.pooled else None
        if g is None:
            return None
        g.ids.copy_(ids)
        g.pos.copy_(pos)
        g.write.copy_(write)
        g.graph.replay()
        return g.logits


def _can_capture(device: torch.device) -> bool:
    """Whether decode graphs are captured on ``device`` (CUDA; the tests make the CPU emulate one)."""
    return device.type == "cuda"


def _record(step: Callable, slots, ids: torch.Tensor, pos: torch.Tensor, write: torch.Tensor, mempool):
    """``(graph, logits)``: ``step(slots, ids, pos, write)`` captured as a CUDA graph into ``mempool`` -- run twice on
    a side stream first (the FlexAttention slot kernel compiles and autotunes there, cuBLAS makes its workspaces);
    replaying the graph recomputes ``logits`` (its output buffer) from whatever ``ids``, ``pos``, ``write`` and the
    slots hold then."""
    dev = ids.device
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):
            step(slots, ids, pos, write)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=mempool):
        logits = step(slots, ids, pos, write)
    return graph, logits
