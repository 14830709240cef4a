"""The CPU decode step's weight layout (magnetar/engine/gemv.py): linear weights with more outputs than inputs
stored (in, out) when a timed pass says so -- the same parameters, shapes and values, ties kept, decided once per
model; nothing below the size where it matters, nothing on another device. Sibling projections (q/k/v, gate/up)
fused into one product each, the same values and tokens."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from magnetar.engine import gemv
from magnetar.ops.small_gemm import small_gemm_unavailable
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


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])  # qwen2: q/k/v with biases; gemma3: q/k norms, windows
def test_fused_sibling_projections_change_no_value(monkeypatch, arch):
    """q/k/v and gate/up fused into one product each (magnetar.engine.gemv.fuse_siblings): the same parameter
    names, shapes and values (views of one buffer), the same logits and greedy tokens as HF's own forward, eager and
    static decode steps alike."""
    import magnetar
    from tests.tiny_models import reference, tiny_model

    monkeypatch.setattr(gemv, "_MIN_BYTES", 0)
    monkeypatch.setattr(gemv, "_GAIN", float("inf"))  # the fused pass always wins
    model = tiny_model(arch, seed=4)
    ctx, q = torch.arange(5, 125) % 256, torch.tensor([9, 8, 7])
    first, want = reference(model, ctx, q, 6)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert "fused" in gemv.fuse_siblings(model, torch.device("cpu"))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn.q_proj, gemv.FusedLinear) and isinstance(mlp.up_proj, nn.Linear)
    storage = attn.q_proj.weight.untyped_storage().data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.v_proj.weight.untyped_storage().data_ptr() == storage
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert after[name].shape == value.shape and torch.equal(after[name], value), name
    for step in ("eager", "static"):
        got = magnetar.init_inference(model, method="dense", decode_step=step, timeout_s=60).generate(
            ctx, q, max_new_tokens=6, return_logits=True)
        assert got.token_ids == want, step
        assert_close(got.first_token_logits, first, what="logits", msg=step)


def test_a_fused_sibling_reads_its_own_input(monkeypatch):
    """The group's product is reused only for the same input, unchanged: another input, or one changed in place
    between two siblings' calls, gets its own product; kept apart when the fused pass is not faster."""
    layers = nn.Module()
    layers.gate_proj, layers.up_proj = nn.Linear(8, 16, bias=False), nn.Linear(8, 16, bias=False)
    ref_gate, ref_up = layers.gate_proj.weight.detach().clone(), layers.up_proj.weight.detach().clone()
    (group,) = gemv._sibling_groups(layers)
    gemv._fuse(group)
    x, other = torch.randn(2, 8), torch.randn(2, 8)
    assert torch.allclose(layers.gate_proj(x), x @ ref_gate.t(), atol=1e-6)
    assert torch.allclose(layers.up_proj(other), other @ ref_up.t(), atol=1e-6)  # not x's product
    layers.gate_proj(x)
    x.mul_(2)  # changed in place between the siblings' calls
    assert torch.allclose(layers.up_proj(x), x @ ref_up.t(), atol=1e-6)
    monkeypatch.setattr(gemv, "_MIN_BYTES", 0)
    monkeypatch.setattr(gemv, "_GAIN", 0.0)  # the fused pass never wins
    kept = nn.Module()
    kept.q_proj, kept.k_proj, kept.v_proj = (nn.Linear(64, 64, bias=False) for _ in range(3))
    assert "kept apart" in gemv.fuse_siblings(kept, torch.device("cpu"))
    assert type(kept.q_proj) is nn.Linear and kept.q_proj.weight.is_contiguous()
    assert gemv.fuse_siblings(kept, torch.device("meta")) is None


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_batched_products_by_onednn_copies_change_no_value(monkeypatch, arch):
    """pack_for_batches: oneDNN copies of the fp32 weights serve the products of 2-64 rows (a batch's decode step,
    a short query); a batch's greedy tokens and first logits are each request's alone (HF's own forward), eager and
    static; one row, a prefill's many rows, or a weight cast since packing take the layer's own path."""
    import magnetar
    from tests.tiny_models import reference, tiny_model

    if not gemv._packable():
        pytest.skip("this torch build has no oneDNN linear ops")
    monkeypatch.setattr(gemv, "_MIN_BYTES", 0)
    monkeypatch.setattr(gemv, "_GAIN", float("inf"))  # the packed pass always wins
    model = tiny_model(arch, seed=5)
    asks = [(torch.arange(5, 125) % 256, torch.tensor([9, 8, 7])), (torch.arange(40, 100) % 256, torch.tensor([4, 2]))]
    want = [reference(model, c, q, 5) for c, q in asks]
    for step in ("eager", "static"):
        eng = magnetar.init_inference(model, method="dense", decode_step=step, timeout_s=60)
        got = eng.ask_batch([eng.encode(c) for c, _ in asks], [q for _, q in asks], max_new_tokens=5,
                            return_logits=True)
        for (first, tokens), r in zip(want, got):
            assert r.token_ids == tokens, step
            assert_close(r.first_token_logits, first, what="logits", msg=step)
    what = model._magnetar_gemv_packed.what  # decided at the first few-row product (the first query forward)
    assert "oneDNN copies" in what and "MiB more" in what, what
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.o_proj, gemv.PackedLinear) and attn.q_proj._magnetar_group._magnetar_packed is not None
    layer, g = attn.o_proj, torch.Generator().manual_seed(0)
    for rows, exact in ((1, True), (2, False), (65, True)):  # one row and a prefill's rows: the layer's own product
        x = torch.randn(rows, layer.in_features, generator=g)
        with torch.inference_mode():
            got, ref = layer(x), F.linear(x, layer.weight, layer.bias)
        assert torch.equal(got, ref) if exact else torch.allclose(got, ref, atol=1e-5), rows
    model.double()  # cast since packing: the copies no longer serve it
    x = torch.randn(3, layer.in_features, dtype=torch.float64, generator=g)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_no_onednn_copies_past_the_memory_share_or_on_other_devices(monkeypatch):
    from tests.tiny_models import tiny_model

    if not gemv._packable():
        pytest.skip("this torch build has no oneDNN linear ops")
    monkeypatch.setattr(gemv, "_MIN_BYTES", 0)
    monkeypatch.setattr(gemv, "free_memory", lambda device: 1024)
    model = tiny_model("llama", seed=5)
    waits = gemv.pack_for_batches(model, torch.device("cpu"))
    assert "decided at the first such product of several requests" in waits  # nothing made until a batch
    what = gemv.pack_for_batches(model, torch.device("cpu"), now=True)
    assert "available memory" in what and all(getattr(m, "_magnetar_packed", None) is None for m in model.modules())
    assert gemv.pack_for_batches(tiny_model("llama", seed=5), torch.device("meta")) is None
    assert gemv.pack_for_batches(model, torch.device("cpu")) == what  # decided once per model
    monkeypatch.setattr(gemv, "free_memory", lambda device: 1 << 40)
    monkeypatch.setattr(gemv, "_GAIN", float("inf"))
    biased = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32, bias=False))  # a bias goes with the packed product
    gemv.pack_for_batches(biased, torch.device("cpu"))
    assert biased[0]._magnetar_packed is None  # deferred: made by the first few-row product of a batch
    with torch.inference_mode():
        biased(torch.randn(1, 5, 64))  # one request's short query: no decision yet
        assert biased[0]._magnetar_batches.pending
    x = torch.randn(4, 1, 64)  # a decode step of four requests
    with torch.inference_mode():
        assert torch.allclose(biased[0](x), F.linear(x, biased[0].weight, biased[0].bias), atol=1e-5)
    assert isinstance(biased[0]._magnetar_packed, gemv._Packed)


def test_bf16_copies_serve_one_request_and_are_made_at_its_first_step(monkeypatch):
    """bf16 weights: the copies serve one row too (torch's own bf16 product of a few rows is slow on the CPU), are
    made at the first few-row product -- one request's decode step -- and give F.linear's values to bf16's rounding;
    a prefill's rows stay the layer's own."""
    if not gemv._packable():
        pytest.skip("this torch build has no oneDNN linear ops")
    monkeypatch.setattr(gemv, "_MIN_BYTES", 0)
    monkeypatch.setattr(gemv, "free_memory", lambda device: 1 << 40)
    monkeypatch.setattr(gemv, "_GAIN", float("inf"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32, bias=False)).to(torch.bfloat16)
    waits = gemv.pack_for_batches(model, torch.device("cpu"))
    assert "products of 1-64 rows" in waits and "several requests" not in waits, waits
    layer = model[0]
    with torch.inference_mode():
        prefill = torch.randn(1, 80, 64, dtype=torch.bfloat16)  # 80 rows: not a few-row product, decides nothing
        assert torch.equal(layer(prefill), F.linear(prefill, layer.weight, layer.bias))
        assert layer._magnetar_batches.pending
        x = torch.randn(1, 1, 64, dtype=torch.bfloat16)  # one request's decode step
        got = layer(x)
    assert isinstance(layer._magnetar_packed, gemv._Packed) and "at 1 and 8 rows" in model._magnetar_gemv_packed.what
    assert got.dtype == torch.bfloat16
    assert_close(got, F.linear(x.double(), layer.weight.double(), layer.bias.double()), torch.bfloat16)
    with torch.inference_mode():
        x32 = torch.randn(1, 1, 64)  # another dtype than the copy's: the layer's own product
        assert layer._magnetar_packed.applies(x, layer.weight) and not layer._magnetar_packed.applies(x32, layer.weight)


@pytest.mark.parametrize("faster", ["_Packed", "_SmallPacked"])
def test_bf16_copies_of_the_kind_the_timed_pass_finds_faster(monkeypatch, faster):
    """bf16 weights on an AVX-512 BF16 CPU: oneDNN's copies and the small GEMM op's are both timed over the same
    products, the faster kind is made for every layer and named in the log's line, and its products are F.linear's
    to bf16's rounding. Elsewhere only oneDNN's are timed."""
    if not gemv._packable():
        pytest.skip("this torch build has no oneDNN linear ops")
    monkeypatch.setattr(gemv, "_MIN_BYTES", 0)
    monkeypatch.setattr(gemv, "free_memory", lambda device: 1 << 40)
    timed = []

    def seconds(targets, packed, rows):  # the kind named by `faster` takes 1 s, the other 2, no copy 3
        kind = None if packed is None else type(packed[0]).__name__
        timed.append(kind)
        return 3.0 if kind is None else (1.0 if kind == faster else 2.0)

    monkeypatch.setattr(gemv, "_batch_seconds", seconds)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 40, bias=False)).to(torch.bfloat16)
    gemv.pack_for_batches(model, torch.device("cpu"))
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = model(x)
    runs = small_gemm_unavailable() is None
    assert timed == ([None, "_Packed", "_SmallPacked"] if runs else [None, "_Packed"])
    kind = getattr(gemv, faster) if runs else gemv._Packed
    assert all(type(m._magnetar_packed) is kind for m in model), [type(m._magnetar_packed) for m in model]
    assert f"by {kind.KIND} copies" in model._magnetar_gemv_packed.what
    h = F.linear(x.double(), model[0].weight.double(), model[0].bias.double()).to(torch.bfloat16)
    assert_close(got, F.linear(h.double(), model[1].weight.double()), torch.bfloat16)
