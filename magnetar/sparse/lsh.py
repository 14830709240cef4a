"""``lsh``: angular LSH codes of queries and keys (random SO(d) rotations, Spotlight paper App. A.8), Hamming
similarity summed over the query group; by default with 4 sink tokens and a 64-token local window, as MagicPIG runs.
:class:`HashSelector` is the selection every hashing policy shares (``spotlight`` trains the hash functions)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from magnetar.config import SparseConfig
from magnetar.engine.kv import LayerKV
from magnetar.sparse.codes import HAMMING_OP, hamming_scores, hamming_topk, topk_scores_torch
from magnetar.sparse.hashing import load_or_make_hashes
from magnetar.sparse.select import SparseSelector


@dataclass
class KeyCodes:
    """The packed hash codes of a shard's keys, ``(Hkv, N, W)`` int32 (one layer's policy state)."""

    codes: torch.Tensor


class HashSelector(SparseSelector):
    """Keys chosen by the Hamming similarity of their codes to the queries' (``kind``: the hash functions of
    :func:`magnetar.sparse.hashing.load_or_make_hashes`)."""

    kind: str  # "lsh" | "mlp": LshSelector's, SpotlightSelector's
    hash_backend = "auto"  # the Hamming op: auto (the JIT op where it builds) | torch

    def __init__(self, cfg: SparseConfig, model_config):
        super().__init__(cfg, model_config)
        self.hashes = load_or_make_hashes(self.kind, model_config, path=cfg.hash_path, bits=cfg.code_bits,
                                          seed=cfg.hash_seed)

    def prepare(self, device: torch.device) -> None:
        """Build or load the Hamming op now (at engine start), so the first build never happens inside a step while
        the other ranks wait in a collective with a timeout."""
        if self.hash_backend != "torch":
            HAMMING_OP.available(device)

    def shard_heads(self, first: int, count: int, total: int) -> None:
        """Tensor parallelism: the hash functions (one per KV head) narrowed to this rank's heads."""
        self.hashes.keep_heads(first, count, total)

    def select(self, layer: int, q: torch.Tensor, kv: LayerKV, take: int, forced: Optional[torch.Tensor],
               scale: float) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        Hkv, D = kv.k.shape[1], kv.k.shape[3]
        S = q.shape[2]
        cached = kv.state.get(self.uid, KeyCodes)
        if cached is None:
            cached = kv.state.put(self.uid, KeyCodes(self.hashes.codes(layer, kv.k[0], backend=self.hash_backend)))
        qc = self.hashes.codes(layer, q[0].reshape(Hkv, -1, S, D).transpose(1, 2), backend=self.hash_backend)
        if forced is None:  # the fused op: scores and top-k in one pass
            return hamming_topk(qc, cached.codes, take, backend=self.hash_backend)[1], None
        scores = hamming_scores(qc, cached.codes, backend=self.hash_backend)
        scores = scores.masked_fill(forced, int(scores.max()) + 1 if scores.numel() else 1)
        return topk_scores_torch(scores, take)[1], None


class LshSelector(HashSelector):
    kind = "lsh"
