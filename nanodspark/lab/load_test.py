"""A bounded load-and-fault run against a running server, over HTTP (walkthrough chapter 08 §10).

    python -m nanodspark.lab.load_test --url http://127.0.0.1:8000 --requests 2000 --concurrency 64 \\
        --stream-fraction 0.5 --faults 200 --out result.json

The idea
--------
A server is hardened when one bad request fails only itself, nothing freezes, and memory stays
flat. This command checks all three from outside, as a client would, in five phases:

1. **reference**: `--reference` greedy prompts, one at a time, on the idle server;
2. **warm-up**: `--warmup` ordinary requests, then the server's resident memory is read ("start");
3. **load**: `--requests` ordinary requests at `--concurrency`, a `--stream-fraction` of them
   streamed, half completions and half chat, with `--faults` bad requests (`FAULTS`: broken and
   deeply nested JSON, lone surrogates, an oversized body, a prompt that cannot fit, context
   overflow, bad and unsupported fields, a wrong model, a temperature of 1e-38, streams and
   non-streaming requests abandoned halfway) spread among them;
4. **after**: the reference prompts again (greedy output must be identical after the storm),
   then a wait until the server is idle (`/metrics`: nothing running, waiting or in flight);
5. **report**: errors (any 5xx, exception or unexpected status of an ordinary request; a fault
   answered with a status other than the expected one is a `fault_mismatch`), p50/p99 latency and
   time to first token, output tokens/s, KV blocks still used when idle ("leaked"), resident
   memory (and device memory on CUDA) at start and end, written as JSON to `--out`.

Memory comes from the server's own `/metrics` (`process_resident_memory_bytes` of the API
process, plus `nanodspark_engine_core_resident_memory_bytes` of the engine-core process when there
is one, and `nanodspark_device_memory_bytes`); for a server that does not export them,
`--server-pid` reads `/proc/PID/statm` instead (same machine only).

Invariants
----------
* Self-contained: the standard library and `httpx`, nothing of the engine or the server, so it
  runs on any machine that can reach the server (`from nanodspark.lab import load_test` also
  works in-process: `run(Options(...))`, as tests/test_hardening.py does).
* Bounded: every request has `--request-timeout`; no request starts after `--time-limit`
  seconds (those not started are counted as `skipped`); the idle wait is at most 60 s.
* Deterministic given `--seed`: the same prompts, parameters and fault positions.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

from .bench_serve import parse_metrics

WORDS = ("the cat sat on a mat while seven ships sailed north past quiet harbours and old lighthouses "
         "under a grey sky full of rain as the keeper counted waves and wrote numbers in a book").split()


@dataclass
class Options:
    url: str = "http://127.0.0.1:8000"
    requests: int = 300
    concurrency: int = 32
    stream_fraction: float = 0.5
    faults: int = 40
    warmup: int = 20
    reference: int = 4
    max_tokens: int = 16            # ordinary requests draw max_tokens from [1, this]
    oversize_mb: float = 21.0       # the oversized body (the 21 MB)
    request_timeout: float = 120.0
    time_limit: float = 900.0       # no request starts after this many seconds
    seed: int = 0
    server_pid: int | None = None
    skip_faults: tuple = ()         # fault names left out (e.g. tiny_temperature on an engine without GREEDY_BELOW)
    out: str | None = None


@dataclass
class Tally:
    """What the load phase saw."""
    ok: int = 0
    errors: dict = field(default_factory=dict)          # kind -> count (ordinary requests)
    error_samples: list = field(default_factory=list)
    faults: dict = field(default_factory=dict)          # fault -> {status: count}
    fault_mismatch: int = 0
    skipped: int = 0
    latency: list = field(default_factory=list)         # seconds, ordinary requests that succeeded
    ttft: list = field(default_factory=list)            # seconds, ordinary streams
    tokens: int = 0

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        if len(self.error_samples) < 10:
            self.error_samples.append(f"{kind}: {detail[:300]}")


def prompt_text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 16)))


# ----------------------------------------------------------------------------- metrics
def _sum(m: dict, prefix: str, *must: str) -> float | None:
    vals = [v for k, v in m.items() if k.startswith(prefix) and all(s in k for s in must)]
    return sum(vals) if vals else None


async def scrape(c: httpx.AsyncClient) -> dict:
    r = await c.get("/metrics", timeout=30)
    return parse_metrics(r.text) if r.status_code == 200 else {}


def rss_from_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


async def memory(c: httpx.AsyncClient, opts: Options) -> dict:
    """The server's memory: its API process (`process_resident_memory_bytes`) plus, when the engine
    runs in a process of its own, the engine core (`nanodspark_engine_core_resident_memory_bytes`)."""
    m = await scrape(c)
    api = m.get("process_resident_memory_bytes")
    if opts.server_pid is not None:
        api = rss_from_pid(opts.server_pid) or api
    core = m.get("nanodspark_engine_core_resident_memory_bytes")
    rss = api + core if api is not None and core is not None else api
    return {"resident_bytes": rss, "api_resident_bytes": api, "core_resident_bytes": core,
            "device_allocated_bytes": m.get('nanodspark_device_memory_bytes{kind="allocated"}'),
            "device_reserved_bytes": m.get('nanodspark_device_memory_bytes{kind="reserved"}')}


async def wait_idle(c: httpx.AsyncClient, timeout: float = 60.0) -> dict:
    """Poll /metrics until nothing runs, waits or is in flight; return the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        m = await scrape(c)
        busy = [m.get(k) or 0 for k in ("nanodspark_requests_running", "nanodspark_requests_waiting",
                                         "nanodspark_requests_in_flight")]
        if not any(busy) or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.1)


# ----------------------------------------------------------------------------- requests
def ordinary_body(rng: random.Random, model: str, max_tokens: int, stream: bool) -> tuple[str, dict]:
    body = {"model": model, "max_tokens": rng.randint(1, max_tokens), "temperature": rng.choice([0, 0.7]),
            "seed": rng.randrange(2**31)}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt_text(rng)}]}
    return "/v1/completions", {**body, "prompt": prompt_text(rng)}


async def send(c: httpx.AsyncClient, path: str, body, timeout: float) -> tuple[int, dict | None, float, float | None]:
    """POST `body` (a dict as JSON, or raw bytes): (status, final usage or error, seconds, TTFT)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    stream = isinstance(body, dict) and body.get("stream")
    t0 = time.monotonic()
    ttft = None
    async with c.stream("POST", path, content=content, headers={"content-type": "application/json"},
                        timeout=timeout) as r:
        if r.status_code != 200 or not stream:
            data = await r.aread()
            try:
                payload = json.loads(data)
            except ValueError:
                payload = {"raw": data[:200].decode(errors="replace")}
            return r.status_code, payload, time.monotonic() - t0, None
        last = None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            ev = json.loads(line[6:])
            if "error" in ev:
                return 500, ev, time.monotonic() - t0, ttft
            if ttft is None and any((ch.get("text") or (ch.get("delta") or {}).get("content"))
                                    for ch in ev.get("choices", [])):
                ttft = time.monotonic() - t0
            last = ev
        return 200, last, time.monotonic() - t0, ttft


async def ordinary(c, rng, opts: Options, model: str, tally: Tally) -> None:
    stream = rng.random() < opts.stream_fraction
    path, body = ordinary_body(rng, model, opts.max_tokens, stream)
    try:
        status, payload, dt, ttft = await send(c, path, body, opts.request_timeout)
    except httpx.HTTPError as e:
        return tally.error(type(e).__name__, repr(e))
    if status != 200:
        return tally.error(f"status_{status}", json.dumps(payload))
    usage = (payload or {}).get("usage") or {}
    tally.ok += 1
    tally.tokens += usage.get("completion_tokens", 0)
    tally.latency.append(dt)
    if ttft is not None:
        tally.ttft.append(ttft)


class Faults:
    """The bad requests: name -> (expected statuses, how to send it). `None` in the expected set
    means the client itself gives up (a disconnect), which is what that fault does."""

    _oversize: dict = {}   # size -> body, built once per process (runs in one process share it)

    def __init__(self, model: str, max_model_len: int, oversize_mb: float):
        self.model, self.ctx = model, max_model_len
        self.oversize_mb = oversize_mb

    def oversize(self) -> bytes:
        n = int(self.oversize_mb * 1e6)
        if n not in self._oversize:
            self._oversize.clear()
            self._oversize[n] = b'{"prompt": "' + b"word " * (n // 5) + b'", "max_tokens": 4}'
        return self._oversize[n]

    def table(self) -> dict:
        m, ctx = self.model, self.ctx
        long_text = "word " * (ctx * 64 // 5 + 1)       # longer than any prompt of ctx tokens can be
        p = {"model": m, "prompt": "hello there", "max_tokens": 4}
        return {
            "not_json": ({400}, "/v1/completions", b"{not json"),
            "deep_json": ({400}, "/v1/completions", b"[" * 100_000),
            "deep_json_field": ({400}, "/v1/completions", b'{"prompt": "hi", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
            "lone_surrogate_prompt": ({400}, "/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 4}'),
            "lone_surrogate_chat": ({400}, "/v1/chat/completions",
                                    b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 4}'),
            "oversize_body": ({413}, "/v1/completions", None),
            "long_prompt": ({400, 413}, "/v1/completions", {**p, "prompt": long_text}),
            "context_overflow": ({400}, "/v1/completions", {**p, "max_tokens": ctx}),
            "bad_param": ({400}, "/v1/completions", {**p, "temperature": -1}),
            "unsupported": ({400}, "/v1/completions", {**p, "n": 2}),
            "wrong_model": ({404}, "/v1/completions", {**p, "model": "no-such-model"}),
            "tiny_temperature": ({200}, "/v1/completions", {**p, "temperature": 1e-38, "max_tokens": 8}),
            "stream_disconnect": ({None}, "/v1/completions",
                                  {**p, "max_tokens": max(1, min(ctx // 2, 400)), "ignore_eos": True, "stream": True}),
            "timeout_disconnect": ({None}, "/v1/completions",
                                   {**p, "max_tokens": max(1, min(ctx // 2, 400)), "ignore_eos": True}),
        }

    async def run(self, c: httpx.AsyncClient, name: str, opts: Options, tally: Tally) -> None:
        expected, path, body = self.table()[name]
        status = None
        try:
            if name == "oversize_body":
                status, *_ = await send(c, path, self.oversize(), opts.request_timeout)
            elif name == "stream_disconnect":
                async with c.stream("POST", path, content=json.dumps(body).encode(),
                                    headers={"content-type": "application/json"}, timeout=opts.request_timeout) as r:
                    status = r.status_code
                    n = 0
                    async for _ in r.aiter_lines():
                        n += 1
                        if n >= 4:
                            break
                status = None if status == 200 else status   # we hung up, as intended
            elif name == "timeout_disconnect":
                try:
                    status, *_ = await send(c, path, body, 0.3)
                except httpx.TimeoutException:
                    status = None
            else:
                status, *_ = await send(c, path, body, opts.request_timeout)
        except httpx.HTTPError as e:
            status = f"exception:{type(e).__name__}"
        seen = tally.faults.setdefault(name, {})
        seen[str(status)] = seen.get(str(status), 0) + 1
        if status not in expected:
            tally.fault_mismatch += 1
            if isinstance(status, int) and status >= 500:
                tally.error(f"fault_{name}_{status}", "a bad request got a server error")


async def reference_texts(c, model: str, n: int, max_tokens: int, timeout: float) -> list:
    rng = random.Random(12345)
    out = []
    for _ in range(n):
        body = {"model": model, "prompt": prompt_text(rng), "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        try:
            status, payload, *_ = await send(c, "/v1/completions", body, timeout)
            out.append(payload["choices"][0]["text"] if status == 200 else f"<status {status}>")
        except (httpx.HTTPError, KeyError, TypeError) as e:
            out.append(f"<{type(e).__name__}>")
    return out


def percentile(xs: list, q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


# ----------------------------------------------------------------------------- the run
async def run_async(opts: Options) -> dict:
    rng = random.Random(opts.seed)
    t_start = time.monotonic()
    limits = httpx.Limits(max_connections=opts.concurrency + 8, max_keepalive_connections=opts.concurrency + 8)
    async with httpx.AsyncClient(base_url=opts.url, limits=limits, timeout=opts.request_timeout) as c:
        models = (await c.get("/v1/models", timeout=30)).json()["data"]
        model, ctx = models[0]["id"], int(models[0].get("max_model_len") or 4096)
        before = await scrape(c)
        ref_tokens = min(16, max(1, ctx // 4))
        reference = await reference_texts(c, model, opts.reference, ref_tokens, opts.request_timeout)

        warm = Tally()
        await asyncio.gather(*(ordinary(c, random.Random(rng.random()), opts, model, warm)
                               for _ in range(opts.warmup)))
        faults = Faults(model, ctx, opts.oversize_mb)
        if opts.faults:
            faults.oversize()   # built before the memory baseline: it is the client's, not the server's
        mem_start = await memory(c, opts)

        tally = Tally()
        names = sorted(set(faults.table()) - set(opts.skip_faults))
        plan = ["ok"] * opts.requests + [names[i % len(names)] for i in range(opts.faults)]
        rng.shuffle(plan)
        seeds = [rng.random() for _ in plan]
        sem = asyncio.Semaphore(opts.concurrency)
        deadline = t_start + opts.time_limit
        t_load = time.monotonic()

        async def one(kind: str, seed: float):
            async with sem:
                if time.monotonic() > deadline:
                    tally.skipped += 1
                    return
                if kind == "ok":
                    await ordinary(c, random.Random(seed), opts, model, tally)
                else:
                    await faults.run(c, kind, opts, tally)

        await asyncio.gather(*(one(k, s) for k, s in zip(plan, seeds)))
        load_s = time.monotonic() - t_load

        after_ref = await reference_texts(c, model, opts.reference, ref_tokens, opts.request_timeout)
        idle = await wait_idle(c)
        mem_end = await memory(c, opts)

    used = {k: v for k, v in idle.items() if k.startswith("nanodspark_kv_blocks") and 'state="used"' in k}
    ok_codes = _sum(idle, "nanodspark_requests_total", 'code="200"') or 0
    result = {
        "options": asdict(opts),
        "model": model, "max_model_len": ctx,
        "load_seconds": round(load_s, 3),
        "requests_ok": tally.ok, "errors": sum(tally.errors.values()), "errors_by_kind": tally.errors,
        "error_samples": tally.error_samples, "skipped": tally.skipped,
        "faults": tally.faults, "fault_mismatch": tally.fault_mismatch,
        "latency_p50_s": percentile(tally.latency, 0.5), "latency_p99_s": percentile(tally.latency, 0.99),
        "ttft_p50_s": percentile(tally.ttft, 0.5), "ttft_p99_s": percentile(tally.ttft, 0.99),
        "output_tokens": tally.tokens, "output_tokens_per_s": round(tally.tokens / load_s, 2) if load_s else None,
        "greedy_identical_after_faults": reference == after_ref,
        "reference_before": reference, "reference_after": after_ref,
        "leaked_kv_blocks": sum(used.values()) if used else None, "kv_blocks_used_when_idle": used,
        "in_flight_when_idle": idle.get("nanodspark_requests_in_flight"),
        "server_http_200_during_run": ok_codes - (_sum(before, "nanodspark_requests_total", 'code="200"') or 0),
        "memory_start": mem_start, "memory_end": mem_end,
        "resident_growth_bytes": (mem_end["resident_bytes"] - mem_start["resident_bytes"])
        if mem_end["resident_bytes"] and mem_start["resident_bytes"] else None,
        "wall_seconds": round(time.monotonic() - t_start, 3),
    }
    return result


def run(opts: Options) -> dict:
    result = asyncio.run(run_async(opts))
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def summary(r: dict) -> str:
    def mb(b):
        return "n/a" if b is None else f"{b / 2**20:.0f} MiB"

    def ms(s):
        return "n/a" if s is None else f"{s * 1000:.0f} ms"
    return "\n".join([
        f"{r['requests_ok']} ok, {r['errors']} errors {r['errors_by_kind'] or ''}, {r['skipped']} skipped, "
        f"{sum(sum(v.values()) for v in r['faults'].values())} faults ({r['fault_mismatch']} answered unexpectedly)",
        f"latency p50 {ms(r['latency_p50_s'])}, p99 {ms(r['latency_p99_s'])}; TTFT p50 {ms(r['ttft_p50_s'])}, "
        f"p99 {ms(r['ttft_p99_s'])}; {r['output_tokens_per_s']} output tok/s over {r['load_seconds']} s",
        f"greedy identical after the faults: {r['greedy_identical_after_faults']}; leaked KV blocks: "
        f"{r['leaked_kv_blocks']}; in flight when idle: {r['in_flight_when_idle']}",
        f"resident memory {mb(r['memory_start']['resident_bytes'])} -> {mb(r['memory_end']['resident_bytes'])}"
        + (f"; device memory (allocated) {mb(r['memory_start']['device_allocated_bytes'])} -> "
           f"{mb(r['memory_end']['device_allocated_bytes'])}" if r['memory_end']['device_allocated_bytes'] else ""),
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Options()
    ap.add_argument("--url", default=d.url)
    ap.add_argument("--requests", type=int, default=d.requests, help="ordinary requests in the load phase")
    ap.add_argument("--concurrency", type=int, default=d.concurrency)
    ap.add_argument("--stream-fraction", type=float, default=d.stream_fraction)
    ap.add_argument("--faults", type=int, default=d.faults, help="bad requests spread among the load")
    ap.add_argument("--warmup", type=int, default=d.warmup)
    ap.add_argument("--reference", type=int, default=d.reference, help="greedy prompts checked before and after")
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens)
    ap.add_argument("--oversize-mb", type=float, default=d.oversize_mb)
    ap.add_argument("--request-timeout", type=float, default=d.request_timeout)
    ap.add_argument("--time-limit", type=float, default=d.time_limit, help="no request starts after this (s)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--server-pid", type=int, default=None,
                    help="read the server's memory from /proc/PID (when /metrics has no process_* series)")
    ap.add_argument("--skip-faults", default="", help="comma-separated fault names to leave out")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    args.skip_faults = tuple(n for n in args.skip_faults.split(",") if n)
    r = run(Options(**vars(args)))
    print(summary(r))
    bad = r["errors"] or r["fault_mismatch"] or not r["greedy_identical_after_faults"] or r["leaked_kv_blocks"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
