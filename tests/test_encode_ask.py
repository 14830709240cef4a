"""Encode a context once, ask it many questions: ``ask(encode(c), q) == generate(c, q)`` for every method and with
sparse decoding and LuKA (whose per-question state must not leak), the context cache (hits skip Phase 1, LRU
eviction under the byte budget, release), and per-request sampling independent of the batch."""
from __future__ import annotations

import copy

import pytest
import torch

import magnetar
from magnetar.engine.context import ContextCache, ContextHandle, context_key
from magnetar.engine.kv import KVShard
from tests.conftest import assert_close
from tests.dist_utils import run_distributed
from tests.tiny_models import tiny_model

L, NEW = 96, 5
VARIANTS = [  # (label, engine fields)
    ("dense", dict(method="dense")),
    ("streaming", dict(method="streaming", window_size=32, sink_tokens=4)),
    ("ring", dict(method="ring", cp_size=2)),
    ("star", dict(method="star", cp_size=2, block_size=24)),
    ("pulsar", dict(method="pulsar", cp_size=2, sink_size=4, chunk_size=8, summary_budget=0.25)),
    ("star + quest", dict(method="star", cp_size=2, block_size=24, sparse_policy="quest", sparse_budget=24,
                          page_size=8)),
    ("star with a halo + quest", dict(method="star", cp_size=4, block_size=24, anchor_size=4, halo_size=12,
                                      sparse_policy="quest", sparse_budget=24, page_size=8)),
    ("star, hybrid layers + LuKA clustered", dict(method="star", cp_size=2, anchor_size=8, exact_layers="0",
                                                  luka_mode="clustered", luka_page_size=8, luka_recent=8,
                                                  luka_refine_k=2, luka_compress_every=2)),
    ("star + LuKA clustered", dict(method="star", cp_size=2, block_size=24, luka_mode="clustered", luka_page_size=8,
                                   luka_recent=8, luka_refine_k=2, luka_compress_every=2)),
]


def _ids(seed, n):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def _engine(model, **flat):
    return magnetar.init_inference(copy.deepcopy(model), timeout_s=60, **flat)


def _same(a, b, what):
    assert a.token_ids == b.token_ids, f"{what}: {a.token_ids} != {b.token_ids}"
    assert_close(a.first_token_logits, b.first_token_logits, what="logits", msg=what)


def _questions_on_one_handle(model, flat, what):
    """Three questions on one handle == three generates of a fresh engine without a cache; then a generate of
    the same context hits the cache (no Phase 1) and gives the same answer."""
    ctx, queries = _ids(1, L), [_ids(10 + i, 4 + i) for i in range(3)]
    fresh = _engine(model, context_cache_mb=0, **flat)
    refs = [fresh.generate(ctx, q, max_new_tokens=NEW, return_logits=True) for q in queries]
    assert fresh.cache.hits == 0 and len(fresh.cache) == 0, what
    eng = _engine(model, **flat)
    handle = eng.encode(ctx)
    assert isinstance(handle, ContextHandle) and handle.context_tokens == L and len(eng.cache) == 1
    for i, (q, ref) in enumerate(zip(queries, refs)):
        res = eng.ask(handle, q, max_new_tokens=NEW, return_logits=True)
        _same(res, ref, f"{what} question {i}")
        assert res.cached_context_tokens == 0 and res.context_kv_tokens_per_rank == ref.context_kv_tokens_per_rank
    hit = eng.generate(ctx, queries[1], max_new_tokens=NEW, return_logits=True)
    _same(hit, refs[1], f"{what} cache hit")
    assert eng.cache.hits == 1 and hit.cached_context_tokens == L and set(hit.phase1_seconds) == {0.0}, what
    assert eng.encode(ctx) is handle and eng.cache.hits == 2, what  # the same handle, no Phase 1
    assert eng.release(handle) and len(eng.cache) == 0 and not eng.release(handle)
    # asking over a released handle still works (it is only out of the cache)
    _same(eng.ask(handle, queries[0], max_new_tokens=NEW, return_logits=True), refs[0], f"{what} released")


@pytest.mark.parametrize("label,flat", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_questions_on_one_handle_simulated(label, flat):
    model = tiny_model("llama", seed=2)
    if flat.get("cp_size", 1) > 1 and flat["method"] != "ring":
        flat = dict(flat, simulate=True)
    elif flat["method"] == "ring":
        pytest.skip("ring is exercised on real ranks (test_questions_on_one_handle_on_two_ranks): its simulation "
                    "is a lock-step dense forward")
    _questions_on_one_handle(model, flat, label)


def _two_rank_worker(rank, world):
    model = tiny_model("qwen3", seed=3)
    for label, flat in VARIANTS:
        if flat.get("cp_size", 1) > 1 and label in ("ring", "pulsar", "star + LuKA clustered",
                                                            "star, hybrid layers + LuKA clustered"):
            _questions_on_one_handle(model, flat, f"[rank {rank}] {label}")


def test_questions_on_one_handle_on_two_ranks():
    run_distributed(_two_rank_worker, 2)


def test_ask_batch_with_repeated_handles_equals_one_at_a_time():
    model = tiny_model("llama", seed=4)
    flat = dict(method="star", cp_size=2, block_size=24, simulate=True)
    eng = _engine(model, **flat)
    c1, c2 = _ids(5, L), _ids(6, L + 7)
    h1, h2 = eng.encode(c1), eng.encode(c2)
    qs = [_ids(20, 4), _ids(21, 6), _ids(22, 5)]
    batch = eng.ask_batch([h1, h2, h1], qs, max_new_tokens=NEW, return_logits=True)
    for res, h, q in zip(batch, (h1, h2, h1), qs):
        _same(res, eng.ask(h, q, max_new_tokens=NEW, return_logits=True), "ask_batch")
    with pytest.raises(ValueError, match="handles and queries must be non-empty lists of the same length"):
        eng.ask_batch([h1], qs)
    with pytest.raises(ValueError, match=r"handles\[0\] must be a ContextHandle from this engine's encode\(\)"):
        eng.ask("not a handle", qs[0])


def test_a_handle_answers_only_on_the_engine_that_encoded_it():
    """Issue 28: a handle from another engine -- the same shapes with other weights, other head counts, or the
    same model loaded twice -- is refused by ask, ask_batch, generate's batch and the continuous batch; the
    engine's variants (per-request options) share its handles."""
    ctx, q = _ids(40, L), _ids(41, 4)
    eng = _engine(tiny_model("llama", seed=4), method="dense")
    handle = eng.encode(ctx)
    others = [_engine(tiny_model("llama", seed=5), method="dense"),  # same shapes, other weights
              _engine(tiny_model("llama", seed=4, num_attention_heads=2, num_key_value_heads=1), method="dense"),
              _engine(tiny_model("llama", seed=4), method="dense")]  # the same weights, another engine
    for other in others:
        with pytest.raises(ValueError, match=r"handles\[0\] was encoded by another engine .*encode the context "
                                             r"with this engine"):
            other.ask(handle, q, max_new_tokens=2)
        with pytest.raises(ValueError, match=r"context was encoded by another engine"):
            other.open_batch().add(handle, q, other.sampling_params(max_new_tokens=2))
    star = eng.variant(method="streaming", window_size=L * 2, sink_tokens=4)
    assert star.ask(handle, q, max_new_tokens=2).token_ids == eng.ask(handle, q, max_new_tokens=2).token_ids


def test_sampled_tokens_do_not_depend_on_the_batch():
    # seeded per request: the second request of a batch samples what it samples alone (it used to get seed + 1)
    model = tiny_model("qwen2", seed=4)
    eng = _engine(model, temperature=1.0, top_k=50, seed=7, context_cache_mb=0)
    reqs = [(_ids(30, 40), _ids(31, 3)), (_ids(32, 50), _ids(33, 4))]
    batch = eng.generate_batch(reqs, max_new_tokens=8)
    alone = [eng.generate(c, q, max_new_tokens=8) for c, q in reqs]
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]


def _handle(key: str, nbytes: int) -> ContextHandle:
    return ContextHandle(key, torch.zeros(1, dtype=torch.long), KVShard(1), 1, [], None, nbytes)


def test_context_cache_lru_within_the_budget():
    cache = ContextCache(100)
    a, b, c = _handle("a", 40), _handle("b", 40), _handle("c", 40)
    assert cache.put(a) and cache.put(b) and cache.nbytes == 80
    assert cache.get("a") is a  # a is now the most recently used: b goes first
    assert cache.put(c) and "b" not in cache and [h.key for h in cache.handles()] == ["a", "c"] and cache.evictions == 1
    assert not cache.put(_handle("huge", 101)) and len(cache) == 2  # larger than the budget: not kept
    assert cache.get("b") is None and (cache.hits, cache.misses) == (1, 1)
    assert cache.release(a) and not cache.release("a") and cache.nbytes == 40
    assert cache.stats() == dict(handles=1, bytes=40, budget_bytes=100, hits=1, misses=1, evictions=1, prefix_hits=0)
    assert not ContextCache(0).put(_handle("x", 1))
    with pytest.raises(ValueError, match="budget_bytes must be an int >= 0"):
        ContextCache(-1)


def test_engine_cache_budget_and_key():
    model = tiny_model("llama", seed=1)
    ctx = _ids(1, L)
    assert context_key(ctx) == context_key(ctx.clone().reshape(1, -1)) != context_key(ctx[:-1])
    eng = _engine(model, context_cache_mb=0)
    eng.generate(ctx, _ids(2, 3), max_new_tokens=1)
    eng.generate(ctx, _ids(2, 3), max_new_tokens=1)
    assert (eng.cache.hits, len(eng.cache)) == (0, 0)  # nothing kept: both ran Phase 1
    eng = _engine(model)
    first = eng.generate(ctx, _ids(2, 3), max_new_tokens=1)
    assert eng.cache.nbytes == max(first.kv_bytes_per_rank) and first.cached_context_tokens == 0
    with pytest.raises(ValueError, match="context_cache_mb.*must be >= 0"):
        magnetar.EngineConfig.create(context_cache_mb=-1)


def test_the_longest_cached_prefix_is_found_by_index_not_by_scanning_every_handle(monkeypatch):
    """Issue 44 item 13: thousands of small cached contexts; the longest proper prefix of a context is found (at and
    off block boundaries, of this engine and options only, never after eviction or release) with one ids comparison,
    not one per cached handle; the byte total follows every put, eviction and release."""
    from magnetar.engine import context as ctx_mod

    def handle(ids, engine="e", options="o", nbytes=10):
        return ContextHandle(context_key(ids, options + engine), ids, KVShard(1), int(ids.numel()), [], None,
                             nbytes, engine=engine, options=options)

    doc = _ids(1, 400)
    cache = ContextCache(10**6)
    for i in range(2000):  # the noise: small contexts, several of them sharing the document's first tokens
        noise = torch.cat((doc[: i % 150], _ids(100 + i, 5))) if i % 3 == 0 else _ids(100 + i, 3 + i % 40)
        cache.put(handle(noise))
    prefixes = {n: handle(doc[:n]) for n in (64, 100, 128, 321)}
    for h in prefixes.values():
        cache.put(h)
    cache.put(handle(doc[:350], engine="other"))  # another engine's, and another options' longer prefix
    cache.put(handle(doc[:360], options="p"))
    calls = []
    equal = torch.equal
    monkeypatch.setattr(ctx_mod.torch, "equal", lambda a, b: calls.append(1) or equal(a, b))
    assert cache.longest_prefix(doc, "e", "o") is prefixes[321] and len(calls) == 1
    assert cache.prefix_tokens(doc[:321], "e", "o") == 128  # a proper prefix: not itself
    assert cache.prefix_tokens(doc[:128], "e", "o") == 100 and cache.prefix_tokens(doc, "other", "o") == 350
    assert cache.prefix_tokens(_ids(9, 500), "e", "o") == 0 and len(calls) <= 5
    assert cache.release(prefixes[321]) and cache.prefix_tokens(doc, "e", "o") == 128
    total = cache.nbytes
    small = ContextCache(25)  # evictions unfile their handles
    for n in (64, 100, 128):
        small.put(prefixes[n])
    assert small.prefix_tokens(doc, "e", "o") == 128 and small.nbytes == 20 and small.evictions == 1
    assert small.prefix_tokens(doc[:99], "e", "o") == 0  # 64 was evicted: nothing shorter than 99 is left
    assert total == 10 * len(cache) and cache.stats()["bytes"] == total
    cache.clear()
    assert cache.nbytes == 0 and cache.prefix_tokens(doc, "e", "o") == 0


def test_a_context_larger_than_the_whole_cache_is_not_kept_and_says_so_once(caplog):
    """2100 tokens of the tiny llama hold ~1.03 MiB of KV (2 layers x 2 KV heads x 16 x fp32 x K and V): over a
    1 MiB cache. The engine answers, keeps nothing, and warns once naming the budget's flag."""
    engine = magnetar.init_inference(tiny_model("llama", max_position_embeddings=4096), method="dense",
                                     context_cache_mb=1)
    with caplog.at_level("WARNING", logger="magnetar.engine.encode"):
        for seed in (1, 2):
            handle = engine.encode(_ids(seed, 2100))
            assert handle.nbytes > 2**20 and len(engine.cache) == 0
    warnings = [r.getMessage() for r in caplog.records if "context cache" in r.getMessage()]
    assert len(warnings) == 1 and "--context-cache-mb" in warnings[0] and "2100 tokens" in warnings[0]
