"""The server on 2 CPU ranks under the real ``torchrun`` (star, cp_size 2): rank 0 serves HTTP and broadcasts each
tick, rank 1 follows. Answers equal the one-process (simulated) engine's; SIGTERM drains and every rank exits 0; a
killed rank makes the request in flight fail with a 5xx and the job exit non-zero within the collective timeout
(never a hang). The tick broadcast's own timeout: a follower whose leader sends nothing raises TimeoutError.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import httpx
import psutil
import pytest

openai = pytest.importorskip("openai", reason="the test extra: pip install 'magnetar[test]'")
pytest.importorskip("fastapi", reason="the serve extra: pip install 'magnetar[serve]'")

import magnetar  # noqa: E402
import torch  # noqa: E402
from magnetar.engine.template import split_messages  # noqa: E402
from magnetar.parallel import lifetime  # noqa: E402
from magnetar.parallel.groups import init_groups  # noqa: E402
from magnetar.parallel.launcher import device_for_rank  # noqa: E402
from magnetar.serve.ticks import Add, Tick, broadcast_tick  # noqa: E402
from tests.conftest import assert_close, repo_pythonpath  # noqa: E402
from tests.dist_utils import free_port, free_ports, run_distributed, wait_serving  # noqa: E402
from tests.tiny_models import save_tiny  # noqa: E402

NAME = "tiny"
TIMEOUT_S = 20  # the job's collective timeout (--timeout-s): where a dead rank must be noticed
STARTUP_S = 240  # two ranks import torch, transformers and deepspeed on a busy machine
FLAGS = ["--method", "star", "--cp-size", "2", "--block-size", "64", "--paste-threshold", "32", "--prefix-reuse", "all"]
DOC = "The quick brown fox jumps over the lazy dog. " * 8
PASTED = "Another document: the lazy dog sleeps in the sun all day. " * 6
QUESTIONS = [" What jumps?", " Who is lazy?"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    save_tiny(out, "llama", max_position_embeddings=4096)
    return out


def _start(model_dir: Path, tmp: Path, port: int, flags=FLAGS) -> subprocess.Popen:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("the torchrun launcher is not installed")
    cmd = [torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "magnetar.serve", "--model", str(model_dir), *flags, "--port", str(port), "--served-model-name", NAME,
           "--timeout-s", str(TIMEOUT_S)]
    env = {k: v for k, v in os.environ.items() if k not in (lifetime.WATCHDOG_ENV, "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=repo_pythonpath(), OMP_NUM_THREADS="1", MAGNETAR_FUSED_MERGE="0")
    with open(tmp / "job.log", "wb") as log:
        return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _ranks(job: subprocess.Popen) -> dict[int, psutil.Process]:
    """The job's rank processes by RANK."""
    found = {}
    for p in psutil.Process(job.pid).children(recursive=True):
        try:
            if any("magnetar.serve" in a for a in p.cmdline()) and "RANK" in p.environ():
                found[int(p.environ()["RANK"])] = p
        except psutil.NoSuchProcess:
            pass
    return found


def _log(tmp: Path) -> str:
    return (tmp / "job.log").read_text(errors="replace")[-6000:]


def _end(job: subprocess.Popen) -> None:
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(30)


def _chat(url, question, max_tokens, timeout=120):
    return httpx.post(url + "/v1/chat/completions", timeout=timeout, json={
        "model": NAME, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
        "magnetar": {"context": DOC}})


def test_two_ranks_answer_like_the_engine_and_drain_on_sigterm(model_dir, tmp_path):
    sim = magnetar.init_inference(str(model_dir), simulate=True, method="star", cp_size=2, block_size=64,
                                  prefix_reuse="all")
    want = [sim.generate(DOC, q, max_new_tokens=6) for q in QUESTIONS]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    job = _start(model_dir, tmp_path, port)
    try:
        wait_serving(url, job, STARTUP_S, lambda: _log(tmp_path))
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        got = {}

        def ask(i):
            got[i] = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUESTIONS[i]}],
                                                    max_tokens=6, extra_body={"magnetar": {"context": DOC}})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for i, w in enumerate(want):
            assert got[i].choices[0].message.content == w.text, i
            assert got[i].usage.completion_tokens == 6
            assert got[i].usage.prompt_tokens == w.context_tokens + w.query_tokens
        assert got[0].usage.prompt_tokens_details.cached_tokens + got[1].usage.prompt_tokens_details.cached_tokens \
            == w.context_tokens  # one of the two encoded the document, the other hit the cache
        # a document pasted into the message is Phase 1, spread over both ranks, as magnetar.context would be
        messages = [{"role": "user", "content": PASTED + "\n\n" + QUESTIONS[1].strip()}]
        pasted = client.chat.completions.create(model=NAME, max_tokens=6, messages=messages)
        p = split_messages(sim.tokenizer, [{"role": "user", "content": "\n" + QUESTIONS[1].strip()}],
                           context=PASTED + "\n")
        assert pasted.model_extra["magnetar"]["prompts"][0]["split"] == "pasted"
        first = sim.generate(p.context_ids, p.query_ids, max_new_tokens=6)
        assert pasted.choices[0].message.content == first.text
        # the next turn extends the pasted document's KV (--prefix-reuse all) on both ranks, as the simulation does
        messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Why?"}]
        turn2 = client.chat.completions.create(model=NAME, max_tokens=6, messages=messages)
        p2 = split_messages(sim.tokenizer, messages)
        want2 = sim.generate(p2.context_ids, p2.query_ids, max_new_tokens=6)
        assert turn2.usage.prompt_tokens_details.cached_tokens == want2.cached_context_tokens == p.context_ids.numel()
        assert turn2.choices[0].message.content == want2.text
        # lm-eval's log-likelihood request: the prompt's log-probs are the query's, after one block (--block-size)
        ids = list(range(5, 95))
        scored = client.completions.create(model=NAME, prompt=[ids], echo=True, logprobs=1, max_tokens=1)
        want_lp = sim.score(torch.tensor(ids[:64]), torch.tensor(ids[64:])).token_logprobs
        assert_close(torch.tensor(scored.choices[0].logprobs.token_logprobs[65:-1]), want_lp, what="same_computation")
        assert scored.choices[0].logprobs.token_logprobs[:65] == [None] * 65
        _structured_on_two_ranks(client)
        ranks = _ranks(job)
        assert sorted(ranks) == [0, 1], ranks
        for p in ranks.values():  # as a scheduler stopping the job would
            p.send_signal(signal.SIGTERM)
        assert job.wait(60) == 0, _log(tmp_path)
        assert "rank 0 drained: exit status 0" in _log(tmp_path) and "rank 1 drained: exit status 0" in _log(tmp_path)
    finally:
        _end(job)


def _structured_on_two_ranks(client) -> None:
    """Structured answers over the two ranks (issue 50): a schema's answer parses, a required tool call follows
    its tool's schema (openai, langchain-openai, litellm), the Responses API answers and continues from its stored
    response with the context cached."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    done = client.chat.completions.create(model=NAME, max_tokens=40, messages=[{"role": "user", "content": "Ok?"}],
                                          extra_body={"magnetar": {"context": DOC}}, temperature=1.0,
                                          response_format={"type": "json_schema", "json_schema": {
                                              "name": "flag", "schema": schema}})
    assert set(json.loads(done.choices[0].message.content)) == {"ok", "n"}
    tool = {"type": "function", "function": {"name": "jump", "parameters": {
        "type": "object", "properties": {"who": {"enum": ["fox", "dog"]}}, "required": ["who"]}}}
    called = client.chat.completions.create(model=NAME, max_tokens=100, temperature=1.0, tools=[tool],
                                            tool_choice="required", parallel_tool_calls=False,
                                            messages=[{"role": "user", "content": DOC + "\n\nWho jumps?"}])
    assert called.choices[0].message.tool_calls, called.choices[0]
    call = called.choices[0].message.tool_calls[0]
    assert call.function.name == "jump" and json.loads(call.function.arguments)["who"] in ("fox", "dog")
    # langchain-openai's structured output and litellm's tool call, as users' agents send them
    langchain_openai = pytest.importorskip("langchain_openai", reason="the test extra: pip install 'magnetar[test]'")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price list fetched at import
    litellm = pytest.importorskip("litellm", reason="the test extra: pip install 'magnetar[test]'")
    llm = langchain_openai.ChatOpenAI(model=NAME, base_url=str(client.base_url), api_key="unused", max_retries=0,
                                      timeout=120, temperature=1.0, max_tokens=60)
    got = llm.with_structured_output(schema | {"title": "flag"}, method="json_schema").invoke([("system", DOC),
                                                                                        ("user", "Ok?")])
    assert set(got) == {"ok", "n"}, got
    done = litellm.completion(model=f"openai/{NAME}", api_base=str(client.base_url), api_key="unused", max_tokens=100,
                              messages=[{"role": "user", "content": "Who jumps?"}], tools=[tool],
                              tool_choice={"type": "function", "function": {"name": "jump"}}, num_retries=0)
    assert json.loads(done.choices[0].message.tool_calls[0].function.arguments)["who"] in ("fox", "dog")
    first = client.responses.create(model=NAME, input=PASTED + "\n\nWho sleeps?", max_output_tokens=4)
    second = client.responses.create(model=NAME, input="Where?", previous_response_id=first.id, max_output_tokens=4)
    assert second.usage.input_tokens_details.cached_tokens >= first.model_extra["magnetar"]["prompts"][0][
        "context_tokens"] > 0


def test_a_killed_rank_fails_the_request_in_flight_and_ends_the_job(model_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    job = _start(model_dir, tmp_path, port)
    try:
        wait_serving(url, job, STARTUP_S, lambda: _log(tmp_path))
        status = []
        request = threading.Thread(target=lambda: status.append(_chat(url, QUESTIONS[0], 3000, timeout=TIMEOUT_S + 60)))
        request.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until it is decoding
            if "magnetar_active_requests 1.0" in httpx.get(url + "/metrics", timeout=10).text:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"the request never started decoding:\n{_log(tmp_path)}")
        t0 = time.monotonic()
        _ranks(job)[1].kill()
        request.join(TIMEOUT_S + 60)
        assert status and status[0].status_code >= 500, (status and status[0].text, _log(tmp_path))
        assert status[0].json()["error"]["type"] == "server_error"
        code = job.wait(TIMEOUT_S + 30)
        assert code != 0 and time.monotonic() - t0 <= TIMEOUT_S + 30, _log(tmp_path)
    finally:
        _end(job)


def _tick_worker(rank, world):
    groups = init_groups(2, timeout=timedelta(seconds=3))
    request = {"context_ids": [4, 5], "query_ids": [1, 2, 3], "params": {"max_new_tokens": 2, "stop": []},
               "key": "k", "options": {}}
    tick = Tick(adds=[Add(1, request)], cancels=[7])
    got = broadcast_tick(tick if rank == 0 else None, groups, device_for_rank())
    assert got == tick
    if rank == 1:  # the leader sends nothing more: the follower gives up after the timeout, naming the tick
        with pytest.raises(TimeoutError, match="tick broadcast"):
            broadcast_tick(None, groups, device_for_rank())


def test_the_tick_reaches_every_rank_and_a_missing_leader_times_out():
    run_distributed(_tick_worker, 2)


def test_a_front_port_routes_each_document_to_the_replica_that_holds_it(model_dir, tmp_path):
    """Two data-parallel replicas (dense, one rank each) behind --front-port: ten questions about one document are
    answered with one Phase 1 in total; a second document goes to the other replica; a pinned context's questions and
    a stored response's continuation go to the replica that holds them; GET /v1/contexts says which."""
    port, front = free_ports(2)  # the replicas on port and port + 1, the front elsewhere
    flags = ["--method", "dense", "--paste-threshold", "32", "--front-port", str(front)]
    job = _start(model_dir, tmp_path, port, flags)
    url = f"http://127.0.0.1:{front}"
    try:
        wait_serving(url, job, STARTUP_S, lambda: _log(tmp_path))
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(doc, question):
            raw = client.chat.completions.with_raw_response.create(
                model=NAME, max_tokens=3, messages=[{"role": "user", "content": question}],
                extra_body={"magnetar": {"context": doc}})
            return raw.headers["x-magnetar-replica"], raw.parse()

        answers = [ask(DOC, f"Question {i}?") for i in range(10)]
        replicas = {r for r, _ in answers}
        cached = [a.usage.prompt_tokens_details.cached_tokens for _, a in answers]
        context = answers[0][1].model_extra["magnetar"]["prompts"][0]["context_tokens"]
        assert len(replicas) == 1 and cached == [0] + [context] * 9, (replicas, cached)  # one Phase 1 in all
        other, _ = ask(PASTED, "Who sleeps?")
        assert other != answers[0][0]  # a new document: the replica routed fewer requests
        made = httpx.post(url + "/v1/contexts", json={"model": NAME, "context": PASTED + " pinned", "format": "raw"},
                          timeout=120)
        owner = made.headers["x-magnetar-replica"]
        cid = made.json()["id"]
        for _ in range(3):
            raw = client.completions.with_raw_response.create(model=NAME, prompt=" Why?", max_tokens=2,
                                                              extra_body={"magnetar": {"context_id": cid}})
            assert raw.headers["x-magnetar-replica"] == owner
        listed = httpx.get(url + "/v1/contexts", timeout=60).json()["data"]
        assert [(c["id"], str(c["replica"]), c["tier"]) for c in listed] == [(cid, owner, "memory")]
        assert listed[0]["bytes"] > 0 and listed[0]["tokens"] == made.json()["tokens"]
        first = client.responses.with_raw_response.create(model=NAME, input=DOC + "\n\nWhat jumps?",
                                                          max_output_tokens=2)
        again = client.responses.with_raw_response.create(model=NAME, input="Why?", max_output_tokens=2,
                                                          previous_response_id=first.parse().id)
        assert again.headers["x-magnetar-replica"] == first.headers["x-magnetar-replica"]
        health = httpx.get(url + "/health", timeout=30).json()
        assert health["replicas"] == [200, 200] and sum(health["routed"]) >= 16, health
        # what every replica answers alike, through the front too (before: 404 there)
        assert httpx.post(url + "/tokenize", json={"model": NAME, "prompt": "hi"}, timeout=30).json()["count"] >= 1
        assert httpx.get(url + f"/v1/models/{NAME}", timeout=30).json()["id"] == NAME
        schema = httpx.get(url + "/openapi.json", timeout=30).json()
        assert schema["info"]["title"] == "Magnetar" and "/v1/chat/completions" in schema["paths"]
        assert httpx.get(url + "/docs", timeout=30).status_code == 200
        assert httpx.get(url + "/version", timeout=30).json() == {"version": magnetar.__version__}
        # the front answers as its schema says (Schemathesis, seeded, a few examples an operation): before, a content
        # part whose "text" was not a string made the front itself fail (500), an id with other characters than
        # ASCII too, and its 404/405 were FastAPI's {"detail"} with a partial Allow
        odd = httpx.get(url + "/v1/models/K%C3%B9%05x", timeout=30)
        assert odd.status_code == 404 and odd.json()["error"]["param"] == "model", odd.text
        put = httpx.put(url + "/health", timeout=30)
        assert put.status_code == 405 and put.headers["allow"] == "GET" and "error" in put.json(), put.text
        res = subprocess.run([sys.executable, "-m", "schemathesis.cli", "run", url + "/openapi.json", "--checks",
                              "all", "--exclude-checks", "positive_data_acceptance", "--max-examples", "3", "--seed",
                              "7", "--generation-deterministic", "--request-timeout", "60", "--workers", "1",
                              "--no-color"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                             env=dict(os.environ, NO_COLOR="1"))
        assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    finally:
        _end(job)
