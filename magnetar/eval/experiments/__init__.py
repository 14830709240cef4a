"""Experiment CLIs of the strategies, built on the evaluation harness (each resumable, each writing a report):

* :mod:`magnetar.eval.experiments.sparse_ppl`  -- perplexity of sparse decoding policies x pruning rates
  (``python -m magnetar.eval.experiments.sparse_ppl``);
* :mod:`magnetar.eval.experiments.luka_ppl`    -- the LuKA paper's perplexity figures
  (``python -m magnetar.eval.experiments.luka_ppl``);
* :mod:`magnetar.eval.experiments.prefill_gap` -- the sparse-prefill oracle / realization / indexer gap report
  over ``magnetar-eval`` runs (``python -m magnetar.eval.experiments.prefill_gap``).

They read their results with :func:`magnetar.eval.report.load`. The runtime strategy packages
(:mod:`magnetar.sparse`, :mod:`magnetar.luka`, :mod:`magnetar.prefill`) never import them.
"""
