"""Hybrid layers (issue 30): Star's and Pulsar's ``exact_layers`` -- in the chosen layers every block attends
exactly to every earlier block. No layer is the method itself, every layer is dense Phase 1 whatever the prefix,
real ranks (the KV exchanged as ring attention does) equal simulated ones, the cost model counts the exact layers'
attention and traffic, and what cannot apply is refused by name before any compute."""
from __future__ import annotations

import copy

import pytest
import torch

import magnetar
from magnetar.config import EngineConfig, parse_exact_layers
from magnetar.eval.cost import _fmt, estimate, format_table
from magnetar.models.dims import ModelDims
from tests.conftest import assert_close, assert_differs
from tests.dist_utils import run_distributed
from tests.tiny_models import reference, tiny_model

L, Q = 160, 4


def _ids():
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 256, (L,), generator=g), torch.randint(0, 256, (Q,), generator=g)


def _run(model, ctx, q, **kw):
    eng = magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, simulate=True, **kw)
    return eng.generate(ctx, q, max_new_tokens=3, return_logits=True)


def test_the_spec_names_layers():
    assert parse_exact_layers("0-3, 29", 30) == (0, 1, 2, 3, 29)
    assert parse_exact_layers("every:4", 10) == (0, 4, 8)
    assert parse_exact_layers("all", 3) == (0, 1, 2) and parse_exact_layers("", 3) == ()
    assert parse_exact_layers("every:4") == ()  # syntax only, before the model is known


@pytest.mark.parametrize("method,kw", [("star", dict(anchor_size=8)), ("star", dict(anchor_size=0)),
                                      ("star", dict(anchor_size=8, halo_size=20)),
                                      ("pulsar", dict(sink_size=4, chunk_size=8, summary_budget=0.25))],
                         ids=["star", "star-no-anchor", "star-halo", "pulsar"])
def test_limits_every_layer_exact_is_dense_and_none_is_the_method(method, kw):
    model = tiny_model("llama", seed=3, num_hidden_layers=4)
    ctx, q = _ids()
    ref_logits, ref_tokens = reference(model, ctx, q, 3)
    full = _run(model, ctx, q, method=method, cp_size=4, exact_layers="all", **kw)
    assert_close(full.first_token_logits, ref_logits, what="logits", msg=f"{method} {kw}: every layer exact")
    assert full.token_ids == ref_tokens and full.context_kv_tokens_per_rank == [40] * 4
    # the last layer's Phase-1 attention shapes no kept KV: every layer but it exact is dense as well
    but_last = _run(model, ctx, q, method=method, cp_size=4, exact_layers="0-2", **kw)
    assert torch.equal(but_last.first_token_logits, full.first_token_logits)
    plain = _run(model, ctx, q, method=method, cp_size=4, **kw)
    none = _run(model, ctx, q, method=method, cp_size=4, exact_layers="", **kw)
    assert torch.equal(none.first_token_logits, plain.first_token_logits)  # no exact layer: the method itself
    some = _run(model, ctx, q, method=method, cp_size=4, exact_layers="0", **kw)
    assert_differs(some.first_token_logits, plain.first_token_logits, msg="one exact layer changes the method")
    assert_differs(some.first_token_logits, ref_logits, msg="one exact layer of four is not dense")


def _real_ranks(rank, world, model, ctx, q, want_logits, want_tokens):
    eng = magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, method="star", cp_size=world,
                                  anchor_size=8, exact_layers="0", timeout_s=60)
    res = eng.generate(ctx, q, max_new_tokens=3, return_logits=True)
    assert_close(res.first_token_logits, want_logits, what="logits", msg=f"rank {rank}: real = simulated ranks")
    assert res.token_ids == want_tokens


def test_real_ranks_exchange_the_blocks_as_simulated_ranks_read_them():
    model = tiny_model("llama", seed=3, num_hidden_layers=3)
    ctx, q = _ids()
    sim = _run(model, ctx, q, method="star", cp_size=2, anchor_size=8, exact_layers="0")
    run_distributed(_real_ranks, 2, model, ctx, q, sim.first_token_logits, sim.token_ids)


def test_cost_model_counts_exact_layers_as_ring_does():
    dims = ModelDims(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256,
                     windows=(None,) * 4, tied_embeddings=True)
    ring = estimate(dims, EngineConfig.create(method="ring", cp_size=4, zigzag=False, dtype="float32"), 4096)
    full = estimate(dims, EngineConfig.create(method="star", cp_size=4, anchor_size=0, exact_layers="all",
                                              dtype="float32"), 4096)
    alone = estimate(dims, EngineConfig.create(method="star", cp_size=4, anchor_size=0, dtype="float32"), 4096)
    # layers 0-2 as contiguous ring, the last one local (it shapes no kept KV), per rank
    assert full.phase1_attention_pairs == [r * 3 // 4 + a // 4 for r, a in zip(ring.phase1_attention_pairs,
                                                                              alone.phase1_attention_pairs)]
    assert full.phase1_comm_bytes_per_layer == ring.phase1_comm_bytes_per_layer
    assert full.phase1_comm_layers == 3 and ring.phase1_comm_layers == 4
    star = estimate(dims, EngineConfig.create(method="star", cp_size=4, anchor_size=64, dtype="float32"), 4096)
    half = estimate(dims, EngineConfig.create(method="star", cp_size=4, anchor_size=64, exact_layers="0,2",
                                              dtype="float32"), 4096)
    assert star.phase1_comm_layers == 0 and half.phase1_comm_layers == 2
    assert star.critical_phase1_flops < half.critical_phase1_flops
    assert half.phase1_linear_flops == star.phase1_linear_flops  # the same tokens, more keys in two layers
    assert any("exact_layers: 2 of 4 layers" in a for a in half.assumptions)
    table = format_table([ring, star, half], baseline="ring")  # the KV a rank sends in Phase 1: all, none, 2 layers
    traffic = [row.split(" | ")[10] for row in table.splitlines()[2:]]
    per_layer = max(half.phase1_comm_bytes_per_layer)
    assert traffic == [_fmt(4 * max(ring.phase1_comm_bytes_per_layer), "B"), "0 B", _fmt(2 * per_layer, "B")]


def test_what_cannot_apply_is_refused_by_name():
    with pytest.raises(ValueError, match=r"exact_layers \(--exact-layers\): 'x' is not a layer spec"):
        EngineConfig.create(method="star", exact_layers="x")
    with pytest.raises(ValueError, match='exact_layers is an option of star / pulsar .*or exact_layers "", not '
                                         "method 'ring'"):
        EngineConfig.create(method="ring", cp_size=2, exact_layers="0")
    with pytest.raises(ValueError, match="exact_layers.*sparse prefill"):
        EngineConfig.create(method="star", cp_size=2, exact_layers="0", prefill_policy="oracle")
    model = tiny_model("llama", seed=3)  # two layers
    with pytest.raises(ValueError, match=r"exact_layers.*layer 2 is outside the model: it has 2 layers \(0-1\)"):
        magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, simulate=True, method="star",
                                cp_size=4, exact_layers="0,2")
    eng = magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, simulate=True, method="star",
                                  cp_size=2, block_size=40, exact_layers="0")
    ctx, q = _ids()
    with pytest.raises(ValueError, match=r"exact_layers needs one block per rank .* block_size 40 gives 4 blocks"):
        eng.generate(ctx, q, max_new_tokens=1)
