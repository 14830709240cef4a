"""Registry of attention backends behind :func:`magnetar.ops.attention_with_lse`.

A backend is an object with ``name``, ``validate(call) -> list[str]`` (the reasons it refuses this call;
empty means it accepts) and ``forward(call) -> (out, lse)``, where ``call`` is a
:class:`magnetar.ops.call.AttentionCall` (backends import it and the mask kinds from there). Backends are registered
by module path and imported lazily, so importing Magnetar never imports flash_attn. ``"auto"`` takes the first backend
in ``AUTO_ORDER`` that accepts the call -- after the backends measured fastest on this card, or named by
``MAGNETAR_ATTENTION_ORDER`` (:mod:`magnetar.ops.backends.measured`); forcing a backend that refuses raises
``ValueError`` with its reasons.
A backend need not handle NaN/inf: the front end applies the non-finite rule (:mod:`magnetar.ops.nonfinite`). A
backend whose kernel knows whether q, k and its output were all finite may also offer ``forward_checked(call) ->
(out, lse, clean)``; ``clean`` True spares the front end its pass over them (False or absent: it makes the pass).

Built-in backends:
    flash_attn  FlashAttention 2/3 on CUDA (fp16/bf16, full or bottom-right causal masks only; the flash-attn package)
    sdpa_flash  torch's own FlashAttention-2 kernel on CUDA (fp16/bf16, full or bottom-right causal): no extra package
    sdpa_cudnn  the same pieces over cuDNN's fused attention through torch (returns the lse); after sdpa_flash in auto
    flex        torch's FlexAttention with the position rule as its mask: any mask; compiled on CUDA, eager on CPU
    cpu_decode  a CPU decode kernel (csrc/decode_attention.cpp): <= 8 query rows per KV head, every key visible
    cpu_amx     a bf16 prefill kernel on Intel AMX tiles (csrc/amx_attention.cpp): full or bottom-right causal
    cpu_flash   torch's fused CPU flash kernel with a float mask for position-based causality
    triton_decode  a decode step's context part through a table of addresses (Triton, CUDA): no ordinary calls
    tiled       pure torch, online softmax over key tiles: any device, bounded memory (GPU fallback)
    torch       pure torch reference: full score matrix in float32
"""
from __future__ import annotations

import functools
import importlib
from typing import Callable, Optional, Protocol

import torch

from magnetar.ops.backends.measured import preferred
from magnetar.ops.call import AttentionCall


class AttentionBackend(Protocol):
    name: str
    device_types: Optional[tuple[str, ...]]  # devices it can ever serve (None: any); auto skips the rest cheaply

    def validate(self, call: AttentionCall) -> list[str]: ...

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]: ...


_REGISTRY: dict[str, Callable[[], AttentionBackend]] = {}
_INSTANCES: dict[str, AttentionBackend] = {}
AUTO_ORDER = ["flash_attn", "sdpa_flash", "sdpa_cudnn", "cpu_decode", "cpu_amx", "cpu_flash", "flex", "tiled", "torch"]


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    """Register ``factory`` (called once, lazily) under ``name``; replaces an existing registration."""
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"register_backend: name must be a non-empty str other than 'auto', got {name!r}")
    if not callable(factory):
        raise ValueError(f"register_backend: factory must be a callable returning the backend (e.g. the backend "
                         f"class), got {type(factory).__name__}")
    _REGISTRY[name] = factory
    _INSTANCES.pop(name, None)


def _lazy(module: str, cls: str) -> Callable[[], AttentionBackend]:
    return lambda: getattr(importlib.import_module(module, __name__), cls)()


register_backend("torch", _lazy(".reference", "ReferenceBackend"))
register_backend("tiled", _lazy(".tiled", "TiledBackend"))
register_backend("cpu_decode", _lazy(".cpu_decode", "CpuDecodeBackend"))
register_backend("cpu_amx", _lazy(".cpu_amx", "CpuAmxBackend"))
register_backend("cpu_flash", _lazy(".cpu_flash", "CpuFlashBackend"))
register_backend("flash_attn", _lazy(".flash_attn", "FlashAttnBackend"))
register_backend("sdpa_flash", _lazy(".sdpa_flash", "SdpaFlashBackend"))
register_backend("sdpa_cudnn", _lazy(".sdpa_flash", "SdpaCudnnBackend"))
register_backend("flex", _lazy(".flex", "FlexAttentionBackend"))
register_backend("triton_decode", _lazy(".triton_decode", "TritonDecodeBackend"))


def list_backends() -> list[str]:
    return sorted(_REGISTRY)


def get_backend(name: str) -> AttentionBackend:
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; choose 'auto' or one of {list_backends()}")
    if name not in _INSTANCES:
        _INSTANCES[name] = _REGISTRY[name]()
    return _INSTANCES[name]


def select_backend(call: AttentionCall, name: str = "auto") -> AttentionBackend:
    """The backend that will run ``call``: the forced one (if it accepts) or the first accepting in AUTO_ORDER."""
    if name != "auto":
        backend = get_backend(name)
        reasons = backend.validate(call)
        if reasons:
            raise ValueError(f"attention backend {name!r} cannot run this call: " + "; ".join(reasons))
        return backend
    device_type = call.q.device.type
    first = preferred(call.q.device, list_backends)  # this card's measured order, or the user's (usually none)
    order = _auto_order(first, tuple(_REGISTRY), tuple(AUTO_ORDER))
    for candidate in order:
        backend = get_backend(candidate)
        devices = getattr(backend, "device_types", None)
        if (devices is None or device_type in devices) and not backend.validate(call):
            return backend
    refusals = []  # none accepts: each one's reasons (worked out only now: auto runs on every attention call)
    for candidate in order:
        backend = get_backend(candidate)
        devices = getattr(backend, "device_types", None)
        if devices is not None and device_type not in devices:
            refusals.append(f"{candidate}: needs a {'/'.join(devices)} device, got {device_type}")
        else:
            refusals.append(f"{candidate}: {'; '.join(backend.validate(call))}")
    raise ValueError("no attention backend accepts this call:\n  " + "\n  ".join(refusals))


@functools.lru_cache(maxsize=64)
def _auto_order(first: tuple[str, ...], registered: tuple[str, ...], auto: tuple[str, ...]) -> tuple[str, ...]:
    """The registered backends in the order ``auto`` tries them: ``first`` (measured or named), then ``AUTO_ORDER``,
    then the others by name -- kept per (first, registry, AUTO_ORDER), so an ``auto`` call builds no list."""
    order = [n for n in dict.fromkeys([*first, *auto]) if n in registered]
    return tuple(order + sorted(n for n in registered if n not in order))


def first_preferred(device: torch.device) -> Optional[str]:
    """The first backend of ``auto``'s preferred order for ``device`` (:func:`.measured.preferred`:
    ``MAGNETAR_ATTENTION_ORDER``'s, else the card's measured one) that serves ``device``, or None (no order:
    ``auto``'s own). The step kernels' choices (:func:`magnetar.ops.slots.slot_backend`,
    :func:`magnetar.ops.pages.page_backend`) read it, so a user's order reaches them as it reaches every other call."""
    for candidate in preferred(device, list_backends):
        devices = getattr(get_backend(candidate), "device_types", None)
        if devices is None or device.type in devices:
            return candidate
    return None


def explain(call: AttentionCall) -> dict[str, list[str]]:
    """For every registered backend, the reasons it refuses ``call`` (empty list: it accepts)."""
    if not isinstance(call, AttentionCall):
        raise ValueError(f"explain: call must be a magnetar.ops.call.AttentionCall(q, k, v, q_pos, k_pos, scale, "
                         f"mask_kind), got {type(call).__name__}")
    return {name: get_backend(name).validate(call) for name in list_backends()}
