"""An OpenAI-compatible HTTP server over the engine (``magnetar serve``, ``python -m magnetar.serve``).

* :mod:`magnetar.serve.protocol` -- the OpenAI wire format (pydantic) and its errors;
* :mod:`magnetar.serve.prompts` -- requests -> Phase-1 context ids, Phase-2 query ids, sampling parameters;
* :mod:`magnetar.serve.ticks` -- the tick the serving rank broadcasts to its replica before each step;
* :mod:`magnetar.serve.loop` -- the lockstep engine loop every rank runs;
* :mod:`magnetar.serve.app` -- FastAPI endpoints and server-sent events (the serving rank only);
* :mod:`magnetar.serve.metrics` -- Prometheus metrics;
* :mod:`magnetar.serve.server` -- one replica's server; :mod:`magnetar.serve.cli` -- the command line.

Nothing is imported here: the command line reports a missing ``serve`` extra (FastAPI, uvicorn,
prometheus_client) itself. docs/serving.md describes the server.
"""
