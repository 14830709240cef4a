"""The one-pass rotary embedding op (magnetar/ops/csrc/rotary.cpp) and its place in a model's modelling file
(magnetar.engine.rotary): the fp64 formula to the dtype's rounding for q / k views as the attention makes them, head
sizes with and without the vector code, cos for every batch row or one; transformers' apply_rotary_pos_emb bit for bit
(strides too); NaN and inf stay; what it refuses is named; a function of another formula keeps its own; a tiny
Llama's logits unchanged, autograd and restore reach the function itself."""
from __future__ import annotations

import json

import pytest
import torch
import transformers.models.llama.modeling_llama as modeling_llama

from magnetar.engine.rotary import fuse_rotary, restore_rotary
from magnetar.ops.rotary import ROTARY_OP, rotary, rotary_unavailable
from tests.conftest import assert_close, load_benchmark

BF16 = torch.bfloat16
HF = modeling_llama.apply_rotary_pos_emb


@pytest.fixture(autouse=True)
def _transformers_own_function():
    """Each test starts and ends with transformers' own function in modeling_llama (an engine built by another test
    put the op there: the values are the same, but these tests check which runs)."""
    own = getattr(modeling_llama.apply_rotary_pos_emb, "_magnetar_own", modeling_llama.apply_rotary_pos_emb)
    modeling_llama.apply_rotary_pos_emb = own
    yield
    modeling_llama.apply_rotary_pos_emb = own


def test_the_op_builds_here():
    assert rotary_unavailable() is None, rotary_unavailable()  # a build failure fails here


def _fp64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The formula in fp64, each product rounded to x's dtype before the sum (as the function rounds)."""
    h = x.shape[-1] // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1).double()
    c, s = cos[:, None].double(), sin[:, None].double()
    return (x.double() * c).to(x.dtype).double() + (rot * s).to(x.dtype).double()


def _qk(B, H, Hk, S, D, dtype, seed, cos_rows=None):
    """q (B, H, S, D) and k (B, Hk, S, D) as views of projections' outputs (B, S, H * D), cos / sin (cos_rows or B,
    S, D)."""
    g = torch.Generator().manual_seed(seed)
    q = (3 * torch.randn(B, S, H * D, generator=g)).to(dtype).view(B, S, H, D).transpose(1, 2)
    k = (3 * torch.randn(B, S, Hk * D, generator=g)).to(dtype).view(B, S, Hk, D).transpose(1, 2)
    cos, sin = (torch.randn(cos_rows or B, S, D, generator=g).to(dtype) for _ in range(2))
    return q, k, cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("D", [64, 32, 6])  # the vector code (D/2 a multiple of 16), twice / once a row; the loop
@pytest.mark.parametrize("B,S,cos_rows", [(1, 70, None), (3, 1, None), (2, 5, 1)])  # a query; a decode step; cos
def test_the_op_is_the_fp64_formula(dtype, D, B, S, cos_rows):
    q, k, cos, sin = _qk(B, 3, 1, S, D, dtype, D + S, cos_rows)
    got_q, got_k = rotary(q, k, cos, sin)
    for name, x, got in (("q", q, got_q), ("k", k, got_k)):
        assert got.shape == x.shape and got.dtype == dtype
        assert_close(got, _fp64(x, cos, sin), dtype, msg=f"rotary {name} D={D} B={B} S={S}")


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_the_scalar_loop_is_the_fp64_formula_too(dtype):
    """The loop a CPU without AVX-512 runs, called here whatever this CPU has."""
    q, _, cos, sin = _qk(2, 3, 1, 9, 64, dtype, 3)
    assert_close(ROTARY_OP.load("cpu").rotary_scalar(q, cos, sin), _fp64(q, cos, sin), dtype, msg="the scalar loop")


def _layout(t):
    return [st for st, n in zip(t.stride(), t.shape) if n > 1]  # a dimension of size 1 has any stride


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("B,S,D,cos_rows", [(1, 1000, 64, None), (8, 1, 64, None), (2, 7, 128, 1), (1, 5, 6, None)])
def test_the_op_is_transformers_function_bit_for_bit(dtype, B, S, D, cos_rows):
    q, k, cos, sin = _qk(B, 9, 3, S, D, dtype, S, cos_rows)
    for want, got in zip(HF(q, k, cos, sin), rotary(q, k, cos, sin)):
        assert torch.equal(got, want) and _layout(got) == _layout(want)
    contiguous = q.contiguous()  # a (B, H, S, D) tensor of its own: heads outer in memory
    assert torch.equal(rotary(contiguous, k, cos, sin)[0], HF(contiguous, k, cos, sin)[0])


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_nan_and_inf_stay(dtype):
    q, k, cos, sin = _qk(1, 2, 1, 4, 64, dtype, 5)
    q = q.clone()
    q[0, 0, 1, 3] = float("nan")
    q[0, 1, 2, 40] = float("inf")
    got, want = rotary(q, k, cos, sin)[0], HF(q, k, cos, sin)[0]
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(torch.isinf(got), torch.isinf(want))
    assert not torch.isfinite(got[0, 0, 1]).all() and not torch.isfinite(got[0, 1, 2]).all()  # never made finite
    assert torch.isfinite(got[0, 0, 0]).all()


def test_what_the_op_refuses_is_named():
    q, k, cos, sin = _qk(1, 2, 1, 4, 8, torch.float32, 1)
    with pytest.raises(ValueError, match="all float32 or all bfloat16"):
        rotary(q.to(BF16), k, cos, sin)
    with pytest.raises(ValueError, match="all float32 or all bfloat16"):
        rotary(q.half(), k.half(), cos.half(), sin.half())
    with pytest.raises(ValueError, match=r"cos and sin must be \(B or 1, S, D\)"):
        rotary(q, k, cos[:, :2], sin)
    with pytest.raises(ValueError, match=r"k must be \(B, H, S, D\) with D even and cos's S and D"):
        rotary(q, k[:, :, :3], cos, sin)
    with pytest.raises(ValueError, match=r"q must be \(B, H, S, D\) with D even"):
        rotary(q[..., :7], k[..., :7], cos[..., :7], sin[..., :7])


def _interleaved(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """An embedding of another formula (GPT-J's pairs side by side) with transformers' signature."""
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def emb(x):
        return x * c + torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2) * s

    return emb(q), emb(k)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_a_tiny_llamas_rotary_is_the_op_and_its_logits_stay(dtype, monkeypatch):
    from tests.tiny_models import tiny_model

    model = tiny_model("llama").to(dtype).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    what = fuse_rotary(model, torch.device("cpu"))
    assert what == ("transformers.models.llama.modeling_llama.apply_rotary_pos_emb computed by Magnetar's one-pass "
                    "op on CPU tensors")
    assert modeling_llama.apply_rotary_pos_emb is not HF and modeling_llama.apply_rotary_pos_emb._magnetar_own is HF
    calls = []
    real = ROTARY_OP.load("cpu")

    class Counting:
        def rotary(self, x, *a):
            calls.append(tuple(x.shape))
            return real.rotary(x, *a)

    monkeypatch.setattr(ROTARY_OP, "load", lambda device: Counting())
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(after, before)  # the function's values, bit for bit
    assert len(calls) == 2 * model.config.num_hidden_layers  # q and k of every layer
    assert fuse_rotary(model, torch.device("cpu")) == what  # a second engine finds it there
    calls.clear()  # under autograd the function itself runs: a graph to differentiate
    q, k, cos, sin = _qk(1, 2, 1, 3, 16, dtype, 2)
    out = modeling_llama.apply_rotary_pos_emb(q.requires_grad_(), k, cos, sin)
    assert out[0].grad_fn is not None and not calls
    with torch.no_grad():  # more arguments than (q, k, cos, sin) -- unsqueeze_dim by position: the function itself
        modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, 1)
    assert not calls
    assert restore_rotary(model) == ["transformers.models.llama.modeling_llama"]
    assert modeling_llama.apply_rotary_pos_emb is HF


def test_a_function_of_another_formula_keeps_its_own(monkeypatch):
    from tests.tiny_models import tiny_model

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", _interleaved)
    model = tiny_model("llama").eval()
    assert fuse_rotary(model, torch.device("cpu")) is None
    assert modeling_llama.apply_rotary_pos_emb is _interleaved
    assert fuse_rotary(model, torch.device("meta")) is None  # another device: nothing to do


def test_bench_rotary_times_both_and_counts_what_differs(capsys):
    summary = load_benchmark("bench_rotary").main(["--heads", "2", "--kv-heads", "1", "--head-dim", "32",
                                                   "--tokens", "1", "70", "--warmup", "0", "--repeats", "2"])
    rows = {(r["dtype"], r["tokens"], r["impl"]): r for r in summary["rows"]}
    assert set(rows) == {(d, n, i) for d in ("bfloat16", "float32") for n in (1, 70) for i in ("hf", "magnetar")}
    assert all(r["us"] > 0 and r["differ_from_hf"] == 0 for r in rows.values())
    assert rows[("bfloat16", 70, "magnetar")]["elements"] == 3 * 70 * 32
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1]) == summary and "| bfloat16 | 70 | 1 x 2 x 70 x 32 | magnetar |" in "\n".join(out)
    with pytest.raises(SystemExit):
        load_benchmark("bench_rotary").main(["--head-dim", "7"])
    assert "--head-dim even" in capsys.readouterr().err
