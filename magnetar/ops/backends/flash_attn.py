"""FlashAttention backend (CUDA, fp16/bf16). The only module in Magnetar that imports ``flash_attn``.

FlashAttention takes ``(B, S, H, D)`` tensors, supports GQA natively and returns the log-sum-exp
(``softmax_lse (B, H, Sq)`` float32) when asked. It cannot express arbitrary position masks, so it only
accepts FULL masks and bottom-right-aligned causal masks (``Sq <= Sk``; flash-attn >= 2.1 aligns causal masks
to the bottom right) -- including explicit positions that turn out to be that pattern. Anything else is
refused and ``auto`` falls through to the next backend.

Version differences live here: flash-attn 2 (``flash_attn.flash_attn_func`` returns
``(out, lse, S_dmask)`` with ``return_attn_probs=True``) and FlashAttention-3 for Hopper
(``flash_attn_interface.flash_attn_func`` returns ``(out, lse)``).
NaN: FlashAttention reports ``lse = +inf`` for a row whose softmax sum is NaN (or 0); those rows never reach
the caller, since the front end re-runs any call with non-finite q/k/out on zeroed inputs and applies the
rule of :mod:`magnetar.ops.nonfinite` (checked on CPU with a backend that mimics this, tests/test_nonfinite.py).
Not yet exercised on a GPU by the test suite (CI is CPU-only); see docs/benchmarks.md for GPU runs.
"""
from __future__ import annotations

import torch

from magnetar.ops.call import FULL, POSITIONS

_FA = None  # (flash_attn_func, version tag) or an error string


def _load():
    global _FA
    if _FA is None:
        try:
            from flash_attn_interface import flash_attn_func  # FlashAttention-3 (Hopper)

            _FA = (flash_attn_func, 3)
        except ImportError:
            try:
                from flash_attn import flash_attn_func

                _FA = (flash_attn_func, 2)
            except ImportError as e:
                _FA = f"flash-attn is not installed ({e}); pip install 'magnetar[gpu]'"
    return _FA


def _is_bottom_right(q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
    """k_pos is contiguous ascending and q_pos are exactly its last Sq positions."""
    sq, sk = q_pos.shape[-1], k_pos.shape[-1]
    if q_pos.dim() != 1 or k_pos.dim() != 1 or sq > sk:
        return False
    start = int(k_pos[0])
    ref = torch.arange(start, start + sk, device=k_pos.device)
    return bool(torch.equal(k_pos, ref)) and bool(torch.equal(q_pos, ref[sk - sq :]))


def flash_kernel_limits(q: torch.Tensor) -> list[str]:
    """What a FlashAttention-2 kernel (this package's, or torch's own: ``sdpa_flash``) cannot take: non-CUDA tensors,
    dtypes other than fp16/bf16, head dims not a multiple of 8 or above 256."""
    reasons = []
    if q.device.type != "cuda":
        reasons.append(f"needs CUDA tensors, got {q.device}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"needs fp16/bf16, got {q.dtype}")
    if q.shape[-1] > 256 or q.shape[-1] % 8:
        reasons.append(f"head dim {q.shape[-1]} must be a multiple of 8 and <= 256")
    return reasons


class FlashAttnBackend:
    name = "flash_attn"
    device_types = ("cuda",)

    def validate(self, call) -> list[str]:
        q = call.q
        reasons = flash_kernel_limits(q)
        if reasons:
            return reasons  # don't import flash_attn for calls it could never serve
        fa = _load()
        if isinstance(fa, str):
            return [fa]
        if call.window is not None:
            reasons.append("sliding-window position masks are not mapped to flash-attn's window_size yet")
        elif call.mask_kind == POSITIONS and not _is_bottom_right(call.q_pos, call.k_pos):
            reasons.append("position mask is not full or bottom-right causal")
        elif call.mask_kind not in (FULL, POSITIONS) and q.shape[2] > call.k.shape[2]:
            reasons.append("causal with Sq > Sk")
        return reasons

    def forward(self, call):
        fn, version = _load()
        q = call.q.transpose(1, 2)
        k = call.k.transpose(1, 2)
        v = call.v.transpose(1, 2)
        causal = call.mask_kind != FULL
        if version == 3:
            res = fn(q, k, v, softmax_scale=call.scale, causal=causal)
        else:
            res = fn(q, k, v, softmax_scale=call.scale, causal=causal, return_attn_probs=True)
        out, lse = res[0], res[1]
        return out.transpose(1, 2), lse.float()
