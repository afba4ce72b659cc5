"""The API users expect, through the official `openai` client and httpx.

* Parameters this server does not honour are refused with a 400 in OpenAI's shape naming the
  field (`min_p` unless 0, `repetition_penalty` unless 1, `response_format` other than text,
  unknown fields), and accepted at their neutral value.
* `--api-key`: 401 in the OpenAI shape without the key or with a wrong one, 200 with it, on
  every /v1 route; /health, /metrics, /version, /tokenize, /detokenize open.
* `/version`, `/tokenize` (a prompt or a chat, vLLM's shape) and `/detokenize` round-trip.
* `serve.py`: a positional model, vLLM's flag spellings as aliases, the API key from the
  environment, a busy port refused before anything loads, the start-up summary's facts.
"""
import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from nanodspark.config import EngineConfig
from nanodspark.engine import LLMEngine
from nanodspark.server import EngineInfo, create_app
from test_server import MODEL, ServerThread, _load_serve, kv_used, wait_idle

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-test-1234"


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return LLMEngine(str(tiny_dir), EngineConfig(use_tqdm=False))


@pytest.fixture(scope="module")
def keyed(engine):
    srv = ServerThread(create_app(engine, model_name=MODEL, api_key=KEY)).start()
    yield srv
    srv.stop()


@pytest.fixture()
def client(keyed):
    with openai.OpenAI(base_url=keyed.base + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


# ----------------------------------------------------------------------------- refusals (item 4)
REFUSED = [
    ("min_p", {"min_p": 0.1}), ("repetition_penalty", {"repetition_penalty": 1.2}),
    ("response_format", {"response_format": {"type": "json_object"}}),
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}),
    ("frobnicate", {"frobnicate": True}), ("min_tokens", {"min_tokens": 3}),
    ("logit_bias", {"logit_bias": {"5": 10}}), ("presence_penalty", {"presence_penalty": 0.5}),
]


@pytest.mark.parametrize("param,extra", REFUSED)
def test_unsupported_parameters_get_400_naming_the_field(client, param, extra):
    for create, kw in ((client.completions.create, dict(prompt="hi")),
                       (client.chat.completions.create, dict(messages=[{"role": "user", "content": "hi"}]))):
        with pytest.raises(openai.BadRequestError) as e:
            create(model=MODEL, max_tokens=2, extra_body=extra, **kw)
        err = e.value.body
        assert e.value.status_code == 400 and err["param"] == param and err["type"] == "invalid_request_error", err
        assert param in err["message"] or "response_format" in err["message"], err


def test_neutral_values_are_accepted(client, keyed):
    neutral = {"min_p": 0, "repetition_penalty": 1, "response_format": {"type": "text"}, "presence_penalty": 0,
               "frequency_penalty": 0, "n": 1, "user": "someone"}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       temperature=0, extra_body=neutral)
    assert r.choices[0].finish_reason in ("stop", "length")
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                           temperature=0)
    assert r.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:   # an end-user id is a string
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, user=5)
    assert e.value.body["param"] == "user"
    with pytest.raises(openai.BadRequestError) as e:   # completions read a prompt, not messages
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"messages": []})
    assert e.value.body["param"] == "messages" and e.value.body["code"] == "unknown_field"
    s = wait_idle(keyed.base)
    assert all(v == 0 for v in kv_used(s).values())


# ----------------------------------------------------------------------------- the API key (item 8)
def test_api_key_guards_every_v1_route_and_nothing_else(keyed):
    routes = [("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
              ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
              ("GET", "/v1/models", None), ("POST", "/v1/nothing", {})]
    with httpx.Client(base_url=keyed.base, timeout=30) as h:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
            for method, path, body in routes:
                r = h.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (headers, path, r.text)
                err = r.json()["error"]
                assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error" and err["message"]
        good = {"Authorization": f"Bearer {KEY}"}
        for method, path, body in routes[:3]:
            assert h.request(method, path, json=body, headers=good).status_code == 200, path
        assert h.post("/v1/nothing", json={}, headers=good).status_code == 404
        for path in ("/health", "/metrics", "/version"):
            assert h.get(path).status_code == 200, path
        assert h.post("/tokenize", json={"prompt": "hi"}).status_code == 200
    with openai.OpenAI(base_url=keyed.base + "/v1", api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.models.list()


# ----------------------------------------------------------------------------- version, tokenize (item 8)
def test_version_tokenize_and_detokenize(keyed, engine):
    tok = engine.tokenizer
    with httpx.Client(base_url=keyed.base, timeout=30) as h:
        v = h.get("/version").json()
        assert set(v) == {"version"} and v["version"]
        text = "Grüße, 日本 😀 and more"
        r = h.post("/tokenize", json={"model": MODEL, "prompt": text}).json()
        assert r == {"count": len(tok.encode(text)), "max_model_len": 1024, "tokens": tok.encode(text), "token_strs": None}
        r = h.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
        assert r["tokens"] == tok.encode(text) and len(r["token_strs"]) == r["count"]
        assert h.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": text}
        messages = [{"role": "user", "content": "hi there"}]
        r = h.post("/tokenize", json={"messages": messages}).json()
        assert r["tokens"] == tok.encode(tok.apply_chat_template(messages))
        assert h.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == tok.apply_chat_template(messages)
        r = h.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
        assert r["tokens"] == tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False))
        for path, body, param in (("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 5}, "prompt"),
                                  ("/tokenize", {"prompt": "a", "messages": []}, "prompt"),
                                  ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus"),
                                  ("/detokenize", {"tokens": "abc"}, "tokens"),
                                  ("/detokenize", {"tokens": [1, 10 ** 7]}, "tokens"),
                                  ("/tokenize", {"prompt": "a", "model": "other"}, "model")):
            r = h.post(path, json=body)
            assert 400 <= r.status_code < 500 and r.json()["error"]["param"] == param, (path, body, r.text)


def test_small_bodies_are_prepared_on_the_event_loop_large_ones_in_a_worker(engine):
    """`prepare_inline_bytes` decides where a body's work runs: a body up to it on the event
    loop's thread (no thread hop), a larger one in a worker thread (the loop keeps serving)."""
    import threading

    from nanodspark.server.app import OpenAIServer

    class Body:
        def __init__(self, raw):
            self.raw, self.headers = raw, {"content-length": str(len(raw))}

        async def stream(self):
            yield self.raw

    server = OpenAIServer(engine, MODEL, prepare_inline_bytes=64)
    server._refuse_if_closed = lambda: None       # its engine loop is not started here
    where = []

    def work(raw):
        where.append(threading.current_thread() is threading.main_thread())
        return len(raw)

    async def main():
        return [await server._prepare(Body(b"x" * n), work) for n in (10, 64, 65, 5000)]
    try:
        assert asyncio.run(main()) == [10, 64, 65, 5000]
    finally:
        server.pool.shutdown()
    assert where == [True, True, False, False] and server.held_body_bytes == 0
    with pytest.raises(ValueError):
        OpenAIServer(engine, MODEL, prepare_inline_bytes=-1)


def test_the_stream_response_sends_events_and_ends_when_the_client_leaves():
    """`_Stream`, the lean SSE response: the events go out as body chunks after an event-stream
    head and a closing empty chunk; a client that disconnects ends the events through
    `on_disconnect` (no chunk after it); `on_close` runs once either way."""
    from nanodspark.server.app import _Stream

    async def run(leave: bool):
        queue, sent, closed = asyncio.Queue(), [], []
        for x in ("data: 1\n\n", "data: 2\n\n"):
            queue.put_nowait(x)
        gone = asyncio.Event()

        async def events():
            while (item := await queue.get()) is not None:
                yield item

        async def receive():
            if leave:
                await asyncio.sleep(0.05)           # after the queued events went out
                return {"type": "http.disconnect"}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if not leave and len(sent) == 3:
                queue.put_nowait(None)              # the stream's own end

        stream = _Stream(events(), lambda: closed.append(1), lambda: queue.put_nowait(None))
        await asyncio.wait_for(stream(None, receive, send), 5)
        return sent, closed

    for leave in (False, True):
        sent, closed = asyncio.run(run(leave))
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
        assert dict(sent[0]["headers"])[b"content-type"].startswith(b"text/event-stream")
        assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n", b"data: 2\n\n", b""]
        assert sent[-1]["more_body"] is False and closed == [1]


def test_the_startup_summary_says_what_runs(engine):
    info = EngineInfo.of(engine, load_seconds=1.25)
    text = "\n".join(info.summary())
    kv = engine.scheduler.managers["full"].num_blocks
    on_cpu = engine.device.type == "cpu"       # on the device: bf16 on cuda, with graphs
    for want in (f"dtype {'float32' if on_cpu else 'bfloat16'}, device {engine.device}, context 1024 tokens",
                 "drafter: none", f"{kv} blocks of 16 tokens", f"{kv * 16:,} tokens",
                 f"maximum concurrency for 1024-token requests: {kv * 16 / 1024:.2f}x",
                 "CUDA graphs: none" if on_cpu else f"CUDA graphs: {info.graphs} captured", "engine ready in 1.2"):
        assert want in text, (want, text)


# ----------------------------------------------------------------------------- serve.py (items 6, 8)
def test_serve_cli_takes_a_positional_model_and_vllm_spellings():
    serve = _load_serve()
    ap = serve.build_parser()
    args = ap.parse_args(["/some/model", "--enable-prefix-caching", "--enforce-eager", "--gpu-memory-utilization",
                          "0.7", "--api-key", "k"])
    cfg = serve.engine_config(args)
    assert args.model_tag == "/some/model" and args.api_key == "k"
    assert (cfg.enable_prefix_cache, cfg.cuda_graphs, cfg.kv_memory_fraction) == (True, False, 0.7)
    cfg = serve.engine_config(ap.parse_args(["--no-enable-prefix-caching"]))
    assert cfg.enable_prefix_cache is False and cfg.cuda_graphs is True
    with pytest.raises(SystemExit):
        serve.main(["/a", "--model", "/b"])      # the model given twice, differently


def test_serve_refuses_a_busy_port_before_loading(tiny_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, str(ROOT / "serve.py"), str(tiny_dir), "--port", str(port)],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
        took = time.monotonic() - t0
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in p.stderr and "--port" in p.stderr, p.stderr
    assert "loading" not in p.stderr and "engine ready" not in p.stderr + p.stdout
    assert took < 60


def test_serve_reads_the_api_key_from_the_environment(monkeypatch):
    serve = _load_serve()
    ap = serve.build_parser()
    assert serve.API_KEY_ENV == "NANODSPARK_API_KEY"
    monkeypatch.delenv(serve.API_KEY_ENV, raising=False)
    assert serve.api_key_of(ap.parse_args([])) is None
    monkeypatch.setenv(serve.API_KEY_ENV, "from-env")
    assert serve.api_key_of(ap.parse_args([])) == "from-env"
    assert serve.api_key_of(ap.parse_args(["--api-key", "flag"])) == "flag"      # the flag wins
    assert "Authorization: Bearer k" in serve.curl_example("http://x", "m", "k")
