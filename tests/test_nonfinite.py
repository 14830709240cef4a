"""NaN / +-inf inputs are never turned into finite output: attention (every CPU backend, every mask path), the
merge (torch and the fused op) and ring attention all follow the one rule of docs/design.md.

Expected NaN patterns are computed here from the corrupted tensors and an explicit visibility matrix (written
without the library's code), and asserted exactly: a row is either NaN in every element or in none.
"""
from __future__ import annotations

import math

import pytest
import torch

import magnetar.ops.attention as attention_mod
from magnetar.ops import attention_with_lse, fused_merge, merge_states, merge_states_torch, runs
from magnetar.ops import backends as backends_mod
from magnetar.ops.backends.reference import attend_block, fold_gqa, unfold_gqa
from magnetar.parallel import contiguous_indices, init_groups, ring_attention, shard, zigzag_indices
from tests.conftest import assert_close
from tests.dist_utils import run_distributed

CPU_BACKENDS = ["torch", "tiled", "cpu_flash", "flex"]  # flash_attn is CUDA-only; see test_a_backend_blind_to_nan_*
NAN, INF = float("nan"), float("inf")
B, HQ, HKV, D = 2, 4, 2, 8  # GQA: query heads 0, 1 read KV head 0; heads 2, 3 read KV head 1

# Mask cases: kwargs of attention_with_lse, and `planner` (False: the run planner is switched off so
# positions take the explicit-mask path). Anchor + block positions, a query before every key (an empty row)
# and a key after every query (masked for the whole call).
STAR_K = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 20])
STAR_Q = torch.tensor([-1, 8, 9, 10, 11, 12, 13])
CASES = {
    "full": {"Sq": 5, "Sk": 9, "kw": {"causal": False}},
    "decode": {"Sq": 1, "Sk": 9, "kw": {}},
    "bottom_right": {"Sq": 5, "Sk": 9, "kw": {}},  # cpu_flash: visible prefix + causal square, merged
    "square": {"Sq": 7, "Sk": 7, "kw": {}},
    "positions_mask": {"Sq": 7, "Sk": 11, "kw": {"q_pos": STAR_Q, "k_pos": STAR_K}, "planner": False},
    "pieces": {"Sq": 7, "Sk": 11, "kw": {"q_pos": STAR_Q, "k_pos": STAR_K}},
    "per_sequence": {"Sq": 6, "Sk": 10, "kw": {
        "q_pos": torch.tensor([[3, 5, 7, 9, 11, 13], [-2, 0, 4, 6, 8, 15]]),
        "k_pos": torch.tensor([[0, 2, 4, 6, 8, 10, 12, 14, 16, 18], [18, 16, 14, 12, 10, 8, 6, 4, 2, 0]]),
    }},
    "window": {"Sq": 6, "Sk": 12, "kw": {"window": 3}},
}
CORRUPTIONS = ["q_nan", "q_inf", "k_nan_visible", "k_inf_visible", "k_nan_masked", "v_nan_visible",
               "v_inf_masked"]


def _visibility(case) -> torch.Tensor:
    """``(B, Sq, Sk)`` bool: which keys each query row sees (the documented rule, built explicitly)."""
    Sq, Sk, kw = case["Sq"], case["Sk"], case["kw"]
    if kw.get("causal", True) is False:
        return torch.ones(B, Sq, Sk, dtype=torch.bool)
    qp = kw.get("q_pos", torch.arange(Sk - Sq, Sk))
    kp = kw.get("k_pos", torch.arange(Sk))
    qp, kp = qp.expand(B, Sq), kp.expand(B, Sk)
    vis = kp[:, None, :] <= qp[:, :, None]
    if "window" in kw:
        vis &= kp[:, None, :] > qp[:, :, None] - kw["window"]
    return vis


def _pick_keys(vis: torch.Tensor) -> tuple[int, int, list[int] | None]:
    """A key some rows of batch 0 see and some do not (else any seen key), one for batch 1, and per batch a key
    no row of that sequence sees (None if some sequence sees every key)."""
    def partly(b):
        seen = vis[b].sum(0)
        part = ((seen > 0) & (seen < vis.shape[1])).nonzero().flatten()
        return int(part[0]) if part.numel() else int((seen > 0).nonzero().flatten()[-1])

    unseen = [(~vis[b].any(0)).nonzero().flatten() for b in range(vis.shape[0])]
    masked = [int(u[0]) for u in unseen] if all(u.numel() for u in unseen) else None
    return partly(0), partly(1), masked


def _corrupt(kind, q, k, v, vis):
    """Put the non-finite values of ``kind`` in copies of q, k, v."""
    q, k, v = q.clone(), k.clone(), v.clone()
    j0, j1, jm = _pick_keys(vis)
    seen_rows = vis.any(-1)  # (B, Sq)
    i0 = int(seen_rows[0].nonzero().flatten()[0])
    if kind == "q_nan":
        q[0, 1, i0, 3] = NAN
        empty = (~seen_rows[1]).nonzero().flatten()
        q[1, 2, int(empty[0]) if empty.numel() else -1, 0] = NAN  # a NaN query that sees nothing: stays (0, -inf)
    elif kind == "q_inf":
        q[1, 3, int(seen_rows[1].nonzero().flatten()[-1]), 0] = INF
        q[0, 0, i0, 5] = -INF
    elif kind == "k_nan_visible":
        k[0, 0, j0, 1] = NAN
    elif kind == "k_inf_visible":
        k[1, 1, j1, 0] = INF
        k[0, 1, j0, 4] = -INF  # -inf makes some scores -inf: never a silently dropped key
    elif kind == "k_nan_masked":
        for b, j in enumerate(jm):
            k[b, :, j] = NAN
            v[b, :, j] = NAN
    elif kind == "v_nan_visible":
        v[0, 1, j0, 2] = NAN
        v[1, 0, j1, 6] = -INF
    elif kind == "v_inf_masked":
        for b, j in enumerate(jm):
            v[b, :, j, 0] = INF
    return q, k, v


def _expected(q, k, v, vis):
    """(rows whose out is NaN, rows whose lse is NaN), both ``(B, Hq, Sq)``, from the rule; vis ``(B, Sq, Sk)``."""
    group = q.shape[1] // k.shape[1]
    bad_q = ~torch.isfinite(q).all(-1)  # (B, Hq, Sq)
    bad_k = (~torch.isfinite(k).all(-1)).repeat_interleave(group, dim=1)  # (B, Hq, Sk)
    bad_v = (~torch.isfinite(v).all(-1)).repeat_interleave(group, dim=1)
    sees = vis[:, None].expand(-1, q.shape[1], -1, -1).float()  # (B, Hq, Sq, Sk)
    lse_nan = (bad_q & vis.any(-1)[:, None]) | ((sees @ bad_k.float().unsqueeze(-1)).squeeze(-1) > 0)
    out_nan = lse_nan | ((sees @ bad_v.float().unsqueeze(-1)).squeeze(-1) > 0)
    return out_nan, lse_nan


def _assert_pattern(out, lse, out_nan, lse_nan, msg):
    assert torch.equal(torch.isnan(out).all(-1), out_nan), f"{msg}: rows with an all-NaN out differ from the rule"
    assert torch.equal(torch.isnan(out).any(-1), out_nan), f"{msg}: a row is partly NaN"
    assert torch.isfinite(out[~out_nan]).all(), f"{msg}: non-finite values outside the NaN rows"
    assert torch.equal(torch.isnan(lse), lse_nan), f"{msg}: NaN lse rows differ from the rule"
    assert not torch.isposinf(lse).any(), f"{msg}: +inf lse"


def _run(q, k, v, backend, case, monkeypatch):
    if case.get("planner", True) is False:
        monkeypatch.setattr(runs, "MAX_RUN_PAIRS", 0)
    return attention_with_lse(q, k, v, backend=backend, **case["kw"])


def _case_kinds():
    """Every (case, corruption) pair; the masked-key kinds only where some key is invisible to the whole call."""
    return [(c, kind) for c in CASES for kind in CORRUPTIONS
            if not kind.endswith("masked") or _pick_keys(_visibility(CASES[c]))[2] is not None]


@pytest.mark.parametrize("case_name,kind", _case_kinds())
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_attention_nonfinite_rows(backend, case_name, kind, monkeypatch):
    case = CASES[case_name]
    gen = torch.Generator().manual_seed(sum(map(ord, case_name + kind)))
    q = torch.randn(B, HQ, case["Sq"], D, generator=gen)
    k = torch.randn(B, HKV, case["Sk"], D, generator=gen)
    v = torch.randn(B, HKV, case["Sk"], D, generator=gen)
    vis = _visibility(case)
    qb, kb, vb = _corrupt(kind, q, k, v, vis)
    msg = f"[{backend} {case_name} {kind}]"
    out, lse = _run(qb, kb, vb, backend, case, monkeypatch)
    out_nan, lse_nan = _expected(qb, kb, vb, vis)
    if kind.endswith("masked"):
        assert not out_nan.any() and not lse_nan.any()
    else:
        assert out_nan.any() and not out_nan.all(), f"{msg}: the case must corrupt some rows and spare others"
    _assert_pattern(out, lse, out_nan, lse_nan, msg)
    # rows untouched by the rule equal the clean call (a masked key changes nothing at all); with a NaN value
    # vector the lse is the ordinary one
    ref_out, ref_lse = _run(q, k, v, backend, case, monkeypatch)
    if kind.endswith("masked"):
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse), f"{msg}: a masked key changed the result"
    assert_close(out[~out_nan], ref_out[~out_nan], torch.float32, "out", msg)
    assert_close(lse[~lse_nan], ref_lse[~lse_nan], torch.float32, "lse", msg)
    empty = ~vis.any(-1)[:, None].expand(B, HQ, -1)
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all(), f"{msg}: empty rows must stay (0, -inf)"


def test_pieces_case_takes_the_run_planner(monkeypatch):
    calls = []
    real = attention_mod._attend_pieces
    monkeypatch.setattr(attention_mod, "_attend_pieces", lambda *a: calls.append(1) or real(*a))
    q, k, v = torch.randn(B, HQ, 7, D), torch.randn(B, HKV, 11, D), torch.randn(B, HKV, 11, D)
    k[0, 0, 5] = NAN
    attention_with_lse(q, k, v, **CASES["pieces"]["kw"])
    assert len(calls) == 2, "fast pass and the exact pass must both go through the pieces"
    calls.clear()
    monkeypatch.setattr(runs, "MAX_RUN_PAIRS", 0)
    attention_with_lse(q, k, v, **CASES["pieces"]["kw"])
    assert not calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_low_precision_nan_key(backend, dtype):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, h, s, D, generator=gen).to(dtype) for h, s in ((HQ, 5), (HKV, 9), (HKV, 9)))
    k[1, 1, 6, 0] = NAN
    out, lse = attention_with_lse(q, k, v, backend=backend)
    vis = _visibility(CASES["bottom_right"])
    _assert_pattern(out, lse, *_expected(q, k, v, vis), f"[{backend} {dtype}]")


def test_finite_inputs_never_take_the_exact_path(monkeypatch):
    def boom(*a, **kw):
        raise AssertionError("finite inputs must stay on the fast path")

    monkeypatch.setattr(attention_mod, "attend_nonfinite", boom)
    gen = torch.Generator().manual_seed(2)
    for backend in CPU_BACKENDS:
        for case in CASES.values():
            q = torch.randn(B, HQ, case["Sq"], D, generator=gen) * 30  # large finite logits
            k = torch.randn(B, HKV, case["Sk"], D, generator=gen) * 30
            v = torch.randn(B, HKV, case["Sk"], D, generator=gen)
            attention_with_lse(q, k, v, backend=backend, **case["kw"])


class _NanBlindBackend:
    """Behaves like FlashAttention on a NaN row (lse +inf) and like an additive-mask kernel on masked keys
    (a NaN anywhere in K poisons every row): the front end must still give the rule's answer."""

    name = "nan_blind"
    device_types = None

    def validate(self, call):
        return []

    def forward(self, call):
        qf = fold_gqa(call.q, call.k.shape[1])
        s = torch.matmul(qf, call.k.transpose(-1, -2)) * call.scale
        if call.mask_kind != "full":
            vis = call.visible(q_pos=call.q_pos.repeat(call.group))
            s = s + torch.zeros_like(s).masked_fill(~vis, -INF)  # additive mask: NaN + -inf = NaN
        lse = torch.logsumexp(s, dim=-1)
        out = torch.matmul(torch.softmax(s, dim=-1), call.v)
        lse = torch.where(torch.isnan(lse), torch.full_like(lse, INF), lse)
        hq = call.q.shape[1]
        return unfold_gqa(out, hq), unfold_gqa(lse, hq)


@pytest.mark.parametrize("kind", ["k_nan_visible", "k_nan_masked", "q_nan", "v_nan_visible"])
def test_a_backend_blind_to_nan_is_normalised_by_the_front_end(kind, monkeypatch):
    """flash_attn cannot run here; like any registered backend it only ever sees finite inputs from the exact
    path, so its own NaN conventions (lse +inf) never reach the caller."""
    monkeypatch.setitem(backends_mod._REGISTRY, "nan_blind", _NanBlindBackend)
    try:
        _check_nan_blind(kind, monkeypatch)
    finally:
        backends_mod._INSTANCES.pop("nan_blind", None)


def _check_nan_blind(kind, monkeypatch):
    case = CASES["positions_mask"]
    gen = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(B, HQ, 7, D, generator=gen), torch.randn(B, HKV, 11, D, generator=gen), torch.randn(
        B, HKV, 11, D, generator=gen)
    vis = _visibility(case)
    qb, kb, vb = _corrupt(kind, q, k, v, vis)
    out, lse = _run(qb, kb, vb, "nan_blind", case, monkeypatch)
    _assert_pattern(out, lse, *_expected(qb, kb, vb, vis), f"[nan_blind {kind}]")
    ref_out, ref_lse = _run(qb, kb, vb, "torch", case, monkeypatch)
    assert torch.equal(torch.isnan(out), torch.isnan(ref_out))
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse))


def test_reference_block_keeps_nan_rows():
    """The torch backends' block kernel (also tiled's) must not report a NaN row as empty (lse -inf)."""
    q, k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
    q[0, 0, 1, 0] = NAN
    out, lse = attend_block(q, k, v, 0.5, None)
    assert torch.isnan(lse[0, 0, 1]) and torch.isnan(out[0, 0, 1]).all()
    assert torch.isfinite(lse[0, 0, [0, 2]]).all()


# ------------------------------------------------------------------------------------------------ merge


@pytest.fixture(scope="module")
def fused_cpu():
    ok = fused_merge.fused_merge_available("cpu")
    assert ok, ("the fused merge_states CPU op failed to build/load: "
                f"{fused_merge.fused_merge_unavailable_reason('cpu')}")
    return "fused"


def _merge_case():
    """4 parts x 8 rows (B=1, H=1), D=6: each row's lse parts and the expected outcome of the rule."""
    L = [  # (part lses, expect): "ok" finite merge, "empty" (0, -inf), "nan" (NaN, NaN)
        ([0.5, -1.0, 2.0, -INF], "ok"),
        ([0.5, NAN, 2.0, 1.0], "nan"),  # NaN part: no longer an empty part
        ([-INF, -INF, INF, -INF], "nan"),  # +inf part
        ([-INF, -INF, -INF, -INF], "empty"),
        ([-INF, NAN, -INF, -INF], "nan"),  # NaN beats empty
        ([0.0, -1e4, -INF, -INF], "ok"),  # part 1 underflows to weight 0; its out holds a NaN (column 3)
        ([3.0, -INF, -INF, -INF], "ok"),  # empty parts with NaN outs: never read
        ([1e4, INF, -1e4, NAN], "nan"),
    ]
    lses = torch.tensor([row for row, _ in L]).T.reshape(4, 1, 1, 8).contiguous()
    gen = torch.Generator().manual_seed(9)
    outs = torch.randn(4, 1, 1, 8, 6, generator=gen)
    outs[1, 0, 0, 5, 3] = NAN  # live part with ~0 weight: NaN in column 3 stays NaN
    outs[1:, 0, 0, 6] = NAN  # behind empty parts
    outs[3, 0, 0, 0] = INF  # behind an empty part
    outs[:, 0, 0, 3] = NAN  # all-empty row: never read
    return outs, lses, [e for _, e in L]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("merge_backend", ["torch", "fused"])
def test_merge_nonfinite_parts(merge_backend, dtype, fused_cpu):
    outs, lses, expect = _merge_case()
    out, lse = merge_states(outs.to(dtype), lses, backend=merge_backend)
    msg = f"[merge {merge_backend} {dtype}]"
    for r, e in enumerate(expect):
        o, l = out[0, 0, r].float(), lse[0, 0, r].item()
        if e == "nan":
            assert torch.isnan(o).all() and math.isnan(l), f"{msg} row {r}: expected (NaN, NaN), got {o}, {l}"
        elif e == "empty":
            assert (o == 0).all() and l == -INF, f"{msg} row {r}: expected (0, -inf), got {o}, {l}"
        else:
            assert math.isfinite(l), f"{msg} row {r}: lse {l}"
    assert torch.equal(torch.isnan(out[0, 0, 5]), torch.arange(6) == 3), f"{msg}: NaN column of a live part"
    assert torch.isfinite(out[0, 0, [0, 6]].float()).all()
    # the finite rows equal the merge of the finite parts only
    ok = [r for r, e in enumerate(expect) if e == "ok"]
    lses_ok = lses[..., ok].clone()
    outs_ok = outs[..., ok, :].clone().to(dtype)
    lses_ok[1, 0, 0, 1] = -INF  # the ~0-weight part of row 5 only contributes its NaN column
    ref_out, ref_lse = merge_states_torch(outs_ok, lses_ok)
    keep = ~torch.isnan(out[..., ok, :])
    assert_close(out[..., ok, :][keep], ref_out[keep], dtype, "out", msg)
    assert_close(lse[..., ok], ref_lse, dtype, "lse", msg)


def test_merge_torch_and_fused_agree_on_random_nonfinite(fused_cpu):
    gen = torch.Generator().manual_seed(12)
    N, S, Dm = 5, 400, 32
    outs = torch.randn(N, 2, 3, S, Dm, generator=gen)
    lses = torch.randn(N, 2, 3, S, generator=gen) * 4
    u = torch.rand(N, 2, 3, S, generator=gen)
    lses[u < 0.2] = -INF
    lses[(u >= 0.2) & (u < 0.23)] = NAN
    lses[(u >= 0.23) & (u < 0.25)] = INF
    outs[torch.rand(N, 2, 3, S, Dm, generator=gen) < 0.002] = NAN
    t_out, t_lse = merge_states(outs, lses, backend="torch")
    f_out, f_lse = merge_states(outs, lses, backend="fused")
    assert torch.equal(torch.isnan(t_out), torch.isnan(f_out)) and torch.equal(torch.isnan(t_lse), torch.isnan(f_lse))
    assert torch.equal(torch.isneginf(t_lse), torch.isneginf(f_lse))
    fin = torch.isfinite(t_lse)
    assert_close(f_lse[fin], t_lse[fin], torch.float32, "lse")
    keep = ~torch.isnan(t_out)
    assert_close(f_out[keep], t_out[keep], torch.float32, "out")
    poisoned = (torch.isnan(lses) | torch.isposinf(lses)).any(0)
    assert torch.equal(torch.isnan(t_lse), poisoned) and torch.isnan(t_out[poisoned]).all()


# ------------------------------------------------------------------------------------------------- ring

RING_S = 16


def _ring_inputs(kind):
    gen = torch.Generator().manual_seed(21)  # same on every rank
    q = torch.randn(1, HQ, RING_S, D, generator=gen)
    k = torch.randn(1, HKV, RING_S, D, generator=gen)
    v = torch.randn(1, HKV, RING_S, D, generator=gen)
    if kind == "k_nan":
        k[0, 0, 5, 2] = NAN  # position 5, KV head 0
    elif kind == "k_inf":
        k[0, 1, 12, 0] = -INF
    elif kind == "v_nan":
        v[0, 1, 9, 4] = NAN
    elif kind == "q_nan":
        q[0, 3, 2, 1] = NAN
    return q, k, v


def _ring_worker(rank, world):
    groups = init_groups(world)
    for kind in ("k_nan", "k_inf", "v_nan", "q_nan"):
        q, k, v = _ring_inputs(kind)
        for causal in (True, False):
            ref_out, ref_lse = attention_with_lse(q, k, v, causal=causal)
            for name, idx_fn in (("contiguous", contiguous_indices), ("zigzag", zigzag_indices)):
                idx = idx_fn(RING_S, world, rank)
                out, lse = ring_attention(shard(q, idx, 2), shard(k, idx, 2), shard(v, idx, 2),
                                          group=groups.cp_group, q_pos=idx, k_pos=idx, causal=causal,
                                          timeout=groups.timeout)
                e_out, e_lse = shard(ref_out, idx, 2), shard(ref_lse, idx, 2)
                msg = f"[rank {rank} ring {kind} {name} causal={causal}]"
                assert torch.equal(torch.isnan(out), torch.isnan(e_out)), f"{msg}: NaN pattern of out"
                assert torch.equal(torch.isnan(lse), torch.isnan(e_lse)), f"{msg}: NaN pattern of lse"
                keep = ~torch.isnan(e_out)
                assert_close(out[keep], e_out[keep], torch.float32, "out", msg)
                fin = ~torch.isnan(e_lse)
                assert_close(lse[fin], e_lse[fin], torch.float32, "lse", msg)
        # and the dense result itself follows the rule (so equal patterns are not trivially equal)
        vis = torch.arange(RING_S)[None, :] <= torch.arange(RING_S)[:, None]
        ref_out, ref_lse = attention_with_lse(q, k, v)
        out_nan, lse_nan = _expected(q, k, v, vis[None])
        _assert_pattern(ref_out, ref_lse, out_nan, lse_nan, f"[dense {kind}]")
        assert out_nan.any() and not out_nan.all()


def test_ring_attention_nonfinite_equals_dense():
    run_distributed(_ring_worker, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_the_fast_paths_finiteness_sum_sees_every_nan_and_inf(dtype):
    """all_finite sums bf16/fp32/fp64 in their own dtype (a bf16 sum has float32's range: no cast copy) and fp16 in
    float32: a NaN or an inf anywhere, of either sign, is seen; values whose fp16 sum would overflow are not a false
    alarm."""
    from magnetar.ops.nonfinite import all_finite

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 300, 64, generator=g).to(dtype).transpose(1, 2)  # strided, as a query's view is
    assert all_finite(x, x[:, :5])
    for bad in (NAN, INF, -INF):
        y = x.clone()
        y[1, 17, 4, 9] = bad
        assert not all_finite(x, y) and not all_finite(y), (dtype, bad)
    both = x.clone()
    both[0, 0, 0, 0], both[1, 1, 1, 1] = INF, -INF  # their sum is NaN: still not finite
    assert not all_finite(both)
    big = torch.full((4, 1000), 60000.0).to(dtype)  # finite; its float16 sum alone would overflow
    assert all_finite(big)
