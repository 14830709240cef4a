"""merge_states (torch path) against the fp64 reference of attention over the union of the parts' keys."""
from __future__ import annotations

import pytest
import torch

from magnetar.ops import merge_states
from tests.conftest import assert_close
from tests.reference import dense_attention_fp64


def _split_states(q, k, v, n_parts, gen, dtype, empty_parts=()):
    """Partial states of q over a random split of the keys into n_parts (some parts may be empty)."""
    Sk = k.shape[2]
    owner = torch.randint(0, n_parts, (Sk,), generator=gen)
    for p in empty_parts:
        owner[owner == p] = (p + 1) % n_parts if n_parts > 1 else p
    k_pos = torch.arange(Sk)
    q_pos = torch.full((q.shape[2],), Sk)  # queries after every key: plain softmax over the union
    outs, lses = [], []
    for p in range(n_parts):
        idx = (owner == p).nonzero().flatten()
        o, l = dense_attention_fp64(q, k[:, :, idx], v[:, :, idx], q_pos=q_pos, k_pos=k_pos[idx])
        outs.append(o.to(dtype))
        lses.append(l.float())
    full = dense_attention_fp64(q, k, v, q_pos=q_pos, k_pos=k_pos)
    return outs, lses, full


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_parts", [1, 2, 3, 5, 8])
def test_merge_equals_attention_over_union(dtype, n_parts, seeded):
    q = torch.randn(2, 4, 6, 16, generator=seeded)
    k = torch.randn(2, 4, 40, 16, generator=seeded) * 3
    v = torch.randn(2, 4, 40, 16, generator=seeded)
    empty = (1,) if n_parts > 2 else ()
    outs, lses, (ref_out, ref_lse) = _split_states(q, k, v, n_parts, seeded, dtype, empty)
    for arg in ((outs, lses), (torch.stack(outs), torch.stack(lses))):  # list and stacked forms
        out, lse = merge_states(*arg, backend="torch")
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert_close(out, ref_out, dtype, "out", f"N={n_parts}")
        assert_close(lse, ref_lse, dtype, "lse", f"N={n_parts}")


def test_extreme_lse_differences(seeded):
    # lse gaps of 1e4 would overflow exp(delta); parts with huge lse must dominate exactly
    o = torch.randn(3, 1, 2, 5, 8, generator=seeded)
    lse = torch.tensor([8e4, 8e4 - 1e4, -8e4]).view(3, 1, 1, 1).expand(3, 1, 2, 5).contiguous()
    out, l = merge_states(o, lse, backend="torch")
    assert torch.isfinite(out).all() and torch.isfinite(l).all()
    assert_close(out, o[0], torch.float32)
    assert_close(l, lse[0], torch.float32, "lse")
    # two equal huge parts: lse + log 2, mean of outputs
    out, l = merge_states(o[:2], torch.full((2, 1, 2, 5), 3e4), backend="torch")
    assert_close(out, o[:2].mean(0), torch.float32)
    assert_close(l, torch.full((1, 2, 5), 3e4 + torch.log(torch.tensor(2.0)).item()), torch.float32, "lse")


def test_nonfinite_lse_parts_are_empty(seeded):
    # issue 19: only a -inf part is empty; a +inf or NaN part is non-finite input and poisons the row
    o = torch.randn(4, 1, 1, 3, 4, generator=seeded)
    lse = torch.tensor([0.5, float("inf"), float("nan"), float("-inf")]).view(4, 1, 1, 1).expand(4, 1, 1, 3)
    o[1:] = float("nan")  # garbage behind empty parts must not leak
    out, l = merge_states(o[[0, 3]], lse[[0, 3]].contiguous(), backend="torch")
    assert_close(out, o[0], torch.float32)
    assert_close(l, torch.full((1, 1, 3), 0.5), torch.float32, "lse")
    out, l = merge_states(o, lse.contiguous(), backend="torch")
    assert torch.isnan(out).all() and torch.isnan(l).all()


def test_all_empty_rows_give_zero_and_neg_inf(seeded):
    o = torch.randn(3, 1, 2, 4, 8, generator=seeded)
    lse = torch.randn(3, 1, 2, 4, generator=seeded)
    lse[:, :, :, 1] = float("-inf")
    lse[0, :, :, 2], lse[1, :, :, 2], lse[2, :, :, 2] = float("-inf"), float("inf"), float("nan")
    out, l = merge_states(o, lse, backend="torch")
    assert (out[:, :, 1] == 0).all() and torch.isneginf(l[:, :, 1]).all()
    # issue 19: row 2 has a +inf and a NaN part, which are not empty: (NaN, NaN)
    assert torch.isnan(out[:, :, 2]).all() and torch.isnan(l[:, :, 2]).all()
    assert torch.isfinite(l[:, :, [0, 3]]).all()


def test_bad_inputs():
    with pytest.raises(ValueError, match="at least one"):
        merge_states([], [])
    with pytest.raises(ValueError, match=r"\(N, B, H, S\)"):
        merge_states(torch.randn(2, 1, 1, 3, 4), torch.randn(2, 1, 1, 4))
    with pytest.raises(ValueError, match="stacked"):
        merge_states(torch.randn(2, 3, 4), torch.randn(2, 3))
    with pytest.raises(ValueError, match="backend must be one of"):
        merge_states(torch.randn(2, 1, 1, 3, 4), torch.randn(2, 1, 1, 3), backend="cuda")
