"""The calibrations' settings (:class:`TrainConfig`: Spotlight / LSH hashes; :class:`IndexerTrainConfig`: sparse
prefill's indexer), checked when made. Apart from the training code, which needs torch: ``magnetar-calibrate``'s
flags are made from these fields and answer ``--help`` or a bad value without importing torch."""
from __future__ import annotations

import math
from dataclasses import dataclass

from magnetar.config.registry import check_d_idx


@dataclass(frozen=True)
class TrainConfig:
    kind: str = "mlp"  # mlp (Spotlight) | lsh (linear, trained with the same loss)
    bits: int = 128
    hidden: int = 128
    dense_layers: int = 2
    seq_len: int = 2048
    sequences: int = 48  # training sequences
    held_out: int = 4  # sequences for the IoU measurement
    queries: int = 64  # query positions sampled per sequence (App. A.3: random query selection)
    passes: int = 2  # passes over the training sequences per layer (fresh random subsets each time)
    pruning: float = 0.98  # top-k = (1 - pruning) of the keys (fixed at 98 % in training, Sec. 4)
    max_top: int = 16  # random members of the top-k set per query
    max_oth: int = 256  # random members of the rest per query
    beta: float = 1.0
    alpha: float = 3.0
    gamma: float = 64.0
    lr: float = 1e-3
    min_lr: float = 0.0
    warmup: float = 0.01  # fraction of the steps (Table 7: 81 of 8192)
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.98)
    clip: float = 1.0
    seed: int = 0

    def __post_init__(self):
        def check(name: str, ok, want: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not ok(value):  # a bool is not a count
                raise ValueError(f"spotlight calibration: {name} (--{name.replace('_', '-')}) must be {want}, got "
                                 f"{value!r}")

        def number(v) -> bool:
            return isinstance(v, (int, float)) and math.isfinite(v)

        check("kind", lambda v: v in ("mlp", "lsh"), "mlp or lsh")
        for name, low in (("bits", 32), ("hidden", 1), ("seq_len", 2), ("sequences", 1), ("held_out", 1),
                          ("queries", 1), ("passes", 1), ("max_top", 1), ("max_oth", 1), ("dense_layers", 0),
                          ("seed", 0)):
            check(name, lambda v, low=low: isinstance(v, int) and v >= low, f"an int >= {low}")
        check("bits", lambda v: v % 32 == 0, "a multiple of 32 (codes are packed 32 bits to a word)")
        check("pruning", lambda v: number(v) and 0 < v < 1, "a fraction in (0, 1)")
        check("warmup", lambda v: number(v) and 0 <= v < 1, "a fraction in [0, 1)")
        for name in ("beta", "gamma", "lr", "clip"):
            check(name, lambda v: number(v) and v > 0, "a finite number > 0")
        for name in ("alpha", "min_lr", "weight_decay"):
            check(name, lambda v: number(v) and v >= 0, "a finite number >= 0")
        check("min_lr", lambda v: v <= self.lr, f"at most lr ({self.lr})")


@dataclass(frozen=True)
class IndexerTrainConfig:
    d_idx: int = 128  # index head width: 64 | 128 | 256 (Sec. 6.3)
    seq_len: int = 2048  # tokens per training sequence
    sequences: int = 32  # training sequences
    held_out: int = 4  # sequences for validation KL and recall
    rows: int = 64  # teacher rows (query positions, from the second half) per sequence and layer
    passes: int = 4  # passes over the training sequences per layer (one AdamW step per sequence)
    lr: float = 1e-3
    lr_schedule: str = "cosine"  # constant | cosine (to 0 over the layer's steps)
    weight_decay: float = 0.0
    topk: int = 256  # recall metric: the oracle support size
    b_sel: int = 1  # recall metric: the indexer's selection block (1: per query)
    dense_layers: int = 0  # the first layers are not trained (the engine's prefill_dense_layers must be >= this)
    layers_per_pass: int = 4  # layers collected per pass of the model (memory vs passes; results do not depend on it)
    seed: int = 0

    def __post_init__(self):
        check_d_idx(self.d_idx)
        for name in ("seq_len", "sequences", "held_out", "rows", "passes", "topk", "b_sel", "layers_per_pass"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"indexer calibration: {name} (--{name.replace('_', '-')}) must be an int >= 1, "
                                 f"got {v!r}")
        if self.dense_layers < 0:
            raise ValueError(f"indexer calibration: dense_layers must be >= 0, got {self.dense_layers}")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"indexer calibration: lr_schedule must be constant or cosine, got {self.lr_schedule!r}")
        if self.seq_len < 4:
            raise ValueError(f"indexer calibration: seq_len must be >= 4 tokens, got {self.seq_len}")
