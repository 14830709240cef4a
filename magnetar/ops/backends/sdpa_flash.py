"""torch's own FlashAttention-2 kernel on CUDA (``aten::_scaled_dot_product_flash_attention``), which also returns the
log-sum-exp: the fast GPU path when the ``flash-attn`` package is absent. Nothing but torch.

It serves the mask-free kinds only -- FULL and bottom-right causal (``Sq <= Sk``); the front end cuts Star anchors,
zigzag shards and other contiguous runs of positions into such pieces, and a general position mask goes on to
``flex``. fp16/bf16, head dim a multiple of 8 up to 256 (the kernel's limits).

* FULL: the G = Hq/Hkv query heads of a KV head are folded into the query rows (no causality to break), so K/V are
  never repeated -- decode reads the KV once per KV head.
* Bottom-right causal, ``Sq == Sk``: the kernel's ``is_causal``; K/V are repeated to Hq heads for GQA (the aten
  kernel checks equal head counts on some torch versions; the copy is one layer's K/V, freed at once).
* Bottom-right causal, ``Sq < Sk``: the visible prefix ``[0, Sk - Sq)`` as FULL, merged with the causal square.

The lse comes back ``(B, H, Sq)`` float32 (natural log). ``MAGNETAR_SDPA_FLASH=0`` turns the backend off.
"""
from __future__ import annotations

import os
import warnings

import torch

from magnetar.ops.call import CAUSAL_BOTTOM_RIGHT, FULL
from magnetar.ops.merge import merge_states_torch
from magnetar.ops.backends.flash_attn import flash_kernel_limits
from magnetar.ops.backends.reference import fold_gqa, unfold_gqa

_BROKEN: list[str] = []  # why the kernel failed on this machine (then auto skips this backend)


def _flash(q, k, v, scale: float, causal: bool):
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    out, lse = res[0], res[1]
    return out, lse[..., : q.shape[2]].float()


def _full(q, k, v, scale):
    hq, hkv = q.shape[1], k.shape[1]
    out, lse = _flash(fold_gqa(q, hkv), k, v, scale, False)
    return unfold_gqa(out, hq), unfold_gqa(lse, hq)


def _causal_square(q, k, v, scale):
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return _flash(q, k, v, scale, True)


class SdpaFlashBackend:
    name = "sdpa_flash"
    device_types = ("cuda",)

    def validate(self, call) -> list[str]:
        q = call.q
        reasons = []
        if os.environ.get("MAGNETAR_SDPA_FLASH", "1") == "0":
            reasons.append("turned off (MAGNETAR_SDPA_FLASH=0)")
        if _BROKEN:
            reasons.append(f"the kernel failed here: {_BROKEN[0]}")
        reasons += flash_kernel_limits(q)
        if call.mask_kind not in (FULL, CAUSAL_BOTTOM_RIGHT):
            reasons.append("a position mask (not full or bottom-right causal): flex serves it")
        elif call.mask_kind == CAUSAL_BOTTOM_RIGHT and q.shape[2] > call.k.shape[2]:
            reasons.append("causal with Sq > Sk")
        if not reasons and not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention"):
            reasons.append(f"torch {torch.__version__} has no aten::_scaled_dot_product_flash_attention")
        return reasons

    def forward(self, call):
        try:
            return self._forward(call)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:  # a kernel this torch build lacks or refuses: the run goes on without it
            _BROKEN.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            warnings.warn(f"magnetar: torch's flash kernel failed ({_BROKEN[0]}); this call and the next ones go to "
                          f"the next backend", RuntimeWarning, stacklevel=2)
            from magnetar.ops.backends import select_backend

            return select_backend(call).forward(call)

    def _forward(self, call):
        q, k, v, scale = call.q.contiguous(), call.k.contiguous(), call.v.contiguous(), call.scale
        Sq, Sk = q.shape[2], k.shape[2]
        if call.mask_kind == FULL:
            return _full(q, k, v, scale)
        if Sq == Sk:
            return _causal_square(q, k, v, scale)
        p = Sk - Sq
        o1, l1 = _full(q, k[:, :, :p].contiguous(), v[:, :, :p].contiguous(), scale)
        o2, l2 = _causal_square(q, k[:, :, p:].contiguous(), v[:, :, p:].contiguous(), scale)
        out, lse = merge_states_torch(torch.stack((o1, o2)), torch.stack((l1, l2)))
        return out.to(q.dtype), lse
