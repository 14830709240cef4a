"""The attention-mass top-k oracle for one full/GQA attention layer (paper Sec. 4, Algorithm 1), as tensor functions.

1. dense causal scores and softmax normalisers (lse per query head and query), key tile by key tile;
2. dense probabilities rebuilt tile by tile and averaged over ALL query heads:
   ``P(t, s) = (1 / Hq) sum_h A(t, h, s)`` (:func:`head_averaged_probs`, also the indexer's KL teacher);
3. top-k of ``P(t, .)`` per query (``b_sel = 1``), or of the block max ``P_B(s) = max_{t in B, s visible to t}
   P(t, s)`` per block ``B`` of ``b_sel`` consecutive query rows, causally invalid keys masked first
   (:func:`head_averaged_topk`); fewer than k valid keys -> the row is padded with :data:`SENTINEL`;
4. the original GQA attention recomputed on the GATHERED support only, each query applying its own causal
   mask (:func:`sparse_gqa_attention`) -- no dense S x N mask is ever built.

Layouts are :func:`magnetar.ops.attention_with_lse`'s: ``q (B, Hq, S, D)``, ``k, v (B, Hkv, N, D)``, query head
``h`` reads KV head ``h // (Hq // Hkv)``; positions ``(S,)``/``(N,)`` or ``(B, S)``/``(B, N)`` decide causality
(key ``s`` visible to query ``t`` iff ``k_pos[s] <= q_pos[t]``, and ``k_pos[s] > q_pos[t] - window`` with a
sliding window); defaults put the queries at the last S key positions. Support indices are ``(B, M, k')``
int64 with ``M = ceil(S / b_sel)`` and ``k' = min(k, N)``: block ``m`` covers query rows
``[m b_sel, (m + 1) b_sel)``. Probabilities and lse are float32, natural log.

Nothing here knows about models, layers or the engine. The oracle is a measuring instrument, not an
acceleration: step 1-2 cost two dense QK^T passes (the torch tiles; the fused CPU op does one, keeping a row's
logits of every head).
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

from magnetar.ops import attention_with_lse
from magnetar.ops.slots import FAR
from magnetar.ops.jit import LazyOp

SENTINEL = -1  # a support slot holding no key (fewer than k keys were causally valid)

Rows = Union[None, slice, torch.Tensor]
SPARSE_BACKENDS = ("auto", "op", "torch", "registry")


def _make_builder(device_type: str):
    from magnetar.ops import op_builder  # imports DeepSpeed: deferred to the first use

    return op_builder.SparseAttentionBuilder() if device_type == "cpu" else None


# the fused oracle top-k and gathered sparse attention (magnetar/ops/csrc/sparse_attention.cpp); CPU only so far
SPARSE_ATTENTION_OP = LazyOp("sparse prefill", _make_builder, ("sparse_gqa_attention", "oracle_topk", "indexer_topk"),
                             devices=("cpu",))


def use_sparse_op(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` (auto / op / torch) means the fused sparse prefill op for tensors on ``device``."""
    if backend not in SPARSE_BACKENDS:
        raise ValueError(f"sparse prefill: unknown backend {backend!r}; choose one of {SPARSE_BACKENDS}")
    if backend in ("torch", "registry"):
        return False
    if device.type != "cpu":
        if backend == "op":
            raise RuntimeError(f"sparse prefill: the fused op is built for CPU tensors only, got {device}; "
                               "use backend='auto' (the torch gather path) on this device")
        return False
    if backend == "op":
        SPARSE_ATTENTION_OP.load(device)  # raises with the build failure's reason
        return True
    return SPARSE_ATTENTION_OP.available(device)


# -- validation and positions --------------------------------------------------------------------------------
def _check_qk(fn: str, q: torch.Tensor, k: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"{fn}: q must be (B, Hq, S, D) and k (B, Hkv, N, D), got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{fn}: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head dim")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"{fn}: query heads Hq={q.shape[1]} must be a multiple of KV heads Hkv={k.shape[1]}")


def check_topk(topk, fn: str = "oracle") -> None:
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"{fn}: topk must be an int >= 1 keys per query (prefill_topk / --prefill-topk), got {topk!r}")


def check_b_sel(b_sel, fn: str = "oracle") -> None:
    if isinstance(b_sel, bool) or not isinstance(b_sel, int) or b_sel < 1:
        raise ValueError(f"{fn}: b_sel must be an int >= 1 query rows per selection block (prefill_b_sel / "
                         f"--prefill-b-sel), got {b_sel!r}")


def check_positions_arg(pos, length: int, batch: int, device, name: str, default_start: int) -> torch.Tensor:
    """Positions as ``(1 or B, length)`` int64 on ``device``."""
    if pos is None:
        return torch.arange(default_start, default_start + length, device=device).view(1, length)
    pos = torch.as_tensor(pos, device=device)
    if pos.is_floating_point() or pos.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer positions, got dtype {pos.dtype}")
    if pos.dim() == 1 and pos.shape[0] == length:
        return pos.long().view(1, length)
    if pos.dim() == 2 and tuple(pos.shape) == (batch, length):
        return pos.long()
    raise ValueError(f"{name} must be ({length},) or ({batch}, {length}), got shape {tuple(pos.shape)}")


def visible_mask(qp: torch.Tensor, kp: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """``qp (Bp, r)``, ``kp (Bp, n)`` -> ``(Bp, r, n)`` bool: key visible to query."""
    vis = kp[:, None, :] <= qp[:, :, None]
    if window is not None:
        vis &= kp[:, None, :] > qp[:, :, None] - window
    return vis


def _row_index(rows: Rows, S: int, device) -> torch.Tensor:
    if rows is None:
        return torch.arange(S, device=device)
    if isinstance(rows, slice):
        return torch.arange(S, device=device)[rows]
    return torch.as_tensor(rows, device=device).long().reshape(-1)


# -- steps 1-2: normalisers and head-averaged probabilities, tile by tile -----------------------------------
def _row_lse(qg, kf, qp, kp, scale, window, k_tile) -> torch.Tensor:
    """``qg (B, Hkv, G, r, D)`` float32 -> dense causal lse ``(B, Hkv, G, r)`` (online over key tiles)."""
    B, Hkv, G, r, _ = qg.shape
    lse = torch.full((B, Hkv, G, r), float("-inf"), device=qg.device)
    for n0 in range(0, kf.shape[2], k_tile):
        n1 = min(kf.shape[2], n0 + k_tile)
        logits = torch.einsum("bhgrd,bhnd->bhgrn", qg, kf[:, :, n0:n1]) * scale
        vis = visible_mask(qp, kp[:, n0:n1], window)[:, None, None]  # (Bp, 1, 1, r, n)
        lse = torch.logaddexp(lse, torch.logsumexp(logits.masked_fill(~vis, float("-inf")), dim=-1))
    return lse


def _row_probs(qg, kf, lse, qp, kp, scale, window, k_tile) -> torch.Tensor:
    """Head-averaged dense probabilities ``(B, r, N)`` float32 of the rows in ``qg``; 0 where not visible."""
    B, Hkv, G, r, _ = qg.shape
    N = kf.shape[2]
    out = torch.empty(B, r, N, device=qg.device)
    for n0 in range(0, N, k_tile):
        n1 = min(N, n0 + k_tile)
        logits = torch.einsum("bhgrd,bhnd->bhgrn", qg, kf[:, :, n0:n1]) * scale
        vis = visible_mask(qp, kp[:, n0:n1], window)[:, None, None]
        p = torch.where(vis, torch.exp(logits - lse[..., None]), torch.zeros((), device=qg.device))
        out[:, :, n0:n1] = p.sum(dim=(1, 2)) / (Hkv * G)
    return out


def _grouped(q: torch.Tensor, Hkv: int, rows: torch.Tensor) -> torch.Tensor:
    B, Hq, _, D = q.shape
    return q[:, :, rows].float().reshape(B, Hkv, Hq // Hkv, rows.numel(), D)


def head_averaged_probs(q: torch.Tensor, k: torch.Tensor, *, scale: Optional[float] = None, q_pos=None, k_pos=None,
                        window: Optional[int] = None, rows: Rows = None, lse: Optional[torch.Tensor] = None,
                        q_tile: int = 128, k_tile: int = 1024) -> torch.Tensor:
    """``P(t, s) = (1/Hq) sum_h softmax_{visible s'}(q_th . k_s' scale)_s`` for the query ``rows`` (default all).

    ``rows``: a slice or 1-D index tensor of query rows; ``lse``: the dense lse ``(B, Hq, S)`` if already known
    (else computed here, key tile by key tile). Returns ``(B, R, N)`` float32, each row summing to 1 over its
    visible keys (0 elsewhere; a row with no visible key is all 0). Only ``q_tile x N`` rows are held at once.
    """
    _check_qk("head_averaged_probs", q, k)
    B, Hq, S, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    qp_all = check_positions_arg(q_pos, S, B, q.device, "q_pos", N - S)
    kp = check_positions_arg(k_pos, N, B, q.device, "k_pos", 0)
    idx = _row_index(rows, S, q.device)
    kf = k.float()
    out = torch.empty(B, idx.numel(), N, device=q.device)
    for i0 in range(0, idx.numel(), q_tile):
        r = idx[i0:i0 + q_tile]
        qg, qp = _grouped(q, Hkv, r), qp_all[:, r]
        if lse is None:
            lr = _row_lse(qg, kf, qp, kp, scale, window, k_tile)
        else:
            lr = lse[:, :, r].float().reshape(B, Hkv, Hq // Hkv, r.numel())
        out[:, i0:i0 + r.numel()] = _row_probs(qg, kf, lr, qp, kp, scale, window, k_tile)
    return out


# -- step 3: the support --------------------------------------------------------------------------------------
def block_topk(scores: torch.Tensor, b_sel: int, topk: int) -> torch.Tensor:
    """Top-k keys of each block of ``b_sel`` consecutive rows of ``scores (B, r, N)`` by the block max.

    Causally invalid entries must already be ``-inf``; a key invalid for every row of a block stays ``-inf``
    and is never chosen: slots left without a valid key hold :data:`SENTINEL`. Returns ``(B, ceil(r / b_sel),
    min(topk, N))`` int64 in decreasing score order (ties in unspecified order).
    """
    B, r, N = scores.shape
    nb = -(-r // b_sel)
    if nb * b_sel != r:
        pad = scores.new_full((B, nb * b_sel - r, N), float("-inf"))
        scores = torch.cat((scores, pad), dim=1)
    agg = scores.view(B, nb, b_sel, N).amax(dim=2) if b_sel > 1 else scores
    val, idx = agg.topk(min(topk, N), dim=-1)
    return idx.masked_fill(val == float("-inf"), SENTINEL)


def head_averaged_topk(q: torch.Tensor, k: torch.Tensor, *, topk: int, b_sel: int = 1, scale: Optional[float] = None,
                       q_pos=None, k_pos=None, window: Optional[int] = None, lse: Optional[torch.Tensor] = None,
                       q_tile: int = 128, k_tile: int = 1024, backend: str = "auto") -> torch.Tensor:
    """The oracle support (Algorithm 1, steps 2-4): per query (``b_sel = 1``) or per block of ``b_sel`` rows.

    Returns ``idx (B, ceil(S / b_sel), min(topk, N))`` int64, padded with :data:`SENTINEL`. ``lse`` as in
    :func:`head_averaged_probs`; at most ``~q_tile`` rows (rounded to whole blocks) of P exist at a time.
    ``backend`` as in :func:`sparse_gqa_attention`: the fused op (CPU, one query row's logits at a time per
    thread; ``lse`` is recomputed there) or the torch tiles. Near-ties at the k-th score may resolve differently.
    """
    check_topk(topk, "head_averaged_topk")
    check_b_sel(b_sel, "head_averaged_topk")
    _check_qk("head_averaged_topk", q, k)
    B, Hq, S, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    qp_all = check_positions_arg(q_pos, S, B, q.device, "q_pos", N - S)
    kp = check_positions_arg(k_pos, N, B, q.device, "k_pos", 0)
    if use_sparse_op(backend, q.device):
        return SPARSE_ATTENTION_OP.load(q.device).oracle_topk(
            q.float().contiguous(), k.float().contiguous(), qp_all.expand(B, S).contiguous(),
            kp.expand(B, N).contiguous(), topk, b_sel, scale, -1 if window is None else int(window))
    kf = k.float()
    step = b_sel * max(1, q_tile // b_sel)  # whole blocks per tile
    parts = []
    for r0 in range(0, S, step):
        r = torch.arange(r0, min(S, r0 + step), device=q.device)
        qg, qp = _grouped(q, Hkv, r), qp_all[:, r]
        lr = _row_lse(qg, kf, qp, kp, scale, window, k_tile) if lse is None else \
            lse[:, :, r].float().reshape(B, Hkv, Hq // Hkv, r.numel())
        p = _row_probs(qg, kf, lr, qp, kp, scale, window, k_tile)
        p = p.masked_fill(~visible_mask(qp, kp, window), float("-inf"))
        parts.append(block_topk(p, b_sel, topk))
    return torch.cat(parts, dim=1)


# -- step 4: sparse GQA attention on the gathered support ---------------------------------------------------
def _check_idx(idx: torch.Tensor, B: int, S: int, N: int, b_sel: int) -> None:
    M = -(-S // b_sel)
    if idx.dim() != 3 or idx.shape[0] != B or idx.shape[1] != M:
        raise ValueError(f"sparse_gqa_attention: idx must be (B, ceil(S / b_sel), k) = ({B}, {M}, k) for S={S}, "
                         f"b_sel={b_sel}; got {tuple(idx.shape)}")
    if idx.is_floating_point() or idx.dtype == torch.bool:
        raise ValueError(f"sparse_gqa_attention: idx must hold integer key indices, got {idx.dtype}")
    if idx.numel() and (int(idx.min()) < SENTINEL or int(idx.max()) >= N):
        raise ValueError(f"sparse_gqa_attention: indices must lie in [0, {N}) or be SENTINEL ({SENTINEL})")


def _block_batches(q, k, v, idx, qp_all, kp, b_sel: int, step: int, dtype):
    """The blocks of ``idx`` ``step`` at a time: ``(r0, r1, nb, sel (B, nb, kk), kg, vg (B, Hkv, nb, kk, D),
    kpos (B, nb, kk), qt (B, Hq, nb * b_sel, D), qp (B, nb * b_sel))`` -- each block's support gathered (an empty
    slot reads key 0: ``sel`` < 0 marks it), its queries and their positions padded to whole blocks (a padding row
    sits at a position that sees nothing), K, V and q in ``dtype``."""
    B, Hq, S, D = q.shape
    Hkv, (M, kk) = k.shape[1], idx.shape[1:]
    for m0 in range(0, M, step):
        m1 = min(M, m0 + step)
        nb, r0, r1 = m1 - m0, m0 * b_sel, min(S, m1 * b_sel)
        sel = idx[:, m0:m1].to(q.device)  # (B, nb, kk)
        safe = sel.clamp(min=0)
        where = safe.reshape(B, 1, nb * kk, 1).expand(B, Hkv, nb * kk, D)
        kg, vg = (t.gather(2, where).to(dtype).view(B, Hkv, nb, kk, D) for t in (k, v))
        kpos = kp.gather(1, safe.reshape(B, nb * kk)).view(B, nb, kk)
        qt = torch.zeros(B, Hq, nb * b_sel, D, dtype=dtype, device=q.device)
        qt[:, :, :r1 - r0] = q[:, :, r0:r1]
        qp = torch.full((B, nb * b_sel), -FAR, dtype=torch.long, device=q.device)
        qp[:, :r1 - r0] = qp_all[:, r0:r1]
        yield r0, r1, nb, sel, kg, vg, kpos, qt, qp


GATHER_BYTES = 1 << 29  # the registry path's gathered K and V per call (512 MiB): how many blocks one call takes


def _sparse_via_registry(q, k, v, idx, scale, qp_all, kp, b_sel, window) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sparse_gqa_attention` with each block's support as a sequence of its own: ``nb`` blocks at a time, the
    queries ``(nb, Hq, b_sel, D)`` over their gathered keys ``(nb, Hkv, kk, D)`` at their own positions (an empty
    slot at :data:`~magnetar.ops.slots.FAR`, a padding row at a position that sees nothing), through
    :func:`magnetar.ops.attention_with_lse` -- one kernel call of the registry per batch of blocks (duplicates in a
    support count twice, as in the torch path)."""
    B, Hq, S, D = q.shape
    Hkv, kk = k.shape[1], idx.shape[2]
    out = torch.zeros(B, Hq, S, D, dtype=q.dtype, device=q.device)
    lse = torch.full((B, Hq, S), float("-inf"), device=q.device)
    if kk == 0 or S == 0:
        return out, lse
    step = max(1, GATHER_BYTES // (2 * kk * Hkv * D * k.element_size()))  # blocks per call
    for r0, r1, nb, sel, kg, vg, kpos, qt, qp in _block_batches(q, k, v, idx, qp_all, kp, b_sel, step, q.dtype):
        kg, vg = (t.transpose(1, 2).reshape(B * nb, Hkv, kk, D) for t in (kg, vg))
        qt = qt.view(B, Hq, nb, b_sel, D).transpose(1, 2).reshape(B * nb, Hq, b_sel, D)
        o, l = attention_with_lse(qt, kg, vg, q_pos=qp.view(B * nb, b_sel),
                                  k_pos=torch.where(sel >= 0, kpos, FAR).reshape(B * nb, kk), scale=scale,
                                  window=window)
        out[:, :, r0:r1] = o.view(B, nb, Hq, b_sel, D).transpose(1, 2).reshape(B, Hq, nb * b_sel, D)[:, :, :r1 - r0]
        lse[:, :, r0:r1] = l.view(B, nb, Hq, b_sel).transpose(1, 2).reshape(B, Hq, nb * b_sel)[:, :, :r1 - r0]
    return out, lse


def sparse_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, *,
                         scale: Optional[float] = None, q_pos=None, k_pos=None, b_sel: int = 1,
                         window: Optional[int] = None, max_gather: int = 16384,
                         backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over its block's support only (Algorithm 1, step 5).

    ``idx (B, ceil(S / b_sel), kk)``: distinct key indices per block, :data:`SENTINEL` for empty slots (invisible).
    Only the selected K/V rows are read; each query masks the support keys it may not see (``k_pos > q_pos``,
    outside the window). Returns ``out (B, Hq, S, D)`` in q's dtype and ``lse (B, Hq, S)`` float32; a query
    seeing none of its support gets ``(0, -inf)``, as in :func:`magnetar.ops.attention_with_lse`.

    ``backend``: ``"op"`` the fused DeepSpeed op (``magnetar/ops/csrc/sparse_attention.cpp``, CPU: one work item
    per (batch, KV head, query) reads its selected K/V rows once for the G query heads sharing them), ``"torch"``
    batched gathers (``max_gather`` support slots per step, shared by all KV heads; any device; float32 einsums),
    ``"registry"`` each block's support gathered into a sequence of its own and attended by the ops registry's
    kernel for per-sequence positions (:func:`magnetar.ops.attention_with_lse`: compiled FlexAttention on CUDA,
    bf16 in, float32 inside; many blocks per call, :func:`_gathered_batches`), ``"auto"`` the op for CPU tensors
    when it builds, the registry on CUDA, else torch.
    """
    _check_qk("sparse_gqa_attention", q, k)
    check_b_sel(b_sel, "sparse_gqa_attention")
    if v.shape != k.shape:
        raise ValueError(f"sparse_gqa_attention: k and v must have one shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    B, Hq, S, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    _check_idx(idx, B, S, N, b_sel)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    qp_all = check_positions_arg(q_pos, S, B, q.device, "q_pos", N - S).expand(B, S)
    kp = check_positions_arg(k_pos, N, B, q.device, "k_pos", 0).expand(B, N)
    kk = idx.shape[2]
    if backend == "registry" or (backend == "auto" and q.device.type == "cuda"):
        return _sparse_via_registry(q, k, v, idx, scale, qp_all, kp, b_sel, window)
    if use_sparse_op(backend, q.device):
        out, lse = SPARSE_ATTENTION_OP.load(q.device).sparse_gqa_attention(
            q.float().contiguous(), k.float().contiguous(), v.float().contiguous(), idx.long().contiguous(),
            qp_all.contiguous(), kp.contiguous(), b_sel, scale, -1 if window is None else int(window))
        return out.to(q.dtype), lse
    out = torch.zeros(B, Hq, S, D, dtype=torch.float32, device=q.device)
    lse = torch.full((B, Hq, S), float("-inf"), device=q.device)
    if kk == 0 or S == 0:
        return out.to(q.dtype), lse
    step = max(1, max_gather // kk)  # blocks per step
    for r0, r1, nb, sel, kg, vg, kpos, qt, qp in _block_batches(q, k, v, idx, qp_all, kp, b_sel, step,
                                                                torch.float32):
        kpg = kpos.view(B, nb, 1, kk)
        qt = qt.view(B, Hkv, G, nb, b_sel, D)
        qp = qp.view(B, nb, b_sel, 1)
        vis = (sel >= 0).view(B, nb, 1, kk) & (kpg <= qp)  # (B, nb, b_sel, kk)
        if window is not None:
            vis &= kpg > qp - window
        logits = torch.einsum("bhgmrd,bhmkd->bhgmrk", qt, kg) * scale
        logits = logits.masked_fill(~vis[:, None, None], float("-inf"))
        l = torch.logsumexp(logits, dim=-1)  # (B, Hkv, G, nb, b_sel)
        p = torch.where(vis[:, None, None], torch.exp(logits - l[..., None]), torch.zeros((), device=q.device))
        o = torch.einsum("bhgmrk,bhmkd->bhgmrd", p, vg)
        out[:, :, r0:r1] = o.reshape(B, Hq, nb * b_sel, D)[:, :, : r1 - r0]
        lse[:, :, r0:r1] = l.reshape(B, Hq, nb * b_sel)[:, :, : r1 - r0]
    return out.to(q.dtype), lse


def oracle_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, topk: int, b_sel: int = 1,
                     scale: Optional[float] = None, q_pos=None, k_pos=None, window: Optional[int] = None,
                     backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1 for one layer: the head-averaged top-k support, then sparse GQA attention on it.

    With ``topk >= N`` (every key fits the budget) the support is every visible key, so this IS dense causal
    attention: it is computed by :func:`magnetar.ops.attention_with_lse` directly (bit-identical to dense).
    """
    check_topk(topk, "oracle_attention")
    check_b_sel(b_sel, "oracle_attention")
    if topk >= k.shape[2]:
        return attention_with_lse(q, k, v, q_pos=q_pos, k_pos=k_pos, scale=scale, window=window, backend=backend)
    idx = head_averaged_topk(q, k, topk=topk, b_sel=b_sel, scale=scale, q_pos=q_pos, k_pos=k_pos, window=window)
    return sparse_gqa_attention(q, k, v, idx, scale=scale, q_pos=q_pos, k_pos=k_pos, b_sel=b_sel, window=window)


# -- accounting -------------------------------------------------------------------------------------------------
def visible_pairs(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int] = None, tile: int = 1024) -> int:
    """(query, key) pairs dense attention sees: ``k_pos <= q_pos`` (within the window); 1-D positions."""
    total = 0
    for r0 in range(0, q_pos.numel(), tile):
        total += int(visible_mask(q_pos[r0:r0 + tile].view(1, -1), k_pos.view(1, -1), window).sum())
    return total


def support_pairs(idx: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, *, b_sel: int = 1,
                  window: Optional[int] = None) -> int:
    """(query, key) pairs the sparse attention actually uses: support entries visible to each query of the
    block, summed (per batch row; 1-D positions shared by the batch). Equals ``topk_pairs(S, k)`` for a
    per-query support over ``S`` tokens attending to themselves."""
    B, M, kk = idx.shape
    S = q_pos.numel()
    total = 0
    for m in range(0, M, max(1, 4096 // max(1, b_sel))):
        m1 = min(M, m + max(1, 4096 // max(1, b_sel)))
        sel = idx[:, m:m1]
        kpg = k_pos[sel.clamp(min=0)]  # (B, nb, kk)
        qp = q_pos[m * b_sel: min(S, m1 * b_sel)]
        block = torch.arange(qp.numel(), device=qp.device) // b_sel  # each row's block in this range
        vis = (sel[:, block] >= 0) & (kpg[:, block] <= qp.view(1, -1, 1))
        if window is not None:
            vis &= kpg[:, block] > qp.view(1, -1, 1) - window
        total += int(vis.sum())
    return total
