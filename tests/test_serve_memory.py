"""Running out of device memory fails a request, never the server (magnetar.engine.memory, EngineLoop._fits / _step).

On a GPU a context that does not fit raises ``torch.OutOfMemoryError`` in its Phase 1, its query forward or a decode
step. The loop frees what the device holds for later (the cached contexts, the allocator's unused blocks) and tries
once more; a request that still does not fit fails alone -- 503 (busy: other requests held the device) or 400 (it
cannot fit this server) -- and the requests around it get their answers. A step that runs out cannot be taken again:
its requests fail, their KV freed. On a replica of several processes the failure is the replica's. CI has no GPU: the
allocations fail by monkeypatch, raising the exception CUDA's allocator raises."""
from __future__ import annotations

import dataclasses
import os

import httpx
import pytest
import torch

openai = pytest.importorskip("openai", reason="the test extra: pip install 'magnetar[test]'")
pytest.importorskip("fastapi", reason="the serve extra: pip install 'magnetar[serve]'")

import magnetar  # noqa: E402
from magnetar.engine.batch import ContinuousBatch  # noqa: E402
from magnetar.engine.context import ContextCache  # noqa: E402
from magnetar.engine.memory import OutOfDeviceMemory, out_of_memory  # noqa: E402
from magnetar.engine.phase2 import DecodeBatch  # noqa: E402
from magnetar.serve.loop import EngineLoop, Failed, Token  # noqa: E402
from magnetar.serve.metrics import Metrics  # noqa: E402
from magnetar.serve.scheduler import Job  # noqa: E402
from magnetar.serve.server import Server  # noqa: E402
from magnetar.serve.ticks import Add, Tick  # noqa: E402
from tests.dist_utils import free_port, serve_in_thread  # noqa: E402
from tests.test_serve_isolation import _Sink  # noqa: E402
from tests.tiny_models import save_tiny_chat  # noqa: E402

CONTEXT, QUERY = torch.arange(10, 40), torch.tensor([50, 51, 52])
HUGE = torch.arange(100, 160)  # the context whose Phase 1 "does not fit" (the patched allocation fails)
OOM = "CUDA out of memory. Tried to allocate 20.00 GiB (test)"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat(tmp_path_factory.mktemp("tiny-chat"), 1024)


@pytest.fixture(scope="module")
def engine(model_dir):
    return magnetar.init_inference(str(model_dir), method="dense", timeout_s=60)


def _loop(engine):
    loop = EngineLoop(engine, metrics=Metrics())
    loop.batch = engine.open_batch(agree=False)
    return loop


def _add(loop, engine, sid, context, query=QUERY, n=5):
    loop.jobs[sid] = job = Job("generate", sid, sink=_Sink())
    loop._apply(Tick(adds=[Add(sid, engine.check(context, query, max_new_tokens=n).to_dict())]))
    return job


def _tokens(sink):
    return [x.token_id for x in sink.items if isinstance(x, Token)]


def _drain(loop):
    while loop.batch.active:
        loop._step()


def _phase1_fails(monkeypatch, times=None):
    """ContinuousBatch.encode raises CUDA's out-of-memory error for HUGE (``times`` times, or always)."""
    encode, left = ContinuousBatch.encode, [times]

    def failing(self, request, **kw):
        if torch.equal(request.context_ids, HUGE) and (left[0] is None or left[0] > 0):
            if left[0] is not None:
                left[0] -= 1
            raise torch.OutOfMemoryError(OOM)
        return encode(self, request, **kw)

    monkeypatch.setattr(ContinuousBatch, "encode", failing)


def test_what_counts_as_running_out_of_memory():
    assert out_of_memory(torch.OutOfMemoryError(OOM))
    try:
        torch.empty(1 << 62, dtype=torch.uint8)  # the CPU allocator's own failure
    except RuntimeError as e:
        assert out_of_memory(e), e
    assert not out_of_memory(RuntimeError("shapes cannot be multiplied")) and not out_of_memory(ValueError("no"))


def test_the_cache_sheds_every_context_to_its_lower_tier():
    cache, evicted = ContextCache(1 << 30), []
    cache.on_evict = evicted.append

    class H:
        def __init__(self, key, n):
            self.key, self.nbytes, self.context_tokens = key, n, 4
            self.engine, self.options, self.context_ids = "e", "o", torch.arange(4) + n
            self.shard = None  # no KV: counted by its nbytes

    for key, n in (("a", 10), ("b", 20)):
        assert cache.put(H(key, n))
    assert cache.shed() == 30 and len(cache) == 0 and cache.nbytes == 0
    assert [h.key for h in evicted] == ["a", "b"] and cache.stats()["evictions"] == 2  # oldest first
    assert cache.prefix_tokens(torch.arange(4) + 10, "e", "o") == 0  # its index went too


def test_a_phase1_that_runs_out_once_frees_the_cache_and_runs_again(engine, monkeypatch, caplog):
    want = engine.generate(HUGE, QUERY, max_new_tokens=5).token_ids
    engine.relieve_memory()
    kept = engine.encode(CONTEXT)  # a cached context: what relieving memory drops
    assert kept.key in engine.cache
    _phase1_fails(monkeypatch, times=1)
    loop = _loop(engine)
    with caplog.at_level("WARNING", logger="magnetar.serve.loop"):
        job = _add(loop, engine, 1, HUGE)
    assert "out of device memory in the Phase 1 of a 60-token context" in caplog.text
    assert "trying once more" in caplog.text
    assert kept.key not in engine.cache
    _drain(loop)
    assert _tokens(job.sink) == want


def test_a_phase1_that_does_not_fit_fails_alone_and_the_server_goes_on(engine, monkeypatch):
    want = engine.generate(CONTEXT, QUERY, max_new_tokens=6).token_ids
    _phase1_fails(monkeypatch)
    loop = _loop(engine)
    good = _add(loop, engine, 1, CONTEXT, n=6)  # decoding while the other one runs out
    loop._step()
    huge = _add(loop, engine, 2, HUGE)
    [failed] = huge.sink.items
    assert isinstance(failed, Failed) and failed.error.status == 503 and failed.error.type == "server_error"
    message = str(failed.error)
    assert message.startswith("out of device memory in the Phase 1 of a 60-token context on cpu (CUDA out of memory.")
    assert "retry when fewer requests run" in message
    _drain(loop)
    assert _tokens(good.sink) == want  # the other request's answer is whole
    alone = _add(loop, engine, 3, HUGE)  # nothing else on the device: it cannot fit this server
    [failed] = alone.sink.items
    assert failed.error.status == 400 and failed.error.type == "invalid_request_error"
    assert "nothing else held the device: this request cannot fit here" in str(failed.error)
    monkeypatch.undo()
    again = _add(loop, engine, 4, CONTEXT, n=6)
    _drain(loop)
    assert _tokens(again.sink) == want and loop.failed is None


def test_a_query_forward_that_does_not_fit_fails_alone(engine, monkeypatch):
    cb_join = ContinuousBatch.join

    def failing(self, prepared):
        if any(torch.equal(p.query_ids, torch.tensor([7, 7, 7])) for p in prepared):
            raise torch.OutOfMemoryError(OOM)
        return cb_join(self, prepared)

    monkeypatch.setattr(ContinuousBatch, "join", failing)
    want = engine.generate(CONTEXT, QUERY, max_new_tokens=4).token_ids
    loop = _loop(engine)
    sinks = {sid: _Sink() for sid in (1, 2)}
    for sid, sink in sinks.items():
        loop.jobs[sid] = Job("generate", sid, sink=sink)
    loop._apply(Tick(adds=[Add(1, engine.check(CONTEXT, torch.tensor([7, 7, 7]), max_new_tokens=4).to_dict()),
                           Add(2, engine.check(CONTEXT, QUERY, max_new_tokens=4).to_dict())]))
    [failed] = sinks[1].items  # the joint forward failed twice, then each joined alone: only its own failed
    assert isinstance(failed, Failed) and failed.error.status in (400, 503)
    assert "out of device memory in the query forward of 1 request(s)" in str(failed.error)
    _drain(loop)
    assert _tokens(sinks[2]) == want


def test_a_decode_step_that_runs_out_fails_its_requests_and_frees_them(engine, monkeypatch):
    want = engine.generate(CONTEXT, QUERY, max_new_tokens=6).token_ids
    step, calls = DecodeBatch.step, [0]

    def failing(self):
        calls[0] += 1
        if calls[0] == 2:  # the second step runs out halfway (its first layers wrote their KV)
            raise torch.OutOfMemoryError(OOM)
        return step(self)

    monkeypatch.setattr(DecodeBatch, "step", failing)
    loop = _loop(engine)
    a, b = _add(loop, engine, 1, CONTEXT, n=6), _add(loop, engine, 2, CONTEXT, torch.tensor([60, 61]), n=6)
    loop._step()
    loop._step()  # runs out
    assert not loop.batch.active and not loop.rids and not loop.sids
    for job in (a, b):
        failed = job.sink.items[-1]
        assert isinstance(failed, Failed) and failed.error.status == 503
        assert "out of device memory in a decode step of 2 request(s)" in str(failed.error)
        assert len(_tokens(job.sink)) == 2  # the first token (the query forward) and the first step's
    after = _add(loop, engine, 3, CONTEXT, n=6)
    _drain(loop)
    assert _tokens(after.sink) == want and loop.failed is None
    calls[0] = 0
    one = _add(loop, engine, 4, CONTEXT, n=6)
    _drain(loop)
    assert one.sink.items[-1].error.status == 400  # it was alone on the device


def test_on_a_replica_of_several_processes_running_out_is_the_replicas_failure(engine):
    loop = _loop(engine)
    loop.groups = dataclasses.replace(loop.groups, cp_size=2)  # as if a CP peer waited in the request's collectives

    def runs_out():
        raise torch.OutOfMemoryError(OOM)

    with pytest.raises(torch.OutOfMemoryError):  # not one request's: the loop ends the replica
        loop._fits("the Phase 1 of a 60-token context", runs_out)
    with pytest.raises(OutOfDeviceMemory):  # on one process: the request's own
        _loop(engine)._fits("the Phase 1 of a 60-token context", runs_out)


def test_the_client_is_told_what_ran_out_and_what_to_change(model_dir, monkeypatch):
    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60)
    encode = ContinuousBatch.encode

    def failing(self, request, **kw):
        if request.context_tokens > 200:
            raise torch.OutOfMemoryError(OOM)
        return encode(self, request, **kw)

    monkeypatch.setattr(ContinuousBatch, "encode", failing)
    with serve_in_thread(Server(engine, model_name="tiny", port=free_port(), max_tokens=8)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Sum it up."}],
                                           max_tokens=4, extra_body={"magnetar": {"context": "A long report. " * 60}})
        assert "out of device memory in the Phase 1 of a" in e.value.body["message"]
        assert "shorten its context, or run it with more context-parallel ranks" in e.value.body["message"]
        ok = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Go on."}],
                                            max_tokens=4, extra_body={"magnetar": {"context": "A short note."}})
        assert ok.choices[0].message.content is not None
        assert server.loop.failed is None
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        assert 'outcome="out_of_memory"' in metrics
        from magnetar.engine.encode import KVRoom

        room = engine.encoder.room  # a context that certainly cannot fit: refused at admission, naming its field
        monkeypatch.setattr(engine.encoder, "room", KVRoom(room.per_token, 20 * room.per_token))
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Sum it up."}],
                                           max_tokens=4, extra_body={"magnetar": {"context": "A short report. " * 4}})
        assert e.value.body["param"] == "magnetar.context" and "context cannot fit" in e.value.body["message"]


def test_magnetar_run_says_in_one_line_what_ran_out(model_dir, monkeypatch, capsys):
    from magnetar.engine.engine import Engine
    from magnetar.launch.run import main

    def runs_out(self, *a, **kw):
        raise torch.OutOfMemoryError(OOM)

    monkeypatch.setattr(Engine, "generate", runs_out)
    with pytest.raises(SystemExit) as e:
        main(["--model", str(model_dir), "--context", "Some text.", "--query", "What?"])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "magnetar-run" in line]  # not the
    assert e.value.code == 2 and len(err) == 1, err  # weights' loading bar
    assert err[0].startswith("magnetar-run: error: out of device memory in this request (its Phase 1 or its decoding) "
                             "on cpu (CUDA out of memory.") and "--cp-size" in err[0], err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")
def test_a_real_cuda_allocation_failure_fails_the_request_alone(model_dir, monkeypatch):
    # CUDA's own allocator raises (a petabyte asked for inside the Phase 1): recognised, the device relieved (its
    # empty_cache), the free memory read into the message; the next request's answer is whole
    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60)
    assert engine.device.type == "cuda"
    want = engine.generate(CONTEXT, QUERY, max_new_tokens=5).token_ids
    encode = ContinuousBatch.encode

    def asks_too_much(self, request, **kw):
        if torch.equal(request.context_ids, HUGE):
            torch.empty(1 << 50, dtype=torch.uint8, device=engine.device)
        return encode(self, request, **kw)

    monkeypatch.setattr(ContinuousBatch, "encode", asks_too_much)
    loop = _loop(engine)
    [failed] = _add(loop, engine, 1, HUGE).sink.items
    assert isinstance(failed, Failed) and failed.error.status == 400, failed
    assert f"on {engine.device}" in str(failed.error) and "GiB free after it" in str(failed.error)
    job = _add(loop, engine, 2, CONTEXT)
    _drain(loop)
    assert _tokens(job.sink) == want and loop.failed is None
    metrics = Metrics()
    metrics.watch_device(engine.device)  # the card's own figures, read at the scrape
    assert b'magnetar_device_memory_bytes{kind="free"}' in metrics.render()


def test_metrics_report_the_devices_memory_when_scraped(monkeypatch):
    from magnetar.serve.metrics import Metrics

    cpu = Metrics()
    cpu.watch_device(torch.device("cpu"))  # a CPU's memory is the host's: nothing reported
    assert b"magnetar_device_memory_bytes" not in cpu.render()
    reads = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: reads.append(d) or (3 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 70 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 76 * 2**30)
    gpu = Metrics()
    gpu.watch_device(torch.device("cuda", 1))
    assert not reads  # read when scraped, not on the engine loop
    text = gpu.render().decode()
    assert reads == [torch.device("cuda", 1)]
    from prometheus_client.parser import text_string_to_metric_families

    [family] = [f for f in text_string_to_metric_families(text) if f.name == "magnetar_device_memory_bytes"]
    assert {s.labels["kind"]: s.value for s in family.samples} == {"free": 3 * 2**30, "total": 80 * 2**30,
                                                                    "allocated": 70 * 2**30, "reserved": 76 * 2**30}


def test_a_context_or_chunk_that_does_not_fit_fails_alone(engine, monkeypatch):
    # POST /v1/contexts' encode and a --prefill-chunk request's chunks take the same path: tried once more after the
    # cache is dropped, then the request's own 400 / 503 (the context API's names its field)
    from magnetar.engine.engine import Engine
    from magnetar.serve.ticks import Chunk, Encode

    def runs_out(self, *a, **kw):
        raise torch.OutOfMemoryError(OOM)

    monkeypatch.setattr(Engine, "encode", runs_out)
    monkeypatch.setattr(Engine, "encode_chunk", runs_out)
    loop = _loop(engine)
    for sid in (1, 2):
        loop.jobs[sid] = Job("generate", sid, sink=_Sink())
    sinks = {sid: loop.jobs[sid].sink for sid in (1, 2)}
    loop._apply(Tick(encodes=[Encode(1, "ctx-1", HUGE.tolist())], chunks=[Chunk(2, HUGE[:32].tolist())]))
    [ctx], [chunk] = sinks[1].items, sinks[2].items
    assert ctx.error.status == chunk.error.status == 400 and ctx.error.param == "context"
    assert "out of device memory in the Phase 1 of a 60-token context on cpu" in str(ctx.error)
    assert "out of device memory in the Phase 1 of a 32-token context's chunk" in str(chunk.error)
    assert "ctx-1" not in loop.handles and 2 not in loop._partial


# -- the certain refusal before a Phase 1: a context whose KV (and Phase-1 activations) cannot fit ---------------------
def test_a_tokens_kv_counts_the_global_layers_of_its_shard():
    from magnetar.engine.memory import device_room, kv_bytes_per_token
    from tests.tiny_models import tiny_model

    model = tiny_model("llama")
    c = model.config
    heads, dim = c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    assert kv_bytes_per_token(model) == c.num_hidden_layers * 2 * heads * dim * 4
    assert kv_bytes_per_token(model.to(torch.bfloat16)) == c.num_hidden_layers * 2 * heads * dim * 2
    gemma = tiny_model("gemma3")  # sliding-window layers may keep only their window: only the global ones count
    g = gemma.config
    n_global = sum(t == "full_attention" for t in g.layer_types)
    assert 0 < n_global < g.num_hidden_layers
    assert kv_bytes_per_token(gemma) == n_global * 2 * g.num_key_value_heads * g.head_dim * 4
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert device_room(torch.device("cpu"), 2**20) == physical - 2**20 and device_room(torch.device("cpu"), 2**62) == 0


def test_a_context_whose_kv_alone_cannot_fit_is_refused_before_its_phase1(engine, monkeypatch):
    from magnetar.engine.encode import KVRoom, Encoder

    per_token = engine.encoder.room.per_token
    assert per_token > 0 and engine.encoder.room.room > 0  # the real figures of this machine
    phase1 = []
    checked = engine.check(HUGE, QUERY, max_new_tokens=5).to_dict()  # admitted while the room was the machine's
    monkeypatch.setattr(Encoder, "_distributed", lambda self, *a: phase1.append(a) or pytest.fail("Phase 1 ran"))
    monkeypatch.setattr(engine.encoder, "room", KVRoom(per_token, 50 * per_token))  # room for 50 tokens' KV
    with pytest.raises(ValueError, match=r"^context: its KV alone needs .* GiB on one process \(it holds the whole "
                                         r"context\) \(60 tokens x .* KiB\), more than cpu holds beside the model's "
                                         r"weights .*: a 60-token context cannot fit; shorten it to at most about 50 "
                                         r"tokens, or spread it over at least 2 context-parallel ranks"):
        engine.generate(HUGE, QUERY, max_new_tokens=2)
    assert not phase1
    loop = _loop(engine)  # served, at its Phase 1: the request's own 400 on every rank alike, the server goes on
    loop.jobs[1] = job = Job("generate", 1, sink=_Sink())
    loop._apply(Tick(adds=[Add(1, checked)]))
    [failed] = job.sink.items
    assert failed.error.status == 400 and "a 60-token context cannot fit" in str(failed.error)
    monkeypatch.undo()
    assert engine.generate(HUGE, QUERY, max_new_tokens=2).token_ids  # it fits the real device


def test_the_room_is_per_rank_for_real_ranks_and_skipped_where_kv_may_be_less(engine):
    from magnetar.engine.encode import KVRoom

    per_token = engine.encoder.room.per_token
    room = KVRoom(per_token, 50 * per_token)
    four = engine.encoder.with_config(engine.config.replace(method="star", cp_size=4))  # real ranks: a quarter each
    four.room = room
    four.check_room(180)  # 45 tokens a rank fit
    with pytest.raises(ValueError, match=r"on its largest context-parallel rank \(60 tokens"):
        four.check_room(240)
    sim = engine.encoder.with_config(engine.config.replace(method="star", cp_size=4, simulate=True))
    sim.room = room
    with pytest.raises(ValueError, match="on one process"):  # simulated ranks: every shard in this process
        sim.check_room(180)
    streaming = engine.encoder.with_config(engine.config.replace(method="streaming"))
    streaming.room = room
    streaming.check_room(10_000)  # its KV keeps a window, not every token: nothing certain to refuse


def test_a_phase1_forward_holds_its_mlp_activations_beside_the_kv_kept_so_far():
    from magnetar.engine.memory import mlp_bytes_per_token, phase1_need
    from tests.tiny_models import tiny_model

    model = tiny_model("llama")
    c = model.config
    assert mlp_bytes_per_token(model) == (2 * c.hidden_size + 2 * c.intermediate_size) * 4
    assert mlp_bytes_per_token(model, tp_size=2) == (2 * c.hidden_size + c.intermediate_size) * 4  # gate/up split
    assert mlp_bytes_per_token(model.to(torch.bfloat16)) == (2 * c.hidden_size + 2 * c.intermediate_size) * 2
    # the KV kept so far accumulates over the forwards a process runs; the activations are the running one's
    assert phase1_need([(10, 20), (10, 20)], 3, 1) == (80, 60, 20)
    assert phase1_need([(1, 100), (10, 10)], 1, 1) == (101, 1, 100)  # a long first forward (a prefix) is the peak
    assert phase1_need([], 1, 1) == (0, 0, 0)


def test_a_context_whose_kv_fits_but_not_beside_its_phase1_activations_is_refused(engine):
    from magnetar.engine.encode import KVRoom

    p = engine.encoder.room.per_token
    assert engine.encoder.room.act_per_token > 0  # the real model's figure
    one = engine.encoder.with_config(engine.config)
    one.room = KVRoom(p, 100 * p, p)  # the KV of 100 tokens fits; a token's activations weigh one token's KV
    one.check_room(50)  # 50 kept + 50 processed
    with pytest.raises(ValueError, match=r"^context: its KV \(0.0 GiB: 60 tokens x .* KiB\) and the activations of "
                                         r"its largest Phase-1 forward's MLP \(0.0 GiB: 60 tokens x .* KiB\) need at "
                                         r"least .* GiB on one process .*: a 60-token context cannot fit; shorten it "
                                         r"to at most about 50 tokens, or spread it over at least 2 context-parallel"):
        one.check_room(60)
    # Star over 4 ranks at 180 tokens: a block of 45 a rank; ranks 1-3 run anchor + block (90 tokens)
    star = dict(method="star", cp_size=4)
    real = engine.encoder.with_config(engine.config.replace(**star))
    real.room = KVRoom(p, 45 * p + 90 * p, p)  # the largest rank: its 45 tokens' KV beside 90 tokens' activations
    real.check_room(180)
    real.room = KVRoom(p, 45 * p + 90 * p - 1, p)
    with pytest.raises(ValueError, match=r"KV \(0.0 GiB: 45 tokens .* MLP \(0.0 GiB: 90 tokens .* on its largest"):
        real.check_room(180)
    sim = engine.encoder.with_config(engine.config.replace(**star, simulate=True))
    sim.room = KVRoom(p, 180 * p + 90 * p, p)  # one process: every rank's KV by the last rank's forward
    sim.check_room(180)
    sim.room = KVRoom(p, 180 * p + 90 * p - 1, p)
    with pytest.raises(ValueError, match=r"KV \(0.0 GiB: 180 tokens .* MLP \(0.0 GiB: 90 tokens .* on one process"):
        sim.check_room(180)


def test_a_context_encoded_in_chunks_needs_its_kv_beside_one_chunks_activations(engine, monkeypatch):
    """A server's --prefill-chunk encodes a long context a chunk at a time, each extending the last in place: the
    admission counts the KV so far beside the running chunk's activations, so a context that fits chunked is not
    refused by the whole Phase 1's bound (and one that does not fit even so still is)."""
    from magnetar.config import FieldError
    from magnetar.engine.encode import KVRoom
    from magnetar.engine.memory import ContextTooLarge

    engine.cache.clear()  # (a context the cache holds is admitted as it is: nothing runs)
    p = engine.encoder.room.per_token
    one = engine.encoder.with_config(engine.config)
    one.room = KVRoom(p, 120 * p, p)  # 100 tokens' KV beside 20 tokens' activations
    one.check_room(100, chunk=20)
    with pytest.raises(ValueError, match="a 100-token context cannot fit"):
        one.check_room(100)  # in one Phase 1: 100 kept + 100 processed
    with pytest.raises(ValueError, match=r"KV \(0.0 GiB: 120 tokens .* MLP \(0.0 GiB: 20 tokens .* shorten it to at "
                                         r"most about 102 tokens"):
        one.check_room(120, chunk=20)
    monkeypatch.setattr(engine.encoder, "room", KVRoom(p, 62 * p, p))
    with pytest.raises(ContextTooLarge):
        engine.check(HUGE, QUERY, max_new_tokens=2)  # 60 tokens in one Phase 1
    assert engine.check(HUGE, QUERY, max_new_tokens=2, prefill_chunk=2).context_tokens == 60  # 60 kept + 2
    with pytest.raises(FieldError) as e:  # a method not encoded in chunks: the whole Phase 1's bound refuses it
        engine.check(HUGE, QUERY, max_new_tokens=2, prefill_chunk=2, options={"method": "star"})
    assert e.value.field == "options.method" and "a 60-token context cannot fit" in str(e.value)


def test_a_turn_over_a_kept_prefix_needs_only_its_new_tokens_activations(engine, monkeypatch):
    """A conversation's next turn extends its kept prefix: only the new tokens run, so the admission counts the
    whole context's KV beside the new tokens' activations (or a chunk's of them), not a whole Phase 1's."""
    from magnetar.engine.encode import KVRoom
    from magnetar.engine.memory import ContextTooLarge

    engine.cache.clear()
    p = engine.encoder.room.per_token
    one = engine.encoder.with_config(engine.config)
    one.room = KVRoom(p, 120 * p, p)
    one.check_room(100, cached=80)  # 100 kept + 20 processed
    one.check_room(110, chunk=10, cached=20)  # 110 kept + a chunk of 10
    with pytest.raises(ValueError, match="a 100-token context cannot fit"):
        one.check_room(100)  # a whole Phase 1: 100 kept + 100 processed
    with pytest.raises(ValueError, match=r"KV \(0.0 GiB: 110 tokens .* MLP \(0.0 GiB: 30 tokens"):
        one.check_room(110, cached=80)
    # real CP ranks: at least a rank's share of the KV (every token kept once), beside the new tokens on every rank
    # -- or, where an extension longer than its prefix is dealt over the ranks, beside a rank's share of them
    real = engine.encoder.with_config(engine.config.replace(method="star", cp_size=4))
    real.room = KVRoom(p, 45 * p + 35 * p, p)
    real.check_room(180, cached=145)  # 35 new tokens, all on every rank
    real.check_room(180, cached=40)  # 140 new tokens: 35 a rank
    with pytest.raises(ValueError, match=r"KV \(0.0 GiB: 45 tokens .* MLP \(0.0 GiB: 36 tokens .* largest"):
        real.check_room(180, cached=144)
    # through Engine.check: the kept prefix is found in the context cache (the same on every rank)
    handle = engine.encode(HUGE[:50])
    try:
        monkeypatch.setattr(engine.encoder, "room", KVRoom(p, 72 * p, p))
        with pytest.raises(ContextTooLarge):
            engine.check(HUGE[1:], QUERY, max_new_tokens=2)  # no kept prefix: 59 kept + 59 processed
        assert engine.check(HUGE, QUERY, max_new_tokens=2).context_tokens == 60  # 60 kept + 10 processed
        with pytest.raises(ValueError, match="a 60-token context cannot fit"):  # not extended: a whole Phase 1
            engine.check(HUGE, QUERY, max_new_tokens=2, options={"method": "star"})
        # the cache holds the context itself: nothing runs (its whole Phase 1, 50 + 50, would not fit 40)
        monkeypatch.setattr(engine.encoder, "room", KVRoom(p, 40 * p, p))
        assert engine.check(HUGE[:50], QUERY, max_new_tokens=2).context_tokens == 50
    finally:
        engine.release(handle)


class _Tier:
    """A lower tier (host memory, disk) as the admission asks it: holding ``key``, or a prefix of ``n`` tokens."""

    def __init__(self, key: str = "", n: int = 0):
        self.key, self.n = key, n

    def __contains__(self, key: str) -> bool:
        return key == self.key

    def loads_alone(self, key: str) -> bool:  # a whole context (a disk file), not a fork's own entries
        return key in self

    def longest_prefix(self, context_ids, options, prefix_of, comes_back=None) -> int:
        return self.n


def test_a_context_a_lower_tier_holds_needs_only_what_loading_it_takes(engine, monkeypatch):
    """After a restart (the disk tier) or an eviction (the host tier), a context a tier holds is loaded, not
    encoded: the admission counts its KV alone; a prefix a tier holds is extended: its KV beside the new tokens'."""
    from magnetar.engine.encode import KVRoom
    from magnetar.engine.memory import ContextTooLarge

    engine.cache.clear()
    p = engine.encoder.room.per_token
    key = engine.cache_key(HUGE)
    monkeypatch.setattr(engine.encoder, "room", KVRoom(p, 72 * p, p))
    with pytest.raises(ContextTooLarge):  # nothing held: a whole Phase 1, 60 + 60
        engine.check(HUGE, QUERY, max_new_tokens=2)
    monkeypatch.setattr(engine.encoder, "tiers", (_Tier(n=50),))
    assert engine.check(HUGE, QUERY, max_new_tokens=2).context_tokens == 60  # 60 kept + 10 new
    monkeypatch.setattr(engine.encoder, "tiers", (_Tier(key),))
    assert engine.check(HUGE, QUERY, max_new_tokens=2).context_tokens == 60  # its 60 tokens' KV, loaded
    monkeypatch.setattr(engine.encoder, "room", KVRoom(p, 50 * p, p))
    with pytest.raises(ValueError, match="its KV alone needs .* a 60-token context cannot fit"):
        engine.check(HUGE, QUERY, max_new_tokens=2)
    # a configuration that does not extend prefixes encodes the context whole despite a tier's prefix
    star = engine.variant(method="star").encoder
    assert star.can_extend() is not None
    monkeypatch.setattr(star, "room", KVRoom(p, 72 * p, p))
    monkeypatch.setattr(star, "tiers", (_Tier(n=50),))
    with pytest.raises(ValueError, match="a 60-token context cannot fit"):
        engine.check(HUGE, QUERY, max_new_tokens=2, options={"method": "star"})
    monkeypatch.setattr(star, "tiers", (_Tier(engine.variant(method="star").cache_key(HUGE)),))
    assert engine.check(HUGE, QUERY, max_new_tokens=2, options={"method": "star"}).context_tokens == 60  # loaded


def test_simulated_ranks_join_their_kv_without_holding_it_twice(model_dir, monkeypatch):
    from magnetar.engine.kv import KVShard

    def shard(n: int, start: int) -> KVShard:
        out = KVShard(3)
        for layer in out.layers:
            layer.append(torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4), torch.arange(start, start + n))
        out.freeze()
        return out

    parts = [shard(5, 0), shard(7, 5)]
    kept = KVShard.join(parts)  # a join that keeps its parts (an extension over a cached context)
    assert all(layer.k is not None for s in parts for layer in s.layers)
    joined = KVShard.join(parts, consume=True)
    assert all(layer.k is None and layer.frozen for s in parts for layer in s.layers)  # emptied layer by layer
    for a, b in zip(kept.layers, joined.layers):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(a.pos, b.pos) and b.k.shape[2] == 12
    # the engine's simulated ranks give their parts up (measured: Star x4 at 8K, 722 -> 561 MiB above the model)
    consumed, join = [], KVShard.join.__func__
    monkeypatch.setattr(KVShard, "join", classmethod(lambda cls, shards, **kw: consumed.append(kw) or
                                                     join(cls, shards, **kw)))
    sim = magnetar.init_inference(str(model_dir), method="star", cp_size=4, simulate=True, timeout_s=60)
    assert len(sim.generate(CONTEXT, QUERY, max_new_tokens=3).token_ids) == 3  # (its answers: tests/test_engine.py)
    assert consumed and all(kw == {"consume": True} for kw in consumed)


def test_simulated_ring_rank_by_rank_keeps_the_lock_step_kv_not_a_second_copy(model_dir, monkeypatch):
    from magnetar.engine.encode import KVRoom
    from magnetar.engine.kv import KVShard

    joins, join = [], KVShard.join.__func__
    monkeypatch.setattr(KVShard, "join", classmethod(lambda cls, shards, **kw: joins.append(kw) or
                                                     join(cls, shards, **kw)))
    ring = dict(method="ring", cp_size=4, simulate=True, timeout_s=60)
    timed = magnetar.init_inference(str(model_dir), rank_by_rank=True, **ring)
    got = timed.generate(CONTEXT, QUERY, max_new_tokens=4)
    assert not joins  # the ranks' own KV was not kept beside the lock-step forward's
    assert len(got.phase1_seconds) == 4 and all(t > 0 for t in got.phase1_seconds)  # every rank still timed
    assert got.token_ids == magnetar.init_inference(str(model_dir), **ring).generate(CONTEXT, QUERY,
                                                                                     max_new_tokens=4).token_ids
    # the room check counts that lock-step forward: the whole context's activations at once
    p, n = timed.encoder.room.per_token, 180
    timed.encoder.room = KVRoom(p, n * p + n * p, p)
    timed.encoder.check_room(n)
    timed.encoder.room = KVRoom(p, n * p + n * p - 1, p)
    with pytest.raises(ValueError, match=r"KV \(0.0 GiB: 180 tokens .* MLP \(0.0 GiB: 180 tokens .* on one process"):
        timed.encoder.check_room(n)


def test_a_phase1_piece_keeps_only_its_own_kv_and_one_piece_is_not_copied():
    from magnetar.engine.kv import LayerKV

    k, v = torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4)  # a forward's KV: an anchor (4) and a block (6)
    layer = LayerKV()
    layer.append(k[:, :, 4:], v[:, :, 4:], torch.arange(4, 10))  # Star keeps the block: not a view of the anchor's KV
    layer.freeze()
    assert torch.equal(layer.k, k[:, :, 4:]) and torch.equal(layer.v, v[:, :, 4:])
    assert layer.k.untyped_storage().nbytes() == layer.k.numel() * 4 and layer.k.data_ptr() != k.data_ptr()
    whole = LayerKV()
    whole.append(k, v, torch.arange(10))  # a rank's one whole segment (dense, ring): taken as it is at the freeze
    whole.freeze()
    assert whole.k is k and whole.v is v
    two = LayerKV()  # several segments: concatenated
    two.append(k[:, :, :4], v[:, :, :4], torch.arange(4))
    two.append(k[:, :, 4:], v[:, :, 4:], torch.arange(4, 10))
    two.freeze()
    assert torch.equal(two.k, k) and torch.equal(two.pos, torch.arange(10))


def test_the_leaders_check_refuses_what_cannot_fit_before_the_request_is_queued(engine, monkeypatch):
    from magnetar.engine.encode import KVRoom
    from magnetar.engine.memory import ContextTooLarge

    engine.cache.clear()  # (a context the cache holds is admitted as it is: nothing runs)
    per_token = engine.encoder.room.per_token
    monkeypatch.setattr(engine.encoder, "room", KVRoom(per_token, 50 * per_token))
    with pytest.raises(ContextTooLarge) as e:  # Engine.check: no collective, no compute -- the server's admission
        engine.check(HUGE, QUERY, max_new_tokens=2)
    assert e.value.field == "context" and "a 60-token context cannot fit" in str(e.value)
    assert engine.check(CONTEXT, QUERY, max_new_tokens=2).context_tokens == 30
