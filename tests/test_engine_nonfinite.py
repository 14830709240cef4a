"""runtime.check_finite (hardening issue, item 2, the engine's side): NaN in the weights or the KV never becomes
plausible tokens -- every rank raises NonFiniteError naming the phase, the first layer and the CP rank."""
from __future__ import annotations

import copy

import pytest
import torch

import magnetar
from magnetar.engine.finite import NonFiniteError
from tests.dist_utils import run_distributed
from tests.tiny_models import tiny_model

L, Q = 40, 4


def _ids(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (L,), generator=g), torch.randint(0, 256, (Q,), generator=g)


def _poison_v(model, layer: int) -> None:
    """NaN in one output row of ``layer``'s value projection: that layer's attention output turns NaN."""
    with torch.no_grad():
        model.model.layers[layer].self_attn.v_proj.weight[0] = float("nan")


@pytest.mark.parametrize("method,cp", [("dense", 1), ("star", 2), ("pulsar", 2), ("ring", 2)])
def test_nan_weights_fail_in_phase1_naming_the_layer(method, cp):
    model = tiny_model("llama", seed=1)
    _poison_v(model, 1)
    eng = magnetar.init_inference(model, deepspeed_inference=False, method=method, cp_size=cp, simulate=cp > 1)
    ctx, q = _ids()
    with pytest.raises(NonFiniteError, match=r"non-finite values in Phase 1: the first non-finite attention output "
                                             r"is layer 1 on CP rank 0.*--check-finite false"):
        eng.generate(ctx, q, max_new_tokens=2)


def test_check_finite_off_lets_the_nan_through():
    """The switch works both ways: with the check off the same model decodes (from NaN logits) without error."""
    model = tiny_model("llama", seed=1)
    _poison_v(model, 1)
    eng = magnetar.init_inference(model, deepspeed_inference=False, check_finite=False)
    res = eng.generate(*_ids(), max_new_tokens=1, return_logits=True)
    assert torch.isnan(res.first_token_logits).all()


def _poison_shard_after_phase1(monkeypatch, on_rank: int, layer: int, which: str = "v"):
    """Wrap the engine's Phase 1 so that rank ``on_rank``'s context KV (``which``, k or v, of ``layer``) holds a NaN
    afterwards."""
    import magnetar.engine.encode as engine_mod  # where Phase 1 runs

    real = engine_mod.run_phase1

    def poisoned(model, config, plan, *a, **kw):
        res = real(model, config, plan, *a, **kw)
        if plan.cp_rank == on_rank:
            kv = res.shard.layers[layer]
            with torch.inference_mode():  # the shard's tensors are inference tensors
                t = getattr(kv, which).clone()
                t[..., 0, :] = float("nan")
                setattr(kv, which, t)
        return res

    monkeypatch.setattr(engine_mod, "run_phase1", poisoned)


@pytest.mark.parametrize("which", ["k", "v"])
def test_nan_in_the_context_kv_fails_in_phase2_simulated(monkeypatch, which):
    model = tiny_model("llama", seed=2)
    ctx, q = _ids(2)
    _poison_shard_after_phase1(monkeypatch, on_rank=1, layer=1, which=which)
    eng = magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, method="star", cp_size=2,
                                  simulate=True)
    with pytest.raises(NonFiniteError, match=r"non-finite logits in Phase 2 \(the query\): the first non-finite "
                                             r"attention output is layer 1 on CP rank 0"):  # one process: rank 0
        eng.generate(ctx, q, max_new_tokens=2)
    scorer = magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, method="star", cp_size=2,
                                     simulate=True)
    with pytest.raises(NonFiniteError, match=r"Phase 2 \(scoring tokens 0\.\.3\).*layer 1"):
        scorer.score(ctx, q)


def _distributed_worker(rank, world):
    mp = pytest.MonkeyPatch()
    try:
        _poison_shard_after_phase1(mp, on_rank=1, layer=1, which="k")  # a NaN key: the merge must not drop it
        eng = magnetar.init_inference(tiny_model("llama", seed=2), deepspeed_inference=False, method="star",
                                      cp_size=world, timeout_s=30)
        with pytest.raises(NonFiniteError, match=r"Phase 2 \(the query\): the first non-finite attention output is "
                                                 r"layer 1 on CP rank 1;"):
            eng.generate(*_ids(2), max_new_tokens=2)
    finally:
        mp.undo()


def test_nan_in_one_ranks_kv_fails_on_every_rank_naming_that_rank():
    run_distributed(_distributed_worker, 2)


@pytest.mark.parametrize("rows", [4, 4096])  # a decode step's few rows; a query's many (read at once on a CPU)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_layer_flags_are_exact(dtype, rows):
    """LayerFlags: each layer's outputs summed (on a CPU in their own dtype, the exact test where that sum is not
    finite; elsewhere in float64) -- flagged exactly when an element is NaN or +-inf,
    however large the finite values (float64 outputs, whose finite values could overflow a sum, are tested
    element by element); records add up over segments."""
    from magnetar.engine.finite import LayerFlags

    big = torch.finfo(dtype).max
    flags = LayerFlags(6, "cpu")
    flags.record(0, torch.full((2, 3, rows, 8), big, dtype=dtype))  # finite: its sum must not false-alarm
    flags.record(0, torch.full((1, 3, 1, 8), big, dtype=dtype))
    flags.record(1, torch.full((2, 3, rows, 8), -big, dtype=dtype))
    assert flags.first() is None
    for layer, bad in ((4, float("inf")), (3, float("-inf")), (5, float("nan"))):
        out = torch.zeros(1, 2, rows, 8, dtype=dtype)
        out[0, 1, rows - 1, 2] = bad
        flags.record(layer, out)
    assert flags.first() == 3
    mixed = torch.zeros(1, 1, rows, 16, dtype=dtype)
    mixed[..., 0, 0], mixed[..., 0, 1] = float("inf"), float("-inf")  # +inf and -inf do not cancel
    flags.record(2, mixed)
    assert flags.first() == 2
