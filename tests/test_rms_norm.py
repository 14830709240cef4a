"""The one-pass RMSNorm op (magnetar/ops/csrc/rms_norm.cpp) and its swap into a model (magnetar.engine.norms): the
fp64 formula to the dtype's rounding across widths with and without a vector tail and row counts across the parallel
chunks; Hugging Face's LlamaRMSNorm bit for bit in bf16; NaN and inf where HF has them; a norm of another formula, or
under autograd, keeps its own forward; a tiny Llama's logits unchanged by the swap."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from magnetar.engine.norms import fuse_norms
from magnetar.ops.rms_norm import RMS_NORM_OP, rms_norm, rms_norm_unavailable
from tests.conftest import assert_close, load_benchmark

BF16 = torch.bfloat16


def test_the_op_builds_here():
    assert rms_norm_unavailable() is None, rms_norm_unavailable()  # a build failure fails here


def _fp64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The formula in fp64 with HF's rounding of the normalized row to x's dtype before the weight's product."""
    x64 = x.double()
    n = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).double()
    return w.double() * n


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("H", [576, 64 + 16 + 3, 5])  # 32-wide body, a 16-wide step and a tail, a tail alone
@pytest.mark.parametrize("rows", [1, 3, 130])  # 130 rows of 576: three parallel chunks
def test_the_op_is_the_fp64_formula(dtype, H, rows):
    g = torch.Generator().manual_seed(H + rows)
    x = (4 * torch.randn(2, rows, H, generator=g)).to(dtype)[:, :, :]
    w = torch.randn(H, generator=g).to(dtype)
    y = rms_norm(x, w, 1e-5)
    assert y.shape == x.shape and y.dtype == dtype
    assert_close(y, _fp64(x, w, 1e-5), dtype, msg=f"rms_norm H={H} rows={rows}")


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_the_scalar_loop_is_the_fp64_formula_too(dtype):
    """The loop a CPU without AVX-512 runs, called here whatever this CPU has; eps counts on a row of small values.
    (Its one float32 sum adds in another order than HF's: a bf16 element may round the other way, not bit for bit.)"""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 83, generator=g)
    x[1] *= 1e-3  # mean(x^2) ~1e-6 against eps 1e-5: a formula without eps is off by ~3x
    x, w = x.to(dtype), torch.randn(83, generator=g).to(dtype)
    y = RMS_NORM_OP.load("cpu").rms_norm_scalar(x, w, 1e-5)
    assert_close(y, _fp64(x, w, 1e-5), dtype, msg="the scalar loop")
    assert_close(rms_norm(x, w, 1e-5), _fp64(x, w, 1e-5), dtype, msg="the op on this CPU")


@pytest.mark.parametrize("rows", [1, 8, 1000])
def test_the_op_is_hugging_faces_norm_bit_for_bit_in_bf16(rows):
    g = torch.Generator().manual_seed(rows)
    norm = LlamaRMSNorm(576, eps=1e-5).to(BF16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=g))
        x = (3 * torch.randn(1, rows, 576, generator=g)).to(BF16)
        own = norm(x)
    assert torch.equal(rms_norm(x, norm.weight, 1e-5), own)
    fp32 = norm.float()
    with torch.no_grad():
        assert_close(rms_norm(x.float(), fp32.weight, 1e-5), fp32(x.float()), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_nan_and_inf_stay_where_hugging_face_has_them(dtype):
    norm = LlamaRMSNorm(48, eps=1e-6).to(dtype)
    x = torch.randn(4, 48).to(dtype)
    x[1, 7] = float("nan")
    x[2, 3] = float("inf")
    with torch.no_grad():
        own = norm(x)
    y = rms_norm(x, norm.weight, 1e-6)
    assert torch.equal(torch.isnan(y), torch.isnan(own)) and torch.equal(torch.isinf(y), torch.isinf(own))
    assert torch.isnan(y[1]).all() and not torch.isfinite(y[2]).all()  # never made finite
    assert torch.isfinite(y[[0, 3]]).all()


def test_what_the_op_refuses_is_named():
    w = torch.ones(8)
    with pytest.raises(ValueError, match="both float32 or both bfloat16"):
        rms_norm(torch.ones(2, 8), w.to(BF16), 1e-5)
    with pytest.raises(ValueError, match="both float32 or both bfloat16"):
        rms_norm(torch.ones(2, 8, dtype=torch.float16), w.half(), 1e-5)
    with pytest.raises(ValueError, match=r"weight must be \(H\)"):
        rms_norm(torch.ones(2, 6), w, 1e-5)


class _GemmaLike(nn.Module):
    """A norm of another formula with the attributes of a Llama one: ``x * (1 + weight)``."""

    def __init__(self, h):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.randn(h)), 1e-6

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
                * (1 + self.weight.float())).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_a_tiny_llamas_norms_are_swapped_and_its_logits_stay(dtype):
    from tests.tiny_models import tiny_model

    model = tiny_model("llama").to(dtype).eval()
    model.model.extra = _GemmaLike(model.config.hidden_size).to(dtype)  # not called by the forward; a candidate
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    what = fuse_norms(model, torch.device("cpu"))
    norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
    assert norms and all(type(m).__name__ == "FusedLlamaRMSNorm" for m in norms)
    assert type(model.model.extra) is _GemmaLike  # its own values differ: kept
    assert what == f"{len(norms)} of {len(norms) + 1} RMSNorm modules computed by Magnetar's one-pass op"
    with torch.no_grad():
        after = model(ids).logits
    if dtype == BF16:
        assert torch.equal(after, before)
    else:
        assert_close(after, before, what="logits")
    again = fuse_norms(model, torch.device("cpu"))  # a second call: the swapped ones are not candidates again
    assert again == "0 of 1 RMSNorm modules computed by Magnetar's one-pass op", again
    # under autograd (training, a gradient check) the class's own forward runs: a graph to differentiate
    x = torch.randn(2, model.config.hidden_size, dtype=dtype, requires_grad=True)
    assert norms[0](x).grad_fn is not None


def test_the_op_is_called_by_a_swapped_norm(monkeypatch):
    """The swapped forward reaches the op (a stand-in module that counts its calls), not the class's own ops."""
    norm = LlamaRMSNorm(32).eval()
    fuse_norms(nn.Sequential(norm), torch.device("cpu"))
    calls = []
    real = RMS_NORM_OP.load("cpu")

    class Counting:
        def rms_norm(self, *a):
            calls.append(a[0].shape)
            return real.rms_norm(*a)

    monkeypatch.setattr(RMS_NORM_OP, "load", lambda device: Counting())
    with torch.no_grad():
        norm(torch.randn(3, 5, 32))
    assert calls == [torch.Size([15, 32])]


def test_bench_norm_times_the_three_and_counts_what_differs(capsys):
    summary = load_benchmark("bench_norm").main(["--width", "40", "--rows", "1", "3", "--warmup", "0",
                                                 "--repeats", "2"])
    rows = {(r["dtype"], r["rows"], r["impl"]): r for r in summary["rows"]}
    assert set(rows) == {(d, n, i) for d in ("bfloat16", "float32") for n in (1, 3)
                         for i in ("hf", "torch_fused", "magnetar")}
    assert all(r["us"] > 0 and r["elements"] == 40 * r["rows"] for r in rows.values())
    assert all(rows[(d, n, "hf")]["differ_from_hf"] == 0 and rows[(d, n, "hf")]["x_hf"] == 1.0
               for d in ("bfloat16", "float32") for n in (1, 3))
    assert rows[("bfloat16", 3, "magnetar")]["differ_from_hf"] == 0  # bit for bit in bf16
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1]) == summary and "| bfloat16 | 3 | magnetar |" in "\n".join(out)
    with pytest.raises(SystemExit):
        load_benchmark("bench_norm").main(["--rows", "0"])
    assert "--width and --rows must be positive" in capsys.readouterr().err
