"""Distilling the head-collapsed indexer on a frozen model (paper Sec. 6.2, Algorithm 2 step 1): the driver of
``magnetar-calibrate indexer``.

For every global attention layer from ``dense_layers`` on (sliding-window layers are never patched), one
:class:`~magnetar.prefill.indexer.HeadCollapsedIndexer` is trained against the oracle's head-averaged dense
attention ``P`` with ``KL(P || softmax(z))`` over the causally valid keys; the backbone is frozen and only
sees ``torch.no_grad`` forwards.

**Streaming.** Teacher rows are never held for all layers at once. Layers are processed ``layers_per_pass``
at a time: one pass of the frozen model over the training and held-out sequences (stopped after the group's
last layer) records, per sequence, the group's attention inputs ``x (S, hidden)`` in float16 and ``rows``
teacher rows ``P (rows, S)`` float32 (:func:`~magnetar.calibrate.distill.collect_teacher`); the group's layers
are trained and measured; the group's data is dropped. Memory: ``(sequences + held_out) x layers_per_pass x
(S x hidden x 2 + rows x S x 4)`` bytes. With ``cache_dir`` the model runs ONCE over every sequence instead
and each (layer, sequence) is written to its own file there (fp16 ``x``); a layer then loads only its own
files (``(sequences + held_out) x (S x hidden x 2 + rows x S x 4)`` bytes in memory; every layer's on disk).
Both give the same data: a sequence's rows depend only on the seed and its index.

**Metrics** (held-out sequences, per layer, before = the random init training starts from, after = trained):
validation KL (nats, the training loss on held-out rows) and the recall of the oracle's per-query top-k
support (:func:`~magnetar.calibrate.distill.support_recall` at ``topk`` / ``b_sel``). Stored in the file's
``meta`` (``kl_before``, ``kl_after``, ``recall_before``, ``recall_after``, ``losses``).

**Resumable.** The weight file is rewritten after every layer with the list of trained layers; a rerun with
the same options and data goes on from the next untrained layer (a partly trained file is refused by the
engine, see :func:`magnetar.prefill.policy.load_or_make_indexers`). Other options or data start over.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Sequence

import torch

from magnetar.calibrate.configs import IndexerTrainConfig
from magnetar.calibrate.distill import collect_teacher, distill_layer, support_recall, validation_kl
from magnetar.prefill.indexer import IndexerBank, rope_theta
from magnetar.sparse.hashing import model_signature

METRICS = ("kl_before", "kl_after", "recall_before", "recall_after")



def trainable_layers(model_config, dense_layers: int) -> list[int]:
    """Global (not sliding-window) layers from ``dense_layers`` on: the layers sparse prefill patches."""
    from magnetar.models.dims import ModelDims

    windows = ModelDims.from_config(model_config).windows
    return [i for i, w in enumerate(windows) if w is None and i >= dense_layers]


def sample_rows(lengths: Sequence[int], rows: int, seed: int) -> list[torch.Tensor]:
    """``rows`` sorted query positions per sequence, uniform over its second half; sequence ``i``'s depend only
    on ``seed`` and ``i``."""
    out = []
    for i, S in enumerate(lengths):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        lo = S // 2
        out.append((torch.randperm(S - lo, generator=g)[:rows] + lo).sort().values)
    return out


def data_hash(sequences: Sequence[torch.Tensor]) -> str:
    h = hashlib.sha1()
    for ids in sequences:
        h.update(ids.to(torch.int64).cpu().numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


def _train_key(cfg: IndexerTrainConfig, sig: dict, digest: str) -> dict:
    d = asdict(cfg)
    d.pop("layers_per_pass")  # how the data is streamed, not what is trained
    return {"config": d, "data": digest, "model": {k: v for k, v in sig.items() if k != "name_or_path"}}


class _DiskCache:
    """Per-(layer, sequence) teacher data under ``root``: ``L{layer}-S{i}.pt``; ``S{i}.done`` once a sequence's
    layers are all written (an interrupted collection redoes only the unfinished sequences)."""

    def __init__(self, root: Path, layers: list[int], rows: list[torch.Tensor]):
        self.root, self.layers, self.rows = root, layers, rows
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, layer: int, i: int) -> Path:
        return self.root / f"L{layer:03d}-S{i:05d}.pt"

    def fill(self, model, sequences, progress: bool, log) -> None:
        todo = [i for i in range(len(sequences)) if not (self.root / f"S{i:05d}.done").is_file()]
        if not todo:
            log(f"using the collected teacher data in {self.root}")
            return
        bar = _bar(progress, total=len(todo), desc="collect all layers (disk cache)", unit="seq")
        for i in todo:
            item = collect_teacher(model, [sequences[i]], self.layers, x_dtype=torch.float16,
                                   row_index=[self.rows[i]])[0]
            for layer in self.layers:
                torch.save({"x": item["x"][layer], "P": item["P"][layer]}, self._path(layer, i))
            (self.root / f"S{i:05d}.done").write_text("ok\n")
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()

    def layer(self, layer: int, n: int) -> list[dict]:
        out = []
        for i in range(n):
            d = torch.load(self._path(layer, i), weights_only=True)
            out.append({"x": {layer: d["x"]}, "P": {layer: d["P"]}, "rows": self.rows[i]})
        return out


def _bar(progress: bool, **kw):
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(dynamic_ncols=True, leave=False, **kw) if kw.get("unit") == "seq" else tqdm(dynamic_ncols=True, **kw)


def calibrate_indexer(model, sequences: Sequence[torch.Tensor], out: str | Path, cfg: IndexerTrainConfig, *,
                      cache_dir: Optional[str | Path] = None, progress: bool = True, log=print) -> IndexerBank:
    """Train (resuming a partial ``out``) and measure every trainable layer's indexer; returns the bank.

    ``sequences``: at least ``cfg.sequences + cfg.held_out`` token-id tensors; the first ``cfg.sequences`` train,
    the next ``cfg.held_out`` are held out. See the module docstring for streaming, metrics and resuming.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sig = model_signature(model.config)
    layers = trainable_layers(model.config, cfg.dense_layers)
    if not layers:
        raise ValueError(f"indexer calibration: dense_layers={cfg.dense_layers} leaves no global attention layer to "
                         f"train (the model has {sig['num_hidden_layers']} layers)")
    n = cfg.sequences + cfg.held_out
    if len(sequences) < n:
        raise ValueError(f"indexer calibration: {len(sequences)} sequences given, {cfg.sequences} training + "
                         f"{cfg.held_out} held-out needed")
    sequences = [s.reshape(-1).long().cpu() for s in sequences[:n]]
    digest = data_hash(sequences)
    key = _train_key(cfg, sig, digest)
    rows = sample_rows([s.numel() for s in sequences], cfg.rows, cfg.seed)
    if cfg.topk >= min(s.numel() for s in sequences) // 2:
        log(f"note: topk {cfg.topk} >= half the sequence length: rows see at most that many keys, so the recall is "
            f"(nearly) 1 whatever the indexer; lower --topk or raise --seq-len")

    bank = None
    if out.is_file():
        prev = IndexerBank.load(out, model.config)
        if prev.meta.get("train_key") == key:
            bank = prev
            log(f"resuming {out}: layers {prev.trained_layers} already trained")
        else:
            log(f"{out} was trained with other options or data: starting over (it is overwritten)")
    if bank is None:
        bank = IndexerBank(sig, cfg.d_idx, theta=rope_theta(model.config), seed=cfg.seed).eval().requires_grad_(False)
        bank.meta = {"train_config": asdict(cfg), "train_key": key, "layers": layers,
                     "metrics_note": f"held-out: {cfg.held_out} sequences x {cfg.rows} rows of {cfg.seq_len} tokens; "
                                     f"KL(P || softmax(z)) in nats; recall of the oracle per-query top-{cfg.topk} "
                                     f"by the indexer's top-{cfg.topk} (b_sel {cfg.b_sel}); before = random init",
                     **{m: {} for m in METRICS}, "losses": {}}
    device = next(model.parameters()).device
    todo = [layer for layer in layers if layer not in bank.trained_layers]
    cache = None
    if cache_dir is not None and todo:
        tag = hashlib.sha1(json.dumps([key, layers], sort_keys=True).encode()).hexdigest()[:10]
        cache = _DiskCache(Path(cache_dir) / f"indexer-teacher-{sig['name_or_path'] or sig['model_type']}-{tag}",
                           layers, rows)
        cache.fill(model, sequences, progress, log)
    bar = _bar(progress, total=len(layers), initial=len(layers) - len(todo), desc=f"distil indexer d_idx {cfg.d_idx}",
               unit="layer")
    for g0 in range(0, len(todo), cfg.layers_per_pass):
        group = todo[g0:g0 + cfg.layers_per_pass]
        if cache is None:
            it = None
            if progress:
                from tqdm import tqdm

                it = lambda seqs: tqdm(seqs, desc=f"collect layers {group[0]}-{group[-1]}", unit="seq",  # noqa: E731
                                       leave=False, dynamic_ncols=True)
            data = collect_teacher(model, sequences, group, x_dtype=torch.float16, row_index=rows, progress=it)
        for layer in group:
            if cache is not None:
                data = cache.layer(layer, n)
            train, held = data[:cfg.sequences], data[cfg.sequences:]
            ix = bank[layer].to(device)
            t0 = time.perf_counter()
            kl0, rc0 = validation_kl(ix, held, layer), support_recall(ix, held, layer, cfg.topk, cfg.b_sel)

            shown = [time.perf_counter()]

            def tick(step, total, layer=layer):  # at most one redraw a second (log files stay readable)
                if bar is not None and time.perf_counter() - shown[0] > 1.0:
                    bar.set_postfix_str(f"layer {layer} step {step}/{total}")
                    shown[0] = time.perf_counter()

            losses = distill_layer(ix, train, layer, passes=cfg.passes, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                   seed=cfg.seed * 1009 + layer, lr_schedule=cfg.lr_schedule, callback=tick)
            kl1, rc1 = validation_kl(ix, held, layer), support_recall(ix, held, layer, cfg.topk, cfg.b_sel)
            bank[layer].to("cpu")
            for m, v in zip(METRICS, (kl0, kl1, rc0, rc1)):
                bank.meta[m][layer] = v
            tail = losses[-max(1, len(train)):]
            bank.meta["losses"][layer] = (losses[0], sum(tail) / len(tail), time.perf_counter() - t0)
            bank.trained_layers.append(layer)
            bank.save(out)
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"layer {layer}: KL {kl0:.3f}->{kl1:.3f}, recall {rc0:.3f}->{rc1:.3f}")
        data = None  # this group's teacher data is dropped before the next group is collected
    if bar is not None:
        bar.close()
    return bank


def metrics_table(bank: IndexerBank) -> tuple[str, dict]:
    """The per-layer markdown table of a calibrated bank's stored metrics and their means (for the CLI)."""
    meta = bank.meta
    cfg = meta.get("train_config", {})
    layers = sorted(meta.get("kl_after", {}))
    lines = [f"indexer distillation (d_idx {bank.d_idx}): {meta.get('metrics_note', '')}",
             f"| layer | val. KL before | val. KL after | recall@{cfg.get('topk')} before | "
             f"recall@{cfg.get('topk')} after |", "|---|---:|---:|---:|---:|"]
    for layer in layers:
        lines.append(f"| {layer} | " + " | ".join(f"{meta[m][layer]:.4f}" if m.startswith("kl") else
                                                   f"{meta[m][layer]:.3f}" for m in METRICS) + " |")
    means = {m: (sum(meta[m][layer] for layer in layers) / len(layers) if layers else float("nan")) for m in METRICS}
    lines.append("| **mean** | " + " | ".join(f"**{means[m]:.4f}**" if m.startswith("kl") else f"**{means[m]:.3f}**"
                                              for m in METRICS) + " |")
    return "\n".join(lines), means
