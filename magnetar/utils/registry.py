"""Lazy registries' one loader: a class named ``"package.module:Class"``, imported on first use.

The strategy registry (:mod:`magnetar.engine.strategy`) and the evaluation suites (:mod:`magnetar.eval.suite`)
name their implementations this way so that the code holding the table imports none of them.
"""
from __future__ import annotations

import importlib
from functools import cache


@cache
def load_class(spec: str) -> type:
    """The class named by ``spec`` = ``"module:Class"`` (imported once); a malformed spec names itself."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"a registry entry is 'package.module:Class', got {spec!r}")
    return getattr(importlib.import_module(module), name)
