"""The small bf16 GEMM op (magnetar/ops/csrc/small_gemm.cpp) behind a bf16 decode step's linear products on AVX-512
BF16 CPUs: the fp64 product of the same bf16 inputs to bf16's rounding over row counts across its 8-row tiles, output
counts across its 32-wide blocks, biases and strided inputs; NaN kept; what it refuses, named. Where the CPU lacks
AVX-512 BF16 the op still builds (a build failure fails here) and says so; the product tests then skip."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from magnetar.ops.small_gemm import SMALL_GEMM_OP, SmallGemm, small_gemm_unavailable
from tests.conftest import assert_close

BF16 = torch.bfloat16


def _runs_here() -> bool:
    assert SMALL_GEMM_OP.available("cpu"), SMALL_GEMM_OP.unavailable_reason("cpu")  # it builds on every CPU
    return SMALL_GEMM_OP.load("cpu").supported()


needs_avx512_bf16 = pytest.mark.skipif("not _runs_here()", reason="this CPU lacks AVX-512 BF16")


def test_the_op_builds_and_says_whether_this_cpu_runs_it():
    runs = _runs_here()
    flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    assert runs == ("avx512_bf16" in flags and "avx512bw" in flags and "avx512f" in flags)
    assert (small_gemm_unavailable() is None) == runs


@needs_avx512_bf16
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 13, 64])
@pytest.mark.parametrize("n,k", [(96, 64), (100, 576), (31, 2), (33, 1536)])
@pytest.mark.parametrize("biased", [False, True])
def test_products_equal_the_fp64_product(rows, n, k, biased):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g).to(BF16)
    x = torch.randn(rows, k, generator=g).to(BF16)
    bias = torch.randn(n, generator=g).to(BF16) if biased else None
    got = SmallGemm(w)(x, bias)
    assert got.dtype == BF16 and got.shape == (rows, n)
    want = x.double() @ w.double().T + (bias.double() if biased else 0)
    assert_close(got, want, BF16)
    assert_close(got, F.linear(x, w, bias).double(), BF16)  # torch's own bf16 product, to bf16's rounding


@needs_avx512_bf16
def test_views_in_and_out():
    """A transposed weight view is packed as its values; inputs with leading dims and a row stride over K."""
    g = torch.Generator().manual_seed(1)
    w_in_out = torch.randn(64, 160, generator=g).to(BF16)  # (in, out) storage, the weight seen as its .T
    x = torch.randn(2, 3, 96, generator=g).to(BF16)[..., :64]  # rows 96 apart
    got = SmallGemm(w_in_out.T)(x)
    assert got.shape == (2, 3, 160)
    assert_close(got, x.double() @ w_in_out.double(), BF16)


@needs_avx512_bf16
def test_nan_and_inf_are_not_made_finite():
    w = torch.ones(40, 8, dtype=BF16)
    w[3, 5] = float("inf")
    x = torch.ones(3, 8, dtype=BF16)
    x[1, 2] = float("nan")
    y = SmallGemm(w)(x)
    assert torch.isnan(y[1]).all()  # a NaN input reaches every output of its row
    assert torch.isinf(y[0, 3]) and torch.isinf(y[2, 3])  # an infinite weight: its output
    assert torch.isfinite(y[0, torch.arange(40) != 3]).all()


def test_what_it_refuses_is_named():
    with pytest.raises(ValueError, match="bfloat16"):
        SmallGemm(torch.randn(8, 8))
    with pytest.raises(ValueError, match="input size must be even"):
        SmallGemm(torch.randn(8, 7).to(BF16))
    if not _runs_here():
        with pytest.raises(ValueError, match="AVX-512 BF16"):
            SmallGemm(torch.randn(8, 8).to(BF16))
        return
    g = SmallGemm(torch.randn(8, 8).to(BF16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        g(torch.randn(1, 8))  # an fp32 input
    with pytest.raises(RuntimeError, match="K = 6"):
        g._op.gemm(torch.randn(1, 6).to(BF16), g.w, 8, None)  # another input size than the packed weight's
    with pytest.raises(RuntimeError, match="does not match the packed blocks"):
        g._op.gemm(torch.randn(1, 8).to(BF16), g.w, 40, None)
    with pytest.raises(RuntimeError, match=r"bias must be \(N,\) bfloat16"):
        g._op.gemm(torch.randn(1, 8).to(BF16), g.w, 8, torch.randn(8))  # a float32 bias
