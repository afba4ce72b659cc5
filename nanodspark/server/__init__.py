"""The server room: an OpenAI-compatible HTTP server around one `LLMEngine` (walkthrough chapter 08).

The idea
--------
Everything that serves requests over HTTP, and nothing the engine needs: the engine (the core,
`nanodspark/*.py`) never imports this package. Four files, each readable on its own:

* `app.py`: **the handlers** (`OpenAIServer`, on the asyncio event loop), the input limits (body
  size, prompt length, context) and the worker threads that parse and tokenize bodies,
  `create_app` (routes, error handlers, the metrics middleware) and `HTTPServer` (uvicorn, with
  abort-on-shutdown).
* `engine_loop.py`: **the engine thread** (`EngineLoop`), the only caller of the engine while
  serving; each request's outputs go to its own asyncio queue (`Handle`).
* `openai_api.py`: **the OpenAI shapes** as plain functions: `parse_json_body`, `parse_sampling`,
  `check_context`, `get_field`, `message_text`, `usage_of`, `sse_event`, and the errors
  (`APIError`, `bad_request`).
* `metrics.py`: **Prometheus metrics** (`Metrics`), fed by the engine thread.

`serve.py` at the top of the repository is the command line: `create_app(engine)` and
`HTTPServer(app).run()`.

Invariants
----------
* The names below are the server's public names: import them from `nanodspark.server`.
* Importing this package needs the `serve` extra (fastapi, uvicorn, prometheus_client).
"""
from .app import DEFAULT_MAX_BODY_BYTES, DEFAULT_PREPARE_THREADS, HTTPServer, OpenAIServer, create_app
from .engine_loop import ACCEPTED, EngineLoop, Handle
from .metrics import Metrics
from .openai_api import (APIError, bad_request, check_context, get_field, message_text, parse_json_body,
                         parse_sampling, sse_event, usage_of)

__all__ = ["ACCEPTED", "APIError", "DEFAULT_MAX_BODY_BYTES", "DEFAULT_PREPARE_THREADS", "EngineLoop", "HTTPServer",
           "Handle", "Metrics", "OpenAIServer", "bad_request", "check_context", "create_app", "get_field",
           "message_text", "parse_json_body", "parse_sampling", "sse_event", "usage_of"]
