"""Evaluation: long-context task generators (offline, seeded), their scorers and runners.

Submodules are imported explicitly (``from magnetar.eval.babilong import babilong_sample``); this package
imports nothing on its own, so that loading one task never needs another task's corpus.
"""
