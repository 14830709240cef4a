"""The CPU decode step's weight layout (magnetar/engine/gemv.py): linear weights with more outputs than inputs
stored (in, out) when a timed pass says so -- the same parameters, shapes and values, ties kept, decided once per
model; nothing below the size where it matters, nothing on another device."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from magnetar.engine import gemv
from tests.conftest import assert_close


class Head(nn.Module):
    """An embedding tied to a wide output layer (32 MiB: over gemv's threshold), and a narrow layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32768, 256)
        self.narrow = nn.Linear(256, 64)
        self.head = nn.Linear(256, 32768, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(h), self.narrow(h)


@pytest.mark.parametrize("gain,transposed", [(float("inf"), True), (0.0, False)])
def test_the_layout_is_the_measured_one_and_changes_no_value(monkeypatch, gain, transposed):
    monkeypatch.setattr(gemv, "_GAIN", gain)  # inf: the transposed pass always wins; 0: never
    model = Head()
    ids = torch.tensor([[3, 30000, 7]])
    want = [t.clone() for t in model(ids)]
    what = gemv.relayout_for_decode(model, torch.device("cpu"))
    assert ("stored (in, out)" in what) == transposed, what
    w = model.head.weight
    assert w is model.embed.weight and tuple(w.shape) == (32768, 256), "the tie and the shape are kept"
    assert w.stride() == ((1, 32768) if transposed else (256, 1))
    assert model.narrow.weight.is_contiguous(), "fewer outputs than inputs: never transposed"
    for got, ref in zip(model(ids), want):
        assert_close(got, ref, what="logits")
    assert gemv.relayout_for_decode(model, torch.device("cpu")) == what, "decided once per model"


def test_small_models_and_other_devices_are_left_alone():
    small = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))
    assert gemv.relayout_for_decode(small, torch.device("cpu")) is None
    assert all(p.is_contiguous() for p in small.parameters())
    model = Head()
    assert gemv.relayout_for_decode(model, torch.device("meta")) is None
    assert model.head.weight.is_contiguous()
