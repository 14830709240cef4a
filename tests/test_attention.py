"""attention_with_lse, every CPU backend, against the fp64 reference in tests/reference.py."""
from __future__ import annotations

import pytest
import torch

from magnetar.ops import attention_with_lse
from magnetar.ops.backends import explain, list_backends
from tests.conftest import assert_close
from tests.reference import dense_attention_fp64, random_qkv

CPU_BACKENDS = ["torch", "tiled", "cpu_flash", "flex"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _check(q, k, v, backend, msg="", **kw):
    out, lse = attention_with_lse(q, k, v, backend=backend, **kw)
    ref_out, ref_lse = dense_attention_fp64(q, k, v, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape, msg
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3], msg
    assert_close(out, ref_out, q.dtype, "out", msg)
    assert_close(lse, ref_lse, q.dtype, "lse", msg)
    return out, lse


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_random_shapes_default_positions(backend, dtype, group, seeded):
    # decode (Sq=1), prefill (Sq=Sk), chunked prefill (Sq<Sk) and Sq>Sk (leading rows see nothing)
    for Sq, Sk in [(1, 37), (23, 23), (9, 40), (12, 5)]:
        q, k, v = random_qkv(2, 2 * group, 2, Sq, Sk, 16, dtype, seeded)
        _check(q, k, v, backend, f"Sq={Sq} Sk={Sk} G={group}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gapped_unsorted_positions_and_empty_rows(backend, dtype, seeded):
    B, Hq, Hkv, Sq, Sk, D = 2, 8, 2, 11, 29, 32
    q, k, v = random_qkv(B, Hq, Hkv, Sq, Sk, D, dtype, seeded)
    k_pos = torch.randperm(Sk, generator=seeded) * 3 + 5  # gapped, unsorted, starting at 5
    q_pos = torch.randint(5, 3 * Sk + 10, (Sq,), generator=seeded)  # every row sees key 5
    q_pos[:3] = torch.tensor([0, 4, 2])  # below every key position: rows with no visible key
    out, lse = _check(q, k, v, backend, q_pos=q_pos, k_pos=k_pos)
    assert torch.isneginf(lse[:, :, :3]).all() and (out[:, :, :3] == 0).all()
    assert torch.isfinite(lse[:, :, 3:]).all()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_per_sequence_positions(backend, seeded):
    B, Hq, Hkv, Sq, Sk, D = 3, 4, 2, 6, 14, 8
    q, k, v = random_qkv(B, Hq, Hkv, Sq, Sk, D, torch.float32, seeded)
    k_pos = torch.stack([torch.randperm(Sk, generator=seeded) for _ in range(B)])
    q_pos = torch.randint(-2, Sk + 2, (B, Sq), generator=seeded)
    _check(q, k, v, backend, q_pos=q_pos, k_pos=k_pos)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_star_like_anchor_prefix(backend, seeded):
    # a Star block: anchor tokens 0..7 then block tokens 32..47, queries are the block itself
    q, k, v = random_qkv(1, 6, 3, 16, 24, 16, torch.float32, seeded)
    k_pos = torch.cat((torch.arange(8), torch.arange(32, 48)))
    q_pos = torch.arange(32, 48)
    _check(q, k, v, backend, q_pos=q_pos, k_pos=k_pos)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_causal(backend, dtype, seeded):
    q, k, v = random_qkv(1, 4, 1, 7, 19, 16, dtype, seeded)
    _check(q, k, v, backend, causal=False, q_pos=torch.zeros(7, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Sq, Sk, kw", [
    (40, 47, dict(causal=False)),  # a query over a short cached context: no mask, keys padded under a -inf row
    (45, 45, {}),  # the query's own tokens: the causal square, padded keys past every row
    (30, 47, {}),  # bottom-right causal: the visible prefix (padded, masked) merged with the padded square
    (20, 64, dict(causal=False)),  # already a multiple of 16: as it was
])
def test_cpu_flash_pads_a_reduced_precision_calls_keys_to_its_key_block(dtype, Sq, Sk, kw, seeded, monkeypatch):
    """The CPU kernel runs a bf16 / fp16 call's keys past the last multiple of 16 one at a time (2.3x a call's time
    over 47 keys): cpu_flash pads them with zeros the rows never see; the result is the fp64 attention's."""
    from magnetar.ops.backends import cpu_flash

    seen = []
    real = cpu_flash._kernel()
    monkeypatch.setattr(cpu_flash, "_KERNEL", lambda q, k, v, *a, **k2: seen.append(k.shape[2]) or real(q, k, v, *a,
                                                                                                          **k2))
    q, k, v = random_qkv(2, 6, 2, Sq, Sk, 16, dtype, seeded)
    pos = dict(q_pos=torch.zeros(Sq, dtype=torch.long)) if kw.get("causal") is False else {}
    _check(q, k, v, "cpu_flash", f"Sq={Sq} Sk={Sk}", **kw, **pos)
    assert seen and all(n % 16 == 0 for n in seen), seen


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_logits(backend, dtype, seeded):
    # Integer-valued q, k make every score exact in every dtype, so the comparison tests the softmax /
    # lse numerics at |q.k| ~ 1e4 rather than input rounding.
    B, Hq, Hkv, Sq, Sk, D = 1, 4, 2, 8, 33, 16
    q = torch.randint(-30, 31, (B, Hq, Sq, D), generator=seeded).to(dtype)
    k = torch.randint(-30, 31, (B, Hkv, Sk, D), generator=seeded).to(dtype)
    v = torch.randn(B, Hkv, Sk, D, generator=seeded).to(dtype)
    out, lse = _check(q, k, v, backend, scale=1.0)
    assert lse.abs().max() > 2e3, "test must actually exercise extreme logits"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_custom_scale_and_fp64(backend, seeded):
    q, k, v = random_qkv(2, 4, 4, 5, 9, 8, torch.float64, seeded)
    _check(q, k, v, backend, scale=0.37)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_empty_query_or_keys(backend, seeded):
    q, k, v = random_qkv(1, 4, 2, 3, 0, 8, torch.float32, seeded)
    out, lse = attention_with_lse(q, k, v, backend=backend)
    assert (out == 0).all() and torch.isneginf(lse).all() and lse.shape == (1, 4, 3)
    q, k, v = random_qkv(1, 4, 2, 0, 5, 8, torch.float32, seeded)
    out, lse = attention_with_lse(q, k, v, backend=backend)
    assert out.shape == (1, 4, 0, 8) and lse.shape == (1, 4, 0)


def test_backends_agree_on_long_sorted_and_chunkedrandom_qkv(seeded, monkeypatch):
    # force the chunked code paths (mask budget / tiles far smaller than the problem)
    import magnetar.ops.backends.cpu_flash as cpu_flash
    import magnetar.ops.backends.tiled as tiled

    monkeypatch.setattr(cpu_flash, "_MASK_BUDGET", 300)
    monkeypatch.setattr(tiled, "_SCORE_BUDGET", 2000)
    q, k, v = random_qkv(1, 4, 2, 40, 200, 16, torch.float32, seeded)
    k_pos = torch.cat((torch.arange(0, 50), torch.arange(100, 250)))  # sorted with a gap
    q_pos = torch.arange(210, 250)
    for backend in CPU_BACKENDS:
        _check(q, k, v, backend, f"chunked {backend}", q_pos=q_pos, k_pos=k_pos)


def test_auto_picks_a_cpu_kernel_and_flash_attn_refuses(seeded):
    from magnetar.ops.attention import AttentionCall, FULL
    from magnetar.ops.backends import select_backend
    from tests.test_cpu_decode import RUNS

    q, k, v = random_qkv(1, 2, 2, 1, 4, 8, torch.float32, seeded)
    call = AttentionCall(q, k, v, torch.tensor([3]), torch.arange(4), 1.0, FULL)
    assert select_backend(call).name == ("cpu_decode" if RUNS else "cpu_flash")  # a decode call
    reasons = explain(call)
    assert set(reasons) == set(list_backends())
    assert any("CUDA" in r for r in reasons["flash_attn"])
    with pytest.raises(ValueError, match="flash_attn.*CUDA"):
        attention_with_lse(q, k, v, backend="flash_attn")
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention_with_lse(q, k, v, backend="nope")


BAD_INPUTS = [
    # (description, builder, expected message fragment)
    ("heads not divisible", lambda: (torch.randn(1, 6, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), {}),
     "multiple of KV heads"),
    ("head dim mismatch", lambda: (torch.randn(1, 4, 2, 8), torch.randn(1, 2, 2, 16), torch.randn(1, 2, 2, 16), {}),
     "head dims differ"),
    ("k/v shape mismatch", lambda: (torch.randn(1, 4, 2, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 2, 8), {}),
     "same shape"),
    ("batch mismatch", lambda: (torch.randn(2, 4, 2, 8), torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8), {}),
     "batch sizes differ"),
    ("dtype mismatch", lambda: (torch.randn(1, 4, 2, 8), torch.randn(1, 2, 2, 8).bfloat16(), torch.randn(1, 2, 2, 8),
                                {}), "share a dtype"),
    ("int dtype", lambda: (torch.ones(1, 4, 2, 8, dtype=torch.long),) * 3 + ({},), "not supported"),
    ("3-D q", lambda: (torch.randn(4, 2, 8), torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8), {}), "must be 4-D"),
    ("q_pos length", lambda: (torch.randn(1, 4, 2, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8),
                              {"q_pos": torch.arange(3)}), "q_pos has 3 positions"),
    ("k_pos length", lambda: (torch.randn(1, 4, 2, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8),
                              {"k_pos": torch.arange(4)}), "k_pos has 4 positions"),
    ("k_pos batch", lambda: (torch.randn(2, 4, 2, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8),
                             {"k_pos": torch.zeros(3, 5, dtype=torch.long)}), r"\(B, S\) = \(2, 5\)"),
    ("float positions", lambda: (torch.randn(1, 4, 2, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8),
                                 {"k_pos": torch.arange(5.0)}), "integer positions"),
]


@pytest.mark.parametrize("desc,build,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_value_error(desc, build, match):
    q, k, v, kw = build()
    with pytest.raises(ValueError, match=match):
        attention_with_lse(q, k, v, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_mismatch_raises():
    with pytest.raises(ValueError, match="one device"):
        attention_with_lse(torch.randn(1, 2, 2, 8, device="cuda"), torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8))


def test_device_mismatch_message_on_cpu_via_meta():
    # the meta device lets the device check be exercised on a CPU-only machine
    with pytest.raises(ValueError, match="one device"):
        attention_with_lse(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8, device="meta"), torch.randn(1, 2, 2, 8))


def test_plan_pieces_star_block():
    from magnetar.ops.runs import Piece, plan_pieces

    k_pos = torch.cat((torch.arange(4), torch.arange(8, 12)))
    assert plan_pieces(torch.arange(8, 12), k_pos) == [Piece(0, 4, 0, 4, False), Piece(0, 4, 4, 8, True)]
    # zigzag shard of 8 tokens on 2 ranks, rank 0 holds [0, 1, 6, 7] for both q and k
    z = torch.tensor([0, 1, 6, 7])
    assert plan_pieces(z, z) == [Piece(0, 2, 0, 2, True), Piece(2, 4, 0, 2, False), Piece(2, 4, 2, 4, True)]
    assert plan_pieces(torch.tensor([5]), torch.arange(9, 12)) == []  # every key in the future
    assert plan_pieces(torch.arange(10).view(2, 5), torch.arange(5)) is None  # per-sequence: mask path


def test_a_segment_over_its_own_tokens_is_one_causal_call_whatever_its_gaps(seeded):
    """Pulsar's Phase 1: sink, summary chunks and block as queries over themselves, positions increasing with gaps
    (dozens of runs, past the pieces' limit): the position mask is the index-causal one -- one mask-free call --,
    equal to the fp64 reference; with one position out of order, or a query seeing one key more, it is not."""
    from magnetar.ops.attention import _classify
    from magnetar.ops.call import CAUSAL_BOTTOM_RIGHT, POSITIONS
    from magnetar.ops.runs import MAX_RUN_PAIRS, index_causal, plan_pieces

    pos = torch.cat([torch.arange(0, 4)] + [torch.arange(s, s + 2) for s in range(8, 8 + 6 * 80, 6)] +
                    [torch.arange(600, 700)])
    assert plan_pieces(pos, pos) is None and len(pos) > MAX_RUN_PAIRS  # the pieces would give up: a mask
    assert index_causal(pos, pos) and _classify(pos, pos, len(pos), len(pos), True) == CAUSAL_BOTTOM_RIGHT
    q, k, v = (torch.randn(1, 4, len(pos), 16) for _ in range(3))
    out, lse = attention_with_lse(q, k[:, :2], v[:, :2], q_pos=pos, k_pos=pos)
    ref_out, ref_lse = dense_attention_fp64(q, k[:, :2], v[:, :2], q_pos=pos, k_pos=pos)
    assert_close(out, ref_out, torch.float32, "out")
    assert_close(lse, ref_lse, torch.float32, "lse")
    # the block's queries alone over the whole segment: bottom-right causal too
    assert index_causal(pos[-100:], pos)
    swapped = pos.clone()
    swapped[[5, 6]] = swapped[[6, 5]]
    assert not index_causal(swapped, swapped)
    assert not index_causal(pos[-100:] + 1, pos)  # each query sees one key more than the bottom-right mask
    assert _classify(pos[-100:] + 1, pos, 100, len(pos), True) == POSITIONS
    assert not index_causal(torch.arange(10).view(2, 5), torch.arange(5))  # per-sequence positions: the mask path


def _random_runs(gen, n_runs, max_len, span):
    parts = []
    for _ in range(n_runs):
        start = int(torch.randint(0, span, (1,), generator=gen))
        length = int(torch.randint(1, max_len + 1, (1,), generator=gen))
        parts.append(torch.arange(start, start + length))
    return torch.cat(parts)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("planned", [True, False], ids=["pieces", "mask"])
def test_run_structured_positions_both_paths(backend, planned, seeded, monkeypatch):
    # positions made of a few contiguous runs (unsorted, overlapping, gaps): the piece planner and the mask
    # path must both equal the reference
    import magnetar.ops.runs as runs

    if not planned:
        monkeypatch.setattr(runs, "MAX_RUN_PAIRS", 0)
    for trial in range(6):
        k_pos = _random_runs(seeded, 1 + trial % 3, 12, 40)
        q_pos = _random_runs(seeded, 1 + trial % 2, 9, 50)
        q, k, v = random_qkv(1, 4, 2, q_pos.numel(), k_pos.numel(), 8, torch.float32, seeded)
        _check(q, k, v, backend, f"trial {trial}", q_pos=q_pos, k_pos=k_pos)


@pytest.mark.parametrize("per_seq", [False, True], ids=["shared", "per-sequence"])
@pytest.mark.parametrize("backend", ["tiled", "cpu_flash", "flex"])
def test_sliding_window_matches_the_torch_backend(backend, per_seq, seeded):
    # Gemma-style local layers: the windowed position mask, unsorted gapped keys, rows that see nothing;
    # the "torch" backend (full score matrix) is the window's reference (tests/reference.py has no window)
    q, k, v = random_qkv(2, 4, 2, 9, 23, 16, torch.float32, seeded)
    k_pos = torch.randperm(40, generator=seeded)[:23]
    q_pos = torch.tensor([0, 3, 7, 12, 18, 25, 31, 36, 39])
    if per_seq:
        k_pos, q_pos = torch.stack((k_pos, k_pos.flip(0))), torch.stack((q_pos, q_pos + 1))
    for window in (1, 5, 16):
        ref = attention_with_lse(q, k, v, q_pos=q_pos, k_pos=k_pos, window=window, backend="torch")
        out, lse = attention_with_lse(q, k, v, q_pos=q_pos, k_pos=k_pos, window=window, backend=backend)
        assert_close(out.double(), ref[0].double(), torch.float32, "out", f"window {window}")
        assert_close(lse.double(), ref[1].double(), torch.float32, "lse", f"window {window}")


def test_flex_compile_failure_falls_back_for_that_kind_of_call_only(seeded, monkeypatch):
    # on an H100 the compiled kernel lowered for most models and failed for one (a windowed GQA-4 model): such a
    # failure sends that call, and later calls of the same signature, to "tiled" with a warning -- not every call
    from magnetar.ops.backends import flex
    from magnetar.ops.call import FULL, AttentionCall

    def broken(device):
        def kernel(*a, **kw):
            raise RuntimeError("NoValidChoicesError: No choices to select (test)")
        return kernel

    monkeypatch.setattr(flex, "_compile_on", lambda device: True)
    monkeypatch.setattr(flex, "_kernel", broken)
    monkeypatch.setattr(flex, "_BROKEN", {})
    q, k, v = random_qkv(1, 4, 1, 1, 20, 16, torch.float32, seeded)
    with pytest.warns(RuntimeWarning, match="compiled FlexAttention kernel failed.*NoValidChoicesError"):
        out, lse = attention_with_lse(q, k, v, backend="flex")
    ref = attention_with_lse(q, k, v, backend="tiled")
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    backend = flex.FlexAttentionBackend()
    same = AttentionCall(q, k, v, None, None, 0.25, FULL)
    assert flex._BROKEN and list(flex._BROKEN) == [flex._signature(same)]
    q2, k2, v2 = random_qkv(1, 4, 2, 5, 20, 16, torch.float32, seeded)  # another signature: still flex's
    assert flex._signature(AttentionCall(q2, k2, v2, None, None, 0.25, FULL)) not in flex._BROKEN
    assert backend.validate(AttentionCall(q2, k2, v2, None, None, 0.25, FULL)) == []


def test_auto_tries_the_measured_or_named_backends_first(seeded, monkeypatch):
    # issue 48, item 1: the order the GPU kit measured on a card (magnetar.ops.backends.measured.MEASURED, by card
    # name), or MAGNETAR_ATTENTION_ORDER, goes before AUTO_ORDER; a backend that refuses still falls through
    from magnetar.ops.backends import measured, select_backend
    from magnetar.ops.call import CAUSAL_BOTTOM_RIGHT, AttentionCall

    q, k, v = random_qkv(1, 4, 2, 8, 24, 16, torch.float32, seeded)
    call = AttentionCall(q, k, v, None, None, 0.25, CAUSAL_BOTTOM_RIGHT)
    assert select_backend(call).name == "cpu_flash"
    monkeypatch.setenv(measured.ENV, "flash_attn, tiled")  # flash_attn refuses a CPU call: tiled is next
    assert select_backend(call).name == "tiled"
    monkeypatch.setenv(measured.ENV, "tiled,fast")
    with pytest.raises(ValueError, match=r"MAGNETAR_ATTENTION_ORDER='tiled,fast': unknown attention backend\(s\) "
                                         r"\['fast'\]"):
        select_backend(call)
    monkeypatch.delenv(measured.ENV)
    monkeypatch.setattr(measured, "MEASURED", {"H200": ("sdpa_cudnn", "sdpa_flash")})
    monkeypatch.setattr(measured, "_card", lambda index: "NVIDIA H200")
    assert measured.preferred(torch.device("cuda", 0), list_backends) == ("sdpa_cudnn", "sdpa_flash")
    monkeypatch.setattr(measured, "_card", lambda index: "NVIDIA H100 80GB HBM3")
    assert measured.preferred(torch.device("cuda", 0), list_backends) == ()
    assert measured.preferred(torch.device("cpu"), list_backends) == ()  # the table is per card


def test_auto_names_every_backend_when_none_accepts(seeded, monkeypatch):
    # the order auto tries is kept per registry (select_backend's _auto_order): a backend registered or removed
    # later is seen, and when none accepts, the error gives each one's reasons
    from magnetar.ops import backends
    from magnetar.ops.backends import select_backend
    from magnetar.ops.call import FULL, AttentionCall

    class Refuser:
        name, device_types = "refuser", None

        def validate(self, call):
            return ["refuses everything"]

    q, k, v = random_qkv(1, 2, 2, 1, 8, 16, torch.float64, seeded)  # float64: cpu_flash's, not cpu_decode's
    call = AttentionCall(q, k, v, None, None, 0.25, FULL)
    assert select_backend(call).name == "cpu_flash"
    monkeypatch.setattr(backends, "_REGISTRY", {"refuser": Refuser, "flash_attn": backends._REGISTRY["flash_attn"]})
    monkeypatch.setattr(backends, "_INSTANCES", {})
    with pytest.raises(ValueError, match=r"no attention backend accepts this call:\n  flash_attn: needs a cuda "
                                         r"device, got cpu\n  refuser: refuses everything"):
        select_backend(call)
    monkeypatch.setattr(backends, "AUTO_ORDER", ["refuser", "flash_attn"])
    with pytest.raises(ValueError, match=r"accepts this call:\n  refuser: refuses everything\n  flash_attn"):
        select_backend(call)
