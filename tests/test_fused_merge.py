"""The fused merge_states op (DeepSpeed op builder, C++ on CPU / CUDA on GPU) against fp64 references.

Two independent references: attention over the union of keys (``tests.reference.dense_attention_fp64``; the
partial states come from the same reference over disjoint key groups) and a plain fp64 per-row merge of the
very inputs the op sees (after rounding to the test dtype), which keeps extreme-lse cases meaningful. The torch
implementation ``merge_states_torch`` is checked to agree with the op as well.

The CPU op is built once per session (first build ~1 min, then cached on disk by torch); a failed build FAILS
these tests: a C++ compiler is required here and in CI. CUDA tests skip without a GPU.
"""
from __future__ import annotations

import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from magnetar.ops import fused_merge
from magnetar.ops.merge import merge_states, merge_states_torch
from tests.conftest import assert_close, repo_pythonpath
from tests.reference import dense_attention_fp64

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INF, NAN = float("inf"), float("nan")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cpu_op():
    """Build (or load from the torch extension cache) the CPU op once; fail loudly if that is impossible."""
    ok = fused_merge.fused_merge_available("cpu")
    reason = fused_merge.fused_merge_unavailable_reason("cpu")
    assert ok, f"the fused merge_states CPU op failed to build/load: {reason}"
    assert fused_merge.fused_merge_unavailable_reason("cpu") is None
    return fused_merge.load_fused_merge_op("cpu")


# ----------------------------------------------------------------------------------------------- references


def merge_fp64(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-by-row fp64 merge of the given (already rounded) inputs; written without the library's code."""
    N, D = outs.shape[0], outs.shape[-1]
    o = outs.double().reshape(N, -1, D)
    lv = lses.double().reshape(N, -1)
    R = o.shape[1]
    out = torch.zeros(R, D, dtype=torch.float64)
    lse = torch.full((R,), -INF, dtype=torch.float64)
    for r in range(R):
        if any(math.isnan(lv[n, r].item()) or lv[n, r].item() == INF for n in range(N)):
            out[r], lse[r] = NAN, NAN  # non-finite rule (issue 19): a NaN / +inf part poisons the row
            continue
        parts = [n for n in range(N) if math.isfinite(lv[n, r].item())]
        if not parts:
            continue
        m = max(lv[n, r].item() for n in parts)
        ws = [math.exp(lv[n, r].item() - m) for n in parts]
        z = sum(ws)
        out[r] = sum(w * o[n, r] for w, n in zip(ws, parts)) / z
        lse[r] = m + math.log(z)
    return out.reshape(outs.shape[1:]), lse.reshape(lses.shape[1:])


def split_keys(Sk: int, n_parts: int, gen: torch.Generator) -> list[torch.Tensor]:
    """A random partition of range(Sk) into n_parts groups of random sizes (groups may be empty)."""
    perm = torch.randperm(Sk, generator=gen)
    cuts = torch.sort(torch.randint(0, Sk + 1, (n_parts - 1,), generator=gen)).values.tolist()
    bounds = [0] + cuts + [Sk]
    return [perm[bounds[i]:bounds[i + 1]] for i in range(n_parts)]


def attention_parts(n_parts, dtype, D, gen, B=2, H=3, Sk=24, logit_scale=1.0):
    """Partial states over a random key partition (fp64 reference, rounded to dtype / float32) + the full result.

    Causal positions: query 0 sits before every key (empty in every part), the others see a prefix, so
    parts are naturally empty for some rows.
    """
    q = torch.randn(B, H, 5, D, generator=gen) * logit_scale
    k = torch.randn(B, H, Sk, D, generator=gen)
    v = torch.randn(B, H, Sk, D, generator=gen)
    k_pos = torch.arange(Sk)
    q_pos = torch.tensor([-1, 0, 3, 11, Sk - 1])
    outs, lses = [], []
    for idx in split_keys(Sk, n_parts, gen):
        o, l = dense_attention_fp64(q, k[:, :, idx], v[:, :, idx], q_pos=q_pos, k_pos=k_pos[idx])
        outs.append(o.to(dtype))
        lses.append(l.float())
    ref_out, ref_lse = dense_attention_fp64(q, k, v, q_pos=q_pos, k_pos=k_pos)
    return torch.stack(outs), torch.stack(lses), ref_out, ref_lse


def synthetic_states(N, dtype, gen, B=2, H=3, S=7, D=16, spread=3.0, p_special=0.3):
    """Random states with -inf / +inf / NaN lse parts sprinkled in and a few rows empty in every part."""
    outs = torch.randn(N, B, H, S, D, generator=gen).to(dtype)
    lses = torch.randn(N, B, H, S, generator=gen) * spread
    u = torch.rand(N, B, H, S, generator=gen)
    third = p_special / 3
    lses[u < third] = -INF
    lses[(u >= third) & (u < 2 * third)] = INF
    lses[(u >= 2 * third) & (u < p_special)] = NAN
    specials = torch.tensor([-INF, INF, NAN])
    lses[:, 0, 0, 0] = specials[torch.arange(N) % 3]  # no finite part, each kind of special present
    lses[:, 1, 2, S - 1] = -INF
    return outs, lses


def check_against(out, lse, ref_out, ref_lse, dtype, msg):
    assert out.dtype == dtype and lse.dtype == torch.float32, msg
    nan = torch.isnan(ref_lse)  # rows a NaN / +inf part poisons (issue 19): exactly these are (NaN, NaN)
    assert torch.equal(torch.isnan(lse), nan) and torch.isnan(out[nan]).all(), msg + ": NaN rows differ"
    assert_close(out[~nan], ref_out[~nan], dtype, "out", msg)
    assert_close(lse[~nan], ref_lse[~nan], dtype, "lse", msg)


# -------------------------------------------------------------------------------------- correctness (CPU)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_parts", [1, 2, 3, 4, 5, 6, 7, 8, 16])
def test_matches_attention_over_union_of_keys(cpu_op, dtype, n_parts):
    gen = torch.Generator().manual_seed(100 + n_parts)
    outs, lses, ref_out, ref_lse = attention_parts(n_parts, dtype, 64, gen)
    out, lse = fused_merge.fused_merge_states(outs, lses)
    msg = f"N={n_parts} {dtype}"
    check_against(out, lse, ref_out, ref_lse, dtype, msg + " vs attention over all keys")
    check_against(out, lse, *merge_fp64(outs, lses), dtype, msg + " vs fp64 merge")
    t_out, t_lse = merge_states_torch(outs, lses)
    check_against(out, lse, t_out, t_lse, dtype, msg + " vs merge_states_torch")
    # query 0 sees no key at all: exact zeros / -inf
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0])), msg
    assert torch.isneginf(lse[:, :, 0]).all(), msg


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [1, 7, 128, 256])
@pytest.mark.parametrize("n_parts", [2, 3, 8])
def test_head_dims(cpu_op, dtype, D, n_parts):
    gen = torch.Generator().manual_seed(7 * D + n_parts)
    outs, lses, ref_out, ref_lse = attention_parts(n_parts, dtype, D, gen, B=1, H=2, logit_scale=2.0)
    out, lse = fused_merge.fused_merge_states(outs, lses)
    msg = f"N={n_parts} D={D} {dtype}"
    check_against(out, lse, ref_out, ref_lse, dtype, msg + " vs attention over all keys")
    check_against(out, lse, *merge_fp64(outs, lses), dtype, msg + " vs fp64 merge")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_parts", [1, 2, 3, 4, 5, 6, 7, 8])
def test_empty_inf_nan_parts_and_all_empty_rows(cpu_op, dtype, n_parts):
    gen = torch.Generator().manual_seed(n_parts)
    outs, lses = synthetic_states(n_parts, dtype, gen)
    out, lse = fused_merge.fused_merge_states(outs, lses)
    msg = f"N={n_parts} {dtype}"
    check_against(out, lse, *merge_fp64(outs, lses), dtype, msg + " vs fp64 merge")
    check_against(out, lse, *merge_states_torch(outs, lses), dtype, msg + " vs merge_states_torch")

    empty = torch.isneginf(lses).all(dim=0)  # (B, H, S) rows empty (-inf) in every part
    poisoned = (torch.isnan(lses) | torch.isposinf(lses)).any(dim=0)  # issue 19: NaN / +inf parts are not empty
    assert (empty[0, 0, 0] if n_parts == 1 else poisoned[0, 0, 0]) and empty[1, 2, -1]
    assert torch.equal(out[empty], torch.zeros_like(out[empty])), msg + ": all-empty rows must give out == 0"
    assert torch.isneginf(lse[empty]).all(), msg + ": all-empty rows must give lse == -inf"
    assert torch.isnan(lse[poisoned]).all() and torch.isnan(out[poisoned].float()).all(), msg
    rest = ~empty & ~poisoned
    assert torch.isfinite(lse[rest]).all() and torch.isfinite(out[rest].float()).all(), msg


def test_empty_part_outputs_are_ignored_even_if_nan(cpu_op):
    """An empty part's out row is never read: NaN/inf garbage there must not reach the result."""
    gen = torch.Generator().manual_seed(3)
    outs, lses = synthetic_states(4, torch.float32, gen)
    clean_out, clean_lse = fused_merge.fused_merge_states(outs, lses)
    dirty = outs.clone()
    empty_parts = torch.isneginf(lses)  # issue 19: only -inf parts are empty
    dirty[empty_parts] = NAN
    dirty[empty_parts & (torch.arange(outs.shape[3]) % 2 == 0)] = INF
    out, lse = fused_merge.fused_merge_states(dirty, lses)
    torch.testing.assert_close(out, clean_out, rtol=0, atol=0, equal_nan=True)  # NaN only in poisoned rows
    torch.testing.assert_close(lse, clean_lse, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_extreme_lse(cpu_op, dtype):
    """Huge lse values and differences: no overflow, tiny parts vanish, lse keeps the magnitude."""
    gen = torch.Generator().manual_seed(11)
    N, B, H, S, D = 5, 1, 2, 6, 16
    outs = torch.randn(N, B, H, S, D, generator=gen).to(dtype)
    rows = torch.tensor(
        [
            [8e4, 8e4 - 1e4, 8e4 + 0.5, -1e4, -8e4],
            [1e4, -1e4, 1e4, 1e4 - 3.0, -INF],
            [-8e4, -8e4 + 2.0, -INF, NAN, INF],
            [3e38, 3e38, -3e38, 0.0, -INF],  # l - m overflows to -inf for the small ones: weight 0
            [-1e4, -1e4 - 1e-2, -1e4 + 20.0, -1e4 + 40.0, -1e4 + 40.5],
            [88.0, -88.0, 100.0, -100.0, 87.0],
        ]
    )  # (S, N)
    lses = rows.T.reshape(N, 1, 1, S).expand(N, B, H, S).contiguous()
    out, lse = fused_merge.fused_merge_states(outs, lses)
    msg = f"extreme lse {dtype}"
    ref_out, ref_lse = merge_fp64(outs, lses)
    check_against(out, lse, ref_out, ref_lse, dtype, msg + " vs fp64 merge")
    check_against(out, lse, *merge_states_torch(outs, lses), dtype, msg + " vs merge_states_torch")
    fin = torch.arange(S) != 2  # row 2 holds a NaN and a +inf part: (NaN, NaN) under issue 19's rule
    assert torch.isfinite(lse[..., fin]).all() and torch.isfinite(out[..., fin, :].float()).all(), msg
    assert torch.isnan(lse[..., 2]).all() and torch.isnan(out[..., 2, :].float()).all(), msg
    # row 0: the 8e4 + 0.5 and 8e4 parts dominate; the others underflow to exactly zero weight
    w = torch.tensor([1.0, math.exp(-0.5)], dtype=torch.float64)
    w = w / w.sum()
    expect = w[0] * outs[2, :, :, 0].double() + w[1] * outs[0, :, :, 0].double()
    assert_close(out[:, :, 0], expect, dtype, "out", msg + " row 0")
    assert abs(lse[0, 0, 0].item() - (8e4 + 0.5 + math.log1p(math.exp(-0.5)))) <= 0.01, msg


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_single_part_is_identity(cpu_op, dtype):
    gen = torch.Generator().manual_seed(5)
    outs, lses = synthetic_states(1, dtype, gen, p_special=0.2)
    out, lse = fused_merge.fused_merge_states(outs, lses)
    keep = torch.isfinite(lses[0])
    assert torch.equal(out[keep], outs[0][keep]), "N=1 must return the part's out bit-exactly"
    assert torch.equal(lse[keep], lses[0][keep]), "N=1 must return the part's lse bit-exactly"
    empty = torch.isneginf(lses[0])  # issue 19: only -inf is empty; NaN / +inf give (NaN, NaN)
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert torch.isneginf(lse[empty]).all()
    assert torch.isnan(out[~keep & ~empty].float()).all() and torch.isnan(lse[~keep & ~empty]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_16bit_value_round_trips(cpu_op, dtype):
    """N=1, lse 0: out must equal the input for all 65536 bit patterns (exercises the op's own fp16 decoding)."""
    vals = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).reshape(1, 1, 1, 256, 256)
    out, lse = fused_merge.fused_merge_states(vals, torch.zeros(1, 1, 1, 256))
    nan = torch.isnan(vals[0])
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan], vals[0][~nan])  # value equality: -0 may come back as +0
    assert torch.equal(lse, torch.zeros(1, 1, 256))
    # and the decoded values enter the accumulation exactly: weights 1/2, 1/2 of the same part = the part
    two = vals.expand(2, *vals.shape[1:])
    out2, _ = fused_merge.fused_merge_states(two, torch.zeros(2, 1, 1, 256))
    fin = torch.isfinite(vals[0]) & (vals[0].float().abs() < 1e38)  # 2 * 3e38 overflows float32, as in the reference
    assert torch.equal(out2[fin], vals[0][fin])


def test_identical_parts(cpu_op):
    gen = torch.Generator().manual_seed(6)
    o = torch.randn(2, 3, 4, 32, generator=gen)
    l = torch.randn(2, 3, 4, generator=gen) * 10
    for n in (2, 3, 8):
        out, lse = fused_merge.fused_merge_states(o.expand(n, *o.shape), l.expand(n, *l.shape))
        assert_close(out, o, torch.float32, "out", f"N={n}")
        assert_close(lse, l.double() + math.log(n), torch.float32, "lse", f"N={n}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(4, 2, 4, 257, 64), (3, 1, 2, 300, 256), (8, 1, 1, 1, 1)])
def test_large_matches_torch_reference(cpu_op, dtype, shape):
    """Shapes big enough to take at::parallel_for's multi-task path (rows split across threads)."""
    gen = torch.Generator().manual_seed(sum(shape))
    outs = torch.randn(*shape, generator=gen).to(dtype)
    lses = torch.randn(*shape[:-1], generator=gen) * 5
    lses[torch.rand(*shape[:-1], generator=gen) < 0.1] = -INF
    lses[:, :, :, :3] = -INF  # a few all-empty rows
    out, lse = fused_merge.fused_merge_states(outs, lses)
    t_out, t_lse = merge_states_torch(outs, lses)
    check_against(out, lse, t_out, t_lse, dtype, f"{shape} {dtype} vs merge_states_torch")
    # spot-check a slice against the fp64 merge (the full fp64 loop would be slow)
    sl = (slice(None), slice(0, 1), slice(0, 1), slice(0, 40))
    r_out, r_lse = merge_fp64(outs[sl], lses[sl])
    check_against(out[sl[1:]], lse[sl[1:]], r_out, r_lse, dtype, f"{shape} {dtype} vs fp64 merge")


def test_noncontiguous_inputs_and_lse_dtypes(cpu_op):
    gen = torch.Generator().manual_seed(9)
    base = torch.randn(2, 8, 3, 5, 4, generator=gen)  # (B, S, N, H, D): permute to (N, B, H, S, D)
    outs = base.permute(2, 0, 3, 1, 4)
    lses_base = torch.randn(5, 3, 8, 2, generator=gen) * 4  # (H, N, S, B)
    lses = lses_base.permute(1, 3, 0, 2)
    assert not outs.is_contiguous() and not lses.is_contiguous()
    ref_out, ref_lse = merge_fp64(outs, lses)
    out, lse = fused_merge.fused_merge_states(outs, lses)
    check_against(out, lse, ref_out, ref_lse, torch.float32, "non-contiguous")
    for ldt in (torch.float64, torch.bfloat16, torch.float16):
        low = lses.to(ldt)
        out, lse = fused_merge.fused_merge_states(outs, low)
        check_against(out, lse, *merge_fp64(outs, low.float()), torch.float32, f"lses {ldt}")
    assert lse.dtype == torch.float32


def test_float64_outs_follow_torch_reference(cpu_op):
    """float64 outs are accepted and, like the reference, accumulated in float32."""
    gen = torch.Generator().manual_seed(12)
    outs = torch.randn(3, 1, 2, 9, 8, generator=gen, dtype=torch.float64)
    lses = torch.randn(3, 1, 2, 9, generator=gen)
    out, lse = fused_merge.fused_merge_states(outs, lses)
    t_out, t_lse = merge_states_torch(outs, lses)
    assert out.dtype == torch.float64
    assert_close(out, t_out, torch.float32, "out")
    assert_close(lse, t_lse, torch.float32, "lse")


def test_zero_rows_and_zero_dim(cpu_op):
    out, lse = fused_merge.fused_merge_states(torch.randn(3, 1, 2, 0, 8), torch.randn(3, 1, 2, 0))
    assert out.shape == (1, 2, 0, 8) and lse.shape == (1, 2, 0)
    lses = torch.randn(3, 1, 2, 4)
    lses[:, 0, 1, 2] = -INF
    out, lse = fused_merge.fused_merge_states(torch.randn(3, 1, 2, 4, 0), lses)
    assert out.shape == (1, 2, 4, 0)
    assert_close(lse, merge_fp64(torch.zeros(3, 1, 2, 4, 1), lses)[1], torch.float32, "lse", "D=0")


def test_input_validation(cpu_op):
    outs, lses = torch.randn(2, 1, 2, 3, 4), torch.randn(2, 1, 2, 3)
    with pytest.raises(ValueError, match="lses must have shape"):
        fused_merge.fused_merge_states(outs, lses[:, :, :, :2])
    with pytest.raises(ValueError, match=r"\(N, B, H, S, D\)"):
        fused_merge.fused_merge_states(outs[0], lses[0])
    with pytest.raises(ValueError, match="N = 0"):
        fused_merge.fused_merge_states(outs[:0], lses[:0])
    with pytest.raises(ValueError, match="float32, bfloat16, float16 or float64"):
        fused_merge.fused_merge_states(outs.to(torch.int32), lses)
    with pytest.raises(ValueError, match="no backward"):
        fused_merge.fused_merge_states(outs.requires_grad_(), lses)
    with torch.no_grad():
        fused_merge.fused_merge_states(outs, lses)
    # the extension's own checks (bypassing the Python wrapper) give clear errors too
    with pytest.raises(RuntimeError, match="lses must be float32"):
        cpu_op.merge_states(outs.detach(), lses.double())
    with pytest.raises(RuntimeError, match="does not match outs shape"):
        cpu_op.merge_states(outs.detach(), lses[:, :, :1].contiguous())


# ------------------------------------------------------------------------------------- dispatch in merge.py


@pytest.fixture
def fused_spy(monkeypatch, cpu_op):
    calls = []
    real = fused_merge.fused_merge_states

    def spy(outs, lses):
        calls.append(outs.shape)
        return real(outs, lses)

    monkeypatch.setattr(fused_merge, "fused_merge_states", spy)
    return calls


def test_merge_states_backends_dispatch(fused_spy, monkeypatch):
    gen = torch.Generator().manual_seed(21)
    outs, lses = synthetic_states(3, torch.bfloat16, gen)
    ref = merge_fp64(outs, lses)

    out, lse = merge_states(outs, lses, backend="fused")
    assert len(fused_spy) == 1
    check_against(out, lse, *ref, torch.bfloat16, "backend=fused")

    monkeypatch.delenv("MAGNETAR_FUSED_MERGE", raising=False)
    out, lse = merge_states(list(outs), list(lses), backend="auto")  # list input is stacked first
    assert len(fused_spy) == 2, "backend='auto' must use the fused op when it is available"
    check_against(out, lse, *ref, torch.bfloat16, "backend=auto")

    out, lse = merge_states(outs, lses, backend="torch")
    assert len(fused_spy) == 2, "backend='torch' must not call the fused op"
    check_against(out, lse, *ref, torch.bfloat16, "backend=torch")

    monkeypatch.setenv("MAGNETAR_FUSED_MERGE", "0")
    out, lse = merge_states(outs, lses)
    assert len(fused_spy) == 2, "MAGNETAR_FUSED_MERGE=0 must make backend='auto' use torch"
    check_against(out, lse, *ref, torch.bfloat16, "MAGNETAR_FUSED_MERGE=0")


# ---------------------------------------------------------------------------- unavailability / fallback path


class _FailingBuilder:
    name = "failing_builder"

    def __init__(self, compatible: bool):
        self.compatible = compatible
        self.error_log = None
        self.jit_calls = 0

    def is_compatible(self, verbose=False):
        if not self.compatible:
            self.error_log = "no C++ compiler on this test machine"
        return self.compatible

    def jit_load(self, verbose=True):
        self.jit_calls += 1
        raise RuntimeError("Error building extension 'failing_builder': boom")


@pytest.mark.parametrize("compatible", [False, True])
def test_unavailable_op_warns_once_and_falls_back(monkeypatch, caplog, compatible):
    builder = _FailingBuilder(compatible)
    monkeypatch.setattr(fused_merge._op, "modules", {})
    monkeypatch.setattr(fused_merge._op, "failures", {})
    monkeypatch.setattr(fused_merge, "_make_builder", lambda device_type: builder)
    expected = "boom" if compatible else "no C\\+\\+ compiler"
    with caplog.at_level(logging.WARNING, logger="magnetar.ops.fused_merge"):
        assert fused_merge.fused_merge_available("cpu") is False
        assert fused_merge.fused_merge_available(torch.device("cpu")) is False
        outs, lses = synthetic_states(2, torch.float32, torch.Generator().manual_seed(0))
        out, lse = merge_states(outs, lses, backend="auto")  # falls back to torch silently
        with pytest.raises(RuntimeError, match=expected):
            fused_merge.fused_merge_states(outs, lses)
        with pytest.raises(RuntimeError, match=expected):
            merge_states(outs, lses, backend="fused")
    warnings = [r for r in caplog.records if r.name == "magnetar.ops.fused_merge" and r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "torch implementation" in warnings[0].getMessage()
    assert re.search(expected, warnings[0].getMessage())
    assert re.search(expected, fused_merge.fused_merge_unavailable_reason("cpu"))
    assert builder.jit_calls == (1 if compatible else 0), "a failed build must not be retried"
    check_against(out, lse, *merge_fp64(outs, lses), torch.float32, "fallback")


def test_concurrent_first_calls_load_once(monkeypatch):
    import threading
    import time
    import types

    class SlowBuilder:
        name = "slow_builder"
        error_log = None
        jit_calls = 0

        def is_compatible(self, verbose=False):
            return True

        def jit_load(self, verbose=True):
            SlowBuilder.jit_calls += 1
            time.sleep(0.2)
            return types.SimpleNamespace(merge_states=lambda o, l: (o[0], l[0]))

    monkeypatch.setattr(fused_merge._op, "modules", {})
    monkeypatch.setattr(fused_merge._op, "failures", {})
    monkeypatch.setattr(fused_merge, "_make_builder", lambda device_type: SlowBuilder())
    results = []
    def first_call():
        results.append(fused_merge.fused_merge_available("cpu"))

    threads = [threading.Thread(target=first_call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 8
    assert SlowBuilder.jit_calls == 1


def test_unsupported_device_type_is_unavailable_not_an_error(monkeypatch):
    monkeypatch.setattr(fused_merge._op, "failures", dict(fused_merge._op.failures))
    assert fused_merge.fused_merge_available("meta") is False
    assert "meta" in fused_merge.fused_merge_unavailable_reason("meta")
    assert fused_merge.fused_merge_available("not a device") is False


# ------------------------------------------------------------------------------- builders, laziness, caching


def test_builders_subclass_deepspeed_and_point_at_sources():
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder

    from magnetar.ops.op_builder import MergeStatesBuilder, MergeStatesCUDABuilder

    cpu, cuda = MergeStatesBuilder(), MergeStatesCUDABuilder()
    assert isinstance(cpu, OpBuilder) and not isinstance(cpu, CUDAOpBuilder)
    assert isinstance(cuda, CUDAOpBuilder)
    # build names carry a hash of the checkout's source dir (separate checkouts keep separate builds)
    assert re.fullmatch(r"magnetar_merge_states_[0-9a-f]{8}", cpu.name), cpu.name
    assert re.fullmatch(r"magnetar_merge_states_cuda_[0-9a-f]{8}", cuda.name), cuda.name
    assert cpu.name != cuda.name
    assert cpu.absolute_name() == "magnetar.ops.magnetar_merge_states_op"
    for b in (cpu, cuda):
        assert b.sources(), b.name
        for src in b.sources():
            assert os.path.isabs(src) and os.path.isfile(src), src
    assert cpu.is_compatible() is True  # a C++ compiler is required on every machine that runs these tests
    if not torch.cuda.is_available():
        assert cuda.is_compatible() is False
        assert cuda.error_log


def test_cpu_builder_reports_missing_compiler(monkeypatch):
    from magnetar.ops.op_builder import MergeStatesBuilder

    monkeypatch.setenv("CXX", "/nonexistent/magnetar-c++")
    b = MergeStatesBuilder()
    assert b.is_compatible() is False
    assert "magnetar-c++" in b.error_log


def _run_py(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=repo_pythonpath())
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_import_builds_nothing():
    code = (
        "import sys\n"
        "import magnetar.ops.fused_merge as f\n"
        "import magnetar.ops.merge\n"
        "assert 'deepspeed' not in sys.modules, 'importing fused_merge must not import deepspeed'\n"
        "assert not f._op.modules and not f._op.failures\n"
        "import magnetar.ops.op_builder\n"
        "from deepspeed.ops.op_builder.builder import OpBuilder\n"
        "assert not OpBuilder._loaded_ops, OpBuilder._loaded_ops\n"
        "assert not f._op.modules and not f._op.failures\n"
        "print('LAZY-OK')\n"
    )
    res = _run_py(code)
    assert res.returncode == 0 and "LAZY-OK" in res.stdout, res.stdout + res.stderr


def test_build_is_cached_across_processes(cpu_op):
    so = Path(cpu_op.__file__)
    assert so.is_file() and so.parent.name.startswith("magnetar_merge_states"), so
    before = so.stat().st_mtime_ns
    code = (
        "import torch, magnetar.ops.fused_merge as f\n"
        "assert f.fused_merge_available('cpu'), f.fused_merge_unavailable_reason('cpu')\n"
        "lses = torch.tensor([0.0, float('-inf')]).view(2, 1, 1, 1)\n"
        "out, lse = f.fused_merge_states(torch.zeros(2, 1, 1, 1, 4), lses)\n"
        "assert lse.item() == 0.0\n"
        "print('OP', f.load_fused_merge_op('cpu').__file__)\n"
    )
    res = _run_py(code)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"OP {so}" in res.stdout, res.stdout
    assert so.stat().st_mtime_ns == before, "a second process must reuse the cached build, not rebuild it"
    assert "ninja" not in res.stdout and "c++" not in res.stdout, "build logs must stay quiet by default"


def test_a_completed_build_is_imported_without_ninja_and_only_for_its_torch(cpu_op, monkeypatch):
    # ninja rebuilt the ops whenever its command changed, and it holds the venv's torch path: a clean checkout and
    # this one rebuilt all three in turn. A completed build (its record names this torch) is imported as it is.
    import json

    from magnetar.ops import jit

    folder = Path(cpu_op.__file__).parent
    name = folder.name
    assert json.loads((folder / jit.BUILT_RECORD).read_text())["torch"] == str(torch.__version__)
    again = jit.reuse_completed_build(folder, name)
    assert again is not None and again.__name__ == name and Path(again.__file__) == Path(cpu_op.__file__)
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")  # a build against another torch is not reused
    assert jit.reuse_completed_build(folder, name) is None


def test_a_clone_of_the_same_sources_reuses_the_build_and_other_sources_get_their_own(tmp_path):
    """Issue 45: builds are keyed by the sources' digest and compiled from a copy staged under it, so a clean clone
    (CI's folder, a second virtualenv) finds this checkout's build -- and a clone with an edited source builds apart."""
    import importlib.util
    import shutil

    from magnetar.ops import op_builder

    def builder_in(folder):
        spec = importlib.util.spec_from_file_location(f"_op_builder_{folder.name}", folder / "op_builder.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module.MergeStatesBuilder()

    here = op_builder.MergeStatesBuilder()
    clone, edited = tmp_path / "clone", tmp_path / "edited"
    for folder in (clone, edited):
        folder.mkdir()
        shutil.copy(Path(op_builder.__file__), folder / "op_builder.py")
        shutil.copytree(op_builder.CSRC_DIR, folder / "csrc")
    with open(edited / "csrc" / "merge_states.cpp", "a") as f:
        f.write("\n// an edit\n")
    same, other = builder_in(clone), builder_in(edited)
    assert same.name == here.name and same.sources() == here.sources()  # the very build this checkout uses
    assert other.name != here.name and other.sources() != here.sources()
    shutil.rmtree(Path(other.sources()[0]).parent)  # the edited sources' staged copy: nothing left in the cache
    assert Path(here.sources()[0]).read_bytes() == (op_builder.CSRC_DIR / "merge_states.cpp").read_bytes()
    assert not str(here.sources()[0]).startswith(str(op_builder.CSRC_DIR))  # a staged copy, not the checkout


# ------------------------------------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_parts", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("D", [1, 7, 64, 128, 256])
def test_cuda_op_matches_references(dtype, n_parts, D):
    assert fused_merge.fused_merge_available("cuda"), fused_merge.fused_merge_unavailable_reason("cuda")
    gen = torch.Generator().manual_seed(1000 + n_parts + D)
    outs, lses = synthetic_states(n_parts, dtype, gen, B=2, H=3, S=33, D=D)
    out, lse = fused_merge.fused_merge_states(outs.cuda(), lses.cuda())
    assert out.is_cuda and lse.is_cuda
    msg = f"CUDA N={n_parts} D={D} {dtype}"
    check_against(out.cpu(), lse.cpu(), *merge_fp64(outs, lses), dtype, msg + " vs fp64 merge")
    check_against(out.cpu(), lse.cpu(), *merge_states_torch(outs, lses), dtype, msg + " vs merge_states_torch")
    empty = torch.isneginf(lses).all(dim=0)  # issue 19: NaN / +inf parts are not empty
    assert torch.equal(out.cpu()[empty], torch.zeros_like(out.cpu()[empty]))
    assert torch.isneginf(lse.cpu()[empty]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_op_attention_union_and_extremes():
    assert fused_merge.fused_merge_available("cuda"), fused_merge.fused_merge_unavailable_reason("cuda")
    for dtype in DTYPES:
        gen = torch.Generator().manual_seed(77)
        outs, lses, ref_out, ref_lse = attention_parts(5, dtype, 64, gen)
        out, lse = fused_merge.fused_merge_states(outs.cuda(), lses.cuda())
        check_against(out.cpu(), lse.cpu(), ref_out, ref_lse, dtype, f"CUDA attention union {dtype}")
        lx = torch.tensor([8e4, 8e4 - 1e4, -INF, NAN, 3e38]).view(5, 1, 1, 1).expand(5, 1, 2, 3).contiguous()
        ox = torch.randn(5, 1, 2, 3, 16, generator=gen).to(dtype)
        out, lse = fused_merge.fused_merge_states(ox.cuda(), lx.cuda())
        check_against(out.cpu(), lse.cpu(), *merge_fp64(ox, lx), dtype, f"CUDA extreme lse {dtype}")
        lx = torch.where(torch.isnan(lx), -INF, lx)  # issue 19: the NaN part poisons the rows; keep the extremes
        out, lse = fused_merge.fused_merge_states(ox.cuda(), lx.cuda())
        check_against(out.cpu(), lse.cpu(), *merge_fp64(ox, lx), dtype, f"CUDA extreme lse, no NaN part {dtype}")


def test_cuda_builder_drops_arch_suffixes_deepspeed_cannot_parse(monkeypatch):
    # the GPU image sets TORCH_CUDA_ARCH_LIST="9.0a"; DeepSpeed's builder parses "0a" as an int and every CUDA op
    # failed to build there (ValueError: invalid literal for int() with base 10: '0a', seen on an H100)
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder

    from magnetar.ops.op_builder import MergeStatesCUDABuilder, plain_arch_list

    assert plain_arch_list("9.0a") == "9.0"
    assert plain_arch_list("8.0 9.0a+PTX") == "8.0;9.0+PTX"
    assert plain_arch_list("9.0a;9.0;10.0f") == "9.0;10.0"
    assert plain_arch_list("7.5+PTX") == "7.5+PTX"
    seen = {}

    def fake(self, cross_compile_archs=None):  # DeepSpeed's own parse, without a device
        seen["env"], seen["jit"] = os.environ["TORCH_CUDA_ARCH_LIST"], self._jit_arch_list
        return [int(p.split("+")[0]) for cc in seen["env"].split(";") for p in cc.split(".")]

    monkeypatch.setattr(CUDAOpBuilder, "compute_capability_args", fake)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    builder = MergeStatesCUDABuilder()
    builder._jit_arch_list = "9.0a"
    assert builder.compute_capability_args() == [9, 0]
    assert seen == {"env": "9.0", "jit": "9.0"}
