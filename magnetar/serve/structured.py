"""Structured outputs over HTTP: OpenAI's ``response_format`` as the engine's grammar (:mod:`magnetar.engine.grammar`,
llguidance). ``{"type": "text"}`` (or none): free text; ``{"type": "json_object"}``: any JSON object;
``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``: JSON that validates
against the schema (what ``client.chat.completions.parse(response_format=PydanticModel)`` sends). The JSON is
compact (no free whitespace between tokens: a small model cannot spend its answer on spaces). A schema llguidance
cannot compile is a 400 naming ``response_format`` with its message (the schema's path)."""
from __future__ import annotations

import json
from typing import Any, Optional

from magnetar.serve.protocol import RequestError, show

MAX_SCHEMA_BYTES = 256 * 1024  # a response_format's schema as JSON, at most
MAX_SCHEMA_DEPTH = 32  # its nesting, at most


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
        _check_bounds(schema, "response_format.json_schema.schema")
        return _json_grammar(schema)
    raise RequestError(f"response_format {show(response_format)}: give {{\"type\": \"text\"}}, {{\"type\": "
                       f"\"json_object\"}} or {{\"type\": \"json_schema\", \"json_schema\": {{...}}}}",
                       "response_format")


def _json_grammar(schema: dict) -> str:
    try:
        import llguidance
    except ImportError as e:
        raise RequestError(f"response_format needs the llguidance package on the server ({e}): pip install "
                           f"'magnetar[serve]'", "response_format", status=501) from None
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                          defaults={"whitespace_flexible": False})


def _check_bounds(schema: Any, param: str) -> None:
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
