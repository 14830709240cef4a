"""torch's own FlashAttention-2 kernel on CUDA (``aten::_scaled_dot_product_flash_attention``), which also returns the
log-sum-exp: the fast GPU path when the ``flash-attn`` package is absent. Nothing but torch. ``sdpa_cudnn`` is the
same backend over cuDNN's fused attention (``aten::_scaled_dot_product_cudnn_attention``, its lse asked for): the
kernel NVIDIA tunes for each card (Hopper's included), a candidate for Phase 1's fastest path on a card (issue 48,
item 1); the GPU kit's ``kernels`` step times both.

It serves the mask-free kinds only -- FULL and bottom-right causal (``Sq <= Sk``); the front end cuts Star anchors,
zigzag shards and other contiguous runs of positions into such pieces, and a general position mask goes on to
``flex``. fp16/bf16, head dim a multiple of 8 up to 256 (the kernel's limits).

* FULL: the G = Hq/Hkv query heads of a KV head are folded into the query rows (no causality to break), so K/V are
  never repeated -- decode reads the KV once per KV head.
* Bottom-right causal, ``Sq == Sk``: the kernel's ``is_causal``; K/V are repeated to Hq heads for GQA (the aten
  kernel checks equal head counts on some torch versions; the copy is one layer's K/V, freed at once).
* Bottom-right causal, ``Sq < Sk``: the visible prefix ``[0, Sk - Sq)`` as FULL, merged with the causal square.

K/V are read where they lie when only their head dim is contiguous (``sdpa_flash``: the flash kernel takes the batch,
head and row strides) -- a conversation's turn views the first entries of its arena's buffers (``KVShard.extended``),
and a copy of it at every call would read the context's KV twice a decode step; cuDNN's copy is kept (its layouts
are not checked here).

The lse comes back ``(B, H, Sq)`` float32 (natural log). ``MAGNETAR_SDPA_FLASH=0`` (``MAGNETAR_SDPA_CUDNN=0``) turns
the backend off.
"""
from __future__ import annotations

import os
import warnings

import torch

from magnetar.ops.call import CAUSAL_BOTTOM_RIGHT, FULL
from magnetar.ops.merge import merge_states_torch
from magnetar.ops.backends.flash_attn import flash_kernel_limits
from magnetar.ops.backends.reference import fold_gqa, unfold_gqa


def _head_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` as it is when its last dim is contiguous, else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _flash(q, k, v, scale: float, causal: bool):
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    out, lse = res[0], res[1]
    return out, lse[..., : q.shape[2]].float()


def _cudnn(q, k, v, scale: float, causal: bool):
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    out, lse = res[0], res[1]
    B, H, S = q.shape[:3]
    return out, lse.reshape(B, H, -1)[..., :S].float()  # (B, H, S) or (B, H, S, 1) by version


class SdpaFlashBackend:
    name = "sdpa_flash"
    device_types = ("cuda",)
    kernel = staticmethod(_flash)
    op = "_scaled_dot_product_flash_attention"
    switch = "MAGNETAR_SDPA_FLASH"
    what = "torch's flash kernel"
    strided_kv = True  # K/V taken with any strides but the head dim's (module docstring)

    def __init__(self):
        self.broken: list[str] = []  # why the kernel failed on this machine (then auto skips this backend)

    def _full(self, q, k, v, scale):
        hq, hkv = q.shape[1], k.shape[1]
        out, lse = self.kernel(fold_gqa(q, hkv), k, v, scale, False)
        return unfold_gqa(out, hq), unfold_gqa(lse, hq)

    def _causal_square(self, q, k, v, scale):
        g = q.shape[1] // k.shape[1]
        if g > 1:
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        return self.kernel(q, k, v, scale, True)

    def validate(self, call) -> list[str]:
        q = call.q
        reasons = []
        if os.environ.get(self.switch, "1") == "0":
            reasons.append(f"turned off ({self.switch}=0)")
        if self.broken:
            reasons.append(f"the kernel failed here: {self.broken[0]}")
        reasons += flash_kernel_limits(q)
        if call.mask_kind not in (FULL, CAUSAL_BOTTOM_RIGHT):
            reasons.append("a position mask (not full or bottom-right causal): flex serves it")
        elif call.mask_kind == CAUSAL_BOTTOM_RIGHT and q.shape[2] > call.k.shape[2]:
            reasons.append("causal with Sq > Sk")
        if not reasons and not hasattr(torch.ops.aten, self.op):
            reasons.append(f"torch {torch.__version__} has no aten::{self.op}")
        return reasons

    def forward(self, call):
        try:
            return self._forward(call)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:  # a kernel this torch build lacks or refuses: the run goes on without it
            self.broken.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            warnings.warn(f"magnetar: {self.what} failed ({self.broken[0]}); this call and the next ones go to "
                          f"the next backend", RuntimeWarning, stacklevel=2)
            from magnetar.ops.backends import select_backend

            return select_backend(call).forward(call)

    def _forward(self, call):
        kv = _head_dim_contiguous if self.strided_kv else torch.Tensor.contiguous
        q, k, v, scale = call.q.contiguous(), kv(call.k), kv(call.v), call.scale
        Sq, Sk = q.shape[2], k.shape[2]
        if call.mask_kind == FULL:
            return self._full(q, k, v, scale)
        if Sq == Sk:
            return self._causal_square(q, k, v, scale)
        p = Sk - Sq
        o1, l1 = self._full(q, kv(k[:, :, :p]), kv(v[:, :, :p]), scale)
        o2, l2 = self._causal_square(q, kv(k[:, :, p:]), kv(v[:, :, p:]), scale)
        out, lse = merge_states_torch(torch.stack((o1, o2)), torch.stack((l1, l2)))
        return out.to(q.dtype), lse


class SdpaCudnnBackend(SdpaFlashBackend):
    """The same pieces over cuDNN's fused attention (``aten::_scaled_dot_product_cudnn_attention``)."""

    name = "sdpa_cudnn"
    kernel = staticmethod(_cudnn)
    op = "_scaled_dot_product_cudnn_attention"
    switch = "MAGNETAR_SDPA_CUDNN"
    what = "cuDNN's attention kernel"
    strided_kv = False

    def validate(self, call) -> list[str]:
        reasons = super().validate(call)
        if not reasons and call.q.is_cuda and not torch.backends.cudnn.is_available():
            reasons.append("cuDNN is not available in this torch build")
        return reasons
