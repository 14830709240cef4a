"""The head-collapsed indexer (paper Sec. 6, Algorithm 2): a small per-layer scorer distilled from the oracle.

    q_t = W_Q x_t,   k_s = LN(W_K x_s),   z(t, s) = ReLU( <RoPE(q_t), RoPE(k_s)> / sqrt(d_idx) )

``x`` is the (detached) input of the layer's attention, i.e. the hidden state after the layer's input norm,
``(B, S, hidden)``; one index head of ``d_idx`` in {64, 128, 256} replaces the model's Hq heads. RoPE is the
standard ``rotate_half`` form of Hugging Face's Llama (``x cos + rotate_half(x) sin``, frequencies
``theta^(-2i / d_idx)``) with the model's global-layer ``rope_theta``; the model's rope *scaling* (llama3, yarn)
is not applied to the indexer -- it only has to rank keys and is trained with whatever RoPE it uses.
Selection reuses the oracle's rule: block max over ``b_sel`` query rows, causal mask, top-k, SENTINEL padding.

Training target (Sec. 6.2): ``KL(P || softmax(z))`` over the causally valid keys of each supervised query
row, ``P`` the oracle's head-averaged dense attention (:func:`magnetar.prefill.oracle.head_averaged_probs`).

:class:`IndexerBank` holds one indexer per layer, saves them with the signature of the model they were made
for and refuses another model or another ``d_idx``. A bank made by :meth:`IndexerBank.random` is untrained: a
stress test of the sparse path only, never output-quality evidence (Sec. 7.1); its metadata says so.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from magnetar.config.registry import PREFILL_D_IDX, check_d_idx
from magnetar.prefill.oracle import (SPARSE_ATTENTION_OP, block_topk, check_b_sel, check_positions_arg, check_topk,
                                     use_sparse_op, visible_mask)
from magnetar.utils.timing import no_timer
from magnetar.utils.weights import WeightsFile, model_signature

D_IDX_CHOICES = PREFILL_D_IDX  # Sec. 6.3: the index dimensions the paper considers
INDEXER_FILE = WeightsFile(format="magnetar-indexer-v1", what="indexer weights", option="prefill_indexer_path",
                           remake="distil them for this model with `magnetar-calibrate indexer --out {path}` (or, for "
                                  "a stress test only, set prefill_indexer_random_init)",
                           fields={"d_idx": int, "theta": float, "seed": int, "trained_layers": list, "meta": dict},
                           defaults={"seed": 0, "trained_layers": [], "meta": {}})
RANDOM_INIT_NOTE = "random init: untrained, a stress test of the sparse prefill path only, not quality evidence"


def rope_theta(config) -> float:
    """The RoPE base of the model's global (full-attention) layers."""
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):  # Gemma-3: per layer type
        params = params["full_attention"]
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta or getattr(config, "rope_theta", None) or 10000.0)


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's default rotary tables for ``positions (..., S)``: cos, sin ``(..., S, dim)`` float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class HeadCollapsedIndexer(torch.nn.Module):
    """One layer's scorer: ``W_Q, W_K (d_idx, hidden)``, key LayerNorm, RoPE, ReLU of the scaled dot product."""

    def __init__(self, hidden_size: int, d_idx: int, *, theta: float = 10000.0, eps: float = 1e-5,
                 generator: Optional[torch.Generator] = None):
        super().__init__()
        check_d_idx(d_idx)
        self.hidden_size, self.d_idx, self.theta = hidden_size, d_idx, float(theta)
        std = 1.0 / math.sqrt(hidden_size)
        self.wq = torch.nn.Parameter(torch.randn(d_idx, hidden_size, generator=generator) * std)
        self.wk = torch.nn.Parameter(torch.randn(d_idx, hidden_size, generator=generator) * std)
        self.k_norm = torch.nn.LayerNorm(d_idx, eps=eps)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x (B, S, hidden)``, ``positions (S,)`` or ``(B, S)`` -> post-RoPE ``q, k (B, S, d_idx)`` float32.
        ``x`` is detached: the backbone never receives gradients from the indexer (Algorithm 2, step 2)."""
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"indexer: x must be (B, S, {self.hidden_size}), got {tuple(x.shape)}")
        x = x.detach().to(self.wq.dtype)
        q = x @ self.wq.T
        k = self.k_norm(x @ self.wk.T)
        pos = check_positions_arg(positions, x.shape[1], x.shape[0], x.device, "positions", 0)  # (1|B, S)
        cos, sin = rope_cos_sin(pos, self.d_idx, self.theta)
        return apply_rope(q.float(), cos, sin), apply_rope(k.float(), cos, sin)

    def scores(self, x: torch.Tensor, positions: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Student scores ``z (B, R, S)`` of the query ``rows`` (default all) against every key, unmasked."""
        q, k = self.project(x, positions)
        if rows is not None:
            q = q[:, rows]
        return F.relu(q @ k.transpose(1, 2) / math.sqrt(self.d_idx))

    @torch.no_grad()
    def select(self, x: torch.Tensor, positions: torch.Tensor, *, topk: int, b_sel: int = 1,
               window: Optional[int] = None, q_tile: Optional[int] = None, timer=None, backend: str = "auto"
               ) -> torch.Tensor:
        """The support (Algorithm 2, steps 2-5): ``idx (B, ceil(S / b_sel), min(topk, S))`` as the oracle's
        :func:`~magnetar.prefill.oracle.head_averaged_topk` returns it, ranked by ``z`` instead of ``P``.
        Scores of causally invalid keys are masked before the block max; ReLU ties (zeros) break arbitrarily.
        ``timer``: a section timer (``with timer("projection"): ...``, e.g. :class:`magnetar.utils.timing.SectionTimer`)
        charged with the projection and with the scoring + top-k separately (the TTFT benchmark's profile).
        ``backend``: scoring + top-k in the fused op (CPU; ``magnetar.prefill.oracle.use_sparse_op``) or in torch
        tiles of ``q_tile`` rows (None: 256 on the CPU; on CUDA as many as keep a tile's scores near 512 MiB -- 256
        rows at 64K meant 256 small launches per layer)."""
        check_topk(topk, "indexer.select")
        check_b_sel(b_sel, "indexer.select")
        timer = timer or no_timer
        B, S, _ = x.shape
        with timer("projection"):
            q, k = self.project(x, positions)
        with timer("score_topk"):
            pos = check_positions_arg(positions, S, B, x.device, "positions", 0)
            if use_sparse_op(backend, q.device):
                p = pos.expand(B, S).contiguous()
                return SPARSE_ATTENTION_OP.load(q.device).indexer_topk(
                    q.contiguous(), k.contiguous(), p, p, topk, b_sel, 1.0 / math.sqrt(self.d_idx),
                    -1 if window is None else int(window))
            if q_tile is None:
                q_tile = max(256, (1 << 27) // max(1, B * S)) if q.device.type == "cuda" else 256
            step = b_sel * max(1, q_tile // b_sel)
            parts = []
            for r0 in range(0, S, step):
                r1 = min(S, r0 + step)
                z = F.relu(q[:, r0:r1] @ k.transpose(1, 2) / math.sqrt(self.d_idx))
                z = z.masked_fill(~visible_mask(pos[:, r0:r1], pos, window), float("-inf"))
                parts.append(block_topk(z, b_sel, topk))
            return torch.cat(parts, dim=1)


def kl_loss(teacher: torch.Tensor, student: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Sec. 6.2: mean over rows of ``KL(P || softmax(z))``, both over the row's valid (causal) keys only.

    ``teacher (..., N)``: P rows, distributions over the valid keys (0 log 0 = 0); ``student (..., N)``: scores
    z; ``valid (..., N)`` bool. Rows with no valid key are left out of the mean. Scalar float32.
    """
    if not (teacher.shape == student.shape == valid.shape):
        raise ValueError(f"kl_loss: teacher {tuple(teacher.shape)}, student {tuple(student.shape)} and valid "
                         f"{tuple(valid.shape)} must have one shape (..., N)")
    p = teacher.float().masked_fill(~valid, 0.0)
    log_q = torch.log_softmax(student.float().masked_fill(~valid, float("-inf")), dim=-1)
    log_q = torch.where(valid, log_q, torch.zeros((), device=log_q.device))  # invalid keys: 0 * log q never NaN
    kl = (torch.xlogy(p, p) - p * log_q).sum(-1)
    rows = valid.any(-1)
    if not bool(rows.any()):
        raise ValueError("kl_loss: no row has a valid key")
    return kl[rows].mean()


class IndexerBank(torch.nn.Module):
    """One :class:`HeadCollapsedIndexer` per layer of the model described by ``signature``."""

    def __init__(self, signature: dict, d_idx: int, *, theta: float = 10000.0, seed: int = 0):
        super().__init__()
        check_d_idx(d_idx)
        self.signature, self.d_idx, self.theta, self.seed = dict(signature), d_idx, float(theta), seed
        g = torch.Generator().manual_seed(seed)
        self.layers = torch.nn.ModuleList(
            HeadCollapsedIndexer(signature["hidden_size"], d_idx, theta=theta, generator=g)
            for _ in range(signature["num_hidden_layers"]))
        self.trained_layers: list[int] = []
        self.meta: dict = {"untrained": True, "note": RANDOM_INIT_NOTE}

    @classmethod
    def random(cls, config, d_idx: int, *, seed: int = 0) -> "IndexerBank":
        """An untrained bank for the model ``config``: a stress test of the sparse path ONLY (Sec. 7.1)."""
        return cls(model_signature(config), d_idx, theta=rope_theta(config), seed=seed).eval().requires_grad_(False)

    @property
    def untrained(self) -> bool:
        return not self.trained_layers

    def __getitem__(self, layer: int) -> HeadCollapsedIndexer:
        return self.layers[layer]

    def save(self, path: str | Path) -> None:
        meta = dict(self.meta, untrained=self.untrained)
        if not self.untrained and meta.get("note") == RANDOM_INIT_NOTE:
            del meta["note"]
        INDEXER_FILE.save(path, {"signature": self.signature, "d_idx": self.d_idx, "theta": self.theta,
                                 "seed": self.seed, "trained_layers": self.trained_layers, "meta": meta},
                          self.state_dict())

    @classmethod
    def load(cls, path: str | Path, config=None, *, d_idx: Optional[int] = None) -> "IndexerBank":
        """Load a bank (:data:`INDEXER_FILE`, never running code from the file); with a model ``config`` check it
        was made for this model, with ``d_idx`` its width."""
        data = INDEXER_FILE.read(path, config)
        if d_idx is not None and data["d_idx"] != d_idx:
            raise ValueError(f"indexer weights {path} have d_idx {data['d_idx']} but prefill_d_idx is {d_idx}; "
                             f"set --prefill-d-idx {data['d_idx']}")
        bank = INDEXER_FILE.build(path, data,
                                  lambda d: cls(d["signature"], d["d_idx"], theta=d["theta"], seed=d["seed"]))
        bank.trained_layers = list(data["trained_layers"])
        bank.meta = dict(data["meta"])
        return bank.eval().requires_grad_(False)
