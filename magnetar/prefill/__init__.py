"""Sparse prefill for full/GQA attention layers (``../shared/papers/004``): the attention-mass top-k oracle and
the head-collapsed indexer distilled from it.

* :mod:`magnetar.prefill.schedule` -- the top-k budget schedule and the causal token-pair sparsity (pure Python);
* :mod:`magnetar.prefill.oracle`   -- Algorithm 1 as tensor functions: head-averaged dense attention mass,
  per-query / per-block top-k support, sparse GQA recomputation on the gathered support;
* :mod:`magnetar.prefill.indexer`  -- Algorithm 2's scorer (``HeadCollapsedIndexer``), the KL distillation loss
  and the per-model weight file (``IndexerBank``);
* :mod:`magnetar.prefill.policy`   -- the engine side: which layers are sparse, the budget, the realised sparsity.

Offline tools live above the runtime: the indexer's distillation in :mod:`magnetar.calibrate.distill` and
:mod:`magnetar.calibrate.indexer` (``magnetar-calibrate indexer``), the gap report in
:mod:`magnetar.eval.experiments.prefill_gap`.

Names are resolved lazily so that :mod:`magnetar.config` can use the schedule helpers without importing torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "SENTINEL": "oracle", "head_averaged_probs": "oracle", "head_averaged_topk": "oracle",
    "sparse_gqa_attention": "oracle", "oracle_attention": "oracle", "support_pairs": "oracle",
    "visible_pairs": "oracle",
    "causal_pairs": "schedule", "causal_pair_sparsity": "schedule", "topk_pairs": "schedule",
    "budget_for_length": "schedule",
    "parse_schedule": "schedule", "PAPER_SCHEDULE": "schedule",
    "HeadCollapsedIndexer": "indexer", "IndexerBank": "indexer", "kl_loss": "indexer", "D_IDX_CHOICES": "indexer",
    "block_topk": "oracle",
    "PrefillPolicy": "policy", "PrefillStats": "policy",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'magnetar.prefill' has no attribute {name!r}")
    return getattr(importlib.import_module(f"magnetar.prefill.{module}"), name)
