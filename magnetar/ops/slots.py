"""Slot attention: the kernel of the static / compiled decode step (``runtime.decode_step``,
:mod:`magnetar.engine.static`), chosen from the attention backend registry like every other kernel.

A decode step attends every request of a batch in ONE call per layer over per-request slot buffers: ``q (B, Hq, S,
D)`` over ``k, v (B, Hkv, C, D)`` whose entries sit at key positions ``k_pos (B, C)`` (:data:`FAR` marks an empty
entry); ``q_pos (B, S)``. Key j is visible to query i iff ``k_pos[j] <= q_pos[i]`` (and ``> q_pos[i] - window``);
the result is ``(out (B, Hq, S, D) in q's dtype, lse (B, Hq, S) float32)`` -- the ``(out, lse)`` contract: a row
seeing no key is ``(0, -inf)``, a NaN in q or in a key the row sees makes the row NaN.

A backend of :mod:`magnetar.ops.backends` owns its decode kernel (as vLLM's do): one with a ``slot_forward(q, k, v,
q_pos, k_pos, scale, window)`` method can run the step. :func:`slot_backend` picks it: ``runtime.attention_backend``
when that backend has one, else -- ``auto`` -- ``flex`` for a compiled step on CUDA (a fused kernel that reads the
bf16 KV once; the math path would copy it to float32 every step), ``cpu_decode`` for a static or graph step on a CPU
(its kernel's masked pass, the eager step's kernel) and ``torch`` (:func:`slot_attention`: exact float32 math that
CPU compilers fuse) otherwise.
"""
from __future__ import annotations

from typing import Optional

import torch

from magnetar.ops.backends import AttentionBackend, first_preferred, get_backend, list_backends

FAR = 2 ** 62  # the key position of an empty slot entry: no query's position reaches it


def slot_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                   scale: float, window: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, Hq, S, D) in q's dtype, lse (B, Hq, S) float32)`` of ``q`` over the slot buffers ``k, v
    (B, Hkv, C, D)`` whose entries sit at positions ``k_pos (B, C)`` (:data:`FAR`: empty); ``q_pos (B, S)``. Key j
    is visible to query i iff ``k_pos[j] <= q_pos[i]`` (and ``> q_pos[i] - window``). Scores, softmax and the
    weighted sum in float32; query head h reads KV head ``h // (Hq // Hkv)``."""
    B, Hq, S, D = q.shape
    Hkv, C = k.shape[1], k.shape[2]
    G = Hq // Hkv
    s = torch.matmul(q.float().reshape(B, Hkv, G * S, D), k.float().transpose(-1, -2)).view(B, Hkv, G, S, C)
    qp, kp = q_pos.view(B, 1, 1, S, 1), k_pos.view(B, 1, 1, 1, C)
    vis = kp <= qp
    if window is not None:
        vis = vis & (kp > qp - window)
    s = (s * scale).masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, G, S): -inf where nothing is visible, NaN where a NaN is
    seen = vis.any(dim=-1)  # (B, 1, 1, S)
    p = torch.exp(s - torch.where(seen, lse, 0.0).unsqueeze(-1))
    out = torch.matmul(p.view(B, Hkv, G * S, C), v.float()).view(B, Hkv, G, S, D)
    out = torch.where(seen.unsqueeze(-1), out, 0.0)
    lse = torch.where(seen, lse, float("-inf"))
    return out.reshape(B, Hq, S, D).to(q.dtype), lse.reshape(B, Hq, S)


def has_slot_kernel(backend: AttentionBackend) -> bool:
    """Whether ``backend`` owns a decode kernel over slot buffers (``slot_forward``)."""
    return callable(getattr(backend, "slot_forward", None))


def slot_backends() -> list[str]:
    """The registered backends that own a slot kernel."""
    return [name for name in list_backends() if has_slot_kernel(get_backend(name))]


def slot_backend(name: str, device, compiled: bool) -> AttentionBackend:
    """The backend whose ``slot_forward`` a decode step runs: ``name`` (``runtime.attention_backend``) when it owns a
    slot kernel; otherwise (``auto``, or an eager-only backend such as ``cpu_flash``) ``flex`` for a ``compiled``
    step on CUDA, ``cpu_decode`` for an uncompiled step on a CPU that runs its op (static, and graph there: one pass
    over the filled entries, bf16 read as bf16) -- unless ``MAGNETAR_ATTENTION_ORDER`` puts another backend serving
    the CPU first: that one's slot kernel, or ``torch``'s if it has none (as :func:`magnetar.ops.pages.page_backend`
    follows the order) --, and ``torch`` elsewhere (a torch.compile'd step on a CPU: the compiler fuses its float32
    math)."""
    if name != "auto":
        backend = get_backend(name)
        if has_slot_kernel(backend):
            return backend
    kind = torch.device(device).type
    if kind == "cuda":
        return get_backend("flex" if compiled else "torch")
    if kind == "cpu" and not compiled:
        first = first_preferred(torch.device(device))
        if first not in (None, "cpu_decode"):  # the user's order names another CPU kernel first
            named = get_backend(first)
            return named if has_slot_kernel(named) else get_backend("torch")
        cpu = get_backend("cpu_decode")
        if cpu.runs_here():
            return cpu
    return get_backend("torch")
