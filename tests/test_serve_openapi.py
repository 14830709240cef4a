"""The server's HTTP contract as its OpenAPI schema states it: every status a route or the gate answers is
documented there (in OpenAI's error body), a method a path does not take is a 405 naming every method it does, and
a property-based run of Schemathesis (the library made for this) over every operation finds no violation."""
from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

pytest.importorskip("fastapi", reason="the serve extra: pip install 'magnetar[serve]'")
pytest.importorskip("schemathesis", reason="the test extra: pip install 'magnetar[test]'")

import magnetar  # noqa: E402
from magnetar.serve.server import Server  # noqa: E402
from tests.dist_utils import free_port, serve_in_thread  # noqa: E402
from tests.tiny_models import save_tiny_chat  # noqa: E402

NAME = "tiny"
KEY = "sk-magnetar-openapi"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine = magnetar.init_inference(str(save_tiny_chat(tmp_path_factory.mktemp("tiny-openapi"), 1024)),
                                     method="dense", timeout_s=60)
    with serve_in_thread(Server(engine, model_name=NAME, port=free_port(), max_batch_size=4, max_tokens=2,
                                api_key=KEY, max_request_bytes=64 * 1024)) as s:
        yield s


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_a_method_a_path_does_not_take_is_405_with_every_method_it_does(server):
    """Before, the gate asked a PUT or a POST to /health for a JSON body (415), and Starlette's Allow named the
    first route of the path alone (OPTIONS /v1/contexts: 'POST', where GET lists the pinned contexts)."""
    for method, path, allow in (("PUT", "/health", "GET"), ("POST", "/health", "GET"), ("DELETE", "/metrics", "GET"),
                                ("OPTIONS", "/v1/contexts", "GET, POST"), ("PATCH", "/v1/chat/completions", "POST"),
                                ("PUT", "/v1/responses/resp-1", "DELETE, GET")):
        r = httpx.request(method, server.url + path, headers=AUTH, timeout=30)
        assert r.status_code == 405 and r.headers["allow"] == allow, (method, path, r.status_code, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    # a POST to a route that reads a body is still held to JSON (a browser's cross-site "simple" request)
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, content=b"model=tiny", timeout=30)
    assert r.status_code == 415, r.text


def test_every_status_answered_is_in_the_schema(server):
    """Each refusal a client can meet -- the gate's and the routes' -- is documented for its operation, with the
    error body it comes in; FastAPI's 422 (which no route answers) is not; the bodies the handlers parse are
    described, the model name among them."""
    assert httpx.get(server.url + "/version", timeout=30).json() == {"version": magnetar.__version__}  # no key
    schema = httpx.get(server.url + "/openapi.json", timeout=30).json()
    paths, components = schema["paths"], schema["components"]["schemas"]
    assert "ErrorResponse" in components and "HTTPValidationError" not in components
    for path, ops in paths.items():
        for method, op in ops.items():
            assert "422" not in op["responses"], (method, path)
            if method == "post":
                body = op["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
                assert components[body]["properties"]["model"]["enum"] == [NAME], path
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    probes = [  # (method, path, its route's template, request arguments)
        ("get", "/v1/models", "/v1/models", {}),  # no key: 401
        ("post", "/v1/chat/completions", "/v1/chat/completions", {"headers": AUTH, "json": dict(chat, model="x")}),
        ("post", "/v1/chat/completions", "/v1/chat/completions", {"headers": AUTH, "content": b"{"}),
        ("post", "/v1/chat/completions", "/v1/chat/completions", {"headers": AUTH, "content": b"{}"}),
        ("post", "/v1/completions", "/v1/completions", {"headers": AUTH, "content": b"prompt=hi"}),
        ("post", "/v1/completions", "/v1/completions",
         {"headers": {**AUTH, "content-type": "application/json"}, "content": b" " * (65 * 1024)}),
        ("post", "/v1/responses", "/v1/responses",
         {"headers": AUTH, "json": {"model": NAME, "input": "hi", "previous_response_id": "resp-none"}}),
        ("get", "/v1/responses/resp-none", "/v1/responses/{rid}", {"headers": AUTH}),
        ("delete", "/v1/contexts/ctx-none", "/v1/contexts/{cid}", {"headers": AUTH}),
        ("get", "/v1/models/other", "/v1/models/{model_id}", {"headers": AUTH}),
        ("post", "/tokenize", "/tokenize", {"headers": AUTH, "json": {"model": NAME}}),
        ("post", "/detokenize", "/detokenize", {"headers": AUTH, "json": {"model": NAME, "tokens": [-1]}}),
        ("get", "/health", "/health", {"headers": {"Host": "evil.example"}}),
        ("post", "/v1/contexts", "/v1/contexts", {"headers": AUTH, "json": {"model": NAME, "context": ""}}),
    ]
    seen = set()
    for method, path, template, kw in probes:
        r = httpx.request(method, server.url + path, timeout=30, **kw)
        assert r.status_code >= 400, (method, path, r.text)
        assert str(r.status_code) in paths[template][method]["responses"], (method, path, r.status_code, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
        seen.add(r.status_code)
    assert seen == {400, 401, 404, 413, 415}


def test_schemathesis_finds_no_contract_violation(server, tmp_path):
    """Schemathesis over the live schema (a few examples an operation, seeded): no server error, every status,
    content type, header and response body as documented, a 405 for undeclared methods. Left out: its check
    that schema-valid data is accepted -- the server checks what the schema cannot say (a token id within the
    vocabulary, a prompt or messages, a non-empty document), with a 400 naming the field."""
    url = server.url + "/openapi.json"
    env = dict(os.environ, NO_COLOR="1")
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", url, "--checks", "all",
           "--exclude-checks", "positive_data_acceptance", "--max-examples", "4", "--seed", "7",
           "--generation-deterministic", "--request-timeout", "30", "--workers", "1", "--header",
           f"Authorization: Bearer {KEY}", "--no-color"]
    # in a folder of its own: Schemathesis keeps a cache (.schemathesis/) where it runs, never in the checkout
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    assert "passed" in res.stdout, res.stdout[-3000:]
