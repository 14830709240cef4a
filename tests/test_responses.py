"""The Responses API (issue 50, item 3) with the ``openai`` client: ``responses.create`` / ``parse`` / ``stream``,
``text.format`` with a schema, function tools and their outputs, ``previous_response_id`` continuing from the cached
context, stored responses, and bad input named by its Responses field."""
from __future__ import annotations

import json
from typing import Literal

import pytest

pytest.importorskip("llguidance", reason="the serve extra: pip install 'magnetar[serve]'")
openai = pytest.importorskip("openai", reason="the test extra: pip install 'magnetar[test]'")
pydantic = pytest.importorskip("pydantic")

import magnetar  # noqa: E402
from magnetar.serve.server import Server  # noqa: E402
from tests.dist_utils import free_port, serve_in_thread  # noqa: E402
from tests.tiny_models import save_tiny_chat  # noqa: E402

TOOL = {"type": "function", "name": "lookup", "description": "Look a record up",
        "parameters": {"type": "object", "properties": {"record": {"type": "integer", "minimum": 0, "maximum": 99}},
                       "required": ["record"], "additionalProperties": False}}
DOCUMENT = "\n".join(f"Line {i}: the archive keeps record {i * 7} of the harbour." for i in range(12))


class Verdict(pydantic.BaseModel):
    found: bool
    colour: Literal["red", "blue"]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model_dir = save_tiny_chat(tmp_path_factory.mktemp("tiny-responses"), 2048)
    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60)
    with serve_in_thread(Server(engine, model_name="tiny", port=free_port(), max_tokens=64,
                                paste_threshold=256)) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_text_response_and_its_stored_copy(client):
    done = client.responses.create(model="tiny", input="Say something.", instructions="Be brief.",
                                   max_output_tokens=5, temperature=0.0)
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert done.output[0].type == "message" and done.output_text == done.output[0].content[0].text
    assert done.usage.output_tokens == 5 and done.usage.input_tokens > 0
    again = client.responses.retrieve(done.id)
    assert again.output_text == done.output_text and again.id == done.id
    assert client.responses.delete(done.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(done.id)


def test_parse_and_stream_with_a_schema(client):
    for seed in range(2):
        done = client.responses.parse(model="tiny", input="Is it there?", text_format=Verdict, temperature=1.0,
                                      max_output_tokens=64, extra_body={"magnetar": {}} if seed else None)
        assert done.status == "completed" and isinstance(done.output_parsed, Verdict), done
    deltas, kinds = [], []
    with client.responses.stream(model="tiny", input="Is it there?", text_format=Verdict,
                                 max_output_tokens=64) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert {"response.output_item.added", "response.content_part.added", "response.output_text.done",
            "response.output_item.done"} <= set(kinds)
    assert "".join(deltas) == final.output_text and isinstance(final.output_parsed, Verdict)


def test_previous_response_id_extends_the_cached_context(client):
    first = client.responses.create(model="tiny", input=DOCUMENT + "\n\nWhich record is on line 3?",
                                    max_output_tokens=4)
    context = first.model_extra["magnetar"]["prompts"][0]["context_tokens"]
    assert first.model_extra["magnetar"]["prompts"][0]["split"] == "pasted" and context > 600
    second = client.responses.create(model="tiny", input="And on line 4?", previous_response_id=first.id,
                                     max_output_tokens=4)
    assert second.usage.input_tokens_details.cached_tokens >= context  # only the new turn was encoded
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_function_calls_and_their_outputs(client):
    done = client.responses.create(model="tiny", input=DOCUMENT + "\n\nLook record 14 up.", tools=[TOOL],
                                   tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                   max_output_tokens=120)
    calls = [item for item in done.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "lookup" and 0 <= json.loads(calls[0].arguments)["record"] <= 99
    context = done.model_extra["magnetar"]["prompts"][0]["context_tokens"]
    result = client.responses.create(model="tiny", previous_response_id=done.id, tools=[TOOL], max_output_tokens=4,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "record 14: the lighthouse"}])
    assert result.usage.input_tokens_details.cached_tokens >= context
    # the call streamed: the SDK's accumulated response holds it
    with client.responses.stream(model="tiny", input="Look record 3 up.", tools=[TOOL],
                                 tool_choice={"type": "function", "name": "lookup"}, max_output_tokens=120) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    assert [item.type for item in final.output] == ["function_call"] and final.output[0].name == "lookup"


@pytest.mark.parametrize("body, param", [
    (dict(reasoning={"effort": "high"}), "reasoning"),
    (dict(max_output_tokens=0), "max_output_tokens"),
    (dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "nosuch"}}}), "text.format"),
    (dict(tools=[TOOL], tool_choice={"type": "function", "name": "nosuch"}), "tool_choice.name"),
    (dict(tools=[dict(TOOL, parameters={"type": "nosuch"})]), "tools[0].parameters"),
    (dict(previous_response_id="resp_nosuch"), "previous_response_id"),
    (dict(input=[{"type": "function_call_output", "call_id": "c"}]), "input[0].output"),
])
def test_bad_responses_requests_are_named(client, body, param):
    kw = dict(model="tiny", input="hi", max_output_tokens=4)
    kw.update(body)
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as e:
        client.responses.create(**kw)
    assert e.value.body["param"] == param, e.value.body
