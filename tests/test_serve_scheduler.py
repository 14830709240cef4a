"""The serving leader's scheduler (magnetar/serve/scheduler.py) with plain values: no ranks, no model, no HTTP --
one Phase 1 per tick beside any cache hits, the batch's room, the joining queries' token bound, chunked Phase 1 after
a cached prefix, cancels of waiting, chunking and decoding requests, a release after its readers, a deleted pinned
context refused."""
from __future__ import annotations

import torch

from magnetar.engine.requests import CheckedRequest
from magnetar.engine.sampling import SamplingParams
from magnetar.serve.prompts import Prepared
from magnetar.serve.scheduler import Job, Scheduler


def _generate(sid: int, key: str, length: int = 8, *, cid=None, options=None, query: int = 2) -> Job:
    request = CheckedRequest(torch.arange(length), torch.arange(query) % 7 + 1, SamplingParams(max_new_tokens=2), key,
                             dict(options or {}))
    return Job("generate", sid, prepared=Prepared(request, cid))


def _sids(tick) -> dict:
    return {"adds": [a.sid for a in tick.adds], "encodes": [e.sid for e in tick.encodes],
            "chunks": [(c.sid, len(c.context_ids)) for c in tick.chunks], "cancels": tick.cancels,
            "releases": tick.releases}


def test_one_phase1_per_tick_beside_any_cache_hits():
    cached = {"hit"}
    s = Scheduler(max_batch_size=8, is_cached=cached.__contains__)
    for job in (_generate(1, "a"), _generate(2, "hit"), _generate(3, "b"), _generate(4, "a"), _generate(5, "hit")):
        s.add(job)
    first = s.decide(active=0, pinned=set()).tick
    # 1 runs a's Phase 1; 4 shares it (same key, the tick encodes it first); 3's Phase 1 waits a tick
    assert _sids(first)["adds"] == [1, 2, 4, 5]
    assert _sids(s.decide(active=4, pinned=set()).tick)["adds"] == [3] and s.idle


def test_the_batch_room_bounds_the_adds():
    s = Scheduler(max_batch_size=2, is_cached=lambda key: True)
    for sid in range(1, 5):
        s.add(_generate(sid, f"k{sid}"))
    assert _sids(s.decide(active=1, pinned=set()).tick)["adds"] == [1]
    assert _sids(s.decide(active=2, pinned=set()).tick)["adds"] == []
    s.cancel(9, decoding=True)  # a decoding request leaves in this tick: its place is free already
    tick = s.decide(active=2, pinned=set()).tick
    assert tick.cancels == [9] and _sids(tick)["adds"] == [2]


def test_a_long_context_runs_in_chunks_after_its_cached_prefix_then_joins():
    s = Scheduler(max_batch_size=4, prefill_chunk=100, prefix_tokens=lambda ids: 50)
    s.add(_generate(1, "long", 330))
    s.add(_generate(2, "other", 10))
    ticks = [s.decide(active=0, pinned=set()).tick for _ in range(4)]
    # after the 50 cached tokens: 150, 250 in chunks (one Phase 1 per tick: request 2 waits), then the last 80 whole
    assert [_sids(t)["chunks"] for t in ticks] == [[(1, 150)], [(1, 250)], [], []]
    assert [_sids(t)["adds"] for t in ticks] == [[], [], [1], [2]]


def test_the_joining_queries_fit_max_join_tokens_in_arrival_order():
    s = Scheduler(max_batch_size=8, max_join_tokens=1000, is_cached=lambda key: True)
    for sid, query in enumerate((600, 300, 200, 900, 100, 5000, 10), start=1):
        s.add(_generate(sid, f"k{sid}", query=query))
    ticks = [_sids(s.decide(active=0, pinned=set()).tick)["adds"] for _ in range(5)]
    # 600 + 300; then 200 alone (200 + 900 is over: 5 waits behind 4, though it would fit); 900 + 100; a query
    # longer than the bound joins alone; then the last
    assert ticks == [[1, 2], [3], [4, 5], [6], [7]] and s.idle
    unbounded = Scheduler(max_batch_size=8, is_cached=lambda key: True)
    for sid in range(1, 4):
        unbounded.add(_generate(sid, f"k{sid}", query=5000))
    assert _sids(unbounded.decide(active=0, pinned=set()).tick)["adds"] == [1, 2, 3]


def test_max_join_tokens_counts_queries_not_phase1():
    # a new context's Phase 1 (whole or a chunk) is bounded by the one-per-tick rule: the queries beside it still join
    s = Scheduler(max_batch_size=8, prefill_chunk=100, max_join_tokens=50, is_cached=lambda key: key != "long")
    s.add(_generate(1, "long", 330, query=20))
    s.add(_generate(2, "hit", 5000, query=30))
    s.add(_generate(3, "hit2", query=30))
    first = _sids(s.decide(active=0, pinned=set()).tick)
    assert first["chunks"] == [(1, 100)] and first["adds"] == [2]  # 30 + 30 is over the bound: 3 waits
    assert _sids(s.decide(active=1, pinned=set()).tick)["adds"] == [3]


def test_options_and_pinned_contexts_never_chunk():
    s = Scheduler(max_batch_size=4, prefill_chunk=10)
    s.add(_generate(1, "star", 100, options={"method": "star"}))
    s.add(_generate(2, "pinned", 100, cid="ctx-1"))
    tick = s.decide(active=0, pinned={"ctx-1"}).tick
    assert _sids(tick)["adds"] == [1, 2] and not tick.chunks


def test_cancels_of_waiting_chunking_and_unknown_requests():
    s = Scheduler(max_batch_size=4, prefill_chunk=10)
    s.add(_generate(1, "a", 100))
    s.add(_generate(2, "b", 5))
    s.decide(active=0, pinned=set())  # request 1's first chunk is sent: every rank holds it
    assert s.cancel(1, decoding=False).sid == 1  # dropped here, and its chunks on every rank by the tick
    assert s.cancel(2, decoding=False).sid == 2  # never sent: nothing to tell the ranks
    assert s.cancel(3, decoding=False) is None  # finished already: a no-op
    tick = s.decide(active=0, pinned=set()).tick
    assert tick.cancels == [1] and not tick.adds and s.idle


def test_a_release_waits_for_its_readers_and_its_encode():
    s = Scheduler(max_batch_size=1, is_cached=lambda key: True)
    s.add(_generate(1, "x", cid="ctx-1"))
    s.add(_generate(2, "y", cid="ctx-1"))
    s.add(Job("release", 3, cid="ctx-1"))
    first = s.decide(active=0, pinned={"ctx-1"})
    assert _sids(first.tick)["adds"] == [1] and first.tick.releases == []  # request 2 still reads it
    second = s.decide(active=0, pinned={"ctx-1"})  # its last reader joins; the ranks release after the adds
    assert _sids(second.tick)["adds"] == [2] and second.tick.releases == ["ctx-1"]
    assert [j.sid for j in second.released] == [3]
    s.add(Job("encode", 4, cid="ctx-2", context_ids=torch.arange(4), key="k2"))
    s.add(Job("release", 5, cid="ctx-2"))  # the POST's client left before its encode ran
    tick = s.decide(active=0, pinned=set()).tick  # the ranks encode it, then release it (releases go last)
    assert _sids(tick)["encodes"] == [4] and tick.releases == ["ctx-2"] and s.idle
    s = Scheduler(max_batch_size=4)  # nothing cached: each encode and request is a Phase 1
    s.add(Job("encode", 6, cid="ctx-3", context_ids=torch.arange(4), key="k3"))
    s.add(_generate(7, "z", 20))  # a Phase 1 too: the encode waits a tick, and so does its release
    s.add(Job("release", 8, cid="ctx-3"))
    s.pending.insert(0, s.pending.pop(1))  # the request arrived first
    tick = s.decide(active=0, pinned=set()).tick
    assert _sids(tick)["adds"] == [7] and not tick.encodes and tick.releases == []
    tick = s.decide(active=1, pinned=set()).tick
    assert _sids(tick)["encodes"] == [6] and tick.releases == ["ctx-3"]


def test_a_request_about_a_deleted_context_is_refused():
    s = Scheduler(max_batch_size=4)
    s.add(_generate(1, "x", cid="ctx-gone"))
    decision = s.decide(active=0, pinned=set())
    assert [j.sid for j in decision.refused] == [1] and decision.tick.empty and s.idle
