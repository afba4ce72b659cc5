"""Several API processes on one engine core (`serve.py --api-server-count N`, api_servers.py).

* The core's `Fanout`: each link gets exactly its own requests' rows (tokens, counters,
  finishes), admissions, failures and waits, and every link the engine's state and a `closing`;
  a link's `abort_all` and its departure abort only its requests, and a departed link gets
  nothing more.
* The metrics of two API processes merged (`merge_expositions`) equal one `Metrics` fed with
  both processes' events: counters and histograms summed, the in-flight count summed, the
  engine's gauges the answering process's, τ recomputed.
* `serve.py --api-server-count 2`: concurrent streamed and plain answers equal the offline text,
  both processes serve, /metrics counts every request once, no KV block is left; SIGINT stops
  every process with status 0; a killed API process stops the server with status 1 and no
  engine core is left behind.
"""
import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nanodspark import LLM, SamplingParams
from nanodspark.server import Metrics, StepOutputs
from nanodspark.server.core import Fanout
from nanodspark.server.engine_loop import SPEC_FIELDS, EngineState
from nanodspark.server.metrics import merge_expositions
from test_server import MODEL, kv_used, make_prompt, metric, scrape, wait_idle
from test_server_core import free_port, gone

ROOT = Path(__file__).resolve().parents[1]


class _Inbox:
    def __init__(self):
        self.sent = []

    def send(self, cmd):
        self.sent.append(cmd)


def _drain(q):
    out = []
    while not q.empty():
        out.append(q.get())
    return out


# ----------------------------------------------------------------------------- the core's fan-out
@pytest.mark.parametrize("seed", range(5))
def test_fanout_gives_each_link_its_own_requests_and_everyone_the_state(seed):
    rng = np.random.default_rng(seed)
    fan, loop = Fanout(3), _Inbox()
    owner = {}
    for i in range(12):
        link = int(rng.integers(0, 3))
        owner[f"r{i}"] = link
        fan.command(link, ("add", f"r{i}", [1, 2], None), loop)
    assert [c[1] for c in loop.sent] == [f"r{i}" for i in range(12)]
    b = StepOutputs(state=EngineState(3, 1, {}))
    rows = {}
    for rid in rng.choice(list(owner), 8, replace=False).tolist():
        toks = rng.integers(0, 1000, int(rng.integers(0, 4))).tolist()
        spec = rng.integers(0, 50, len(SPEC_FIELDS)).tolist()
        fin = ("length", None) if rng.random() < 0.3 else None
        if fin:
            b.finished[len(b.request_ids)] = fin
        b.request_ids.append(rid)
        b.num_tokens.append(len(toks))
        b.token_ids.extend(toks)
        b.spec.extend(spec)
        rows[rid] = (toks, fin, tuple(spec))
        if fin:
            b.waits.append((rid, 0.1, 0.2))
    b.admitted = [("accepted", "r0"), ("refused", "r1", 429, "rate_limit_error", "busy")]
    b.failed = [("r2", 500, "server_error", "boom")]
    fan.emit(b)
    for link, q in enumerate(fan.sends):
        msgs = _drain(q)
        assert len(msgs) == 1 and msgs[0][0] == "out"
        part = msgs[0][1]
        assert part.state is b.state
        assert {rid: (t, f, s) for rid, t, f, s in part.rows()} == {
            rid: r for rid, r in rows.items() if owner[rid] == link}
        assert part.admitted == [a for a in b.admitted if owner[a[1]] == link]
        assert part.failed == [f for f in b.failed if owner[f[0]] == link]
        assert part.waits == [w for w in b.waits if owner[w[0]] == link]
    # ended requests are forgotten: refused, failed, finished
    ended = {"r1", "r2"} | {rid for rid, r in rows.items() if r[1]}
    live = [rid for rid in owner if rid not in ended]
    assert sorted(fan._owner) == sorted(live)
    # abort_all of link 1 aborts link 1's live requests only; link 2 leaves: its requests are
    # aborted, it is told `stopped`, and gets nothing more (not even the state)
    loop.sent.clear()
    fan.command(1, ("abort_all",), loop)
    assert sorted(loop.sent) == sorted(("abort", r) for r in live if owner[r] == 1)
    loop.sent.clear()
    fan.leave(2, loop)
    assert sorted(loop.sent) == sorted(("abort", r) for r in live if owner[r] == 2)
    assert _drain(fan.sends[2]) == [("stopped", None), None]
    fan.emit(StepOutputs(state=EngineState(0, 0, {}), closing=(503, "server_error", "bye")))
    assert not _drain(fan.sends[2])
    assert [m[1].closing for q in fan.sends[:2] for m in _drain(q)] == [(503, "server_error", "bye")] * 2


def test_one_link_is_passed_through_untouched():
    fan, loop = Fanout(1), _Inbox()
    fan.command(0, ("add", "a", [1], None), loop)
    fan.command(0, ("abort_all",), loop)
    b = StepOutputs(request_ids=["a"])
    fan.emit(b)
    assert loop.sent == [("add", "a", [1], None), ("abort_all",)] and not fan._owner
    assert _drain(fan.sends[0]) == [("out", b)]


def test_a_started_fanout_splits_in_its_own_thread_and_keeps_the_order():
    from array import array
    fan, loop = Fanout(2), _Inbox()
    fan.start()
    fan.command(0, ("add", "a", [1], None), loop)
    fan.command(1, ("add", "b", [1], None), loop)
    for k in range(50):
        fan.emit(StepOutputs(request_ids=["a", "b"], num_tokens=array("l", [1, 2]), token_ids=array("l", [k, k, -k]),
                             spec=array("q", [0] * (2 * len(SPEC_FIELDS)))))
    fan.put_all(("stopped", None))
    fan.put_all(None)                      # joins the router
    for link, want in ((0, [[k] for k in range(50)]), (1, [[k, -k] for k in range(50)])):
        msgs = _drain(fan.sends[link])
        assert msgs[-2:] == [("stopped", None), None]
        assert [ids for m in msgs[:-2] for _, ids, _, _ in m[1].rows()] == want


# ----------------------------------------------------------------------------- metrics of several processes
def _feed(m: Metrics, events, now=100.0):
    for i, (rid, n_tokens, steps) in enumerate(events):
        m.request_started(rid, now - 1.0 - 0.1 * i)
        spec = (0,) * len(SPEC_FIELDS)
        for k in range(n_tokens):
            spec = (k + 1, 7 * (k + 1), 5 * (k + 1), 2 * (k + 1), 3 * (k + 1)) + spec[5:]
            m.on_tokens(rid, 3 if k < steps else 1, spec, now=now + 0.01 * k + 0.003 * i)
        m.on_finish(rid, "length" if i % 3 else "stop", 10 + i, now=now + 1 + 0.1 * i)
        m.engine_waits(0.01 * i, 0.02 * i)
        m.count_request("/v1/completions", 200)


def _samples(text: bytes) -> dict:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text.decode()) for s in fam.samples
            if not s.name.endswith("_created") and not s.name.startswith("process_")}


def test_merged_metrics_equal_one_metrics_fed_with_both_processes_events(tmp_path):
    ev0 = [(f"a{i}", 4 + i, 2) for i in range(5)]
    ev1 = [(f"b{i}", 2 + i, 1) for i in range(3)]
    m0, m1, ref = Metrics(), Metrics(), Metrics()
    m0.share(tmp_path, 0)
    m1.share(tmp_path, 1)
    _feed(m0, ev0)
    _feed(m1, ev1)
    _feed(ref, ev0)
    _feed(ref, ev1)
    m0.track_inflight(lambda: 2)
    m1.track_inflight(lambda: 5)
    ref.track_inflight(lambda: 7)
    for m, running in ((m0, 3), (m1, 9), (ref, 3)):     # the answering process's state wins
        m.set_engine_state(running, 1, {"full": {"used": running, "free": 10, "total": 10 + running}})
    m1.write_share()
    got, want = _samples(m0.render()[0]), _samples(ref.render()[0])
    assert got == want
    assert metric(got, "nanodspark_requests_in_flight") == 7 and metric(got, "nanodspark_requests_running") == 3
    assert metric(got, "nanodspark_spec_tau") == pytest.approx(3.0)
    # a process that is not sharing answers for itself only
    assert _samples(Metrics().render()[0]) != want
    # merging is a sum per sample, not per line position: the other's labels that we lack are kept
    m2 = Metrics()
    m2.finished.labels("abort").inc(4)
    merged = _samples(merge_expositions(m0.render()[0], [m2.render()[0]]))
    assert metric(merged, "nanodspark_requests_finished_total", finish_reason="abort") == 4
    assert metric(merged, "nanodspark_requests_finished_total", finish_reason="stop") == \
        metric(want, "nanodspark_requests_finished_total", finish_reason="stop")


# ----------------------------------------------------------------------------- serve.py with two API processes
def _start(args, port, env):
    p = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), *args, "--port", str(port)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
    lines, deadline = [], time.monotonic() + 180
    while not any(line.lstrip().startswith("curl ") for line in lines):
        line = p.stdout.readline()
        assert line and time.monotonic() < deadline, "".join(lines)
        lines.append(line)
    banner = "".join(lines)
    pids = [int(x) for x in re.search(r"API servers: 2 processes \(pid (\d+), (\d+)\)", banner).groups()]
    core = int(re.search(r"engine core: pid (\d+)", banner).group(1))
    return p, pids, core


def test_serve_py_with_two_api_processes(tiny_dir, tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    offline = LLM(str(tiny_dir), use_tqdm=False)
    prompts = [make_prompt(700 + i) for i in range(32)]
    want = [o.text for o in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))]
    del offline
    p, (api0, api1), core = _start([str(tiny_dir), "--api-server-count", "2", "--log-level", "warning",
                                    "--served-model-name", MODEL], port, env)
    try:
        async def one(i, prompt):
            async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120) as c:
                kw = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
                if i % 2:
                    return (await c.completions.create(**kw)).choices[0].text
                return "".join([ch.choices[0].text async for ch in await c.completions.create(**kw, stream=True)
                                if ch.choices])

        async def run():
            return await asyncio.gather(*(one(i, q) for i, q in enumerate(prompts)))

        assert asyncio.run(run()) == want
        folder = next(tmp_path.glob("nanodspark-metrics-*"))
        deadline = time.monotonic() + 10
        while True:   # each process writes its series at most every 0.25 s
            s = wait_idle(base)
            each = [metric(_samples_all((folder / f"api-{i}.prom").read_bytes()),
                           "nanodspark_requests_finished_total", finish_reason="length") for i in (0, 1)]
            if metric(s, "nanodspark_requests_finished_total", finish_reason="length") == 32 and sum(each) == 32:
                break
            assert time.monotonic() < deadline, (each, metric(s, "nanodspark_requests_finished_total",
                                                            finish_reason="length"))
            time.sleep(0.1)
        assert min(each) > 0, f"one API process served nothing: {each}"
        assert all(v == 0 for v in kv_used(s).values()) and metric(s, "nanodspark_requests_in_flight") == 0
        assert metric(scrape(base), "nanodspark_generation_tokens_total") == 32 * 16
        p.send_signal(signal.SIGINT)
        assert p.wait(60) == 0, p.stdout.read()
        assert all(gone(pid, 30) for pid in (api1, core)), "a process outlived serve.py"
        assert not folder.exists(), "the metrics folder was left behind"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    # an API process killed outright: the server stops with status 1 and takes the core with it
    p, (_, api1), core = _start([str(tiny_dir), "--api-server-count", "2", "--log-level", "warning"], port, env)
    try:
        r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200, r.text
        os.kill(api1, signal.SIGKILL)
        assert p.wait(60) == 1
        assert "error: API server process 1 exited (status -9)" in p.stdout.read()
        assert gone(core, 30), "the engine core outlived the server"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _samples_all(text: bytes) -> dict:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text.decode()) for s in fam.samples}
