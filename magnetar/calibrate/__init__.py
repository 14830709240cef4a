"""Calibration: training the small learned parts of the strategies on a frozen model, offline.

* :mod:`magnetar.calibrate.cli`       -- ``magnetar-calibrate`` (= ``python -m magnetar.calibrate``): the CLI;
* :mod:`magnetar.calibrate.spotlight` -- Spotlight / LSH hash training with the ranking loss (sparse decoding);
* :mod:`magnetar.calibrate.distill`   -- sparse prefill's indexer: teacher rows from a frozen model, KL training
  of one layer, support recall (library level);
* :mod:`magnetar.calibrate.indexer`   -- the indexer calibration driver: streamed, resumable.

The runtime packages (:mod:`magnetar.sparse`, :mod:`magnetar.prefill`) only load the files written here; they
never import this package. Submodules are imported explicitly; this package imports nothing on its own.
"""
