"""The OpenAI request and response shapes, with no thread and no app (walkthrough chapter 08).

The idea
--------
Everything the server knows about the OpenAI API as *data* lives here: how the bytes of a body
become a checked JSON object (`parse_json_body`, `check_json`), how that object becomes
validated `SamplingParams` (`parse_sampling`, field by field with `get_field`), how a chat
message becomes `{role, content}` (`message_text`), when a prompt and its `max_tokens` do not fit
the context (`check_context`), and how answers and errors are written back (`usage_of`,
`sse_event`, `APIError`, `bad_request`), and which fields a request may hold at all (`FIELDS`,
`check_fields`). These are plain functions of their arguments, so they
can be read and tested without a server, an engine or an event loop; `app.py` calls them from
its handlers (in a worker thread), and `engine_loop.py` hands `APIError`s to the handlers when
the engine refuses or fails a request.

Validation is written by hand (`get_field`, `parse_sampling`, `message_text`), not with pydantic
models: we want the OpenAI error shape and a message that names the field, and a few explicit
lines are easier to read than a schema with custom error handlers (chapter 08, section 6).

Invariants
----------
* Errors have the OpenAI shape `{"error": {"message", "type", "param", "code"}}`. An error about
  a field names it in `param` (the top-level field: `"messages"` for `messages[2].content`);
  only errors about the body as a whole (not JSON, not an object, too large) have `param` null.
* A body that parses is also checked as a whole before any field is read: at most
  `MAX_JSON_DEPTH` levels of nesting, and no lone surrogate (`"\\ud800"`) in any string or key,
  since such a string is not text and cannot be tokenized or encoded as UTF-8.
* Error messages quote client values only through `preview` (short, ASCII), and error bodies
  are written with ASCII escapes, so writing an error can never fail.
* A `bool` is refused where a number is expected, although Python counts it as one:
  `"max_tokens": true` is a client bug.
* A field we do not read is refused with a 400 naming it, never silently ignored: `FIELDS` is
  the one list per endpoint; `NEUTRAL_ONLY` fields (`n`, `best_of`, `echo`, `logprobs`, the
  penalties, `min_p`, `repetition_penalty`, `logit_bias`, `suffix`, `tools`, `response_format`)
  are accepted only at their neutral value.
"""
from __future__ import annotations

import json
import math

from fastapi.responses import JSONResponse

from ..sampling import SamplingParams

MAX_JSON_DEPTH = 32       # nesting levels of a request body; the API itself needs 5
MAX_STOP_STRINGS = 16     # the engine checks every stop string after every step of its request
MAX_STOP_CHARS = 256      # a stream holds back len(stop) - 1 characters, so stops stay short


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
        return _ASCIIJSONResponse(self.body(), status_code=self.status)


class _ASCIIJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: encodable whatever the message holds."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 in the OpenAI shape; `param` names the offending field."""
    return APIError(400, message, param=param, code=code)


def preview(v, limit: int = 40) -> str:
    """A short ASCII rendering of a client's value for an error message (never the whole value)."""
    if isinstance(v, str):
        return json.dumps(v[:limit] + ("..." if len(v) > limit else ""))
    if isinstance(v, list):
        return f"a list of {len(v)} item{'s' * (len(v) != 1)}"
    if isinstance(v, dict):
        return f"an object with {len(v)} key{'s' * (len(v) != 1)}"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return json.dumps(v)[:limit]


# ----------------------------------------------------------------------------- the body as a whole
def parse_json_body(raw: bytes) -> dict:
    """The bytes of a request body -> a JSON object that `check_json` accepts, or a 400."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request(f"the request body nests too deeply to parse (at most {MAX_JSON_DEPTH} levels "
                          "are accepted)", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_json(body)
    return body


def _where(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return (out if len(out) <= 60 else out[:57] + "...") or "the body"


def _surrogate_at(s: str) -> int | None:
    """Index of the first lone surrogate in `s`, or None (an ASCII string is checked in O(1))."""
    if s.isascii():
        return None
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def check_json(body: dict) -> None:
    """Refuse (400) a body nested deeper than `MAX_JSON_DEPTH` or holding a lone surrogate in a
    string or a key. Iterative, so no depth can overflow the interpreter's stack here."""
    stack = [(body, 1, ())]
    while stack:
        obj, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels (at {_where(path)})",
                              _top(path), code="invalid_json")
        if isinstance(obj, dict):
            for k in obj:
                if not k.isascii():
                    _refuse_surrogate(k, path, key=True)
            items = obj.items()
        else:
            items = enumerate(obj)
        for k, v in items:
            if isinstance(v, str):
                if not v.isascii():
                    _refuse_surrogate(v, path + (k,))
            elif isinstance(v, (dict, list)):
                stack.append((v, depth + 1, path + (k,)))


def _top(path: tuple) -> str | None:
    return path[0] if path and isinstance(path[0], str) else None


def _refuse_surrogate(s: str, path: tuple, key: bool = False) -> None:
    i = _surrogate_at(s)
    if i is not None:
        what = f"a key of {_where(path)}" if key else _where(path)
        raise bad_request(f"{what} is not valid Unicode: character {i} is a lone surrogate (U+{ord(s[i]):04X}); "
                          "a JSON string must hold text, with a surrogate escape only as half of a pair",
                          _top(path), code="invalid_unicode")


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
        raise bad_request(f"'{name}' must be {what}, got {preview(v)}", name)
    return v


# ----------------------------------------------------------------------------- the accepted fields
# The one list of what a request may hold. A field not listed for its endpoint is refused (400,
# `param` naming it), never ignored. A field of NEUTRAL_ONLY is accepted only at its neutral
# value (n=1, min_p=0, ...): to support one, read it in parse_sampling and move it to SAMPLING.
SAMPLING = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "stop", "seed", "ignore_eos")


def _off(v) -> bool:
    return not v


NEUTRAL_ONLY = {   # field: (its JSON kind, None = any; accepted values; why the others are refused)
    "n": ("int", lambda v: v == 1, "only n=1 is supported"),
    "best_of": ("int", lambda v: v == 1, "best_of is not supported"),
    "echo": (None, _off, "echo is not supported"),
    "logprobs": (None, _off, "logprobs are not supported"),
    "top_logprobs": (None, _off, "logprobs are not supported"),
    "presence_penalty": ("number", lambda v: v == 0, "presence_penalty is not supported (only 0)"),
    "frequency_penalty": ("number", lambda v: v == 0, "frequency_penalty is not supported (only 0)"),
    "repetition_penalty": ("number", lambda v: v == 1, "repetition_penalty is not supported (only 1, no penalty)"),
    "min_p": ("number", lambda v: v == 0, "min_p is not supported (only 0, off)"),
    "logit_bias": (None, _off, "logit_bias is not supported"),
    "suffix": (None, _off, "suffix is not supported"),
    "tools": (None, _off, "tools are not supported"),
    "functions": (None, _off, "tools are not supported"),
    "response_format": ("dict", lambda v: v == {"type": "text"},
                        'only response_format {"type": "text"} is supported: JSON mode and JSON schemas '
                        "(constrained decoding) are not implemented"),
}
_GENERATE = ("model", "stream", "stream_options", "user") + SAMPLING + tuple(NEUTRAL_ONLY)
FIELDS = {
    "completions": _GENERATE + ("prompt",),
    "chat": _GENERATE + ("messages",),
    "tokenize": ("model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs"),
    "detokenize": ("model", "tokens"),
}


def check_fields(body: dict, endpoint: str) -> None:
    """400 for a field this endpoint does not read (`FIELDS`), naming it."""
    allowed = FIELDS[endpoint]
    for name in body:
        if name not in allowed:
            raise bad_request(f"unknown field {preview(name)}: this server does not read it, and refuses it rather "
                              f"than ignore it (accepted: {', '.join(allowed)})", name, code="unknown_field")
    get_field(body, "user", "str")      # an end-user id: accepted, not used


def _reject_unsupported(body: dict) -> None:
    for name, (kind, neutral, why) in NEUTRAL_ONLY.items():
        v = get_field(body, name, kind) if kind else body.get(name)
        if v is not None and not neutral(v):
            if name == "response_format" and "type" in v:
                raise bad_request(f"{why}; got response_format.type={preview(v['type'])}", name)
            raise bad_request(f"{why}; got {name}={preview(v)}", name)


def requested_max_tokens(body: dict) -> tuple[str, int] | None:
    """(field name, value) of the client's own output limit, or None if it gave none."""
    for name in ("max_tokens", "max_completion_tokens"):
        v = get_field(body, name, "int")
        if v is not None:
            return name, v
    return None


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' has {len(stop)} strings; at most {MAX_STOP_STRINGS} are accepted", "stop")
    for s in stop:
        if len(s) > MAX_STOP_CHARS:
            raise bad_request(f"a stop string has {len(s)} characters; at most {MAX_STOP_CHARS} are accepted",
                              "stop")
    return [s for s in stop if s]


def parse_sampling(body: dict, max_tokens_default: int) -> SamplingParams:
    """The OpenAI sampling fields (plus `top_k`, `ignore_eos`) -> validated `SamplingParams`.
    Every range is checked here, so that each error names its field; `validate()` stays the
    engine's own last word."""
    _reject_unsupported(body)
    given = requested_max_tokens(body)
    max_tokens = given[1] if given else max_tokens_default
    if max_tokens < 1:
        raise bad_request(f"{given[0] if given else 'max_tokens'} must be a positive integer, got {max_tokens}",
                          given[0] if given else "max_tokens")
    temperature = get_field(body, "temperature", "number", 1.0)
    if not 0 <= temperature <= 100:   # NaN fails both comparisons
        raise bad_request(f"'temperature' must be a number in [0, 100], got {preview(temperature)}", "temperature")
    top_p = get_field(body, "top_p", "number", 1.0)
    if not 0 < top_p <= 1:
        raise bad_request(f"'top_p' must be in (0, 1], got {preview(top_p)}", "top_p")
    top_k = get_field(body, "top_k", "int", 0)
    if top_k < -1:
        raise bad_request(f"'top_k' must be an integer >= 0 (0 or -1 = off), got {top_k}", "top_k")
    seed = get_field(body, "seed", "int")
    if seed is not None and not -2**63 <= seed < 2**64:
        raise bad_request("'seed' must fit in 64 bits", "seed")
    stop, ignore_eos = _stop_strings(body), get_field(body, "ignore_eos", "bool", False)
    try:                     # SamplingParams checks itself when built, as validate() does
        return SamplingParams(
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=0 if top_k == -1 else top_k,   # -1 is a common spelling of "off"
            max_tokens=max_tokens,
            stop=stop,
            seed=seed,
            ignore_eos=ignore_eos,
        ).validate()
    except ValueError as e:  # a rule the engine added that the lines above do not know yet
        first = str(e).split(" ", 1)[0].strip("'")
        raise bad_request(str(e), first if first in body else None) from None


def check_context(num_prompt: int, max_tokens: int, max_model_len: int, prompt_param: str,
                  max_tokens_param: str = "max_tokens") -> None:
    """400 (`code: context_length_exceeded`) unless prompt + max_tokens fit the context, with the
    arithmetic in the message, as OpenAI-style servers answer."""
    if num_prompt >= max_model_len:
        raise bad_request(f"this model's maximum context length is {max_model_len} tokens, and the prompt alone "
                          f"has {num_prompt} tokens (a request needs room for at least one new token); shorten "
                          "the prompt", prompt_param, code="context_length_exceeded")
    if num_prompt + max_tokens > max_model_len:
        raise bad_request(f"this model's maximum context length is {max_model_len} tokens; you requested "
                          f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt + {max_tokens} for "
                          f"{max_tokens_param}); set {max_tokens_param} to at most {max_model_len - num_prompt} or "
                          "shorten the prompt", max_tokens_param, code="context_length_exceeded")


def message_text(m, i: int) -> dict:
    """One chat message -> {role, content: str}; content may be a list of text parts."""
    if not isinstance(m, dict):
        raise bad_request(f"messages[{i}] must be an object", "messages")
    role, content = m.get("role"), m.get("content")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant"):
        raise bad_request(f"messages[{i}].role must be system, user or assistant, got {preview(role)}", "messages")
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


def sse_event(obj, ascii: bool = False) -> str:
    """One server-sent event carrying `obj` as compact JSON (`ascii`: escape non-ASCII, for errors)."""
    return f"data: {json.dumps(obj, ensure_ascii=ascii, separators=(',', ':'))}\n\n"
