"""Host synchronizations made visible: ``with host_syncs("error"):`` raises on the first call that makes the host wait
for the device's results, ``with host_syncs("count") as seen:`` counts them (``seen.calls``: the calls' names).

A decode step on a GPU is a few milliseconds of kernels; a call that reads a device value on the host (``.item()``,
``.tolist()``, ``.cpu()``, ``bool(t)``, ``nonzero``, a boolean-mask index ...) stalls the CPU until every kernel queued
before it has run, so the next step's launches cannot overlap this one's work -- and a CUDA graph cannot hold it at
all. Magnetar's decode step reads the device once per step, after it: the chosen tokens and the finite flags in one
transfer (:meth:`magnetar.engine.phase2.DecodeBatch.step`). This module is how that is checked:

* on CUDA, ``torch.cuda.set_sync_debug_mode`` (``"error"`` or, for ``"count"``, ``"warn"``) for the block: the
  driver-level truth, what the GPU kit's decode step runs under;
* on any device (the CPU tests: CI has no GPU), a :class:`~torch.overrides.TorchFunctionMode` that sees the tensor
  methods which synchronize on CUDA -- the same calls, caught by name rather than by the driver.

A host-to-device copy from pinned memory with ``non_blocking=True`` is not a synchronization: the host enqueues it
and goes on (:func:`to_device`). From pageable memory (``torch.tensor(list, device="cuda")``, a plain
``t.to("cuda")``) torch waits for the copy, and the driver's sync debug mode says so.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Literal

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HostSyncError", "host_syncs", "SYNCING", "to_device"]


class HostSyncError(RuntimeError):
    """A call inside ``host_syncs("error")`` made the host wait for the device."""


# the tensor methods and functions that make the host wait for the device's values on CUDA
SYNCING = {
    torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.cpu: "cpu", torch.Tensor.numpy: "numpy",
    torch.Tensor.__bool__: "bool", torch.Tensor.__int__: "int", torch.Tensor.__float__: "float",
    torch.Tensor.__index__: "index", torch.Tensor.nonzero: "nonzero", torch.nonzero: "nonzero",
    torch.Tensor.masked_select: "masked_select", torch.masked_select: "masked_select", torch.unique: "unique",
    torch.Tensor.unique: "unique", torch.equal: "equal", torch.Tensor.equal: "equal",
}


def _bool_index(args) -> bool:
    """``t[mask]`` with a boolean tensor: its result's size is the mask's count (a read of the device)."""
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def _on(args, device_type: str) -> bool:
    """Whether the call's first tensor argument lives on ``device_type``."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return first is not None and first.device.type == device_type


class _Watch(TorchFunctionMode):
    def __init__(self, mode: str, device_type: str):
        super().__init__()
        self.mode, self.device_type, self.calls = mode, device_type, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = SYNCING.get(func)
        if name is None and func is torch.Tensor.__getitem__ and _bool_index(args):
            name = "boolean-mask index"
        if name is not None and (self.device_type == "cpu" or _on(args, self.device_type)):
            if self.mode == "error":
                raise HostSyncError(f"a host synchronization ({name}) inside a block that must not wait for the "
                                    f"device (magnetar.utils.sync.host_syncs)")
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_syncs(mode: Literal["error", "count"] = "error", device=None) -> Iterator[_Watch]:
    """Raise :class:`HostSyncError` on (``"error"``), or count (``"count"``: the yielded object's ``calls``), every
    host synchronization inside the block; on CUDA the driver's sync debug mode is set for the block as well.
    ``device``: the compute device (a CUDA one: only reads of tensors on it count, not the host's own tensors; the
    CPU or None: every read counts -- the CPU stands in for a device that has none)."""
    if mode not in ("error", "count"):
        raise ValueError(f"mode must be 'error' or 'count', got {mode!r}")
    device_type = "cpu" if device is None else torch.device(device).type
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    before = torch.cuda.get_sync_debug_mode() if cuda else None
    if cuda:
        torch.cuda.set_sync_debug_mode("error" if mode == "error" else "warn")
    try:
        with _Watch(mode, device_type) as watch:
            yield watch
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(before)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """Host tensor ``t`` on ``device`` without making the host wait: on CUDA pinned, then copied with
    ``non_blocking=True`` (torch's pinned-memory allocator keeps the page until the copy has run); elsewhere ``t``
    moved as usual."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
