"""The answer to a request no route takes -- an unknown path (404), a method its path does not take (405) -- in
OpenAI's error body, for the server's app and the front port's alike: a 405's ``Allow`` names every method some
route takes at the path (Starlette's names the first matching route's alone)."""
from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.routing import Match

from magnetar.serve.protocol import error_body


def allowed_methods(app, scope) -> list[str]:
    """The methods some route of ``app`` takes at the request's path (``scope``): a 405's ``Allow``."""
    methods: set[str] = set()
    for route in app.routes:
        if route.matches(scope)[0] != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


def http_error(app, request, exc) -> JSONResponse:
    """``exc`` (Starlette's HTTPException: a 404, a 405) as OpenAI's error body."""
    headers = getattr(exc, "headers", None)
    if exc.status_code == 405:
        headers = {k: v for k, v in (headers or {}).items() if k.lower() != "allow"}
        headers["allow"] = ", ".join(allowed_methods(app, request.scope))
    return JSONResponse(error_body(f"{exc.detail}: {request.method} {request.url.path[:200]}", None,
                                   "invalid_request_error"), status_code=exc.status_code, headers=headers)
