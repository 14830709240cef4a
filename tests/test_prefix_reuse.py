"""Prefix reuse: a context that starts with a cached one encodes only its new tokens (Encoder.extend), which attend
to the cached KV exactly and are dealt to the CP ranks in blocks, the least loaded first. Exact methods give a fresh
Phase 1's answers; the longest cached prefix is chosen, a chain of turns extends turn by turn and stays balanced
over the ranks; what cannot extend says why."""
from __future__ import annotations

import pytest
import torch

import magnetar
from tests.conftest import assert_close
from tests.dist_utils import run_distributed
from tests.test_encode_ask import _engine, _ids, _same  # the encode/ask tests' helpers: the same engines and checks
from tests.tiny_models import tiny_model

L, ADD, NEW = 96, 40, 5


def _extends_like_a_fresh_phase1(model, flat, what):
    """Turn 1 encodes A; turn 2 (A + B) extends it, turn 3 (A + B + C) extends turn 2: each answer equals a fresh
    engine's (no cache), and each turn reports the prefix it reused."""
    a, b, c = _ids(1, L), _ids(2, ADD), _ids(3, ADD)
    q = _ids(9, 4)
    fresh = _engine(model, context_cache_mb=0, **flat)
    eng = _engine(model, **flat)
    turns = [a, torch.cat((a, b)), torch.cat((a, b, c))]
    for i, ctx in enumerate(turns):
        got = eng.generate(ctx, q, max_new_tokens=NEW, return_logits=True)
        _same(got, fresh.generate(ctx, q, max_new_tokens=NEW, return_logits=True), f"{what} turn {i + 1}")
        assert got.cached_context_tokens == (0 if i == 0 else int(turns[i - 1].numel())), what
    assert eng.cache.prefix_hits == 2 and eng.cache.misses == 3, what
    # the extended context itself is now cached whole
    again = eng.generate(turns[1], q, max_new_tokens=NEW)
    assert again.cached_context_tokens == L + ADD and eng.cache.hits == 1, what


@pytest.mark.parametrize("label,flat", [("dense", dict(method="dense")),
                                        ("ring (lock-step simulation)", dict(method="ring", cp_size=2,
                                                                             simulate=True))])
def test_exact_methods_extend_like_a_fresh_phase1(label, flat):
    _extends_like_a_fresh_phase1(tiny_model("llama", seed=2), flat, label)


def _two_rank_worker(rank, world):
    model = tiny_model("qwen3", seed=3)
    _extends_like_a_fresh_phase1(model, dict(method="ring", cp_size=2), f"[rank {rank}] ring")
    # star, prefix_reuse all: the new tokens' KV goes to the rank holding fewer (rank 0 on a tie); the simulated
    # engine gives the same answer
    flat = dict(method="star", cp_size=2, block_size=48, anchor_size=8, prefix_reuse="all")
    real, sim = _engine(model, **flat), _engine(model, simulate=True, **flat)
    a, b, q = _ids(4, L), _ids(5, ADD), _ids(6, 4)
    for eng in (real, sim):
        eng.generate(a, q, max_new_tokens=2)
    got = real.generate(torch.cat((a, b)), q, max_new_tokens=NEW, return_logits=True)
    want = sim.generate(torch.cat((a, b)), q, max_new_tokens=NEW, return_logits=True)
    assert got.token_ids == want.token_ids and got.cached_context_tokens == L
    assert_close(got.first_token_logits, want.first_token_logits, what="same_computation", msg="star extension")
    assert got.context_kv_tokens_per_rank == [L // 2 + ADD, L // 2], got.context_kv_tokens_per_rank


def test_exact_and_star_extensions_on_two_real_ranks():
    run_distributed(_two_rank_worker, 2)


def test_new_tokens_go_to_the_least_loaded_rank_in_blocks():
    from magnetar.engine.encode import spread_blocks

    owners = spread_blocks([100, 40], 150, block=64)
    assert owners.tolist() == [1] * 64 + [0] * 64 + [1] * 22  # 40 -> 104 (r1), 100 -> 164 (r0), 104 -> 126 (r1)
    assert spread_blocks([5, 5, 5], 10).tolist() == [0] * 10  # a tie: the first rank


def _balanced_conversation(rank, world):
    """Twelve turns of a conversation over ring on two real ranks: every answer equals the one-process simulation's,
    and the ranks' shards stay within 1.2x of each other (each turn went to the rank holding fewer tokens)."""
    model = tiny_model("llama", seed=5)
    flat = dict(method="ring", cp_size=2)
    real, sim = _engine(model, **flat), _engine(model, simulate=True, **flat)
    ctx, q = _ids(10, L), _ids(11, 4)
    for turn in range(12):
        got = real.generate(ctx, q, max_new_tokens=3)
        want = sim.generate(ctx, q, max_new_tokens=3)
        assert got.token_ids == want.token_ids, (rank, turn)
        assert got.context_kv_tokens_per_rank == want.context_kv_tokens_per_rank, (rank, turn)
        ctx = torch.cat((ctx, _ids(20 + turn, 30)))
    tokens = got.context_kv_tokens_per_rank
    assert sum(tokens) == L + 11 * 30 and max(tokens) <= 1.2 * min(tokens), tokens




def _long_extension(rank, world):
    """A document three times its cached prefix's length (a system prompt cached, then a long document): each real
    rank encodes its share over the cached prefix, and the answers equal the one-process simulation's (ring: also a
    fresh Phase 1's; star with prefix_reuse all: the same extension semantics); the shards end balanced."""
    model = tiny_model("llama", seed=6)
    for flat in (dict(method="ring", cp_size=2), dict(method="star", cp_size=2, block_size=48, anchor_size=8,
                                                     prefix_reuse="all")):
        real, sim = _engine(model, **flat), _engine(model, simulate=True, **flat)
        prompt, doc, q = _ids(30, 64), _ids(31, 200), _ids(32, 4)
        before = [eng.generate(prompt, q, max_new_tokens=1) for eng in (real, sim)][0].context_kv_tokens_per_rank
        ctx = torch.cat((prompt, doc))
        got = real.generate(ctx, q, max_new_tokens=NEW, return_logits=True)
        want = sim.generate(ctx, q, max_new_tokens=NEW, return_logits=True)
        assert got.cached_context_tokens == want.cached_context_tokens == 64, (rank, flat["method"])
        assert got.token_ids == want.token_ids, (rank, flat["method"])
        assert_close(got.first_token_logits, want.first_token_logits, what="same_computation",
                     msg=f"{flat['method']} long extension")
        added = [a - b for a, b in zip(got.context_kv_tokens_per_rank, before)]
        assert added == [100, 100], (flat["method"], added)  # each rank encoded and keeps half the document
        if flat["method"] == "ring":
            fresh = _engine(model, context_cache_mb=0, **flat).generate(ctx, q, max_new_tokens=NEW)
            assert fresh.token_ids == got.token_ids


def _tight_budget(rank, world):
    """A conversation over star on two real ranks (each turn's tokens dealt to one rank: the other's arena takes
    its own tensors as they are, or grows) and a fork off the document, under a budget the arenas overflow: after
    every turn both ranks' caches hold the same contexts and count the same bytes (a rank that kept what its peer
    evicted would leave it waiting in a collective), and the conversation's turns are counted once."""
    import torch.distributed as dist

    model = tiny_model("llama", seed=7)
    eng = _engine(model, method="star", cp_size=2, block_size=48, anchor_size=8, prefix_reuse="all")
    doc, q = _ids(40, L), _ids(41, 4)
    eng.cache.budget_bytes = 5 * eng.encode(doc).nbytes
    ctx, kept = doc, 0
    for turn in range(12):  # turn 5 forks (sharing the document's arena); its longer turns then overflow the budget
        ctx = torch.cat((doc, _ids(60, 20))) if turn == 5 else torch.cat((ctx, _ids(50 + turn, 20 if turn < 5 else 60)))
        eng.generate(ctx, q, max_new_tokens=2)
        mine = [sorted(h.key for h in eng.cache.handles()), eng.cache.nbytes, eng.cache.evictions]
        every = [None] * world
        dist.all_gather_object(every, mine)
        assert all(x == every[0] for x in every), (turn, every)
        assert eng.cache.nbytes <= eng.cache.budget_bytes
        kept = max(kept, len(eng.cache))
    assert eng.cache.evictions > 0 and kept > 5, (eng.cache.stats(), kept)  # more turns kept than documents fit


def _spread_worker(rank, world):
    _balanced_conversation(rank, world)
    _long_extension(rank, world)
    _tight_budget(rank, world)


def test_turns_and_long_extensions_are_spread_over_two_real_ranks():
    """One pair of processes for both (a spawn costs seconds of the suite)."""
    run_distributed(_spread_worker, 2)


def test_star_extends_only_with_prefix_reuse_all_and_its_new_tokens_see_the_whole_prefix():
    model = tiny_model("llama", seed=4)
    flat = dict(method="star", cp_size=2, block_size=48, anchor_size=8, simulate=True)
    a, b, q = _ids(7, L), _ids(8, ADD), _ids(9, 4)
    ab = torch.cat((a, b))
    exact = _engine(model, **flat)
    assert "prefix_reuse 'all' extends it" in exact.encoder.can_extend()
    exact.generate(a, q, max_new_tokens=1)
    assert exact.generate(ab, q, max_new_tokens=1).cached_context_tokens == 0  # a fresh Phase 1
    every = _engine(model, prefix_reuse="all", **flat)
    assert every.encoder.can_extend() is None
    base = every.encode(a)
    ext = every.encode(ab)
    assert ext.reused_tokens == L and ext.query_position == base.query_position + ADD
    # the prefix's KV is the base's, untouched; the new tokens' is what a Phase-2 query over it computes
    for lb, le in zip(base.shard.layers, ext.shard.layers):
        assert torch.equal(le.k[:, :, :L], lb.k) and torch.equal(le.pos[L:], torch.arange(L, L + ADD))
    dense = _engine(model, method="dense")
    assert not torch.allclose(ext.shard.layers[-1].k, dense.encode(ab).shard.layers[-1].k, atol=1e-3), \
        "star's prefix KV should differ from dense's (the test would not tell an extension from a dense encode)"


def test_what_does_not_extend():
    model = tiny_model("llama", seed=5)
    a, q = _ids(10, L), _ids(11, 4)
    eng = _engine(model, method="dense")
    eng.generate(a, q, max_new_tokens=1)
    # more new tokens than the prefix has extend it too (on one rank there is nothing to spread), as exactly
    longer = torch.cat((a, _ids(12, L + 1)))
    fresh = _engine(model, method="dense", context_cache_mb=0)
    _same(eng.generate(longer, q, max_new_tokens=3, return_logits=True),
          fresh.generate(longer, q, max_new_tokens=3, return_logits=True), "a long extension")
    assert eng.cache.prefix_hits == 1
    off = _engine(model, method="dense", prefix_reuse="off")
    assert off.encoder.can_extend() == "runtime.prefix_reuse is off"
    luka = _engine(model, method="dense", luka_mode="clustered", luka_page_size=8, luka_recent=8, luka_refine_k=2,
                   luka_compress_every=2)
    assert "LuKA" in luka.encoder.can_extend()
    with pytest.raises(ValueError, match="prefix_reuse"):
        magnetar.EngineConfig().replace(prefix_reuse="some")
