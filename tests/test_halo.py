"""Star's and Pulsar's halo (issue 30): each block also sees the tokens just before it. It reduces to Star (Pulsar)
at 0 and to dense attention when the prefix reaches back to the context's start; bad values are refused naming
halo_size."""
from __future__ import annotations

import argparse
import copy

import pytest
import torch

import magnetar
from magnetar.config import EngineConfig
from magnetar.methods.star import star_segment
from tests.conftest import assert_close, assert_differs

from tests.tiny_models import reference, tiny_model


def _run(model, ctx, q, **kw):
    eng = magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, simulate=True, **kw)
    return eng.generate(ctx, q, max_new_tokens=3, return_logits=True)


def test_the_prefix_is_the_anchor_and_the_halo_once():
    bounds = [(0, 10), (10, 20), (20, 30)]
    cfg = EngineConfig.create(method="star", cp_size=3, anchor_size=3, halo_size=4)
    seg = star_segment(cfg, bounds, 2)
    assert seg.indices.tolist() == [0, 1, 2, 16, 17, 18, 19] + list(range(20, 30))
    assert seg.positions.tolist() == seg.indices.tolist() and seg.keep == slice(7, None)
    assert star_segment(cfg, bounds, 0).indices.tolist() == list(range(10))  # block 0: no prefix
    overlap = star_segment(EngineConfig.create(method="star", cp_size=3, anchor_size=8, halo_size=4), bounds, 1)
    assert overlap.indices.tolist()[:10] == list(range(10))  # anchor [0, 8) and halo [6, 10): each token once
    plain = EngineConfig.create(method="star", cp_size=3, anchor_size=3)
    assert torch.equal(star_segment(plain, bounds, 2).indices, torch.cat((torch.arange(3), torch.arange(20, 30))))


def test_halo_limits_star_and_dense():
    model = tiny_model("llama", seed=3)
    g = torch.Generator().manual_seed(7)
    ctx, q = torch.randint(0, 256, (160,), generator=g), torch.randint(0, 256, (4,), generator=g)
    ref_logits, ref_tokens = reference(model, ctx, q, 3)
    # two blocks, no anchor, a halo of the whole first block: block 1 sees every earlier token -- dense Phase 1
    full = _run(model, ctx, q, method="star", cp_size=2, anchor_size=0, halo_size=80)
    assert_close(full.first_token_logits, ref_logits, what="logits", msg="halo = block 0")
    assert full.token_ids == ref_tokens and full.context_kv_tokens_per_rank == [80, 80]
    # four blocks: a halo of one block is neither Star nor dense
    star = _run(model, ctx, q, method="star", cp_size=4, anchor_size=8)
    halo = _run(model, ctx, q, method="star", cp_size=4, anchor_size=8, halo_size=40)
    assert_differs(halo.first_token_logits, star.first_token_logits, msg="a halo changes the prefix")
    assert_differs(halo.first_token_logits, ref_logits, msg="a one-block halo is not dense")
    zero = _run(model, ctx, q, method="star", cp_size=4, anchor_size=8, halo_size=0)
    assert torch.equal(zero.first_token_logits, star.first_token_logits)  # halo 0 is Star


def test_bad_halos_are_refused_by_name():
    with pytest.raises(ValueError, match="halo_size.*must be >= 0"):
        EngineConfig.create(method="star", halo_size=-1)
    with pytest.raises(ValueError, match="halo_size is an option of star / pulsar .each block also sees.*use method "
                                         "star or pulsar, or halo_size 0, not method 'ring'"):
        EngineConfig.create(method="ring", cp_size=2, halo_size=16)
    model = tiny_model("llama", seed=3)
    eng = magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, simulate=True, method="star",
                                  cp_size=4, halo_size=64)
    with pytest.raises(ValueError, match=r"halo_size \(64\) exceeds the block size \(40 tokens"):
        eng.generate(torch.randint(0, 256, (160,)), torch.randint(0, 256, (4,)), max_new_tokens=1)


def test_one_eval_or_cost_command_gives_the_halo_to_star_and_pulsar_alone():
    """``--halo-size`` in a multi-method command (magnetar-eval, the cost model, magnetar-bench) is Star's and
    Pulsar's option: the other methods, and the fidelity run's dense reference, run without it; with neither it is
    refused."""
    from magnetar.cli.args import engine_config
    from magnetar.eval.runner import base_config, build_parser, check_args, method_config

    args = build_parser().parse_args(["--suite", "fidelity", "--methods", "dense,star,pulsar", "--lengths", "4k",
                                      "--simulate-ranks", "4", "--anchor-size", "64", "--halo-size", "200",
                                      "--out", "unused"])
    base = base_config(args)
    assert base.blocks.halo_size == 0
    star, pulsar = method_config(base, args, "star", 4), method_config(base, args, "pulsar", 4)
    assert (star.blocks.halo_size, star.blocks.anchor_size, star.parallel.cp_size) == (200, 64, 4)
    assert pulsar.blocks.halo_size == 200 and method_config(base, args, "dense", 4).blocks.halo_size == 0
    flags = argparse.Namespace(dtype="float32", anchor_size=64, halo_size=200)  # the cost model's and bench's
    assert engine_config(flags, "star", 4).blocks.halo_size == 200
    assert engine_config(flags, "dense", 4).blocks.halo_size == 0
    assert engine_config(flags, "pulsar", 4).blocks.halo_size == 200
    args.methods = "dense,ring"
    with pytest.raises(ValueError, match=r"--halo-size 200 is an option of star / pulsar: add star or pulsar to "
                                         r"--methods \(given dense,ring\)"):
        check_args(args)


def test_a_relative_halo_fits_every_context_length():
    # issue 30's 4K run stopped when a 3948-token context's 987-token blocks were shorter than --halo-size 990: a
    # halo given as a fraction of the block (halo_blocks) is the same setting at every length
    cfg = EngineConfig.create(method="star", cp_size=3, anchor_size=3, halo_blocks=0.5)
    seg = star_segment(cfg, [(0, 10), (10, 20), (20, 30)], 2)
    assert seg.indices.tolist() == [0, 1, 2, 15, 16, 17, 18, 19] + list(range(20, 30))  # half of a 10-token block
    model = tiny_model("llama", seed=3)
    g = torch.Generator().manual_seed(7)
    q = torch.randint(0, 256, (4,), generator=g)
    for L in (150, 160):  # blocks of 38 and 40 tokens: a fixed halo of 40 is refused at 150, one block fits both
        ctx = torch.randint(0, 256, (L,), generator=g)
        one = _run(model, ctx, q, method="star", cp_size=4, anchor_size=8, halo_blocks=1.0)
        block = -(-L // 4)
        fixed = _run(model, ctx, q, method="star", cp_size=4, anchor_size=8, halo_size=block)
        assert torch.equal(one.first_token_logits, fixed.first_token_logits), L
    with pytest.raises(ValueError, match=r"halo_size \(40\) exceeds the block size \(38 tokens"):
        _run(model, torch.randint(0, 256, (150,), generator=g), q, method="star", cp_size=4, halo_size=40)
    with pytest.raises(ValueError, match=r"halo_blocks.*must be in \[0, 1\]"):
        EngineConfig.create(method="star", halo_blocks=1.5)
    with pytest.raises(ValueError, match="give halo_size .* or halo_blocks .*not both"):
        EngineConfig.create(method="star", halo_size=10, halo_blocks=0.5)
    with pytest.raises(ValueError, match="halo_blocks is an option of star / pulsar"):
        EngineConfig.create(method="dense", halo_blocks=1.0)
    from magnetar.methods.star import StarMethod

    assert StarMethod().label_options(EngineConfig.create(method="star", anchor_size=8, halo_blocks=1.0)) == \
        ["anchor 8", "halo 1 block"]


def test_pulsars_halo_limits_pulsar_dense_and_star():
    """Pulsar with a halo: the prefix is sink ∪ summaries ∪ the W tokens before the block, each once; halo 0 is
    Pulsar, and a halo reaching back to the context's start is dense Phase 1."""
    from magnetar.methods.pulsar import PulsarMethod
    from magnetar.methods.summaries import plan_pulsar

    ids = torch.arange(120) % 50
    plain = plan_pulsar(ids, 40, chunk_size=4, budget=0.25, sink_size=4)
    halo = plan_pulsar(ids, 40, chunk_size=4, budget=0.25, sink_size=4, halo=10)
    for i in (1, 2):
        want = torch.unique(torch.cat((plain.blocks[i].prefix, torch.arange(40 * i - 10, 40 * i))), sorted=True)
        assert torch.equal(halo.blocks[i].prefix, want), i
        assert torch.equal(halo.blocks[i].prefix_pos, want)  # sparse positions: each token at its own
    assert halo.blocks[0].prefix.numel() == 0

    model = tiny_model("llama", seed=3)
    g = torch.Generator().manual_seed(11)
    ctx, q = torch.randint(0, 256, (160,), generator=g), torch.randint(0, 256, (4,), generator=g)
    ref_logits, ref_tokens = reference(model, ctx, q, 3)
    pulsar = _run(model, ctx, q, method="pulsar", cp_size=4, sink_size=8, chunk_size=4)
    zero = _run(model, ctx, q, method="pulsar", cp_size=4, sink_size=8, chunk_size=4, halo_blocks=0.0)
    assert torch.equal(zero.first_token_logits, pulsar.first_token_logits)  # halo 0 is Pulsar
    one = _run(model, ctx, q, method="pulsar", cp_size=4, sink_size=8, chunk_size=4, halo_blocks=1.0)
    assert_differs(one.first_token_logits, pulsar.first_token_logits, msg="a halo changes Pulsar's prefix")
    assert_differs(one.first_token_logits, ref_logits, msg="a one-block halo over four blocks is not dense")
    full = _run(model, ctx, q, method="pulsar", cp_size=2, sink_size=8, chunk_size=4, halo_blocks=1.0)
    assert_close(full.first_token_logits, ref_logits, what="logits", msg="pulsar, halo = block 0 of 2")
    assert full.token_ids == ref_tokens
    # beside Star with an anchor of the sink's size and the same halo, the summaries of the blocks before the halo
    star = _run(model, ctx, q, method="star", cp_size=4, anchor_size=8, halo_blocks=1.0)
    assert_differs(one.first_token_logits, star.first_token_logits, msg="the summaries beyond the halo count")
    assert PulsarMethod().label_options(EngineConfig.create(method="pulsar", cp_size=4, halo_blocks=1.0)) == \
        ["halo 1 block"]
    with pytest.raises(ValueError, match=r"halo_size \(41\) exceeds the block size \(40 tokens"):
        _run(model, ctx, q, method="pulsar", cp_size=4, halo_size=41)
