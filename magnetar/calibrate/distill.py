"""Distilling the head-collapsed indexer from the oracle (paper Sec. 6.2, Algorithm 2 step 1) -- library level.

1. **Collect** (:func:`collect_teacher`): each sequence runs once through the frozen model with ordinary dense
   causal attention; for every requested global layer we keep the attention's input hidden states
   ``x (S, hidden)`` and, for ``rows`` sampled query positions, the oracle's teacher rows
   ``P (rows, S)`` = head-averaged dense attention (:func:`~magnetar.prefill.oracle.head_averaged_probs`, from
   the lse the attention returned). Teacher rows come from the dense trajectory.
2. **Train** (:func:`distill_layer`): only the layer's indexer, AdamW on ``KL(P || softmax(z))`` over the valid
   causal keys (:func:`~magnetar.prefill.indexer.kl_loss`); the backbone is never touched.
3. **Measure** (:func:`support_recall`): how much of the oracle's top-k support the indexer's top-k recovers.

:mod:`magnetar.calibrate.indexer` drives these over a corpus, a few layers at a time (``magnetar-calibrate indexer``).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from magnetar.engine.strategy import LayerContext
from magnetar.ops import attention_with_lse
from magnetar.prefill.indexer import HeadCollapsedIndexer, kl_loss
from magnetar.prefill.oracle import head_averaged_probs


class _Stop(Exception):
    """Raised after the last requested layer: the rest of the forward is not needed."""


class _Capture(LayerContext):
    """A layer context of its own (magnetar.engine.strategy.LayerContext): dense causal attention; records x and
    the teacher rows."""

    name = "capture"

    def __init__(self, layers: Sequence[int], rows: torch.Tensor, x_dtype: torch.dtype = torch.float32):
        self.layers, self.rows, self.x_dtype = set(layers), rows, x_dtype
        self.last = max(self.layers)
        self.x: dict[int, torch.Tensor] = {}
        self.P: dict[int, torch.Tensor] = {}
        self._hidden: dict[int, torch.Tensor] = {}

    def attend(self, layer, q, k, v, scale, window=None):
        out, lse = attention_with_lse(q, k, v, scale=scale, window=window)
        hidden = self._hidden.pop(layer, None)
        if layer in self.layers and window is None:
            self.x[layer] = hidden[0].detach().to("cpu", self.x_dtype)
            self.P[layer] = head_averaged_probs(q, k, scale=scale, rows=self.rows.to(q.device), lse=lse)[0].cpu()
        if layer >= self.last:
            raise _Stop
        return out


@torch.no_grad()
def collect_teacher(model, sequences: Sequence[torch.Tensor], layers: Sequence[int], *, rows: int = 64,
                    seed: int = 0, x_dtype: torch.dtype = torch.float32,
                    row_index: Optional[Sequence[torch.Tensor]] = None, progress=None) -> list[dict]:
    """Per sequence ``{"x": {layer: (S, hidden)}, "P": {layer: (R, S)}, "rows": (R,)}`` on the CPU (``x`` in
    ``x_dtype``, e.g. float16 to halve the memory; ``P`` float32).

    ``rows`` query positions per sequence are drawn uniformly from the second half of the sequence (they see
    enough keys for top-k to matter); the same rows serve every layer, and a sequence's rows depend only on
    ``seed`` and its place in ``sequences`` (not on ``layers``). Sliding-window layers are not recorded. The
    forward stops after the last requested layer. ``row_index``: the rows of each sequence, given (then ``rows``
    and ``seed`` are unused). ``progress``: wraps the sequence iterator (e.g. tqdm).
    """
    from magnetar.engine.hf import prepare_model

    prepare_model(model)
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    out = []

    def hook(module, args, kwargs):
        cap = kwargs.get("magnetar")
        if isinstance(cap, _Capture) and module.layer_idx in cap.layers:
            cap._hidden[module.layer_idx] = kwargs.get("hidden_states", args[0] if args else None)

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules()
               if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]
    try:
        for i, ids in enumerate(progress(sequences) if progress else sequences):
            S = ids.numel()
            if row_index is not None:
                r = row_index[i].long().cpu()
            else:
                lo = S // 2
                r = (torch.randperm(S - lo, generator=g)[:rows] + lo).sort().values
            cap = _Capture(layers, r, x_dtype)
            try:
                model(input_ids=ids[None].to(device), position_ids=torch.arange(S, device=device)[None],
                      use_cache=False, magnetar=cap)
            except _Stop:
                pass
            out.append({"x": cap.x, "P": cap.P, "rows": r})
    finally:
        for h in handles:
            h.remove()
    return out


def _item(item: dict, layer: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x (1, S, hidden)``, ``P (R, S)``, ``rows (R,)``, ``valid (R, S)`` of one sequence, on ``device``."""
    x = item["x"][layer].to(device)
    P, rows = item["P"][layer].to(device), item["rows"].to(device)
    valid = torch.arange(x.shape[0], device=device)[None, :] <= rows[:, None]
    return x[None], P, rows, valid


def distill_layer(indexer: HeadCollapsedIndexer, data: Sequence[dict], layer: int, *, passes: int = 4,
                  lr: float = 1e-3, weight_decay: float = 0.0, seed: int = 0, lr_schedule: str = "constant",
                  callback=None) -> list[float]:
    """Train ``indexer`` (one layer's) in place on the collected ``data``; returns the KL loss per step.

    One step per sequence (all its rows), ``passes`` shuffled passes, AdamW at ``lr`` -- constant, or with
    ``lr_schedule="cosine"`` decayed to 0 over the steps. Tensors move to the indexer's device step by step.
    ``callback(step, total)`` is called after each step (progress bars)."""
    if lr_schedule not in ("constant", "cosine"):
        raise ValueError(f"lr_schedule must be 'constant' or 'cosine', got {lr_schedule!r}")
    torch.manual_seed(seed)
    params = list(indexer.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    g = torch.Generator().manual_seed(seed)
    device = indexer.wq.device
    order = [i for _ in range(passes) for i in torch.randperm(len(data), generator=g).tolist()]
    losses = []
    indexer.train()
    for step, i in enumerate(order):
        if lr_schedule == "cosine":
            for group in opt.param_groups:
                group["lr"] = 0.5 * lr * (1 + math.cos(math.pi * step / len(order)))
        x, P, rows, valid = _item(data[i], layer, device)
        z = indexer.scores(x, torch.arange(x.shape[1], device=device), rows=rows)[0]  # (R, S)
        loss = kl_loss(P, z, valid)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if callback is not None:
            callback(step + 1, len(order))
    indexer.eval()
    for p in params:
        p.requires_grad_(False)
    return losses


@torch.no_grad()
def validation_kl(indexer: HeadCollapsedIndexer, data: Sequence[dict], layer: int) -> float:
    """Mean over every sampled row of ``data`` of ``KL(P || softmax(z))`` (nats), as the training loss."""
    total, count = 0.0, 0
    for item in data:
        x, P, rows, valid = _item(item, layer, indexer.wq.device)
        z = indexer.scores(x, torch.arange(x.shape[1], device=x.device), rows=rows)[0]
        n = int(valid.any(-1).sum())
        if n:
            total += float(kl_loss(P, z, valid)) * n
            count += n
    return total / max(1, count)


@torch.no_grad()
def support_recall(indexer: HeadCollapsedIndexer, data: Sequence[dict], layer: int, topk: int,
                   b_sel: int = 1) -> float:
    """Mean over the sampled rows of ``|S_indexer ∩ S_oracle| / |S_oracle|``: ``S_oracle`` the row's per-query
    oracle support (top-k of its P over the visible keys), ``S_indexer`` the indexer's support for the row's
    selection block (per query for ``b_sel = 1``)."""
    hits, total = 0, 0
    for item in data:
        x, P, rows, valid = _item(item, layer, indexer.wq.device)
        S = x.shape[1]
        idx = indexer.select(x, torch.arange(S, device=x.device), topk=topk, b_sel=b_sel)[0].cpu()  # (M, k)
        _, want = P.masked_fill(~valid, float("-inf")).topk(min(topk, S), dim=-1)
        want = want.cpu()
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
