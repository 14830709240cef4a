"""benchmarks/bench_gemm.py: the shapes it times (the fused siblings as one) and every kernel's product equal to
``F.linear``'s, so a faster kernel in its table is a right one."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from magnetar.ops.small_gemm import small_gemm_unavailable
from tests.conftest import load_benchmark
from tests.tiny_models import tiny_model


def test_shapes_are_the_models_with_the_siblings_fused():
    bench = load_benchmark("bench_gemm")
    model = tiny_model("llama", seed=0)
    cfg = model.config
    shapes = {name: (o, i) for name, o, i in bench.model_shapes(model)}
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    qkv = cfg.hidden_size + 2 * cfg.num_key_value_heads * head_dim
    assert shapes["q+k+v"] == (qkv, cfg.hidden_size)
    assert shapes["gate+up"] == (2 * cfg.intermediate_size, cfg.hidden_size)
    assert (cfg.vocab_size, cfg.hidden_size) in shapes.values()  # the LM head (here gate+up's shape: timed once)
    assert len(set(shapes.values())) == len(shapes)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kernel_is_the_linear_product(rows, dtype):
    bench = load_benchmark("bench_gemm")
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(48, 32, generator=g).to(dtype) for _ in range(2)]
    x = torch.randn(rows, 32, generator=g).to(dtype)
    kernels = bench.kernels(weights, rows)
    assert {"linear", "transposed"} <= set(kernels)
    assert ("mkl_packed" in kernels) <= (dtype == torch.float32)  # MKL's packed GEMM takes fp32 only
    # Magnetar's small GEMM: bf16, where this CPU runs it
    assert ("small_gemm" in kernels) == (dtype == torch.bfloat16 and small_gemm_unavailable() is None)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, f in kernels.items():
        torch.testing.assert_close(f(x, 1), F.linear(x, weights[1]), rtol=tol, atol=tol, msg=name)
    assert bench.time_kernel(kernels["linear"], x, 2, 1) > 0
    with pytest.raises(SystemExit):
        bench.parse_args(["--rows", "0"])
