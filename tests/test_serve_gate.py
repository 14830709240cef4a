"""What a client may send (issue 28): the request-body limit (413), texts too long for the model refused from a
bounded prefix, stop-string bounds, the API key (401), JSON-only POSTs (415), the Host check (DNS rebinding),
request heads and bodies that never arrive (closed / 408), the connection limit (503), and tokenizing that does
not serialise the clients. Real servers on 127.0.0.1 with a tiny llama; the real ``openai`` client or raw HTTP."""
from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai", reason="the test extra: pip install 'magnetar[test]'")
pytest.importorskip("fastapi", reason="the serve extra: pip install 'magnetar[serve]'")

import magnetar  # noqa: E402
from magnetar.serve.server import Server  # noqa: E402
from tests.dist_utils import free_port, serve_in_thread  # noqa: E402
from tests.tiny_models import save_tiny_chat  # noqa: E402

NAME = "tiny"
KEY = "sk-magnetar-test"
POSITIONS = 1024
BODY_LIMIT = 256 * 1024
TIMEOUT_S = 1.5  # the server's --request-timeout-s
DOC = "The quick brown fox jumps over the lazy dog. " * 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_chat(tmp_path_factory.mktemp("tiny-gate"), POSITIONS)


@contextlib.contextmanager
def serving(model_dir, **kw):
    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60)
    with serve_in_thread(Server(engine, model_name=NAME, port=free_port(), max_batch_size=4, max_tokens=4, **kw)) \
            as server:
        yield server


@pytest.fixture(scope="module")
def keyed(model_dir):
    with serving(model_dir, api_key=KEY, max_request_bytes=BODY_LIMIT, request_timeout_s=TIMEOUT_S) as server:
        yield server


def _client(server, key=KEY):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _chat(client, doc=DOC, question=" What jumps?", **kw):
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": question}],
                                          extra_body={"magnetar": {"context": doc}}, max_tokens=3, **kw)


def _error(exc) -> dict:
    return exc.response.json()["error"]


def _raw(server, request: bytes, *, wait_s: float = 30.0) -> bytes:
    """Send ``request`` bytes on a new connection and read until the server closes it (or ``wait_s``)."""
    with socket.create_connection((server.host, server.port), timeout=wait_s) as s:
        s.sendall(request)
        out = b""
        with contextlib.suppress(socket.timeout, ConnectionResetError):
            while chunk := s.recv(65536):
                out += chunk
        return out


# -- the API key -----------------------------------------------------------------------------------------------
def test_api_key_is_required_on_v1_and_metrics_and_the_client_key_just_works(keyed):
    assert _chat(_client(keyed)).choices[0].finish_reason in ("stop", "length")
    for key in ("wrong", ""):
        with pytest.raises(openai.AuthenticationError) as e:
            _chat(_client(keyed, key=key or "x"))
        err = _error(e.value)
        assert err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"]
    assert e.value.response.headers["www-authenticate"] == "Bearer"
    for path in ("/v1/models", "/v1/contexts/ctx-x", "/metrics"):
        assert httpx.get(keyed.url + path, timeout=30).status_code == 401, path
    assert httpx.get(keyed.url + "/health", timeout=30).status_code == 200  # open, as in vLLM and SGLang
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(keyed.url + "/metrics", headers=auth, timeout=30).status_code == 200
    assert httpx.get(keyed.url + "/v1/models", headers=auth, timeout=30).json()["data"][0]["id"] == NAME


def test_a_key_from_a_secret_file_works_and_one_no_client_can_send_is_refused_at_start(model_dir, monkeypatch,
                                                                                        capsys):
    """Issue 44 item 5: a mounted secret ends in a newline -- stripped, as the token a client sends is; a key an HTTP
    header cannot carry (non-ASCII, a control character) would start a server nobody can use: refused by name."""
    with serving(model_dir, api_key=f"  {KEY}\n") as server:
        assert _chat(_client(server)).choices[0].message.content is not None
        with pytest.raises(openai.AuthenticationError):
            _chat(_client(server, key=KEY + "x"))
    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60)
    for key, words in (("sk-clé", "api_key holds 'é' (U+00E9)"), ("sk\x01x", "api_key holds '\\x01'"),
                       (" \n", "api_key is empty")):
        with pytest.raises(ValueError, match=re.escape(words)):
            Server(engine, model_name=NAME, port=free_port(), api_key=key)
    from magnetar.serve import cli

    monkeypatch.setattr(magnetar, "init_inference", lambda *a, **k: pytest.fail("the model loaded"))
    monkeypatch.setenv("MAGNETAR_API_KEY", "ключ")
    with pytest.raises(SystemExit) as e:
        cli.main(["--model", str(model_dir), "--port", str(free_port())])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "MAGNETAR_API_KEY holds 'к' (U+043A)" in err and "Traceback" not in err, err


def test_public_metrics_and_no_key(model_dir):
    with serving(model_dir, api_key=KEY, public_metrics=True) as server:
        assert httpx.get(server.url + "/metrics", timeout=30).status_code == 200
        assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401


# -- what a request may hold ----------------------------------------------------------------------------------
def test_a_body_over_the_limit_is_413_and_the_server_keeps_serving(keyed):
    client = _client(keyed)
    with pytest.raises(openai.APIStatusError) as e:
        _chat(client, doc="x" * (BODY_LIMIT + 10))
    assert e.value.status_code == 413 and _error(e.value)["code"] == "request_too_large"
    assert f"{BODY_LIMIT} bytes, --max-request-bytes" in _error(e.value)["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(BODY_LIMIT // 4096 + 2):
            yield b"y" * 4096
        yield b'"}]}'

    r = httpx.post(keyed.url + "/v1/chat/completions", content=chunks(), timeout=60,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert _chat(client).choices[0].message.content is not None


def test_a_context_that_cannot_fit_is_refused_from_a_prefix(keyed):
    """Under the body limit, far over the model's positions: a 400 naming the field, before it is tokenized
    whole (the prefix rule itself: tests/test_template.py)."""
    client = _client(keyed)
    for kw, param in ((dict(doc="word " * 40000), "magnetar.context"),
                      (dict(question="word " * 40000 + "?"), "messages")):
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, **kw)
        err = _error(e.value)
        assert err["param"] == param and "too long for the model's 1024 positions" in err["message"], err
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/contexts", body={"model": NAME, "context": "word " * 40000}, cast_to=httpx.Response)
    assert _error(e.value)["param"] == "context" and "too long" in _error(e.value)["message"]


def test_stop_lists_are_bounded(keyed):
    client = _client(keyed)
    assert _chat(client, stop=["a", "b", "c", "d"]).choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, stop=[f"s{i}" for i in range(5)])
    err = _error(e.value)
    assert err["param"] == "stop" and "at most 4" in err["message"] and "--max-stop-strings" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, stop=["x" * 600])
    assert _error(e.value)["param"] == "stop" and "at most 512" in _error(e.value)["message"]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_post_bodies_must_be_json(keyed, content_type):
    """A web page can make a browser send such 'simple' cross-site requests without asking; JSON needs a
    preflight."""
    headers = {"Authorization": f"Bearer {KEY}"} | ({"Content-Type": content_type} if content_type else {})
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
    r = httpx.post(keyed.url + "/v1/chat/completions", content=body, headers=headers, timeout=30)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text
    r = httpx.post(keyed.url + "/v1/chat/completions", content=body, timeout=30,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text  # a charset parameter is fine


@pytest.mark.parametrize("host,status", [("evil.example", 400), (f"evil.example:{8000}", 400),
                                         ("localhost", 200), ("127.0.0.1", 200), ("[::1]", 200)])
def test_host_must_name_this_server_on_loopback(keyed, host, status):
    """DNS rebinding: a page at evil.example that resolves to 127.0.0.1 sends Host: evil.example."""
    r = httpx.get(keyed.url + "/health", headers={"Host": host}, timeout=30)
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["code"] == "invalid_host" and "--allowed-hosts" in r.json()["error"]["message"]


def test_allowed_hosts_flag(model_dir):
    with serving(model_dir, allowed_hosts=("magnetar.internal",)) as server:
        assert httpx.get(server.url + "/health", headers={"Host": "magnetar.internal:80"}, timeout=30).status_code \
            == 200
        assert httpx.get(server.url + "/health", headers={"Host": "other.internal"}, timeout=30).status_code == 400


# -- requests that never arrive, and too many connections -----------------------------------------------------
def test_a_body_shorter_than_its_content_length_gets_408(keyed):
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode()
    t0 = time.monotonic()
    out = _raw(keyed, head + b'{"model": ')
    assert out.startswith(b"HTTP/1.1 408"), out[:200]
    assert b"--request-timeout-s" in out and time.monotonic() - t0 < 30


@pytest.mark.parametrize("sent", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0"])
def test_a_request_head_that_never_completes_is_closed(keyed, sent):
    t0 = time.monotonic()
    assert _raw(keyed, sent) == b""  # closed by the server, nothing answered
    assert time.monotonic() - t0 < 30, "the server kept a half-sent request open"
    assert _chat(_client(keyed)).choices  # and it still serves


def test_connections_past_the_limit_get_503(model_dir):
    with serving(model_dir, max_connections=3, request_timeout_s=60) as server:
        idle = [socket.create_connection((server.host, server.port), timeout=30) for _ in range(3)]
        try:
            time.sleep(0.3)
            r = httpx.get(server.url + "/health", timeout=30, headers={"x-request-id": "over-1"})
            assert r.status_code == 503, r.text
            # issue 44 item 10: the server's own refusal, with the headers a client's retry logic reads
            assert r.headers["retry-after"] == "1" and r.headers["x-request-id"] == "over-1"
            assert r.json()["error"]["code"] == "server_overloaded" and "--max-connections" in r.text
        finally:
            for s in idle:
                s.close()
        time.sleep(0.3)
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_request_bodies_in_flight_have_one_budget(model_dir):
    """Issue 44 item 14: --max-connections x --max-request-bytes could all be buffered at once; the bodies of the
    requests in flight share one budget (told by Content-Length, or counted as a body arrives), past it a 503 with
    Retry-After, and the budget is given back when a request is answered."""
    with serving(model_dir, max_request_bytes=BODY_LIMIT, max_inflight_bytes=BODY_LIMIT + 1024,
                 request_timeout_s=30) as server:
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {BODY_LIMIT - 10}\r\n\r\n").encode()
        with socket.create_connection((server.host, server.port), timeout=30) as slow:
            slow.sendall(head + b"{" * 1000)  # a body of BODY_LIMIT - 10 announced (reserved), its start sent
            time.sleep(0.3)
            r = httpx.post(server.url + "/v1/chat/completions", json={"model": NAME, "messages": [
                {"role": "user", "content": "x" * 4000}]}, timeout=30)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "server_overloaded" and "--max-inflight-bytes" in r.text
        time.sleep(0.3)  # the slow client left: its budget is back
        assert _chat(_client(server)).choices[0].message.content is not None
        gate = server.asgi.app  # RequestIds around the Gate; the answered request gives its bytes back as its ASGI
        deadline = time.monotonic() + 10  # call returns, just after the client has read the response
        while gate.inflight_bytes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gate.inflight_bytes == 0
    with pytest.raises(ValueError, match="--max-inflight-bytes 2048 is below --max-request-bytes 4096"):
        Server(server.engine, model_name=NAME, port=free_port(), max_request_bytes=4096, max_inflight_bytes=2048)


# -- tokenizing does not serialise the clients ----------------------------------------------------------------
class _Gate:
    """Held by the test: a tokenizer call on text holding ``BLOCK`` waits until it is released."""
    release = threading.Event()
    entered = threading.Event()


class BlockingTokenizer:
    """A tokenizer that blocks on text holding ``BLOCK`` (deep-copied per worker, the events are shared)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, text, *args, **kw):
        if "BLOCK" in text:
            _Gate.entered.set()
            assert _Gate.release.wait(60)
        return self.inner(text, *args, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __deepcopy__(self, memo):
        import copy

        return BlockingTokenizer(copy.deepcopy(self.inner, memo))


def test_one_slow_tokenization_does_not_stall_other_clients(model_dir):
    """Issue 28, item 1: one lock for every tokenization let a 4 MB context stall every client for ~9 s. Requests
    are now prepared on a pool, each worker with its own tokenizer copy: while one request's tokenization is
    stuck, another client's request is prepared and answered."""
    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60)
    engine.tokenizer = BlockingTokenizer(engine.tokenizer)
    server = Server(engine, model_name=NAME, port=free_port(), max_batch_size=4, max_tokens=3)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert server.started.wait(60)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    stuck = threading.Thread(target=lambda: _chat(client, doc="BLOCK " + DOC), daemon=True)
    try:
        stuck.start()
        assert _Gate.entered.wait(30), "the blocked request never reached its tokenizer"
        assert _chat(client).choices[0].finish_reason in ("stop", "length")
        assert stuck.is_alive(), "the blocked request finished: the test did not hold it"
    finally:
        _Gate.release.set()
        stuck.join(60)
        server.drain()
        thread.join(60)


# -- one request's fault stays its own ------------------------------------------------------------------------
def test_one_requests_nan_is_a_500_for_it_alone_and_the_server_keeps_serving(model_dir):
    """Issue 28, item 5: a NaN embedding row reached by one request's token ended the whole server. Now that
    request gets a 500 (in its Phase 1 or its query forward) while a streamed request decodes on to its end."""
    import torch

    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60)
    poison = engine.tokenizer("~", add_special_tokens=False)["input_ids"][0]
    with torch.no_grad():
        engine.model.model.embed_tokens.weight[poison] = float("nan")
    server = Server(engine, model_name=NAME, port=free_port(), max_batch_size=4, max_tokens=4)
    status = []
    thread = threading.Thread(target=lambda: status.append(server.run()), daemon=True)
    thread.start()
    assert server.started.wait(60)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    try:
        stream = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": " What jumps?"}], max_tokens=200, stream=True,
            extra_body={"magnetar": {"context": DOC}}, stream_options={"include_usage": True})
        chunks = iter(stream)
        next(chunks)  # the role chunk: the request is decoding
        for kw in (dict(doc=DOC + " ~"), dict(question=" What ~ jumps?")):  # Phase 1, then the query forward
            with pytest.raises(openai.InternalServerError) as e:
                _chat(client, **kw)
            assert "non-finite values for this request" in _error(e.value)["message"]
        rest = list(chunks)
        assert rest[-1].usage.completion_tokens == 200, "the streamed request did not decode to its end"
        assert _chat(client).choices[0].finish_reason in ("stop", "length")
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    finally:
        server.drain()
        thread.join(60)
    assert status == [0]


# -- pinned contexts and per-request options: bounded -----------------------------------------------------------
def test_max_contexts_holds_under_concurrent_posts_and_formats_are_enforced(model_dir):
    """Item 6: the --max-contexts check and the pinning were two steps, so concurrent POSTs passed the limit
    together (pinned KV is outside the cache budget). Item 7: a context is tokenized for one endpoint's format."""
    from concurrent.futures import ThreadPoolExecutor

    with serving(model_dir, max_contexts=2) as server:
        docs = [f"Document {i}: " + "the fox and the dog. " * (3 + i) for i in range(8)]

        def post(doc):
            return httpx.post(server.url + "/v1/contexts", json={"model": NAME, "context": doc}, timeout=60)

        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(post, docs))
        ok = [r for r in replies if r.status_code == 200]
        assert len(ok) == 2, [r.status_code for r in replies]
        assert all("--max-contexts" in r.json()["error"]["message"] for r in replies if r.status_code != 200)
        assert len(server.contexts) == 2
        time.sleep(0.5)  # a tick for releases of the refused ones (none were encoded)
        assert len(server.loop.handles) == 2
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
        chat_id = ok[0].json()["id"]
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=NAME, prompt=" What?", max_tokens=2,
                                      extra_body={"magnetar": {"context_id": chat_id}})
        err = _error(e.value)
        assert err["param"] == "magnetar.context_id" and "format 'chat'" in err["message"] and \
            "/v1/chat/completions" in err["message"]
        assert client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": " What?"}],
                                              max_tokens=2, extra_body={"magnetar": {"context_id": chat_id}}).choices
        httpx.delete(server.url + f"/v1/contexts/{ok[1].json()['id']}", timeout=30)
        raw = httpx.post(server.url + "/v1/contexts", json={"model": NAME, "context": docs[5], "format": "raw"},
                         timeout=60).json()["id"]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": " What?"}],
                                           max_tokens=2, extra_body={"magnetar": {"context_id": raw}})
        assert "format 'raw'" in _error(e.value)["message"] and "/v1/completions" in _error(e.value)["message"]
        assert client.completions.create(model=NAME, prompt=" What?", max_tokens=2,
                                         extra_body={"magnetar": {"context_id": raw}}).choices


def test_per_request_option_sets_are_bounded_and_refused_ones_make_nothing(keyed):
    """Item 8: every distinct option set made an Engine variant kept forever, even for refused requests."""
    from magnetar.engine.engine import MAX_VARIANTS

    engine, client = keyed.engine, _client(keyed)
    for block in range(8, 8 + MAX_VARIANTS + 5):
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": " What?"}], max_tokens=1,
            extra_body={"magnetar": {"context": DOC, "method": "streaming", "window_size": block,
                                     "sink_tokens": 2}})
    assert len(engine._variants) == MAX_VARIANTS
    before = dict(engine._variants)
    for bad in ({"method": "star", "block_size": 0}, {"method": "streaming", "window_size": -1}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": " What?"}], max_tokens=1,
                                           extra_body={"magnetar": {"context": DOC, **bad}})
    assert dict(engine._variants) == before


# -- the small things a deployment meets at once ----------------------------------------------------------------
def test_a_port_in_use_is_found_before_the_model_loads(model_dir, monkeypatch, capsys):
    from magnetar.serve import cli

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was bound")

    monkeypatch.setattr(magnetar, "init_inference", no_model)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            cli.main(["--model", str(model_dir), "--port", str(port)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"magnet serve: error: --port {port}: cannot listen on 127.0.0.1:{port}".replace("magnet ", "magnetar ") \
        in err and "choose another --port" in err


def test_the_served_name_of_a_local_folder_is_its_name_not_its_path(model_dir):
    from magnetar.serve.cli import served_name

    assert served_name(str(model_dir)) == model_dir.name and "/" not in served_name(str(model_dir))
    assert served_name("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert served_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_openapi_declares_the_request_bodies_and_405_says_allow(keyed):
    schema = httpx.get(keyed.url + "/openapi.json", timeout=30).json()
    for path, model in (("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest"),
                        ("/v1/contexts", "ContextRequest")):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert "model" in schema["components"]["schemas"][model]["properties"]
    assert "ChatMessage" in schema["components"]["schemas"]  # the nested models resolve
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    r = httpx.get(keyed.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["message"]


def _counts(server, endpoint: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    return {s.labels["outcome"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "magnetar_requests_total" and s.labels.get("endpoint") == endpoint}


def test_a_client_that_leaves_while_waiting_is_counted_once(keyed, monkeypatch):
    from magnetar.engine.batch import ContinuousBatch

    step = ContinuousBatch.step

    def slow(self):  # the tiny model decoded 700 tokens before the server saw the client go (CI, 2026-11-29)
        time.sleep(0.01)
        return step(self)

    monkeypatch.setattr(ContinuousBatch, "step", slow)  # the server runs in this process: >= 7 s of decoding
    endpoint = "/v1/chat/completions"
    before = _counts(keyed, endpoint)
    body = {"model": NAME, "messages": [{"role": "user", "content": " What?"}], "max_tokens": 700,
            "magnetar": {"context": DOC}}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up while its answer is decoding
        httpx.post(keyed.url + endpoint, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _counts(keyed, endpoint).get("cancelled", 0) == before.get("cancelled", 0):
        time.sleep(0.2)
    after = _counts(keyed, endpoint)
    assert after.get("cancelled", 0) == before.get("cancelled", 0) + 1
    assert after.get("rejected", 0) == before.get("rejected", 0), "the cancelled request was also counted rejected"


@pytest.mark.parametrize("stream", [False, True])
def test_an_option_that_cannot_apply_is_a_400_naming_it_also_streamed(keyed, stream):
    """A block larger than the context was a 400 with param null, and streamed a 200 followed by an error event."""
    with pytest.raises(openai.BadRequestError) as e:
        client = _client(keyed)
        reply = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": " What?"}], max_tokens=2, stream=stream,
            extra_body={"magnetar": {"context": DOC, "method": "star", "block_size": 100000}})
        if stream:
            list(reply)
    err = _error(e.value)
    assert err["param"] == "magnetar.block_size" and "larger than the context" in err["message"]
