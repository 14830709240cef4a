"""The cpu_decode attention backend (magnetar/ops/csrc/decode_attention.cpp): a decode step's few query rows per KV
head over every key, against the fp64 reference of tests/reference.py; what it refuses (and auto then sends to
cpu_flash); NaN never made finite."""
from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest
import torch

from magnetar.ops import attention_with_lse
from magnetar.ops.backends import explain, get_backend, select_backend
from magnetar.ops.backends.cpu_decode import DECODE_ATTENTION_OP
from magnetar.ops.call import FULL, AttentionCall
from tests.conftest import assert_close
from tests.reference import dense_attention_fp64, random_qkv


def _has_avx2_fma() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return " avx2" in flags and " fma" in flags


# Whether this machine must run the kernel (x86-64 with AVX2 and FMA: every CI machine so far); elsewhere the tests
# below check that the backend refuses with the reason instead -- never a skip on an error.
RUNS = _has_avx2_fma()
# Whether bf16 calls (D a multiple of 32) take the AVX-512 BF16 pass here (Intel Cooper Lake / Sapphire Rapids on, AMD
# Zen 4 on); the AVX2 pass is checked on every x86-64 machine (the op switched to it).
HAS_AVX512_BF16 = RUNS and all(f" {flag}" in Path("/proc/cpuinfo").read_text()
                               for flag in ("avx512f", "avx512bw", "avx512_bf16"))

# The kernel's passes by dtype: float32 and bf16 through AVX2, bf16 through AVX-512 BF16 where the CPU has it.
DTYPE_PASSES = [
    pytest.param(torch.float32, "avx2", id="float32"),
    pytest.param(torch.bfloat16, "avx2", id="bfloat16-avx2"),
    pytest.param(torch.bfloat16, "avx512_bf16", id="bfloat16-avx512_bf16",
                 marks=pytest.mark.skipif(not HAS_AVX512_BF16, reason="this CPU has no AVX-512 BF16 (the AVX2 pass "
                                                                       "serves its bf16 calls: the other ids)")),
]


@pytest.fixture
def on_pass(kernel_pass):
    """The op switched to ``kernel_pass`` (a test's parameter) for the test, then back."""
    op = DECODE_ATTENTION_OP.load("cpu")
    before = op.set_avx512_bf16(kernel_pass == "avx512_bf16")
    assert op.avx512_bf16() == (kernel_pass == "avx512_bf16")
    yield kernel_pass
    op.set_avx512_bf16(before)


def _check(q, k, v, msg="", **kw):
    out, lse = attention_with_lse(q, k, v, backend="cpu_decode", **kw)
    ref_out, ref_lse = dense_attention_fp64(q, k, v, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.dtype == torch.float32, msg
    assert_close(out, ref_out, q.dtype, "out", msg)
    assert_close(lse, ref_lse, q.dtype, "lse", msg)


def test_the_op_builds_and_runs_where_the_cpu_has_avx2():
    assert DECODE_ATTENTION_OP.available("cpu"), DECODE_ATTENTION_OP.unavailable_reason("cpu")
    assert DECODE_ATTENTION_OP.load("cpu").supported() == RUNS
    # on by default where the CPU has it (MAGNETAR_DECODE_AVX512=0 switches it off)
    assert DECODE_ATTENTION_OP.load("cpu").avx512_bf16() == (HAS_AVX512_BF16
                                                             and os.environ.get("MAGNETAR_DECODE_AVX512") != "0")


@pytest.mark.skipif(not RUNS, reason="the kernel needs x86-64 with AVX2 and FMA (the refusal is tested below)")
@pytest.mark.parametrize("dtype,kernel_pass", DTYPE_PASSES)
@pytest.mark.parametrize("group,sq", [(1, 1), (2, 1), (3, 1), (4, 2), (8, 1), (1, 8), (7, 1)])
def test_decode_calls_equal_the_fp64_reference(dtype, group, sq, seeded, on_pass):
    # key counts across the kernel's 128-key blocks and its 8-wide exp tail; head dims 8 to 256
    for Sk, D in [(1, 8), (7, 64), (128, 64), (129, 128), (300, 256), (1000, 64)]:
        q, k, v = random_qkv(2, 2 * group, 2, sq, Sk, D, dtype, seeded)
        _check(q, k, v, f"G={group} Sq={sq} Sk={Sk} D={D}", causal=False)
        if sq == 1:
            _check(q, k, v, f"decode G={group} Sk={Sk} D={D}")  # a query at the end: every key visible


@pytest.mark.skipif(not RUNS, reason="the kernel needs x86-64 with AVX2 and FMA (the refusal is tested below)")
@pytest.mark.parametrize("dtype,kernel_pass", DTYPE_PASSES)
def test_strided_inputs_and_large_logits(dtype, seeded, on_pass):
    # q a transposed view, K / V the first entries of larger cache buffers (a KV cache's capacity), logits large
    # enough that the running max moves between blocks (the online rescaling)
    B, Hq, Hkv, Sk, D = 2, 6, 2, 700, 64
    q = torch.randn(B, 2, Hq, D, generator=seeded).mul(4).to(dtype).transpose(1, 2)  # two query tokens
    k = torch.randn(B, Hkv, 1024, D, generator=seeded).mul(4).to(dtype)[:, :, :Sk]
    v = torch.randn(B, Hkv, 1024, D, generator=seeded).to(dtype)[:, :, :Sk]
    k[:, :, 650] *= 3  # a late key far above the rest: the max moves in the sixth block
    assert not q.is_contiguous() and not k.is_contiguous()
    _check(q, k, v, "strided, large logits", causal=False)


def test_refusals_name_their_reason(seeded):
    backend = get_backend("cpu_decode")

    def reasons(q, k, v, kind=FULL):
        return " ".join(backend.validate(AttentionCall(q, k, v, None, None, 0.125, kind)))

    q, k, v = random_qkv(1, 9, 1, 1, 16, 64, torch.float32, seeded)
    assert "9 query rows per KV head" in reasons(q, k, v)  # Gemma-like MQA with 9 heads: cpu_flash's
    q, k, v = random_qkv(1, 4, 2, 12, 12, 64, torch.float32, seeded)
    assert "every key visible" in reasons(q, k, v, "causal_bottom_right")  # a prefill's causal square
    for dtype in (torch.float16, torch.float64):
        q, k, v = random_qkv(1, 4, 2, 1, 16, 64, dtype, seeded)
        assert "float32 or all bfloat16" in reasons(q, k, v)
    q, k, v = random_qkv(1, 4, 2, 1, 16, 12, torch.float32, seeded)
    assert "head dimension 12" in reasons(q, k, v)
    q, k, v = random_qkv(1, 4, 2, 1, 16, 64, torch.float32, seeded)
    assert "contiguous along the head dimension" in reasons(q, k.transpose(2, 3).contiguous().transpose(2, 3), v)
    assert ("this CPU lacks AVX2/FMA" in reasons(q, k, v)) == (not RUNS)


def test_auto_sends_decode_calls_here_and_the_rest_to_cpu_flash(seeded):
    q, k, v = random_qkv(1, 9, 3, 1, 64, 64, torch.float32, seeded)
    decode = AttentionCall(q, k, v, None, None, 0.125, FULL)
    assert select_backend(decode).name == ("cpu_decode" if RUNS else "cpu_flash"), explain(decode)["cpu_decode"]
    q, k, v = random_qkv(1, 9, 3, 3, 64, 64, torch.float32, seeded)  # 9 rows per KV head: a short query
    assert select_backend(AttentionCall(q, k, v, None, None, 0.125, FULL)).name == "cpu_flash"


@pytest.mark.skipif(not RUNS, reason="the kernel needs x86-64 with AVX2 and FMA (the refusal is tested above)")
@pytest.mark.parametrize("dtype,kernel_pass", DTYPE_PASSES)
def test_the_kernel_itself_never_makes_nan_finite(dtype, seeded, on_pass):
    # the op alone (the front end's non-finite rule aside): a NaN query row, or a NaN key, makes exactly the rows
    # that read it (NaN, NaN); the other rows stay as the reference's
    op = DECODE_ATTENTION_OP.load("cpu")
    q, k, v = random_qkv(2, 4, 2, 1, 200, 64, dtype, seeded)
    q[0, 1, 0, 5] = float("nan")  # batch 0, query head 1 (KV head 0)
    k[1, 1, 170, 3] = float("nan")  # batch 1, KV head 1: query heads 2 and 3, in the second block
    out, lse = op.decode_attention(q, k, v, 0.125)
    bad = torch.zeros(2, 4, dtype=torch.bool)
    bad[0, 1] = bad[1, 2] = bad[1, 3] = True
    assert torch.isnan(lse[..., 0][bad]).all() and torch.isnan(out[bad]).all()
    assert torch.isfinite(lse[..., 0][~bad]).all() and torch.isfinite(out[~bad]).all()
    ref_out, ref_lse = dense_attention_fp64(q, k, v, causal=False, scale=0.125)
    assert_close(out[~bad], ref_out[~bad], dtype, "out")
    assert_close(lse[..., 0][~bad], ref_lse[..., 0][~bad], dtype, "lse")


def test_an_op_that_cannot_build_sends_decode_calls_to_cpu_flash(seeded, monkeypatch):
    from magnetar.ops import backends
    from magnetar.ops.backends import cpu_decode

    monkeypatch.setattr(cpu_decode.DECODE_ATTENTION_OP, "unavailable_reason", lambda device: "no C++ compiler")
    monkeypatch.setattr(backends, "_INSTANCES", {})  # a fresh backend asks the op again
    q, k, v = random_qkv(1, 9, 3, 1, 64, 64, torch.float32, seeded)
    call = AttentionCall(q, k, v, None, None, 0.125, FULL)
    assert get_backend("cpu_decode").validate(call) == ["the decode attention op is unavailable: no C++ compiler"]
    assert select_backend(call).name == "cpu_flash"
    with pytest.raises(RuntimeError, match=r"unavailable: no C\+\+ compiler"):
        get_backend("cpu_decode").forward(call)


@pytest.mark.skipif(not RUNS, reason="the kernel needs x86-64 with AVX2 and FMA (the refusal is tested above)")
@pytest.mark.parametrize("dtype,kernel_pass", DTYPE_PASSES)
@pytest.mark.parametrize("D", [8, 64])
def test_an_overflowing_score_makes_its_rows_nan_in_the_op(dtype, D, seeded, on_pass):
    # finite inputs whose product overflows float32: +inf - +inf has no softmax, so those rows are NaN, never finite
    op = DECODE_ATTENTION_OP.load("cpu")
    q, k, v = random_qkv(1, 2, 1, 1, 40, D, dtype, seeded)
    q[..., 0], k[..., 0] = 0.0, 0.0
    q[0, 0, 0, :] = 0.0
    q[0, 0, 0, 0], k[0, 0, 7, 0] = 3e38, 3e38  # head 0: key 7's score +inf, every other 0; head 1's all finite
    out, lse = op.decode_attention(q, k, v, 1.0)
    assert torch.isnan(out[0, 0]).all() and torch.isnan(lse[0, 0]).all()
    assert torch.isfinite(out[0, 1]).all() and torch.isfinite(lse[0, 1]).all()


@pytest.mark.skipif(not RUNS, reason="the kernel needs x86-64 with AVX2 and FMA (the refusal is tested above)")
@pytest.mark.parametrize("dtype,kernel_pass", DTYPE_PASSES[1:])
def test_two_threads_give_one_threads_result(dtype, seeded, on_pass):
    # at::parallel_for deals the (batch, KV head) items to the threads, each with its own scratch: the same bits
    op = DECODE_ATTENTION_OP.load("cpu")
    q, k, v = random_qkv(3, 8, 4, 1, 333, 64, dtype, seeded)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op.decode_attention(q, k, v, 0.125)
        torch.set_num_threads(2)
        two = op.decode_attention(q, k, v, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@pytest.mark.skipif(not RUNS, reason="the kernel needs x86-64 with AVX2 and FMA (the refusal is tested above)")
@pytest.mark.parametrize("where", ["none", "q nan", "q inf", "k +inf", "k -inf", "k nan", "v nan", "v inf", "overflow"])
@pytest.mark.parametrize("dtype,kernel_pass", DTYPE_PASSES)
def test_the_checked_op_is_clean_exactly_when_q_k_and_out_are_finite(where, dtype, seeded, on_pass):
    """decode_attention_checked's flag spares the front end its finite pass, so it may be True only when q, k and out
    are all finite; and it is True on finite inputs (else it would spare nothing). The same out and lse as the op."""
    op = DECODE_ATTENTION_OP.load("cpu")
    q, k, v = random_qkv(2, 6, 3, 1, 300, 64, dtype, seeded)
    if where == "overflow":  # finite inputs whose score overflows (3e38 is a finite bf16 too)
        q[1, 4, 0, 0], k[1, 2, 250, 0] = 3e38, -3e38
    elif where != "none":
        tensor, value = where.split()
        t = {"q": q, "k": k, "v": v}[tensor]
        t[1, 2 if tensor != "q" else 4, 0 if tensor == "q" else 250, 9] = {"nan": float("nan"), "inf": float("inf"),
                                                                           "+inf": float("inf"),
                                                                           "-inf": float("-inf")}[value]
    out, lse, clean = op.decode_attention_checked(q, k, v, 0.125)
    finite = all(bool(torch.isfinite(t).all()) for t in (q, k, out))
    assert clean == (where == "none"), (where, clean)
    assert clean <= finite
    plain = op.decode_attention(q, k, v, 0.125)
    assert torch.equal(out.nan_to_num(7.0), plain[0].nan_to_num(7.0)) and torch.equal(lse.nan_to_num(7.0),
                                                                                       plain[1].nan_to_num(7.0))


@pytest.mark.skipif(not RUNS, reason="the kernel needs x86-64 with AVX2 and FMA (the refusal is tested above)")
def test_the_front_end_makes_no_finite_pass_over_a_clean_call(seeded, monkeypatch):
    """attention_with_lse through cpu_decode: a clean call returns the kernel's result without the front end's pass
    over q, k and out; a non-clean one (a NaN value) still takes it and the non-finite rule's result."""
    from magnetar.ops import attention as front

    passes = []
    real = front.fast_path_finite
    monkeypatch.setattr(front, "fast_path_finite", lambda *a, **kw: passes.append(1) or real(*a, **kw))
    q, k, v = random_qkv(1, 9, 3, 1, 100, 64, torch.float32, seeded)
    out, lse = attention_with_lse(q, k, v, q_pos=torch.tensor([500]), k_pos=torch.arange(100), scale=0.125)
    assert passes == []
    ref_out, ref_lse = dense_attention_fp64(q, k, v, causal=False, scale=0.125)
    assert_close(out, ref_out, torch.float32, "out")
    v[0, 1, 40, 3] = float("nan")
    out, lse = attention_with_lse(q, k, v, q_pos=torch.tensor([500]), k_pos=torch.arange(100), scale=0.125)
    assert passes == [1] and torch.isnan(out[0, 3:6]).all() and torch.isfinite(out[0, :3]).all()


def _slots(B, Hq, Hkv, S, C, D, dtype, g, fill):
    """Slot buffers as a decode step holds them: each slot's first fill[b] entries at gapped, unsorted positions (Star's
    anchor, Pulsar's summaries), the rest empty (FAR), the buffers a view of a larger capacity (the step's `used`)."""
    from magnetar.ops.slots import FAR

    q = torch.randn(B, Hq, S, D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, C + 24, D, generator=g).to(dtype)[:, :, :C] for _ in range(2))
    k_pos = torch.full((B, C + 24), FAR, dtype=torch.long)[:, :C]
    for b, n in enumerate(fill):
        k_pos[b, :n] = torch.randperm(3 * C, generator=g)[:n]
    return q, k, v, k_pos


@pytest.mark.skipif(not RUNS, reason="the kernel needs x86-64 with AVX2 and FMA (the refusal is tested below)")
@pytest.mark.parametrize("dtype,kernel_pass", DTYPE_PASSES)
@pytest.mark.parametrize("group,S,window", [(3, 1, None), (1, 1, 50), (8, 1, None), (2, 3, None), (4, 2, 40)])
def test_slot_calls_equal_the_fp64_reference(dtype, group, S, window, on_pass):
    # the static / graph step's call on a CPU (slot_backend's auto choice): each row sees the entries at positions
    # <= its own (within the window), across the kernel's 128-entry blocks; rows of one slot at different positions
    # (S > 1) see different entries; a slot with nothing visible gives (0, -inf)
    from magnetar.ops.slots import slot_backend

    g = torch.Generator().manual_seed(group * 10 + S)
    B, Hkv, C, D = 4, 2, 300, 64
    q, k, v, k_pos = _slots(B, group * Hkv, Hkv, S, C, D, dtype, g, fill=[300, 129, 0, 7])
    q_pos = torch.tensor([[3 * C - t for t in range(S)], [2 * C + t for t in range(S)], [C] * S,
                          [C // 2 + 5 * t for t in range(S)]])
    backend = slot_backend("auto", "cpu", compiled=False)
    assert backend.name == "cpu_decode"
    out, lse = backend.slot_forward(q, k, v, q_pos, k_pos, 0.125, window)
    assert out.dtype == dtype and out.shape == q.shape and lse.dtype == torch.float32
    for b in range(B):
        for t in range(S):
            seen = (k_pos[b] <= q_pos[b, t]) & ((k_pos[b] > q_pos[b, t] - window) if window else True)
            idx = seen.nonzero().view(-1)
            if not len(idx):
                assert (out[b, :, t] == 0).all() and (lse[b, :, t] == float("-inf")).all(), f"slot {b} row {t}"
                continue
            ref_o, ref_l = dense_attention_fp64(q[b:b + 1, :, t:t + 1], k[b:b + 1, :, idx], v[b:b + 1, :, idx],
                                                causal=False, scale=0.125)
            assert_close(out[b:b + 1, :, t:t + 1], ref_o, dtype, "out", f"slot {b} row {t}")
            assert_close(lse[b:b + 1, :, t:t + 1], ref_l, dtype, "lse", f"slot {b} row {t}")


@pytest.mark.skipif(not RUNS, reason="the kernel needs x86-64 with AVX2 and FMA (the refusal is tested below)")
@pytest.mark.parametrize("dtype,kernel_pass", DTYPE_PASSES)
def test_slot_entries_no_row_sees_are_not_read(dtype, on_pass):
    # an empty entry, or another request's old one, holds anything: NaN there never reaches a row (the kernel skips
    # the entry), where NaN in an entry the row sees makes it NaN
    g = torch.Generator().manual_seed(5)
    q, k, v, k_pos = _slots(2, 4, 2, 1, 200, 32, dtype, g, fill=[150, 150])
    q_pos = torch.tensor([[10_000], [10_000]])
    cpu = get_backend("cpu_decode")
    clean_o, clean_l = cpu.slot_forward(q, k, v, q_pos, k_pos, 0.2)
    k[:, :, 150:] = float("nan")  # the empty tail (FAR)
    v[:, :, 150:] = float("nan")
    out, lse = cpu.slot_forward(q, k, v, q_pos, k_pos, 0.2)
    assert torch.equal(out, clean_o) and torch.equal(lse, clean_l)
    v[1, 0, 3] = float("nan")  # seen by slot 1's rows of KV head 0
    out, lse = cpu.slot_forward(q, k, v, q_pos, k_pos, 0.2)
    assert out[1, :2].isnan().all() and torch.equal(out[1, 2:], clean_o[1, 2:]) and torch.equal(out[0], clean_o[0])


def test_slot_calls_the_kernel_cannot_take_go_to_torchs_math(seeded, monkeypatch):
    # more than 8 rows per KV head, a head dim the kernel refuses, float64: the same contract through slot_attention;
    # a compiled step on a CPU keeps torch's math (the compiler fuses it); an op that cannot run here: torch's too
    from magnetar.ops import slots
    from magnetar.ops.slots import slot_attention, slot_backend

    g = torch.Generator().manual_seed(6)
    cpu = get_backend("cpu_decode")
    for Hq, S, D, dtype in [(18, 1, 32, torch.float32), (4, 1, 12, torch.float32), (4, 1, 16, torch.float64)]:
        q, k, v, k_pos = _slots(2, Hq, 2, S, 40, D, dtype, g, fill=[40, 3])
        q_pos = torch.tensor([[500], [500]])
        out, lse = cpu.slot_forward(q, k, v, q_pos, k_pos, 0.3)
        want = slot_attention(q, k, v, q_pos, k_pos, 0.3)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), (Hq, S, D, dtype)
    assert slot_backend("auto", "cpu", compiled=True).name == "torch"
    assert slot_backend("auto", "cpu", compiled=False).name == ("cpu_decode" if RUNS else "torch")
    monkeypatch.setattr(cpu, "runs_here", lambda: False)
    assert slot_backend("auto", "cpu", compiled=False).name == "torch"
    assert slots.slot_backend("cpu_decode", "cpu", compiled=False) is cpu  # asked for by name: its own fallback


@pytest.mark.skipif(not RUNS, reason="the kernel needs x86-64 with AVX2 and FMA (the refusal is tested above)")
def test_the_ops_own_checks_name_the_entry_point_and_the_argument():
    # the backend refuses these before the op sees them; a caller of the op itself gets its own checks' errors
    op = DECODE_ATTENTION_OP.load("cpu")
    q, k = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 5, 16)
    page = torch.randn(1, 2, 5, 16)
    bad = [
        (lambda: op.decode_attention(q, k, k[:, :, :3], 1.0), "decode_attention: k and v must be"),
        (lambda: op.decode_attention(q[..., :12], k[..., :12], k[..., :12], 1.0), "D a multiple of 8"),
        (lambda: op.decode_attention(q, k[:, :, :0], k[:, :, :0], 1.0), "at least one key"),
        (lambda: op.decode_attention(q.expand(2, 4, 5, 16), k, k, 1.0), "at most 8 query rows"),
        (lambda: op.decode_attention(q.double(), k.double(), k.double(), 1.0), "float32 or all bfloat16"),
        (lambda: op.slot_attention(q, k, k, torch.zeros(2, 1), torch.zeros(2, 5, dtype=torch.long), 1.0, 0),
         "slot_attention: int64 CPU q_pos"),
        (lambda: op.decode_attention_pages(q, [page], [page], [0, 1], 2, 1.0), "first must hold B \\+ 1"),
        (lambda: op.decode_attention_pages(q, [page], [page, page], [0, 1, 1], 2, 1.0), "as many value pages"),
        (lambda: op.decode_attention_pages(q, [k], [k], [0, 1, 1], 2, 1.0), "decode_attention_pages: k and v must"),
        (lambda: op.decode_attention_pages(q, [page], [page], [0, 1, 1], 4, 1.0), "every page \\(1, kv_heads"),
        (lambda: op.decode_attention_pages(q, [page.bfloat16()], [page.bfloat16()], [0, 1, 1], 2, 1.0),
         "float32 or all bfloat16"),
        (lambda: op.decode_attention_pages(q, [page], [page], [0, 1, 0], 2, 1.0), "first must hold"),
        (lambda: op.decode_attention_pages(q, [page, page], [page, page], [0, 3, 2], 2, 1.0), "first not sorted"),
        (lambda: op.decode_attention_pages(q, [page], [page], [0, 1, 1], 3, 1.0), "Hq must be a multiple"),
        (lambda: op.decode_attention_pages(q[:0], [], [], [0], 2, 1.0), "at least one request"),
        (lambda: op.decode_attention(q[:, :, :0], k, k, 1.0), "at least one query"),
    ]
    for call, message in bad:
        with pytest.raises(RuntimeError, match=message):
            call()
    assert op.decode_attention(q[:0], k[:0], k[:0], 1.0)[0].shape == (0, 4, 1, 16)  # an empty batch, as before
    out, lse, clean = op.decode_attention_pages(q, [page], [page], [0, 1, 1], 2, 1.0)  # request 1: no page
    assert clean and torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()
