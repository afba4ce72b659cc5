"""The engine core in its own process (nanodspark/server/core.py) and the API side's text
(nanodspark/server/outputs.py).

* The API side's detokenizer, unit-tested on real multi-byte text cut into byte tokens: streamed
  in one-token rows or in verify-sized chunks, the text is the tokenizer's decode of the ids, a
  stop string ends the request at the token that completes it (one abort to the engine, the
  tokens after it dropped and not counted), and an abort flushes the held-back text.
* The loop submits to the engine without stop strings and with `stream_text=False`.
* A server whose engine runs in a `CoreClient` process: streams and plain answers equal the
  offline `LLM.generate` text (invalid UTF-8 bytes of the random model included), stop strings
  end requests exactly as offline, a disconnect aborts in the core and frees its KV blocks, the
  metrics add up (with the core's memory), and a stop ends the core process.
* `serve.py` (two processes): a core that dies stops the server with status 1 and the error;
  an API process that is killed leaves no engine core behind.
"""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from nanodspark import LLM, SamplingParams
from nanodspark.config import EngineConfig
from nanodspark.loader import Tokenizer, resolve_model_dir
from nanodspark.server import CoreClient, EngineLoop, Handle, Metrics, OutputProcessor, StepOutputs, create_app
from nanodspark.server.engine_loop import SPEC_FIELDS
from test_server import MODEL, ServerThread, kv_used, make_prompt, metric, scrape, wait_idle

ROOT = Path(__file__).resolve().parents[1]
TEXT = "Grüße aus Köln: 日本語のテキスト, a snowman ☃ and a face 😀 — done."


# ----------------------------------------------------------------------------- the API side's text
@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(resolve_model_dir(None))


def rows(rid, ids, chunk, finish_at_end=None):
    """StepOutputs carrying `ids` for one request, `chunk` tokens per step."""
    out = []
    for i in range(0, len(ids), chunk):
        b = StepOutputs()
        part = ids[i:i + chunk]
        b.request_ids.append(rid)
        b.num_tokens.append(len(part))
        b.token_ids.extend(part)
        b.spec.extend([0] * len(SPEC_FIELDS))
        if finish_at_end and i + chunk >= len(ids):
            b.finished[0] = (finish_at_end, None)
        out.append(b)
    return out


def finish_row(rid, reason):
    b = StepOutputs()
    b.request_ids.append(rid)
    b.num_tokens.append(0)
    b.spec.extend([0] * len(SPEC_FIELDS))
    b.finished[0] = (reason, None)
    return b


def run_processor(tokenizer, ids, chunk, stop=(), stream=True, finish="length", extra=None):
    """Feed `ids` to an OutputProcessor: (items on the handle's queue, aborts sent)."""
    aborts = []
    p = OutputProcessor(tokenizer, Metrics(), aborts.append)
    h = Handle("r", SamplingParams(stop=list(stop)), num_prompt_tokens=3, stream=stream)
    p.register(h)
    admit = StepOutputs()
    admit.admitted.append(("accepted", "r"))
    for b in [admit] + rows("r", ids, chunk, finish) + (extra or []):
        p.on_batch(b)
    items = []
    while not h.queue.empty():
        items.append(h.queue.get_nowait())
    return items, aborts, p


@pytest.mark.parametrize("chunk", [1, 3, 6])
@pytest.mark.parametrize("stream", [True, False])
def test_api_side_text_equals_the_decode_multibyte_included(tokenizer, chunk, stream):
    ids = tokenizer.encode(TEXT)
    assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids), "the text must split characters into bytes"
    items, aborts, p = run_processor(tokenizer, ids, chunk, stream=stream)
    assert items[0] == "accepted" and not aborts and not p.handles
    outs = items[1:]
    assert all("\ufffd" not in o.text_delta for o in outs), "a character was cut"
    assert "".join(o.text_delta for o in outs) == tokenizer.decode(ids) == TEXT
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert len(outs) == 1 if not stream else len(outs) > 1
    final = outs[-1]
    assert (final.finish_reason, final.num_output_tokens, final.num_prompt_tokens) == ("length", len(ids), 3)


@pytest.mark.parametrize("chunk", [1, 4])
@pytest.mark.parametrize("stop", ["日本語", "😀 —", "snowman ☃", "Köln"])
def test_api_side_stop_string_ends_at_its_token_and_aborts_the_engine(tokenizer, chunk, stop):
    ids = tokenizer.encode(TEXT)
    assert stop in TEXT
    k = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))   # the completing token
    want = TEXT[:TEXT.find(stop)]
    late = rows("r", [5, 6], 2, "abort")          # the engine's late tokens, then its abort
    items, aborts, p = run_processor(tokenizer, ids, chunk, stop=[stop], finish=None, extra=late)
    outs = items[1:]
    assert "".join(o.text_delta for o in outs) == want
    assert outs[-1].finished and outs[-1].finish_reason == "stop" and outs[-1].num_output_tokens == k
    assert aborts == ["r"] and not p.handles, "one abort, and the late rows were recognised"
    fin = {s.labels["finish_reason"]: s.value for s in p.metrics.finished.collect()[0].samples
           if s.name.endswith("_total")}
    assert fin == {"stop": 1.0}
    assert p.metrics.generation_tokens._value.get() == k


def test_api_side_abort_flushes_the_held_text(tokenizer):
    """A stream holds back len(stop) - 1 characters; an abort sends them (as the engine's own
    abort does), and a non-streaming request's text is decoded at its end."""
    ids = tokenizer.encode("hello world, and more")
    for stream in (True, False):
        items, aborts, _ = run_processor(tokenizer, ids, 2, stop=["never in this text"], stream=stream,
                                         finish=None, extra=[finish_row("r", "abort")])
        outs = items[1:]
        assert "".join(o.text_delta for o in outs) == "hello world, and more"
        assert outs[-1].finish_reason == "abort" and not aborts


def _feed(tokenizer, batches, handles):
    """Run `batches` through an OutputProcessor holding `handles`: {id: [items]}, aborts."""
    aborts = []
    p = OutputProcessor(tokenizer, Metrics(), aborts.append)
    for h in handles:
        p.register(h)
    for b in batches:
        p.on_batch(b)
    items = {h.request_id: [] for h in handles}
    for h in handles:
        while not h.queue.empty():
            items[h.request_id].append(h.queue.get_nowait())
    return items, aborts


def _interleaved(tokenizer):
    """Three requests' steps interleaved as the engine emits them: 'a' streams TEXT 3 tokens a
    step and finishes, 'b' has a stop string and gets the engine's late rows and abort, 'c' is
    admitted late and fails with the engine."""
    ids = tokenizer.encode(TEXT)
    admit = StepOutputs()
    admit.admitted += [("accepted", "a"), ("accepted", "b")]
    a = rows("a", ids, 3, "length")
    b = rows("b", ids[:20], 2) + rows("b", [7, 8], 2, "abort")
    out = [admit]
    for i in range(max(len(a), len(b))):
        step = StepOutputs.merge([x[i] for x in (a, b) if i < len(x)])
        if i == 2:
            step.admitted.append(("accepted", "c"))
        if i == 4:
            step.failed.append(("c", 500, "server_error", "engine step failed: boom"))
        out.append(step)
    return out


@pytest.mark.parametrize("group", [2, 3, 1000])
def test_merged_step_outputs_answer_exactly_as_step_by_step(tokenizer, group):
    """What a lagging reader hands over (several steps merged into one StepOutputs, a row per
    request) gives every request the same text, finish, counts, aborts and errors as the steps
    one by one; only the number of outputs on a stream shrinks."""
    steps = _interleaved(tokenizer)
    stop = tokenizer.decode(tokenizer.encode(TEXT)[:20])[-4:]
    make = lambda: [Handle("a"), Handle("b", SamplingParams(stop=[stop])), Handle("c")]   # noqa: E731
    want, want_aborts = _feed(tokenizer, steps, make())
    merged = [StepOutputs.merge(steps[i:i + group]) for i in range(0, len(steps), group)]
    got, got_aborts = _feed(tokenizer, merged, make())
    assert got_aborts == want_aborts == ["b"]

    def summary(items):
        outs = [x for x in items if not isinstance(x, str)]
        end = outs[-1]
        text = "".join(o.text_delta for o in outs if not isinstance(o, Exception))
        return text, (type(end).__name__, getattr(end, "finish_reason", None), getattr(end, "num_output_tokens", None))
    for rid in "abc":
        assert summary(got[rid]) == summary(want[rid]), rid
    assert summary(want["a"])[1] == ("RequestOutput", "length", len(tokenizer.encode(TEXT)))
    assert summary(want["b"])[1][:2] == ("RequestOutput", "stop") and summary(want["c"])[1][0] == "APIError"
    if group > 2:
        assert len(got["a"]) < len(want["a"])


@pytest.mark.parametrize("seed", range(6))
def test_merge_keeps_each_requests_tokens_in_order_its_last_counters_and_its_finish(seed):
    """`StepOutputs.merge` (array operations) against the plain reading of what it promises:
    per request, the concatenation of its rows' tokens, the counters of its last row, its
    latest finish; requests in order of first appearance; admissions, failures, waits kept."""
    from nanodspark.server.engine_loop import SPEC_FIELDS
    rng = np.random.default_rng(seed)
    n = len(SPEC_FIELDS)
    batches, want = [], {}
    for step in range(int(rng.integers(2, 7))):
        b = StepOutputs()
        b.admitted.append(("accepted", f"new{step}"))
        b.waits.append((f"r{step}", 0.1 * step, 0.2))
        for rid in rng.choice([f"r{i}" for i in range(9)], int(rng.integers(0, 6)), replace=False).tolist():
            toks = rng.integers(0, 1000, int(rng.integers(0, 4))).tolist()
            spec = rng.integers(0, 50, n).tolist()
            finish = ("length", None) if rng.random() < 0.15 else None
            if finish is not None:
                b.finished[len(b.request_ids)] = finish
            b.request_ids.append(rid)
            b.num_tokens.append(len(toks))
            b.token_ids.extend(toks)
            b.spec.extend(spec)
            w = want.setdefault(rid, [[], None, None])
            w[0] += toks
            w[1] = tuple(spec)
            w[2] = finish or w[2]
        batches.append(b)
    m = StepOutputs.merge(batches)
    assert m.request_ids == list(want)
    assert {rid: [ids, spec, fin] for rid, ids, fin, spec in m.rows()} == {
        rid: [ids, spec, fin] for rid, (ids, spec, fin) in want.items()}
    assert m.admitted == [("accepted", f"new{i}") for i in range(len(batches))]
    assert m.waits == [(f"r{i}", 0.1 * i, 0.2) for i in range(len(batches))]


def test_bulk_histogram_exposes_what_prometheus_histogram_does():
    """The metrics' histograms (numpy buckets, an observation n times over as one entry) give the
    same `_bucket`, `_sum` and `_count` series as prometheus_client's own Histogram, values on
    the bucket bounds included (`le` is inclusive)."""
    from prometheus_client import CollectorRegistry, Histogram
    from prometheus_client.exposition import generate_latest

    from nanodspark.server.metrics import ITL_BUCKETS, BulkHistogram
    rng = np.random.default_rng(0)
    values = list(rng.exponential(0.05, 300)) + list(ITL_BUCKETS[:5]) + [7.0, 0.0]
    times = rng.integers(1, 5, len(values))
    ours_r, ref_r = CollectorRegistry(), CollectorRegistry()
    ours = BulkHistogram("x_seconds", "doc", ITL_BUCKETS, ours_r)
    ref = Histogram("x_seconds", "doc", buckets=ITL_BUCKETS, registry=ref_r)
    for i, (v, n) in enumerate(zip(values, times)):
        ours.observe(float(v), int(n))
        for _ in range(n):
            ref.observe(float(v))
        if i == 100:
            generate_latest(ours_r)       # a scrape in the middle folds what was buffered

    def series(reg):
        lines = generate_latest(reg).decode().splitlines()
        out = {}
        for line in lines:
            if line.startswith("x_seconds_") and "_created" not in line:
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out
    a, b = series(ours_r), series(ref_r)
    assert a.keys() == b.keys() and a["x_seconds_count"] == times.sum()
    assert all(a[k] == pytest.approx(b[k], rel=1e-9) for k in a), (a, b)


def test_the_relay_merges_what_queues_while_the_event_loop_is_busy():
    """Posts from the step's thread while the event loop is busy arrive as one delivery; posts
    while it is idle arrive one by one."""
    import threading

    from nanodspark.server.engine_loop import Relay
    got = []

    async def main():
        loop = asyncio.get_running_loop()
        relay = Relay(got.append, loop)
        steps = rows("r", list(range(12)), 3)
        t = threading.Thread(target=lambda: [relay.post(b) for b in steps[:3]])
        t.start()
        t.join()                          # the loop was busy with this coroutine all along
        await asyncio.sleep(0.05)
        assert len(got) == 1 and list(got[0].token_ids) == list(range(9)) and list(got[0].num_tokens) == [9]
        relay.post(steps[3])
        await asyncio.sleep(0.05)
        assert len(got) == 2 and list(got[1].token_ids) == [9, 10, 11]

    asyncio.run(main())


def test_a_lagging_stream_sends_what_queued_as_one_chunk():
    """Outputs that queued while a stream waited go out as one SSE chunk (the text joined, the
    finish of the last); an error after them still comes after their text."""
    from nanodspark.request import RequestOutput
    from nanodspark.server.app import OpenAIServer
    from nanodspark.server.openai_api import APIError

    def out(text, finished=False):
        return RequestOutput("r", [1], text, finished, "length" if finished else None, 3, 0, {})

    def chunk(text, finish_reason):
        return {"text": text, "finish_reason": finish_reason}

    async def events(items):
        h = Handle("r")
        for x in items:
            h.queue.put_nowait(x)
        return [e async for e in OpenAIServer._events(None, h, chunk, False)]

    ev = asyncio.run(events([out("a"), out("b"), out("c", True)]))
    assert ev == ['data: {"text":"abc","finish_reason":"length"}\n\n', "data: [DONE]\n\n"]
    ev = asyncio.run(events([out("a"), out("b"), APIError(500, "boom", "server_error")]))
    assert ev[0] == 'data: {"text":"ab","finish_reason":null}\n\n' and '"boom"' in ev[1] and ev[2] == "data: [DONE]\n\n"


def test_the_loop_gives_the_engine_no_stop_strings_and_no_text():
    """`EngineLoop` hands the engine the request without its stop strings and with
    stream_text=False (the API side does both); a refusal is passed back with its status."""
    calls = []

    class FakeEngine:
        def add_request(self, ids, params, request_id, stream_text):
            calls.append((ids, params.stop, params.max_tokens, stream_text))
            if ids == [9]:
                raise OverflowError("full")

    sent = []
    loop = EngineLoop(FakeEngine(), emit=sent.append)
    loop.submit("a", [1, 2], SamplingParams(max_tokens=7, stop=["x", "yy"]))
    loop.submit("b", [9], SamplingParams())
    for cmd in list(loop._inbox):
        loop._command(cmd)
    assert calls == [([1, 2], [], 7, False), ([9], [], 64, False)]
    assert loop._out.admitted == [("accepted", "a"), ("refused", "b", 429, "rate_limit_error", "server busy: full")]


# ----------------------------------------------------------------------------- a server on an engine core
@pytest.fixture(scope="module")
def core_server(tiny_dir):
    core = CoreClient(str(tiny_dir), EngineConfig(use_tqdm=False), "warning")
    info = core.wait_ready()
    assert info.max_model_len == 1024 and core.tokenizer is not None
    app = create_app(core, model_name=MODEL)
    srv = ServerThread(app).start()
    yield srv
    srv.stop()
    assert not core.process.is_alive() and core.process.exitcode == 0, "the core did not stop cleanly"


@pytest.fixture(scope="module")
def offline(tiny_dir):
    return LLM(str(tiny_dir), use_tqdm=False)


def stream_text(base, body):
    """(text, finish_reason, usage) of a streamed completion."""
    text, reason, usage = "", None, None
    with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True,
                                                              "stream_options": {"include_usage": True}},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ev = json.loads(line[6:])
                assert "error" not in ev, ev
                if ev["choices"]:
                    text += ev["choices"][0]["text"]
                    reason = ev["choices"][0]["finish_reason"] or reason
                else:
                    usage = ev["usage"]
    return text, reason, usage


def test_core_server_matches_offline_text(core_server, offline):
    prompts = [make_prompt(300 + i) for i in range(24)]
    want = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert any(any(ord(c) > 127 for c in w.text) for w in want), "no non-ASCII text to check"

    async def one(c, i, p):
        kw = dict(model=MODEL, prompt=p, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
        if i % 2:
            r = await c.completions.create(**kw)
            return r.choices[0].text, r.usage.completion_tokens
        text, n = "", None
        async for ch in await c.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
            if ch.choices:
                text += ch.choices[0].text
            if ch.usage:
                n = ch.usage.completion_tokens
        return text, n

    async def run():
        async with openai.AsyncOpenAI(base_url=core_server.base + "/v1", api_key="none", max_retries=0,
                                      timeout=120) as c:
            return await asyncio.gather(*(one(c, i, p) for i, p in enumerate(prompts)))

    assert asyncio.run(run()) == [(w.text, len(w.token_ids)) for w in want]
    with openai.OpenAI(base_url=core_server.base + "/v1", api_key="none", max_retries=0) as c:
        messages = [{"role": "user", "content": make_prompt(7)}]
        chat = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    ref = offline.generate(offline.tokenizer.apply_chat_template(messages), SamplingParams(temperature=0, max_tokens=12))
    assert chat.choices[0].message.content == ref[0].text


def test_core_server_stop_strings_end_where_offline_ends(core_server, offline):
    s0 = scrape(core_server.base)
    prompts = [make_prompt(400 + i) for i in range(6)]
    greedy = dict(temperature=0, max_tokens=30, ignore_eos=True)
    fulls = [o.text for o in offline.generate(prompts, SamplingParams(**greedy))]
    cases = [(p, next(f[j:j + 3] for j in range(4, len(f) - 3) if f[j:j + 3].strip()))
             for p, f in zip(prompts, fulls) if any(f[j:j + 3].strip() for j in range(4, len(f) - 3))]
    assert len(cases) >= 3
    refs = offline.generate([p for p, _ in cases], [SamplingParams(**greedy, stop=[stop]) for _, stop in cases])
    for (prompt, stop), ref in zip(cases, refs):
        assert ref.finish_reason == "stop"
        body = {"prompt": prompt, "stop": [stop], **greedy}
        text, reason, usage = stream_text(core_server.base, body)
        assert (text, reason, usage["completion_tokens"]) == (ref.text, "stop", len(ref.token_ids))
        r = httpx.post(core_server.base + "/v1/completions", json=body, timeout=60).json()
        assert (r["choices"][0]["text"], r["usage"]["completion_tokens"]) == (ref.text, len(ref.token_ids))
    s = wait_idle(core_server.base)
    assert all(v == 0 for v in kv_used(s).values()), kv_used(s)
    for reason, grew in (("stop", 2 * len(cases)), ("abort", 0)):   # the core's late abort is not a second finish
        assert metric(s, "nanodspark_requests_finished_total", finish_reason=reason) - \
            metric(s0, "nanodspark_requests_finished_total", finish_reason=reason) == grew, reason


def test_core_server_disconnect_aborts_in_the_core(core_server):
    before = metric(scrape(core_server.base), "nanodspark_requests_finished_total", finish_reason="abort")
    with openai.OpenAI(base_url=core_server.base + "/v1", api_key="none", max_retries=0) as c:
        stream = c.completions.create(model=MODEL, prompt=make_prompt(9), max_tokens=900, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
        it = iter(stream)
        for _ in range(3):
            next(it)
        stream.close()
    deadline = time.monotonic() + 20
    while metric(scrape(core_server.base), "nanodspark_requests_finished_total", finish_reason="abort") < before + 1:
        assert time.monotonic() < deadline, "the abandoned stream was not aborted"
        time.sleep(0.05)
    s = wait_idle(core_server.base)
    assert all(v == 0 for v in kv_used(s).values()), kv_used(s)
    assert metric(s, "nanodspark_requests_in_flight") == 0


def test_core_server_metrics_add_up(core_server):
    before = scrape(core_server.base)

    async def one(c, i):
        r = await c.post("/v1/completions", json={"prompt": make_prompt(600 + i), "max_tokens": 1 + i % 7,
                                                  "temperature": 0.7, "seed": i})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["completion_tokens"]

    async def run():
        async with httpx.AsyncClient(base_url=core_server.base, timeout=60) as c:
            return await asyncio.gather(*(one(c, i) for i in range(30)))

    total = sum(asyncio.run(run()))
    after = wait_idle(core_server.base)
    delta = {k: metric(after, k) - metric(before, k) for k in (
        "nanodspark_generation_tokens_total", "nanodspark_time_to_first_token_seconds_count",
        "nanodspark_request_latency_seconds_count", "nanodspark_request_prepare_seconds_count",
        "nanodspark_request_admission_seconds_count", "nanodspark_request_queue_time_seconds_count",
        "nanodspark_request_prefill_time_seconds_count")}
    assert delta == {"nanodspark_generation_tokens_total": total, "nanodspark_time_to_first_token_seconds_count": 30,
                     "nanodspark_request_latency_seconds_count": 30, "nanodspark_request_prepare_seconds_count": 30,
                     "nanodspark_request_admission_seconds_count": 30, "nanodspark_request_queue_time_seconds_count": 30,
                     "nanodspark_request_prefill_time_seconds_count": 30}
    # the parts of TTFT the bench reads: the acceptance comes no later than the first token, and
    # the engine's own queue and prefill (its clock, in the other process) fit inside the API's TTFT
    from nanodspark.lab.bench_serve import server_latency_sums
    sums = server_latency_sums(core_server.base)
    assert set(sums) == {"prepare", "admission", "first_token_after_submit", "engine_queue", "engine_prefill"}
    assert 0 < sums["prepare"][0] and sums["admission"][0] <= sums["first_token_after_submit"][0] + 1e-6
    assert 0 < sums["engine_prefill"][0]
    assert sums["engine_queue"][0] + sums["engine_prefill"][0] <= sums["first_token_after_submit"][0] + 1e-6
    assert metric(after, "nanodspark_engine_core_resident_memory_bytes") > 50 * 2**20
    assert metric(after, "nanodspark_requests_in_flight") == 0 and httpx.get(core_server.base + "/health").json() == {
        "status": "ok"}


# ----------------------------------------------------------------------------- serve.py, two processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(args, port):
    p = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), *args, "--port", str(port)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines, deadline = [], time.monotonic() + 120
    while not any(line.lstrip().startswith("curl ") for line in lines):
        line = p.stdout.readline()
        assert line and time.monotonic() < deadline, "".join(lines)
        lines.append(line)
    return p, "".join(lines)


def gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:   # a zombie of ours counts as gone
            if open(f"/proc/{pid}/stat").read().split()[2] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def test_serve_py_core_death_stops_the_server_and_an_api_death_stops_the_core(tiny_dir):
    import re
    port = free_port()
    p, banner = start_serve([str(tiny_dir), "--log-level", "info"], port)
    try:
        for want in ("KV cache:", "maximum concurrency", "drafter", "CUDA graphs", "engine ready in"):
            assert want in banner, (want, banner)
        core = int(re.search(r"engine core: pid (\d+)", banner).group(1))
        base = f"http://127.0.0.1:{port}"
        r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200, r.text
        with httpx.stream("POST", base + "/v1/completions", timeout=60,
                          json={"prompt": "a long one", "max_tokens": 900, "ignore_eos": True, "stream": True}) as s:
            lines = s.iter_lines()
            next(x for x in lines if x.startswith("data:"))
            os.kill(core, signal.SIGKILL)
            rest = "".join(lines)
        assert "engine stopped" in rest and rest.rstrip().endswith("[DONE]"), rest[-300:]
        assert p.wait(30) == 1
        assert "error: the engine stopped: the engine-core process exited" in p.stdout.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    # the API process killed outright: its engine core sees the pipe close and exits
    p, banner = start_serve([str(tiny_dir), "--log-level", "warning"], port)
    core = int(re.search(r"engine core: pid (\d+)", banner).group(1))
    p.kill()
    p.wait()
    assert gone(core, 30), "the engine core outlived the API process"
