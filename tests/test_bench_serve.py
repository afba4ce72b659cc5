"""The steady-state harness (nanodspark/lab/bench_serve.py): it holds C requests in flight and
measures only the window (a fake engine on a virtual clock, so the figures are exact), its HTTP
client against a fake SSE server and the real one, spawned servers, the sweep's JSON and the
figures. No timing is asserted: the numbers mean something on the GPU."""
import asyncio
import json
import shutil
import sys
from types import SimpleNamespace as NS

import numpy as np
import pytest

from nanodspark.lab import bench_serve as bsv
from nanodspark.lab.bench_serve import ServeWorkload, engine_closed_loop, http_closed_loop, summarize

from test_verify import make_drafter


class FakeEngine:
    """add_request / step / abort / release on a virtual clock: a step takes `dt` seconds (4 dt
    before `slow_s`: a warm-up that must not be measured) and gives every request one token."""

    def __init__(self, dt=1 / 64, slow_s=0.5):
        from nanodspark.engine import PhaseClock
        self.t, self.dt, self.slow_s = 0.0, dt, slow_s
        self.live, self.in_flight, self.aborted, self.released = {}, [], [], []
        self.gamma, self.clock, self.extra_observers = 0, PhaseClock(), []
        self.scheduler, self.windows = NS(preempt=lambda r: None), NS(plan=lambda rs, s: None)

    def now(self):
        return self.t

    def add_request(self, ids, params, request_id, queue_limit=True, stream_text=True):
        self.live[request_id] = [params.max_tokens, 0]

    def step(self):
        self.in_flight.append(len(self.live))
        self.t += self.dt * (4 if self.t < self.slow_s else 1)
        self.clock.steps += 1
        outs = []
        for rid, st in list(self.live.items()):
            st[1] += 1
            done = st[1] == st[0]
            outs.append(NS(request_id=rid, new_token_ids=[7], finished=done, num_output_tokens=st[1], spec={},
                           finish_reason="length" if done else None, error=None))
            if done:
                del self.live[rid]
        return outs

    def has_unfinished(self):
        return bool(self.live)

    def abort(self, rid):
        self.aborted.append(rid)
        self.live.pop(rid, None)

    def release(self, rid):
        self.released.append(rid)


WORK = ServeWorkload([[1, 2, 3], [4, 5]], ["math", "chat"], np.array([5, 9, 6, 8, 7]))


@pytest.mark.parametrize("c", [1, 3, 8])
def test_the_closed_loop_holds_c_in_flight_and_measures_only_the_window(c):
    eng = FakeEngine()
    run = engine_closed_loop(eng, WORK, c, warmup_s=1.0, duration_s=2.0, clock=eng.now)
    assert set(eng.in_flight) == {c}                    # every step, exactly C requests in the engine
    assert all(r.measured == (1.0 <= r.sent < 3.0) for r in run.records)
    s = summarize(run)
    # one token per request per 1/64 s once warm: the slow warm-up is not in the figures
    assert s["total_tok_s"] == c * 64 and s["per_user_tok_s"] == 64.0
    assert s["ttft_ms"]["p50"] == 1e3 / 64 and s["itl_ms"]["p99"] == 1e3 / 64
    assert s["requests_completed"] == s["requests_measured"] == sum(r.measured for r in run.records) > c
    assert s["by_workload"]["math"]["requests"] + s["by_workload"]["chat"]["requests"] == s["requests_completed"]
    # after the window: load kept at C until the last measured request ended, then the tail aborted
    last_end = max(r.end for r in run.records if r.measured)
    assert all(r.sent <= last_end for r in run.records)
    assert sorted(eng.aborted + [f"r{r.index}" for r in run.records if r.end is not None]) == sorted(eng.released)
    assert not eng.live and s["engine_steps"] == 0      # the fake commits through no observer


def test_a_request_count_window_measures_the_first_n_after_the_warm_up():
    eng = FakeEngine()
    run = engine_closed_loop(eng, WORK, 4, warmup_s=1.0, duration_s=0.0, num_requests=10, clock=eng.now)
    measured = [r for r in run.records if r.measured]
    assert len(measured) == 10 and min(r.sent for r in measured) >= 1.0
    assert [r.index for r in measured] == sorted(r.index for r in measured)
    assert run.t1 == max(r.end for r in measured) and summarize(run)["total_tok_s"] == 4 * 64


def test_request_i_is_the_same_work_everywhere():
    w = bsv.output_lengths(128, 0.25, seed=0)
    assert w.min() >= 96 and w.max() <= 160 and len(set(w[:100].tolist())) > 20
    assert (bsv.output_lengths(128, 0.25, seed=0) == w).all() and (bsv.output_lengths(16, 0.0) == 16).all()
    assert WORK.request(7) == ([4, 5], "chat", 6) and WORK.request(2) == ([1, 2, 3], "math", 6)


# ----------------------------------------------------------------------------- HTTP
async def _fake_sse_server(dt: float, stats: dict, fail_every: int = 0):
    """A stdlib HTTP/1.1 server streaming completions as chunked SSE, one event per token."""
    async def handle(reader, writer):
        counted = False
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                headers = {}
                while (h := await reader.readline()) not in (b"\r\n", b""):
                    k, _, v = h.decode().partition(":")
                    headers[k.strip().lower()] = v.strip()
                if line.startswith(b"GET"):       # the client's /metrics scrape: this server has none
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    await writer.drain()
                    return
                stats["connections"] += not counted
                counted = True
                body = json.loads(await reader.readexactly(int(headers["content-length"])))
                stats["requests"] += 1
                if fail_every and stats["requests"] % fail_every == 0:
                    msg = b'{"error": {"message": "bad"}}'
                    writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(msg), msg))
                    await writer.drain()
                    continue
                stats["active"] += 1
                stats["max_active"] = max(stats["max_active"], stats["active"])
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
                n = body["max_tokens"]

                def chunk(obj):
                    data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
                    writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                for k in range(n):
                    await asyncio.sleep(dt)
                    chunk({"choices": [{"text": "x", "finish_reason": "length" if k == n - 1 else None}]})
                    await writer.drain()
                chunk({"choices": [], "usage": {"completion_tokens": n, "speculative": {"steps": n}}})
                chunk(b"[DONE]")
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                stats["active"] -= 1
        except (ConnectionError, asyncio.IncompleteReadError):
            stats["active"] -= 1
        finally:
            writer.close()
    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_http_clients_keep_c_streams_open_on_c_connections():
    stats = {"connections": 0, "requests": 0, "active": 0, "max_active": 0}

    async def main():
        srv = await _fake_sse_server(0.005, stats)
        port = srv.sockets[0].getsockname()[1]
        async with srv:
            return await http_closed_loop(f"http://127.0.0.1:{port}", WORK, 3, warmup_s=0.1, duration_s=0.3)
    run = asyncio.run(main())
    assert stats["max_active"] == 3 and stats["connections"] == 3        # keep-alive: one connection a client
    done = [r for r in run.records if r.measured]
    assert done and all(r.error is None and r.tokens == WORK.request(r.index)[2] for r in done)
    assert all(len(r.chunks) == r.tokens and sum(n for _, n in r.chunks) == r.tokens for r in done)
    s = summarize(run)
    assert s["requests_completed"] == len(done) and s["total_tok_s"] > 0 and s["ttft_ms"]["p50"] > 0
    assert 0 <= s["client_cpu_share"] and "server_ms" not in s        # a server without /metrics: no split


def test_an_http_error_fails_its_request_alone():
    stats = {"connections": 0, "requests": 0, "active": 0, "max_active": 0}

    async def main():
        srv = await _fake_sse_server(0.002, stats, fail_every=3)
        port = srv.sockets[0].getsockname()[1]
        async with srv:
            return await http_closed_loop(f"http://127.0.0.1:{port}", WORK, 2, warmup_s=0.05, duration_s=0.2)
    run = asyncio.run(main())
    bad = [r for r in run.records if r.error]
    assert bad and all("HTTP 400" in r.error for r in bad)
    assert any(r.error is None and r.tokens for r in run.records if r.measured)
    assert summarize(run)["errors"] == sum(1 for r in bad if r.measured)


def test_the_client_streams_from_the_real_server(tiny_dir):
    """Against serve.py's app (uvicorn in a thread, the tiny model): token-id prompts, chunked
    SSE, usage with the speculative counters; the engine is idle and leaks nothing after."""
    from test_server import start_server
    engine, app, srv = start_server(tiny_dir, enable_prefix_cache=False)
    try:
        work = ServeWorkload([[5, 6, 7, 8], [9, 10, 11]], ["math", "chat"], np.array([3, 4, 2]))
        run = asyncio.run(http_closed_loop(srv.base, work, 2, warmup_s=0.05, duration_s=0.3))
    finally:
        srv.stop()
    done = [r for r in run.records if r.end is not None and r.error is None]
    assert done and all(r.tokens == work.request(r.index)[2] for r in done)
    assert all(r.first >= r.sent and r.end >= r.first for r in done)
    assert not [r.error for r in run.records if r.error and r.measured]
    assert all(u["used"] == 0 for u in engine.kv_usage().values())


# ----------------------------------------------------------------------------- servers
def _args(**kw):
    base = dict(cost_table="cost.json", drafter="dr", serve_cmd=None, max_num_seqs=0, concurrency=[1, 64],
                kv_gb=2.0, prefix_cache=False, model="m", max_num_batched_tokens=0)
    return NS(**{**base, **kw})


def test_spawned_servers_get_each_system_its_flags():
    cmd = bsv.serve_command(_args(), "compact", 8123)
    assert cmd[:2] == [sys.executable, str(bsv.REPO_ROOT / "serve.py")]
    s = " ".join(cmd)
    assert "--port 8123" in s and "--max-num-seqs 64" in s and "--no-enable-prefix-cache" in s and "--model m" in s
    assert "--verify-mode compact --cost-table cost.json --drafter-path dr" in s
    assert "--drafter-path none" in " ".join(bsv.serve_command(_args(), "no-spec", 1)) and \
        "cost.json" not in " ".join(bsv.serve_command(_args(), "no-spec", 1))
    assert "--verify-min-gain 1e9" in " ".join(bsv.serve_command(_args(), "compact-no-trim", 1))
    assert "--api-server-count" not in s and \
        "--api-server-count 2" in " ".join(bsv.serve_command(_args(api_server_count=2), "static", 1))
    tmpl = bsv.serve_command(_args(serve_cmd="python serve.py --model x {flags} --port {port}"), "static", 9)
    assert tmpl == ["python", "serve.py", "--model", "x", "--verify-mode", "static", "--cost-table", "cost.json",
                    "--drafter-path", "dr", "--port", "9"]


HEALTH_SERVER = """
import http.server, sys, time
time.sleep(0.3)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_spawned_server_is_ready_when_health_answers_and_its_log_explains_a_failure(tmp_path):
    port = bsv.free_port()
    srv = bsv.ServerProcess([sys.executable, "-c", HEALTH_SERVER, str(port)], port, tmp_path / "ok.log")
    try:
        srv.wait_ready(30)
        assert srv.proc.poll() is None
    finally:
        srv.stop()
    assert srv.proc.poll() is not None
    bad = bsv.ServerProcess([sys.executable, "-c", "import sys; print('no model here'); sys.exit(2)"], port,
                            tmp_path / "bad.log")
    with pytest.raises(RuntimeError, match="(?s)status 2.*no model here"):
        bad.wait_ready(30)
    bad.stop()


# ----------------------------------------------------------------------------- the sweep
def test_serve_sweep_writes_every_run_paired_ratios_the_front_and_a_table(tiny_dir, tmp_path, capsys):
    """`bench serve` (engine front end) on the tiny pair, the A/A control in; dspark-table
    reads its JSON; the Pareto PNG is written beside it."""
    from nanodspark.cost_table import CostTable
    from nanodspark.lab import bench_engine as be
    from nanodspark.lab.bench import build_parser
    model = tmp_path / "pair"
    shutil.copytree(tiny_dir, model)
    make_drafter(model, model / "drafter")
    CostTable({(b, k): 0.01 + 0.002 * k for b in (1, 2) for k in range(0, 4 * b + 1)}, model_name=str(model),
              dtype="torch.float32", device="cpu").save(tmp_path / "cost.json")
    out = tmp_path / "serve.json"
    args = build_parser().parse_args([
        "serve", "--model", str(model), "--cost-table", str(tmp_path / "cost.json"), "--concurrency", "2",
        "--prompts", "8", "--prompt-tokens", "24", "--output-len", "4", "--warmup-s", "0", "--warmup-round-s", "0.2", "--num-requests", "2",
        "--repeats", "2", "--kv-gb", "0.05", "--record-traces", str(tmp_path / "tr"), "--out", str(out)])
    res = bsv.serve_bench(args)
    saved = json.loads(out.read_text())
    systems = ["no-spec", "static", "compact", "static-b"]
    assert {(r["mode"], r["concurrency"]) for r in saved["sweep"]} == {(s, 2) for s in systems}
    import torch
    here = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    assert len(saved["runs"]) == 8 and not saved["partial"] and saved["device"].startswith(here)
    # the order rotates each round: round 0 starts with no-spec, round 1 with static
    firsts = [saved["runs"][i]["mode"] for i in (0, 4)]
    assert firsts == ["no-spec", "static"]
    ratios = {(p["ratio"], p["concurrency"]) for p in saved["paired"]}
    assert {("static-b/static", 2), ("compact/static", 2), ("static/no-spec", 2)} <= ratios
    assert all(r["requests_completed"] == r["requests_measured"] == 2 and r["errors"] == 0 for r in saved["runs"])
    assert all(r["total_tok_s"] > 0 and r["per_user_tok_s"] > 0 for r in saved["runs"])
    assert all(r["accounting"]["steps"] == r["engine_steps"] for r in saved["runs"])
    assert all(0 < r["accounting"]["kv_used_mean"] <= r["accounting"]["kv_used_max"] <= 1 for r in saved["runs"])
    spec = [r for r in saved["runs"] if r["mode"] != "no-spec"]
    assert all(r["accounting"]["verify_rows"] > r["accounting"]["decode_request_steps"] for r in spec)
    assert any(p["on_front"] for p in saved["pareto"])
    md = be.dspark_markdown(res)
    assert "static-b / static (A/A control), paired" in md and "| compact, total tok/s |" in md
    assert out.with_suffix(".pareto.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in (tmp_path / "tr").iterdir()) == sorted(f"{s}_mix_c2.npz" for s in
                                                                          ("compact", "static", "static-b"))
    printed = capsys.readouterr().out
    assert "x no-spec" in printed and printed.rstrip().splitlines()[-1].startswith("Pareto front")


def test_dspark_runs_in_steady_state_with_the_aa_control_or_as_before_in_bursts(monkeypatch):
    from nanodspark.lab import bench_engine as be
    from nanodspark.lab.bench import build_parser
    calls = {}
    monkeypatch.setattr(bsv, "serve_bench", lambda a: calls.setdefault("steady", a) and {"sweep": []})
    monkeypatch.setattr(be, "dspark_bench", lambda a: calls.setdefault("burst", a))
    p = build_parser()
    a = p.parse_args(["dspark", "--cost-table", "t.json", "--concurrency", "4", "--mixed-requests", "0",
                      "--max-tokens", "64", "--no-trim"])
    a.func(a)
    s = calls["steady"]
    assert s.systems == ["no-spec", "static", "compact", "static-b", "compact-no-trim"] and s.output_len == 64
    assert s.frontend == "engine" and s.concurrency == [4] and s.workloads == ["mix"] and s.repeats == 1
    a = p.parse_args(["dspark", "--traffic", "burst", "--min-requests", "16", "--aa"])
    a.func(a)
    b = calls["burst"]
    assert b.min_requests == 16 and b.aa and b.repeats == 3 and b.workloads == ["mix", "math", "chat", "poetry", "code"]


def test_compact_without_a_cost_table_is_refused(tmp_path):
    from nanodspark.lab.bench import build_parser
    a = build_parser().parse_args(["serve", "--concurrency", "1"])
    with pytest.raises(SystemExit, match="compact needs --cost-table"):
        bsv.serve_bench(a)
    a = build_parser().parse_args(["serve", "--frontend", "http", "--systems", "static"])
    with pytest.raises(SystemExit, match="--url"):
        bsv.serve_bench(a)


# ----------------------------------------------------------------------------- figures
def _result(kind=None):
    rows = [{"mode": m, "workload": "mix", "concurrency": c, "per_user_tok_s": 100.0 / c ** 0.5,
             "total_tok_s": t * c} for c in (1, 16, 256) for m, t in (("no-spec", 100), ("static", 150), ("compact", 160))]
    res = {"sweep": rows, "paired": [{"workload": "mix", "concurrency": 16, "ratio": "compact/no-spec",
                                      "median": 1.7, "min": 1.5, "max": 1.8}], "command": "python -m x"}
    if kind:
        res["kind"] = kind
    return res


def test_the_speedup_figure_draws_measured_and_predicted_apart(tmp_path):
    from nanodspark.lab.speedup_figure import ratios, speedup_figure
    assert ratios(_result(), "compact") == [(1, 1.6, 1.6, 1.6), (16, 1.7, 1.5, 1.8), (256, 1.6, 1.6, 1.6)]
    labels = speedup_figure([_result()], [_result("prediction")], str(tmp_path / "f.png"), labels=["tiny", "8B"])
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(labels) == sorted(["static, tiny (measured)", "compact, tiny (measured)", "static, 8B (predicted)",
                                     "compact, 8B (predicted)", "no speculation"])
    with pytest.raises(ValueError, match="no curve"):
        speedup_figure([{"sweep": []}], [], str(tmp_path / "g.png"))


def test_a_shape_with_random_weights_runs_the_sweep_under_a_synthetic_law(tmp_path):
    """`--shape` builds random weights in-process, keyed as `bench profile` keys their table, and
    `--synthetic-acceptance` gives the drafts a law: compact, reading a steep table, verifies
    fewer drafts than static. Without --shape the law is refused (it would change real output)."""
    from nanodspark.cost_table import CostTable
    from nanodspark.lab.bench import build_parser
    CostTable({(b, k): 0.01 + 0.01 * k for b in (1, 2, 4) for k in range(0, 7 * b + 1)},
              model_name="tiny-dense (random weights)", dtype="torch.float32", device="cpu").save(tmp_path / "c.json")
    out = tmp_path / "serve.json"
    args = build_parser().parse_args([
        "serve", "--shape", "tiny-dense", "--synthetic-acceptance", "0.3:0.95", "--systems", "static", "compact",
        "--cost-table", str(tmp_path / "c.json"), "--concurrency", "4", "--prompts", "8", "--prompt-tokens", "24",
        "--output-len", "24", "--warmup-s", "0", "--warmup-round-s", "0", "--num-requests", "8", "--kv-gb", "0.05",
        "--out", str(out)])
    bsv.serve_bench(args)
    saved = json.loads(out.read_text())
    assert saved["random_weights"] == {"shape": "tiny-dense", "synthetic_acceptance": "0.3:0.95"}
    assert saved["systems"]["static"]["load_format"] == "dummy"
    acc = {r["mode"]: r["accounting"] for r in saved["runs"]}
    per_step = {m: a["verify_rows"] / a["decode_request_steps"] for m, a in acc.items()}
    assert per_step["compact"] < per_step["static"] and all(r["errors"] == 0 for r in saved["runs"])
    # with the target's own profile beside a table where the drafter's pass is dear per row,
    # compact lets only the confident requests draft; compact-no-partial drafts all or none
    name = "tiny-dense (random weights)"
    CostTable({(b, k): 1e-3 * (1 + 0.4 * b + 0.02 * k) for b in (1, 2, 4) for k in range(0, 7 * b + 1)},
              model_name=name, dtype="torch.float32", device="cpu").save(tmp_path / "p.json")
    CostTable({(b, 0): 1e-3 * (1 + 0.1 * b) for b in (1, 2, 4)}, model_name=f"{name} (no drafter)",
              dtype="torch.float32", device="cpu").save(tmp_path / "p.json")
    for f in (0.25, 0.5, 0.75):
        d = lambda b: -(-b * f // 1)        # noqa: E731  (ceil(f * b) rows draft)
        CostTable({(b, k): 1e-3 * (1 + 0.1 * b + 0.4 * d(b) + 0.02 * k) for b in (1, 2, 4)
                   for k in range(0, int(d(b)) * 7 + 1)},
                  model_name=f"{name} (draft {f:g})", dtype="torch.float32", device="cpu").save(tmp_path / "p.json")
    args = build_parser().parse_args([
        "serve", "--shape", "tiny-dense", "--synthetic-acceptance", "0.05:0.99", "--systems", "compact",
        "compact-no-partial", "--cost-table", str(tmp_path / "p.json"), "--concurrency", "4", "--prompts", "8",
        "--prompt-tokens", "24", "--output-len", "48", "--warmup-s", "0", "--warmup-round-s", "0", "--num-requests",
        "8", "--kv-gb", "0.05", "--out", str(tmp_path / "partial.json")])
    bsv.serve_bench(args)
    acc = {r["mode"]: r["accounting"] for r in json.loads((tmp_path / "partial.json").read_text())["runs"]}
    assert acc["compact"]["partial_steps"] > 0 and acc["compact-no-partial"]["partial_steps"] == 0
    with pytest.raises(ValueError, match="load_format='dummy'"):
        bsv.serve_bench(build_parser().parse_args(["serve", "--systems", "static", "--synthetic-acceptance",
                                                   "0.5:0.6", "--concurrency", "1", "--kv-gb", "0.05"]))


def test_every_committed_token_of_a_real_engine_is_counted_from_the_step_arrays(tmp_path):
    """On a real engine most decode rows come back as arrays (`StepOutputs.rows`), not as
    `RequestOutput`s: the closed loop must count their tokens too, so every completed request's
    chunks add up to its output length, and most of its chunks come from those rows."""
    from nanodspark import LLM
    from nanodspark.lab.shapes import materialize
    llm = LLM(str(materialize("tiny-dense", tmp_path / "tiny-dense")), load_format="dummy", device="cpu",
              max_model_len=128, num_kv_blocks=128, use_tqdm=False, max_num_seqs=4)
    work = ServeWorkload([[5, 6, 7, 8], [9, 10, 11]], ["math", "chat"], np.array([12, 9, 15, 10]))
    run = engine_closed_loop(llm.engine, work, 4, warmup_s=0.0, duration_s=0.0, num_requests=6)
    done = [r for r in run.records if r.measured and r.end is not None]
    assert len(done) == 6 and all(r.error is None for r in done)
    assert all(sum(n for _, n in r.chunks) == r.tokens == work.request(r.index)[2] for r in done)
    assert all(len(r.chunks) > 2 for r in done)          # not only the first token and the last step


def test_in_process_engines_decode_no_text_unless_asked(tiny_dir):
    """The engine front end runs each engine as serve.py's engine core does, text-free (its API
    processes decode): a finishing request's text is not decoded inside the step. `--stream-text`
    keeps the tokenizer (text decoded in the step, every step)."""
    from nanodspark.lab.bench import build_parser
    from nanodspark.sampling import SamplingParams
    model = str(tiny_dir)
    for flag, has_text in (([], False), (["--stream-text"], True)):
        args = build_parser().parse_args(["serve", "--model", model, "--systems", "no-spec", "--kv-gb", "0.05",
                                          "--concurrency", "1", *flag])
        with bsv._backends(args, ["no-spec"]) as backends:
            eng = backends["no-spec"].engine
            assert (eng.tokenizer is not None) == has_text
            r = eng.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                                queue_limit=False, stream_text=False)
            while eng.has_unfinished():
                eng.step()
            assert len(r.output_ids) == 3 and (r.text != "") == has_text
