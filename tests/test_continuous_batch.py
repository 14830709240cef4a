"""Continuous batching (``Engine.open_batch``): requests that join the decode batch between steps and leave at EOS,
a stop string, their limit or a cancel each equal their one-at-a-time ``generate`` -- greedy and sampled, dense,
Star / Pulsar over 2 ranks (simulated and real), sparse decoding and LuKA (per-request state); a cache hit skips
Phase 1; ``Engine.stream``'s text deltas join to the answer; under data parallelism ``generate_batch`` deals the
requests to the replicas."""
from __future__ import annotations

import copy

import pytest
import torch

import magnetar
from magnetar.engine.batch import TokenEvent
from tests.conftest import assert_close
from tests.dist_utils import run_distributed
from tests.tiny_models import save_tiny, tiny_model


def _ids(seed, n):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def _engine(model, **flat):
    return magnetar.init_inference(copy.deepcopy(model), timeout_s=60, **flat)


# (context seed, context length, query seed, query length, sampling keywords); contexts 0 and 3 are the same
REQUESTS = [
    (1, 96, 10, 4, dict(max_new_tokens=6)),
    (2, 130, 11, 5, dict(max_new_tokens=3)),
    (3, 70, 12, 3, dict(max_new_tokens=7, temperature=0.9, top_k=20, seed=5)),
    (1, 96, 13, 6, dict(max_new_tokens=5, temperature=1.2, top_p=0.8, seed=9)),
]


VARIANTS = [  # (label, engine fields)
    ("dense", dict(method="dense")),
    ("star", dict(method="star", cp_size=2, block_size=24, simulate=True)),
    ("pulsar + quest", dict(method="pulsar", cp_size=2, sink_size=4, chunk_size=8, summary_budget=0.25,
                                            simulate=True, sparse_policy="quest", sparse_budget=24, page_size=8)),
    ("star + LuKA lined", dict(method="star", cp_size=2, block_size=24, simulate=True, luka_mode="lined",
                               luka_page_size=8, luka_recent=8, luka_compress_every=2)),
]


@pytest.mark.parametrize("label,flat", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_interleaved_requests_equal_one_at_a_time(label, flat):
    model = tiny_model("llama", seed=2)
    eng = _engine(model, **flat)
    ref = _engine(model, context_cache_mb=0, **flat)
    _interleaved_against(eng, ref, label)


def _interleaved_against(eng, ref_eng, what):
    refs = [ref_eng.generate(_ids(cs, cl), _ids(qs, ql), return_logits=True, **kw) for cs, cl, qs, ql, kw in REQUESTS]
    batch = eng.open_batch(return_logits=True)
    tokens, rids, results = {}, [], {}

    def drain():
        for rid_done in batch.finished:
            results[rid_done] = batch.pop(rid_done)

    for i, (cs, cl, qs, ql, kw) in enumerate(REQUESTS):
        rid, first = batch.add(_ids(cs, cl), _ids(qs, ql), eng.sampling_params(**kw))
        assert isinstance(first, TokenEvent) and first.rid == rid
        rids.append(rid)
        tokens[rid] = [first.token_id]
        for _ in range(2 if i % 2 == 0 else 1):  # requests join at different steps of the others
            for ev in batch.step():
                tokens[ev.rid].append(ev.token_id)
        drain()
    while batch.active:
        for ev in batch.step():
            tokens[ev.rid].append(ev.token_id)
    drain()
    assert len(batch) == 0, what
    for i, (rid, ref) in enumerate(zip(rids, refs)):
        res = results[rid]
        assert res.token_ids == tokens[rid] == ref.token_ids, f"{what} request {i}: {res.token_ids} != {ref.token_ids}"
        assert res.stop_reason == ref.stop_reason == "max_new_tokens", what
        assert_close(res.first_token_logits, ref.first_token_logits, what="logits", msg=f"{what} request {i}")
    # the fourth request repeats the first one's context: a cache hit, no Phase 1
    assert results[rids[3]].cached_context_tokens == 96 and results[rids[0]].cached_context_tokens == 0, what
    assert eng.cache.hits == 1 and eng.cache.misses == 3, what


def test_prepared_requests_join_in_one_forward():
    # three requests of different lengths and sampling prepared apart, their queries joined in one forward while
    # another request is decoding: each equals its one-at-a-time generate
    model = tiny_model("llama", seed=8)
    flat = dict(method="star", cp_size=2, block_size=24, simulate=True)
    eng, ref = _engine(model, **flat), _engine(model, context_cache_mb=0, **flat)
    batch = eng.open_batch()
    first, _ = batch.add(*_args(eng, REQUESTS[0]))
    batch.step()
    ready = [batch.prepare(*_args(eng, r)) for r in REQUESTS[1:]]
    assert [r.cached for r in ready] == [False, False, True]  # the last repeats the first request's context
    joined = batch.join(ready)
    while batch.active:
        batch.step()
    for (rid, ev), req in zip([(first, None)] + joined, REQUESTS):
        want = ref.generate(*_args(ref, req)[:2], **req[4])
        assert batch.pop(rid).token_ids == want.token_ids, req
    with pytest.raises(ValueError, match=r"prepared\[0\] must be a Ready from ContinuousBatch.prepare\(\)"):
        batch.join(["not ready"])


def test_padded_query_rows_attend_with_their_real_rows_only(monkeypatch):
    """Joined queries of 5 and 9 tokens: the short one's attention calls take its 5 real rows (the padding's rows
    are the empty state, which nothing reads), its tokens and first logits are its one-at-a-time generate's, and
    no padding row trips the finiteness check."""
    import magnetar.engine.phase2 as phase2

    model = tiny_model("llama", seed=8)
    flat = dict(method="dense", check_finite=True)
    eng, ref = _engine(model, **flat), _engine(model, context_cache_mb=0, **flat)
    reqs = [(2, 40, 11, 5, dict(max_new_tokens=3)), (3, 30, 12, 9, dict(max_new_tokens=3))]
    rows, attend = [], phase2.attention_with_lse
    monkeypatch.setattr(phase2, "attention_with_lse", lambda q, *a, **kw: rows.append(q.shape[2]) or attend(q, *a,
                                                                                                             **kw))
    batch = eng.open_batch(return_logits=True)
    joined = batch.join([batch.prepare(*_args(eng, r)) for r in reqs])
    layers = model.config.num_hidden_layers
    assert sorted(set(rows)) == [5, 9] and rows.count(5) == rows.count(9) == 2 * layers  # context + own, a layer
    monkeypatch.setattr(phase2, "attention_with_lse", attend)
    while batch.active:
        batch.step()
    for (rid, _), req in zip(joined, reqs):
        want = ref.generate(*_args(ref, req)[:2], return_logits=True, **req[4])
        got = batch.pop(rid)
        assert got.token_ids == want.token_ids, req
        assert_close(got.first_token_logits, want.first_token_logits, what="logits", msg=f"query of {req[3]}")


def _args(eng, req):
    cs, cl, qs, ql, kw = req
    return _ids(cs, cl), _ids(qs, ql), eng.sampling_params(**kw)


def _two_rank_worker(rank, world):
    model = tiny_model("qwen3", seed=3)
    flat = dict(method="pulsar", cp_size=2, sink_size=4, chunk_size=8, summary_budget=0.25)
    _interleaved_against(_engine(model, **flat), _engine(model, context_cache_mb=0, **flat), f"[rank {rank}] pulsar")


def test_interleaved_requests_on_two_ranks():
    run_distributed(_two_rank_worker, 2)


def test_cancel_stream_and_text_deltas(tmp_path):
    save_tiny(tmp_path / "tiny", "llama", seed=5)
    eng = magnetar.init_inference(str(tmp_path / "tiny"), method="star", cp_size=2, block_size=16, simulate=True,
                                  timeout_s=60)
    context, questions = "the quick brown fox jumps over the lazy dog. " * 4, ["who jumps?", "what is lazy?"]
    ref = [eng.generate(context, q, max_new_tokens=12) for q in questions]
    batch = eng.open_batch()
    params = eng.sampling_params(max_new_tokens=12)
    (a, ev_a), (b, ev_b) = batch.add(context, questions[0], params), batch.add(context, questions[1], params)
    texts = {a: ev_a.text, b: ev_b.text}
    for _ in range(3):
        for ev in batch.step():
            texts[ev.rid] += ev.text
    last = batch.cancel(b)  # b leaves; a goes on unchanged
    assert last.stop_reason == "cancelled" and batch.active == [a]
    with pytest.raises(ValueError, match="request 0 is not finished"):
        batch.pop(a)
    cancelled = batch.pop(b)
    assert cancelled.stop_reason == "cancelled" and cancelled.token_ids == ref[1].token_ids[:4]
    while batch.active:
        for ev in batch.step():
            texts[ev.rid] += ev.text
    res = batch.pop(a)
    assert res.token_ids == ref[0].token_ids and texts[a] == res.text == ref[0].text
    with pytest.raises(ValueError, match="rid must be the id of a request in this batch"):
        batch.cancel(a)
    # stream: the pieces join to generate's text; the result is the generator's return value
    gen = eng.stream(context, questions[0], max_new_tokens=12)
    pieces = []
    while True:
        try:
            pieces.append(next(gen))
        except StopIteration as stop:
            result = stop.value
            break
    assert "".join(pieces) == ref[0].text and result.token_ids == ref[0].token_ids and len(pieces) >= 1
    assert all(isinstance(p, str) and p for p in pieces)
    # a stop string: the stream never shows it, and stops where generate stops
    assert len(ref[0].text) >= 5
    stop = [ref[0].text[3:5]]
    streamed = "".join(eng.stream(context, questions[0], max_new_tokens=12, stop=stop))
    assert streamed == eng.generate(context, questions[0], max_new_tokens=12, stop=stop).text == ref[0].text[:3]


def test_per_request_sampling_parameters():
    model = tiny_model("qwen2", seed=4)
    eng = _engine(model, context_cache_mb=0)
    c, q = _ids(30, 40), _ids(31, 3)
    greedy = eng.generate(c, q, max_new_tokens=8)
    hot = [eng.generate(c, q, max_new_tokens=8, temperature=1.5, seed=s).token_ids for s in (1, 2, 1)]
    assert hot[0] == hot[2] and hot[0] != greedy.token_ids  # seeded per request: reproducible, and not greedy
    params = eng.sampling_params(max_new_tokens=8, temperature=1.5, seed=1)
    assert (params.temperature, params.seed, params.top_k, params.top_p) == (1.5, 1, 0, 1.0)
    batch = eng.generate_batch([(c, q), (_ids(32, 50), _ids(33, 4))], max_new_tokens=8, temperature=1.5, seed=1)
    assert batch[0].token_ids == hot[0]
    for kw, field in ((dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=2.5), "top_k"),
                      (dict(seed=True), "seed"), (dict(stop="x"), "stop")):
        with pytest.raises(ValueError, match=field):
            eng.generate(c, q, **kw)


def _dp_worker(rank, world):
    # 4 ranks: cp 2 x dp 2; three requests dealt to the two replicas (deal=True); every rank returns all three
    model = tiny_model("llama", seed=6)
    flat = dict(method="star", cp_size=2, block_size=24)
    eng = _engine(model, **flat)
    reqs = [(_ids(40 + i, 60 + 10 * i), _ids(50 + i, 4)) for i in range(3)]
    results = eng.generate_batch(reqs, max_new_tokens=4, deal=True)
    assert eng.groups.dp_size == 2
    mine = [i for i in range(3) if i % 2 == eng.groups.dp_rank]
    assert eng.cache.misses == len(mine), f"rank {rank} encoded {eng.cache.misses} contexts, its share is {mine}"
    sim = magnetar.init_inference(copy.deepcopy(model), groups=magnetar.parallel.local_groups(), simulate=True,
                                  context_cache_mb=0, **flat)
    for i, (res, (c, q)) in enumerate(zip(results, reqs)):
        assert res.token_ids == sim.generate(c, q, max_new_tokens=4).token_ids, f"rank {rank} request {i}"
    if eng.groups.dp_rank == 1:  # a replica given another list: every rank of the DP group raises
        reqs = reqs[::-1]
    with pytest.raises(magnetar.engine.agree.RequestMismatchError, match="data-parallel replicas"):
        eng.generate_batch(reqs, max_new_tokens=4, deal=True)
    # without deal a replica runs what it is given, alone (replica 1 is not called here)
    if eng.groups.dp_rank == 0:
        alone = eng.generate_batch(reqs[:1], max_new_tokens=4)
        assert alone[0].token_ids == sim.generate(*reqs[0], max_new_tokens=4).token_ids
    with pytest.raises(ValueError, match="deal"):
        eng.generate_batch(reqs, deal="yes")


def test_data_parallel_replicas_share_the_requests():
    run_distributed(_dp_worker, 4)


def test_per_request_method_options():
    # one engine (pulsar) serving a request encoded with star, and its own: each equals an engine of that config;
    # the same context encoded two ways is two cache entries
    model = tiny_model("llama", seed=7)
    base = dict(cp_size=2, simulate=True, sink_size=4, chunk_size=8, summary_budget=0.25)
    eng = _engine(model, method="pulsar", **base)
    star_ref = _engine(model, method="star", block_size=24, context_cache_mb=0, **base)
    pulsar_ref = _engine(model, method="pulsar", context_cache_mb=0, **base)
    c, q = _ids(60, 100), _ids(61, 4)
    batch = eng.open_batch()
    params = eng.sampling_params(max_new_tokens=5)
    star_rid, _ = batch.add(c, q, params, options={"method": "star", "block_size": 24})
    own_rid, _ = batch.add(c, q, params)
    while batch.active:
        batch.step()
    star, own = batch.pop(star_rid), batch.pop(own_rid)
    assert star.token_ids == star_ref.generate(c, q, max_new_tokens=5).token_ids and star.method == "star"
    assert own.token_ids == pulsar_ref.generate(c, q, max_new_tokens=5).token_ids and own.method == "pulsar"
    assert star.context_kv_tokens_per_rank != own.context_kv_tokens_per_rank  # two encodings of one context
    assert len(eng.cache) == 2 and eng.cache.misses == 2
    assert eng.variant(method="star", block_size=24) is eng.variant(block_size=24, method="star")
    assert eng.variant(method="pulsar") is eng and eng.variant() is eng
    with pytest.raises(ValueError, match="sparse_policy cannot change per request"):
        eng.variant(sparse_policy="quest")
    with pytest.raises(ValueError, match="cp_size cannot change per request"):
        batch.add(c, q, params, options={"cp_size": 1})
    with pytest.raises(ValueError, match="block_size"):
        batch.add(c, q, params, options={"method": "star", "block_size": -3})
    with pytest.raises(ValueError, match="this context is a handle, already encoded"):
        batch.add(eng.encode(c), q, params, options={"method": "star"})


def _poison_token(model, token: int) -> None:
    """NaN in ``token``'s embedding row: any forward that reads that token turns NaN (for its own request)."""
    with torch.no_grad():
        model.model.embed_tokens.weight[token] = float("nan")


@pytest.mark.parametrize("label,flat", VARIANTS[:2], ids=[v[0] for v in VARIANTS[:2]])
def test_one_requests_nan_fails_it_alone(label, flat):
    """Issue 28, item 5: one request whose tokens reach a NaN embedding row ended the whole server. In a batch it
    fails alone -- in its query forward (joined with a healthy request) or in its Phase 1 -- and the others
    decode what they decode alone; Engine.stream and generate still raise NonFiniteError."""
    from magnetar.engine.finite import NonFiniteError

    model = tiny_model("llama", seed=2)
    _poison_token(model, 255)
    eng = _engine(model, **flat)
    ctx, q = _ids(1, 96) % 255, _ids(10, 4) % 255  # never token 255
    alone = eng.generate(ctx, q, max_new_tokens=6)
    batch = eng.open_batch()
    bad_q = q.clone()
    bad_q[1] = 255
    ready = [batch.prepare(ctx, q, eng.sampling_params(max_new_tokens=6)),
             batch.prepare(ctx, bad_q, eng.sampling_params(max_new_tokens=6))]
    (good, first), (bad, failed) = batch.join(ready)
    assert failed.stop_reason == "nonfinite" and failed.token_id == -1 and "non-finite logits in Phase 2 (the query)" \
        in failed.error
    assert batch.pop(bad).stop_reason == "nonfinite" and batch.active == [good]
    tokens = [first.token_id]
    while batch.active:
        tokens += [ev.token_id for ev in batch.step()]
    assert tokens == alone.token_ids and batch.pop(good).token_ids == alone.token_ids
    bad_ctx = ctx.clone()
    bad_ctx[5] = 255
    with pytest.raises(NonFiniteError, match="Phase 1"):  # its Phase 1: every rank raises alike, nothing is cached
        batch.prepare(bad_ctx, q, eng.sampling_params(max_new_tokens=2))
    assert eng.generate(ctx, q, max_new_tokens=6).token_ids == alone.token_ids  # the engine goes on
    with pytest.raises(NonFiniteError, match="the query"):
        list(eng.stream(ctx, bad_q, max_new_tokens=3))
    with pytest.raises(NonFiniteError, match="the query"):
        eng.generate(ctx, bad_q, max_new_tokens=3)


def test_the_serving_path_skips_what_its_broadcast_guarantees(monkeypatch):
    """Issue 29, item 3: the server's ticks give every rank the same requests, so its batch drops the per-request
    agreement collective (the library path keeps it) and reuses the cache key the leader hashed once."""
    import magnetar.engine.requests as requests_mod
    from magnetar.engine.encode import Encoder

    eng = _engine(tiny_model("llama", seed=2))
    ctx, q = _ids(1, 96), _ids(10, 4)
    want = eng.generate(ctx, q, max_new_tokens=3).token_ids
    key = eng.cache_key(ctx)
    eng.cache.clear()
    agreed = []
    real = requests_mod.check_request
    monkeypatch.setattr(requests_mod, "check_request", lambda *a, **kw: (agreed.append(kw["entry"]), real(*a, **kw)))
    monkeypatch.setattr(Encoder, "key", lambda self, ids: pytest.fail("the context was hashed again"))
    batch = eng.open_batch(agree=False)
    rid, _ = batch.add(ctx, q, eng.sampling_params(max_new_tokens=3), key=key)
    while batch.active:
        batch.step()
    assert batch.pop(rid).token_ids == want and agreed == [] and key in eng.cache
    library = eng.open_batch()
    rid, _ = library.add(ctx, q, eng.sampling_params(max_new_tokens=3), key=key)
    assert agreed == ["ask"]
