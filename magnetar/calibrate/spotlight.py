"""Training the Spotlight hash (Spotlight Attention, Sec. 3.3, App. A.1 and A.3) on a frozen model.

1. **Collect** post-RoPE queries and keys from real text: each sequence runs once through the model with a
   capturing attention (ordinary causal attention that also records, for every layer from ``dense_layers``
   on, all keys and the queries at ``queries`` random positions; fp16 to save memory).
2. **Train** each layer's hash functions (one per KV head, stacked) independently -- layer-wise, as the paper
   does with precomputed hidden states -- with the Bradley-Terry ranking loss (Eq. 7):
   for each sampled query the true top-k set (the ``1 - pruning`` best keys by q.k, over the sequence with
   the causal mask, App. A.3) and the rest; ``max_top`` / ``max_oth`` random members of each; draft scores
   from soft-sign codes (Eq. 8, ``gamma``); ``L = mean BCE(beta (B_i - C_j) - alpha, 1)`` over the visible
   pairs. AdamW with linear warm-up and cosine decay to 0, gradient clipping (Table 7, scaled to our data).
3. **Measure** retrieval IoU with the oracle selection on held-out sequences, before and after (Table 1).

Resumable: the collected tensors are cached next to the output (shared by every hash trained on them), and the hash
file is rewritten after every layer with the list of trained layers; a rerun with the same options goes on from the
next layer.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from magnetar.calibrate.configs import TrainConfig
from magnetar.engine.strategy import LayerContext
from magnetar.sparse.hashing import HashBank, model_signature, softsign


# -- ranking loss ------------------------------------------------------------------------------------------
def ranking_loss(draft: torch.Tensor, true: torch.Tensor, visible: torch.Tensor, top_count: int,
                 top_idx: Optional[torch.Tensor] = None, oth_idx: Optional[torch.Tensor] = None, *,
                 beta: float = 1.0, alpha: float = 3.0) -> torch.Tensor:
    """Eq. 7 over rows ``(..., N)``: ``draft`` scores from the hash, ``true`` attention logits, ``visible`` the
    causal mask (True = the key is visible to the row's query). The top set is the ``top_count`` best keys by
    ``true`` (invisible keys rank last); ``top_idx`` / ``oth_idx`` (positions into the sorted top / rest
    lists, shared by all rows) subsample them. Pairs touching an invisible key are left out; the loss is
    the mean of ``-log sigmoid(beta (B_i - C_j) - alpha)`` over the remaining pairs."""
    masked = true.masked_fill(~visible, torch.finfo(true.dtype).min)
    order = masked.argsort(dim=-1, descending=True)
    top, oth = order[..., :top_count], order[..., top_count:]
    if top_idx is not None:
        top = top[..., top_idx]
    if oth_idx is not None:
        oth = oth[..., oth_idx]
    b, c = draft.gather(-1, top), draft.gather(-1, oth)
    ok = visible.gather(-1, top)[..., :, None] & visible.gather(-1, oth)[..., None, :]
    logits = beta * (b[..., :, None] - c[..., None, :]) - alpha
    return F.binary_cross_entropy_with_logits(logits[ok], torch.ones_like(logits[ok]))


# -- collection --------------------------------------------------------------------------------------------
class _Capture(LayerContext):
    """A layer context of its own (magnetar.engine.strategy.LayerContext): causal attention; records q (sampled
    rows) and k."""

    name = "capture"

    def __init__(self, first_layer: int, q_rows: torch.Tensor):
        self.first_layer, self.q_rows = first_layer, q_rows
        self.q: dict[int, torch.Tensor] = {}
        self.k: dict[int, torch.Tensor] = {}

    def attend(self, layer, q, k, v, scale, window=None):
        from magnetar.ops import attention_with_lse

        if layer >= self.first_layer and window is None:
            self.q[layer] = q[0][:, self.q_rows].to(torch.float16)  # (Hq, nq, D)
            self.k[layer] = k[0].to(torch.float16)  # (Hkv, S, D)
        return attention_with_lse(q, k, v, scale=scale, window=window)[0]


def text_sequences(tokenizer, texts: list[str], seq_len: int, count: int) -> list[torch.Tensor]:
    """Consecutive ``seq_len``-token pieces of the concatenated texts (plain text, no template)."""
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        if len(ids) >= seq_len * count:
            break
    n = min(count, len(ids) // seq_len)
    if n < count:
        raise ValueError(f"the corpus holds {len(ids)} tokens: {n} sequences of {seq_len}, but {count} were asked "
                         f"for; lower --sequences/--held-out or --seq-len")
    return [torch.tensor(ids[i * seq_len:(i + 1) * seq_len]) for i in range(n)]


@torch.no_grad()
def collect(model, sequences: list[torch.Tensor], cfg: TrainConfig, *, progress: bool = True) -> list[dict]:
    """Per sequence: ``{"q": {layer: (Hq, nq, D)}, "k": {layer: (Hkv, S, D)}, "q_pos": (nq,)}`` (fp16)."""
    from magnetar.engine.hf import prepare_model

    prepare_model(model)
    out = []
    rng = torch.Generator().manual_seed(cfg.seed)
    it = sequences
    if progress:
        from tqdm import tqdm

        it = tqdm(sequences, desc="collect q/k", unit="seq", dynamic_ncols=True)
    for ids in it:
        S = ids.numel()
        lo = max(1, S // 8)  # queries late enough to see a few hundred keys
        rows = torch.randperm(S - lo, generator=rng)[: cfg.queries].sort().values + lo
        cap = _Capture(cfg.dense_layers, rows)
        model(input_ids=ids[None], position_ids=torch.arange(S)[None], use_cache=False, magnetar=cap)
        out.append({"q": cap.q, "k": cap.k, "q_pos": rows})
    return out


# -- training ----------------------------------------------------------------------------------------------
def _layer_params(bank: HashBank, layer: int) -> list[torch.nn.Parameter]:
    names = ("R",) if bank.kind == "lsh" else ("W1", "b1", "W2")
    return [torch.nn.Parameter(getattr(bank, n).data[layer].clone()) for n in names]


def _project(bank: HashBank, params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Like HashBank.project, with one layer's (trainable) parameters; ``x (H, n, D)``."""
    if bank.kind == "lsh":
        return torch.bmm(x, params[0])
    w1, b1, w2 = params
    return torch.bmm(F.silu(torch.baddbmm(b1[:, None, :], x, w1)), w2)


def _step_loss(bank, params, item, layer, cfg: TrainConfig, rng: random.Random) -> torch.Tensor:
    q, k, q_pos = item["q"][layer].float(), item["k"][layer].float(), item["q_pos"]
    Hq, nq, D = q.shape
    Hkv, S, _ = k.shape
    G = Hq // Hkv
    qg = q.reshape(Hkv, G * nq, D)
    true = torch.bmm(qg, k.transpose(1, 2))  # (Hkv, G*nq, S); the scale does not change the ranking
    visible = (torch.arange(S)[None, :] <= q_pos[:, None]).repeat(G, 1)[None].expand(Hkv, -1, -1)
    cq = softsign(_project(bank, params, qg), cfg.gamma)
    ck = softsign(_project(bank, params, k), cfg.gamma)
    draft = torch.bmm(cq, ck.transpose(1, 2))  # soft agreement score, the differentiable Hamming similarity
    top_count = max(1, int(S * (1 - cfg.pruning)))
    top_idx = torch.tensor(rng.sample(range(top_count), min(cfg.max_top, top_count)))
    oth_idx = torch.tensor(rng.sample(range(S - top_count), min(cfg.max_oth, S - top_count)))
    return ranking_loss(draft, true, visible, top_count, top_idx, oth_idx, beta=cfg.beta, alpha=cfg.alpha)


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    warm = max(1, int(round(total * cfg.warmup)))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * t))


def train_layer(bank: HashBank, layer: int, data: list[dict], cfg: TrainConfig) -> list[float]:
    """Train ``bank``'s functions of one layer in place; returns the loss per step."""
    torch.manual_seed(cfg.seed * 1009 + layer)
    rng = random.Random(cfg.seed * 1009 + layer)
    params = _layer_params(bank, layer)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    order = [i for _ in range(cfg.passes) for i in rng.sample(range(len(data)), len(data))]
    losses = []
    for step, i in enumerate(order):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, len(order), cfg)
        loss = _step_loss(bank, params, data[i], layer, cfg, rng)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        opt.step()
        losses.append(loss.item())
    names = ("R",) if bank.kind == "lsh" else ("W1", "b1", "W2")
    with torch.no_grad():
        for n, p in zip(names, params):
            getattr(bank, n).data[layer].copy_(p.data)
    return losses


# -- IoU ---------------------------------------------------------------------------------------------------
@torch.no_grad()
def retrieval_iou(bank: HashBank, data: list[dict], layers: list[int], pruning: float = 0.98) -> dict[int, float]:
    """Mean IoU per layer between the oracle selection (top ``1 - pruning`` of each query's visible keys by the
    group's attention mass) and the hash selection (the same count by Hamming similarity summed over the
    group) -- the selections the decoder makes. Table 1 reports the mean over layers and heads."""
    from magnetar.sparse.codes import hamming_scores, topk_scores_torch

    out = {}
    for layer in layers:
        ious = []
        for item in data:
            q, k, q_pos = item["q"][layer].float(), item["k"][layer].float(), item["q_pos"]
            Hq, nq, D = q.shape
            Hkv, S, _ = k.shape
            G = Hq // Hkv
            qg = q.reshape(Hkv, G, nq, D)
            scale = 1.0 / math.sqrt(D)
            codes_k = bank.codes(layer, k)
            codes_q = bank.codes(layer, qg.transpose(1, 2))  # (Hkv, nq, G, W)
            ham = hamming_scores(codes_q, codes_k)  # (Hkv, nq, S)
            for i in range(nq):
                n = int(q_pos[i]) + 1
                kk = max(1, math.ceil(n * (1 - pruning)))
                mass = torch.softmax(torch.einsum("hgd,hnd->hgn", qg[:, :, i], k[:, :n]) * scale, -1).sum(1)
                oracle = mass.topk(kk, dim=-1).indices
                mine = topk_scores_torch(ham[:, i, :n], kk)[1]
                for h in range(Hkv):
                    a, b = set(oracle[h].tolist()), set(mine[h].tolist())
                    ious.append(len(a & b) / len(a | b))
        out[layer] = sum(ious) / len(ious)
    return out


# -- driver ------------------------------------------------------------------------------------------------
def calibrate(model, tokenizer, texts: list[str], out: str | Path, cfg: TrainConfig, *, progress: bool = True,
              log=print) -> HashBank:
    """Collect, train every layer (resuming a partial ``out``), measure IoU; returns the trained bank."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)  # before the collection, which is saved beside it
    sig = model_signature(model.config)
    layers = list(range(cfg.dense_layers, sig["num_hidden_layers"]))
    if not layers:
        raise ValueError(f"dense_layers={cfg.dense_layers} leaves no layer to train (the model has "
                         f"{sig['num_hidden_layers']})")
    key = {k: v for k, v in asdict(cfg).items() if k in ("seq_len", "sequences", "held_out", "queries", "dense_layers",
                                                          "seed")}
    corpus = hashlib.sha1()
    for t in texts:
        corpus.update(t.encode())
    key["corpus"] = corpus.hexdigest()[:16]
    # one collection serves every hash trained on it (mlp and lsh): named by the model, the text and the sampling
    tag = hashlib.sha1(json.dumps([key, sig], sort_keys=True).encode()).hexdigest()[:10]
    cache = out.parent / f"qk-cache-{sig['name_or_path'] or sig['model_type']}-{tag}.pt"
    data = None
    if cache.is_file():
        blob = torch.load(cache, weights_only=True)
        if blob.get("key") == key and blob.get("signature") == sig:
            data = blob["data"]
            log(f"using the collected queries/keys in {cache}")
    if data is None:
        seqs = text_sequences(tokenizer, texts, cfg.seq_len, cfg.sequences + cfg.held_out)
        data = collect(model, seqs, cfg, progress=progress)
        tmp = cache.with_suffix(".pt.tmp")
        torch.save({"key": key, "signature": sig, "data": data}, tmp)
        tmp.replace(cache)  # never a half-written cache
    train, held = data[: cfg.sequences], data[cfg.sequences:]

    bank = None
    if out.is_file():
        prev = HashBank.load(out, model.config)
        if prev.meta.get("train_config") == asdict(cfg):
            bank = prev
            log(f"resuming {out}: layers {prev.trained_layers} already trained")
    if bank is None:
        bank = HashBank(cfg.kind, sig, bits=cfg.bits, hidden=cfg.hidden, seed=cfg.seed)
        bank.meta = {"train_config": asdict(cfg), "iou_before": retrieval_iou(bank, held, layers, cfg.pruning),
                     "losses": {}}
    todo = [layer for layer in layers if layer not in bank.trained_layers]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(layers), initial=len(layers) - len(todo), desc=f"train {cfg.kind} hash", unit="layer",
                   dynamic_ncols=True)
    for layer in todo:
        t0 = time.perf_counter()
        losses = train_layer(bank, layer, train, cfg)
        bank.trained_layers.append(layer)
        bank.meta["losses"][layer] = (losses[0], sum(losses[-8:]) / len(losses[-8:]), time.perf_counter() - t0)
        bank.save(out)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[0]:.3f}->{bank.meta['losses'][layer][1]:.3f}")
    if bar is not None:
        bar.close()
    if "iou_after" not in bank.meta:
        bank.meta["iou_after"] = retrieval_iou(bank, held, layers, cfg.pruning)
        bank.save(out)
    return bank
