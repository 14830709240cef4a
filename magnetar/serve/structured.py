"""Structured outputs over HTTP: OpenAI's ``response_format`` as the engine's grammar (:mod:`magnetar.engine.grammar`,
llguidance). ``{"type": "text"}`` (or none): free text; ``{"type": "json_object"}``: any JSON object;
``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``: JSON that validates
against the schema (what ``client.chat.completions.parse(response_format=PydanticModel)`` sends). The JSON is
compact (no free whitespace between tokens: a small model cannot spend its answer on spaces). A schema llguidance
cannot compile is a 400 naming ``response_format`` with its message (the schema's path).

Chat and text completions also take vLLM's extras, in the ``magnetar`` object: ``"regex"`` (the answer matches
it), ``"choice"`` (the answer is one of these strings), ``"grammar"`` (a Lark grammar, llguidance's dialect) -- one
structured output per request."""
from __future__ import annotations

import json
from typing import Any, Optional

from magnetar.serve.protocol import RequestError, show

MAX_SCHEMA_BYTES = 256 * 1024  # a response_format's schema as JSON, at most
MAX_SCHEMA_DEPTH = 32  # its nesting, at most


EXTRAS = ("regex", "choice", "grammar")  # the magnetar object's structured outputs (vLLM's names)
MAX_CHOICES = 1024


def structured(response_format: Optional[dict[str, Any]], options: Optional[dict[str, Any]]) -> tuple:
    """``(llguidance grammar, the request field it came from)`` of a request -- its ``response_format`` or one of
    the ``magnetar`` object's :data:`EXTRAS` -- or ``(None, None)`` for free text; RequestError naming the field."""
    given = [name for name in EXTRAS if (options or {}).get(name) is not None]
    fmt = grammar_of(response_format)
    if len(given) + (fmt is not None) > 1:
        named = [f"magnetar.{n}" for n in given] + (["response_format"] if fmt is not None else [])
        raise RequestError(f"give one structured output per request, got {', '.join(named)}", named[-1])
    if fmt is not None:
        return fmt, "response_format"
    if not given:
        return None, None
    name = given[0]
    value, param = options[name], f"magnetar.{name}"
    llg = _llguidance(param)
    if name == "choice":
        if not isinstance(value, list) or not value or len(value) > MAX_CHOICES or \
                not all(isinstance(c, str) and c for c in value):
            raise RequestError(f"{param} must be a list of 1..{MAX_CHOICES} non-empty strings, got {show(value)}",
                               param)
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value)), param
    if not isinstance(value, str) or not value or len(value) > MAX_SCHEMA_BYTES:
        raise RequestError(f"{param} must be a non-empty string of at most {MAX_SCHEMA_BYTES} characters, got "
                           f"{show(value)}", param)
    if name == "regex":
        return llg.LLMatcher.grammar_from_regex(value), param
    return llg.LLMatcher.grammar_from_lark(value), param


def grammar_of(response_format: Optional[dict[str, Any]]) -> Optional[str]:
    """The llguidance grammar of a request's ``response_format`` (None: free text); RequestError naming the field."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text" and set(response_format) == {"type"}:
        return None
    if kind == "json_object" and set(response_format) == {"type"}:
        return _json_grammar({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict) or \
                set(response_format) != {"type", "json_schema"}:
            raise RequestError("response_format.json_schema must be an object {\"name\": ..., \"schema\": {...}, "
                               "\"strict\": ...}", "response_format.json_schema")
        schema = spec.get("schema", {"type": "object"})
        check_bounds(schema, "response_format.json_schema.schema")
        return _json_grammar(schema)
    raise RequestError(f"response_format {show(response_format)}: give {{\"type\": \"text\"}}, {{\"type\": "
                       f"\"json_object\"}} or {{\"type\": \"json_schema\", \"json_schema\": {{...}}}}",
                       "response_format")


def _llguidance(param: str):
    try:
        import llguidance
    except ImportError as e:
        raise RequestError(f"{param} needs the llguidance package on the server ({e}): pip install "
                           f"'magnetar[serve]'", param, status=501) from None
    return llguidance


def _json_grammar(schema: dict) -> str:
    return _llguidance("response_format").LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults={"whitespace_flexible": False})


def check_bounds(schema: Any, param: str) -> None:
    """The schema's size and nesting are bounded (a hostile schema must not cost the server its compile time)."""
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise RequestError(f"{param} is over {MAX_SCHEMA_BYTES} bytes as JSON; send a smaller schema", param)
    stack = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise RequestError(f"{param} nests deeper than {MAX_SCHEMA_DEPTH} levels; flatten it", param)
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((c, depth + 1) for c in children)
