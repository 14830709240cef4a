"""Tool calls (issue 50, item 2): ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` over HTTP with the ``openai``
client. A ``required`` or named call is constrained to the tools' schemas, so even a random tiny model's calls parse
and validate; ``auto`` answers are read by the parser (tested on written answers, cut into any deltas); the tool
results of the next turn extend the cached context; both prompt formats (a template that renders tools, the
fallback) put the results after the calls."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("llguidance", reason="the serve extra: pip install 'magnetar[serve]'")
openai = pytest.importorskip("openai", reason="the test extra: pip install 'magnetar[test]'")

import magnetar  # noqa: E402
from magnetar.engine.template import renders_tools, split_messages  # noqa: E402
from magnetar.serve.protocol import ChatMessage  # noqa: E402
from magnetar.serve.server import Server  # noqa: E402
from magnetar.serve.tools import ToolCallParser, ToolUse, call_text, parse_answer, tool_messages  # noqa: E402
from tests.dist_utils import free_port, serve_in_thread  # noqa: E402
from tests.tiny_models import save_tiny_chat  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city on a day",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                    "day": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "day"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}

# a template that renders tools itself (as Qwen's and Llama 3.1's do), in the tiny tokenizer's plain markers
NATIVE = ("{% if tools %}<|system|>\nTOOLS\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
          "{% for m in messages %}{% if m.role == 'tool' %}<|tool|>\n{{ m.content }}\n"
          "{% elif m.tool_calls %}<|assistant|>\n{% for c in m.tool_calls %}<tool_call>\n"
          "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}\n"
          "{% else %}<|{{ m.role }}|>\n{{ m.content }}\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat(tmp_path_factory.mktemp("tiny-tools"), 2048)


@pytest.fixture(scope="module")
def server(model_dir):
    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60)
    with serve_in_thread(Server(engine, model_name="tiny", port=free_port(), max_tokens=200,
                                paste_threshold=256)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _valid(call) -> dict:
    """The call's arguments, checked against its tool's schema (enum and bounds)."""
    args = json.loads(call.function.arguments)
    props = SCHEMAS[call.function.name]["function"]["parameters"]["properties"]
    assert set(args) == set(props), args
    for key, value in args.items():
        spec = props[key]
        assert value in spec["enum"] if "enum" in spec else spec["minimum"] <= value <= spec["maximum"], (key, value)
    return args


QUESTION = [{"role": "user", "content": "What is the weather in Paris tomorrow?"}]


@pytest.mark.parametrize("parallel", [True, False])
def test_a_required_call_always_parses(client, parallel):
    for seed in range(2):
        done = client.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER, CLOCK], seed=seed,
                                              tool_choice="required", parallel_tool_calls=parallel, temperature=1.0,
                                              max_tokens=160)
        choice = done.choices[0]
        calls = choice.message.tool_calls
        assert calls and (parallel or len(calls) == 1), choice
        if choice.finish_reason == "length":  # a model without EOS calls on until max_tokens: the cut call is text
            cut = choice.message.content
            assert parallel and (cut.startswith("<tool_call>") or "<tool_call>".startswith(cut)), cut
        else:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_")
            _valid(call)


def test_a_named_call_and_its_stream(client):
    kw = dict(model="tiny", messages=QUESTION, tools=[WEATHER, CLOCK], seed=5, temperature=0.8,
              tool_choice={"type": "function", "function": {"name": "get_time"}})
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop" and len(choice.message.tool_calls) == 1  # OpenAI's forced call: "stop"
    assert choice.message.tool_calls[0].function.name == "get_time"
    _valid(choice.message.tool_calls[0])
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:  # accumulated as the SDK's users do
                got = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                got["name"] += d.function.name or ""
                got["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "stop" and len(calls) == 1
    assert calls[0]["name"] == "get_time"
    assert json.loads(calls[0]["arguments"]) == json.loads(choice.message.tool_calls[0].function.arguments)


def test_the_next_turn_extends_the_cached_context(client):
    document = "\n".join(f"Line {i}: the archive keeps record {i * 7} of the city's weather." for i in range(12))
    first = [{"role": "user", "content": document + "\n\nWhat is the weather in Rome on day 3?"}]
    done = client.chat.completions.create(model="tiny", messages=first, tools=[WEATHER], tool_choice="required",
                                          parallel_tool_calls=False, seed=1)
    assert done.model_extra["magnetar"]["prompts"][0]["split"] == "pasted"
    context = done.model_extra["magnetar"]["prompts"][0]["context_tokens"]
    message = done.choices[0].message
    second = first + [message.model_dump(exclude_none=True),  # the SDK's message, sent back as users do
                      {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny, 21 C"}]
    again = client.chat.completions.create(model="tiny", messages=second, tools=[WEATHER], seed=1, max_tokens=8)
    assert again.usage.prompt_tokens_details.cached_tokens >= context > 700  # the document was not encoded again
    assert again.model_extra["magnetar"]["prompts"][0]["query_tokens"] < 80  # the tool result (bytes) is the new part


def test_tool_choice_none_answers_text(client):
    done = client.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER], tool_choice="none",
                                          max_tokens=6, seed=0)
    assert done.choices[0].message.tool_calls is None and done.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body, param", [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nosuch"}}),
     "tool_choice.function.name"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(parallel_tool_calls=True), "parallel_tool_calls"),
    (dict(tools=[{"type": "function", "function": {"name": "x", "parameters": {"type": "nosuch"}}}]),
     "tools[0].function.parameters"),
    (dict(tools=[WEATHER, WEATHER]), "tools[1].function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0].function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "deep", "parameters": json.loads(
        '{"a":' * 40 + "1" + "}" * 40)}}]), "tools[0].function.parameters"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
    (dict(messages=QUESTION + [{"role": "tool", "content": "x"}]), "messages[1].tool_call_id"),
    (dict(messages=QUESTION + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": "not json"}}]}, {"role": "tool", "tool_call_id": "c", "content": "x"}]),
     "messages[1].tool_calls[0].function.arguments"),
    (dict(messages=QUESTION + [{"role": "assistant"}, {"role": "user", "content": "?"}]), "messages[1].content"),
])
def test_bad_tool_requests_are_refused_by_name(client, body, param):
    kw = dict(model="tiny", messages=QUESTION, max_tokens=4)
    kw.update(body)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw)
    assert e.value.body["param"] == param, e.value.body


USE = ToolUse(("get_weather", "get_time"), "auto")


@pytest.mark.parametrize("text, content, names", [
    ("It is sunny.", "It is sunny.", []),
    ("Let me look.\n" + call_text("get_weather", {"city": "Oslo", "day": 2}), "Let me look.\n", ["get_weather"]),
    (call_text("get_weather", {"city": "Oslo", "day": 2}) + "\n" + call_text("get_time", {"zone": "UTC"}), None,
     ["get_weather", "get_time"]),
    ('{"name": "get_time", "parameters": {"zone": "CET"}}', None, ["get_time"]),  # Llama 3's bare JSON
    ('{"a": 1}', '{"a": 1}', []),  # JSON that is no call is content
    ("<tool_call>\n{\"name\": \"nosuch\", \"arguments\": {}}\n</tool_call>",
     "<tool_call>\n{\"name\": \"nosuch\", \"arguments\": {}}\n</tool_call>", []),
    ("Cut short <tool_call>\n{\"name\": \"get_ti", "Cut short <tool_call>\n{\"name\": \"get_ti", []),
    ("a < b and <tool", "a < b and <tool", []),
])
def test_the_parser_reads_calls_from_any_deltas(text, content, names):
    got_content, calls = parse_answer(USE, text)
    assert got_content == content and [c["function"]["name"] for c in calls] == names
    for cut in (1, 2, 3, 7):  # the same answer streamed in pieces: the same content and calls
        parser, streamed, streamed_calls = ToolCallParser(USE), "", []
        for i in range(0, len(text), cut):
            piece, new = parser.feed(text[i:i + cut])
            streamed += piece
            streamed_calls += new
            assert OPEN_PREFIX_SAFE(streamed)
        piece, new = parser.finish()
        streamed, streamed_calls = streamed + piece, streamed_calls + new
        assert [c["function"] for c in streamed_calls] == [c["function"] for c in calls]
        assert streamed == (content or ""), (cut, streamed)


def OPEN_PREFIX_SAFE(streamed: str) -> bool:  # noqa: N802 -- no half marker is ever sent as content
    return not streamed.endswith(("<", "<tool", "<tool_call"))


def test_both_prompt_formats_put_the_results_after_the_calls(model_dir, tmp_path):
    from transformers import AutoTokenizer

    fallback = AutoTokenizer.from_pretrained(model_dir)
    native = AutoTokenizer.from_pretrained(model_dir)
    native.chat_template = NATIVE
    assert renders_tools(native) and not renders_tools(fallback)
    history = [ChatMessage.model_validate(m) for m in (
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "day": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "snow"},
        {"role": "tool", "tool_call_id": "c2", "content": "cold"})]
    for tok, is_native in ((native, True), (fallback, False)):
        messages = tool_messages(history, [WEATHER], is_native)
        prompt = split_messages(tok, messages, tools=[WEATHER] if is_native else None)
        context, query = tok.decode(prompt.context_ids), tok.decode(prompt.query_ids)
        assert "get_weather" in context and '"Oslo"' in context and "snow" not in context
        assert "snow" in query and "cold" in query and query.endswith("<|assistant|>\n")
        # the first turn's context is a prefix of this one's: the next turn extends it
        turn1 = split_messages(tok, tool_messages(history[:1], [WEATHER], is_native),
                               tools=[WEATHER] if is_native else None)
        assert torch.equal(prompt.context_ids[:turn1.context_ids.numel()], turn1.context_ids)
    fb = tool_messages(history, [WEATHER], False)
    assert fb[0]["role"] == "system" and "<tools>" in fb[0]["content"]
    assert [m["role"] for m in fb] == ["system", "user", "assistant", "user"]
    assert fb[2]["content"] == call_text("get_weather", {"city": "Oslo", "day": 1})
    assert fb[3]["content"].count("<tool_response>") == 2
