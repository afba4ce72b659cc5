"""The OpenAI request and response shapes, with no thread and no app (walkthrough chapter 08).

The idea
--------
Everything the server knows about the OpenAI API as *data* lives here: how a JSON body becomes
validated `SamplingParams` (`parse_sampling`, field by field with `get_field`), how a chat
message becomes `{role, content}` (`message_text`), and how answers and errors are written back
(`usage_of`, `sse_event`, `APIError`, `bad_request`). These are plain functions of their
arguments, so they can be read and tested without a server, an engine or an event loop;
`app.py` calls them from its handlers, and `engine_loop.py` hands `APIError`s to the handlers
when the engine refuses or fails a request.

Validation is written by hand (`get_field`, `parse_sampling`, `message_text`), not with pydantic
models: we want the OpenAI error shape and a message that names the field, and a few explicit
lines are easier to read than a schema with custom error handlers (chapter 08, section 6).

Invariants
----------
* Errors have the OpenAI shape `{"error": {"message", "type", "param", "code"}}`; a bad request
  is a 400 whose `param` names the field when there is one.
* A `bool` is refused where a number is expected, although Python counts it as one:
  `"max_tokens": true` is a client bug.
* A field we do not support (`n > 1`, `best_of`, `echo`, `logprobs`, the penalties, `logit_bias`,
  `suffix`, `tools`) is refused with a 400, never silently ignored.
"""
from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from ..sampling import SamplingParams


# ----------------------------------------------------------------------------- errors
class APIError(Exception):
    """An error answered in the OpenAI shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 in the OpenAI shape; `param` names the offending field."""
    return APIError(400, message, param=param)


# ----------------------------------------------------------------------------- request parsing
_TYPES = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "number": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "bool": (lambda v: isinstance(v, bool), "a boolean"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
}


def get_field(body: dict, name: str, kind: str, default=None):
    """body[name] checked against `kind`; missing or null gives `default`."""
    v = body.get(name)
    if v is None:
        return default
    ok, what = _TYPES[kind]
    if not ok(v):
        raise bad_request(f"'{name}' must be {what}, got {json.dumps(v)[:60]}", name)
    return v


def _reject_unsupported(body: dict) -> None:
    n = get_field(body, "n", "int", 1)
    if n != 1:
        raise bad_request(f"only n=1 is supported, got n={n}", "n")
    if get_field(body, "best_of", "int", 1) != 1:
        raise bad_request("best_of is not supported", "best_of")
    if body.get("echo"):
        raise bad_request("echo is not supported", "echo")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise bad_request("logprobs are not supported", "logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if get_field(body, name, "number", 0) != 0:
            raise bad_request(f"{name} is not supported", name)
    if body.get("logit_bias"):
        raise bad_request("logit_bias is not supported", "logit_bias")
    if body.get("suffix"):
        raise bad_request("suffix is not supported", "suffix")
    if body.get("tools") or body.get("functions"):
        raise bad_request("tools are not supported", "tools")


def parse_sampling(body: dict, max_tokens_default: int) -> SamplingParams:
    """The OpenAI sampling fields (plus `top_k`, `ignore_eos`) -> validated `SamplingParams`."""
    _reject_unsupported(body)
    max_tokens = get_field(body, "max_tokens", "int")
    if max_tokens is None:
        max_tokens = get_field(body, "max_completion_tokens", "int", max_tokens_default)
    if max_tokens < 1:
        raise bad_request(f"max_tokens must be a positive integer, got {max_tokens}", "max_tokens")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    top_k = get_field(body, "top_k", "int", 0)
    seed = get_field(body, "seed", "int")
    if seed is not None and not -2**63 <= seed < 2**64:
        raise bad_request("'seed' must fit in 64 bits", "seed")
    params = SamplingParams(
        temperature=float(get_field(body, "temperature", "number", 1.0)),
        top_p=float(get_field(body, "top_p", "number", 1.0)),
        top_k=0 if top_k == -1 else top_k,   # -1 is a common spelling of "off"
        max_tokens=max_tokens,
        stop=[s for s in stop if s],
        seed=seed,
        ignore_eos=get_field(body, "ignore_eos", "bool", False),
    )
    try:
        return params.validate()
    except ValueError as e:
        raise bad_request(str(e)) from None


def message_text(m, i: int) -> dict:
    """One chat message -> {role, content: str}; content may be a list of text parts."""
    if not isinstance(m, dict):
        raise bad_request(f"messages[{i}] must be an object", "messages")
    role, content = m.get("role"), m.get("content")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant"):
        raise bad_request(f"messages[{i}].role must be system, user or assistant, got {json.dumps(role)[:40]}",
                          "messages")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"messages[{i}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")
    return {"role": role, "content": content}


# ----------------------------------------------------------------------------- responses
def usage_of(out) -> dict:
    """The OpenAI `usage` object of a `RequestOutput`, with the DSpark counters as `speculative`."""
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
            "total_tokens": out.num_prompt_tokens + out.num_output_tokens, "speculative": out.spec}


def sse_event(obj) -> str:
    """One server-sent event carrying `obj` as compact JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
