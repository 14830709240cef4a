"""One request can never end the server (issue 44, item 1): an exception that belongs to one request -- its
options, its tokens, its values -- fails that request alone, in its Phase 1, in the joint query forward and in the
token choice of a decode step; the requests around it get their answers and the server goes on. And a value the
model cannot give (more ``logprobs`` alternatives than its vocabulary) is refused up front, naming the field.

The HTTP cases run a real server on 127.0.0.1 (uvicorn in a thread) with the real ``openai`` client."""
from __future__ import annotations

import threading

import pytest
import torch

openai = pytest.importorskip("openai", reason="the test extra: pip install 'magnetar[test]'")
pytest.importorskip("fastapi", reason="the serve extra: pip install 'magnetar[serve]'")

import magnetar  # noqa: E402
from magnetar.engine.phase2 import DecodeBatch, RequestFailed  # noqa: E402
from magnetar.engine.sampling import RequestSampler, SamplingParams  # noqa: E402
from magnetar.serve.loop import EngineLoop, Failed, Token  # noqa: E402
from magnetar.serve.scheduler import Job  # noqa: E402
from magnetar.serve.metrics import Metrics  # noqa: E402
from magnetar.serve.server import Server  # noqa: E402
from magnetar.serve.ticks import Add, Tick  # noqa: E402
from tests.dist_utils import free_port, serve_in_thread  # noqa: E402
from tests.tiny_models import save_tiny, save_tiny_chat  # noqa: E402

POISON_SEED = 6661  # a request with this seed raises in its token choice (the monkeypatched sampler)
POISON_TOKEN = 3  # a query holding this id raises in the query forward (the monkeypatched forward)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat(tmp_path_factory.mktemp("tiny-chat"), 1024)


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory):
    """A model of 12 tokens: fewer than the 20 alternatives a request may ask for."""
    out = tmp_path_factory.mktemp("tiny-12")
    save_tiny(out, vocab_size=12)
    return out


@pytest.fixture
def poisoned(monkeypatch):
    """A sampler that raises for the requests seeded :data:`POISON_SEED`, on the rank that chooses: in ``choose``
    (a request that reads its own row) and in ``record`` (one chosen with its batch on the device)."""
    for name in ("choose", "record"):
        def fail(self, arg, _inner=getattr(RequestSampler, name)):
            if self.params.seed == POISON_SEED:
                raise IndexError("this request's own sampler failed (test)")
            return _inner(self, arg)

        monkeypatch.setattr(RequestSampler, name, fail)


def test_logprobs_beyond_the_vocabulary_are_refused_by_name(small_vocab_dir):
    engine = magnetar.init_inference(str(small_vocab_dir), method="dense", timeout_s=60)
    with pytest.raises(ValueError, match=r"^logprobs must be at most the model's vocabulary size \(12 tokens"):
        engine.sampling_params(logprobs=13)
    assert engine.sampling_params(logprobs=12).logprobs == 12
    with pytest.raises(ValueError, match="logprobs must be at most"):  # the batch's own check of a made params
        engine.open_batch().prepare(torch.tensor([1, 2, 3]), torch.tensor([4, 5]), SamplingParams(logprobs=20))
    with serve_in_thread(Server(engine, model_name="tiny", port=free_port(), max_tokens=4)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt=[1, 2, 3, 4, 5], max_tokens=2, logprobs=20)
        assert e.value.body["param"] == "logprobs" and "12 tokens" in e.value.body["message"]
        ok = client.completions.create(model="tiny", prompt=[1, 2, 3, 4, 5], max_tokens=2, logprobs=12)
        assert len(ok.choices[0].logprobs.top_logprobs[0]) == 12  # the most there are


def test_a_request_whose_token_choice_raises_fails_alone(model_dir, poisoned):
    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60)
    want = engine.generate("A long document. " * 8, "Go on.", max_new_tokens=24).text
    with serve_in_thread(Server(engine, model_name="tiny", port=free_port(), max_tokens=24)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        pieces, done = [], threading.Event()

        def stream():  # decoding while the poisoned request joins, steps and fails
            for chunk in client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "Go on."}], stream=True, max_tokens=24,
                    extra_body={"magnetar": {"context": "A long document. " * 8}}):
                if chunk.choices:
                    pieces.append(chunk.choices[0].delta.content or "")
            done.set()

        t = threading.Thread(target=stream)
        t.start()
        for _ in range(3):  # sampled (seeded) and greedy both go through the chooser
            with pytest.raises(openai.InternalServerError) as e:
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi."}],
                                               max_tokens=4, seed=POISON_SEED, temperature=0.7)
            assert "IndexError: this request's own sampler failed" in e.value.body["message"]
        t.join(60)
        assert done.is_set() and "".join(pieces) == want
        after = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Go on."}],
                                               max_tokens=24,
                                               extra_body={"magnetar": {"context": "A long document. " * 8}})
        assert after.choices[0].message.content == want  # the server goes on
        assert server.loop.failed is None


def test_the_batch_without_isolation_raises_on_every_rank(model_dir, poisoned):
    """``Engine.generate`` (no isolation) raises the request's own error; a stream raises RequestFailed."""
    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60)
    with pytest.raises(IndexError, match="own sampler"):
        engine.generate("Some context.", "Q?", max_new_tokens=3, seed=POISON_SEED, temperature=0.5)
    with pytest.raises(RequestFailed, match="IndexError: this request's own sampler"):
        list(engine.stream("Some context.", "Q?", max_new_tokens=3, seed=POISON_SEED, temperature=0.5))


class _Sink:
    def __init__(self):
        self.items = []

    def put(self, item):
        self.items.append(item)


def test_a_joint_query_forward_that_raises_fails_only_the_request_that_raised(model_dir, monkeypatch):
    """Two requests in one tick (one query forward); one of them makes the forward raise: they join one at a
    time, the other one decodes to its answer alone and the loop goes on."""
    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60)
    forward = DecodeBatch._forward

    def poisoned_forward(self, live, ids, starts, valid, what, every=False):
        if what == "the query" and any(POISON_TOKEN in r.req.query.tolist() for r in live):
            raise RuntimeError("this request's query broke the forward (test)")
        return forward(self, live, ids, starts, valid, what, every)

    monkeypatch.setattr(DecodeBatch, "_forward", poisoned_forward)
    context, good = torch.arange(10, 40), torch.tensor([50, 51, 52])
    want = engine.generate(context, good, max_new_tokens=5).token_ids
    loop = EngineLoop(engine, metrics=Metrics())
    loop.batch = engine.open_batch(agree=False)
    sinks = {sid: _Sink() for sid in (1, 2)}
    for sid, sink in sinks.items():
        loop.jobs[sid] = Job("generate", sid, sink=sink)
    loop._apply(Tick(adds=[Add(1, engine.check(context, torch.tensor([60, POISON_TOKEN]), max_new_tokens=5).to_dict()),
                           Add(2, engine.check(context, good, max_new_tokens=5).to_dict())]))
    [failed] = sinks[1].items
    assert isinstance(failed, Failed) and failed.error.status == 500
    assert "RuntimeError: this request's query broke the forward" in str(failed.error)
    while loop.batch.active:
        loop._route(loop.batch.step())
    assert [x.token_id for x in sinks[2].items if isinstance(x, Token)] == want
