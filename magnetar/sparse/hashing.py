"""Hash functions for KV retrieval, one per layer and KV head (Spotlight Attention, Eq. 4-6 and App. A.8).

* ``lsh``: angular LSH ``H(x) = sign(x R)`` with ``R (D, bits)`` built from random rotations: QR of a standard
  normal ``D x D`` matrix, the first column's sign flipped when ``det(Q) < 0`` so that ``Q`` is in SO(D)
  (App. A.8); ``bits > D`` stacks ``ceil(bits / D)`` independent rotations side by side.
* ``mlp`` (Spotlight): ``H(x) = sign(W2 SiLU(W1 x + b1))``, ``W1 (hidden, D)``, ``W2 (bits, hidden)``, Gaussian
  initialisation (``b1 = 0``), trained with the ranking loss (:mod:`magnetar.calibrate.spotlight`).

The same function hashes a KV head's keys and the queries of every query head in its group (so their codes
are comparable). A :class:`HashBank` holds the functions of all layers as stacked tensors, saves them with a
signature of the model they were made for, and refuses to load them for another model.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from magnetar.sparse.codes import pack_bits
from magnetar.utils.weights import WeightsFile, model_signature

KINDS = ("lsh", "mlp")
HASH_FILE = WeightsFile(format="magnetar-hash-v1", what="hash weights", option="hash_path",
                        remake="make them for this model with `magnetar-calibrate spotlight --out {path}`",
                        fields={"kind": str, "bits": int, "hidden": int, "trained_layers": list, "meta": dict},
                        defaults={"trained_layers": [], "meta": {}})


def so_rotation(d: int, generator: torch.Generator) -> torch.Tensor:
    """A random rotation in SO(d): QR of a standard normal matrix, first column negated if det(Q) < 0."""
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
    if torch.linalg.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q.float()


def softsign(x: torch.Tensor, gamma: float) -> torch.Tensor:
    """Eq. 8: ``gamma x / (1 + gamma |x|)``, the differentiable stand-in for sign during training."""
    return gamma * x / (1 + gamma * x.abs())


class HashBank(torch.nn.Module):
    """Hash functions for ``layers`` layers x ``heads`` KV heads, inputs of ``head_dim``, ``bits``-bit codes."""

    def __init__(self, kind: str, signature: dict, *, bits: int = 128, hidden: int = 128, seed: int = 0):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"unknown hash kind {kind!r}; choose one of {KINDS}")
        if bits <= 0 or bits % 32:
            raise ValueError(f"code_bits must be a positive multiple of 32 (codes are packed 32 bits to a word), "
                             f"got {bits}")
        self.kind, self.signature, self.bits, self.hidden = kind, dict(signature), bits, hidden
        L, H, D = signature["num_hidden_layers"], signature["num_key_value_heads"], signature["head_dim"]
        g = torch.Generator().manual_seed(seed)
        if kind == "lsh":
            reps = math.ceil(bits / D)
            r = torch.stack([torch.stack([torch.cat([so_rotation(D, g) for _ in range(reps)], dim=1)[:, :bits]
                                          for _ in range(H)]) for _ in range(L)])
            self.R = torch.nn.Parameter(r)  # (L, H, D, bits)
        else:
            self.W1 = torch.nn.Parameter(torch.randn(L, H, D, hidden, generator=g) / math.sqrt(D))
            self.b1 = torch.nn.Parameter(torch.zeros(L, H, hidden))
            self.W2 = torch.nn.Parameter(torch.randn(L, H, hidden, bits, generator=g) / math.sqrt(hidden))
        self.trained_layers: list[int] = []
        self.meta: dict = {}

    def keep_heads(self, first: int, count: int, total: int) -> None:
        """Keep the hash functions of KV heads ``[first, first + count)`` only (a tensor-parallel rank's heads);
        ``total`` is checked against the bank's heads. The signature still names the whole model."""
        heads = self.signature["num_key_value_heads"]
        if total != heads or not 0 <= first < first + count <= heads:
            raise ValueError(f"hash bank of {heads} KV heads: cannot keep heads [{first}, {first + count}) of {total}")
        for name, param in list(self.named_parameters()):
            setattr(self, name, torch.nn.Parameter(param.detach()[:, first:first + count].clone(),
                                                   requires_grad=param.requires_grad))

    @property
    def words(self) -> int:
        return self.bits // 32

    def project(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Real-valued pre-sign output for ``x (H, ..., D)`` (KV head first) -> ``(H, ..., bits)``."""
        H = x.shape[0]
        flat = x.reshape(H, -1, x.shape[-1]).to(self._dtype())
        if self.kind == "lsh":
            out = torch.bmm(flat, self.R[layer])
        else:
            h = F.silu(torch.baddbmm(self.b1[layer][:, None, :], flat, self.W1[layer]))
            out = torch.bmm(h, self.W2[layer])
        return out.reshape(*x.shape[:-1], self.bits)

    def codes(self, layer: int, x: torch.Tensor, backend: str = "auto") -> torch.Tensor:
        """Packed codes of ``x (H, ..., D)``: ``int32 (H, ..., bits / 32)``; bit = 1 where the projection is > 0."""
        with torch.no_grad():
            return pack_bits(self.project(layer, x) > 0, backend=backend)

    def _dtype(self) -> torch.dtype:
        return (self.R if self.kind == "lsh" else self.W1).dtype

    # -- files ------------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        HASH_FILE.save(path, {"kind": self.kind, "signature": self.signature, "bits": self.bits, "hidden": self.hidden,
                              "trained_layers": self.trained_layers, "meta": self.meta}, self.state_dict())

    def initial(self) -> "HashBank":
        """This bank as it was before training: the same kind, sizes and seed (from the training config in
        ``meta``), untrained -- Table 1's "before" column, usable by the engine like any hash file."""
        cfg = self.meta.get("train_config")
        if not cfg:
            raise ValueError("this hash bank has no training config in its metadata (was it trained by "
                             "`magnetar-calibrate spotlight`?)")
        bank = HashBank(self.kind, self.signature, bits=self.bits, hidden=self.hidden, seed=cfg["seed"])
        bank.meta = {"train_config": dict(cfg), "untrained": True, "iou_before": self.meta.get("iou_before")}
        return bank.eval().requires_grad_(False)

    @classmethod
    def load(cls, path: str | Path, config=None) -> "HashBank":
        """Load hash weights (:data:`HASH_FILE`, never running code from the file); with a model ``config``
        check they were made for this model."""
        bank, data = HASH_FILE.load(path, lambda d: cls(d["kind"], d["signature"], bits=d["bits"], hidden=d["hidden"]),
                                    config)
        bank.trained_layers = list(data["trained_layers"])
        bank.meta = dict(data["meta"])
        return bank.eval().requires_grad_(False)


def load_or_make_hashes(kind: str, config, *, path: Optional[str], bits: int, seed: int) -> HashBank:
    """``path`` given: load (checked against ``config``); else a fresh bank (LSH: random rotations)."""
    if path:
        bank = HashBank.load(path, config)
        if bank.kind != kind:
            raise ValueError(f"{path} holds {bank.kind!r} hashes, but the policy needs {kind!r}")
        if bank.bits != bits:
            raise ValueError(f"{path} holds {bank.bits}-bit codes but code_bits is {bits}; set --code-bits {bank.bits}")
        return bank
    return HashBank(kind, model_signature(config), bits=bits, seed=seed).eval().requires_grad_(False)
