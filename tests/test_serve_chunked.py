"""Chunked Phase 1 in the server (``--prefill-chunk``, issue 33 item 3): a new context longer than the chunk is encoded
a chunk per tick, each extending the ones before it (prefix reuse), so the requests decoding go on between the chunks
instead of waiting for the whole Phase 1; the answer is the unchunked one's; the partial contexts leave the cache."""
from __future__ import annotations

import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai", reason="the test extra: pip install 'magnetar[test]'")
pytest.importorskip("fastapi", reason="the serve extra: pip install 'magnetar[serve]'")

import magnetar  # noqa: E402
from magnetar.serve.server import Server  # noqa: E402
from magnetar.serve.ticks import Chunk, Tick  # noqa: E402
from tests.dist_utils import free_port, serve_in_thread  # noqa: E402
from tests.tiny_models import save_tiny_chat, tiny_model  # noqa: E402

NAME, CHUNK = "tiny", 32
LONG_DOC = "".join(f"Line {i}: the value of item {i} is {i * 37 % 101}.\n" for i in range(24))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat(tmp_path_factory.mktemp("tiny-chat"), 4096)


@pytest.fixture(scope="module")
def served(model_dir):
    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60)
    with serve_in_thread(Server(engine, model_name=NAME, port=free_port(), max_batch_size=8, max_tokens=8,
                                prefill_chunk=CHUNK)) as server:
        yield server


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, doc, question, **kw):
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": question}],
                                          extra_body={"magnetar": {"context": doc}}, **kw)


def test_a_long_context_is_encoded_in_chunks_and_answers_as_a_whole(served, client, model_dir):
    ref = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60, context_cache_mb=0)
    want = ref.generate(LONG_DOC, " What is item 3?", max_new_tokens=6)
    assert want.context_tokens > 4 * CHUNK
    cache = served.engine.cache
    before = cache.stats()["prefix_hits"]
    got = _chat(client, LONG_DOC, " What is item 3?", max_tokens=6)
    assert got.choices[0].message.content == want.text
    chunks = -(-want.context_tokens // CHUNK) - 1  # every chunk after the first extends the ones before it
    assert cache.stats()["prefix_hits"] - before == chunks
    # only the whole context stays cached: each partial one left once the next chunk extended it
    assert sorted(h.context_tokens for h in cache.handles()) == [want.context_tokens]
    assert got.usage.prompt_tokens_details.cached_tokens == 0  # the request's own Phase 1, chunked
    again = _chat(client, LONG_DOC, " What is item 5?", max_tokens=4)
    assert again.usage.prompt_tokens_details.cached_tokens == want.context_tokens


def test_a_decoding_request_goes_on_between_the_chunks(served, client, monkeypatch):
    # A decodes; B brings a new long context: A gets a token after each of B's chunks (the loop's token events,
    # counted where they are routed: a tiny random model's tokens are mostly not yet text)
    events, started = [], threading.Event()
    route = served.loop._token

    def token(sid, ev):
        events.append((time.perf_counter(), sid))
        if len(events) == 3:
            started.set()
        route(sid, ev)

    monkeypatch.setattr(served.loop, "_token", token)
    a = threading.Thread(target=lambda: client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": " Count."}], max_tokens=1500, temperature=0,
        extra_body={"magnetar": {"context": "Numbers: 1 2 3.\n"}}))
    a.start()
    assert started.wait(60)
    a_sid = events[0][1]
    t0 = time.perf_counter()
    b = _chat(client, LONG_DOC * 3, " What is item 7?", max_tokens=2)  # ~ 80 chunks
    t1 = time.perf_counter()
    a.join(120)
    during = sum(t0 < t < t1 and sid == a_sid for t, sid in events)
    # its chunks start after what the cache held (the first test's LONG_DOC, when it ran: a cached prefix)
    context = b.model_extra["magnetar"]["prompts"][0]["context_tokens"]
    chunks = (context - b.usage.prompt_tokens_details.cached_tokens) // CHUNK
    a_all = [t for t, sid in events if sid == a_sid]
    assert during >= chunks - 2, (f"A got {during} tokens while B's {chunks} chunks ran; A: {len(a_all)} tokens, "
                                  f"its last {a_all[-1] - t1:.2f} s after B ended")


def test_chunks_are_held_by_their_request_whatever_the_cache_keeps(model_dir, monkeypatch):
    """Issue 44 item 2: a cache that keeps nothing (or less than one chunk's KV) still extends each chunk from the
    one before -- one Phase 1 for the first chunk, never one from scratch per chunk -- and ``cached_tokens`` is
    what was reused (nothing here: the turn before was not kept either)."""
    from magnetar.engine.encode import Encoder

    ref = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60, context_cache_mb=0)
    want = ref.generate(LONG_DOC, " What is item 3?", max_new_tokens=6)
    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60, context_cache_mb=0)
    phase1s, extended = [], []
    phase1, extend = Encoder.phase1, Encoder.extend
    monkeypatch.setattr(Encoder, "phase1", lambda self, ids, *a: phase1s.append(int(ids.numel())) or
                        phase1(self, ids, *a))
    monkeypatch.setattr(Encoder, "extend", lambda self, base, ids, *a: extended.append(
        (base.context_tokens, int(ids.numel()))) or extend(self, base, ids, *a))
    server = Server(engine, model_name=NAME, port=free_port(), max_tokens=8, prefill_chunk=CHUNK)
    with serve_in_thread(server):
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        _chat(api, LONG_DOC[:200], " What is item 1?", max_tokens=2)  # a turn before: not kept (budget 0)
        phase1s.clear(), extended.clear()
        got = _chat(api, LONG_DOC, " What is item 3?", max_tokens=6)
        assert got.choices[0].message.content == want.text
        assert phase1s == [CHUNK]  # the first chunk only; every later one extends the one before
        assert [n for n, _ in extended[1:]] == [m for _, m in extended[:-1]] and extended[-1][1] == want.context_tokens
        assert got.usage.prompt_tokens_details.cached_tokens == 0
        assert len(engine.cache) == 0 and not server.loop._partial  # nothing kept, nothing held after the request


def test_the_serve_config_bounds_reach_the_scheduler(served):
    from magnetar.serve.config import MAX_JOIN_TOKENS

    scheduler = served.loop.scheduler
    assert (scheduler.prefill_chunk, scheduler.max_join_tokens) == (CHUNK, MAX_JOIN_TOKENS)


def test_where_chunks_apply():
    eng = magnetar.init_inference(tiny_model("llama"), method="dense")
    assert eng.chunk_problem() is None
    off = magnetar.init_inference(tiny_model("llama"), method="dense", prefix_reuse="off")
    assert off.chunk_problem() == "runtime.prefix_reuse is off"
    star = magnetar.init_inference(tiny_model("llama"), method="star", cp_size=2, simulate=True)
    assert star.chunk_problem().startswith("cp_size 2: each rank encodes its own block")
    tick = Tick(chunks=[Chunk(3, [1, 2, 3])])
    assert Tick.from_bytes(tick.to_bytes()) == tick and not tick.empty
    assert torch.equal(torch.tensor(tick.chunks[0].context_ids), torch.tensor([1, 2, 3]))


def test_a_compiled_decode_step_is_warmed_up_before_serving(model_dir, monkeypatch, caplog):
    # torch.compile stood in by the uncompiled function (the compile itself: tests/test_static_decode.py): what is
    # checked is that the server runs the warm-up steps first, leaves no warm-up context cached, and answers as eager
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    ref = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60)
    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60, decode_step="compiled")
    server = Server(engine, model_name=NAME, port=free_port(), max_batch_size=4, max_tokens=8)
    with caplog.at_level("WARNING", logger="magnetar.serve.loop"), serve_in_thread(server):
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        got = _chat(api, LONG_DOC[:300], " What is item 2?", max_tokens=6)
    assert calls and calls[0]["dynamic"] is None
    assert "the decode step compiled before serving" in caplog.text
    assert got.choices[0].message.content == ref.generate(LONG_DOC[:300], " What is item 2?", max_new_tokens=6).text
    assert [h.context_tokens for h in engine.cache.handles()] == [got.model_extra["magnetar"]["prompts"][0][
        "context_tokens"]]  # no warm-up context left


def test_graph_decode_steps_are_captured_at_start_and_serve_concurrent_clients(model_dir, monkeypatch, caplog):
    # decode_step graph in the server: its shapes captured when the engine starts (the CPU stand-in for CUDA graphs
    # of tests/test_decode_graphs.py), concurrent clients answered as eager, from the graphs; a --max-batch-size above
    # the largest planned batch is said at start
    from concurrent.futures import ThreadPoolExecutor

    from magnetar.engine import graphs
    from tests.test_decode_graphs import _fake_record, _Replayed

    monkeypatch.setattr(graphs, "_can_capture", lambda device: True)
    monkeypatch.setattr(graphs, "_record", _fake_record)
    _Replayed.replays = 0
    ref = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60)
    # batches 1, 2 and 4: three clients that join at once pad to 4 (with 1,2 only, a batch of 3 ran uncaptured
    # and replayed nothing when the three arrived together: the test depended on their timing)
    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60, decode_step="graph",
                                     decode_graph_batches="1,2,4", decode_graph_tokens=4096)
    assert engine.decode_graphs.graphs and engine.decode_graphs.why_not is None
    questions = [f" What is item {i}?" for i in range(3)]
    with caplog.at_level("WARNING", logger="magnetar.serve.loop"):
        server = Server(engine, model_name=NAME, port=free_port(), max_batch_size=8, max_tokens=8)
    with serve_in_thread(server):
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda q: _chat(api, LONG_DOC[:400], q, max_tokens=6), questions))
    assert [g.choices[0].message.content for g in got] == [
        ref.generate(LONG_DOC[:400], q, max_new_tokens=6).text for q in questions]
    assert _Replayed.replays > 0  # (the pool's release after the last answer races the server's stop: not checked)
    assert "--max-batch-size 8 is more than the largest planned batch (4" in caplog.text


def test_a_new_exact_method_gets_prefix_reuse_and_chunks_from_its_registry_facts(monkeypatch):
    """Issue 46 item 3 (method facts): the engine and the server ask the registry whether a method's Phase 1 is exact
    (extendable prefixes, chunked Phase 1) or partitions its KV (prefix_reuse "all"); neither names a method."""
    from magnetar.config import METHODS, MethodSpec

    monkeypatch.setitem(METHODS, "dense_copy", MethodSpec("magnetar.methods.dense:DenseMethod", distributed=False,
                                                          local_prefill=True, exact=True, partitions=True))
    monkeypatch.setitem(METHODS, "approx_copy", MethodSpec("magnetar.methods.dense:DenseMethod", distributed=False,
                                                           local_prefill=True, partitions=True))
    exact = magnetar.init_inference(tiny_model("llama"), method="dense_copy")
    assert exact.encoder.can_extend() is None and exact.chunk_problem() is None
    approx = magnetar.init_inference(tiny_model("llama"), method="approx_copy")
    assert approx.encoder.can_extend() == ("method 'approx_copy' is not extended with prefix_reuse 'exact' (its "
                                           "Phase 1 is approximate: prefix_reuse 'all' extends it)")
    assert approx.chunk_problem().startswith("method 'approx_copy': its Phase 1 is not a causal pass")
    assert magnetar.init_inference(tiny_model("llama"), method="approx_copy", prefix_reuse="all").encoder \
        .can_extend() is None
