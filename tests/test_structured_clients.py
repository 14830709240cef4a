"""Structured answers through the clients users build agents with (issue 50, item 4): langchain-openai's
``with_structured_output`` (json_schema and function calling) and ``bind_tools``, and litellm's ``completion`` with a
pydantic ``response_format`` and with tools -- each against a one-rank server on 127.0.0.1 (the two-rank job of
tests/test_serve_dist.py asks the same kinds of request). A random tiny model answers: only the constraint makes
its answers parse, which is what is tested."""
from __future__ import annotations

import os
from typing import Literal

import pytest

pytest.importorskip("llguidance", reason="the serve extra: pip install 'magnetar[serve]'")
pydantic = pytest.importorskip("pydantic")

import magnetar  # noqa: E402
from magnetar.serve.server import Server  # noqa: E402
from tests.dist_utils import free_port, serve_in_thread  # noqa: E402
from tests.tiny_models import save_tiny_chat  # noqa: E402


class Weather(pydantic.BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Rome"]
    sunny: bool


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                   "additionalProperties": False}}}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    model_dir = save_tiny_chat(tmp_path_factory.mktemp("tiny-clients"), 2048)
    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60)
    with serve_in_thread(Server(engine, model_name="tiny", port=free_port(), max_tokens=120)) as server:
        yield server.url + "/v1"


def _client(name: str):
    """The client package, imported when its test runs (litellm takes ~5 s to import: not at every collection)."""
    if name == "litellm":
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price list fetched at import
    return pytest.importorskip(name, reason="the test extra: pip install 'magnetar[test]'")


def test_langchain_structured_output_and_tools(url):
    langchain_openai = _client("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model="tiny", base_url=url, api_key="unused", max_retries=0, timeout=120,
                                      temperature=1.0, max_tokens=120)
    for method in ("json_schema", "function_calling"):
        got = llm.with_structured_output(Weather, method=method).invoke("What is the weather in Rome?")
        assert isinstance(got, Weather), (method, got)
    message = llm.bind_tools([WEATHER_TOOL], tool_choice="get_weather").invoke("Weather in Paris?")
    assert [c["name"] for c in message.tool_calls] == ["get_weather"]
    assert message.tool_calls[0]["args"]["city"] in ("Paris", "Rome") and message.tool_calls[0]["id"]


def test_litellm_response_format_and_tools(url):
    litellm = _client("litellm")
    common = dict(model="openai/tiny", api_base=url, api_key="unused", max_tokens=120, temperature=1.0,
                  num_retries=0, timeout=120)
    done = litellm.completion(messages=[{"role": "user", "content": "Weather in Rome?"}], response_format=Weather,
                              **common)
    Weather.model_validate_json(done.choices[0].message.content)
    called = litellm.completion(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL],
                                tool_choice="required", parallel_tool_calls=False, **common)
    calls = called.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather" and called.choices[0].finish_reason == \
        "tool_calls"
