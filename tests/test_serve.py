"""The OpenAI-compatible server (magnetar/serve) against the real ``openai`` client on 127.0.0.1: answers equal
``Engine.generate``, streams join to the same text, 16 concurrent clients get their one-at-a-time answers, a
client that disconnects frees its slot, every bad request is a 400 naming its field (and the server keeps
serving), pinned contexts, metrics, and SIGTERM drains. One rank in this process (uvicorn in a thread) with a
tiny llama; SIGTERM in a subprocess. The multi-rank server and a killed rank: tests/test_serve_dist.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

openai = pytest.importorskip("openai", reason="the test extra: pip install 'magnetar[test]'")
pytest.importorskip("fastapi", reason="the serve extra: pip install 'magnetar[serve]'")

import magnetar  # noqa: E402
from magnetar.engine.requests import CheckedRequest  # noqa: E402
from magnetar.engine.sampling import SamplingParams  # noqa: E402
from magnetar.engine.template import split_messages, split_plain, split_prompt  # noqa: E402
from magnetar.serve.protocol import ChatCompletionRequest, RequestError, parse_body  # noqa: E402
from magnetar.serve.split import split_completion, split_pasted  # noqa: E402
from tests.conftest import repo_pythonpath  # noqa: E402
from magnetar.serve.server import Server  # noqa: E402
from magnetar.serve.ticks import Add, Encode, Tick  # noqa: E402
from tests.dist_utils import free_port, serve_in_thread, wait_serving  # noqa: E402
from tests.tiny_models import save_tiny_chat  # noqa: E402

NAME = "tiny"
DOCS = ["The quick brown fox jumps over the lazy dog. " * 6, "Magnetar serves long contexts on many ranks. " * 5,
        "A needle: the special magic number is 7351. Remember it well. " * 4]
POSITIONS = 4096  # room for requests long enough to be still decoding when the test acts (~3 ms a token)
LONG = 3000  # the max_tokens of a request that must still be decoding when its client leaves
DRAINED = 1000  # the max_tokens of one still decoding when SIGTERM comes (and drained by the server in a few s)
QUESTIONS = [" What jumps?", " Who serves?", " What is the number?", " Say it again."]
PASTE = 64  # the served fixture's --paste-threshold (tokens): DOCS[0] and longer pasted messages are documents


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_chat(tmp_path_factory.mktemp("tiny-chat"), POSITIONS)


@pytest.fixture(scope="module")
def ref(model_dir):
    """The engine the answers are compared with (its own model copy, used from the test thread only)."""
    return magnetar.init_inference(str(model_dir), method="dense", timeout_s=60)


@pytest.fixture(scope="module")
def served(model_dir):
    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60)
    with serve_in_thread(Server(engine, model_name=NAME, port=free_port(), max_batch_size=8, max_tokens=8,
                                paste_threshold=PASTE)) as server:
        yield server


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, doc, question, **kw):
    extra = kw.pop("extra_body", {})
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": question}],
                                          extra_body={"magnetar": {"context": doc}, **extra}, **kw)


def _metrics(server) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


# -- answers ---------------------------------------------------------------------------------------------------
def test_chat_completion_equals_generate(client, ref):
    want = ref.generate(DOCS[0], QUESTIONS[0], max_new_tokens=6)
    got = _chat(client, DOCS[0], QUESTIONS[0], max_tokens=6)
    assert got.choices[0].message.content == want.text
    assert got.usage.completion_tokens == len(want.token_ids) == 6
    assert got.usage.prompt_tokens == want.context_tokens + want.query_tokens
    assert got.choices[0].finish_reason == "length" and got.model == NAME and got.object == "chat.completion"
    # the same document again: its Phase 1 comes from the context cache
    again = _chat(client, DOCS[0], QUESTIONS[1], max_tokens=3)
    assert again.usage.prompt_tokens_details.cached_tokens == want.context_tokens
    assert again.choices[0].message.content == ref.generate(DOCS[0], QUESTIONS[1], max_new_tokens=3).text


def test_ignore_eos_goes_on_to_max_tokens(served, client, ref):
    # the answer's second token made the model's EOS: the answer ends there, unless the request sets ignore_eos
    # (vLLM's extension, as a throughput benchmark sends it): then it is the whole 6 tokens, finish_reason length
    want = ref.generate(DOCS[0], QUESTIONS[0], max_new_tokens=6)
    gen = served.engine.model.generation_config
    before = gen.eos_token_id
    gen.eos_token_id = want.token_ids[1]
    try:
        cut = _chat(client, DOCS[0], QUESTIONS[0], max_tokens=6)
        assert cut.usage.completion_tokens == 2 and cut.choices[0].finish_reason == "stop"
        whole = _chat(client, DOCS[0], QUESTIONS[0], max_tokens=6, extra_body={"ignore_eos": True})
        assert whole.usage.completion_tokens == 6 and whole.choices[0].finish_reason == "length"
        kept = [t for t in want.token_ids if t != want.token_ids[1]]  # the same greedy tokens, EOS left out of the text
        assert whole.choices[0].message.content == ref.tokenizer.decode(kept, skip_special_tokens=True)
    finally:
        gen.eos_token_id = before


def test_chat_without_context_is_the_conversation_before_the_question(client, ref, model_dir):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": DOCS[1]},
                {"role": "assistant", "content": "Read."}, {"role": "user", "content": QUESTIONS[1]}]
    p = split_messages(ref.tokenizer, messages)
    want = ref.generate(p.context_ids, p.query_ids, max_new_tokens=5)
    got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5)
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == int(p.context_ids.numel() + p.query_ids.numel())


def test_text_completions(client, ref):
    # with magnetar.context: the document as plain text and a blank line, the prompt as the query
    p = split_plain(ref.tokenizer, DOCS[2] + "\n\n", QUESTIONS[2])
    want = ref.generate(p.context_ids, p.query_ids, max_new_tokens=5)
    got = client.completions.create(model=NAME, prompt=QUESTIONS[2], max_tokens=5,
                                    extra_body={"magnetar": {"context": DOCS[2]}})
    assert got.choices[0].text == want.text and got.usage.completion_tokens == 5
    # without: the raw prompt is cut after its last blank line
    prompt = DOCS[2] + "\n\nQuestion: what is the number?\nAnswer:"
    context, query = split_completion(prompt)
    assert context == DOCS[2] + "\n\n" and query == "Question: what is the number?\nAnswer:"
    p = split_plain(ref.tokenizer, context, query)
    want = ref.generate(p.context_ids, p.query_ids, max_new_tokens=4)
    got = client.completions.create(model=NAME, prompt=prompt, max_tokens=4)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"


def test_method_options_per_request(client, ref):
    # the dense server encodes this request's context the streaming way: as that engine variant does
    doc = "Streams keep a window of recent tokens and a few sinks. " * 8
    options = {"method": "streaming", "window_size": 24, "sink_tokens": 4}
    want = ref.variant(**options).generate(doc, QUESTIONS[0], max_new_tokens=6)
    dense = ref.generate(doc, QUESTIONS[0], max_new_tokens=6)
    assert want.method == "streaming" and want.token_ids != dense.token_ids
    got = _chat(client, doc, QUESTIONS[0], max_tokens=6, extra_body={"magnetar": {"context": doc, **options}})
    assert got.choices[0].message.content == want.text and got.usage.prompt_tokens_details.cached_tokens == 0
    # the same document with the server's own method is another cache entry: encoded again, not a hit
    plain = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                           max_tokens=6, extra_body={"magnetar": {"context": doc}})
    # (a few first tokens may come from another test's cached context: the template's opening, prefix reuse)
    context = plain.model_extra["magnetar"]["prompts"][0]["context_tokens"]
    assert plain.usage.prompt_tokens_details.cached_tokens < context // 2 and plain.choices[0].message.content == \
        dense.text


def test_stop_string_finishes_with_stop(client, ref):
    full = ref.generate(DOCS[1], QUESTIONS[0], max_new_tokens=40).text
    # an ASCII letter or digit after the start (random bytes also decode to U+FFFD, which no token ends in)
    stop = next((c for c in full[3:] if c.isascii() and c.isalnum()), None)
    assert stop is not None, f"no ASCII letter in {full!r}"
    want = ref.generate(DOCS[1], QUESTIONS[0], max_new_tokens=40, stop=[stop])
    assert want.stop_reason == "stop_string"
    got = _chat(client, DOCS[1], QUESTIONS[0], max_tokens=40, stop=stop)
    assert got.choices[0].message.content == want.text and stop not in want.text
    assert got.choices[0].finish_reason == "stop" and got.usage.completion_tokens == len(want.token_ids)


def test_streamed_chunks_join_to_the_same_text(client, ref):
    want = ref.generate(DOCS[2], QUESTIONS[3], max_new_tokens=10)
    stream = _chat(client, DOCS[2], QUESTIONS[3], max_tokens=10, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    # completions stream too, without usage unless asked
    p = split_plain(ref.tokenizer, DOCS[0] + "\n\n", QUESTIONS[0])
    want = ref.generate(p.context_ids, p.query_ids, max_new_tokens=7)
    parts = list(client.completions.create(model=NAME, prompt=QUESTIONS[0], max_tokens=7, stream=True,
                                           extra_body={"magnetar": {"context": DOCS[0]}}))
    assert "".join(c.choices[0].text for c in parts) == want.text and all(c.usage is None for c in parts)


def test_the_sse_wire_format_ends_with_done(served):
    body = {"model": NAME, "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 3, "stream": True,
            "magnetar": {"context": DOCS[0]}}
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    first = json.loads(lines[0][6:])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"


def test_16_concurrent_clients_get_their_one_at_a_time_answers(client, ref):
    jobs = [(DOCS[i % 3], QUESTIONS[i % 4], 3 + i % 5, i % 2 == 0) for i in range(16)]
    want = [ref.generate(d, q, max_new_tokens=m).text for d, q, m, _ in jobs]  # one at a time

    def ask(job):
        doc, q, m, stream = job
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in _chat(client, doc, q, max_tokens=m, stream=True)
                           if c.choices)
        return _chat(client, doc, q, max_tokens=m).choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, jobs))
    assert got == want


def test_a_client_that_disconnects_mid_stream_frees_its_slot(served, client):
    before = _metrics(served).get(("magnetar_requests_total", (("endpoint", "/v1/chat/completions"),
                                                                ("outcome", "cancelled"))), 0)
    body = {"model": NAME, "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": LONG,
            "stream": True, "magnetar": {"context": DOCS[0]}}
    completed = _metrics(served)[("magnetar_completion_tokens_total", ())]
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # the first chunk (the assistant role); leaving the block closes the connection
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = _metrics(served)
        cancelled = m.get(("magnetar_requests_total", (("endpoint", "/v1/chat/completions"), ("outcome", "cancelled"))),
                          0)
        if cancelled == before + 1 and m[("magnetar_active_requests", ())] == 0:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the disconnected request was not cancelled: {m}")
    assert not served.loop.batch.active and not served.loop.jobs
    assert m[("magnetar_completion_tokens_total", ())] - completed < LONG  # it ended before its max_tokens
    assert _chat(client, DOCS[0], QUESTIONS[0], max_tokens=2).usage.completion_tokens == 2


# -- bad requests ------------------------------------------------------------------------------------------------
def _chat_body(**kw):
    body = {"model": NAME, "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 2,
            "magnetar": {"context": DOCS[0]}}
    body.update(kw)
    return body


BAD = [  # (id, path, body (bytes or dict), the param named)
    ("no messages", "chat", _chat_body(messages=[]), "messages"),
    ("messages missing", "chat", {"model": NAME}, "messages"),
    ("max_tokens 0", "chat", _chat_body(max_tokens=0), "max_tokens"),
    ("max_completion_tokens 0", "chat", _chat_body(max_tokens=None, max_completion_tokens=0), "max_completion_tokens"),
    ("max_tokens a string", "chat", _chat_body(max_tokens="5"), "max_tokens"),
    ("max_tokens 2.5", "chat", _chat_body(max_tokens=2.5), "max_tokens"),
    ("max_tokens a bool", "chat", _chat_body(max_tokens=True), "max_tokens"),
    ("unknown model", "chat", _chat_body(model="gpt-4"), "model"),
    ("context over the positions", "chat", _chat_body(magnetar={"context": "x" * (POSITIONS + 10)}),
     "magnetar.context"),
    ("max_tokens over the positions", "chat", _chat_body(max_tokens=POSITIONS), "max_tokens"),
    ("malformed JSON", "chat", b'{"model": "tiny", "messages": [', None),
    ("empty body", "chat", b"", None),
    ("not an object", "chat", b"[1, 2]", None),
    ("messages a string", "chat", _chat_body(messages="hi"), "messages"),
    ("content a number", "chat", _chat_body(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    ("unknown role", "chat", _chat_body(messages=[{"role": "robot", "content": "hi"}]), "messages[0].role"),
    ("last message not the user's", "chat", _chat_body(messages=[{"role": "assistant", "content": "hi"}]),
     "messages[0].role"),
    ("blank question", "chat", _chat_body(messages=[{"role": "user", "content": "  "}]), "messages[0].content"),
    ("temperature a string", "chat", _chat_body(temperature="hot"), "temperature"),
    ("temperature negative", "chat", _chat_body(temperature=-1), "temperature"),
    ("top_p 0", "chat", _chat_body(top_p=0), "top_p"),
    ("top_k negative", "chat", _chat_body(top_k=-1), "top_k"),
    ("ignore_eos a string", "chat", _chat_body(ignore_eos="yes"), "ignore_eos"),
    ("seed negative", "chat", _chat_body(seed=-1), "seed"),
    ("empty stop string", "chat", _chat_body(stop=[""]), "stop"),
    ("stop a number", "chat", _chat_body(stop=5), "stop"),
    ("n 0", "chat", _chat_body(n=0), "n"),
    ("n over the bound", "chat", _chat_body(n=65), "n"),
    ("split_document not a bool", "chat", _chat_body(magnetar={"split_document": "no"}), "magnetar.split_document"),
    ("top_logprobs without logprobs", "chat", _chat_body(top_logprobs=2), "top_logprobs"),
    ("top_logprobs over 20", "chat", _chat_body(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("logprobs an int in chat", "chat", _chat_body(logprobs=1), "logprobs"),
    ("completions logprobs over 20", "completions", {"model": NAME, "prompt": "a\n\nb", "logprobs": 21}, "logprobs"),
    ("scoring a one-token prompt", "completions", {"model": NAME, "prompt": [5], "echo": True, "logprobs": 1},
     "prompt"),
    ("unknown field", "chat", _chat_body(frobnicate=1), "frobnicate"),
    ("stream_options without stream", "chat", _chat_body(stream_options={"include_usage": True}), "stream_options"),
    ("unknown method", "chat", _chat_body(magnetar={"context": DOCS[0], "method": "warp"}), "magnetar.method"),
    ("bad block size", "chat", _chat_body(magnetar={"context": DOCS[0], "method": "star", "block_size": 0}),
     "magnetar.block_size"),
    ("layout option per request", "chat", _chat_body(magnetar={"context": DOCS[0], "cp_size": 2}),
     "magnetar.cp_size"),
    ("decode option per request", "chat", _chat_body(magnetar={"context": DOCS[0], "sparse_policy": "quest"}),
     "magnetar.sparse_policy"),
    ("unknown option", "chat", _chat_body(magnetar={"contxt": DOCS[0]}), "magnetar.contxt"),
    ("context not a string", "chat", _chat_body(magnetar={"context": 5}), "magnetar.context"),
    ("unknown context id", "chat", _chat_body(magnetar={"context_id": "ctx-nope"}), "magnetar.context_id"),
    ("one token id", "completions", {"model": NAME, "prompt": [5], "max_tokens": 2}, "prompt"),
    ("prompt a number", "completions", {"model": NAME, "prompt": 5}, "prompt"),
    ("empty prompt list", "completions", {"model": NAME, "prompt": []}, "prompt"),
    ("too many prompts", "completions", {"model": NAME, "prompt": ["a\n\nb"] * 65}, "prompt"),
    ("blank prompt in a list", "completions", {"model": NAME, "prompt": ["a\n\nb", " "]}, "prompt[1]"),
    ("token id outside the vocabulary", "completions", {"model": NAME, "prompt": [1, 10**9]}, "prompt"),
    ("negative token id in a list", "completions", {"model": NAME, "prompt": [[1, 2], [3, -1]]}, "prompt[1]"),
    ("token id past int64", "completions", {"model": NAME, "prompt": [1, 2**64]}, "prompt"),  # issue 44 item 8
    ("token id below int64 in a list", "completions", {"model": NAME, "prompt": [[1, 2], [3, -(2**70)]]}, "prompt[1]"),
    ("a 5000-digit token id", "completions", f'{{"model": "{NAME}", "prompt": [1, 1{"0" * 4999}]}}'.encode(),
     None),  # refused by the JSON parser: "number out of range at line 1 column 4334"
    ("mixed prompt list", "completions", {"model": NAME, "prompt": ["a\n\nb", [1, 2]]}, "prompt"),
    ("echo a string", "completions", {"model": NAME, "prompt": "a\n\nb", "echo": "yes"}, "echo"),
    ("split_document on completions", "completions",
     {"model": NAME, "prompt": "a\n\nb", "magnetar": {"split_document": False}}, "magnetar.split_document"),
    ("choices over the bound", "completions", {"model": NAME, "prompt": ["a\n\nb"] * 8, "n": 9}, "n"),
    ("completions max_tokens 0", "completions", {"model": NAME, "prompt": "a\n\nb", "max_tokens": 0}, "max_tokens"),
]


@pytest.mark.parametrize("path,body,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_request_is_a_400_naming_the_field_and_the_server_keeps_serving(served, client, path, body, param):
    url = served.url + ("/v1/chat/completions" if path == "chat" else "/v1/completions")
    if isinstance(body, dict):
        body = json.dumps({k: v for k, v in body.items() if v is not None}).encode()
    r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] is None, err
    assert err["message"] and (param is None or param.split("[")[0].split(".")[-1] in err["message"]), err
    assert _chat(client, DOCS[0], QUESTIONS[0], max_tokens=1).usage.completion_tokens == 1


def test_the_openai_client_sees_a_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[], max_tokens=2)
    assert e.value.status_code == 400 and e.value.param == "messages"


def test_unknown_routes_and_methods_get_openai_errors(served):
    r = httpx.get(served.url + "/v1/nothing", timeout=30)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(served.url + "/v1/chat/completions", timeout=30)
    assert r.status_code == 405 and "error" in r.json()


# -- contexts, models, health, metrics ---------------------------------------------------------------------------
def test_pinned_contexts(served, client, ref):
    r = httpx.post(served.url + "/v1/contexts", json={"model": NAME, "context": DOCS[1]}, timeout=60)
    assert r.status_code == 200, r.text
    ctx = r.json()
    assert ctx["object"] == "context" and ctx["id"].startswith("ctx-") and ctx["format"] == "chat"
    want = ref.generate(DOCS[1], QUESTIONS[2], max_new_tokens=4)
    assert ctx["tokens"] == want.context_tokens
    # posting it again gives the same id
    assert httpx.post(served.url + "/v1/contexts", json={"model": NAME, "context": DOCS[1]},
                      timeout=60).json()["id"] == ctx["id"]
    got = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUESTIONS[2]}], max_tokens=4,
                                         extra_body={"magnetar": {"context_id": ctx["id"]}})
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens_details.cached_tokens == want.context_tokens
    # a raw context serves completions
    raw = httpx.post(served.url + "/v1/contexts", json={"model": NAME, "context": DOCS[2], "format": "raw"},
                     timeout=60).json()
    p = split_plain(ref.tokenizer, DOCS[2] + "\n\n", QUESTIONS[0])
    want = ref.generate(p.context_ids, p.query_ids, max_new_tokens=3)
    got = client.completions.create(model=NAME, prompt=QUESTIONS[0], max_tokens=3,
                                    extra_body={"magnetar": {"context_id": raw["id"]}})
    assert got.choices[0].text == want.text
    for c in (ctx, raw):
        r = httpx.delete(served.url + f"/v1/contexts/{c['id']}", timeout=30)
        assert r.status_code == 200 and r.json()["deleted"] is True
    r = httpx.delete(served.url + f"/v1/contexts/{ctx['id']}", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "context_id"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "?"}], max_tokens=1,
                                       extra_body={"magnetar": {"context_id": ctx["id"]}})
    assert e.value.param == "magnetar.context_id"
    deadline = time.monotonic() + 10
    while served.loop.handles and time.monotonic() < deadline:  # the release is applied at the next tick
        time.sleep(0.05)
    assert not served.loop.handles
    # deleting a pinned context unpins it: the context cache keeps what automatic reuse shares
    again = _chat(client, DOCS[1], QUESTIONS[2], max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens == ctx["tokens"]


def test_models_health_and_metrics(served, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(served.url + "/health", timeout=30).json() == {"status": "ok"}
    for _ in range(2):  # the second a cache hit (the test holds alone, whichever tests ran before it)
        _chat(client, DOCS[0], QUESTIONS[0], max_tokens=2)
    m = _metrics(served)
    assert m[("magnetar_requests_total", (("endpoint", "/v1/chat/completions"), ("outcome", "length")))] >= 1
    assert m[("magnetar_completion_tokens_total", ())] >= 2 and m[("magnetar_prompt_tokens_total", ())] > 0
    assert m[("magnetar_time_to_first_token_seconds_count", ())] >= 1
    assert m[("magnetar_time_per_output_token_seconds_count", ())] >= 1
    assert m[("magnetar_context_cache_hits_total", ())] >= 1 and m[("magnetar_context_cache_misses_total", ())] >= 1
    assert m[("magnetar_kv_bytes", (("rank", "0"),))] > 0
    assert m[("magnetar_active_requests", ())] == 0
    assert m[("magnetar_build_info", (("model", NAME), ("version", magnetar.__version__)))] == 1


# -- unmodified clients: pasted documents, completions as tools send them, ops headers --------------------------------
PASTED = DOCS[0] * 3 + "\n\n" + DOCS[2] * 2  # a document long enough (> PASTE tokens) to be pasted


def test_a_document_pasted_into_the_chat_is_phase_1_and_cached(client, ref):
    system = {"role": "system", "content": "Answer briefly."}
    first = client.chat.completions.create(model=NAME, max_tokens=4, messages=[
        system, {"role": "user", "content": PASTED + "\n\n" + QUESTIONS[2].strip()}])
    info = first.model_extra["magnetar"]["prompts"][0]
    assert info["split"] == "pasted"
    # the document (through its blank line's first line break) opens the last user turn, as magnetar.context
    # does; the tail asks
    p = split_messages(ref.tokenizer, [system, {"role": "user", "content": "\n" + QUESTIONS[2].strip()}],
                       context=PASTED + "\n")
    want = ref.generate(p.context_ids, p.query_ids, max_new_tokens=4)
    assert first.choices[0].message.content == want.text
    assert info["context_tokens"] == p.context_ids.numel() and info["query_tokens"] == p.query_ids.numel()
    # another question about the same pasted document: its Phase 1 comes from the cache
    second = client.chat.completions.create(model=NAME, max_tokens=2, messages=[
        system, {"role": "user", "content": PASTED + "\n\n" + QUESTIONS[0].strip()}])
    assert second.usage.prompt_tokens_details.cached_tokens == info["context_tokens"]
    # turned off per request: the whole message is the question, the context only the turns before it
    whole = client.chat.completions.create(model=NAME, max_tokens=2, extra_body={"magnetar": {"split_document": False}},
                                           messages=[system, {"role": "user", "content": PASTED + "\n\nWhy?"}])
    assert whole.model_extra["magnetar"]["prompts"][0]["split"] == "conversation"
    assert whole.model_extra["magnetar"]["prompts"][0]["context_tokens"] < info["context_tokens"]
    # the next turn (the pasted message, the answer, a short question): its context extends the first's
    turn2 = client.chat.completions.create(model=NAME, max_tokens=2, messages=[
        system, {"role": "user", "content": PASTED + "\n\n" + QUESTIONS[2].strip()},
        {"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Why?"}])
    assert turn2.model_extra["magnetar"]["prompts"][0]["split"] == "conversation"
    assert turn2.usage.prompt_tokens_details.cached_tokens == info["context_tokens"]
    # a short message stays the question
    short = client.chat.completions.create(model=NAME, max_tokens=1, messages=[{"role": "user", "content": "Hi?"}])
    assert short.model_extra["magnetar"]["prompts"][0]["split"] == "conversation"


def test_the_next_turn_of_a_conversation_encodes_only_its_new_tokens(client, ref):
    messages = [{"role": "system", "content": DOCS[1] * 2}, {"role": "user", "content": "Who serves?"}]
    first = client.chat.completions.create(model=NAME, messages=messages, max_tokens=3)
    turn1 = first.model_extra["magnetar"]["prompts"][0]["context_tokens"]
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model=NAME, messages=messages, max_tokens=3)
    # the first turn's context (system prompt, user header) is a prefix of the second's: only the rest is encoded
    assert second.usage.prompt_tokens_details.cached_tokens == turn1
    p = split_messages(ref.tokenizer, messages)
    assert second.choices[0].message.content == ref.generate(p.context_ids, p.query_ids, max_new_tokens=3).text


def test_split_pasted_counts_tokens_not_characters_and_ignores_trailing_blanks(ref, client):
    """Issue 44 item 6: 30 CJK characters are 90 tokens of the byte-level tokenizer (over PASTE = 64): a document,
    though shorter than 64 characters; a document followed by blank lines and spaces is cut at its last non-blank
    text, never into a blank question."""
    tok = ref.tokenizer
    cjk = "東京は日本の首都です。" * 3  # 33 characters, 99 tokens
    assert len(cjk) < PASTE < len(tok(cjk, add_special_tokens=False)["input_ids"])
    head, tail = split_pasted(tok, cjk, PASTE)
    assert head + tail == cjk and head.strip() and tail.strip()
    doc = DOCS[0] * 2
    for trailing in ("\n\n" + " " * 100, "\n\n\n\n\n\n", "   \n  \n"):
        head, tail = split_pasted(tok, doc + trailing, PASTE)
        assert head + tail == doc + trailing and tail.strip() and head.strip()
    assert split_pasted(tok, " \n" * 80, PASTE) is None  # all blank: nothing to cut
    for trailing in ("\n\n" + " " * 100, "\n\n\n"):  # served: the pasted document is Phase 1, as without them
        got = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": doc + trailing}],
                                             max_tokens=2)
        assert got.model_extra["magnetar"]["prompts"][0]["split"] == "pasted"
    got = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": cjk}], max_tokens=2)
    assert got.model_extra["magnetar"]["prompts"][0]["split"] == "pasted"


def test_text_that_looks_like_the_servers_own_marks_is_text(client, ref):
    """Issue 44 item 7: the mark that cuts a conversation into context and question is private to each request,
    so a message holding the old fixed one is answered as text (it was a 400 about the chat template)."""
    mark = "\x00MAGNETAR_CONTEXT_END\x00"
    messages = [{"role": "system", "content": "Be brief." + mark}, {"role": "user", "content": "Why?" + mark}]
    got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=3)
    p = split_messages(ref.tokenizer, messages)
    assert got.usage.prompt_tokens == int(p.context_ids.numel() + p.query_ids.numel())
    assert got.choices[0].message.content == ref.generate(p.context_ids, p.query_ids, max_new_tokens=3).text


def test_split_pasted_cuts_at_the_last_paragraph_then_line_then_tokens(ref):
    tok = ref.tokenizer
    doc = DOCS[0] * 4
    assert split_pasted(tok, doc + "\n\nWhat jumps?\n", PASTE) == (doc + "\n", "\nWhat jumps?\n")
    assert split_pasted(tok, doc + "\nWhat jumps?", PASTE) == (doc + "\n", "What jumps?")
    assert split_pasted(tok, "What jumps?", PASTE) is None and split_pasted(tok, doc + "\n\nQ?", 0) is None
    head, tail = split_pasted(tok, doc, PASTE)  # no line break: the last 64 tokens are the question
    assert head + tail == doc and len(tok(tail, add_special_tokens=False)["input_ids"]) in range(63, 66)
    # a last paragraph longer than half the threshold is not the question: a line break inside it, or tokens
    head, tail = split_pasted(tok, "Intro.\n\n" + doc + "\nWhat jumps?", PASTE)
    assert tail == "What jumps?"
    # a threshold under the token cut's 64: the cut leaves the document at least one token
    head, tail = split_pasted(tok, "x" * 40, 8)
    assert head and head + tail == "x" * 40


def test_completions_take_lists_token_ids_echo_and_n(client, ref):
    prompts = [DOCS[1] + "\n\n" + QUESTIONS[1].strip(), DOCS[2] + "\n\n" + QUESTIONS[2].strip()]
    singles = [client.completions.create(model=NAME, prompt=pr, max_tokens=3).choices[0].text for pr in prompts]
    both = client.completions.create(model=NAME, prompt=prompts, max_tokens=3)
    assert [c.index for c in both.choices] == [0, 1] and [c.text for c in both.choices] == singles
    # token ids, as lm-eval sends them: the last 64 tokens are the query, the rest Phase 1
    ids = ref.tokenizer(DOCS[2] * 3, add_special_tokens=False)["input_ids"]
    want = ref.generate(torch.tensor(ids[:-64]), torch.tensor(ids[-64:]), max_new_tokens=3)
    got = client.completions.create(model=NAME, prompt=ids, max_tokens=3)
    assert got.choices[0].text == want.text and got.model_extra["magnetar"]["prompts"][0]["split"] == "tokens"
    assert got.usage.prompt_tokens == len(ids)
    lists = client.completions.create(model=NAME, prompt=[ids, ids[:10]], max_tokens=3)
    assert lists.choices[0].text == want.text and len(lists.choices) == 2
    # a prompt with no line break (aiperf's): a token cut too
    flat = client.completions.create(model=NAME, prompt="word " * 100, max_tokens=2)
    assert flat.model_extra["magnetar"]["prompts"][0]["split"] == "tokens"
    # echo puts the prompt before the answer; n choices of one prompt count its tokens once
    echoed = client.completions.create(model=NAME, prompt=prompts[0], max_tokens=3, echo=True, n=2)
    assert [c.text for c in echoed.choices] == [prompts[0] + singles[0]] * 2
    one = client.completions.create(model=NAME, prompt=prompts[0], max_tokens=3)
    assert echoed.usage.prompt_tokens == one.usage.prompt_tokens and echoed.usage.completion_tokens == 6
    # streamed, the choices' chunks carry their index and join to the same texts
    parts = ["", ""]
    for c in client.completions.create(model=NAME, prompt=prompts, max_tokens=3, stream=True):
        for ch in c.choices:
            parts[ch.index] += ch.text
    assert parts == singles


def test_lm_eval_log_likelihood_request_equals_hugging_face(served, client, model_dir):
    from transformers import AutoModelForCausalLM

    from tests.conftest import assert_close

    # lm-eval's local-completions: token ids, echo, logprobs 1, max_tokens 1, greedy
    ids = torch.randint(3, 200, (80,), generator=torch.Generator().manual_seed(0)).tolist()
    prompts = [ids[:40], ids[40:] + ids[:12]]
    got = client.completions.create(model=NAME, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    for choice, prompt in zip(sorted(got.choices, key=lambda c: c.index), prompts):
        lp = choice.logprobs
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1)
        expected = want[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]  # token i + 1 given 0..i
        # the first token (no past) has none, as OpenAI's; the second -- the first query token, after the 1-token
        # Phase 1 -- has Phase 1's last logits' (issue 44 item 9), every later one the query forward's
        assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(prompt) + 1
        assert_close(torch.tensor(lp.token_logprobs[1:-1]), expected, what="logits", msg="prompt log-probs")
        # the generated token's: greedy, so it is the most likely one, and its log-prob is HF's at the last position
        assert_close(lp.token_logprobs[-1], want[-1].max(), what="logits", msg="answer log-prob")
        assert all(len(top) == 1 and abs(max(top.values()) - max(want[i].tolist())) < 1e-4
                   for i, top in enumerate(lp.top_logprobs[1:]))
    # streamed: the same numbers, the echo's chunk first
    chunks = list(client.completions.create(model=NAME, prompt=prompts[0], echo=True, logprobs=1, max_tokens=2,
                                            stream=True))
    streamed = [x for c in chunks for ch in c.choices if ch.logprobs for x in ch.logprobs.token_logprobs]
    whole = client.completions.create(model=NAME, prompt=prompts[0], echo=True, logprobs=1, max_tokens=2)
    assert streamed == whole.choices[0].logprobs.token_logprobs
    # and the same text_offsets (issue 44 item 9), also where the text deltas hold words back (a text prompt)
    for prompt in (prompts[0], "The quick brown fox\n\njumps over the lazy"):
        kw = dict(model=NAME, prompt=prompt, echo=True, logprobs=1, max_tokens=8, temperature=0)
        offsets = [x for c in client.completions.create(stream=True, **kw) for ch in c.choices if ch.logprobs
                   for x in ch.logprobs.text_offset]
        assert offsets == client.completions.create(**kw).choices[0].logprobs.text_offset


def test_chat_logprobs_are_the_answer_tokens_and_their_alternatives(client, ref):
    got = _chat(client, DOCS[1], QUESTIONS[1], max_tokens=4, logprobs=True, top_logprobs=3)
    want = ref.generate(DOCS[1], QUESTIONS[1], max_new_tokens=4, return_logits=True)
    content = got.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
    first = torch.log_softmax(want.first_token_logits.double(), -1)
    from tests.conftest import assert_close

    assert_close(content[0].logprob, first.max(), what="logits", msg="first token")
    # greedy: each chosen token is its step's most likely one
    assert all(abs(c.logprob - c.top_logprobs[0].logprob) < 1e-6 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob >= c.top_logprobs[2].logprob for c in content)
    streamed = [x.logprob for c in _chat(client, DOCS[1], QUESTIONS[1], max_tokens=4, logprobs=True, stream=True)
                for ch in c.choices if ch.logprobs for x in ch.logprobs.content]
    assert streamed == [c.logprob for c in content]


def test_chat_n_choices_and_ops_headers(served, client, ref):
    got = _chat(client, DOCS[0], QUESTIONS[0], max_tokens=3, n=2)
    want = ref.generate(DOCS[0], QUESTIONS[0], max_new_tokens=3).text
    assert [c.message.content for c in got.choices] == [want, want] and got.usage.completion_tokens == 6
    # models by id (a Hub id holds a slash), /docs, the schema's request bodies
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/other")
    assert httpx.get(served.url + "/docs", timeout=30).status_code == 200
    schema = httpx.get(served.url + "/openapi.json", timeout=30).json()
    assert "requestBody" in schema["paths"]["/v1/completions"]["post"]
    # x-request-id: echoed when usable, made otherwise (refusals too)
    r = httpx.get(served.url + "/v1/models", headers={"x-request-id": "abc-123"}, timeout=30)
    assert r.headers["x-request-id"] == "abc-123"
    r = httpx.post(served.url + "/v1/completions", content=b"x", headers={"x-request-id": "bad id!"}, timeout=30)
    assert r.status_code == 415 and r.headers["x-request-id"].startswith("req-")


def test_cors_and_retry_headers_without_running_the_engine(served):
    from magnetar.serve.app import retry_headers

    assert retry_headers(503) == {"retry-after": "5"} and retry_headers(503, "dead") == {"x-should-retry": "false"}
    assert retry_headers(500) == {"x-should-retry": "false"} and retry_headers(400) == {}
    other = Server(served.engine, model_name=NAME, port=free_port(), allowed_origins=["https://app.example"])

    async def calls():
        transport = httpx.ASGITransport(app=other.asgi)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            pre = await c.options("/v1/chat/completions", headers={
                "origin": "https://app.example", "access-control-request-method": "POST",
                "access-control-request-headers": "authorization,content-type"})
            got = await c.get("/v1/models", headers={"origin": "https://app.example"})
            foreign = await c.get("/v1/models", headers={"origin": "https://evil.example"})
            other.loop.draining = True
            drained = await c.post("/v1/chat/completions", json=_chat_body())
            other.loop.failed = "a rank died"
            failed = await c.post("/v1/chat/completions", json=_chat_body())
            return pre, got, foreign, drained, failed

    import asyncio

    pre, got, foreign, drained, failed = asyncio.run(calls())
    other.preparer.close()
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
    assert pre.headers["x-request-id"].startswith("req-")  # issue 44 item 10: the preflight too
    assert got.headers["access-control-allow-origin"] == "https://app.example"
    assert "x-request-id" in got.headers["access-control-expose-headers"]
    assert "access-control-allow-origin" not in foreign.headers
    assert drained.status_code == 503 and drained.headers["retry-after"] == "5"
    assert failed.status_code == 503 and failed.headers["x-should-retry"] == "false"


# -- pieces without a server -------------------------------------------------------------------------------------
def test_split_messages_generalizes_split_prompt(ref):
    tok = ref.tokenizer
    one = split_messages(tok, [{"role": "user", "content": QUESTIONS[0]}], context=DOCS[0])
    two = split_prompt(tok, DOCS[0], QUESTIONS[0])
    assert one.context_ids.tolist() == two.context_ids.tolist() and one.query_ids.tolist() == two.query_ids.tolist()
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
                {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]
    p = split_messages(tok, messages)
    assert tok.decode(p.context_ids) == "<|system|>\nS\n<|user|>\nU1\n<|assistant|>\nA1\n<|user|>\n"
    assert tok.decode(p.query_ids) == "U2\n<|assistant|>\n"
    for bad, match in (([], "non-empty list"), ([{"role": "user"}], r"messages\[0\]\.content must be a str"),
                       ([{"role": "assistant", "content": "x"}], r"messages\[0\]\.role must be 'user'"),
                       ("hello", "non-empty list")):
        with pytest.raises(ValueError, match=match):
            split_messages(tok, bad)


def test_split_messages_without_a_template_and_special_tokens_are_text(ref):
    import copy

    tok = copy.deepcopy(ref.tokenizer)
    tok.chat_template = None
    p = split_messages(tok, [{"role": "system", "content": "Doc."}, {"role": "user", "content": " Q?"}])
    assert tok.decode(p.context_ids) == "Doc." and tok.decode(p.query_ids) == " Q?"
    with pytest.raises(ValueError, match="there is no context"):
        split_messages(tok, [{"role": "user", "content": " Q?"}])
    special = copy.deepcopy(ref.tokenizer)
    special.add_special_tokens({"additional_special_tokens": ["<|end|>"]})
    end = special.convert_tokens_to_ids("<|end|>")
    p = split_messages(special, [{"role": "user", "content": "a<|end|>b"}, {"role": "user", "content": "c<|end|>"}])
    assert end not in p.context_ids.tolist() + p.query_ids.tolist()


def test_request_parsing_is_strict_and_names_the_field():
    ok = parse_body(ChatCompletionRequest, b'{"model": "m", "messages": [{"role": "user", "content": "q"}], '
                                          b'"temperature": 1, "stop": "x"}')
    assert ok.temperature == 1.0 and ok.stop_list() == ["x"]
    for body, param in ((b'{"model": "m", "messages": [], "max_tokens": "3"}', "max_tokens"),
                        (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image"}]}]}',
                         "messages[0].content"),
                        (b'{"model": 1, "messages": []}', "model"), (b"{oops", None)):
        with pytest.raises(RequestError) as e:
            parse_body(ChatCompletionRequest, body)
        assert e.value.param == param and e.value.status == 400


def test_the_tick_round_trips_as_json():
    checked = CheckedRequest(torch.tensor([5, 6]), torch.tensor([1, 2]), SamplingParams(max_new_tokens=4, stop=["\n"]),
                             "k1", {"method": "star"})
    tick = Tick(adds=[Add(3, checked.to_dict()), Add(4, checked.to_dict(context=False), context_id="ctx-ab")],
                cancels=[1], encodes=[Encode(5, "ctx-cd", [9])], releases=["ctx-ef"])
    assert Tick.from_bytes(tick.to_bytes()) == tick and not tick.empty and Tick().empty
    back = [CheckedRequest.from_dict(a.request, context_ids=torch.tensor([5, 6]))
            for a in Tick.from_bytes(tick.to_bytes()).adds]
    assert all(torch.equal(b.context_ids, checked.context_ids) and torch.equal(b.query_ids, checked.query_ids) and
               b.params == checked.params and b.key == "k1" and b.options == {"method": "star"} for b in back)
    assert Tick.from_bytes(Tick(stop=True, error="x").to_bytes()) == Tick(stop=True, error="x")


# -- the command line and SIGTERM --------------------------------------------------------------------------------
def _serve_cmd(model_dir, port, *extra):
    return [sys.executable, "-m", "magnetar.serve", "--model", str(model_dir), "--method", "dense", "--port",
            str(port), "--served-model-name", NAME, "--timeout-s", "20", *extra]


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=repo_pythonpath(), OMP_NUM_THREADS="1", MAGNETAR_FUSED_MERGE="0")
    return env


@pytest.mark.parametrize("flags,message", [
    (["--port", "70000"], "--port: must be a TCP port in 1..65535"),
    (["--max-batch-size", "0"], "--max-batch-size: must be >= 1"),
    (["--served-model-name", " "], "--served-model-name is empty"),
    (["--method", "ring", "--cp-size", "2"], "cp-size"),
])
def test_bad_flags_end_with_one_error_line(model_dir, flags, message):
    cmd = [sys.executable, "-m", "magnetar.serve", "--model", str(model_dir), *flags]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.startswith("magnetar serve: error: ") and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_sigterm_drains_in_flight_requests_and_exits_0(model_dir, tmp_path):
    port = free_port()
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen(_serve_cmd(model_dir, port), env=_env(), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(url, proc, 240, lambda: (tmp_path / "server.log").read_text())
        lines, started = [], threading.Event()

        def stream():
            body = {"model": NAME, "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": DRAINED,
                    "stream": True, "stream_options": {"include_usage": True}, "magnetar": {"context": DOCS[0]}}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(120)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(url + "/v1/chat/completions", json=_chat_body(), timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error"
        assert refused.headers["retry-after"] == "5"  # a draining replica: retry (elsewhere) after 5 s
        reader.join(120)
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == DRAINED  # answered in full
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serving_threads_come_from_the_affinity_less_one_for_http(monkeypatch):
    from magnetar.serve.cli import choose_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert choose_threads(None)[:2] == (3, 4)  # decode (8 - 1) // 2, Phase 1 8 // 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert choose_threads(None)[:2] == (7, 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert choose_threads(None)[:2] == (1, 1)  # never 0
    assert choose_threads(5) == (5, 5, "--threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert choose_threads(None) == (None, None, "OMP_NUM_THREADS=2")  # the user's own: torch read it at start


def test_the_serve_flags_are_made_from_serve_config():
    """One place for the server's options: every ServeConfig field with a flag is a flag of `magnetar serve`, whose
    defaults parse back to ServeConfig's own."""
    from dataclasses import fields

    from magnetar.serve.cli import build_parser
    from magnetar.serve.config import ServeConfig

    args = build_parser().parse_args(["--model", "m"])
    assert ServeConfig.from_args(args, model_name="m") == ServeConfig(model_name="m")
    flagged = [f.name for f in fields(ServeConfig) if f.metadata["flag"]]
    assert {"port", "max_batch_size", "api_key", "allowed_origins", "prefill_chunk"} <= set(flagged)
    args = build_parser().parse_args(["--model", "m", "--max-batch-size", "3", "--allowed-hosts", "A.example,b",
                                      "--max-join-tokens", "64"])
    got = ServeConfig.from_args(args, model_name="m")
    assert (got.max_batch_size, got.allowed_hosts, got.max_join_tokens) == (3, ("a.example", "b"), 64)
    with pytest.raises(ValueError, match="max_stop_strings"):
        ServeConfig(model_name="m", max_stop_strings=10**6)
