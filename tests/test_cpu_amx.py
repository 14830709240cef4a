"""The cpu_amx attention backend (magnetar/ops/csrc/amx_attention.cpp): bf16 prefill calls -- a query's rows over its
own keys (bottom-right causal) and over a cached prefix (every key visible) -- on AMX tiles, against the fp64 reference
of tests/reference.py; the same code with emulated tiles on any AVX-512 CPU; what the backend refuses (and auto then
sends to cpu_flash); NaN never made finite."""
from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from magnetar.ops import attention_with_lse
from magnetar.ops.backends import explain, get_backend, select_backend
from magnetar.ops.backends.cpu_amx import AMX_ATTENTION_OP
from magnetar.ops.call import CAUSAL_BOTTOM_RIGHT, FULL, AttentionCall
from tests.conftest import assert_close
from tests.reference import dense_attention_fp64, random_qkv


def _flags() -> set[str]:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return set()
    line = next((x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


FLAGS = _flags()
# Whether this machine must run the kernel on AMX tiles (Linux grants the tile state to any process that asks, from
# 5.16 on), and whether it must run the emulated tiles (AVX-512 F + BW); elsewhere the tests below check the refusal
# -- never a skip on an error.
RUNS = {"amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512_bf16"} <= FLAGS
EMULATES = {"avx512f", "avx512bw"} <= FLAGS
ENTRIES = (["attention"] if RUNS else []) + (["attention_emulated"] if EMULATES else [])
NEEDS = pytest.mark.skipif(not ENTRIES, reason="the kernel needs x86-64 with AVX-512 (the refusal is tested below)")


def _op():
    return AMX_ATTENTION_OP.load("cpu")


def _check_op(entry, q, k, v, causal, msg, scale=0.125):
    out, lse = getattr(_op(), entry)(q, k, v, scale, causal)
    ref_out, ref_lse = dense_attention_fp64(q, k, v, causal=causal, scale=scale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.dtype == torch.float32, msg
    assert_close(out, ref_out, torch.bfloat16, "out", f"{entry} {msg}")
    assert_close(lse, ref_lse, torch.bfloat16, "lse", f"{entry} {msg}")


def test_the_op_builds_and_says_whether_this_cpu_runs_it():
    assert AMX_ATTENTION_OP.available("cpu"), AMX_ATTENTION_OP.unavailable_reason("cpu")
    assert _op().supported() == RUNS


@NEEDS
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("group", [1, 3])
def test_calls_equal_the_fp64_reference(entry, group, seeded):
    # rows and keys across the 32-row blocks, the 32-key tile passes and the 128-key softmax steps (and not multiples
    # of any); a causal square, a query over a longer context (Sq < Sk), a prefix every row sees; head dims 32-256
    cases = [(1, 1, 32, 64, True), (2, 37, 81, 32, True), (1, 100, 100, 64, True), (1, 40, 300, 128, True),
             (1, 16, 16, 256, True), (1, 50, 47, 64, False), (2, 33, 129, 64, False), (1, 200, 1, 32, False)]
    for B, Sq, Sk, D, causal in cases:
        if entry == "attention_emulated" and Sq * Sk > 20000:
            Sq = min(Sq, 20)  # the scalar tiles are slow; the shapes that matter (block edges) stay
        q, k, v = random_qkv(B, 2 * group, 2, Sq, Sk, D, torch.bfloat16, seeded)
        _check_op(entry, q, k, v, causal, f"G={group} B={B} Sq={Sq} Sk={Sk} D={D} causal={causal}")


@NEEDS
@pytest.mark.parametrize("entry", ENTRIES)
def test_strided_inputs_and_a_max_that_moves_between_steps(entry, seeded):
    # q and k views of a projection's (B, S, H, D) output (heads inner), v the first entries of a larger buffer; a late
    # key far above the rest moves the running max in the third softmax step (the rescaling of the output so far)
    B, Hq, Hkv, Sq, Sk, D = 1, 4, 2, 70 if entry == "attention" else 20, 400, 64
    q = torch.randn(B, Sq, Hq, D, generator=seeded).mul(3).bfloat16().transpose(1, 2)
    k = torch.randn(B, Sk, Hkv, D, generator=seeded).mul(3).bfloat16().transpose(1, 2)
    v = torch.randn(B, Hkv, 512, D, generator=seeded).bfloat16()[:, :, :Sk]
    k[:, :, 300] *= 4
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    _check_op(entry, q, k, v, True, "strided, causal")
    _check_op(entry, q, k, v, False, "strided, full")


@NEEDS
@pytest.mark.parametrize("entry", ENTRIES)
def test_rows_that_see_no_key_are_zero_with_lse_minus_inf(entry, seeded):
    # causal with Sq > Sk (the op's own contract; the front end never sends it): row i sees keys j <= i - (Sq - Sk)
    q, k, v = random_qkv(1, 2, 1, 40, 10, 32, torch.bfloat16, seeded)
    out, lse = getattr(_op(), entry)(q, k, v, 0.2, True)
    empty = torch.arange(40) < 30
    assert (lse[:, :, empty] == float("-inf")).all() and (out[:, :, empty] == 0).all()
    ref_out, ref_lse = dense_attention_fp64(q, k, v, causal=True, scale=0.2, q_pos=torch.arange(-30, 10))
    assert_close(out, ref_out, torch.bfloat16, "out")
    assert_close(lse, ref_lse, torch.bfloat16, "lse")


@pytest.mark.skipif(not RUNS, reason="the AMX tiles need an AMX CPU (the refusal is tested below)")
def test_through_the_front_end_and_auto(seeded):
    q, k, v = random_qkv(1, 9, 3, 100, 147, 64, torch.bfloat16, seeded)
    call = AttentionCall(q, k, v, None, None, 0.125, CAUSAL_BOTTOM_RIGHT)
    assert select_backend(call).name == "cpu_amx", explain(call)["cpu_amx"]
    out, lse = attention_with_lse(q, k, v, backend="cpu_amx", scale=0.125)
    ref_out, ref_lse = dense_attention_fp64(q, k, v, scale=0.125)
    assert_close(out, ref_out, torch.bfloat16, "out")
    assert_close(lse, ref_lse, torch.bfloat16, "lse")


@pytest.mark.skipif(not RUNS, reason="the AMX tiles need an AMX CPU")
def test_two_threads_give_one_threads_result(seeded):
    # blocks of rows are independent: how they are split over threads changes nothing, bit for bit
    q, k, v = random_qkv(2, 6, 2, 150, 150, 64, torch.bfloat16, seeded)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _op().attention(q, k, v, 0.125, True)
        torch.set_num_threads(2)
        two = _op().attention(q, k, v, 0.125, True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@pytest.mark.skipif(not RUNS, reason="the AMX tiles need an AMX CPU")
def test_nan_is_never_made_finite_through_the_front_end(seeded):
    q, k, v = random_qkv(1, 4, 2, 64, 64, 64, torch.bfloat16, seeded)
    q[0, 1, 20, 5] = float("nan")  # one query row of head 1
    k[0, 1, 10, 3] = float("nan")  # key 10 of KV head 1: rows >= 10 of query heads 2 and 3
    out, lse = attention_with_lse(q, k, v, backend="cpu_amx", scale=0.125)
    assert torch.isnan(out[0, 1, 20]).all() and torch.isnan(lse[0, 1, 20])
    assert torch.isnan(lse[0, 2:, 10:]).all() and torch.isnan(out[0, 2:, 10:]).all()
    assert torch.isfinite(lse[0, 2:, :10]).all() and torch.isfinite(lse[0, 0]).all()


def test_refusals_name_their_reason(seeded):
    backend = get_backend("cpu_amx")

    def reasons(q, k, v, kind=CAUSAL_BOTTOM_RIGHT):
        return " ".join(backend.validate(AttentionCall(q, k, v, None, None, 0.125, kind)))

    q, k, v = random_qkv(1, 4, 2, 64, 64, 64, torch.float32, seeded)
    assert "all bfloat16" in reasons(q, k, v)
    q, k, v = random_qkv(1, 4, 2, 64, 64, 48, torch.bfloat16, seeded)
    assert "head dimensions 48" in reasons(q, k, v)
    q, k, v = random_qkv(1, 4, 2, 4, 64, 64, torch.bfloat16, seeded)
    assert "8 query rows per KV head" in reasons(q, k, v, FULL)  # a decode call's rows: cpu_decode's
    q, k, v = random_qkv(1, 6, 2, 3, 64, 64, torch.bfloat16, seeded)
    short = backend.validate(AttentionCall(q, k, v, None, None, 0.125, FULL))  # 9 rows a KV head: a short question's
    assert not [r for r in short if "query rows" in r], short
    q, k, v = random_qkv(1, 4, 2, 64, 64, 64, torch.bfloat16, seeded)
    assert "mask kind positions" in reasons(q, k, v, "positions")
    assert "contiguous along the head dimension" in reasons(q, k.transpose(2, 3).contiguous().transpose(2, 3), v)
    assert ("lacks AVX-512 with AMX-BF16" in reasons(q, k, v)) == (not RUNS)
    assert select_backend(AttentionCall(q, k, v, None, None, 0.125, CAUSAL_BOTTOM_RIGHT)).name == (
        "cpu_amx" if RUNS else "cpu_flash")
    q, k, v = random_qkv(1, 4, 2, 64, 64, 64, torch.float32, seeded)
    assert select_backend(AttentionCall(q, k, v, None, None, 0.125, CAUSAL_BOTTOM_RIGHT)).name == "cpu_flash"


def test_an_op_that_cannot_build_sends_prefill_calls_to_cpu_flash(seeded, monkeypatch):
    from magnetar.ops import backends
    from magnetar.ops.backends import cpu_amx

    monkeypatch.setattr(cpu_amx.AMX_ATTENTION_OP, "unavailable_reason", lambda device: "no C++ compiler")
    monkeypatch.setattr(backends, "_INSTANCES", {})  # a fresh backend asks the op again
    q, k, v = random_qkv(1, 9, 3, 64, 64, 64, torch.bfloat16, seeded)
    call = AttentionCall(q, k, v, None, None, 0.125, CAUSAL_BOTTOM_RIGHT)
    assert get_backend("cpu_amx").validate(call) == ["the AMX attention op is unavailable: no C++ compiler"]
    assert select_backend(call).name == "cpu_flash"
    with pytest.raises(RuntimeError, match=r"unavailable: no C\+\+ compiler"):
        get_backend("cpu_amx").forward(call)


@NEEDS
def test_the_ops_own_checks_name_what_is_wrong(seeded):
    q, k, v = random_qkv(1, 4, 2, 32, 32, 64, torch.bfloat16, seeded)
    with pytest.raises(RuntimeError, match="head dimension a multiple of 32"):
        _op().attention_emulated(q[..., :48], k[..., :48], v[..., :48], 0.1, True)
    with pytest.raises(RuntimeError, match="q, k and v bfloat16"):
        _op().attention_emulated(q.float(), k.float(), v.float(), 0.1, True)
    with pytest.raises(RuntimeError, match="Hq a multiple of Hkv"):
        _op().attention_emulated(q[:, :3], k, v, 0.1, True)
    with pytest.raises(RuntimeError, match="at least one key"):
        _op().attention_emulated(q, k[:, :, :0], v[:, :, :0], 0.1, True)


@pytest.mark.skipif(not RUNS, reason="the AMX tiles need an AMX CPU")
def test_calls_alternating_with_torchs_bf16_products_on_the_same_threads(seeded):
    # the kernel configures the tiles for each thread's chunk and releases them after; torch's bf16 products (oneDNN,
    # AMX on this CPU) configure their own -- a forward alternates the two every layer, on the same threads
    q, k, v = random_qkv(1, 4, 2, 96, 96, 64, torch.bfloat16, seeded)
    x = torch.randn(64, 512, generator=seeded).bfloat16()
    w = torch.randn(512, 512, generator=seeded).bfloat16()
    want = x.double() @ w.double().T
    ref_out, ref_lse = dense_attention_fp64(q, k, v, scale=0.125)
    for _ in range(3):
        y = torch.nn.functional.linear(x, w)
        assert_close(y, want, torch.bfloat16, "out", "linear")  # bf16 out, fp64 product: the table's bf16 row
        out, lse = _op().attention(q, k, v, 0.125, True)
        assert_close(out, ref_out, torch.bfloat16, "out")
        assert_close(lse, ref_lse, torch.bfloat16, "lse")
