"""The engine side of sparse prefill: which layers are sparse, the budget of a request, the realised sparsity.

:class:`PrefillPolicy` is built once per engine from :class:`magnetar.config.PrefillConfig` (loading the indexer
weights, if any); :meth:`PrefillPolicy.start` opens one request's Phase 1 on this rank (its budget from the
context length) and the returned :class:`PrefillRun` is what a local Phase-1 method (dense, Star, Pulsar) calls
for every patched layer -- a global (non sliding-window) layer from
``prefill_dense_layers`` on. The layer's output is the sparse one: later layers, and later oracle choices, see
the sparse trajectory (Algorithm 1, step 6). The KV stored for decoding is the layer's ordinary K/V.

Realised sparsity is counted exactly, per patched (segment, layer) call: the (query, key) pairs the sparse
attention used (support entries visible to the query) against the pairs dense causal attention would have
used. For one segment attending to itself with ``b_sel = 1`` this is the paper's ``k S - k (k - 1) / 2`` over
``S (S + 1) / 2``; Star/Pulsar segments and ``b_sel > 1`` differ from that formula, which is why it is counted.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch

from magnetar.engine.strategy import PrefillPolicyBase
from magnetar.ops import attention_with_lse
from magnetar.prefill.oracle import (SPARSE_ATTENTION_OP, head_averaged_topk, sparse_gqa_attention, support_pairs,
                                     visible_pairs)
from magnetar.prefill.schedule import causal_pair_sparsity
from magnetar.utils.timing import no_timer


_COUNTS = ("patched_calls", "sparse_calls", "kept_pairs", "causal_pairs", "empty_rows")


@dataclass
class PrefillStats:
    """What sparse prefill did for one request (summed over its segments, patched layers and CP ranks)."""

    policy: str
    topk: int  # keys per query (block) for this request
    b_sel: int
    context_tokens: int
    patched_calls: int = 0  # (segment, layer) attention calls under the policy
    sparse_calls: int = 0  # of those, calls with fewer than all keys (topk < keys of the segment)
    kept_pairs: int = 0  # visible (query, key) pairs the patched calls used
    causal_pairs: int = 0  # visible pairs dense attention would have used in the same calls
    empty_rows: int = 0  # queries that saw none of their support (possible with b_sel > 1): output 0

    @property
    def sparsity(self) -> float:
        """Realised causal token-pair sparsity of the patched layers (0 when nothing was patched)."""
        return 1.0 - self.kept_pairs / self.causal_pairs if self.causal_pairs else 0.0

    @property
    def formula_sparsity(self) -> float:
        """The paper's accounting for one ``context_tokens`` sequence at ``topk`` (Sec. 5.1)."""
        return causal_pair_sparsity(self.context_tokens, self.topk) if self.context_tokens else 0.0

    def merge(self, other: "PrefillStats") -> "PrefillStats":
        """Sum of two ranks' (or segments') counts of the same request."""
        return self.with_counts([a + b for a, b in zip(self.counts(), other.counts())])

    def counts(self) -> list[int]:
        """The counts that add up over segments and ranks (what the ranks gather)."""
        return [getattr(self, f) for f in _COUNTS]

    def with_counts(self, counts) -> "PrefillStats":
        """This request's stats with ``counts`` (another rank's, or a sum) in place of its own."""
        return replace(self, **{f: int(c) for f, c in zip(_COUNTS, counts, strict=True)})

    def as_dict(self) -> dict:
        return dict(asdict(self), sparsity=self.sparsity, formula_sparsity=self.formula_sparsity)


def patched_layers(cfg, model_config) -> list[int]:
    """The layers sparse prefill patches: global (no sliding window) layers from ``prefill_dense_layers`` on."""
    from magnetar.models.dims import ModelDims

    windows = ModelDims.from_config(model_config).windows
    return [i for i, w in enumerate(windows) if w is None and i >= cfg.prefill_dense_layers]


def load_or_make_indexers(cfg, model_config):
    """The :class:`~magnetar.prefill.indexer.IndexerBank` ``cfg`` asks for (checked against the model).

    A file from an unfinished calibration (some layers trained, not every patched one) is refused: the
    missing layers would rank keys with their random init while the run is labelled distilled."""
    from magnetar.prefill.indexer import IndexerBank

    if cfg.prefill_indexer_path:
        bank = IndexerBank.load(cfg.prefill_indexer_path, model_config, d_idx=cfg.prefill_d_idx or None)
        if bank.trained_layers:
            missing = [i for i in patched_layers(cfg, model_config) if i not in bank.trained_layers]
            if missing:
                raise ValueError(
                    f"indexer weights {cfg.prefill_indexer_path} (prefill_indexer_path) are distilled for layers "
                    f"{sorted(bank.trained_layers)} but sparse prefill patches layers {missing} too, which would "
                    f"use random weights; finish the calibration (rerun the same magnetar-calibrate indexer command: "
                    f"it resumes) or raise prefill_dense_layers (--prefill-dense-layers)")
        return bank
    return IndexerBank.random(model_config, cfg.prefill_d_idx or 128, seed=cfg.prefill_seed)


class PrefillPolicy(PrefillPolicyBase):
    """Sparse prefill for one engine (a :class:`magnetar.engine.strategy.PrefillPolicy`; see the module
    docstring): both ``oracle`` and ``indexer`` are registered to it, the indexer weights are what differs."""

    @classmethod
    def label(cls, cfg) -> str:
        """``prefill_oracle(top-k 256, b_sel 64)``: the policy and the options a result depends on."""
        parts = [f"top-k {cfg.prefill_topk}" if cfg.prefill_topk else f"schedule {cfg.prefill_schedule}"]
        if cfg.prefill_b_sel != 1:
            parts.append(f"b_sel {cfg.prefill_b_sel}")
        if cfg.prefill_dense_layers:
            parts.append(f"dense layers {cfg.prefill_dense_layers}")
        if cfg.prefill_policy == "indexer":
            parts.append(f"d_idx {cfg.prefill_d_idx}" if cfg.prefill_d_idx else "")
            parts.append("random init" if cfg.prefill_indexer_random_init else "distilled")
        return f"prefill_{cfg.prefill_policy}({', '.join(x for x in parts if x)})"

    def __init__(self, cfg, model_config):
        super().__init__(cfg, model_config)
        self.indexers = load_or_make_indexers(cfg, model_config) if cfg.prefill_policy == "indexer" else None
        # a section timer (magnetar.utils.timing.SectionTimer) for the TTFT benchmark's profile of the patched layers:
        # projection (indexer), score_topk, sparse_attention, dense_attention (budget >= keys), accounting
        self.timer = None

    def prepare(self, device: torch.device) -> None:
        """Build or load the sparse-prefill op now (at engine start), not inside the first request's Phase 1
        while the other ranks wait in a collective with a timeout."""
        SPARSE_ATTENTION_OP.available(device)

    def shard_heads(self, first: int, count: int, total: int) -> None:
        """Tensor parallelism: this rank sees ``count`` of ``total`` KV heads. The indexer scores the (whole,
        replicated) hidden states, so its choice is the same on every rank; the oracle averages the attention
        of ALL query heads, which no rank holds, so it is refused."""
        if self.cfg.prefill_policy == "oracle":
            raise ValueError(
                f"prefill_policy 'oracle' averages the attention of every query head, but with tensor parallelism "
                f"each rank holds {count} of {total} KV heads' queries: use prefill_policy indexer "
                f"(--prefill-policy indexer) or tp_size 1")

    @property
    def needs_hidden(self) -> bool:
        """The indexer scores the attention's input hidden states, which the attention function is not given."""
        return self.indexers is not None

    def applies(self, layer: int, window: Optional[int]) -> bool:
        """Patched? Global layers from ``prefill_dense_layers`` on; sliding-window (local) layers stay dense."""
        return layer >= self.cfg.prefill_dense_layers and window is None

    def start(self, context_tokens: int) -> "PrefillRun":
        return PrefillRun(self, self.cfg.budget(context_tokens), context_tokens)


class PrefillRun:
    """One request's Phase 1 on this rank: the budget and the running :class:`PrefillStats`."""

    def __init__(self, policy: PrefillPolicy, topk: int, context_tokens: int):
        self.policy, self.topk = policy, topk
        cfg = policy.cfg
        self.stats = PrefillStats(policy=cfg.prefill_policy, topk=topk, b_sel=cfg.prefill_b_sel,
                                  context_tokens=context_tokens)
        self._causal: tuple[Optional[torch.Tensor], int] = (None, 0)  # (positions, their visible pairs)

    @property
    def needs_hidden(self) -> bool:
        return self.policy.needs_hidden

    def applies(self, layer: int, window: Optional[int]) -> bool:
        return self.policy.applies(layer, window)

    def _visible_pairs(self, pos: torch.Tensor) -> int:
        if self._causal[0] is not pos:  # one count per forward: every layer gets the same positions tensor
            self._causal = (pos, visible_pairs(pos, pos))
        return self._causal[1]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
               pos: torch.Tensor, hidden: Optional[torch.Tensor] = None, backend: str = "auto"
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The patched layer's ``(out, lse)`` over ``[segment]`` causally by ``pos (S,)``; ``hidden (1, S,
        hidden)`` the attention's input (indexer only)."""
        cfg, st = self.policy.cfg, self.stats
        b_sel, N = cfg.prefill_b_sel, k.shape[2]
        timer = self.policy.timer or no_timer
        with timer("accounting"):
            causal = self._visible_pairs(pos)
        st.patched_calls += 1
        st.causal_pairs += causal
        if self.topk >= N:  # the support is every key: dense attention, exactly
            st.kept_pairs += causal
            with timer("dense_attention"):
                return attention_with_lse(q, k, v, q_pos=pos, k_pos=pos, scale=scale, backend=backend)
        if self.policy.indexers is not None:
            if hidden is None:
                raise RuntimeError(f"layer {layer}: the indexer needs the attention's input hidden states; "
                                   "call magnetar.engine.hf.capture_attention_inputs(model) once")
            ix = self.policy.indexers[layer]
            if ix.wq.device != hidden.device:
                self.policy.indexers.to(hidden.device)
            extra = {"timer": self.policy.timer} if self.policy.timer is not None else {}
            idx = ix.select(hidden, pos, topk=self.topk, b_sel=b_sel, **extra)  # projection, score_topk
        else:
            with timer("score_topk"):
                idx = head_averaged_topk(q, k, topk=self.topk, b_sel=b_sel, scale=scale, q_pos=pos, k_pos=pos)
        with timer("sparse_attention"):
            out, lse = sparse_gqa_attention(q, k, v, idx, scale=scale, q_pos=pos, k_pos=pos, b_sel=b_sel)
        st.sparse_calls += 1
        with timer("accounting"):
            st.kept_pairs += support_pairs(idx, pos, pos, b_sel=b_sel)
            st.empty_rows += int(torch.isneginf(lse[:, 0]).sum())
        return out, lse
