"""The server room: an OpenAI-compatible HTTP server around one `LLMEngine` (walkthrough chapter 08).

The idea
--------
Everything that serves requests over HTTP, and nothing the engine needs: the engine (the core,
`nanodspark/*.py`) never imports this package. Seven files, each readable on its own:

* `app.py`: **the handlers** (`OpenAIServer`, on the asyncio event loop), the input limits (body
  size, prompt length, context), the API key, the worker threads that parse and tokenize bodies,
  `create_app` (routes, error handlers, the metrics middleware) and `HTTPServer` (uvicorn, with
  abort-on-shutdown).
* `outputs.py`: **the API side of a request** (`Handle`, `OutputProcessor`): token ids in; text,
  stop strings, metrics and each request's asyncio queue out.
* `engine_loop.py`: **the engine side** (`EngineLoop`), the only caller of the engine while
  serving, token ids in and out (`StepOutputs`); in a thread, or in the engine core.
* `core.py`: **the engine-core process** (`run_core`) and the API process's handle on it
  (`CoreClient`, a `CoreLink`): `serve.py` runs the engine there, apart from HTTP and text.
* `api_servers.py`: **several API processes** on that one core (`serve.py --api-server-count N`).
* `openai_api.py`: **the OpenAI shapes** as plain functions: `parse_json_body`, `check_fields`,
  `parse_sampling`, `check_context`, `get_field`, `message_text`, `usage_of`, `sse_event`, and
  the errors (`APIError`, `bad_request`).
* `metrics.py`: **Prometheus metrics** (`Metrics`), fed by the `OutputProcessor`.

`serve.py` at the top of the repository is the command line: `CoreClient(model, config)`, then
`create_app(core)` and `HTTPServer(app).run()`.

Invariants
----------
* The names below are the server's public names: import them from `nanodspark.server`.
* Importing this package needs the `serve` extra (fastapi, uvicorn, prometheus_client).
"""
from .app import DEFAULT_MAX_BODY_BYTES, DEFAULT_PREPARE_THREADS, HTTPServer, OpenAIServer, create_app
from .core import CoreClient, CoreLink, CoreStartError
from .engine_loop import EngineInfo, EngineLoop, EngineState, StepOutputs
from .metrics import Metrics
from .openai_api import (APIError, bad_request, check_context, check_fields, get_field, message_text,
                         parse_json_body, parse_sampling, sse_event, usage_of)
from .outputs import ACCEPTED, Handle, OutputProcessor

__all__ = ["ACCEPTED", "APIError", "CoreClient", "CoreLink", "CoreStartError", "DEFAULT_MAX_BODY_BYTES", "DEFAULT_PREPARE_THREADS",
           "EngineInfo", "EngineLoop", "EngineState", "HTTPServer", "Handle", "Metrics", "OpenAIServer",
           "OutputProcessor", "StepOutputs", "bad_request", "check_context", "check_fields", "create_app", "get_field",
           "message_text", "parse_json_body", "parse_sampling", "sse_event", "usage_of"]
