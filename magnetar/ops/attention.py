"""``attention_with_lse``: softmax attention that also returns the log-sum-exp, with position-based causality.

This is the one attention entry point of Magnetar. Every strategy (dense, Star, Pulsar, Ring, sparse
decoding) computes partial results with it and combines them with :func:`magnetar.ops.merge.merge_states`.

Layouts (the whole project uses them):
    q        (B, Hq,  Sq, D)   fp32 / bf16 / fp16
    k, v     (B, Hkv, Sk, D)   same dtype and device as q; Hq % Hkv == 0 (MHA, GQA, MQA).
                               Query head h reads KV head h // (Hq // Hkv) (transformers' repeat_kv order).
    q_pos    (Sq,) or (B, Sq)  integer positions of the queries; default arange(Sk - Sq, Sk)
    k_pos    (Sk,) or (B, Sk)  integer positions of the keys;    default arange(Sk)
    out      (B, Hq, Sq, D)    q's dtype
    lse      (B, Hq, Sq)       float32, natural log

Causality is defined by positions, not by index: key j is visible to query i iff ``k_pos[j] <= q_pos[i]``.
Positions may be gapped and unsorted (Star anchors and Pulsar summaries keep their original positions).
``causal=False`` makes every key visible. A query with no visible key gets ``out = 0, lse = -inf``.

Non-finite inputs are never turned into finite output, and every backend gives the same rows
(:mod:`magnetar.ops.nonfinite`): NaN or +-inf in q row i or in a key row i can see makes row i
``(NaN, NaN)``; in v of a key row i can see, row i's ``out`` is NaN (its lse stays what the scores give);
a key no query can see changes nothing; a row that sees no key is ``(0, -inf)`` even if its query is NaN.
Cost for finite inputs: one sum over q, k and out per call and one host sync; only when it
finds a non-finite value is the call re-run on zeroed inputs and the affected rows set to NaN.

The work is done by a backend from :mod:`magnetar.ops.backends`; this module validates the inputs, classifies
the mask once (so backends can take a mask-free fast path), hands the backend a
:class:`magnetar.ops.call.AttentionCall`, fixes up rows with no visible key and applies the non-finite rule.
It knows nothing about ranks, blocks or models.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from magnetar.ops.backends import list_backends, select_backend
# the call object and mask kinds live in ops.call so backends need not import this module; they stay
# importable from here (tests and benchmarks do)
from magnetar.ops.call import CAUSAL_BOTTOM_RIGHT, FULL, POSITIONS, AttentionCall
from magnetar.ops.merge import merge_states
from magnetar.ops.nonfinite import attend_nonfinite, fast_path_finite
from magnetar.ops.runs import Piece, index_causal, plan_pieces
from magnetar.utils.nvtx import ATTENTION, nvtx_range

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# The argument checks below are shared with ring_attention (``caller`` names the entry in the message).
def check_positions(pos, name: str, length: int, batch: int, device,
                    caller: str = "attention_with_lse") -> Optional[torch.Tensor]:
    """``pos``: None or integer positions ``(S,)`` / ``(B, S)`` (a tensor or a list); returns them int64 on
    ``device``, or raises ``ValueError`` naming ``name``."""
    if pos is None:
        return None
    if not isinstance(pos, torch.Tensor):
        try:
            pos = torch.as_tensor(pos)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"{caller}: {name} must be a tensor of integer positions, got {type(pos).__name__} "
                             f"({e})") from None
    if pos.is_floating_point() or pos.is_complex() or pos.dtype == torch.bool:
        raise ValueError(f"{caller}: {name} must hold integer positions, got dtype {pos.dtype}")
    if pos.dim() == 1:
        if pos.shape[0] != length:
            raise ValueError(
                f"{caller}: {name} has {pos.shape[0]} positions but the tensor it describes has "
                f"length {length}; pass one position per token"
            )
    elif pos.dim() == 2:
        if tuple(pos.shape) != (batch, length):
            raise ValueError(
                f"{caller}: {name} has shape {tuple(pos.shape)}; per-sequence positions must be "
                f"(B, S) = ({batch}, {length})"
            )
    else:
        raise ValueError(f"{caller}: {name} must be 1-D (S,) or 2-D (B, S), got shape {tuple(pos.shape)}")
    return pos.to(device=device, dtype=torch.long)


def validate_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caller: str = "attention_with_lse") -> None:
    """The layout, dtype and device rules of the module docstring; ``ValueError`` naming the tensor otherwise."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{caller}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            layout = "(B, Hq, Sq, D)" if name == "q" else "(B, Hkv, Sk, D)"
            raise ValueError(f"{caller}: {name} must be 4-D {layout}, got shape {tuple(t.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{caller}: dtype {q.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"{caller}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast k and v to q's dtype"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"{caller}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"{caller}: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"{caller}: batch sizes differ: q has B={q.shape[0]}, k/v have B={k.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{caller}: head dims differ: q has D={q.shape[-1]}, k/v have D={k.shape[-1]}")
    if q.shape[-1] == 0:
        raise ValueError(f"{caller}: the head dimension D (the last axis of q, k, v) is 0; attention needs D >= 1 "
                         f"(the softmax scale is 1/sqrt(D))")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"{caller}: query heads Hq={hq} must be a multiple of KV heads Hkv={hkv} (MHA, GQA or MQA); "
            f"check the head axis (dim 1) of q and k"
        )


def check_options(causal, scale, window, backend, caller: str = "attention_with_lse") -> None:
    """``causal`` a bool; ``scale`` None or a finite real > 0; ``window`` None or an int >= 1 (with causal);
    ``backend`` ``"auto"`` or a registered name. ``ValueError`` naming the argument otherwise."""
    if not isinstance(causal, bool):
        raise ValueError(f"{caller}: causal must be True or False, got {type(causal).__name__} {causal!r}")
    if scale is not None:
        if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
            raise ValueError(f"{caller}: scale must be a float > 0 (default 1/sqrt(D): pass None), got "
                             f"{type(scale).__name__} {scale!r}")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"{caller}: scale must be a finite float > 0 (default 1/sqrt(D): pass None), got {scale}")
    if window is not None:
        if not isinstance(window, numbers.Integral) or isinstance(window, bool):
            raise ValueError(f"{caller}: window must be an int >= 1 (keys per query, transformers' sliding_window) "
                             f"or None, got {type(window).__name__} {window!r}")
        if not causal or window < 1:
            raise ValueError(f"{caller}: window={window} needs causal=True and window >= 1")
    if not isinstance(backend, str) or (backend != "auto" and backend not in list_backends()):
        raise ValueError(f"{caller}: unknown attention backend {backend!r}; choose 'auto' or one of "
                         f"{list_backends()}")


def _classify(q_pos, k_pos, sq: int, sk: int, causal: bool, window: Optional[int] = None) -> str:
    if not causal:
        return FULL
    if window is not None:  # FULL only if every key lies in every query's window; else the position mask
        qp = q_pos if q_pos is not None else torch.arange(sk - sq, sk)
        kp = k_pos if k_pos is not None else torch.arange(sk)
        if bool(kp.max() <= qp.min()) and bool(kp.min() > qp.max() - window):
            return FULL
        return POSITIONS
    if q_pos is None and k_pos is None:
        if sq == 1 and sk >= 1:
            return FULL  # the single query sits at the last position: it sees every key
        return CAUSAL_BOTTOM_RIGHT if sq <= sk else POSITIONS
    # Explicit positions: one reduction tells whether any key lies in the future of any query.
    qp = q_pos if q_pos is not None else torch.arange(sk - sq, sk, device=k_pos.device)
    kp = k_pos if k_pos is not None else torch.arange(sk, device=qp.device)
    if bool(kp.max() <= qp.min()):
        return FULL
    if index_causal(qp, kp):  # a segment over its own tokens in position order (Pulsar's summaries, Star's anchor)
        return CAUSAL_BOTTOM_RIGHT
    return POSITIONS


def _attend_pieces(call: AttentionCall, pieces: list[Piece], backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Run each mask-free piece on the chosen backend and merge the pieces of every query row."""
    q, k, v = call.q, call.k, call.v
    B, Hq, Sq, D = q.shape
    out = torch.zeros(B, Hq, Sq, D, dtype=torch.float32, device=q.device)
    lse = torch.full((B, Hq, Sq), float("-inf"), dtype=torch.float32, device=q.device)
    seen = torch.zeros(Sq, dtype=torch.bool)  # rows written at least once (first write needs no merge)
    for p in pieces:
        sub = AttentionCall(q[:, :, p.q0 : p.q1], k[:, :, p.k0 : p.k1], v[:, :, p.k0 : p.k1], None, None, call.scale,
                            CAUSAL_BOTTOM_RIGHT if p.causal else FULL)
        impl = select_backend(sub, backend)
        with nvtx_range(ATTENTION, backend=impl.name):
            o, l = impl.forward(sub)
        rows = slice(p.q0, p.q1)
        if not bool(seen[rows].any()):
            out[:, :, rows], lse[:, :, rows] = o, l
        else:
            out[:, :, rows], lse[:, :, rows] = merge_states(
                torch.stack((out[:, :, rows], o.float())), torch.stack((lse[:, :, rows], l))
            )
        seen[rows] = True
    return out.to(q.dtype), lse


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_pos: Optional[torch.Tensor] = None,
    k_pos: Optional[torch.Tensor] = None,
    causal: bool = True,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    backend: str = "auto",
    k_finite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over ``k, v`` returning ``(out, lse)``; see the module docstring for the contract.

    Args:
        q, k, v: ``(B, Hq, Sq, D)``, ``(B, Hkv, Sk, D)``, ``(B, Hkv, Sk, D)``.
        q_pos, k_pos: integer positions ``(S,)`` or ``(B, S)``; defaults place the queries at the end.
        causal: mask keys whose position is greater than the query's.
        scale: softmax scale, default ``1/sqrt(D)``.
        window: sliding-window attention (Gemma-3 local layers, Mistral): key j is visible to query i only if
            also ``k_pos[j] > q_pos[i] - window`` (transformers' convention). Needs ``causal=True``.
        backend: ``"auto"`` or a registered backend name (``magnetar.ops.backends.list_backends()``);
            a forced backend that cannot serve the call raises ``ValueError`` with its reasons.
        k_finite: the caller knows every element of k is finite (checked once for a frozen KV it reuses): the
            non-finite check then reads q and out only (the rule is unchanged).

    Returns:
        ``out (B, Hq, Sq, D)`` in q's dtype, ``lse (B, Hq, Sq)`` float32; rows with no visible key are
        ``(0, -inf)``. Non-finite inputs give NaN rows, the same on every backend (module docstring).
    """
    validate_qkv(q, k, v)
    check_options(causal, scale, window, backend)
    B, Hq, Sq, D = q.shape
    Sk = k.shape[2]
    q_pos_t = check_positions(q_pos, "q_pos", Sq, B, q.device)
    k_pos_t = check_positions(k_pos, "k_pos", Sk, B, q.device)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)

    if Sq == 0 or Sk == 0:  # nothing to attend to (kernels crash on Sk = 0)
        out = torch.zeros(B, Hq, Sq, D, dtype=q.dtype, device=q.device)
        return out, torch.full((B, Hq, Sq), float("-inf"), dtype=torch.float32, device=q.device)

    kind = _classify(q_pos_t, k_pos_t, Sq, Sk, causal, window)
    if kind == CAUSAL_BOTTOM_RIGHT:  # the call's contract: the default positions (the same mask, by index)
        q_pos_t = k_pos_t = None
    call = AttentionCall(q, k, v, q_pos_t, k_pos_t, scale, kind, window if kind == POSITIONS else None)
    out, lse, clean = _attend_checked(call, backend)
    # the common case: the kernel saw q, k and out finite, or one sum over them says so
    if clean or fast_path_finite(call, out, check_k=not k_finite):
        return out, lse
    return attend_nonfinite(call, lambda c: _attend(c, backend), fast=(out, lse))


def _attend(call: AttentionCall, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _attend_checked(call, backend)[:2]


def _attend_checked(call: AttentionCall, backend: str) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The finite path: mask-free pieces or one backend call, then rows with no visible key set to ``(0, -inf)``;
    and whether the backend saw q, k and out all finite (``forward_checked``; False: not known)."""
    if call.mask_kind == POSITIONS and call.window is None:
        pieces = plan_pieces(call.q_pos, call.k_pos)
        if pieces is not None:  # a few contiguous runs: mask-free pieces, merged
            return (*_attend_pieces(call, pieces, backend), False)

    impl = select_backend(call, backend)
    checked = getattr(impl, "forward_checked", None)
    with nvtx_range(ATTENTION, backend=impl.name):
        if checked is not None:
            out, lse, clean = checked(call)
        else:
            (out, lse), clean = impl.forward(call), False
    if call.mask_kind == POSITIONS:
        # Rows that see no key: kernels disagree (CPU flash gives lse 0, FA gives +inf); normalise here.
        Sq = call.q.shape[2]
        if call.window is None:
            kmin = call.k_pos.amin(dim=-1, keepdim=True)  # (1,) or (B, 1)
            empty = call.q_pos < kmin  # (Sq,) or (B, Sq)
            empty = empty.view(1, 1, Sq) if empty.dim() == 1 else empty.unsqueeze(1)
        else:
            empty = ~call.visible().any(dim=-1)  # (1|B, 1, Sq)
        lse = torch.where(empty, torch.full_like(lse, float("-inf")), lse)
        out = out.masked_fill(empty.unsqueeze(-1), 0)
        clean = False  # a backend's own flag is for the call it saw, not for these rows
    return out, lse, clean
