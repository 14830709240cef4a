"""FlexAttention backend: torch's ``flex_attention`` with the position rule as its mask; any mask, nothing but torch.

The visibility rule of :mod:`magnetar.ops.attention` (key j visible to query i iff ``k_pos[j] <= q_pos[i]``, and
``k_pos[j] > q_pos[i] - window`` with a window) becomes a ``mask_mod`` over the call's position tensors, turned
into a block mask (:func:`torch.nn.attention.flex_attention.create_block_mask`: tiles that no query can see are
skipped); GQA is native (``enable_gqa``); the log-sum-exp comes back with the output (``return_aux`` on torch
>= 2.9, ``return_lse`` before). Natural log, like every backend.

* On CUDA the kernel is ``torch.compile(flex_attention, dynamic=True)`` (one compiled kernel per dtype / head dim,
  shared by every length) and the block mask is built compiled too, so no ``Sq x Sk`` tensor is ever made.
* On CPU it runs eagerly (``torch.compile`` on CPU refuses ``return_lse``): the unfused implementation, which
  materialises the score matrix -- correct (tested against the fp64 reference in every mask case), not fast.
  ``auto`` never picks it on CPU (``cpu_flash`` accepts every CPU call first); force it with
  ``attention_backend="flex"``.

Rows that see no key are normalised by the front end (``(0, -inf)``), and non-finite inputs by
:mod:`magnetar.ops.nonfinite`, as for every backend. ``MAGNETAR_FLEX_COMPILE=0`` runs the eager path on CUDA too
(to tell a compiler problem from a kernel problem).
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch

from magnetar.ops.call import FULL

_FLEX = None  # (flex_attention, create_block_mask, AuxRequest or None) or an error string
_COMPILED: dict[str, object] = {}
# why the compiled kernel failed on this machine, per call signature (then auto skips flex for such calls only:
# seen on an H100, the compiled kernel served llama / qwen3 / mistral and failed to lower for a windowed
# one-KV-head model)
_BROKEN: dict[tuple, str] = {}


def _signature(call) -> tuple:
    """What decides which kernel the compiler makes: dtype, head dim, GQA, decode or not, window, per-sequence."""
    per_seq = call.q_pos.dim() == 2 or call.k_pos.dim() == 2 if call.mask_kind != FULL else False
    return (str(call.q.dtype), call.q.shape[-1], call.group, call.q.shape[2] == 1, call.mask_kind,
            call.window is not None, per_seq)


def _load():
    global _FLEX
    if _FLEX is None:
        try:
            from torch.nn.attention import flex_attention as fa
        except ImportError as e:  # torch < 2.5
            _FLEX = f"torch {torch.__version__} has no torch.nn.attention.flex_attention ({e}); torch >= 2.5 has"
        else:
            _FLEX = (fa.flex_attention, fa.create_block_mask, getattr(fa, "AuxRequest", None))
    return _FLEX


def _compile_on(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("MAGNETAR_FLEX_COMPILE", "1") != "0"


def allow_recompiles(limit: int = 64) -> None:
    """Let dynamo recompile a function up to ``limit`` times (its default gives up after 8 and runs it eagerly)."""
    import torch._dynamo

    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), limit))


def _kernel(device: torch.device):
    flex, _, _ = _load()
    if not _compile_on(device):
        return flex
    if "flex" not in _COMPILED:
        # every layer's call brings a new mask closure over new position tensors: allow the recompiles a model's
        # mask variants (causal, windowed, per-sequence) need before dynamo would give up on the compiled kernel
        allow_recompiles()
        _COMPILED["flex"] = torch.compile(flex, dynamic=True)
    return _COMPILED["flex"]


def _mask_mod(call):
    """The visibility rule over the call's positions, as FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)``."""
    q_pos, k_pos, window = call.q_pos, call.k_pos, call.window
    per_seq = q_pos.dim() == 2 or k_pos.dim() == 2
    if per_seq:  # broadcast both to (B, S) so one index rule serves
        B = call.q.shape[0]
        q_pos = q_pos.expand(B, -1) if q_pos.dim() == 2 else q_pos.unsqueeze(0).expand(B, -1)
        k_pos = k_pos.expand(B, -1) if k_pos.dim() == 2 else k_pos.unsqueeze(0).expand(B, -1)
        q_pos, k_pos = q_pos.contiguous(), k_pos.contiguous()

        def qk(b, q_idx, kv_idx):
            return q_pos[b, q_idx], k_pos[b, kv_idx]
    else:
        def qk(b, q_idx, kv_idx):
            return q_pos[q_idx], k_pos[kv_idx]

    if window is None:
        def mask_mod(b, h, q_idx, kv_idx):
            qp, kp = qk(b, q_idx, kv_idx)
            return kp <= qp
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            qp, kp = qk(b, q_idx, kv_idx)
            return (kp <= qp) & (kp > qp - window)
    return mask_mod, per_seq


SKIP_BLOCK = 128  # the slot kernel's key block: a slot's blocks past its last filled entry are not read
SKIP_EMPTY_ON = ("cuda",)  # devices whose slot calls skip the empty blocks (the compiled kernel skips them)


def _filled_blocks(k_pos: torch.Tensor, S: int):
    """A block mask over slots ``k_pos (B, C)`` whose every slot lists its key blocks up to its last filled entry
    (:data:`~magnetar.ops.slots.FAR` marks the empty ones): a slot of capacity C holding n entries costs n, not C.
    Made on the device from ``k_pos`` alone (no read of the host: a CUDA graph holds it)."""
    from torch.nn.attention.flex_attention import BlockMask

    from magnetar.ops.slots import FAR

    B, C = k_pos.shape
    upto = ((k_pos < FAR) * torch.arange(1, C + 1, device=k_pos.device)).amax(dim=-1)  # entries up to the last filled
    num = torch.div(upto + SKIP_BLOCK - 1, SKIP_BLOCK, rounding_mode="floor").to(torch.int32).view(B, 1, 1)
    idx = torch.arange(C // SKIP_BLOCK, dtype=torch.int32, device=k_pos.device).view(1, 1, 1, -1)
    return BlockMask.from_kv_blocks(num, idx.expand(B, 1, 1, -1).contiguous(), BLOCK_SIZE=(SKIP_BLOCK, SKIP_BLOCK),
                                    seq_lengths=(S, C), compute_q_blocks=False)


def slot_attention_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                        scale: float, window: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`magnetar.ops.slots.slot_attention` through torch's FlexAttention (the compiled and captured steps' on
    CUDA: a fused kernel that reads the bf16 KV once, float32 inside; the visibility rule is its ``score_mod``). Called
    alone (a ``graph`` step, captured eagerly) it runs the compiled kernel on CUDA and skips each slot's empty blocks
    (:func:`_filled_blocks`); inside a compiled step, that step's compile takes it in. Same contract."""
    flex, _, aux = _load()
    B, Hq, S, D = q.shape
    alone = not torch.compiler.is_compiling()
    if alone:
        flex = _kernel(q.device)

    def score_mod(score, b, h, qi, kj):
        kp, qp = k_pos[b, kj], q_pos[b, qi]
        vis = kp <= qp
        if window is not None:
            vis = vis & (kp > qp - window)
        return torch.where(vis, score, float("-inf"))

    kw = dict(score_mod=score_mod, scale=scale, enable_gqa=Hq != k.shape[1])
    if alone and q.device.type in SKIP_EMPTY_ON and k.shape[2] % SKIP_BLOCK == 0:
        kw["block_mask"] = _filled_blocks(k_pos, S)
    if aux is not None:
        out, extra = flex(q, k, v, return_aux=aux(lse=True), **kw)
        lse = extra.lse
    else:
        out, lse = flex(q, k, v, return_lse=True, **kw)
    qp, kp = q_pos.view(B, S, 1), k_pos.view(B, 1, -1)
    vis = kp <= qp
    if window is not None:
        vis = vis & (kp > qp - window)
    seen = vis.any(dim=-1).view(B, 1, S)
    out = torch.where(seen.unsqueeze(-1), out, 0.0).to(q.dtype)
    return out, torch.where(seen, lse.float(), float("-inf"))


class FlexAttentionBackend:
    name = "flex"
    device_types = ("cuda", "cpu")
    slot_forward = staticmethod(slot_attention_flex)  # the decode step's kernel (magnetar.ops.slots)

    def validate(self, call) -> list[str]:
        fx = _load()
        if isinstance(fx, str):
            return [fx]
        reasons = []
        D = call.q.shape[-1]
        if call.q.device.type == "cuda":
            broken = _BROKEN.get(_signature(call))
            if broken:
                reasons.append(f"the compiled kernel failed here for such calls: {broken}")
            if D < 16 or D & (D - 1):
                reasons.append(f"head dim {D}: the compiled kernel needs a power of two >= 16")
            if call.q.dtype == torch.float64:
                reasons.append("float64 on CUDA: the compiled kernel takes fp32/bf16/fp16")
        return reasons

    def forward(self, call):
        try:
            return self._forward(call)
        except Exception as e:  # noqa: BLE001 -- a compiler failure must not stop a run that other backends can do
            if not _compile_on(call.q.device) or isinstance(e, torch.OutOfMemoryError):
                raise
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
            _BROKEN[_signature(call)] = why
            warnings.warn(f"magnetar: the compiled FlexAttention kernel failed ({why}); this call and the next ones "
                          f"like it ({_signature(call)}) go to the 'tiled' backend (MAGNETAR_FLEX_COMPILE=0 tries the "
                          f"eager kernel)", RuntimeWarning, stacklevel=2)
            from magnetar.ops.backends import get_backend

            return get_backend("tiled").forward(call)

    def _forward(self, call):
        _, create_block_mask, aux_request = _load()
        q, k, v = call.q, call.k, call.v
        B, Hq, Sq, _ = q.shape
        Sk = k.shape[2]
        block_mask = None
        if call.mask_kind != FULL:
            mask_mod, per_seq = _mask_mod(call)
            block_mask = create_block_mask(mask_mod, B if per_seq else None, None, Sq, Sk, device=q.device,
                                           _compile=_compile_on(q.device))
        kernel = _kernel(q.device)
        kw = dict(block_mask=block_mask, scale=call.scale, enable_gqa=call.group > 1)
        with warnings.catch_warnings():  # the eager path warns that it is unfused: that is what CPU means here
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            if aux_request is not None:
                out, aux = kernel(q, k, v, return_aux=aux_request(lse=True), **kw)
                lse = aux.lse
            else:
                out, lse = kernel(q, k, v, return_lse=True, **kw)
        return out.to(q.dtype), lse.float()
