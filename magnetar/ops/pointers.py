"""Decode attention over KV read where it lies, through a table of addresses: the context part of a decode step a
CUDA graph holds (:mod:`magnetar.engine.static`, :mod:`magnetar.engine.graphs`).

A CUDA graph replays its kernels with the addresses they were captured with, but a cached context's KV lives in
tensors of its own, made long after the graphs were captured at start. A captured step therefore either copies
each request's context into buffers the graph knows -- a second copy of every context: an 8B model's batch of 8 at
32K holds 32 GiB of KV, which then does not fit an 80 GB card twice -- or reads it where it is, through a table the
graph knows. :class:`PointerTable` is that table: per layer and row (a decode slot), up to ``pages`` pieces of the
row's context KV, each its keys', values' and key positions' addresses, its length and its keys' and values' head
strides. The host writes a row when a request takes a slot or leaves it (:meth:`PointerTable.put`,
:meth:`PointerTable.clear`) and copies the table to the device once, before the next step (:meth:`PointerTable.sync`,
no wait for the device); a step's kernel reads it on the device, so a step never waits for the host and a graph
replays it as it is.

The contract is slot attention's (:mod:`magnetar.ops.slots`): ``q (B, Hq, 1, D)`` at ``q_pos (B, 1)`` over row b's
pages: key j is visible iff its position ``<= q_pos[b]`` (and ``> q_pos[b] - window``); ``(out (B, Hq, 1, D) in q's
dtype, lse (B, Hq, 1) float32)``, a row seeing no key (an empty row: an idle slot) ``(0, -inf)``. Triton's kernel
applies :mod:`magnetar.ops.nonfinite`'s rule (+-inf or NaN in q or in a key the row sees: the row NaN; in a value it
sees: its output NaN; what it does not see is not read); the torch one slot attention's (a static step places only
contexts checked finite, and a NaN in q reaches its output through the slot part too).

A backend of :mod:`magnetar.ops.backends` owns the kernel, as it owns its slot and paged kernels: one with
``pointers_forward(q, q_pos, table, layer, scale, window)``. ``triton_decode`` on CUDA (a split-KV kernel, one
launch per layer, the splits merged by :func:`~magnetar.ops.merge_states`); ``torch`` everywhere
(:func:`pointer_attention`: the rows' pages read from the table's host side, float32 math -- what the CPU tests run a
captured step with). :func:`pointer_backend` picks.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from magnetar.ops.backends import get_backend
from magnetar.ops.slots import slot_attention
from magnetar.utils.sync import to_device

PAGES = 4  # pieces of one row's context KV a table holds (a fork: its document's, then its own); more are joined

Piece = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (k (1, Hkv, n, D), v, pos (n,))

# the table's fields, its first dimension
K, V, POS, N, K_HEAD, V_HEAD = range(6)


class PointerTable:
    """Per layer, ``rows x pages`` pieces of context KV by address (module docstring): ``device`` the table a kernel
    reads, ``(6, layers, rows, pages)`` int64 -- keys', values', positions' addresses, lengths, the keys' and values'
    head strides (elements) -- and its host side, which :meth:`put` and :meth:`clear` write and :meth:`sync` copies.
    The table holds a reference to every tensor it points to (the rows' ``pieces``): none is freed while a kernel
    may read it."""

    def __init__(self, layers: int, rows: int, pages: int, hkv: int, device):
        self.layers, self.rows, self.pages, self.hkv = layers, rows, pages, hkv
        self.host = torch.zeros(6, layers, rows, pages, dtype=torch.long)
        self.device = torch.zeros(6, layers, rows, pages, dtype=torch.long, device=device)
        self.pieces: list[Optional[list[list[Piece]]]] = [None] * rows
        self._dirty = False

    def put(self, row: int, layers: Sequence[Sequence[Piece]]) -> None:
        """Point ``row`` at its context KV: per layer its pieces ``(k (1, Hkv, n, D), v, pos (n,))`` in order (at
        most ``pages``; empty ones skipped). A piece's keys and values must be contiguous along D with consecutive
        entries (a context's tensors and their views are); one that is not is copied (and held)."""
        if len(layers) != self.layers:
            raise ValueError(f"PointerTable.put: {len(layers)} layers' pieces for a table of {self.layers} layers")
        held = []
        self.host[:, :, row] = 0
        for i, pieces in enumerate(layers):
            pieces = [_laid_out(p) for p in pieces if p[0].shape[2]]
            if len(pieces) > self.pages:
                raise ValueError(f"PointerTable.put: row {row} has {len(pieces)} pieces at layer {i}, the table holds "
                                 f"{self.pages}: join them first (KVShard.whole)")
            for j, (k, v, pos) in enumerate(pieces):
                if k.shape[1] != self.hkv:
                    raise ValueError(f"PointerTable.put: {k.shape[1]} KV heads, the table's kernel reads {self.hkv}")
                self.host[:, i, row, j] = torch.tensor(_fields((k, v, pos)))
            held.append(pieces)
        self.pieces[row] = held
        self._dirty = True

    def fill(self, rows: Sequence[Sequence[Piece]]) -> None:
        """Layer 0 of rows ``0 .. len(rows) - 1`` at once -- row b's pieces ``rows[b]`` (at most ``pages``, none
        empty, laid out as :meth:`put` needs) -- and every other row empty: an eager step's pages, a layer at a time
        (one tensor made on the host, not one a piece)."""
        vals = [[0] * 6 for _ in range(self.rows * self.pages)]
        held = []
        for b, pieces in enumerate(rows):
            pieces = [_laid_out(p) for p in pieces]
            for j, piece in enumerate(pieces):
                vals[b * self.pages + j] = _fields(piece)
            held.append([pieces])
        self.host[:, 0] = torch.tensor(vals, dtype=torch.long).t().reshape(6, self.rows, self.pages)
        self.pieces = held + [None] * (self.rows - len(held))
        self._dirty = True

    def forget(self) -> None:
        """Drop the references to the tensors pointed at (the addresses stay): once the kernels reading them are
        queued, a tensor freed is reused only by work queued after them."""
        self.pieces = [None] * self.rows

    def clear(self, row: int) -> None:
        """Empty ``row`` (its kernel rows see no key) and drop its references."""
        self.host[:, :, row] = 0
        self.pieces[row] = None
        self._dirty = True

    def clear_all(self) -> None:
        """Empty every row."""
        for row in range(self.rows):
            if self.pieces[row] is not None:
                self.clear(row)

    def sync(self) -> None:
        """Copy the host side to the device if it changed (queued: the host does not wait; the next step's kernels
        run after it)."""
        if self._dirty:
            # to_device's pinned copy is the copy's source: the host side may change before it runs
            self.device.copy_(to_device(self.host, self.device.device))
            self._dirty = False


def _fields(piece: Piece) -> list[int]:
    """A piece's entry in the table: its keys', values' and positions' addresses, length, keys' and values' head
    strides (the order of :data:`K` ... :data:`V_HEAD`)."""
    k, v, pos = piece
    return [k.data_ptr(), v.data_ptr(), pos.data_ptr(), k.shape[2], k.stride(1), v.stride(1)]


def _laid_out(piece: Piece) -> Piece:
    """``piece`` whose keys and values have consecutive entries contiguous along D and whose positions are
    contiguous: as it is, else a copy."""
    k, v, pos = piece
    d = k.shape[3]
    k = k if k.stride(3) == 1 and k.stride(2) == d else k.contiguous()
    v = v if v.stride(3) == 1 and v.stride(2) == d else v.contiguous()
    return k, v, pos if pos.stride(0) == 1 else pos.contiguous()


def pointer_attention(q: torch.Tensor, q_pos: torch.Tensor, table: PointerTable, layer: int, scale: float,
                      window: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract in float32 torch (module docstring), each row's pieces read from the table's host side: what a
    CPU runs a captured step with, and what the kernels are tested against."""
    B, Hq, S, D = q.shape
    outs, lses = [], []
    for b in range(B):
        pieces = table.pieces[b][layer] if table.pieces[b] is not None else []
        if not pieces:
            outs.append(q.new_zeros(1, Hq, S, D))
            lses.append(torch.full((1, Hq, S), float("-inf"), device=q.device))
            continue
        k = torch.cat([p[0] for p in pieces], dim=2)
        v = torch.cat([p[1] for p in pieces], dim=2)
        pos = torch.cat([p[2] for p in pieces])
        o, lse = slot_attention(q[b:b + 1], k, v, q_pos[b:b + 1], pos[None], scale, window)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def has_pointer_kernel(backend) -> bool:
    """Whether ``backend`` owns a kernel over a :class:`PointerTable` (``pointers_forward``)."""
    return callable(getattr(backend, "pointers_forward", None))


def pointer_backend(name: str, device, required: bool):
    """The backend whose ``pointers_forward`` a static or graph step's context part runs, or None (the step reads
    its contexts as pages: :mod:`magnetar.ops.pages`). ``name`` (``runtime.attention_backend``) when it owns such a
    kernel; else on CUDA ``triton_decode`` where Triton runs; else -- ``required``: a step a graph holds, which
    cannot read pages chosen on the host -- ``torch``'s (:func:`pointer_attention`)."""
    if name != "auto" and has_pointer_kernel(backend := get_backend(name)):
        return backend
    if torch.device(device).type == "cuda":
        triton = get_backend("triton_decode")
        if triton.runs_here(device):
            return triton
    return get_backend("torch") if required else None
