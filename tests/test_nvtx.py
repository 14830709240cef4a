"""nvtx_range: balanced push/pop even when the body raises; a no-op when no profiler is attached."""
from __future__ import annotations

import pytest

from magnetar.utils import nvtx


@pytest.fixture
def recorder(monkeypatch):
    events = []
    monkeypatch.setattr(nvtx, "_EMIT", (lambda msg: events.append(("push", msg)), lambda: events.append(("pop",))))
    return events


def test_context_manager_balanced_on_exception(recorder):
    with pytest.raises(KeyError):
        with nvtx.nvtx_range("outer"):
            with nvtx.nvtx_range("inner"):
                raise KeyError("boom")
    assert recorder == [("push", "outer"), ("push", "inner"), ("pop",), ("pop",)]


def test_decorator_returns_and_propagates(recorder):
    @nvtx.nvtx_range("f")
    def f(x):
        if x < 0:
            raise ValueError("negative")
        return 2 * x

    assert f(3) == 6 and f.__name__ == "f"
    with pytest.raises(ValueError):
        f(-1)
    assert recorder == [("push", "f"), ("pop",)] * 2


def test_reentrant_instance(recorder):
    r = nvtx.nvtx_range("r")
    with r:
        with r:
            pass
    assert recorder == [("push", "r"), ("push", "r"), ("pop",), ("pop",)]


def test_disabled_without_profiler(monkeypatch):
    monkeypatch.delenv("NVTX_INJECTION64_PATH", raising=False)
    monkeypatch.delenv("MAGNETAR_NVTX", raising=False)
    assert nvtx.refresh() is False
    with nvtx.nvtx_range("x"):  # must not touch any backend
        pass
    monkeypatch.setenv("MAGNETAR_NVTX", "1")
    assert nvtx.refresh() is True  # the nvtx package is a dependency: ranges can be emitted
    with nvtx.nvtx_range("real nvtx call"):
        pass
    monkeypatch.setenv("MAGNETAR_NVTX", "0")
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/nonexistent")
    assert nvtx.refresh() is False
    monkeypatch.delenv("MAGNETAR_NVTX")
    monkeypatch.delenv("NVTX_INJECTION64_PATH")
    nvtx.refresh()
