"""The OpenAI-compatible server, driven over real HTTP by the official `openai` client.

The server runs in-process (uvicorn in a background thread, on a socket bound to a free
loopback port) around a tiny random model (`tiny_dir`). What is checked:

* completions and chat, streaming and not, give exactly the offline `LLM.generate` greedy text,
  including 64 concurrent streams; `usage` carries token counts and the speculative stats;
* seeds reproduce, stop strings cut, the sampling knobs are accepted;
* malformed requests get a 4xx in the OpenAI error shape and the server keeps serving;
  a full server queue and a full engine queue give 429;
* a client that goes away (streaming or not) aborts its request and frees its KV blocks;
* a 300-request load ends with no errors and no leaked KV blocks, as `/metrics` reports, and
  `/metrics` parses with `prometheus_client`'s parser;
* `serve.py` builds its flags from `EngineConfig`, refuses a missing model naming `--model`, and
  shuts down cleanly on SIGTERM.
"""
import asyncio
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nanodspark import LLM, SamplingParams
from nanodspark.config import EngineConfig
from nanodspark.engine import LLMEngine
from nanodspark.server import HTTPServer, create_app

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
WORDS = ("the cat sat on a mat while seven ships sailed north past quiet harbours and old "
         "lighthouses under a grey sky full of rain").split()


# ----------------------------------------------------------------------------- helpers
class ServerThread:
    """`HTTPServer` (uvicorn) serving `app` from a background thread, on a bound loopback socket."""

    def __init__(self, app):
        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.server = HTTPServer(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2)
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[self.sock]), daemon=True)

    def start(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
        assert not self.thread.is_alive()


def scrape(base: str) -> dict:
    """/metrics -> {(sample name, frozenset(labels)): value}, through the official parser."""
    text = httpx.get(base + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def kv_used(samples: dict) -> dict:
    return {dict(lab)["group"]: v for (n, lab), v in samples.items()
            if n == "nanodspark_kv_blocks" and dict(lab).get("state") == "used"}


def wait_idle(base: str, timeout: float = 10.0) -> dict:
    """Poll /metrics until nothing runs, nothing waits and no KV block is used; return the scrape."""
    deadline = time.monotonic() + timeout
    while True:
        s = scrape(base)
        idle = (metric(s, "nanodspark_requests_running") == 0 and metric(s, "nanodspark_requests_waiting") == 0
                and kv_used(s) and all(v == 0 for v in kv_used(s).values()))
        if idle or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def make_prompt(i: int) -> str:
    rng = random.Random(i)
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))


# ----------------------------------------------------------------------------- fixtures
def start_server(model_dir, **engine_kw):
    """An engine on `model_dir`, its app, and a started server thread."""
    engine = LLMEngine(str(model_dir), EngineConfig(use_tqdm=False, **engine_kw))
    app = create_app(engine, model_name=MODEL)
    return engine, app, ServerThread(app).start()


@pytest.fixture(scope="module")
def served(tiny_dir):
    engine, app, srv = start_server(tiny_dir)
    yield srv
    srv.stop()
    loop = app.state.server.loop
    assert not loop._thread.is_alive(), "the engine thread was not joined"
    assert all(u["used"] == 0 for u in engine.kv_usage().values())
    assert not engine.requests, "finished requests were not released"


@pytest.fixture(scope="module")
def offline(tiny_dir):
    return LLM(str(tiny_dir), use_tqdm=False)


@pytest.fixture()
def client(served):
    with openai.OpenAI(base_url=served.base + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def greedy(max_tokens=8, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


# ----------------------------------------------------------------------------- tests
def test_models_health_and_metrics_parse(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(served.base + "/health").json() == {"status": "ok"}
    s = scrape(served.base)
    names = {n for n, _ in s}
    for want in ("nanodspark_requests_total", "nanodspark_prompt_tokens_total", "nanodspark_generation_tokens_total",
                 "nanodspark_time_to_first_token_seconds_bucket", "nanodspark_inter_token_latency_seconds_bucket",
                 "nanodspark_requests_running", "nanodspark_requests_waiting", "nanodspark_kv_blocks",
                 "nanodspark_spec_verify_steps_total", "nanodspark_spec_drafted_tokens_total",
                 "nanodspark_spec_verified_tokens_total", "nanodspark_spec_accepted_tokens_total",
                 "nanodspark_spec_committed_tokens_total", "nanodspark_spec_tau",
                 "nanodspark_spec_verify_window_tokens_bucket"):
        assert want in names, want
    assert set(kv_used(s)) == set(served.app.state.server.engine.kv_usage())


def test_completions_and_chat_match_offline(served, client, offline):
    tok = offline.tokenizer
    prompt = make_prompt(1)
    want = offline.generate(prompt, greedy())[0]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    u = r.usage
    assert u.prompt_tokens == len(tok.encode(prompt)) and u.completion_tokens == len(want.token_ids)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert set(u.speculative) >= {"steps", "drafted", "verified", "accepted", "committed", "tau"}

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert "speculative" in chunks[-1].usage.model_extra

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": make_prompt(2)}]
    want = offline.generate(tok.apply_chat_template(messages), greedy())[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.usage.completion_tokens == len(want.token_ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == want.text


def test_64_concurrent_streams_match_offline(served, offline):
    prompts = [make_prompt(100 + i) for i in range(64)]
    want = [o.text for o in offline.generate(prompts, greedy())]

    async def one(c, p):
        stream = await c.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0, stream=True)
        return "".join([ch.choices[0].text async for ch in stream if ch.choices])

    async def run():
        async with openai.AsyncOpenAI(base_url=served.base + "/v1", api_key="none", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    got = asyncio.run(run())
    assert got == want
    s = wait_idle(served.base)
    assert all(v == 0 for v in kv_used(s).values())


def test_seed_stop_and_sampling_knobs(served, client, offline):
    prompt = make_prompt(3)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=10, temperature=0.9, top_p=0.95, seed=1234,
              extra_body={"top_k": 50})
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b
    full = offline.generate(prompt, greedy(16, ignore_eos=True))[0].text
    stop = next((full[i:i + 2] for i in range(2, len(full) - 2) if full[i:i + 2].strip()), None)
    if stop is None:
        pytest.skip("the random model produced no usable stop string")
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:full.find(stop)]
    assert r.choices[0].finish_reason == "stop"


BAD_COMPLETIONS = [
    (b"{not json", 400), (b"[1, 2]", 400), (b'"a string"', 400), (b"", 400),
    ({}, 400), ({"prompt": 42}, 400), ({"prompt": ""}, 400), ({"prompt": []}, 400),
    ({"prompt": ["one", "two"]}, 400), ({"prompt": [1, "x"]}, 400), ({"prompt": [10 ** 7]}, 400),
    ({"prompt": [5] * 2000}, 400),                       # over the 1024-token context
    ({"prompt": "hi", "max_tokens": 0}, 400), ({"prompt": "hi", "max_tokens": -3}, 400),
    ({"prompt": "hi", "max_tokens": "8"}, 400), ({"prompt": "hi", "max_tokens": True}, 400),
    ({"prompt": "hi", "max_tokens": 2.5}, 400), ({"prompt": "hi", "temperature": "hot"}, 400),
    ({"prompt": "hi", "temperature": -1}, 400), ({"prompt": "hi", "top_p": 0}, 400),
    ({"prompt": "hi", "top_k": -7}, 400), ({"prompt": "hi", "n": 2}, 400), ({"prompt": "hi", "seed": "x"}, 400),
    ({"prompt": "hi", "seed": 2 ** 80}, 400), (b'{"prompt": "hi", "temperature": NaN}', 400),
    ({"prompt": "hi", "stop": 5}, 400), ({"prompt": "hi", "stop": ["a", 1]}, 400),
    ({"prompt": "hi", "stream": "yes"}, 400), ({"prompt": "hi", "logprobs": 3}, 400),
    ({"prompt": "hi", "stream_options": 7}, 400),
    ({"prompt": "hi", "model": "gpt-9"}, 404), ({"prompt": "hi", "model": 3}, 400),
]
BAD_CHATS = [
    ({}, 400), ({"messages": []}, 400), ({"messages": "hi"}, 400), ({"messages": ["hi"]}, 400),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400), ({"messages": [{"role": "user"}]}, 400),
    ({"messages": [{"role": "user", "content": 5}]}, 400),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
    ({"messages": [{"role": "user", "content": "word " * 3000}]}, 400),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400),
]


@pytest.mark.parametrize("endpoint,cases", [("/v1/completions", BAD_COMPLETIONS),
                                            ("/v1/chat/completions", BAD_CHATS)])
def test_malformed_requests_get_4xx(served, client, endpoint, cases):
    with httpx.Client(base_url=served.base, timeout=30) as h:
        for body, status in cases:
            r = h.post(endpoint, content=body) if isinstance(body, bytes) else h.post(endpoint, json=body)
            assert r.status_code == status, (body if len(str(body)) < 200 else str(body)[:200], r.text)
            err = r.json()["error"]
            assert isinstance(err["message"], str) and err["message"] and "type" in err, r.text
        assert h.get(endpoint).status_code == 405
        r = h.post("/v1/nothing", json={})
        assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-served", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", n=2)
    # ... and the server keeps serving
    assert client.completions.create(model=MODEL, prompt="still alive?", max_tokens=3).usage.completion_tokens >= 1
    s = wait_idle(served.base)
    assert all(v == 0 for v in kv_used(s).values())


def test_disconnects_abort_and_free_kv(served, client, monkeypatch):
    # Steps of at least 2 ms: on a GPU the tiny model's graphed steps finished all 600 or 900
    # tokens before the server could notice the client was gone (it checks every 0.5 s).
    real_step = LLMEngine.step

    def slow_step(self):
        time.sleep(0.002)
        return real_step(self)
    monkeypatch.setattr(LLMEngine, "step", slow_step)
    before = metric(scrape(served.base), "nanodspark_requests_finished_total", finish_reason="abort")
    stream = client.completions.create(model=MODEL, prompt=make_prompt(4), max_tokens=600, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    for _ in range(3):
        next(it)
    stream.close()  # the client goes away mid-stream
    s = wait_idle(served.base)
    assert all(v == 0 for v in kv_used(s).values()), kv_used(s)
    assert metric(s, "nanodspark_requests_finished_total", finish_reason="abort") == before + 1

    # a non-streaming client that times out is noticed too
    with pytest.raises(httpx.TimeoutException):
        httpx.post(served.base + "/v1/completions", timeout=0.3,
                   json={"prompt": make_prompt(5), "max_tokens": 900, "ignore_eos": True, "temperature": 0})
    deadline = time.monotonic() + 10
    while metric(scrape(served.base), "nanodspark_requests_finished_total", finish_reason="abort") < before + 2:
        assert time.monotonic() < deadline, "the abandoned non-streaming request was not aborted"
        time.sleep(0.05)
    s = wait_idle(served.base)
    assert all(v == 0 for v in kv_used(s).values()), kv_used(s)


def test_queue_limits_give_429(served, client):
    server = served.app.state.server
    old = server.max_queue
    server.max_queue = 1
    try:
        stream = client.completions.create(model=MODEL, prompt="hold the line", max_tokens=600, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="one more", max_tokens=2)
        stream.close()
    finally:
        server.max_queue = old
    cfg = server.engine.config
    old_waiting, cfg.max_waiting = cfg.max_waiting, 0   # the engine's own queue is full: OverflowError
    try:
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="and another", max_tokens=2)
    finally:
        cfg.max_waiting = old_waiting
    assert server.inflight <= 1
    s = wait_idle(served.base)
    assert all(v == 0 for v in kv_used(s).values())
    assert server.inflight == 0


def test_load_300_requests_no_errors_no_leaks(served):
    before = scrape(served.base)
    n, concurrency = 300, 32

    async def one(c, i, sem):
        rng = random.Random(i)
        kw = dict(model=MODEL, max_tokens=rng.randint(1, 6), temperature=rng.choice([0, 0.7]), seed=i)
        stream = rng.random() < 0.5
        async with sem:
            if i % 2:
                kw["messages"] = [{"role": "user", "content": make_prompt(1000 + i)}]
                create = c.chat.completions.create
            else:
                kw["prompt"] = make_prompt(1000 + i)
                create = c.completions.create
            if not stream:
                return (await create(**kw)).usage.completion_tokens
            last = None
            async for ch in await create(**kw, stream=True, stream_options={"include_usage": True}):
                last = ch
            return last.usage.completion_tokens

    async def run():
        sem = asyncio.Semaphore(concurrency)
        async with openai.AsyncOpenAI(base_url=served.base + "/v1", api_key="none", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, i, sem) for i in range(n)), return_exceptions=True)

    results = asyncio.run(run())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    after = wait_idle(served.base)
    assert all(v == 0 for v in kv_used(after).values()), kv_used(after)

    def ok(s):
        return sum(metric(s, "nanodspark_requests_total", endpoint=e, code="200")
                   for e in ("/v1/completions", "/v1/chat/completions"))
    assert ok(after) - ok(before) == n
    gen = metric(after, "nanodspark_generation_tokens_total") - metric(before, "nanodspark_generation_tokens_total")
    assert gen == sum(results)
    ttft = metric(after, "nanodspark_time_to_first_token_seconds_count") - \
        metric(before, "nanodspark_time_to_first_token_seconds_count")
    assert ttft == n


# ----------------------------------------------------------------------------- serve.py
def _load_serve():
    spec = importlib.util.spec_from_file_location("serve", ROOT / "serve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_serve_flags_mirror_engine_config(capsys, tmp_path):
    serve = _load_serve()
    ap = serve.build_parser()
    flags = {a for act in ap._actions for a in act.option_strings}
    import dataclasses
    for f in dataclasses.fields(EngineConfig):
        if f.name != "use_tqdm":
            assert "--" + f.name.replace("_", "-") in flags, f.name
    args = ap.parse_args(["--max-num-seqs", "8", "--no-enable-prefix-cache", "--verify-mode", "compact",
                          "--drafter-path", "none", "--kv-cache-memory-gb", "0.5", "--port", "9"])
    cfg = serve.engine_config(args)
    assert (cfg.max_num_seqs, cfg.enable_prefix_cache, cfg.verify_mode, cfg.drafter_path,
            cfg.kv_cache_memory_gb) == (8, False, "compact", "none", 0.5)
    assert cfg.block_size == EngineConfig().block_size and args.host == "127.0.0.1"
    assert serve.main(["--model", "/does/not/exist"]) == 2
    assert "--model" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as e:   # an enumerated flag: argparse refuses it, listing the choices
        serve.main(["--model", str(tmp_path), "--verify-mode", "bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--verify-mode" in err and "cap-accept" in err
    assert serve.main(["--model", str(tmp_path), "--block-size", "3"]) == 2   # EngineConfig's own check
    assert "block_size" in capsys.readouterr().err


def test_serve_py_end_to_end_and_sigterm(tiny_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), "--model", str(tiny_dir), "--port", str(port),
                          "--max-num-seqs", "4", "--log-level", "warning"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    lines = []
    try:
        deadline = time.monotonic() + 90
        while not any(line.lstrip().startswith("curl ") for line in lines):
            line = p.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(lines)
            lines.append(line)
        banner = "".join(lines)
        assert f"http://127.0.0.1:{port}/v1" in banner
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                       json={"model": tiny_dir.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0, p.stdout.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_speculative_server_matches_target_and_reports_dspark_counters(tiny_dir, offline, tmp_path):
    """With a (random) drafter the server still answers the target's greedy text, and the DSpark
    counters flow into `usage` and /metrics; the drafter's KV group does not leak either."""
    from test_verify import make_drafter
    ddir = make_drafter(tiny_dir, tmp_path / "drafter", gamma=4)
    engine, _, srv = start_server(tiny_dir, drafter_path=str(ddir))
    assert engine.drafter is not None
    try:
        prompts = [make_prompt(500 + i) for i in range(8)]
        want = [o.text for o in offline.generate(prompts, greedy(10, ignore_eos=True))]

        async def one(c, p):
            stream = await c.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
            return "".join([ch.choices[0].text async for ch in stream if ch.choices])

        async def run():
            async with openai.AsyncOpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0) as c:
                return await asyncio.gather(*(one(c, p) for p in prompts))

        assert asyncio.run(run()) == want
        with openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0) as c:
            r = c.completions.create(model=MODEL, prompt=prompts[0], max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
        spec = r.usage.speculative
        assert spec["steps"] > 0 and spec["committed"] >= spec["steps"] and spec["drafted"] == 4 * spec["steps"]
        s = wait_idle(srv.base)
        assert "full" in kv_used(s) and all(v == 0 for v in kv_used(s).values()), kv_used(s)   # (the drafter shares it)
        steps = metric(s, "nanodspark_spec_verify_steps_total")
        assert steps >= spec["steps"]
        assert metric(s, "nanodspark_spec_drafted_tokens_total") == 4 * steps
        assert metric(s, "nanodspark_spec_verify_window_tokens_count") == steps
        committed = metric(s, "nanodspark_spec_committed_tokens_total")
        assert committed >= steps and metric(s, "nanodspark_spec_tau") == pytest.approx(committed / steps)
        assert 0 <= s[("nanodspark_spec_position_acceptance", frozenset({("position", "1")}))] <= 1
        assert 0 <= s[("nanodspark_spec_online_ece", frozenset({("position", "1")}))] <= 1
        assert s[("nanodspark_spec_step_time_seconds", frozenset({("kind", "measured")}))] > 0
        assert 0 < s[("nanodspark_spec_utilisation", frozenset())] <= 1.0 + 1e-9
    finally:
        srv.stop()


def test_shutdown_ends_open_streams_and_joins_the_engine_thread(tiny_dir):
    engine, app, srv = start_server(tiny_dir)
    events = []
    first = threading.Event()

    def read():
        with httpx.stream("POST", srv.base + "/v1/completions", timeout=30,
                          json={"prompt": "a long story", "max_tokens": 900, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    first.set()

    t = threading.Thread(target=read)
    t.start()
    assert first.wait(30)
    t0 = time.monotonic()
    srv.stop()
    t.join(10)
    assert time.monotonic() - t0 < 5, "shutdown waited for the stream instead of aborting it"
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"
    assert not app.state.server.loop._thread.is_alive()
    assert all(u["used"] == 0 for u in engine.kv_usage().values()) and not engine.requests
