"""The OpenAI wire format: pydantic models of the requests and responses, and OpenAI-style errors.

Requests are parsed strictly from the raw body (:func:`parse_body`): nothing is coerced (``"5"`` is not 5, ``true``
is not 1, 2.5 is not 2), unknown fields are refused by name, and every problem becomes a :class:`RequestError`
whose ``param`` names the field (``messages[0].content``, ``max_tokens``) -- the 400 body is OpenAI's
``{"error": {"message", "type": "invalid_request_error", "param", "code": null}}``.

OpenAI fields Magnetar does not implement are declared too, so that their non-default values are refused by name
(:func:`refuse_unsupported`) instead of silently ignored. This module knows nothing about the engine.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from magnetar.config import short_repr


class RequestError(Exception):
    """A request the server refuses: HTTP ``status``, a message naming the field and what to change, ``param``
    (the field, or None) and OpenAI's error ``type``."""

    def __init__(self, message: str, param: Optional[str] = None, *, status: int = 400,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type

    def body(self) -> dict:
        return error_body(self.message, self.param, self.type)


def error_body(message: str, param: Optional[str] = None, type: str = "invalid_request_error",
               code: Optional[str] = None) -> dict:
    """OpenAI's error object (a ``param`` longer than 100 characters -- a client's own field name -- is cut)."""
    if param is not None and len(param) > 100:
        param = param[:97] + "..."
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def show(value: Any, limit: int = 60) -> str:
    """A client's value for an error message, cheaply and short (:func:`magnetar.config.short_repr`)."""
    return short_repr(value, limit)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class ErrorDetail(BaseModel):
    """What :func:`error_body` holds under ``error`` (OpenAI's error object)."""

    message: str
    type: str
    param: Optional[str] = None  # the request's field at fault, where one is
    code: Optional[str] = None  # e.g. invalid_api_key, request_too_large, server_overloaded


class ErrorResponse(BaseModel):
    """Every error this server answers, refusals of the gate included (the OpenAPI schema's error responses)."""

    error: ErrorDetail


# -- requests --------------------------------------------------------------------------------------------------
class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's)


class ToolCall(_Strict):
    """A call an assistant message made (sent back in the conversation's history)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None  # None: an assistant message that only called tools
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant message's calls
    tool_call_id: Optional[str] = None  # a tool message: the call it answers
    refusal: Optional[str] = None  # an assistant message the SDK sends back as it got it (None here)

    def text(self) -> str:
        """The content as one string (text parts joined, as OpenAI reads them; none is "")."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionDefinition(_Strict):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema of the arguments (none: no arguments)
    strict: Optional[bool] = None  # the arguments always follow the schema where the call is constrained


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class StreamOptions(_Strict):
    include_usage: bool = False


class _Generation(_Strict):
    """The fields chat and text completions share. ``None`` means "not given": the server's defaults apply
    (``--temperature``, ``--top-p``, ``--top-k``, ``--seed``; ``--max-tokens`` capped to the positions left)."""

    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None  # not OpenAI's; vLLM's and SGLang's extension
    ignore_eos: Optional[bool] = None  # not OpenAI's; vLLM's and SGLang's extension (EOS does not end the answer)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # Magnetar's per-request options (docs/serving.md, "Per-request options"); checked by magnetar.serve.prompts
    magnetar: Optional[dict[str, Any]] = None
    # OpenAI fields that are refused unless they hold their default (refuse_unsupported)
    n: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None

    def stop_list(self) -> Optional[list[str]]:
        """``stop`` as a list: OpenAI allows one string or a list of them."""
        return [self.stop] if isinstance(self.stop, str) else self.stop

    # the engine's SamplingParams field -> this request's field (a FieldError of the engine names the former)
    SAMPLING_PARAMS: ClassVar[dict[str, str]] = {
        "max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
        "seed": "seed", "stop": "stop", "logprobs": "logprobs", "ignore_eos": "ignore_eos"}

    def sampling_fields(self, *, prompt_logprobs: bool = False) -> dict[str, Any]:
        """The request as the engine's :class:`~magnetar.engine.sampling.SamplingParams` fields (vLLM's
        ``to_sampling_params``): the fields given, no others -- what is not given is the server's default
        (``Engine.check`` fills it). ``prompt_logprobs``: also score the query's tokens (echo with logprobs)."""
        given = dict(max_new_tokens=self.max_new_tokens(), temperature=self.temperature, top_p=self.top_p,
                     top_k=self.top_k, seed=self.seed, stop=self.stop_list(), logprobs=self.alternatives(),
                     prompt_logprobs=prompt_logprobs or None, ignore_eos=self.ignore_eos)
        return {k: v for k, v in given.items() if v is not None}

    def max_new_tokens(self) -> Optional[int]:
        return self.max_tokens

    def alternatives(self) -> Optional[int]:
        """How many alternatives each token's log-probability comes with (None: no log-probabilities)."""
        return None

    def sampling_param(self, field: str) -> Optional[str]:
        """This request's field that sets the engine's SamplingParams ``field`` (None: no field of the client's)."""
        return self.SAMPLING_PARAMS.get(field)


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None  # OpenAI's newer name for max_tokens
    logprobs: Optional[bool] = None  # each answer token's log-probability
    top_logprobs: Optional[int] = None  # and this many alternatives (0..20; needs logprobs)
    tools: Optional[list[ToolDefinition]] = None  # functions the answer may call (magnetar.serve.tools)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[dict[str, Any]] = None

    def max_new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def alternatives(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling_param(self, field: str) -> Optional[str]:
        if field == "max_new_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return "top_logprobs" if field == "logprobs" else super().sampling_param(field)


class CompletionRequest(_Generation):
    # a string, a list of strings, token ids, or a list of token-id lists (one choice each, in order)
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None  # log-probabilities of the answer's (with echo also the prompt's) tokens and
    # this many alternatives each (0..20)
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def alternatives(self) -> Optional[int]:
        return self.logprobs


class ContextRequest(_Strict):
    """``POST /v1/contexts``: encode ``context`` once; ``format`` says which requests will use it: ``chat``
    (tokenized as the chat template's context part, like a chat request's ``magnetar.context``) or ``raw``
    (plain text, like a completion's ``magnetar.context``)."""

    model: str
    context: str
    format: Literal["chat", "raw"] = "chat"


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's): ``prompt`` as text (special-token strings are text; BOS as the tokenizer adds it
    with ``add_special_tokens``), or ``messages`` rendered with the chat template (``add_generation_prompt``)."""

    model: str
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


# -- the Responses API (POST /v1/responses: magnetar.serve.responses) -------------------------------------------
class ResponseInputText(_Strict):
    type: Literal["input_text", "output_text"]  # output_text: an earlier answer sent back as input
    text: str
    annotations: Optional[list[Any]] = None
    logprobs: Optional[list[Any]] = None


class ResponseMessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[ResponseInputText]]
    id: Optional[str] = None
    status: Optional[str] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: Optional[str] = None
    status: Optional[str] = None


class ResponseFunctionOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: Optional[str] = None
    status: Optional[str] = None


def _item_kind(value: Any) -> str:
    return (value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message"))


ResponseInputItem = Annotated[Union[Annotated[ResponseMessageItem, Tag("message")],
                                    Annotated[ResponseFunctionCallItem, Tag("function_call")],
                                    Annotated[ResponseFunctionOutputItem, Tag("function_call_output")]],
                              Discriminator(_item_kind)]


class ResponseTool(_Strict):
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ResponseNamedTool(_Strict):
    type: Literal["function"]
    name: str


class ResponseText(_Strict):
    format: Optional[dict[str, Any]] = None  # {"type": "text" | "json_object" | "json_schema", "name", "schema", ...}
    verbosity: Optional[Literal["low", "medium", "high"]] = None


class ResponsesRequest(_Strict):
    """``POST /v1/responses``: OpenAI's Responses API over the chat pipeline (magnetar.serve.responses)."""

    model: str
    input: Union[str, list[ResponseInputItem]]
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: bool = False
    store: Optional[bool] = None  # kept for previous_response_id (true by default)
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    tools: Optional[list[ResponseTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], ResponseNamedTool, None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[ResponseText] = None
    truncation: Optional[Literal["disabled"]] = None
    service_tier: Optional[Literal["auto", "default"]] = None
    prompt_cache_key: Optional[str] = None  # accepted: the context cache is keyed by the tokens themselves
    magnetar: Optional[dict[str, Any]] = None
    # refused unless at their default (refuse_unsupported)
    reasoning: Optional[dict[str, Any]] = None
    include: Optional[list[str]] = None
    top_logprobs: Optional[int] = None
    background: Optional[bool] = None


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's): ``tokens`` (ids of the model's vocabulary) back to text."""

    model: str
    tokens: list[int]


# The unsupported OpenAI fields and the values they may hold: (field, allowed values, why)
_UNSUPPORTED: tuple[tuple[str, tuple, str], ...] = (
    ("best_of", (None, 1), "no server-side best-of; ask for n choices and pick one"),
    ("presence_penalty", (None, 0, 0.0), "no penalties"),
    ("frequency_penalty", (None, 0, 0.0), "no penalties"),
    ("logit_bias", (None,), "no logit bias"),
    ("suffix", (None,), "no insertion"),
)
RESPONSES_UNSUPPORTED: tuple[tuple[str, tuple, str], ...] = (  # the Responses API's
    ("reasoning", (None,), "no reasoning models"),
    ("include", (None,), "no extra output (reasoning, sources, log-probabilities) in responses"),
    ("top_logprobs", (None,), "no log-probabilities in responses; use /v1/chat/completions"),
    ("background", (None, False), "no background responses"),
)


def refuse_unsupported(req: BaseModel, fields: tuple = _UNSUPPORTED) -> None:
    """RequestError for an OpenAI field Magnetar does not implement (of ``fields``: the generation endpoints' by
    default), set to something else than its default."""
    for name, allowed, why in fields:
        value = getattr(req, name, None)
        if not any(value is a or (value == a and type(value) is type(a)) for a in allowed):
            raise RequestError(f"{name}={show(value)} is not supported by Magnetar ({why}); leave it out", name)


_UNION_TAGS = ("str", "int", "float", "bool", "list", "message", "function_call", "function_call_output")


def _param(loc: tuple) -> Optional[str]:
    """``("messages", 0, "content")`` -> ``"messages[0].content"``; the type tags pydantic adds under a union
    (``"str"``, ``"list[str]"``, a Responses input item's kind) are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part in _UNION_TAGS or isinstance(part, str) and "[" in part:
            continue
        elif isinstance(part, str) and part.isidentifier():
            out += f".{part}" if out else part
        else:
            break
    return out or None


def parse_body(model: type[BaseModel], body: bytes) -> BaseModel:
    """``body`` (the raw request body) as ``model``; a RequestError naming the field on any problem."""
    if not body.strip():
        raise RequestError("the request body is empty; send a JSON object", None)
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        first = errors[0]
        if first["type"] == "json_invalid":
            raise RequestError(f"the body is not valid JSON ({first['msg']})", None) from None
        full = _param(first["loc"])
        deeper = [err for err in errors if (_param(err["loc"]) or "").startswith(f"{full}[") and
                  any("tagged-union" in str(part) for part in err["loc"])]
        if first["type"].endswith("_type") and deeper:  # text or a list of tagged items (Responses' input): the
            # list's error names its item
            first, full = deeper[0], _param(deeper[0]["loc"])
        same = [err for err in errors if _param(err["loc"]) == full]
        param = full if full is None or len(full) <= 100 else full[:97] + "..."  # a client's field name may be huge
        msgs = list(dict.fromkeys(_message(err) for err in same))
        where = param or "the body"
        raise RequestError(f"{where}: {' or '.join(msgs)}", param) from None


def _message(err: dict) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return "unknown field (not part of the API; Magnetar's own options go in the 'magnetar' object)"
    if kind == "missing":
        return "field required"
    got = err.get("input")
    shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{err['msg'].lower()} (got {shown})"


# -- responses -------------------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]  # None when the answer is only tool calls
    tool_calls: Optional[list[dict[str, Any]]] = None  # [{"id", "type": "function", "function": {"name", "arguments"}}]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Optional[str]
    logprobs: Optional[dict[str, Any]] = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    magnetar: Optional[dict[str, Any]] = None  # how each prompt was cut into the two phases (docs/serving.md)


class Delta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # [{"index", "id", "type", "function": {"name", "arguments"}}]


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Optional[str] = None
    logprobs: Optional[dict[str, Any]] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Optional[Usage] = None
    magnetar: Optional[dict[str, Any]] = None  # in the usage chunk


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Optional[str] = None
    logprobs: Optional[dict[str, Any]] = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None
    magnetar: Optional[dict[str, Any]] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "magnetar"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ContextObject(BaseModel):
    """A context encoded by ``POST /v1/contexts``: pass ``"magnetar": {"context_id": id}`` to use it."""

    id: str
    object: Literal["context"] = "context"
    created: int
    model: str
    format: Literal["chat", "raw"]
    tokens: int
    deleted: bool = False


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


# finish reasons: the engine's stop reasons -> OpenAI's
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "grammar": "stop", "max_new_tokens": "length"}
