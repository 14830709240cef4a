"""Tool calls over HTTP (OpenAI's ``tools``, ``tool_choice``, ``parallel_tool_calls``): the prompt that shows the
tools, the grammar that makes a required call parse, and the parser that reads calls out of an answer.

**The prompt.** A model whose chat template renders tools itself (it reads ``tools``:
:func:`magnetar.engine.template.renders_tools`) gets the definitions, the assistant messages' ``tool_calls`` and the
``tool`` messages as the template expects them. Every other template gets the fallback format (vLLM ships the same
idea as its tool chat templates): the tools' definitions, one JSON object per line inside ``<tools></tools>``, and
how to call them, at the end of the system message (a system message is added first when there is none); an
assistant message's calls are written as the model would have written them, one ``<tool_call>`` block each
(``<tool_call>\\n{"name":...,"arguments":{...}}\\n</tool_call>``); consecutive ``tool`` messages become one user
message of ``<tool_response>`` blocks. Either way the tool results are the new part of the conversation: the rest
-- the document, the question, the call -- is the context the first turn encoded, extended (prefix reuse).

**The choice.** ``auto`` (the default with tools): the answer is free text, read by :class:`ToolCallParser`
(``<tool_call>`` blocks, or an answer that is one JSON object ``{"name", "arguments" | "parameters"}`` as Llama 3's
template asks for); ``none``: the tools are shown but the answer is text; ``required`` and a named function: the
answer is constrained (:func:`tool_grammar`, llguidance) to ``<tool_call>`` blocks whose JSON follows the tools'
argument schemas, so it always parses -- one call, or several with ``parallel_tool_calls`` (the default); an
object of a schema that does not say ``additionalProperties`` takes only its declared properties (:func:`closed`).
A call that runs out of ``max_tokens`` is no call: its text is the content and the finish reason ``length``.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from magnetar.serve.protocol import ChatCompletionRequest, ChatMessage, RequestError, show
from magnetar.serve.structured import check_bounds

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
MAX_TOOLS = 128
NO_ARGUMENTS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolUse:
    """How a chat request's answer may call its tools: ``names`` (the functions), ``choice`` (``auto``,
    ``required`` or ``named``: the function ``named``), ``parallel`` (several calls in one answer)."""

    names: tuple[str, ...]
    choice: str
    parallel: bool = True
    named: Optional[str] = None

    def finish_reason(self, reason: Optional[str], calls: list) -> Optional[str]:
        """OpenAI's finish reason of an answer: ``tool_calls`` when it called tools of its own choice (a named
        call ends as ``stop``, as OpenAI's forced calls do)."""
        return "tool_calls" if calls and reason == "stop" and self.choice != "named" else reason


def check_tools(req: ChatCompletionRequest) -> tuple[Optional[ToolUse], list[dict]]:
    """The request's :class:`ToolUse` (None: the answer is text) and its tools as OpenAI's dicts (what is shown
    to the model); RequestError naming ``tools[i]...``, ``tool_choice`` or ``parallel_tool_calls``."""
    tools = req.tools or []
    if len(tools) > MAX_TOOLS:
        raise RequestError(f"tools holds {len(tools)} functions; at most {MAX_TOOLS}", "tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not NAME.fullmatch(name):
            raise RequestError(f"tools[{i}].function.name {show(name)}: a function's name is 1-64 letters, digits, "
                               f"underscores or dashes", f"tools[{i}].function.name")
        if name in seen:
            raise RequestError(f"tools[{i}].function.name {name!r} is given twice; names must be unique",
                               f"tools[{i}].function.name")
        seen.add(name)
        params = tool.function.parameters
        if params is not None:
            check_bounds(params, f"tools[{i}].function.parameters")
    choice = req.tool_choice
    if req.parallel_tool_calls is not None and not tools:
        raise RequestError("parallel_tool_calls needs tools", "parallel_tool_calls")
    if choice is not None and not tools:
        raise RequestError(f"tool_choice={show(_choice_text(choice))} needs tools: give the functions in tools",
                           "tool_choice")
    if not tools or choice == "none":
        return None, [tool.model_dump(exclude_none=True) for tool in tools]
    named = None
    if not isinstance(choice, str) and choice is not None:
        named = choice.function.name
        if named not in seen:
            raise RequestError(f"tool_choice.function.name {show(named)} is not one of the tools ("
                               f"{', '.join(sorted(seen))})", "tool_choice.function.name")
    use = ToolUse(tuple(t.function.name for t in tools), "named" if named else choice or "auto",
                  parallel=req.parallel_tool_calls is not False and named is None, named=named)
    return use, [tool.model_dump(exclude_none=True) for tool in tools]


def _choice_text(choice) -> Any:
    return choice if isinstance(choice, str) or choice is None else choice.model_dump()


def tool_grammar(use: ToolUse, tools: list[dict]) -> Optional[str]:
    """The llguidance grammar of a ``required`` or named call (None for ``auto``): ``<tool_call>`` blocks whose
    JSON is ``{"name": a tool, "arguments": its schema}``, compact; one block, or several with ``parallel``."""
    if use.choice == "auto":
        return None
    import llguidance  # the serve extra (structured outputs checked it)

    chosen = [t["function"] for t in tools if use.named in (None, t["function"]["name"])]
    options = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                 "arguments": closed(f.get("parameters") or NO_ARGUMENTS)},
                "required": ["name", "arguments"], "additionalProperties": False} for f in chosen]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    schema = dict(schema, **{"x-guidance": {"whitespace_flexible": False}})
    more = ' ("\\n" call)*' if use.parallel else ""
    return llguidance.LLMatcher.grammar_from_lark(
        f'start: call{more}\ncall: "{OPEN}\\n" body "\\n{CLOSE}"\nbody: %json {json.dumps(schema)}')


def closed(schema: Any) -> Any:
    """``schema`` with every object that lists its properties and says nothing of others closed to them
    (``additionalProperties: false``, as OpenAI's strict mode requires of a tool's schema): a constrained call holds
    the declared arguments, not names the model makes up. An object that allows others says so and keeps them."""
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def tool_messages(messages: list[ChatMessage], tools: list[dict], native: bool) -> list[dict]:
    """The conversation as the chat template's messages (``developer`` as ``system``): with ``native`` (a
    template that renders tools) the calls and results as the template reads them, else in the fallback format
    (module docstring). Checks that ``tool_calls`` sit on assistant messages and ``tool_call_id`` on tool ones."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        if m.tool_calls is not None and m.role != "assistant":
            raise RequestError(f"messages[{i}].tool_calls: only an assistant message calls tools",
                               f"messages[{i}].tool_calls")
        if m.role == "tool" and not m.tool_call_id:
            raise RequestError(f"messages[{i}].tool_call_id is required: a tool message answers a call (its id)",
                               f"messages[{i}].tool_call_id")
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise RequestError(f"messages[{i}].content is required (only an assistant message with tool_calls may "
                               f"leave it out)", f"messages[{i}].content")
        role = "system" if m.role == "developer" else m.role
        if native:
            message: dict[str, Any] = {"role": role, "content": m.text()}
            if m.tool_calls:
                message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments, i, j)}}
                    for j, c in enumerate(m.tool_calls)]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.name is not None and role == "tool":
                message["name"] = m.name
            out.append(message)
        elif m.role == "tool":
            block = f"<tool_response>\n{m.text()}\n</tool_response>"
            if out and out[-1].get("tool_results"):  # consecutive results: one user message
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        else:
            text = m.text()
            if m.tool_calls:
                calls = "\n".join(call_text(c.function.name, _arguments(c.function.arguments, i, j))
                                  for j, c in enumerate(m.tool_calls))
                text = f"{text}\n{calls}" if text else calls
            out.append({"role": role, "content": text})
    for m in out:
        m.pop("tool_results", None)
    if tools and not native:
        block = fallback_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _arguments(text: str, i: int, j: int) -> dict:
    """An earlier call's arguments (a JSON object as a string) as a dict."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        where = f"messages[{i}].tool_calls[{j}].function.arguments"
        raise RequestError(f"{where} must be a JSON object as a string, got {show(text)}", where)
    return value


def call_text(name: str, arguments: dict) -> str:
    """One call as the fallback format writes it (and the grammar makes the model write it)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False, separators=(",", ":"))
    return f"{OPEN}\n{body}\n{CLOSE}"


def fallback_prompt(tools: list[dict]) -> str:
    """The system message's part that shows the tools to a model whose template does not render them."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more of these functions to answer. Their definitions, one per line:\n"
            f"<tools>\n{listed}\n</tools>\n\nTo call a function, answer with one block per call, holding its name "
            f"and its arguments as a JSON object:\n{OPEN}\n{{\"name\":\"<function name>\",\"arguments\":"
            f"{{<arguments>}}}}\n{CLOSE}")


def new_call(name: str, arguments: dict) -> dict:
    """OpenAI's tool call object."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


class ToolCallParser:
    """Reads one answer's tool calls as its text arrives (:meth:`feed` per text delta, :meth:`finish` at the end):
    the content to send now (text before the first ``<tool_call>``, less a tail that may begin one) and the calls
    completed so far. An answer that opens with ``{`` is held to the end and read as one call when it is
    ``{"name": a tool, "arguments"|"parameters": {...}}``. A block that does not hold a call of a known tool, and
    a block left open, are content."""

    def __init__(self, use: ToolUse):
        self.use = use
        self.text = ""  # everything so far
        self.sent = 0  # characters of it sent as content
        self.calls: list[dict] = []
        self._scan = 0  # where the next block is looked for
        self._late = ""  # content after the first block (sent at the end)
        self._opened = False

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.text += delta
        if not self._opened:
            start = self.text.find(OPEN)
            if start < 0:
                if self.text.lstrip().startswith("{"):
                    return "", []
                keep = _partial_suffix(self.text, OPEN)
                return self._send(len(self.text) - keep), []
            self._opened = True
            self._scan = start
            out = self._send(start)
        else:
            out = ""
        return out, self._blocks()

    def _send(self, upto: int) -> str:
        piece = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return piece

    def _blocks(self) -> list[dict]:
        new = []
        while True:
            start = self.text.find(OPEN, self._scan)
            if start < 0:
                break
            end = self.text.find(CLOSE, start)
            if end < 0:
                break
            self._late += self.text[self._scan:start].strip()
            call = self._call(self.text[start + len(OPEN):end])
            if call is None:
                self._late += self.text[start:end + len(CLOSE)]
            else:
                new.append(call)
            self._scan = end + len(CLOSE)
        self.calls += new
        return new

    def _call(self, body: str) -> Optional[dict]:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.use.names:
            return None
        args = value.get("arguments", value.get("parameters", {}))
        return new_call(value["name"], args) if isinstance(args, dict) else None

    def finish(self) -> tuple[str, list[dict]]:
        """The content not sent yet and the calls completed at the end."""
        if not self._opened:
            call = self._call(self.text.strip()) if self.text.lstrip().startswith("{") else None
            if call is not None:
                self.calls.append(call)
                self.sent = len(self.text)
                return "", [call]
            return self._send(len(self.text)), []
        new = self._blocks()
        rest = (self._late + self.text[self._scan:]).strip()
        self.sent = len(self.text)
        return rest, new


def _partial_suffix(text: str, marker: str) -> int:
    """How many last characters of ``text`` are a proper prefix of ``marker`` (held back: the marker may follow)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_answer(use: ToolUse, text: str) -> tuple[Optional[str], list[dict]]:
    """A whole answer's ``(content, calls)``: content None when the answer is only calls."""
    parser = ToolCallParser(use)
    head, calls = parser.feed(text)
    rest, more = parser.finish()
    content, calls = head + rest, calls + more
    return (content if content.strip() or not calls else None), calls
