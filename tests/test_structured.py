"""Structured outputs (issue 50, item 1, first step): a request's llguidance grammar masks its tokens on the rank that
chooses, on every decode path; over HTTP, ``response_format`` json_schema (what ``chat.completions.parse`` sends) and
json_object. With a random tiny model every constrained answer still follows its grammar."""
from __future__ import annotations

import json
import re
from typing import Literal

import pytest
import torch

llguidance = pytest.importorskip("llguidance", reason="the serve extra: pip install 'magnetar[serve]'")
openai = pytest.importorskip("openai", reason="the test extra: pip install 'magnetar[test]'")
pydantic = pytest.importorskip("pydantic")

import magnetar  # noqa: E402
from magnetar.serve.server import Server  # noqa: E402
from tests.dist_utils import free_port, serve_in_thread  # noqa: E402
from tests.tiny_models import save_tiny_chat  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat(tmp_path_factory.mktemp("tiny-structured"), 1024)


@pytest.fixture(scope="module")
def engine(model_dir):
    return magnetar.init_inference(str(model_dir), method="dense", timeout_s=60)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("decode_step", ["eager", "static"])
def test_a_grammar_constrains_every_answer(model_dir, sampled, decode_step):
    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60, decode_step=decode_step)
    grammar = llguidance.LLMatcher.grammar_from_regex("(yes|no) [0-9]{2}")
    ctx, q = torch.arange(10, 60), torch.tensor([5, 6, 7])
    kw = dict(temperature=0.9, seed=3) if sampled else {}
    free = engine.generate(ctx, q, max_new_tokens=12, **kw)
    got = engine.generate(ctx, q, max_new_tokens=12, grammar=grammar, **kw)
    assert re.fullmatch(r"(yes|no) [0-9]{2}", got.text), (got.text, free.text)
    assert got.stop_reason == "grammar" and free.text != got.text


def test_a_grammar_that_cannot_end_in_time_stops_at_the_limit(engine):
    grammar = llguidance.LLMatcher.grammar_from_regex("[a-z]{40}")
    got = engine.generate(torch.arange(10, 60), torch.tensor([5, 6]), max_new_tokens=5, grammar=grammar)
    assert got.stop_reason == "max_new_tokens" and re.fullmatch("[a-z]{5}", got.text)


def test_a_bad_grammar_is_refused_by_name(engine):
    bad = llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object", "properties":
                                                                    {"a": {"type": "nosuch"}}}))
    with pytest.raises(ValueError, match="grammar.*nosuch") as e:
        engine.check(torch.arange(10, 20), torch.tensor([1]), grammar=bad)
    assert e.value.field == "grammar"


class Answer(pydantic.BaseModel):
    ok: bool
    color: Literal["red", "green", "blue"]


def test_response_format_over_http(engine):
    with serve_in_thread(Server(engine, model_name="tiny", port=free_port(), max_tokens=64)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "Is the sky blue? Answer as JSON."}]
        for seed in range(3):  # the random model's every answer parses and validates
            done = client.chat.completions.parse(model="tiny", messages=messages, response_format=Answer, seed=seed,
                                                 temperature=1.0)
            choice = done.choices[0]
            assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Answer), choice
            assert json.loads(choice.message.content) == choice.message.parsed.model_dump()
        with pytest.raises(openai.BadRequestError) as e:  # a schema llguidance rejects: 400 naming the field
            client.chat.completions.create(model="tiny", messages=messages, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nosuch"}}})
        assert e.value.body["param"] == "response_format" and "nosuch" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=messages, response_format={"type": "yaml"})
        assert e.value.body["param"] == "response_format"
        deep: dict = {"type": "object"}
        for _ in range(40):
            deep = {"type": "object", "properties": {"a": deep}}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=messages, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": deep}})
        assert e.value.body["param"] == "response_format.json_schema.schema"
        strict = dict(Answer.model_json_schema(), additionalProperties=False)  # as parse() sends it
        chunks = list(client.chat.completions.create(
            model="tiny", messages=messages, stream=True, max_tokens=64,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": strict}}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "stop"
        Answer.model_validate_json(text)


def _two_ranks(rank, world, model_dir):
    """Star over two real ranks: every rank follows the grammar (its stop decision must match), the first chooses;
    the answer equals the simulated ranks' (the mask does not care where the KV lives)."""
    flat = dict(method="star", cp_size=2, block_size=32, timeout_s=60)
    grammar = llguidance.LLMatcher.grammar_from_regex("(red|green|blue)!")
    ctx, q = torch.arange(10, 74), torch.tensor([5, 6, 7])
    real = magnetar.init_inference(str(model_dir), **flat).generate(ctx, q, max_new_tokens=10, grammar=grammar,
                                                                   temperature=0.8, seed=4)
    sim = magnetar.init_inference(str(model_dir), simulate=True, groups=magnetar.parallel.local_groups(),
                                  **flat).generate(ctx, q, max_new_tokens=10, grammar=grammar, temperature=0.8, seed=4)
    assert re.fullmatch("(red|green|blue)!", real.text) and real.stop_reason == "grammar", (rank, real.text)
    assert real.token_ids == sim.token_ids, (rank, real.text, sim.text)


def test_a_grammar_on_two_ranks(model_dir):
    from tests.dist_utils import run_distributed

    run_distributed(_two_ranks, 2, str(model_dir))


def test_the_magnetar_extras_regex_choice_grammar(engine):
    """vLLM's extras in the magnetar object, on chat and on text completions: the answer follows them, and a bad
    one is a 400 naming magnetar.<extra>."""
    with serve_in_thread(Server(engine, model_name="tiny", port=free_port(), max_tokens=24)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "Pick a color."}]
        for extra, check in (({"choice": ["red", "green", "blue sky"]}, lambda t: t in ("red", "green", "blue sky")),
                             ({"regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
                             ({"grammar": 'start: "ab" N\nN: /[0-9]/'}, lambda t: re.fullmatch("ab[0-9]", t))):
            chat = client.chat.completions.create(model="tiny", messages=messages, temperature=1.0, seed=1,
                                                  extra_body={"magnetar": extra})
            text = client.completions.create(model="tiny", prompt="Colors:\n\nPick one:", temperature=1.0, seed=2,
                                              extra_body={"magnetar": extra}).choices[0].text
            assert check(chat.choices[0].message.content) and chat.choices[0].finish_reason == "stop", (extra, chat)
            assert check(text), (extra, text)
        for extra, param in (({"regex": "(unclosed"}, "magnetar.regex"), ({"choice": []}, "magnetar.choice"),
                             ({"regex": "a", "choice": ["b"]}, "magnetar.choice")):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="tiny", messages=messages, extra_body={"magnetar": extra})
            assert e.value.body["param"] == param, (extra, e.value.body)
        with pytest.raises(openai.BadRequestError) as e:  # one structured output per request
            client.chat.completions.create(model="tiny", messages=messages, response_format={"type": "json_object"},
                                           extra_body={"magnetar": {"regex": "a"}})
        assert e.value.body["param"] == "response_format"


def test_tokenize_and_detokenize(engine):
    """vLLM's /tokenize and /detokenize: a prompt's ids (as the tokenizer gives them), a conversation's through the
    chat template, ids back to text; bad input named; the API key guards them as it guards /v1."""
    import httpx

    tok = engine.tokenizer
    with serve_in_thread(Server(engine, model_name="tiny", port=free_port(), api_key="sk-t")) as server:
        headers = {"Authorization": "Bearer sk-t"}
        r = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": "hello <|user|> world"},
                       headers=headers)
        want = tok("hello <|user|> world", split_special_tokens=True)["input_ids"]
        assert r.status_code == 200 and r.json()["tokens"] == want and r.json()["count"] == len(want), r.text
        msgs = [{"role": "user", "content": "hi"}]
        r = httpx.post(server.url + "/tokenize", json={"model": "tiny", "messages": msgs}, headers=headers)
        want_chat = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=True)
        assert r.json()["tokens"] == list(want_chat["input_ids"])
        r = httpx.post(server.url + "/detokenize", json={"model": "tiny", "tokens": want}, headers=headers)
        assert r.status_code == 200 and r.json()["prompt"] == tok.decode(want)
        r = httpx.post(server.url + "/detokenize", json={"model": "tiny", "tokens": [1, 10**6]}, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
        r = httpx.post(server.url + "/tokenize", json={"model": "tiny"}, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": "x"}).status_code == 401
