"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``) over the chat pipeline.

A Responses request becomes a chat request (:func:`chat_turn`): ``instructions`` as the system message, then the
conversation of ``previous_response_id`` (its input and output, kept by :class:`ResponseStore`), then ``input``
(text as one user message; message items; ``function_call`` items as the assistant's tool calls;
``function_call_output`` items as tool messages), ``text.format`` as ``response_format``, the flat function tools as
chat's, ``max_output_tokens`` as ``max_tokens``. So a response continued by ``previous_response_id`` is the next turn
of a conversation: its context extends the cached one (prefix reuse) and only the new turn is encoded, and a
document in the first input is cut into Phase 1 as a chat's pasted document is. Errors of the chat checks name the
Responses field (``max_output_tokens``, ``text.format``, ``tools[0].parameters``, ``input``).

:class:`ResponsesResponder` answers with the ``response`` object (``output``: a ``message`` item of ``output_text``,
and ``function_call`` items) or streams OpenAI's events (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``, ...,
``response.function_call_arguments.delta`` / ``.done``, ``response.output_item.done``, ``response.completed`` or
``response.incomplete``), each with its ``sequence_number``.

Stored responses (``store``, true by default) are kept in memory, the :data:`MAX_STORED` most recent: a restart
forgets them (their contexts' KV is the context cache's, by content, so a new conversation about the same
document still reuses it).
"""
from __future__ import annotations

import json
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from magnetar.serve.protocol import (RESPONSES_UNSUPPORTED, ChatCompletionRequest, ChatMessage, RequestError,
                                     ResponseFunctionCallItem,
                                     ResponseFunctionOutputItem, ResponsesRequest, now, refuse_unsupported, show)
from magnetar.serve.tools import ToolCallParser, parse_answer

MAX_STORED = 1024  # stored responses, at most (least recently used out)


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object, as returned
    messages: tuple  # the conversation through this response's output (ChatMessage; no instructions)


class ResponseStore:
    """The stored responses of a server (thread-safe; bounded, least recently used out)."""

    def __init__(self, limit: int = MAX_STORED):
        self.limit = limit
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, rid: str) -> Optional[StoredResponse]:
        with self._lock:
            found = self._items.get(rid)
            if found is not None:
                self._items.move_to_end(rid)
            return found

    def put(self, rid: str, stored: StoredResponse) -> None:
        with self._lock:
            self._items[rid] = stored
            self._items.move_to_end(rid)
            while len(self._items) > self.limit:
                self._items.popitem(last=False)

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._items.pop(rid, None) is not None

    def find(self, rid: str) -> StoredResponse:
        """The stored response ``rid``, or a 404 naming it."""
        found = self.get(rid)
        if found is None:
            raise RequestError(f"response {show(rid)} is not stored on this server (it was made with store: false, "
                               f"deleted, or evicted: the {self.limit} most recent are kept; a restart forgets them)",
                               "previous_response_id", status=404)
        return found


@dataclass(frozen=True)
class ChatTurn:
    """A Responses request as the chat request it runs as, and the conversation to store after it."""

    request: ResponsesRequest
    chat: ChatCompletionRequest
    history: tuple  # the conversation before the output: previous_response_id's, then this input (ChatMessage)

    def renamed(self, error: RequestError) -> RequestError:
        """A chat check's error with the Responses field it came from."""
        param = error.param
        if param is None:
            return error
        new = _responses_param(param)
        if new == param:
            return error
        message = error.message.replace(param, new, 1)
        return RequestError(message, new, status=error.status, type=error.type)


def _responses_param(param: str) -> str:
    if param in ("max_tokens", "max_completion_tokens"):
        return "max_output_tokens"
    if param.startswith("response_format"):
        return "text.format"
    if param.startswith("messages"):
        return "input"
    if param.startswith("tool_choice.function."):
        return "tool_choice." + param[len("tool_choice.function."):]
    if param.startswith("tools[") and ".function." in param:
        return param.replace(".function.", ".", 1)
    return param


def chat_turn(req: ResponsesRequest, store: ResponseStore) -> ChatTurn:
    """The chat request of a Responses request (module docstring); RequestError naming the Responses field."""
    refuse_unsupported(req, RESPONSES_UNSUPPORTED)
    history: list[ChatMessage] = []
    if req.previous_response_id is not None:
        history = list(store.find(req.previous_response_id).messages)
    history += input_messages(req.input)
    messages = ([ChatMessage(role="system", content=req.instructions)] if req.instructions else []) + history
    body: dict[str, Any] = dict(model=req.model, messages=messages, max_tokens=req.max_output_tokens,
                                temperature=req.temperature, top_p=req.top_p, stream=req.stream, user=req.user,
                                magnetar=req.magnetar, parallel_tool_calls=req.parallel_tool_calls)
    if req.tools is not None:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else \
            {"type": "function", "function": {"name": req.tool_choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None:
        body["response_format"] = response_format(fmt)
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValueError as e:  # the Responses model checked the types: only a value chat refuses is left
        raise RequestError(f"input: {e}", "input") from None
    return ChatTurn(req, chat, tuple(history))


def response_format(fmt: dict) -> dict:
    """``text.format`` as chat's ``response_format`` (json_schema's fields move under ``json_schema``)."""
    if fmt.get("type") != "json_schema":
        return fmt
    spec = {k: v for k, v in fmt.items() if k != "type"}
    if not isinstance(spec.get("schema", {}), dict) or not set(spec) <= {"name", "schema", "strict", "description"}:
        raise RequestError("text.format must be {\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}, "
                           "\"strict\": ...}", "text.format")
    return {"type": "json_schema", "json_schema": spec}


def input_messages(items) -> list[ChatMessage]:
    """A Responses ``input`` as chat messages: text as one user message, a message item as its message,
    consecutive ``function_call`` items as one assistant message's tool calls (after the assistant's text, when it
    precedes them), a ``function_call_output`` as a tool message."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    out: list[ChatMessage] = []
    for item in items:
        if isinstance(item, ResponseFunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                out[-1] = ChatMessage.model_validate({**last.model_dump(exclude_none=True),
                                                      "tool_calls": [*(c.model_dump() for c in last.tool_calls or []),
                                                                     call]})
            else:
                out.append(ChatMessage.model_validate({"role": "assistant", "tool_calls": [call]}))
        elif isinstance(item, ResponseFunctionOutputItem):
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.output))
        else:
            out.append(ChatMessage(role=item.role, content=item.text()))
    return out


class ResponsesResponder:
    """The Responses API's answer to one chat turn (the app's responder interface: ``whole``, ``opening``,
    ``tokens``, ``end``, ``sse``): the response object, or its stream of events; stores it when asked to."""

    done_marker = False  # no "data: [DONE]" (the SDK ends on response.completed)

    def __init__(self, model: str, names, prepared: list, n: int, info: dict, logprobs: bool, *, turn: ChatTurn,
                 store: ResponseStore):
        self.model, self.prepared, self.info, self.turn, self.store = model, prepared, info, turn, store
        self.id, self.created = f"resp_{uuid.uuid4().hex}", now()
        self.tools = prepared[0].tools
        self.parser = ToolCallParser(self.tools) if self.tools is not None else None
        self.seq = 0
        self.output: list[dict] = []  # the items so far (the open message's text grows in place)
        self._message: Optional[dict] = None  # the message item open in the stream

    # -- the response object ------------------------------------------------------------------------------------
    def response(self, status: str, done=None) -> dict:
        req = self.turn.request
        fmt = req.text.format if req.text is not None and req.text.format is not None else {"type": "text"}
        body = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": self.output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "previous_response_id": req.previous_response_id, "temperature": req.temperature,
                "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls is not False,
                "tool_choice": (req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None
                                else req.tool_choice.model_dump()) or "auto",
                "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "text": {"format": fmt},
                "truncation": "disabled", "store": req.store is not False, "metadata": req.metadata or {},
                "user": req.user, "usage": None, "magnetar": self.info}
        if done is not None:
            r = done.result
            prompt = r.context_tokens + r.query_tokens
            body["usage"] = {"input_tokens": prompt,
                             "input_tokens_details": {"cached_tokens": r.cached_context_tokens},
                             "output_tokens": len(r.token_ids), "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": prompt + len(r.token_ids)}
        return body

    def _status(self, done) -> str:
        return "incomplete" if done.finish_reason == "length" else "completed"

    def _finished(self, done) -> dict:
        """The final response object; stored (with the conversation through it) unless ``store`` is false."""
        body = self.response(self._status(done), done)
        if self.turn.request.store is not False:
            self.store.put(self.id, StoredResponse(body, self.turn.history + tuple(self._as_messages())))
        return body

    def _as_messages(self) -> list[ChatMessage]:
        """The output as the conversation's next assistant message (its text and calls)."""
        text = "".join(p["text"] for item in self.output if item["type"] == "message" for p in item["content"])
        calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                          "arguments": item["arguments"]}}
                 for item in self.output if item["type"] == "function_call"]
        return [ChatMessage.model_validate({"role": "assistant", "content": text or None, "tool_calls": calls or None})]

    @staticmethod
    def _message_item(text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def _call_item(call: dict) -> dict:
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}

    def whole(self, tokens: list, dones: list) -> dict:
        text = "".join(t.text for t in tokens[0])
        content, calls = parse_answer(self.tools, text) if self.tools is not None else (text, [])
        if content:
            self.output.append(self._message_item(content, self._status(dones[0])))
        self.output += [self._call_item(c) for c in calls]
        return self._finished(dones[0])

    # -- the stream ---------------------------------------------------------------------------------------------
    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def sse(self, event: dict) -> str:
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    def error_event(self, body: dict) -> dict:
        error = body["error"]
        return self.event("error", code=error.get("code"), message=error["message"], param=error.get("param"))

    def opening(self, i: int) -> list:
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def tokens(self, i: int, item) -> list:
        text, calls = self.parser.feed(item.text) if self.parser is not None else (item.text, [])
        return self._text(text) + self._calls(calls)

    def _text(self, text: str) -> list:
        if not text:
            return []
        out = []
        if self._message is None:
            self._message = self._message_item("", "in_progress")
            self.output.append(self._message)
            index = len(self.output) - 1
            out += [self.event("response.output_item.added", output_index=index,
                               item=dict(self._message, content=[])),
                    self.event("response.content_part.added", item_id=self._message["id"], output_index=index,
                               content_index=0, part=dict(self._message["content"][0]))]
        self._message["content"][0]["text"] += text
        return out + [self.event("response.output_text.delta", item_id=self._message["id"],
                                 output_index=self.output.index(self._message), content_index=0, delta=text,
                                 logprobs=[])]

    def _close_message(self, status: str = "completed") -> list:
        if self._message is None:
            return []
        m, self._message = self._message, None
        m["status"] = status
        index, part = self.output.index(m), m["content"][0]
        return [self.event("response.output_text.done", item_id=m["id"], output_index=index, content_index=0,
                           text=part["text"], logprobs=[]),
                self.event("response.content_part.done", item_id=m["id"], output_index=index, content_index=0,
                           part=dict(part)),
                self.event("response.output_item.done", output_index=index, item=m)]

    def _calls(self, calls: list) -> list:
        out = self._close_message() if calls else []
        for call in calls:
            item = self._call_item(call)
            self.output.append(item)
            index = len(self.output) - 1
            out += [self.event("response.output_item.added", output_index=index,
                               item=dict(item, arguments="", status="in_progress")),
                    self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=item["arguments"]),
                    self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=item["name"], arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=index, item=item)]
        return out

    def end(self, i: int, done) -> list:
        text, calls = self.parser.finish() if self.parser is not None else ("", [])
        out = self._text(text) + self._calls(calls) + self._close_message(self._status(done))
        body = self._finished(done)
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return out + [self.event(kind, response=body)]
