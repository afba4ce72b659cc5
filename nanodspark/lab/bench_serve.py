"""Steady-state serving benchmark: C clients in a closed loop (`python -m nanodspark.bench serve`).

The idea
    As `vllm bench serve --max-concurrency C` and SGLang's `bench_serving` measure: C clients,
    each sending its next request the moment its last one ends, so C requests are always in
    flight. A warm-up (`--warmup-s`) lets the batch fill and desynchronise; then a measured
    window (`--duration` seconds, or the first `--num-requests` requests sent after the
    warm-up) is timed while the clients keep going, and the clients keep the load at C until
    every measured request has finished. One harness, two front ends: the engine in-process
    (`--frontend engine`: add_request / step, the engine text-free as `serve.py`'s engine core
    runs it, whose API processes decode the text) and a running `serve.py` over HTTP with streaming
    (`--frontend http`: `/v1/completions`, raw asyncio streams; `--url`, or `--spawn` one server
    per system). A sweep runs every system (`--systems`: no-spec, static, compact, and static-b,
    an A/A control) at every `--concurrency`, `--repeats` rounds whose order rotates, and writes
    one JSON (hardware, versions, argv, every run) and a short table last.

Definitions (vLLM's names)
    TTFT      first token (first streamed chunk) − request sent.
    ITL       gap between two chunks of a request; one verify step may bring several tokens.
    TPOT      (end − first token) / (output tokens − 1).
    per-user tok/s  = 1 / TPOT: the decode speed a user sees once the first token is there (the
              Pareto x axis). End-to-end tok/s = output tokens / (end − sent) is reported too.
    total tok/s     = output tokens delivered inside the window / its length (every request's,
              warm-up and tail ones included: what the machine produced in that time).
    Per-request figures are over the measured requests: those sent inside the window.
    server_ms (HTTP)  the server's own split of TTFT, means over the window from its /metrics:
              prepare (handler start to submission), admission (submission to the engine's
              acceptance), first_token_after_submit, and inside it the engine's own
              engine_queue and engine_prefill; the rest of TTFT is HTTP and the event loop.
    api_cpu_share (HTTP)  the server's API process's CPU seconds per second over the window
              (its process_cpu_seconds_total): near 1, its event loop is the bound.

Invariants
    * Request i is the same everywhere (prompt i mod P of the workload, its own seeded output
      length, greedy, ignore_eos): every system and both front ends get the same work.
    * After the first C sends, a send happens only when a request ends (closed loop).
    * Nothing sent before the window is measured; nothing after the window counts in total tok/s.
    * Over HTTP a chunk carries text, not a token count: a request's tokens (its final usage)
      are spread evenly over its chunks, exact except for requests that straddle the window's
      edges; the client's CPU share is recorded (near 1.0: the client, not the server, bound it).
"""
from __future__ import annotations

import asyncio
import gc
import json
import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .traces import StepLedger, TraceRecorder, account

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SYSTEMS = ("no-spec", "static", "compact", "static-b")
# system -> (EngineConfig fields, serve.py flags, needs the cost table)
SYSTEMS = {
    "no-spec": ({"drafter_path": "none"}, ["--drafter-path", "none"], False),
    "static": ({"verify_mode": "static"}, ["--verify-mode", "static"], False),
    "compact": ({"verify_mode": "compact"}, ["--verify-mode", "compact"], True),
    "compact-no-trim": ({"verify_mode": "compact", "verify_min_gain": 1e9},
                        ["--verify-mode", "compact", "--verify-min-gain", "1e9"], True),
    "compact-no-plain": ({"verify_mode": "compact", "verify_plain_steps": False},
                         ["--verify-mode", "compact", "--no-verify-plain-steps"], True),
    "compact-no-partial": ({"verify_mode": "compact", "verify_draft_fractions": ()},
                           ["--verify-mode", "compact", "--verify-draft-fractions", "[]"], True),
    "compact-clock": ({"verify_mode": "compact", "verify_step_clock": True},
                      ["--verify-mode", "compact", "--verify-step-clock"], True),
    "compact-keep": ({"verify_mode": "compact", "verify_lapse_after": 0},      # plain steps feed the drafter
                     ["--verify-mode", "compact", "--verify-lapse-after", "0"], True),
    "static-b": ({"verify_mode": "static"}, ["--verify-mode", "static"], False),   # the A/A control
}
# paired ratios reported per concurrency: (numerator, denominator)
PAIRS = (("static", "no-spec"), ("compact", "no-spec"), ("compact", "static"), ("static-b", "static"),
         ("compact-no-trim", "static"), ("compact-no-plain", "no-spec"), ("compact", "compact-no-plain"),
         ("compact-no-partial", "no-spec"), ("compact", "compact-no-partial"), ("compact-clock", "no-spec"),
         ("compact-clock", "compact"), ("compact-keep", "no-spec"), ("compact", "compact-keep"))


# ----------------------------------------------------------------------------- the work
@dataclass
class ServeWorkload:
    """Request i: prompt i mod P (token ids), its workload name and its output length."""
    prompts: list[list[int]]
    names: list[str]
    lengths: np.ndarray                  # output lengths, request i takes lengths[i mod len]

    def request(self, i: int) -> tuple[list[int], str, int]:
        p = i % len(self.prompts)
        return self.prompts[p], self.names[p], int(self.lengths[i % len(self.lengths)])


def output_lengths(mean: int, spread: float, seed: int = 0, n: int = 1 << 16) -> np.ndarray:
    """Seeded output lengths, uniform in [mean (1 - spread), mean (1 + spread)]. Fixed lengths
    would keep a closed loop in lockstep (a whole wave ends in one step: bursts, not a steady
    state), so the default spread is 0.25."""
    lo, hi = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
    return np.random.default_rng(seed).integers(lo, hi + 1, size=n)


def make_workload(tokenizer, workload: str = "mix", n_prompts: int = 400, prompt_tokens: int = 256,
                  output_len: int = 128, spread: float = 0.25, seed: int = 0, data_dir=None) -> ServeWorkload:
    from .bench_engine import bench_prompts
    ps = bench_prompts(workload, n_prompts, data_dir)
    return ServeWorkload([tokenizer.encode(p.render())[-prompt_tokens:] for p in ps], [p.workload for p in ps],
                         output_lengths(output_len, spread, seed))


# ----------------------------------------------------------------------------- records and figures
@dataclass
class RequestRecord:
    index: int
    workload: str
    sent: float
    measured: bool
    chunks: list = field(default_factory=list)     # (time, tokens) per streamed output
    end: float | None = None
    tokens: int = 0
    spec: dict | None = None
    error: str | None = None

    @property
    def first(self) -> float | None:
        return self.chunks[0][0] if self.chunks else None


@dataclass
class Run:
    """One closed-loop run: every request it sent, and the window [t0, t1) that was measured."""
    records: list[RequestRecord]
    t0: float
    t1: float
    extra: dict = field(default_factory=dict)


def _stats(xs, percentiles) -> dict:
    if not len(xs):
        return {}
    a = np.asarray(xs, dtype=np.float64)
    return {"mean": round(float(a.mean()), 4), **{f"p{q:g}": round(float(np.percentile(a, q)), 4)
                                                   for q in percentiles}}


def summarize(run: Run, percentiles=(50, 90, 99)) -> dict:
    """The figures of a run (the module docstring defines them)."""
    span = run.t1 - run.t0
    toks = sum(n for r in run.records for t, n in r.chunks if run.t0 <= t < run.t1)
    done = [r for r in run.records if r.measured and r.end is not None and r.error is None]
    decoding = [r for r in done if r.tokens > 1 and r.end > r.first]
    user = [(r.tokens - 1) / (r.end - r.first) for r in decoding]
    by_wl: dict = {}
    for r in done:
        s = by_wl.setdefault(r.workload, {"requests": 0, "tokens": 0, "steps": 0, "verified": 0, "committed": 0})
        s["requests"] += 1
        s["tokens"] += r.tokens
        for k in ("steps", "verified", "committed"):
            s[k] += int((r.spec or {}).get(k, 0))
    return {
        "window_s": round(span, 4), "wall_s": round(span, 4),     # (wall_s: the name bench dspark-table reads)
        "total_tok_s": round(toks / span, 2) if span > 0 else 0.0,
        "per_user_tok_s": round(statistics.median(user), 2) if user else 0.0,
        "requests_measured": sum(r.measured for r in run.records),
        "requests_completed": len(done),
        "errors": sum(r.error is not None for r in run.records if r.measured),
        "error_samples": [r.error for r in run.records if r.error][:3],
        "output_tokens_in_window": round(toks, 1),
        "per_user_tok_s_stats": _stats(user, percentiles),
        "e2e_tok_s_stats": _stats([r.tokens / (r.end - r.sent) for r in done if r.end > r.sent], percentiles),
        "ttft_ms": _stats([1e3 * (r.first - r.sent) for r in done], percentiles),
        "tpot_ms": _stats([1e3 * (r.end - r.first) / (r.tokens - 1) for r in decoding], percentiles),
        "itl_ms": _stats([1e3 * (b[0] - a[0]) for r in done for a, b in zip(r.chunks, r.chunks[1:])], percentiles),
        "by_workload": by_wl,
        **run.extra,
    }


# ----------------------------------------------------------------------------- front end 1: the engine
def _prefill_graphs(engine) -> tuple[int, float]:
    r = getattr(engine, "runner", None)
    return (len(getattr(r, "graphs", ())), float(getattr(r, "capture_seconds", 0.0)))


def engine_closed_loop(engine, work: ServeWorkload, concurrency: int, warmup_s: float, duration_s: float,
                       num_requests: int = 0, temperature: float = 0.0, stream_text: bool = False,
                       clock=time.perf_counter, cost=None, traces: TraceRecorder | None = None) -> Run:
    """Keep `concurrency` requests in the engine: add one whenever one finishes, step, repeat.

    `cost` (simulate.StepCost) replaces the wall clock by a virtual one that advances by what
    each step costs by the table: the engine's real scheduling and acceptance on a machine whose
    speed is known exactly (the simulator's check; tests)."""
    from ..sampling import SamplingParams
    if cost is not None:
        now_v = [0.0]
        clock = lambda: now_v[0]  # noqa: E731
    ledger = StepLedger.attach(engine, clock)
    if traces is not None:
        engine.extra_observers.append(traces)
    start = clock()
    t0 = start + warmup_s
    t1 = t0 + duration_s if not num_requests else math.inf
    records, live, calls = [], {}, []
    n_measured, i = 0, 0
    phases: dict[str, tuple] = {}
    cpu0 = cpu = 0.0
    graphs0 = graphs1 = (0, 0.0)
    try:
        while True:
            now = clock()
            if "w" not in phases and now >= t0:
                phases["w"], cpu0 = (dict(engine.clock.total), engine.clock.steps), time.process_time()
                graphs0 = _prefill_graphs(engine)
            over = now >= t1 or (num_requests and n_measured >= num_requests)
            closing = over and not any(r.measured for r in live.values())
            if (now >= t1 or closing) and "e" not in phases:     # the window's end: t1, or the last measured
                phases["e"], cpu = (dict(engine.clock.total), engine.clock.steps), time.process_time() - cpu0
                graphs1 = _prefill_graphs(engine)
            if closing:
                t1 = min(t1, now)
                break
            measuring = now >= t0 and not over
            while len(live) < concurrency:
                ids, wl, max_tokens = work.request(i)
                rec = RequestRecord(i, wl, clock(), measuring)
                n_measured += measuring
                params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i, ignore_eos=True)
                engine.add_request(ids, params, request_id=f"r{i}", queue_limit=False, stream_text=stream_text)
                if traces is not None:
                    traces.labels[f"r{i}"] = (wl, len(ids))
                live[f"r{i}"] = rec
                records.append(rec)
                i += 1
            a = clock()
            n_rows = len(ledger.rows)
            outs = engine.step()
            if cost is not None:     # the virtual machine: every step committed in this call costs its price
                now_v[0] += sum(cost.step_seconds(int(r[3]), int(r[6]), int(r[7]), engine.gamma > 0, int(r[11]))
                                for r in ledger.rows[n_rows:])
            b = clock()
            calls.append((a, b))
            # the quiet decode rows stay arrays (StepOutputs.rows): iterating `outs` would build a
            # RequestOutput per row and step, milliseconds of client time per step at 256
            for reqs, _, counts, _, _ in (outs.rows() if hasattr(outs, "rows") else ()):
                for req, n in zip(reqs.tolist(), counts.tolist()):
                    rec = live.get(req.request_id)
                    if rec is not None and n:
                        rec.chunks.append((b, n))
            for o in getattr(outs, "outputs", outs):   # finished, streamed text, first tokens: built by the engine
                rec = live.get(o.request_id)
                if rec is None:
                    continue
                if o.new_token_ids:
                    rec.chunks.append((b, len(o.new_token_ids)))
                if o.finished:
                    rec.end, rec.tokens, rec.spec = b, o.num_output_tokens, o.spec
                    if o.finish_reason in ("error", "abort"):
                        rec.error = o.error or o.finish_reason
                    del live[o.request_id]
                    engine.release(o.request_id)
    finally:
        for rid in list(live):          # the tail: requests sent after the window
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        for rid in list(live):
            engine.release(rid)
        ledger.detach()
        if traces is not None:
            engine.extra_observers.remove(traces)
    (w, sw), (e, se) = phases["w"], phases["e"]      # the phase clock at the window's edges
    diff = {k: e.get(k, 0.0) - w.get(k, 0.0) for k in e}
    acc = account(ledger, t0, t1, calls, diff, cost)
    # prefill tiers captured inside the window (each capture is host time the window paid for)
    acc["prefill_graphs"] = graphs1[0]
    acc["prefill_captures_in_window"], acc["prefill_capture_s_in_window"] = (
        graphs1[0] - graphs0[0], round(graphs1[1] - graphs0[1], 4))
    extra = {"engine_steps": acc["steps"], "phase_ms": {k: round(1e3 * v / max(1, se - sw), 3) for k, v in diff.items()},
             "accounting": acc, "client_cpu_share": round(cpu / max(t1 - t0, 1e-9), 3) if cost is None else None}
    return Run(records, t0, t1, extra)


# ----------------------------------------------------------------------------- front end 2: HTTP
class HTTPError(Exception):
    pass


class _Connection:
    """One keep-alive HTTP/1.1 connection, read as a stream of server-sent events (stdlib only)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader = self.writer = None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def events(self, path: str, body: bytes):
        """POST `body`; yield each SSE `data:` payload (bytes) as it arrives."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 22)
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)
        await self.writer.drain()
        r = self.reader
        status = await r.readline()
        if not status:
            self.close()
            raise HTTPError("the server closed the connection")
        code = int(status.split()[1])
        headers = {}
        while (line := await r.readline()) not in (b"\r\n", b"\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip().lower()
        buf = b""
        async for piece in self._body(headers):
            if code != 200:
                buf += piece
                continue
            buf += piece
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                        yield line[5:].strip()
        if headers.get("connection") == "close":
            self.close()
        if code != 200:
            raise HTTPError(f"HTTP {code}: {buf[:300].decode('utf-8', 'replace')}")

    async def _body(self, headers):
        r = self.reader
        if "chunked" in headers.get("transfer-encoding", ""):
            while True:
                size = int((await r.readline()).split(b";")[0], 16)
                if size == 0:
                    while (await r.readline()) not in (b"\r\n", b"\n", b""):
                        pass
                    return
                yield await r.readexactly(size)
                await r.readexactly(2)
        elif "content-length" in headers:
            yield await r.readexactly(int(headers["content-length"]))
        else:
            yield await r.read()
            self.close()


def _split_url(url: str) -> tuple[str, int]:
    from urllib.parse import urlsplit
    u = urlsplit(url)
    return u.hostname or "127.0.0.1", u.port or 80


async def http_closed_loop(url: str, work: ServeWorkload, concurrency: int, warmup_s: float, duration_s: float,
                           num_requests: int = 0, temperature: float = 0.0, model: str | None = None,
                           request_timeout: float = 600.0, clock=time.perf_counter) -> Run:
    """C asyncio clients, each on its own keep-alive connection, sending /v1/completions streams."""
    host, port = _split_url(url)
    start = clock()
    st = {"i": 0, "measured": 0, "t1": start + warmup_s + duration_s if not num_requests else math.inf,
          "live_measured": 0}
    t0 = start + warmup_s
    records: list[RequestRecord] = []
    done = asyncio.Event()

    def over(now: float) -> bool:
        return now >= st["t1"] or bool(num_requests and st["measured"] >= num_requests)

    def check(now: float) -> None:
        if st["live_measured"] == 0 and over(now):
            if num_requests and st["t1"] == math.inf:
                st["t1"] = now
            done.set()

    async def client() -> None:
        conn = _Connection(host, port)
        try:
            while not done.is_set():
                now = clock()
                measuring = now >= t0 and not over(now)
                i = st["i"]
                st["i"] += 1
                ids, wl, max_tokens = work.request(i)
                rec = RequestRecord(i, wl, now, measuring)
                records.append(rec)
                st["measured"] += measuring
                st["live_measured"] += measuring
                body = {"prompt": ids, "max_tokens": max_tokens, "temperature": temperature, "seed": i,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                if model:
                    body["model"] = model
                try:
                    await asyncio.wait_for(_one(conn, json.dumps(body).encode(), rec, clock), request_timeout)
                except (asyncio.TimeoutError, OSError, HTTPError, ValueError) as e:
                    rec.error = f"{type(e).__name__}: {e}"[:300]
                    rec.end = clock()
                    conn.close()
                st["live_measured"] -= measuring
                check(clock())
        finally:
            conn.close()

    scrapes = []

    async def watch() -> None:
        while not done.is_set():
            now = clock()
            if not scrapes and now >= t0:     # the server's latency sums as the window opens
                scrapes.append((await asyncio.to_thread(metrics_text, url), clock()))
            check(now)
            await asyncio.sleep(0.02)

    cpu0 = time.process_time()
    tasks = [asyncio.create_task(client()) for _ in range(concurrency)] + [asyncio.create_task(watch())]
    await done.wait()
    cpu = time.process_time() - cpu0
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    t1 = st["t1"]
    extra = {"client_cpu_share": round(cpu / max(t1 - start, 1e-9), 3)}
    if scrapes and scrapes[0][0] is not None and (text := metrics_text(url)) is not None:
        a, b = server_latency_sums(text=scrapes[0][0]), server_latency_sums(text=text)
        if a and b:
            extra["server_ms"] = {k: round(1e3 * (b[k][0] - a[k][0]) / (b[k][1] - a[k][1]), 3)
                                  for k in b if k in a and b[k][1] > a[k][1]}
        cpu = [parse_metrics(x).get("process_cpu_seconds_total") for x in (scrapes[0][0], text)]
        if None not in cpu:     # the API process's CPU over the window, in cores
            extra["api_cpu_share"] = round((cpu[1] - cpu[0]) / max(clock() - scrapes[0][1], 1e-9), 3)
    return Run(records, t0, t1, extra)


SERVER_LATENCIES = {"prepare": "nanodspark_request_prepare_seconds",
                    "admission": "nanodspark_request_admission_seconds",
                    "first_token_after_submit": "nanodspark_time_to_first_token_seconds",
                    "engine_queue": "nanodspark_request_queue_time_seconds",
                    "engine_prefill": "nanodspark_request_prefill_time_seconds"}


def metrics_text(url: str) -> str | None:
    """The server's /metrics, or None if it has none."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as r:
            return r.read().decode()
    except OSError:
        return None


def parse_metrics(text: str) -> dict:
    """Prometheus text -> {'name{labels}': value} (enough of the format for our own series)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            pass
    return out


def server_latency_sums(url: str | None = None, text: str | None = None) -> dict | None:
    """(sum, count) of the server's latency histograms from its /metrics (or their `text`), or
    None if it has none: their difference over the window gives the mean of each part of the
    server's TTFT."""
    text = metrics_text(url) if text is None else text
    if text is None:
        return None
    values = parse_metrics(text)
    out = {k: (values[m + "_sum"], values[m + "_count"]) for k, m in SERVER_LATENCIES.items()
           if m + "_sum" in values and m + "_count" in values}
    return out or None


async def _one(conn: _Connection, body: bytes, rec: RequestRecord, clock) -> None:
    async for data in conn.events("/v1/completions", body):
        now = clock()
        obj = json.loads(data)
        if "error" in obj:
            raise HTTPError(obj["error"].get("message", "error"))
        for ch in obj.get("choices") or ():
            rec.chunks.append((now, 0))
            if ch.get("finish_reason"):
                rec.end = now
        if obj.get("usage"):
            rec.tokens = int(obj["usage"]["completion_tokens"])
            rec.spec = obj["usage"].get("speculative")
    if rec.end is None:
        raise HTTPError("the stream ended without a finish_reason")
    share = rec.tokens / max(1, len(rec.chunks))
    rec.chunks = [(t, share) for t, _ in rec.chunks]


# ----------------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A `serve.py` (or any command) started as a subprocess; ready once /health answers 200."""

    def __init__(self, cmd: list[str], port: int, log_path: Path):
        self.cmd, self.port, self.log_path = cmd, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode} before it was ready; "
                                   f"its log ({self.log_path}) ends:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s; its log ends:\n{self.tail()}")

    def tail(self, n: int = 2000) -> str:
        self.log.flush()
        return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def serve_command(args, system: str, port: int) -> list[str]:
    """serve.py's command line for one system (`--spawn`), or the user's `--serve-cmd` template
    with `{port}` and `{flags}` (the system's flags) filled in."""
    _, flags, needs_table = SYSTEMS[system]
    flags = list(flags)
    if needs_table or system != "no-spec":
        if args.cost_table:
            flags += ["--cost-table", args.cost_table]
        if args.drafter and system != "no-spec":
            flags += ["--drafter-path", args.drafter]
    if args.serve_cmd:
        return shlex.split(args.serve_cmd.format(port=port, flags=" ".join(shlex.quote(f) for f in flags)))
    cmd = [sys.executable, str(REPO_ROOT / "serve.py"), "--port", str(port), "--log-level", "warning",
           "--max-num-seqs", str(args.max_num_seqs or max(args.concurrency)),
           "--kv-cache-memory-gb", str(args.kv_gb),
           "--enable-prefix-cache" if args.prefix_cache else "--no-enable-prefix-cache"] + flags
    if args.model:
        cmd += ["--model", args.model]
    if args.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if getattr(args, "max_waiting_steps", "auto") != "auto":
        cmd += ["--max-waiting-steps", str(args.max_waiting_steps)]
    if getattr(args, "eager_prefill", False):
        cmd += ["--no-cuda-graph-prefill"]
    if getattr(args, "api_server_count", 1) > 1:
        cmd += ["--api-server-count", str(args.api_server_count)]
    return cmd


# ----------------------------------------------------------------------------- the sweep
def engine_config(args, system: str) -> dict:
    fields, _, _ = SYSTEMS[system]
    kw = dict(fields, use_tqdm=False, max_num_seqs=args.max_num_seqs or max(args.concurrency),
              kv_cache_memory_gb=args.kv_gb, enable_prefix_cache=args.prefix_cache,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_waiting_steps=getattr(args, "max_waiting_steps", "auto"),
              cuda_graph_prefill=not getattr(args, "eager_prefill", False))
    if getattr(args, "shape", None):          # random weights; room for the longest request, no more
        # graph tiers at the measured concurrencies only, as `bench profile --shape` captures them:
        # at paper scale each capture costs seconds, and a closed loop's batch stays near C
        kw.update(load_format="dummy", graph_batch_sizes=tuple(sorted(set(args.concurrency))),
                  max_model_len=args.prompt_tokens + int(args.output_len * (1 + args.output_spread)) + 64)
    if system != "no-spec":
        kw["cost_table"] = args.cost_table
        if args.drafter:
            kw["drafter_path"] = args.drafter
        if getattr(args, "synthetic_acceptance", None):
            kw["synthetic_acceptance"] = args.synthetic_acceptance
    return kw


def paired_ratios(runs: list[dict]) -> list[dict]:
    """Per (workload, concurrency) and pair of systems: the median of per-repeat ratios of total
    tok/s (each repeat ran both systems in one round), with its range."""
    out = []
    keys = sorted({(r["workload"], r["concurrency"]) for r in runs}, key=lambda k: (k[0], k[1]))
    for wl, c in keys:
        by = {}
        for r in runs:
            if (r["workload"], r["concurrency"]) == (wl, c):
                by.setdefault(r["mode"], {})[r["repeat"]] = r["total_tok_s"]
        for a, b in PAIRS:
            if a in by and b in by:
                q = [by[a][k] / by[b][k] for k in by[a] if k in by[b] and by[b][k] > 0]
                if q:
                    out.append({"workload": wl, "concurrency": c, "ratio": f"{a}/{b}",
                                "median": round(statistics.median(q), 3), "min": round(min(q), 3),
                                "max": round(max(q), 3)})
    return out


def legacy_paired(paired: list[dict]) -> list[dict]:
    """`paired_compact_over_static` in the shape `bench dspark-table` reads."""
    out = {}
    for p in paired:
        key = (p["workload"], p["concurrency"])
        name = {"compact/static": "", "static-b/static": "aa_", "compact-no-trim/static": "no_trim_"}.get(p["ratio"])
        if name is None:
            continue
        d = out.setdefault(key, {"workload": key[0], "concurrency": key[1]})
        if name == "":
            d.update(compact_over_static=p["median"], min=p["min"], max=p["max"])
        else:
            d.update({f"{name}over_static": p["median"], f"{name}min": p["min"], f"{name}max": p["max"]})
    return [d for d in out.values() if "compact_over_static" in d]


def pareto_front(rows: list[dict]) -> list[dict]:
    """Each (system, concurrency) point with `on_front`: no other point has both more per-user
    and more total tok/s."""
    pts = [{"mode": r["mode"], "workload": r["workload"], "concurrency": r["concurrency"],
            "per_user_tok_s": r["per_user_tok_s"], "total_tok_s": r["total_tok_s"]} for r in rows]
    for p in pts:
        p["on_front"] = not any(q is not p and q["workload"] == p["workload"]
                                and q["per_user_tok_s"] >= p["per_user_tok_s"] and q["total_tok_s"] >= p["total_tok_s"]
                                and (q["per_user_tok_s"], q["total_tok_s"]) != (p["per_user_tok_s"], p["total_tok_s"])
                                for q in pts)
    return pts


def _rounds(workloads, concurrencies, repeats: int, systems: list[str]):
    """(workload, concurrency, repeat, system) in run order: each round the systems' order rotates
    (A B C, B C A, ...), so no system always runs first or after the same other one."""
    for wl in workloads:
        for c in concurrencies:
            for rep in range(repeats):
                for s in systems[rep % len(systems):] + systems[:rep % len(systems)]:
                    yield wl, c, rep, s


@contextmanager
def _backends(args, systems: list[str]):
    """system -> an `LLM` (engine front end) or a server's URL (HTTP: `--url`, or servers started
    here, together, and stopped on the way out)."""
    servers, out = [], {}
    try:
        for s in systems:
            if args.frontend == "engine":
                from .. import LLM
                out[s] = LLM(args.model, **engine_config(args, s))
                if not args.stream_text:      # as serve.py's engine core: text is the front end's work,
                    out[s].engine.tokenizer = None   # not decoded in the step (not even at a finish)
            elif args.url:
                out[s] = args.url
            else:
                port = free_port()
                logs = Path(args.out).parent if args.out else Path("runs")
                servers.append(ServerProcess(serve_command(args, s, port), port, logs / f"server_{s}_{port}.log"))
                out[s] = servers[-1].url
        for srv in servers:
            srv.wait_ready(args.server_timeout)
        yield out
    finally:
        for srv in servers:
            srv.stop()


def _run(args, backend, system: str, work: ServeWorkload, c: int, traces: TraceRecorder | None) -> Run:
    if args.frontend == "http":
        return _run_client(http_closed_loop(backend, work, c, args.warmup_s, args.duration, args.num_requests,
                                            args.temperature, request_timeout=args.request_timeout))
    return engine_closed_loop(backend.engine, work, c, args.warmup_s, args.duration, args.num_requests,
                              args.temperature, args.stream_text, traces=traces)


def _run_client(coro) -> Run:
    """The clients on uvloop where it is installed (and Python has `asyncio.Runner`): at 100k+
    tok/s the client's event loop is a third of a core or more, and must not be the bound."""
    try:
        import uvloop
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except (ImportError, AttributeError):
        run = asyncio.run(coro)
        run.extra["client_loop"] = "asyncio"
        return run
    with runner:
        run = runner.run(coro)
    run.extra["client_loop"] = "uvloop"
    return run


def serve_bench(args) -> dict:
    """The sweep: every system at every concurrency, `--repeats` rotating rounds; one JSON."""
    from ..loader import Tokenizer, resolve_model_dir
    from .bench_engine import environment
    systems = list(args.systems)
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}")
    if any(SYSTEMS[s][2] for s in systems) and not args.cost_table:
        raise SystemExit("compact needs --cost-table (a profile from `python -m nanodspark.bench profile`); "
                         "without one it would verify full blocks, as static does")
    if args.frontend == "http" and args.url and len(systems) > 1:
        raise SystemExit("--url measures one running server: give one --systems name (its label)")
    if args.frontend == "http" and not (args.url or args.spawn or args.serve_cmd):
        raise SystemExit("--frontend http needs --url (a running server), --spawn or --serve-cmd")
    shape_dir = None
    if getattr(args, "shape", None):          # a paper-scale shape with random weights (lab/shapes.py)
        from .shapes import describe, materialize
        if args.frontend != "engine" or args.model:
            raise SystemExit("--shape builds random weights in-process: the engine front end, without --model")
        shape_dir = tempfile.TemporaryDirectory(prefix="nanodspark-shape-")
        args = argparse_namespace(args, model=str(materialize(args.shape, Path(shape_dir.name) / args.shape)))
        print(f"RANDOM WEIGHTS, shape {describe(args.shape)}"
              + (f"; synthetic acceptance {args.synthetic_acceptance}" if args.synthetic_acceptance else ""))
    tok = Tokenizer(resolve_model_dir(args.model))
    works = {wl: make_workload(tok, wl, args.prompts, args.prompt_tokens, args.output_len, args.output_spread,
                               args.seed, args.data_dir) for wl in args.workloads}
    result = {"benchmark": f"steady-state closed loop ({args.frontend} front end)", **environment(),
              "command": "python -m nanodspark.bench " + " ".join(sys.argv[1:]),
              "options": {k: v for k, v in vars(args).items() if not callable(v)},
              "definitions": {"per_user_tok_s": "median over measured requests of (tokens - 1) / (end - first token)",
                              "total_tok_s": "output tokens delivered in the window / window seconds",
                              "itl": "gap between two streamed chunks (a verify step may bring several tokens)"},
              "systems": {s: SYSTEMS[s][1] if args.frontend == "http" else engine_config(args, s) for s in systems},
              "runs": [], "partial": True, "stopped": None}
    if shape_dir is not None:
        result["random_weights"] = {"shape": args.shape, "synthetic_acceptance": args.synthetic_acceptance}
    t_start = time.monotonic()
    try:
        with _backends(args, systems) as backends:
            if args.frontend == "engine":
                # Measurement hygiene: every engine first serves an unmeasured round at the largest
                # concurrency (it compiles the prefill shapes a first run would pay for inside its
                # window), then the objects of the engines built are moved out of the garbage
                # collector's generations, so its full passes do not land in one system's window.
                for s in systems:
                    if getattr(args, "warmup_round_s", 0) > 0:
                        engine_closed_loop(backends[s].engine, next(iter(works.values())), max(args.concurrency),
                                           0.0, args.warmup_round_s, temperature=args.temperature)
                gc.collect()
                gc.freeze()
            for wl, c, rep, s in _rounds(works, args.concurrency, args.repeats, systems):
                if args.budget_s and time.monotonic() - t_start > args.budget_s:
                    result["stopped"] = f"--budget-s {args.budget_s} spent before {s} at concurrency {c}"
                    break
                rec = None
                if args.frontend == "engine" and args.record_traces and rep == 0 and backends[s].engine.gamma:
                    rec = TraceRecorder(backends[s].engine.gamma)
                row = {"mode": s, "workload": wl, "concurrency": c, "repeat": rep,
                       **summarize(_run(args, backends[s], s, works[wl], c, rec), args.percentiles)}
                if rec is not None:
                    meta = {"system": s, "concurrency": c, "workload": wl,
                            "model": backends[s].engine.model_name}
                    print(f"  traces: {rec.traces(meta).save(Path(args.record_traces) / f'{s}_{wl}_c{c}.npz')}")
                result["runs"].append(row)
                print(f"{s:>16} {wl:>6} c={c:<4} total {row['total_tok_s']:>10,.1f} tok/s  per-user "
                      f"{row['per_user_tok_s']:>8,.1f}  TTFT p50 {row['ttft_ms'].get('p50', float('nan')):8.1f} ms"
                      f"  ({row['requests_measured']} requests, {row['errors']} errors)", flush=True)
                if row.get("server_ms"):
                    cpu = f"; API process {row['api_cpu_share']:.2f} cores" if row.get("api_cpu_share") is not None else ""
                    print(" " * 18 + "server, mean ms: " + ", ".join(f"{k} {v:.1f}" for k, v in row["server_ms"].items()) + cpu,
                          flush=True)
                if args.out:                       # keep what is measured if the call is cut short
                    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    finally:
        gc.unfreeze()      # what the sweep froze may be collected again
        if shape_dir is not None:
            shape_dir.cleanup()
    runs = result["runs"]
    result.update(sweep=median_rows(runs), paired=paired_ratios(runs), partial=False)
    result["paired_compact_over_static"] = legacy_paired(result["paired"])
    result["pareto"] = pareto_front(result["sweep"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
        if result["sweep"]:
            try:
                from .speedup_figure import pareto_figure
                pareto_figure(result, str(Path(args.out).with_suffix(".pareto.png")))
            except ImportError as e:               # matplotlib: the `lab` extra
                print(f"(no Pareto PNG: {e}; pip install -e '.[lab]')")
    print_table(result)
    return result


def median_rows(runs: list[dict]) -> list[dict]:
    """Per (system, workload, concurrency): the run with the median total tok/s, with every repeat's."""
    groups: dict = {}
    for r in runs:
        groups.setdefault((r["mode"], r["workload"], r["concurrency"]), []).append(r)
    out = []
    for rs in groups.values():
        med = sorted(rs, key=lambda x: x["total_tok_s"])[len(rs) // 2]
        out.append({**med, "repeats_total_tok_s": [x["total_tok_s"] for x in rs]})
    return out


def print_table(result: dict) -> None:
    rows = result["sweep"]
    base = {(r["workload"], r["concurrency"]): r["total_tok_s"] for r in rows if r["mode"] == "no-spec"}
    print(f"\n{'system':>16} {'workload':>8} {'conc':>5} {'total tok/s':>12} {'user tok/s':>11} "
          f"{'TTFT p50 ms':>12} {'ITL p50 ms':>11} {'x no-spec':>10}")
    for r in sorted(rows, key=lambda r: (r["workload"], r["concurrency"], r["mode"])):
        b = base.get((r["workload"], r["concurrency"]))
        print(f"{r['mode']:>16} {r['workload']:>8} {r['concurrency']:>5} {r['total_tok_s']:>12,.1f} "
              f"{r['per_user_tok_s']:>11,.1f} {r['ttft_ms'].get('p50', float('nan')):>12.1f} "
              f"{r['itl_ms'].get('p50', float('nan')):>11.2f} "
              f"{(r['total_tok_s'] / b if b else float('nan')):>10.3f}")
    if result["paired"]:
        print("\npaired ratios of total tok/s (median of repeats, range):")
        for p in result["paired"]:
            print(f"  {p['workload']:>6} c={p['concurrency']:<4} {p['ratio']:>22} {p['median']:.3f} "
                  f"({p['min']:.3f}-{p['max']:.3f})")
    front = [p for p in result["pareto"] if p["on_front"]]
    if front:
        print("Pareto front (per-user, total tok/s): " + ", ".join(
            f"{p['mode']}@{p['concurrency']} ({p['per_user_tok_s']:.0f}, {p['total_tok_s']:.0f})"
            for p in sorted(front, key=lambda p: p["per_user_tok_s"])))
    if result.get("stopped"):
        print(f"stopped early: {result['stopped']}")


# ----------------------------------------------------------------------------- command line
def add_serve_args(p, dspark: bool = False) -> None:
    """The flags of `bench serve`; with `dspark`, those `bench dspark` does not define already."""
    from .workloads import WORKLOADS
    p.add_argument("--frontend", choices=("engine", "http"), default="engine",
                   help="the engine in-process (add_request/step), or serve.py over HTTP with streaming")
    p.add_argument("--drafter", default=None, help="drafter checkpoint (default: the model's own)")
    p.add_argument("--systems", nargs="+", default=None if dspark else list(DEFAULT_SYSTEMS),
                   help=f"systems to compare, from {', '.join(SYSTEMS)} (static-b: an A/A control; "
                        f"default {' '.join(DEFAULT_SYSTEMS)})")
    if not dspark:
        p.add_argument("--model", default=None, help="target checkpoint (default: the embedded pair)")
        p.add_argument("--cost-table", default=None, help="step-cost profile for compact (`bench profile`)")
        p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64, 128, 256],
                       help="requests held in flight (closed-loop clients), one run each")
        p.add_argument("--workloads", nargs="+", default=["mix"], choices=WORKLOADS,
                       help="prompt sets (mix: all four interleaved)")
        p.add_argument("--repeats", type=int, default=1, help="rounds per point; the order rotates each round")
        p.add_argument("--temperature", type=float, default=0.0,
                       help="sampling temperature of every request (0: greedy)")
        p.add_argument("--prompt-tokens", type=int, default=256, help="prompts are cut to their last N tokens")
        p.add_argument("--data-dir", default=None, help="workload data; none: $NANODSPARK_DATA, else ../shared/data")
        p.add_argument("--kv-gb", type=float, default=4.0, help="KV cache memory per engine (GB)")
        p.add_argument("--out", default="", help="JSON of every run (and a Pareto PNG beside it)")
        p.add_argument("--output-len", type=int, default=128, help="mean output tokens per request (ignore_eos)")
    p.add_argument("--output-spread", type=float, default=0.25,
                   help="output lengths uniform in mean * [1 - spread, 1 + spread] (0: all equal)")
    p.add_argument("--prompts", type=int, default=400, help="distinct prompts cycled through")
    p.add_argument("--warmup-s", type=float, default=3.0, help="seconds of load before the window")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of the measured window")
    p.add_argument("--num-requests", type=int, default=0,
                   help="measure the first N requests sent after the warm-up instead of --duration")
    p.add_argument("--percentiles", type=float, nargs="+", default=[50, 90, 99],
                   help="latency percentiles reported (TTFT, TPOT, ITL)")
    p.add_argument("--max-num-seqs", type=int, default=0, help="engine slots (default: the largest concurrency)")
    p.add_argument("--max-num-batched-tokens", type=int, default=0, help="token budget per step (0: the engine's)")
    p.add_argument("--warmup-round-s", type=float, default=3.0,
                   help="engine front end: seconds each engine serves, unmeasured, before the sweep")
    p.add_argument("--max-waiting-steps", default="auto",
                   help="steps an arrival may wait for an admission wave (auto: the engine's; 0: admit at once)")
    p.add_argument("--prefix-cache", action="store_true",
                   help="keep the prefix cache on (off by default: a closed loop repeats its prompts)")
    p.add_argument("--eager-prefill", action="store_true",
                   help="prefill forwards run eagerly, not from CUDA graphs (an A/B of cuda_graph_prefill)")
    p.add_argument("--stream-text", action="store_true",
                   help="engine front end: detokenize in the step, every step (default: the engine decodes "
                        "no text, as serve.py's engine core)")
    p.add_argument("--record-traces", default=None, metavar="DIR",
                   help="engine front end: write acceptance traces (simulator input) of each speculative "
                        "system's first round to DIR/<system>_<workload>_c<C>.npz")
    p.add_argument("--url", default=None, help="http: a running server (one system)")
    p.add_argument("--spawn", action="store_true", help="http: start one serve.py per system, wait for /health")
    p.add_argument("--serve-cmd", default=None,
                   help="http: the command that starts a server, with {port} and {flags} (the system's flags)")
    p.add_argument("--api-server-count", type=int, default=1, metavar="N",
                   help="http --spawn: serve.py's API processes in front of its engine core")
    p.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for /health")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="http: seconds before one request counts as an error")
    p.add_argument("--budget-s", type=float, default=0.0, help="start no run after this many seconds (0: no limit)")
    p.add_argument("--seed", type=int, default=0, help="seed of the output lengths")
    from .shapes import SHAPES
    p.add_argument("--shape", default=None, choices=sorted(SHAPES), help="engine front end: a model shape with random weights "
                   "(lab/shapes.py: qwen3-8b, qwen3-30b-a3b) instead of a checkpoint; its drafts are never "
                   "accepted unless --synthetic-acceptance says how")
    p.add_argument("--synthetic-acceptance", default=None, metavar="LO:HI",
                   help="with --shape: each request accepts a draft with its own rate, uniform in [LO, HI] "
                        "(EngineConfig.synthetic_acceptance; output is not the target's)")


def add_dspark_args(p) -> None:
    """`bench dspark`: the economics sweep, in steady state through this harness (the engine
    front end, the A/A control always in); `--traffic burst` runs the former benchmark, each
    point a batch of C requests (bench_engine.py), for which `--min-requests` and `--aa` are meant."""
    from .bench_engine import add_dspark_args as add_burst_args
    add_burst_args(p)
    p.add_argument("--traffic", choices=("steady", "burst"), default="steady",
                   help="steady: closed-loop clients (`bench serve`'s harness); burst: each point a batch of C")
    add_serve_args(p, dspark=True)
    p.set_defaults(workloads=None, repeats=None)    # steady: mix, one round; burst: its own (below)


BURST_DEFAULTS = {"workloads": ["mix", "math", "chat", "poetry", "code"], "repeats": 3}
def dspark(args) -> dict:
    from . import bench_engine as be
    if args.traffic == "burst":
        return be.dspark_bench(argparse_namespace(args, workloads=args.workloads or BURST_DEFAULTS["workloads"],
                                                  repeats=args.repeats or BURST_DEFAULTS["repeats"]))
    systems = args.systems or list(DEFAULT_SYSTEMS) + (["compact-no-trim"] if args.no_trim else [])
    args = argparse_namespace(args, workloads=args.workloads or ["mix"], repeats=args.repeats or 1)
    ns = argparse_namespace(args, systems=systems, output_len=args.max_tokens)
    res = serve_bench(ns) if args.concurrency else {"sweep": []}
    if args.mixed_requests:
        from ..sampling import SamplingParams
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0, ignore_eos=True)
        res["mixed_traffic_cap_accept"] = be.mixed_traffic(args, params)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    return res


def argparse_namespace(args, **over):
    import argparse
    return argparse.Namespace(**{**vars(args), **over})


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # the HTTP client forks no workers
