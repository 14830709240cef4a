"""An eager decode step's requests that read one cached context shard (several questions about one document) attend
it in ONE call per layer (magnetar.engine.phase2.Phase2Context._shared_context): each request's state equals the fp64
reference over its context and its own tokens, a NaN in one request's query makes that request's row NaN and no
other's, and a sliding window still applies per request."""
from __future__ import annotations

import pytest
import torch

import magnetar.engine.phase2 as phase2
from magnetar.engine.kv import KVShard
from magnetar.engine.phase2 import Phase2Context
from magnetar.parallel import local_groups
from tests.conftest import assert_close
from tests.reference import dense_attention_fp64

HQ, HKV, D, L = 6, 2, 16, 40


def _shard(gen: torch.Generator, n: int, start: int = 0) -> KVShard:
    s = KVShard(1)
    s.layers[0].append(torch.randn(1, HKV, n, D, generator=gen), torch.randn(1, HKV, n, D, generator=gen),
                       torch.arange(start, start + n))
    s.freeze()
    return s


@pytest.mark.parametrize("window", [None, 30])
def test_requests_on_one_shard_share_one_call(window, monkeypatch, seeded):
    monkeypatch.setattr(phase2, "SHARED_MIN_KEYS", L)  # a document of L keys counts as long here
    doc, other = _shard(seeded, L), _shard(seeded, L + 9)
    shards = [doc.view(), other.view(), doc.view()]  # requests 0 and 2 ask about one document
    gens = [_shard(seeded, n, start) for n, start in ((3, L), (5, L + 9), (7, L))]
    positions = torch.tensor([[L + 3], [L + 14], [L + 7]])  # each request's new token, after its own tokens
    q = torch.randn(3, HQ, 1, D, generator=seeded)
    k, v = torch.randn(3, HKV, 1, D, generator=seeded), torch.randn(3, HKV, 1, D, generator=seeded)
    q[1, 2] = float("nan")  # request 1's query: its row alone turns NaN
    calls = []
    real = phase2.attention_with_lse
    monkeypatch.setattr(phase2, "attention_with_lse", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    ctx = Phase2Context(positions, shards, gens, [1, 1, 1], local_groups(), "auto")
    out = ctx.attend(0, q, k, v, scale=D ** -0.5, window=window)
    # one call for the shared document, one for the other context, one per request's own tokens
    assert len(calls) == 5 and sum(s[2] == L for s in calls) == 1, calls
    for b in range(3):
        c, g = shards[b].layers[0], gens[b].layers[0]  # g holds the new token now (appended by attend)
        keys, values, pos = (torch.cat((c.k, g.k), 2), torch.cat((c.v, g.v), 2), torch.cat((c.pos, g.pos)))
        if window is not None:  # the reference takes no window: the keys in it
            keep = pos > positions[b, 0] - window
            keys, values, pos = keys[:, :, keep], values[:, :, keep], pos[keep]
        want, _ = dense_attention_fp64(q[b:b + 1], keys, values, q_pos=positions[b], k_pos=pos, scale=D ** -0.5)
        if b == 1:
            assert torch.isnan(out[1, 2]).all() and torch.isfinite(out[1, :2]).all()
            continue
        assert_close(out[b:b + 1], want.float(), torch.float32, "out", f"request {b}")


def test_a_short_shared_store_is_read_with_each_requests_own_calls(monkeypatch, seeded):
    """A store under SHARED_MIN_KEYS that several requests read (a chat template's system prompt) gets no call of its
    own: each request reads it in its own calls (here: its context, then its own tokens), the same states."""
    monkeypatch.setattr(phase2, "SHARED_MIN_KEYS", L + 1)
    doc = _shard(seeded, L)
    shards = [doc.view(), doc.view()]
    gens = [_shard(seeded, n, L) for n in (3, 7)]
    positions = torch.tensor([[L + 3], [L + 7]])
    q = torch.randn(2, HQ, 1, D, generator=seeded)
    k, v = torch.randn(2, HKV, 1, D, generator=seeded), torch.randn(2, HKV, 1, D, generator=seeded)
    calls = []
    real = phase2.attention_with_lse
    monkeypatch.setattr(phase2, "attention_with_lse", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    out = Phase2Context(positions, shards, gens, [1, 1], local_groups(), "auto").attend(0, q, k, v, scale=D ** -0.5)
    assert len(calls) == 4 and all(s[2] == 1 for s in calls), calls  # per request: no call of both requests' rows
    for b in range(2):
        c, g = shards[b].layers[0], gens[b].layers[0]
        want, _ = dense_attention_fp64(q[b:b + 1], torch.cat((c.k, g.k), 2), torch.cat((c.v, g.v), 2),
                                       q_pos=positions[b], k_pos=torch.cat((c.pos, g.pos)), scale=D ** -0.5)
        assert_close(out[b:b + 1], want.float(), torch.float32, "out", f"request {b}")


def test_a_batch_parts_merge_in_one_call_as_each_request_alone(seeded, monkeypatch):
    # merge_requests (Phase 2's local states): where every request has the same number of parts, one merge for the
    # batch -- each row the merge of its own request's parts; otherwise a merge per request (a request with none: the
    # empty state); a NaN part poisons only its request
    import magnetar.ops.merge as merge
    from magnetar.ops import merge_states

    def part(nan=False, empty=False):
        o, lse = torch.randn(1, HQ, 1, D, generator=seeded), torch.randn(1, HQ, 1, generator=seeded)
        if nan:
            lse[0, 1, 0] = float("nan")
        if empty:
            o, lse = torch.zeros_like(o), torch.full_like(lse, float("-inf"))
        return o, lse

    q = torch.zeros(3, HQ, 1, D)
    calls = []
    real = merge.merge_states
    monkeypatch.setattr(merge, "merge_states", lambda *a, **k: calls.append(1) or real(*a, **k))
    for parts in ([[part(), part()], [part(nan=True), part()], [part(), part(empty=True)]],
                  [[part(), part()], [part()], []]):
        calls.clear()
        out, lse = merge.merge_requests(parts, q)
        if len(parts[1]) == 2:  # the first batch: its NaN part poisons its own request's row only
            assert torch.isnan(out[1, 1]).all() and torch.isfinite(out[[0, 2]]).all()
        assert len(calls) == (1 if len({len(p) for p in parts}) == 1 else sum(len(p) > 1 for p in parts))
        for b, p in enumerate(parts):
            if not p:
                want = (torch.zeros(1, HQ, 1, D), torch.full((1, HQ, 1), float("-inf")))
            else:
                want = p[0] if len(p) == 1 else merge_states([o for o, _ in p], [lse for _, lse in p])
            torch.testing.assert_close(out[b : b + 1], want[0], equal_nan=True, rtol=0, atol=1e-6)
            torch.testing.assert_close(lse[b : b + 1], want[1], equal_nan=True, rtol=0, atol=1e-6)


def test_a_cloned_shard_is_another_context(seeded, monkeypatch):
    # KVShard.clone: the same values in tensors of its own (a benchmark's B contexts from one Phase 1): requests over
    # a shard and its clone attend apart, each as over the shard itself
    doc = _shard(seeded, L)
    copy = doc.clone()
    c, d = doc.layers[0], copy.layers[0]
    pairs = ((c.k, d.k), (c.v, d.v), (c.pos, d.pos))
    assert copy.tokens() == L and d.frozen and all(torch.equal(x, y) and x.data_ptr() != y.data_ptr() for x, y in pairs)
    calls = []
    real = phase2.attention_with_lse
    monkeypatch.setattr(phase2, "attention_with_lse", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    own = _shard(seeded, 2, L)  # each request's own tokens so far: the same two
    positions = torch.tensor([[L + 2], [L + 2]])
    q = torch.randn(1, HQ, 1, D, generator=seeded).expand(2, -1, -1, -1).contiguous()
    k, v = torch.randn(1, HKV, 1, D, generator=seeded), torch.randn(1, HKV, 1, D, generator=seeded)
    ctx = Phase2Context(positions, [doc.view(), copy.view()], [own, own.clone()], [1, 1], local_groups(), "auto")
    out = ctx.attend(0, q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), scale=D ** -0.5)
    assert sum(s[2] == L for s in calls) == 2, calls  # a context call each: not one shared read
    assert torch.equal(out[0], out[1])
    with pytest.raises(RuntimeError, match="frozen"):
        unfrozen = KVShard(1)
        unfrozen.layers[0].append(c.k, c.v, c.pos)
        unfrozen.clone()
