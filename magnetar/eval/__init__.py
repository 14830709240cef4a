"""Evaluation: long-context task generators (offline, seeded), their scorers and runners.

* :mod:`magnetar.eval.suite`   -- one :class:`~magnetar.eval.suite.EvalSample`, the ``Suite`` protocol and the lazy
  name -> suite registry; the suites: :mod:`~magnetar.eval.ruler`, :mod:`~magnetar.eval.niah`,
  :mod:`~magnetar.eval.babilong`, :mod:`~magnetar.eval.wikisalad`, :mod:`~magnetar.eval.ppl`;
* :mod:`magnetar.eval.runner`  -- ``magnetar-eval``: suites x methods x lengths, resumable; :mod:`~magnetar.eval.report`
  its tables and plots (and :func:`~magnetar.eval.report.load`, the results reader);
* :mod:`magnetar.eval.cost`    -- the analytic cost model; :mod:`~magnetar.eval.bench` ``magnetar-bench``;
  :mod:`~magnetar.eval.common` the helpers their CLIs share;
* :mod:`magnetar.eval.experiments` -- the strategies' experiment CLIs (sparse decoding, LuKA, sparse prefill).

Submodules are imported explicitly (``from magnetar.eval.babilong import babilong_sample``); this package
imports nothing on its own, so that loading one task never needs another task's corpus.
"""
