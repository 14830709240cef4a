"""Distilling the head-collapsed indexer from the oracle (paper Sec. 6.2, Algorithm 2 step 1) -- library level.

1. **Collect** (:func:`collect_teacher`): each sequence runs once through the frozen model with ordinary dense
   causal attention; for every requested global layer we keep the attention's input hidden states
   ``x (S, hidden)`` and, for ``rows`` sampled query positions, the oracle's teacher rows
   ``P (rows, S)`` = head-averaged dense attention (:func:`~magnetar.prefill.oracle.head_averaged_probs`, from
   the lse the attention returned). Teacher rows come from the dense trajectory.
2. **Train** (:func:`distill_layer`): only the layer's indexer, AdamW on ``KL(P || softmax(z))`` over the valid
   causal keys (:func:`~magnetar.prefill.indexer.kl_loss`); the backbone is never touched.
3. **Measure** (:func:`support_recall`): how much of the oracle's top-k support the indexer's top-k recovers.

This is the interface a calibration command would drive (sequences in, an :class:`IndexerBank` file out); the
command itself, its corpus and its sampling schedule over layers and positions are not built here.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from magnetar.ops import attention_with_lse
from magnetar.prefill.indexer import HeadCollapsedIndexer, kl_loss
from magnetar.prefill.oracle import head_averaged_probs


class _Capture:
    """Stands in for the engine's ForwardContext: dense causal attention; records x and the teacher rows."""

    mode = "capture"

    def __init__(self, layers: Sequence[int], rows: torch.Tensor):
        self.layers, self.rows = set(layers), rows
        self.x: dict[int, torch.Tensor] = {}
        self.P: dict[int, torch.Tensor] = {}
        self._hidden: dict[int, torch.Tensor] = {}

    def attend(self, layer, q, k, v, scale, window=None):
        out, lse = attention_with_lse(q, k, v, scale=scale, window=window)
        if layer in self.layers and window is None:
            self.x[layer] = self._hidden.pop(layer)[0].float()
            self.P[layer] = head_averaged_probs(q, k, scale=scale, rows=self.rows, lse=lse)[0]
        return out


@torch.no_grad()
def collect_teacher(model, sequences: Sequence[torch.Tensor], layers: Sequence[int], *, rows: int = 64,
                    seed: int = 0) -> list[dict]:
    """Per sequence ``{"x": {layer: (S, hidden)}, "P": {layer: (R, S)}, "rows": (R,)}`` (float32).

    ``rows`` query positions per sequence are drawn uniformly from the second half of the sequence (they see
    enough keys for top-k to matter); the same rows serve every layer.
    """
    from magnetar.engine.hf import prepare_model

    prepare_model(model)
    g = torch.Generator().manual_seed(seed)
    out = []

    def hook(module, args, kwargs):
        cap = kwargs.get("magnetar")
        if isinstance(cap, _Capture):
            cap._hidden[module.layer_idx] = kwargs.get("hidden_states", args[0] if args else None)

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules()
               if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]
    try:
        for ids in sequences:
            S = ids.numel()
            lo = S // 2
            r = (torch.randperm(S - lo, generator=g)[:rows] + lo).sort().values
            cap = _Capture(layers, r)
            model(input_ids=ids[None], position_ids=torch.arange(S)[None], use_cache=False, magnetar=cap)
            out.append({"x": cap.x, "P": cap.P, "rows": r})
    finally:
        for h in handles:
            h.remove()
    return out


def distill_layer(indexer: HeadCollapsedIndexer, data: Sequence[dict], layer: int, *, passes: int = 4,
                  lr: float = 1e-3, weight_decay: float = 0.0, seed: int = 0) -> list[float]:
    """Train ``indexer`` (one layer's) in place on the collected ``data``; returns the KL loss per step."""
    torch.manual_seed(seed)
    params = list(indexer.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    g = torch.Generator().manual_seed(seed)
    losses = []
    indexer.train()
    for _ in range(passes):
        for i in torch.randperm(len(data), generator=g).tolist():
            x, P, rows = data[i]["x"][layer], data[i]["P"][layer], data[i]["rows"]
            S = x.shape[0]
            z = indexer.scores(x[None], torch.arange(S), rows=rows)[0]  # (R, S)
            valid = torch.arange(S)[None, :] <= rows[:, None]
            loss = kl_loss(P, z, valid)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    indexer.eval()
    for p in params:
        p.requires_grad_(False)
    return losses


@torch.no_grad()
def support_recall(indexer: HeadCollapsedIndexer, data: Sequence[dict], layer: int, topk: int,
                   b_sel: int = 1) -> float:
    """Mean over the sampled rows of ``|S_indexer ∩ S_oracle| / |S_oracle|`` (per-query supports, top-k of P)."""
    hits, total = 0, 0
    for item in data:
        x, P, rows = item["x"][layer], item["P"][layer], item["rows"]
        S = x.shape[0]
        idx = indexer.select(x[None], torch.arange(S), topk=topk, b_sel=b_sel)[0]  # (M, k)
        valid = torch.arange(S)[None, :] <= rows[:, None]
        _, want = P.masked_fill(~valid, float("-inf")).topk(min(topk, S), dim=-1)
        for r, row in enumerate(rows.tolist()):
            oracle = {s for s in want[r].tolist() if s <= row}
            got = {s for s in idx[row // b_sel].tolist() if 0 <= s <= row}
            hits += len(oracle & got)
            total += len(oracle)
    return hits / max(1, total)


def random_text_ids(count: int, length: int, vocab: int, *, seed: int = 0, generator: Optional[torch.Generator] = None):
    """Text-like token ids (a few frequent tokens, a long tail) for tests and smoke runs without a corpus."""
    g = generator or torch.Generator().manual_seed(seed)
    weights = torch.linspace(1, 0.01, vocab) ** 3
    return [torch.multinomial(weights, length, replacement=True, generator=g) for _ in range(count)]
