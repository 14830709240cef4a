"""Bit-packed hash codes and Hamming-similarity top-k: torch references and the fused DeepSpeed op.

Layouts (shared with ``magnetar/ops/csrc/hamming*.{cpp,cu}``, which must agree bit for bit):

* ``pack_bits(bits (..., nbits))`` -> ``int32 (..., nbits // 32)``: bit ``b`` of a code is bit ``b % 32``
  (least significant first) of word ``b // 32``; any non-zero value is a 1. The words are uint32 bit
  patterns held in int32 tensors (torch's uint32 lacks the bitwise ops). ``nbits`` must be a multiple of 32.
* ``hamming_scores(q (H, M, G, W), k (H, N, W))`` -> ``int32 (H, M, N)``: for KV head ``h`` and query row ``m``
  the number of agreeing bits (XNOR popcount, ``32 W - hamming distance``) summed over the ``G`` query heads
  that share KV head ``h`` (GQA). Higher = more similar.
* ``hamming_topk(q, k, kk)`` -> ``(scores int32 (H, M, kk), indices int64 (H, M, kk))``: the ``kk`` best keys,
  score descending, ties by index ascending -- deterministic, so the op and the reference agree exactly.

``backend``: ``"auto"`` (the op if it builds for the tensors' device, else torch), ``"op"`` (the op or an
error), ``"torch"`` (the reference).
"""
from __future__ import annotations

import torch

from magnetar.ops.jit import LazyOp

BACKENDS = ("auto", "op", "torch")


def _make_builder(device_type: str):
    from magnetar.ops import op_builder  # imports DeepSpeed: deferred to the first use

    return {"cpu": op_builder.HammingBuilder, "cuda": op_builder.HammingCUDABuilder}.get(device_type, lambda: None)()


HAMMING_OP = LazyOp("Hamming top-k", _make_builder, ("pack_bits", "hamming_scores", "hamming_topk"))


def _use_op(backend: str, device) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"unknown Hamming backend {backend!r}; choose one of {BACKENDS}")
    if backend == "torch":
        return False
    if backend == "op":
        HAMMING_OP.load(device)  # raises with the reason when unavailable
        return True
    return HAMMING_OP.available(device)


# -- torch references ------------------------------------------------------------------------------------


def pack_bits_torch(bits: torch.Tensor) -> torch.Tensor:
    nbits = bits.shape[-1]
    b = (bits != 0).reshape(*bits.shape[:-1], nbits // 32, 32).to(torch.int64)
    shifts = torch.arange(32, device=bits.device, dtype=torch.int64)
    words = (b << shifts).sum(-1)  # < 2^32: exact in int64
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)  # same bits as uint32


def popcount32_torch(x: torch.Tensor) -> torch.Tensor:
    """Set bits of each int32 word (as uint32), SWAR in int64."""
    v = x.to(torch.int64) & 0xFFFFFFFF
    v = v - ((v >> 1) & 0x55555555)
    v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
    v = (v + (v >> 4)) & 0x0F0F0F0F
    return ((v * 0x01010101) & 0xFFFFFFFF) >> 24


def hamming_scores_torch(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    H, M, G, W = q.shape
    x = q[:, :, :, None, :] ^ k[:, None, None, :, :]  # (H, M, G, N, W)
    diff = popcount32_torch(x).sum(dim=(2, 4))
    return (32 * W * G - diff).to(torch.int32)


def topk_scores_torch(scores: torch.Tensor, kk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``kk`` of integer scores along the last dim: score descending, ties by index ascending."""
    N = scores.shape[-1]
    idx = torch.arange(N, device=scores.device, dtype=torch.int64)
    key = scores.to(torch.int64) * (1 << 32) + ((1 << 32) - 1 - idx)
    top = key.topk(kk, dim=-1, largest=True, sorted=True).indices
    return scores.gather(-1, top), top


# -- public entry points ---------------------------------------------------------------------------------
def _check_codes(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 3:
        raise ValueError(f"Hamming codes: expected q (H, M, G, W) and k (H, N, W), got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    if q.dtype != torch.int32 or k.dtype != torch.int32:
        raise ValueError(f"Hamming codes must be int32 words from pack_bits, got {q.dtype} and {k.dtype}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[2]:
        raise ValueError(f"Hamming codes: q {tuple(q.shape)} and k {tuple(k.shape)} disagree on heads (H) or "
                         f"words per code (W)")


def pack_bits(bits: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Pack ``bits (..., nbits)`` (bool, or any dtype: non-zero is 1) into int32 words; see the module doc."""
    nbits = bits.shape[-1]
    if nbits == 0 or nbits % 32:
        raise ValueError(f"code bits must be a positive multiple of 32 (packed 32 to a word), got {nbits}")
    if _use_op(backend, bits.device):
        flat = bits.reshape(-1, nbits)
        flat = flat if flat.dtype in (torch.bool, torch.uint8) else flat != 0
        return HAMMING_OP.load(bits.device).pack_bits(flat.contiguous()).reshape(*bits.shape[:-1], nbits // 32)
    return pack_bits_torch(bits)


def hamming_scores(q: torch.Tensor, k: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    _check_codes(q, k)
    if _use_op(backend, q.device):
        return HAMMING_OP.load(q.device).hamming_scores(q, k)
    return hamming_scores_torch(q, k)


def hamming_topk(q: torch.Tensor, k: torch.Tensor, kk: int, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    _check_codes(q, k)
    N = k.shape[1]
    if not 1 <= kk <= N:
        raise ValueError(f"Hamming top-k: k must be in [1, {N}] (the number of keys), got {kk}")
    if _use_op(backend, q.device):
        return HAMMING_OP.load(q.device).hamming_topk(q, k, int(kk))
    return topk_scores_torch(hamming_scores_torch(q, k), kk)
