"""Prometheus metrics of one server: requests, tokens, latency, KV blocks and DSpark counters.

The idea
--------
`Metrics` owns its *own* `CollectorRegistry`, so two servers in one process (the tests start
several) never share or collide on a metric. Nothing reads engine internals behind the server's
back: the API side's `OutputProcessor` (outputs.py, on the event loop, never on the engine's
step) feeds each request's tokens to `on_tokens` and its end to `on_finish`, and every
`EngineState` the engine side sends (queue lengths, KV usage, DSpark and EPLB summaries, device
memory) to `set_engine_state`. The HTTP layer counts answered requests with `count_request`.
`render()` returns the Prometheus text exposition; with several API processes each writes its
series to a shared folder (`share`) and any of them answers for all (`merge_expositions`).

The process is measured too: prometheus_client's `process_*` series (memory, CPU seconds, open
files; Linux only) describe the API server's process(es), and
`nanodspark_engine_core_resident_memory_bytes` the engine-core process (when the engine runs in
one, core.py); on CUDA, `nanodspark_device_memory_bytes` (allocated and reserved by torch's
caching allocator, in the engine's process). `nanodspark_requests_in_flight` is the server's own
count of accepted requests whose handler has not ended (the `--max-queue` count): after a load
it must return to 0, or a request is stuck.

Speculative counters come with every row of tokens (the request's `SpecStats`, cumulative).
Each row contributes the *difference* to the previous row of the same request. That keeps the
counters live while a request runs and lets one verify step be recovered exactly: a row whose
`steps` grew by one carries that step's window (`verified` grew by the window), which feeds the
window histogram.

Cheap per row: `on_tokens` adds to plain sums and lists; `flush()` (after each delivery, and
first in every scrape) adds them to the series. The histograms are `BulkHistogram`s (numpy
buckets; `observe(v, n)` is one entry) with prometheus_client's `_bucket`/`_sum`/`_count` series.

Invariants
----------
* Per-request bookkeeping (`_live`) is touched only by the event loop; an entry exists from
  `request_started` until `on_finish` (or `forget`), then it is dropped.
* Counters only grow; the τ gauge is committed / steps over every verify step seen so far.
* Label sets are bounded: endpoints are a fixed list (anything else is `other`), KV groups come
  from the engine, finish reasons from the engine's few values (stop, length, abort, error).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/version", "/tokenize",
             "/detokenize")
SPEC_KEYS = ("steps", "drafted", "verified", "accepted", "committed")   # the first counters of a row's spec

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
WINDOW_BUCKETS = tuple(range(0, 33))  # draft tokens verified in one step: 0, 1, ..., 32


class BulkHistogram:
    """A Prometheus histogram (a collector in `registry`) whose observations are buffered in
    lists and counted into buckets by numpy when read: `observe(value, n)` is two appends."""

    def __init__(self, name: str, documentation: str, buckets, registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self.bounds = np.asarray(buckets, dtype=float)
        self.counts = np.zeros(len(self.bounds) + 1, dtype=np.int64)   # the last one is +Inf
        self.sum = 0.0
        self._values: list[float] = []
        self._weights: list[int] = []
        registry.register(self)

    def observe(self, value: float, n: int = 1) -> None:
        self._values.append(value)
        self._weights.append(n)
        if len(self._values) >= 1 << 16:     # no scrape for a long while: bound the buffer
            self.fold()

    def fold(self) -> None:
        if not self._values:
            return
        v, w = np.asarray(self._values, dtype=float), np.asarray(self._weights, dtype=np.int64)
        self._values, self._weights = [], []
        np.add.at(self.counts, np.searchsorted(self.bounds, v, side="left"), w)   # le: v <= bound
        self.sum += float(v @ w)

    def _family(self, cumulative) -> HistogramMetricFamily:
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        return HistogramMetricFamily(self.name, self.documentation, buckets=list(zip(les, cumulative)),
                                     sum_value=self.sum)

    def describe(self):
        return [self._family([0] * (len(self.bounds) + 1))]

    def collect(self):
        self.fold()
        return [self._family(np.cumsum(self.counts).tolist())]


@dataclass
class _Track:
    """What the metrics remember about one live request."""
    arrival: float
    first: float | None = None     # time of its first generated token
    last: float = 0.0              # time of its latest generated token
    spec: tuple = (0,) * len(SPEC_KEYS)   # its SpecStats counters at the previous row


class Metrics:
    def __init__(self, prefix: str = "nanodspark"):
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)   # process_resident_memory_bytes and friends, at scrape time
        p = prefix + "_"
        self.in_flight = Gauge(p + "requests_in_flight", "Accepted requests whose handler has not ended",
                               registry=r)
        self.device_memory = Gauge(p + "device_memory_bytes", "Device memory held by torch in the engine's "
                                   "process (allocated, reserved); CUDA only", ["kind"], registry=r)
        self.core_memory = None        # created by the first EngineState from an engine-core process
        self._prefix = p
        # HTTP and request lifecycle
        self.requests = Counter(p + "requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "code"], registry=r)
        self.finished = Counter(p + "requests_finished", "Generation requests finished, by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.ttft = BulkHistogram(p + "time_to_first_token_seconds", "Arrival to first generated token",
                                  TTFT_BUCKETS, r)
        self.itl = BulkHistogram(p + "inter_token_latency_seconds",
                                 "Time between generated tokens of one request (per token)", ITL_BUCKETS, r)
        self.e2e = BulkHistogram(p + "request_latency_seconds", "Arrival to finish of a generation request",
                                 E2E_BUCKETS, r)
        # where a request's time to first token goes before the engine sees it (arrival = submission)
        self.prepare = BulkHistogram(p + "request_prepare_seconds", "Handler start to submission: read, parse, "
                                     "check and tokenize the body", TTFT_BUCKETS, r)
        self.admission = BulkHistogram(p + "request_admission_seconds", "Submission to the engine's acceptance: "
                                       "the pipe, the engine loop's inbox, the step in flight", TTFT_BUCKETS, r)
        # ... and inside the engine (vLLM's names), observed when the request finishes
        self.queue_time = BulkHistogram(p + "request_queue_time_seconds", "In the engine's waiting queue: "
                                        "its arrival there to its first admission", TTFT_BUCKETS, r)
        self.prefill_time = BulkHistogram(p + "request_prefill_time_seconds", "First admission to the first "
                                          "token committed: the prefill's steps", TTFT_BUCKETS, r)
        # engine state
        self.running = Gauge(p + "requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge(p + "requests_waiting", "Requests queued in the engine", registry=r)
        self.kv_blocks = Gauge(p + "kv_blocks", "KV cache blocks per KV group and state (used, free)",
                               ["group", "state"], registry=r)
        # DSpark speculative decoding
        self.spec = {
            "steps": Counter(p + "spec_verify_steps", "Speculative verify steps (one per request and step)", registry=r),
            "drafted": Counter(p + "spec_drafted_tokens", "Draft tokens produced by the drafter", registry=r),
            "verified": Counter(p + "spec_verified_tokens", "Draft tokens the target verified", registry=r),
            "accepted": Counter(p + "spec_accepted_tokens", "Draft tokens accepted", registry=r),
            "committed": Counter(p + "spec_committed_tokens", "Tokens committed by verify steps", registry=r),
        }
        self.position_acceptance = Gauge(p + "spec_position_acceptance",
                                         "Conditional acceptance of draft position k given k-1 accepted",
                                         ["position"], registry=r)
        self.online_ece = Gauge(p + "spec_online_ece", "Running ECE of the cumulative survival at position k",
                                ["position"], registry=r)
        self.step_time = Gauge(p + "spec_step_time_seconds",
                               "Mean speculative step time: predicted by the cost table, measured",
                               ["kind"], registry=r)
        self.ceiling = Gauge(p + "spec_tokens_per_step", "Committed tokens per verify step: delivered, and "
                             "the estimated full-block ceiling (block-accept estimator)", ["kind"], registry=r)
        self.utilisation = Gauge(p + "spec_utilisation", "Delivered tokens per step / estimated ceiling",
                                 registry=r)
        self.tau = Gauge(p + "spec_tau", "Committed tokens per verify step, over all steps so far", registry=r)
        self.window = BulkHistogram(p + "spec_verify_window_tokens", "Draft tokens verified per verify step",
                                    WINDOW_BUCKETS, r)
        # EPLB (eplb.py): balance of the expert load over the simulated EP ranks, last window
        self.eplb_balancedness = Gauge(p + "eplb_balancedness", "Mean over MoE layers of mean_r(load_r) / "
                                       "max_r(load_r) over the EP ranks r, in the recorder's window (1 = perfect)",
                                       registry=r)
        self.eplb_straggler = Gauge(p + "eplb_straggler_factor",
                                    "Mean over MoE layers of max_r(load_r) / mean_r(load_r)", registry=r)
        self.eplb_layer_balancedness = Gauge(p + "eplb_layer_balancedness",
                                             "mean_r / max_r of one MoE layer's rank load", ["layer"], registry=r)
        self.eplb_rank_load = Gauge(p + "eplb_rank_load_tokens", "(token, expert) pairs routed to the slots of one EP "
                                    "rank in the window, summed over MoE layers", ["rank"], registry=r)
        self.eplb_rebalances = Gauge(p + "eplb_rebalances", "Rebalances of the expert placement so far", registry=r)
        self.eplb_rebalance_seconds = Gauge(p + "eplb_last_rebalance_seconds", "Wall time of the last rebalance "
                                            "(read the window, place, move the weights)", registry=r)
        self._shared: tuple[Path, int] | None = None   # (folder, this API process's index)
        self._tau_committed = 0
        self._tau_steps = 0
        self._live: dict[str, _Track] = {}
        self._tokens = 0                           # generated since the last flush
        self._spec_sums = [0] * len(SPEC_KEYS)     # the spec counters' growth since the last flush

    # -- called by the HTTP layer ---------------------------------------------------------------
    def track_inflight(self, count) -> None:
        """`count()` is read at each scrape as `requests_in_flight`."""
        self.in_flight.set_function(count)

    def count_request(self, endpoint: str, code: int) -> None:
        self.requests.labels(endpoint if endpoint in ENDPOINTS else "other", str(code)).inc()

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type (of every API process, when shared)."""
        own = self.write_share()
        if self._shared is None:
            return own, CONTENT_TYPE_LATEST
        folder, index = self._shared
        others = []
        for f in sorted(folder.glob("api-*.prom")):
            if f.name != f"api-{index}.prom":
                try:
                    others.append(f.read_bytes())
                except OSError:      # being replaced this instant: the next scrape has it
                    pass
        return merge_expositions(own, others), CONTENT_TYPE_LATEST

    SHARE_INTERVAL_S = 0.25    # how stale another API process's series may be in a scrape

    def share(self, folder, index: int) -> None:
        """This is API process `index` of several: its series go to `folder` (see the module)."""
        self._shared = (Path(folder), index)

    @property
    def shared(self) -> bool:
        return self._shared is not None

    def write_share(self) -> bytes:
        """Flush, and (when shared) write this process's exposition for the others; returns it."""
        self.flush()
        own = generate_latest(self.registry)
        if self._shared is not None:
            folder, index = self._shared
            tmp = folder / f".api-{index}.prom.tmp"
            tmp.write_bytes(own)
            os.replace(tmp, folder / f"api-{index}.prom")   # a reader sees the old file or the new one
        return own

    def flush(self) -> None:
        """Add what the rows since the last flush summed up to the Prometheus series."""
        if self._tokens:
            self.generation_tokens.inc(self._tokens)
            self._tokens = 0
        if any(self._spec_sums):
            for k, d in zip(SPEC_KEYS, self._spec_sums):
                if d > 0:
                    self.spec[k].inc(d)
            self._spec_sums = [0] * len(SPEC_KEYS)
            if self._tau_steps:
                self.tau.set(self._tau_committed / self._tau_steps)

    # -- called by the OutputProcessor (the event loop) --------------------------------------------
    def request_started(self, request_id: str, arrival: float, received: float | None = None) -> None:
        """The engine accepted, now, a request submitted at `arrival` (its handler began at `received`)."""
        self._live[request_id] = _Track(arrival)
        if received is not None:
            self.prepare.observe(arrival - received)
            self.admission.observe(time.monotonic() - arrival)

    def engine_waits(self, queue: float, prefill: float) -> None:
        """A finished request's time in the engine's queue and in its prefill (the engine's clock)."""
        self.queue_time.observe(queue)
        self.prefill_time.observe(prefill)

    def on_tokens(self, request_id: str, n: int, spec: tuple = (), now: float | None = None) -> None:
        """Account `n` new tokens of a request (latency) and its speculative counters so far."""
        now = time.monotonic() if now is None else now
        t = self._live.get(request_id)
        if t is None:  # a request the server did not announce: account it from now on
            t = self._live[request_id] = _Track(now)
        if n:
            self._tokens += n
            if t.first is None:
                t.first = now
                self.ttft.observe(now - t.arrival)
            else:
                self.itl.observe((now - t.last) / n, n)
            t.last = now
        if spec:
            self._spec_delta(t, spec[:len(SPEC_KEYS)])

    def on_finish(self, request_id: str, reason: str, num_prompt_tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        t = self._live.pop(request_id, None)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.finished.labels(reason or "unknown").inc()
        if t is not None:
            self.e2e.observe(now - t.arrival)

    def _spec_delta(self, t: _Track, spec: tuple) -> None:
        delta = [a - b for a, b in zip(spec, t.spec)]
        t.spec = spec
        self._spec_sums = [s + max(d, 0) for s, d in zip(self._spec_sums, delta)]
        steps, verified, committed = delta[0], delta[2], delta[4]
        if steps > 0:  # normally one step per row; spread evenly if several were merged
            self.window.observe(verified / steps, steps)
            self._tau_steps += steps
            self._tau_committed += committed

    def forget(self, request_id: str) -> None:
        """Drop a request that never produced a finished output (refused or failed)."""
        self._live.pop(request_id, None)

    def set_engine_state(self, num_running: int, num_waiting: int, kv_usage: dict,
                         spec_summary: dict | None = None, eplb_summary: dict | None = None,
                         device_memory: tuple[int, int] | None = None, core_resident_bytes: int | None = None) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        if spec_summary:
            self._set_spec_summary(spec_summary)
        if eplb_summary:
            self._set_eplb_summary(eplb_summary)
        for group, u in kv_usage.items():
            self.kv_blocks.labels(group, "used").set(u["used"])
            self.kv_blocks.labels(group, "free").set(u["free"])
        if device_memory is not None:
            self.device_memory.labels("allocated").set(device_memory[0])
            self.device_memory.labels("reserved").set(device_memory[1])
        if core_resident_bytes is not None:
            if self.core_memory is None:   # absent when the engine runs in the server's process
                self.core_memory = Gauge(self._prefix + "engine_core_resident_memory_bytes",
                                         "Resident memory of the engine-core process", registry=self.registry)
            self.core_memory.set(core_resident_bytes)

    def _set_spec_summary(self, summary: dict) -> None:
        """Engine-level DSpark gauges (SpecDecoder.summary): per-position conditional acceptance,
        online ECE of the cumulative survival, and the step time predicted by the cost table
        next to the measured one."""
        for k, a in enumerate(summary.get("position_acceptance") or []):
            if a is not None:
                self.position_acceptance.labels(str(k + 1)).set(a)
        for k, e in enumerate(summary.get("online_ece") or []):
            if e is not None:
                self.online_ece.labels(str(k + 1)).set(e)
        c = summary.get("ceiling")
        if c:
            self.ceiling.labels("ceiling").set(c["tau"])
            self.ceiling.labels("delivered").set(c["delivered"])
            self.utilisation.set(c["utilisation"])
        for kind in ("predicted", "measured"):
            v = summary.get(f"step_time_{kind}_s")
            if v is not None:
                self.step_time.labels(kind).set(v)

    def _set_eplb_summary(self, summary: dict) -> None:
        """Expert load balance (ExpertBalancer.summary): per-layer and mean balancedness, the
        straggler factor, per-rank load, and the rebalances so far."""
        if summary.get("balancedness") is not None:
            self.eplb_balancedness.set(summary["balancedness"])
            self.eplb_straggler.set(summary["straggler"])
        for layer, b in enumerate(summary.get("balancedness_per_layer") or []):
            if b is not None:
                self.eplb_layer_balancedness.labels(str(layer)).set(b)
        for rank, load in enumerate(summary.get("rank_load") or []):
            self.eplb_rank_load.labels(str(rank)).set(load)
        self.eplb_rebalances.set(summary.get("rebalances", 0))
        last = summary.get("last_rebalance")
        if last:
            self.eplb_rebalance_seconds.set(last["seconds"])


# Gauges that are a sum over the API processes; every other gauge is the engine's (each process
# hears the same state), taken from the process that answers the scrape.
SUMMED_GAUGES = ("nanodspark_requests_in_flight", "process_resident_memory_bytes", "process_virtual_memory_bytes",
                 "process_open_fds")


def merge_expositions(own: bytes, others: list[bytes]) -> bytes:
    """One exposition for several API processes: counter and histogram samples summed (their
    `_created` the earliest), the gauges of `SUMMED_GAUGES` summed, `process_start_time_seconds`
    the earliest, other gauges `own`'s (else the first that has them); `spec_tau` recomputed as
    committed / verify steps of the summed counters."""
    families: dict[str, dict] = {}
    for text in (own, *others):
        fam = None
        for line in text.decode().splitlines():
            if line.startswith("# "):
                _, what, name, rest = (line.split(" ", 3) + [""])[:4]
                if name not in families:
                    families[name] = {"head": [], "type": "untyped", "samples": {}, "from": id(text)}
                fam = families[name]
                if fam["from"] == id(text):
                    fam["head"].append(line)
                if what == "TYPE":
                    fam["type"] = rest
                continue
            if not line or fam is None:
                continue
            key, _, value = line.rpartition(" ")
            v, samples = float(value), fam["samples"]
            if key not in samples:
                samples[key] = v
            elif key.partition("{")[0].endswith("_created") or key.startswith("process_start_time_seconds"):
                samples[key] = min(samples[key], v)
            elif fam["type"] in ("counter", "histogram", "summary") or key.partition("{")[0] in SUMMED_GAUGES:
                samples[key] += v
    tau = families.get("nanodspark_spec_tau")
    steps = families.get("nanodspark_spec_verify_steps", {}).get("samples", {}).get("nanodspark_spec_verify_steps_total")
    committed = families.get("nanodspark_spec_committed_tokens", {}).get("samples", {}).get(
        "nanodspark_spec_committed_tokens_total")
    if tau is not None and steps and committed is not None:
        tau["samples"]["nanodspark_spec_tau"] = committed / steps
    lines = []
    for fam in families.values():
        lines += fam["head"]
        lines += [f"{k} {floatToGoString(v)}" for k, v in fam["samples"].items()]
    return ("\n".join(lines) + "\n").encode()
