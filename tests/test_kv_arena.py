"""A conversation's turns share their KV: each extension of a context writes its new tokens after the last turn's
KV in one arena (no copy of the document a turn), a fork shares the document's KV as its head and keeps only its
own, a full buffer grows and every turn (and every fork's head) is pointed at the new one; the context cache counts
each arena once, the same on every rank; and on the engine a conversation over a document stays cached whole where
each turn used to hold the document again, and conversations forking from one document hold it once."""
from __future__ import annotations

import copy

import pytest
import torch

import magnetar
from magnetar.engine.context import ContextCache, ContextHandle
from magnetar.engine.kv import ARENA_SPARE, KVShard
from tests.test_encode_ask import _ids, _same
from tests.tiny_models import tiny_model

LAYERS, B, H, D = 3, 1, 2, 4


def _shard(start: int, n: int, seed: int, empty_layer: int = -1) -> KVShard:
    """A frozen shard of ``n`` tokens at positions ``start ...`` (layer ``empty_layer`` holds none)."""
    g = torch.Generator().manual_seed(seed)
    shard = KVShard(LAYERS)
    for i, layer in enumerate(shard.layers):
        if i != empty_layer:
            layer.append(torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g),
                         torch.arange(start, start + n))
    shard.freeze()
    return shard


def _content(shard: KVShard) -> list:
    """Every layer's ``(k, v, pos)`` (a fork's segments joined), copied; None where the layer holds none."""
    return [None if e is None else tuple(t.clone() for t in e[:3])
            for e in (shard.entries(i) for i in range(shard.num_layers))]


def _equal(shard: KVShard, want: list, what: str) -> None:
    for i, (got, w) in enumerate(zip(_content(shard), want, strict=True)):
        if w is None:
            assert got is None, f"{what}: layer {i}"
            continue
        assert all(torch.equal(x, y) for x, y in zip(got, w)), f"{what}: layer {i}"


def _joined(*shards: KVShard) -> list:
    return _content(KVShard.join([KVShard.join([s]) for s in shards]))


def _same_memory(a: KVShard, b: KVShard) -> bool:
    return all(x.k.data_ptr() == y.k.data_ptr() and x.v.data_ptr() == y.v.data_ptr()
               for x, y in zip(a.own, b.own) if x.k is not None)


def test_turns_extend_in_place_and_hold_the_content_of_a_join():
    base, a, b = _shard(0, 40, 1), _shard(40, 6, 2), _shard(46, 3, 3)
    want_base, want_1, want_2 = _content(base), _joined(base, a), _joined(base, a, b)
    turn1 = KVShard.extended(base, a, 40, 46)
    _equal(turn1, want_1, "turn 1")
    _equal(base, want_base, "the base after turn 1")  # it joined the arena: the same values, in its buffers
    assert base.arena is turn1.arena and _same_memory(base, turn1)
    ptrs = [layer.k.data_ptr() for layer in turn1.layers]
    turn2 = KVShard.extended(turn1, b, 46, 49)  # the tip: written in place after turn 1's KV
    _equal(turn2, want_2, "turn 2")
    _equal(turn1, want_1, "turn 1 after turn 2")
    assert [layer.k.data_ptr() for layer in turn2.layers] == ptrs and turn2.arena is turn1.arena
    assert turn2.arena.tip == 49 and turn2.arena.capacity(0) == 46 + 64  # made at turn 1 with 64 to spare


def test_a_fork_shares_the_document_and_leaves_the_later_turn_alone():
    base, a, other, more = _shard(0, 40, 1), _shard(40, 6, 2), _shard(40, 5, 4), _shard(45, 3, 9)
    turn1 = KVShard.extended(base, a, 40, 46)
    want_1 = _content(turn1)
    fork = KVShard.extended(base, other, 40, 45)  # base is no longer its arena's tip: shared, not copied
    _equal(fork, _joined(base, other), "the fork")
    _equal(turn1, want_1, "turn 1 after the fork")  # its entries after the base were not overwritten
    assert fork.head is base and fork.arena is not turn1.arena and base.arena is turn1.arena
    assert [len(layer) for layer in fork.own] == [5] * LAYERS and fork.tokens() == 45  # its own KV alone
    assert fork.nbytes() == base.nbytes() + other.nbytes() and fork.arenas() == (turn1.arena, fork.arena)
    with pytest.raises(RuntimeError, match="segments"):  # a reader of one tensor a layer would see its own alone
        fork.layers
    fork2 = KVShard.extended(fork, more, 45, 48)  # the fork's next turn: in place in its own arena
    _equal(fork2, _joined(base, other, more), "the fork's next turn")
    assert fork2.head is base and fork2.arena is fork.arena and _same_memory(fork, fork2)
    assert [seg.k.data_ptr() for seg in fork2.segments(0)] == [base.own[0].k.data_ptr(), fork.own[0].k.data_ptr()]
    nested = KVShard.extended(fork, _shard(45, 2, 10), 45, 47)  # a fork of the fork: both heads shared
    _equal(nested, _joined(base, other, _shard(45, 2, 10)), "a fork of a fork")
    assert nested.head is fork and len(nested.segments(1)) == 3
    _equal(fork2, _joined(base, other, more), "the fork's next turn after the fork of the fork")
    for i in range(LAYERS):  # one layer as one store (a decode policy's path): the segments joined, once
        whole = fork2.whole(i)
        assert torch.equal(whole.k, _joined(base, other, more)[i][0]) and fork2.whole(i) is whole
        assert base.whole(i) is base.own[i]
    assert fork2.entries(0, 40)[0].data_ptr() == fork2.own[0].k.data_ptr()  # after the head: its own, no copy


def test_a_forks_head_follows_the_document_when_its_arena_grows():
    base, a, other = _shard(0, 40, 1), _shard(40, 6, 2), _shard(40, 5, 4)
    turn1 = KVShard.extended(base, a, 40, 46)
    fork = KVShard.extended(base, other, 40, 45)
    big = _shard(46, turn1.arena.capacity(0), 5)
    turn2 = KVShard.extended(turn1, big, 46, 46 + big.tokens())  # the document's arena grows: new buffers
    _equal(fork, _joined(base, other), "the fork after its document's arena grew")
    assert fork.segments(0)[0].k.data_ptr() == turn2.own[0].k.data_ptr()  # its head views the new buffers


def test_a_full_buffer_grows_and_every_turn_views_the_new_one():
    base, a = _shard(0, 40, 1), _shard(40, 6, 2)
    turn1 = KVShard.extended(base, a, 40, 46)
    room = turn1.arena.capacity(0)
    assert room == 46 + max(64, 46 // ARENA_SPARE)
    big = _shard(46, room, 5)  # more than the spare room
    want = [_content(base), _content(turn1), _joined(base, a, big)]
    turn2 = KVShard.extended(turn1, big, 46, 46 + room)
    assert turn2.arena is turn1.arena and turn2.arena.capacity(0) > room
    for shard, w, what in zip((base, turn1, turn2), want, ("base", "turn 1", "turn 2")):
        _equal(shard, w, what)
        assert _same_memory(shard, turn2), what  # pointed at the new buffers: the old ones are freed


def test_a_rank_dealt_nothing_keeps_its_tensors_and_an_empty_layer_is_shaped_by_the_new_tokens():
    base = _shard(0, 40, 1)
    ptrs = [layer.k.data_ptr() for layer in base.layers]
    turn1 = KVShard.extended(base, None, 40, 46)  # this rank holds none of the new tokens
    assert [layer.k.data_ptr() for layer in base.layers] == ptrs and _same_memory(base, turn1)
    assert turn1.arena.tip == 46 and turn1.tokens() == 40
    empty, part = _shard(0, 40, 6, empty_layer=1), _shard(40, 4, 7)
    grown = KVShard.extended(empty, part, 40, 44)
    _equal(grown, _joined(empty, part), "a base with an empty layer")
    assert len(grown.layers[1]) == 4


def _handle(key: str, shard: KVShard, tokens: int, nbytes: int) -> ContextHandle:
    return ContextHandle(key, torch.arange(tokens), shard, tokens, [], None, nbytes)


def test_the_cache_counts_a_conversation_once():
    base, a, b = _shard(0, 40, 1), _shard(40, 6, 2), _shard(46, 3, 3)
    cache = ContextCache(10 ** 9)
    h0 = _handle("t0", base, 40, base.nbytes())
    assert cache.put(h0) and cache.nbytes == base.nbytes()
    turn1 = KVShard.extended(base, a, 40, 46)
    turn1.arena.charged = turn1.arena.nbytes()
    cache.regroup(turn1.arena)  # the encoder's call: the kept base now lives in the arena
    assert cache.nbytes == turn1.arena.charged
    h1 = _handle("t1", turn1, 46, turn1.nbytes())
    turn2 = KVShard.extended(turn1, b, 46, 49)
    turn2.arena.charged = turn2.arena.nbytes()
    h2 = _handle("t2", turn2, 49, turn2.nbytes())
    assert cache.put(h1) and cache.put(h2)
    assert cache.nbytes == turn2.arena.charged < h0.nbytes + h1.nbytes + h2.nbytes
    assert cache.release("t2") and cache.nbytes == turn2.arena.charged  # turn 1 views the same buffers
    assert cache.release("t0") and cache.release("t1") and cache.nbytes == 0 and not cache._arenas


def test_a_budget_that_holds_the_arena_once_keeps_every_turn_and_evicts_what_else_is_over():
    base, a = _shard(0, 40, 1), _shard(40, 6, 2)
    other = _shard(0, 40, 8)
    charged = KVShard.extended(_shard(0, 40, 1), a, 40, 46).arena.nbytes()  # what turn 1's arena will hold
    cache = ContextCache(charged + other.nbytes() // 2)
    assert cache.put(_handle("other", other, 40, other.nbytes()))
    assert cache.put(_handle("t0", base, 40, base.nbytes())) and len(cache) == 2  # both fit, counted alone
    turn1 = KVShard.extended(base, a, 40, 46)
    turn1.arena.charged = turn1.arena.nbytes()
    cache.regroup(turn1.arena)  # the base now lives in the larger arena: the least recently used is evicted
    assert "other" not in cache and cache.nbytes == charged and cache.evictions == 1
    assert cache.put(_handle("t1", turn1, 46, turn1.nbytes()))  # in the arena already counted: adds nothing
    assert len(cache) == 2 and cache.nbytes == charged <= cache.budget_bytes
    small = ContextCache(turn1.arena.charged - 1)  # the arena alone exceeds this budget: nothing of it is kept
    assert not small.put(_handle("t1", turn1, 46, turn1.nbytes())) and small.nbytes == 0


def test_an_arena_is_cut_to_what_the_cache_keeps_when_later_turns_leave():
    """A document, a conversation of three long turns written after it in place, a fork off the document: once the
    turns leave the cache, the document's arena is cut to the document (and its spare), counted so, and is its tip
    again (the next conversation off it writes in place). The document and the fork's head read the same values; an
    evicted turn a request still reads keeps the old buffers and leaves the arena, so the next turn written after
    the document does not overwrite it."""
    base = _shard(0, 40, 1)
    turns = [base]
    for t in range(3):
        turns.append(KVShard.extended(turns[-1], _shard(40 + 200 * t, 200, 20 + t), 40 + 200 * t, 240 + 200 * t))
    fork = KVShard.extended(base, _shard(40, 5, 4), 40, 45)
    arena = base.arena
    arena.charged = arena.nbytes()
    cache = ContextCache(10 ** 9)
    for i, shard in enumerate(turns):
        assert cache.put(_handle(f"t{i}", shard, 40 + 200 * i, shard.nbytes()))
    assert cache.put(_handle("fork", fork, 45, fork.nbytes()))
    want_base, want_fork, want_last = _content(base), _content(fork), _content(turns[-1])
    before, last = cache.nbytes, turns[-1]  # (a request still reads the last turn)
    for i in (3, 2):  # the later turns leave first: the first turn still reaches far
        assert cache.release(f"t{i}")
    assert arena.tip == 240 and arena.capacity(0) == 240 + max(64, 240 // ARENA_SPARE)
    assert cache.release("t1")
    assert arena.tip == 40 and arena.capacity(0) == 40 + 64 and base.arena is arena
    assert cache.nbytes < before - arena.charged  # the arena's count scaled down to the document
    _equal(base, want_base, "the document after the cut")
    _equal(fork, want_fork, "the fork after its document's arena was cut")
    assert fork.segments(0)[0].k.data_ptr() == arena.bufs[0][0].data_ptr()  # its head views the new buffers
    _equal(last, want_last, "an evicted turn still read")
    assert last.arena is None and last not in arena.members
    nxt = KVShard.extended(base, _shard(40, 9, 30), 40, 49)  # the document is the tip again: in place
    assert nxt.head is None and nxt.arena is arena and _same_memory(nxt, base)
    _equal(last, want_last, "the evicted turn after the next turn was written")
    _equal(fork, want_fork, "the fork after the next turn")


def test_a_shed_cuts_no_arena():
    """shed() (a rank out of device memory drops every context) allocates nothing: no arena is cut on the way, even
    when the later turns go before the document."""
    base = _shard(0, 40, 1)
    turn = KVShard.extended(base, _shard(40, 400, 2), 40, 440)
    turn.arena.charged = turn.arena.nbytes()
    cache = ContextCache(10 ** 9)
    assert cache.put(_handle("t1", turn, 440, turn.nbytes())) and cache.put(_handle("t0", base, 40, base.nbytes()))
    capacity = turn.arena.capacity(0)
    cache.shed()
    assert len(cache) == 0 and turn.arena.capacity(0) == capacity and turn.arena.tip == 440


def test_an_arena_growing_for_a_new_turn_is_not_cut_by_the_evictions_it_causes():
    """A long new turn written in place makes its arena grow past the budget: the cache evicts the conversation's
    older turns (least recently used) to make room -- and must not cut the arena down to them, since the new turn,
    not counted yet, lies past them: it stays in the arena, counted once."""
    base = _shard(0, 40, 1)
    turn1 = KVShard.extended(base, _shard(40, 10, 2), 40, 50)
    arena = base.arena
    arena.charged = arena.nbytes()
    cache = ContextCache(10 ** 9)
    assert cache.put(_handle("t0", base, 40, base.nbytes())) and cache.put(_handle("t1", turn1, 50, turn1.nbytes()))
    turn2 = KVShard.extended(turn1, _shard(50, 400, 3), 50, 450)  # the buffers grow: 450 entries and their spare
    arena.charged = arena.nbytes()
    cache.budget_bytes = arena.charged  # the grown arena alone fits
    cache.regroup(arena)  # (the encoder's call) -- nothing is evicted: the arena is counted once
    cache.budget_bytes = arena.charged - 1
    assert not cache.put(_handle("t2", turn2, 450, turn2.nbytes()))  # too large now: nothing of it is kept
    cache.budget_bytes = arena.charged
    cache.put(_handle("other", _shard(0, 8, 9), 8, 1))  # over the budget by a byte: the conversation's turns go
    assert cache.put(_handle("t2", turn2, 450, turn2.nbytes()))
    assert turn2.arena is arena and arena.tip == 450 and _same_memory(turn1, turn2)
    assert "t2" in cache and cache.nbytes <= cache.budget_bytes


def _a_first_conversation(turns: int, seed: int, **flat) -> tuple:
    """An engine (and a fresh one, no cache) over a tiny Llama: a 200-token document and ``turns`` turns of 150 tokens
    written after it in its arena; (engine, fresh, document ids, query ids, the turns' contexts)."""
    model = tiny_model("llama", seed=seed)
    doc, q = _ids(1, 200), _ids(9, 4)
    eng = magnetar.init_inference(copy.deepcopy(model), timeout_s=60, **flat)
    fresh = magnetar.init_inference(copy.deepcopy(model), timeout_s=60, context_cache_mb=0,
                                    **{k: v for k, v in flat.items() if k != "host_cache_mb"})
    eng.encode(doc)
    first, ctx = [], doc
    for t in range(turns):
        ctx = torch.cat((ctx, _ids(40 + t, 150)))
        eng.encode(ctx)
        first.append(ctx)
    return eng, fresh, doc, q, first


@pytest.mark.parametrize("flat", [dict(method="dense"), dict(method="ring", cp_size=2, simulate=True)],
                         ids=["dense", "ring simulated"])
def test_a_documents_arena_is_cut_when_its_first_conversation_leaves(flat):
    """On the engine: a document, a conversation of long turns written after it, two conversations forking off it;
    the first conversation leaves the cache, and the cache counts the document's arena at the document's size again
    while the forks stay. The forks' answers, and a new conversation's (written after the document in place), equal
    a fresh engine's."""
    eng, fresh, doc, q, first = _a_first_conversation(4, seed=4, **flat)
    document = eng.encoder.cache.peek(eng.cache_key(doc))
    forks = [torch.cat((doc, _ids(60 + c, 20))) for c in range(2)]
    for c in forks:
        eng.encode(c)
    arena = document.shard.arena
    before, charged = eng.cache.nbytes, arena.charged  # the document and 600 tokens of turns
    for ctx in first:
        assert eng.cache.release(eng.cache_key(ctx))
    assert arena.tip == 200 and arena.charged < 0.4 * charged  # 200 of 800 tokens, and its spare
    assert eng.cache.nbytes == before - charged + arena.charged
    for c in [*forks, torch.cat((doc, _ids(80, 20)))]:  # the last: written after the document, in place
        got = eng.generate(c, q, max_new_tokens=3, return_logits=True)
        _same(got, fresh.generate(c, q, max_new_tokens=3, return_logits=True), f"{c.numel()} tokens")
    new = eng.cache.peek(eng.cache_key(c)).shard
    assert new.head is None and new.arena is arena


def test_another_conversation_in_a_cut_arena_keeps_its_own_host_copy():
    """A conversation's turns evicted into host memory while its document stays: the document's arena is cut, and a
    new conversation is written after the document in the same arena. Evicted too, its host copy is its own -- not a
    view of the first conversation's copy, whose entries after the document are another conversation's -- and both
    come back with a fresh engine's answers."""
    eng, fresh, doc, q, first = _a_first_conversation(3, seed=5, host_cache_mb=64)
    arena = eng.encoder.cache.peek(eng.cache_key(doc)).shard.arena
    eng.encode(doc)  # the document most recently used: the turns go first
    eng.cache.budget_bytes = eng.cache.nbytes
    eng.encode(_ids(70, 100))  # the turns are evicted into host memory, the arena cut to the document
    assert arena.tip == 200 and all(eng.cache_key(c) in eng.encoder.host for c in first)
    other = torch.cat((doc, _ids(80, 150)))  # written after the document in the cut arena
    eng.cache.budget_bytes = 10 ** 9
    assert eng.encode(other).shard.arena is arena
    eng.cache.release(eng.cache_key(_ids(70, 100)))
    eng.encode(doc)
    eng.cache.budget_bytes = eng.cache.nbytes
    eng.encode(_ids(71, 100))  # the new conversation's turn goes into host memory too
    assert eng.cache_key(other) in eng.encoder.host
    eng.cache.budget_bytes = 10 ** 9
    for c in (other, first[1]):
        got = eng.generate(c, q, max_new_tokens=3, return_logits=True)
        _same(got, fresh.generate(c, q, max_new_tokens=3, return_logits=True), f"{c.numel()} tokens")
        assert got.cached_context_tokens == c.numel()


@pytest.mark.parametrize("flat", [dict(method="dense"), dict(method="ring", cp_size=2, simulate=True)],
                         ids=["dense", "ring simulated"])
def test_a_conversation_stays_cached_within_one_documents_budget(flat):
    """Six turns over a 200-token document with a budget of 1.5 documents' KV: every turn is kept (one arena,
    one count) and each turn's answer equals a fresh engine's; before, each turn held the document again and the
    budget kept one turn."""
    model = tiny_model("llama", seed=2)
    doc, q = _ids(1, 200), _ids(9, 4)
    probe = magnetar.init_inference(copy.deepcopy(model), timeout_s=60, **flat)
    per_doc = probe.encode(doc).nbytes
    eng = magnetar.init_inference(copy.deepcopy(model), timeout_s=60, **flat)
    eng.cache.budget_bytes = int(1.5 * per_doc)  # below a MiB (the flag's unit) for the tiny model
    fresh = magnetar.init_inference(copy.deepcopy(model), timeout_s=60, context_cache_mb=0, **flat)
    ctx = doc
    for turn in range(6):
        got = eng.generate(ctx, q, max_new_tokens=3, return_logits=True)
        _same(got, fresh.generate(ctx, q, max_new_tokens=3, return_logits=True), f"turn {turn}")
        assert got.cached_context_tokens == (0 if turn == 0 else int(ctx.numel()) - 12), turn
        ctx = torch.cat((ctx, _ids(20 + turn, 12)))
    assert len(eng.cache) == 6 and eng.cache.evictions == 0, eng.cache.stats()
    handles = eng.cache.handles()
    assert len({id(h.shard.arena) for h in handles}) == 1
    assert eng.cache.nbytes == handles[0].shard.arena.charged < sum(h.nbytes for h in handles)


FORKS = [dict(method="dense"), dict(method="ring", cp_size=2, simulate=True),
         dict(method="star", cp_size=2, simulate=True, block_size=48, anchor_size=8, prefix_reuse="all"),
         dict(method="dense", sparse_policy="oracle_topk", sparse_budget=64, dense_layers=0),
         dict(method="dense", decode_step="static")]


@pytest.mark.parametrize("flat", FORKS, ids=["dense", "ring simulated", "star simulated", "oracle_topk", "static"])
def test_conversations_forking_from_one_document_hold_it_once(flat):
    """Four conversations over one 200-token document, two turns each: the first extends the document in place,
    the others fork -- each sharing the document's KV as its head, its own turns in an arena of its own --; the
    cache counts the document's arena once beside each conversation's; every turn's answer, alone and the four
    decoded as one batch (the shared document read once a step, or joined for a decode policy), equals a fresh
    engine's. Before, each fork copied the document."""
    model = tiny_model("llama", seed=3)
    doc, q = _ids(1, 200), _ids(9, 4)
    eng = magnetar.init_inference(copy.deepcopy(model), timeout_s=60, **flat)
    fresh = magnetar.init_inference(copy.deepcopy(model), timeout_s=60, context_cache_mb=0, **flat)
    document = eng.encode(doc)
    convs = [torch.cat((doc, _ids(30 + c, 12))) for c in range(4)]
    for turn in range(2):
        if turn:
            convs = [torch.cat((c, _ids(50 + i, 9))) for i, c in enumerate(convs)]
        for c in convs:
            got = eng.generate(c, q, max_new_tokens=3, return_logits=True)
            want = fresh.generate(c, q, max_new_tokens=3, return_logits=True)
            if flat["method"] == "star":  # prefix_reuse all: the new tokens attend the cached prefix exactly, where a
                assert got.token_ids == want.token_ids, turn  # fresh encode is Star's (logits differ: docs/engine.md)
            else:
                _same(got, want, f"turn {turn}")
            assert got.cached_context_tokens == int(c.numel()) - (12 if turn == 0 else 9), turn
    handles = [eng.cache.get(eng.cache_key(c)) for c in convs]
    assert handles[0].shard.head is None and handles[0].shard.arena is document.shard.arena
    assert all(h.shard.head is document.shard for h in handles[1:])  # the document itself, not a copy
    arenas = {id(a): a for h in [document, *handles] for a in h.shard.arenas()}
    assert len(arenas) == 4 and len(eng.cache) == 9 and eng.cache.evictions == 0
    assert eng.cache.nbytes == sum(a.charged for a in arenas.values()) < 2 * document.shard.arena.charged
    batch = eng.generate_batch([(c, q) for c in convs], max_new_tokens=3)
    assert [r.token_ids for r in batch] == [fresh.generate(c, q, max_new_tokens=3).token_ids for c in convs]
    for h in eng.cache.handles():  # the document and the first conversation leave: the forks still hold its arena
        if h.shard.head is None:
            assert eng.cache.release(h)
    assert len(eng.cache) == 6 and eng.cache.nbytes == sum(a.charged for a in arenas.values())


@pytest.mark.parametrize("backend,copied", [("sdpa_flash", False), ("sdpa_cudnn", True)])
def test_a_turns_kv_reaches_the_flash_kernel_where_it_lies(backend, copied, monkeypatch):
    """A turn's KV views the first entries of its arena's buffers (not contiguous along heads): torch's flash kernel
    takes it with its strides (no copy of the context's KV at every decode call); cuDNN's is given a copy. The kernel
    is a stand-in recording what it was given (the real ones run in tests/test_gpu.py on a card)."""
    from magnetar.ops.backends.sdpa_flash import SdpaCudnnBackend, SdpaFlashBackend
    from magnetar.ops.call import CAUSAL_BOTTOM_RIGHT, FULL, AttentionCall

    turn = KVShard.extended(_shard(0, 40, 1), _shard(40, 6, 2), 40, 46)
    k, v = turn.layers[0].k, turn.layers[0].v
    assert not k.is_contiguous()
    seen = []

    def kernel(q, k_, v_, scale, causal):
        seen.append((k_.data_ptr() == k.data_ptr(), v_.data_ptr() == v.data_ptr()))
        return torch.zeros_like(q), torch.zeros(q.shape[:3])

    be = (SdpaFlashBackend if backend == "sdpa_flash" else SdpaCudnnBackend)()
    monkeypatch.setattr(be, "kernel", kernel)
    q = torch.randn(B, 2 * H, 1, D)
    be._forward(AttentionCall(q, k, v, None, None, 0.5, FULL))  # a decode call over the context
    q = torch.randn(B, 2 * H, 4, D)
    be._forward(AttentionCall(q, k, v, None, None, 0.5, CAUSAL_BOTTOM_RIGHT))  # a chunk over it: its visible prefix
    assert seen[0] == (not copied, not copied) and seen[1] == (not copied, not copied), seen
