"""The simulator (nanodspark/lab/simulate.py): a hand-computed case exactly, the real engine step
for step (on a virtual clock, so no timing is asserted), a sweep predicted within a stated error,
the recorder, the scaled traces and the calibration."""
import dataclasses
import json
import math
import shutil

import numpy as np
import pytest
import torch

from nanodspark.cost_table import CostTable
from nanodspark.lab.bench_serve import ServeWorkload, engine_closed_loop, output_lengths, summarize
from nanodspark.lab.simulate import (StepCost, calibrate, expected_tau, scale_traces, simulate_closed_loop,
                                     trace_picker)
from nanodspark.lab.traces import RequestTrace, TraceRecorder, Traces

from test_verify import make_drafter


def linear_table(per_token: float, base: float = 0.01, gamma: int = 2, batches=(1, 2, 3, 4)) -> CostTable:
    """T(R, K) = base + per_token * K at every integer K: lookups are exact."""
    return CostTable({(b, k): base + per_token * k for b in batches for k in range(b * gamma + 1)},
                     model_name="toy", dtype="float32", device="cpu")


def hand_traces() -> Traces:
    """r0 (prompt 0): confident, a full block accepted every step; r1 (prompt 1): doubtful, nothing."""
    return Traces(2, [RequestTrace("r0", np.full((10, 2), 0.9, np.float32), np.full(10, 2), "math", 4),
                      RequestTrace("r1", np.tile(np.array([[0.2, 0.5]], np.float32), (10, 1)), np.zeros(10, np.int64),
                                    "chat", 4)])


def test_a_compact_run_computed_by_hand():
    """Two clients, gamma 2, T(R, K) = 10 ms + 4 ms per draft, prefill 20 ms a step, lag 2.

    step 0  prefill r0, r1 (8 rows)                          t = 0.020  r0: 1 token, r1: 1 token
    step 1  R=2, no lagged data: budget 4 (full)             t = 0.046  r0 +3 (2 accepted), r1 +1
    step 2  lagged from step 0 (a prefill): none -> full     t = 0.072  r0 +3 -> 7, done; r2 sent
    step 3  r1 alone, lagged [0.2, 0.1]: Theta(0) = 100 beats Theta(2) = 72.2 by > 4 %: budget 0;
            r2's prefill (20 ms)                             t = 0.102  r1 +1, r2: 1 token
    step 4  lagged (step 2): r1 [0.2, 0.1], r2 (new) [1, 1] -> K* = 2 (222 > 1.04 * 165);
            top-2 fresh cells are r2's (0.9, 0.81)           t = 0.120  r1 +1 -> 5, done;
                                                                        r2 +2 (room 1) -> 3, done
    Past the 0.09 s window with nothing measured in flight: the run ends, r3 is never sent.
    """
    work = ServeWorkload([[1, 2, 3, 4], [5, 6, 7, 8]], ["math", "chat"], np.array([7, 5, 3, 3]))
    cost = StepCost(linear_table(0.004), prefill_s=0.02)
    run = simulate_closed_loop("compact", work, hand_traces(), cost, concurrency=2, warmup_s=0.0, duration_s=0.09,
                               gamma=2, max_num_seqs=4, max_num_batched_tokens=100)
    rec = {r.index: r for r in run.records}
    chunks = lambda i: [(pytest.approx(t), n) for t, n in rec[i].chunks]  # noqa: E731
    assert chunks(0) == [(0.020, 1), (0.046, 3), (0.072, 3)]
    assert chunks(1) == [(0.020, 1), (0.046, 1), (0.072, 1), (0.102, 1), (0.120, 1)]
    assert chunks(2) == [(0.102, 1), (0.120, 2)]
    assert rec[2].sent == pytest.approx(0.072) and len(run.records) == 3
    assert all(r.measured for r in run.records)
    s = summarize(run)
    assert s["total_tok_s"] == pytest.approx(10 / 0.09, abs=0.01)           # 2 + 4 + 4 tokens before 0.09 s
    assert s["per_user_tok_s"] == pytest.approx(2 / 0.018, abs=0.01)        # r2's: the median of 115, 40, 111
    assert s["ttft_ms"]["p50"] == pytest.approx(20.0) and s["ttft_ms"]["mean"] == pytest.approx(70 / 3, abs=1e-3)
    assert s["by_workload"]["math"]["verified"] == 2 + 2 + 1                # r0 full twice; r2 2 cut to room 1
    # static on the same traces: every step full blocks; r1 pays for 2 drafts at steps 3 and 4
    static = simulate_closed_loop("static", work, hand_traces(), cost, 2, 0.0, 0.09, gamma=2, max_num_seqs=4,
                                  max_num_batched_tokens=100)
    assert [(pytest.approx(t), n) for t, n in static.records[1].chunks][3] == (pytest.approx(0.110), 1)


def test_no_speculation_prices_the_plain_table_and_commits_one_token_a_step():
    work = ServeWorkload([[1, 2, 3]], ["math"], np.array([4]))
    cost = StepCost(linear_table(0.004), plain=CostTable({(1, 0): 0.005, (2, 0): 0.006}), host_s=0.001,
                    prefill_token_s=0.001)
    run = simulate_closed_loop("no-spec", work, None, cost, 1, 0.0, 0.02, max_num_seqs=2, max_num_batched_tokens=64)
    # prefill: 1 ms host + 3 rows * 1 ms; then 6 ms a decode step (5 plain + 1 host)
    assert [(pytest.approx(t), n) for t, n in run.records[0].chunks] == [(0.004, 1), (0.010, 1), (0.016, 1), (0.022, 1)]


def test_the_token_budget_keeps_verify_rows_first_and_chunks_prefill():
    """Decoding requests claim 1 + gamma rows before any prefill; a prompt longer than what is
    left is chunked over steps (scheduler.py's order)."""
    work = ServeWorkload([[1] * 3, [2] * 10], ["math", "chat"], np.array([4, 4]))
    traces = Traces(2, [RequestTrace("r0", np.full((9, 2), 0.9, np.float32), np.zeros(9, np.int64))])
    cost = StepCost(linear_table(0.0), prefill_token_s=0.001)
    run = simulate_closed_loop("static", work, traces, cost, 2, 0.0, 1.0, gamma=2, max_num_seqs=2,
                               max_num_batched_tokens=8)
    r1 = run.records[1]
    # step 0: r0's 3 rows + 5 of r1's; step 1: r0 decodes (3 rows), r1's last 5 rows -> its first token
    assert r1.chunks[0][0] == pytest.approx(run.records[0].chunks[1][0])


def _oracle(eng, continuations: dict, corrupt: float = 0.35, seed: int = 0):
    """Drafts that are the target's greedy tokens, each wrong with probability `corrupt` (keyed by
    request and position, so every run proposes the same), with confidences that say so: 0.95
    where right, 0.3 where wrong (calibrated-ish). Acceptance then varies per step, and the
    confidence predicts it, as a trained drafter's does. It stands in for the drafter (the same
    `propose` / `inject` interface) and finds each row's request by its drafter block table."""
    from nanodspark.drafter import Draft
    g, config = eng.gamma, eng.executor.spec.drafter.config

    class Oracle:
        def propose(self, anchors, anchor_pos, cache, block_tables, block_size, st, ops, stream, kv_start=None):
            dg = eng.worker.draft_group
            by_block = {r.tables[dg].blocks[0]: r for r in eng.scheduler.running if r.tables.get(dg)}
            toks = torch.zeros(len(anchors), g, dtype=torch.long)
            conf = torch.full((len(anchors), g), 0.5)
            for i, (b, p) in enumerate(zip(block_tables[:, 0].tolist(), anchor_pos.tolist())):
                r = by_block.get(b)
                if r is None:
                    continue
                cont = continuations[tuple(r.prompt_ids)]
                for k in range(g):
                    j = p - len(r.prompt_ids) + 1 + k          # output index the k-th draft predicts
                    right = cont[j] if 0 <= j < len(cont) else 0
                    bad = np.random.default_rng([seed, p, k, len(r.prompt_ids)]).random() < corrupt
                    toks[i, k] = (right + 1) % eng.model_config.vocab_size if bad else right
                    conf[i, k] = 0.3 if bad else 0.95
            return Draft(toks, None, torch.zeros(toks.shape), conf)

        def inject(self, *args, **kwargs):
            pass

    oracle = Oracle()
    oracle.config = config
    eng.executor.spec.drafter = oracle


@pytest.fixture(scope="module")
def pair(tiny_dir, tmp_path_factory):
    """The tiny pair, its greedy continuations, a workload of 6 random prompts and a table on
    which compact trims (a draft verified costs a third of an empty step)."""
    from nanodspark import LLM, SamplingParams
    d = tmp_path_factory.mktemp("sim_pair")
    shutil.copytree(tiny_dir, d / "pair")
    make_drafter(d / "pair", d / "pair" / "drafter", gamma=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 8000, int(n)).tolist() for n in rng.integers(6, 20, 6)]
    work = ServeWorkload(prompts, ["math", "chat", "code"] * 2, output_lengths(8, 0.25, seed=1))
    plain = LLM(str(d / "pair"), drafter_path="none", use_tqdm=False, enable_prefix_cache=False,
                kv_cache_memory_gb=0.05, max_num_seqs=4)
    outs = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    conts = {tuple(p): o.token_ids for p, o in zip(prompts, outs)}
    table = CostTable({(b, k): 0.030 + 0.004 * b + 0.010 * k for b in (1, 2, 3, 4) for k in range(0, 3 * b + 1)},
                      model_name=str(d / "pair"), dtype="torch.float32", device="cpu")
    table.save(d / "cost.json")
    plain_table = CostTable({(b, 0): 0.025 + 0.004 * b for b in (1, 2, 3, 4)}, model_name=f"{d / 'pair'} (no drafter)",
                            dtype="torch.float32", device="cpu")
    plain_table.save(d / "cost.json")        # the engine's compact reads it too: partial drafting, plain steps
    shares = {f: CostTable({(b, k): 0.025 + 0.004 * b + 0.005 * math.ceil(f * b) / b + 0.010 * k
                            for b in (1, 2, 3, 4) for k in range(0, 3 * math.ceil(f * b) + 1)},
                           model_name=f"{d / 'pair'} (draft {f:g})", dtype="torch.float32", device="cpu")
              for f in (0.25, 0.5, 0.75)}
    for t in shares.values():
        t.save(d / "cost.json")
    cost = StepCost(table, plain_table, host_s=0.002, prefill_s=0.01, prefill_token_s=2e-4, shares=shares)
    return {"dir": d / "pair", "table": d / "cost.json", "work": work, "conts": conts, "cost": cost, "plain": plain}


WARMUP_S, WINDOW_S, CLIENTS = 0.1, 1.0, 3


def _measure(pair, system: str):
    """The real engine on the virtual clock, its traces recorded."""
    from nanodspark import LLM
    if system == "no-spec":
        llm = pair["plain"]
    else:
        kw = dict(verify_mode="compact", cost_table=str(pair["table"])) if system == "compact" else {}
        llm = LLM(str(pair["dir"]), use_tqdm=False, max_num_seqs=4, enable_prefix_cache=False,
                  kv_cache_memory_gb=0.05, **kw)
        _oracle(llm.engine, pair["conts"])
    rec = TraceRecorder(llm.engine.gamma)
    run = engine_closed_loop(llm.engine, pair["work"], CLIENTS, WARMUP_S, WINDOW_S, cost=pair["cost"], traces=rec)
    return run, rec.traces(), llm.engine.config.max_num_batched_tokens


@pytest.fixture(scope="module")
def measured(pair):
    return {s: _measure(pair, s) for s in ("no-spec", "static", "compact")}


def _simulate(pair, system, traces, mbt):
    return simulate_closed_loop(system, pair["work"], traces, pair["cost"], CLIENTS, WARMUP_S, WINDOW_S,
                                gamma=3, max_num_seqs=4, max_num_batched_tokens=mbt)


@pytest.mark.parametrize("system", ["no-spec", "static", "compact"])
def test_the_simulator_follows_the_engine_step_for_step_on_its_own_traces(pair, measured, system):
    """Replaying a run's own traces, the simulator makes the engine's decisions: the same
    requests, chunks and timestamps (the virtual clock prices both the same way)."""
    run, traces, mbt = measured[system]
    sim = _simulate(pair, system, traces if system != "no-spec" else None, mbt)
    got = {r.index: [(round(t, 9), n) for t, n in r.chunks] for r in sim.records}
    want = {r.index: [(round(t, 9), n) for t, n in r.chunks] for r in run.records}
    assert got == want
    a, b = summarize(run), summarize(sim)
    assert a["total_tok_s"] == b["total_tok_s"] and a["per_user_tok_s"] == b["per_user_tok_s"]
    assert a["engine_steps"] == b["engine_steps"] >= 4
    if system == "compact":          # the table lets only some requests draft (or none) at times
        assert run.extra["accounting"]["partial_steps"] >= 1
    if system == "static":
        # censored only where the length limit cut a request's last step short of the full block
        assert 1.3 < traces.tau() < 3.9 and all((r.full[:-1] >= 0).all() for r in traces.requests)


def test_compact_is_predicted_from_static_traces_within_the_stated_error(pair, measured):
    """The approximation the simulator makes (acceptance replayed by step, recorded under
    static): compact's total tok/s within 10 % (the issue's bar; 3.8 % when written), the
    others exact, and which system is fastest right."""
    _, static_traces, mbt = measured["static"]
    pred = {s: summarize(_simulate(pair, s, static_traces if s != "no-spec" else None, mbt))["total_tok_s"]
            for s in ("no-spec", "static", "compact")}
    meas = {s: summarize(measured[s][0])["total_tok_s"] for s in pred}
    assert abs(pred["compact"] / meas["compact"] - 1) < 0.10, (pred, meas)
    assert pred["static"] == meas["static"] and pred["no-spec"] == meas["no-spec"]
    assert max(pred, key=pred.get) == max(meas, key=meas.get)
    acc = summarize(measured["compact"][0])["accounting"]
    assert acc["drafts_verified"] < 3 * acc["decode_request_steps"]         # compact did trim


def test_calibrate_recovers_the_overheads_of_a_run_priced_by_the_table(pair, measured):
    """A run on the virtual clock was priced exactly by table + host + prefill: the fit gets the
    host term back from the runs' accounting, and prefill terms that price their prefill steps
    exactly (the fixed and per-row terms separate only over runs of other prefill shapes)."""
    runs = [{"mode": s, **summarize(measured[s][0])} for s in ("static", "compact")]
    fit = calibrate({"runs": runs}, StepCost(pair["cost"].table, pair["cost"].plain, shares=pair["cost"].shares))["spec"]
    assert fit["host_s"] == pytest.approx(0.002, rel=1e-6)
    acc = runs[0]["accounting"]
    n, rows = acc["mixed_steps"] + acc["prefill_only_steps"], acc["prefill_rows"]
    assert n * fit["prefill_s"] + rows * fit["prefill_token_s"] == pytest.approx(n * 0.01 + rows * 2e-4, rel=1e-6)
    plain = calibrate({"runs": [{"mode": "no-spec", **summarize(measured["no-spec"][0])}]}, pair["cost"])
    assert set(plain) == {"plain"} and plain["plain"]["host_s"] == pytest.approx(0.002, rel=1e-6)


def test_calibrate_by_run_recovers_overheads_that_the_overlapped_loop_moves_between_steps():
    """In the overlapped loop a prefill's GPU time is waited for in the decode steps after it:
    the decode-only steps carry it and the prefill steps look free. Fitted per whole run, the
    three terms come back exactly; fitted per kind of step, they do not (the host term takes
    what was the prefill's), and an unknown `by` is refused."""
    table = CostTable({(b, k): 1e-3 + 1e-6 * b for b in (1, 16, 64, 256) for k in (0, 4 * b)})
    host, pre, tok = 2e-4, 8e-3, 2e-6
    runs = []
    for d, m, p, R in ((900, 40, 6000, 16), (2000, 150, 30000, 64), (1200, 90, 9000, 256), (500, 10, 2500, 1)):
        prefill_time = m * pre + p * tok
        t = table.predict(R, 4 * R) + host
        acc = {"steps": d + m, "client_s": 0.0, "decode_rk": [[R, 4 * R, d, 0], [R, 4 * R, m, 1]],
               "decode_only_steps": d, "decode_only_s": d * t + prefill_time, "decode_only_prefill_rows": 0,
               "prefill_only_steps": 0, "prefill_only_s": 0.0, "prefill_only_prefill_rows": 0,
               "mixed_steps": m, "mixed_s": m * t, "mixed_prefill_rows": p}
        runs.append({"mode": "static", "accounting": acc})
    cost = StepCost(table)
    fit = calibrate({"runs": runs}, cost, by="run")["spec"]
    assert [fit[k] for k in ("host_s", "prefill_s", "prefill_token_s")] == pytest.approx([host, pre, tok], rel=1e-6)
    kind = calibrate({"runs": runs}, cost, by="kind")["spec"]
    assert kind["host_s"] > 2 * host and kind["prefill_s"] < pre / 2
    with pytest.raises(ValueError):
        calibrate({"runs": runs}, cost, by="step")


def test_trace_picker_replays_the_recorded_request_of_the_same_prompt():
    t = Traces(2, [RequestTrace(f"r{i}", np.zeros((n, 2), np.float32), np.zeros(n, np.int64))
                   for i, n in ((0, 3), (1, 2), (4, 9), (5, 1))])
    pick = trace_picker(t, n_prompts=4)
    assert pick(8).request_id == "r4" and pick(9).request_id == "r1" and pick(5).request_id == "r5"
    assert pick(0).request_id == "r0"     # its own, although r4 (the same prompt) is longer
    assert pick(3).request_id == "r5"     # prompt 3 was never recorded: the traces in turn


def test_scaled_traces_reach_the_target_tau_and_say_they_are_scaled():
    rng = np.random.default_rng(0)
    conf = rng.uniform(0.3, 0.95, (400, 4)).astype(np.float32)
    t = Traces(4, [RequestTrace(f"r{i}", conf[i * 40:(i + 1) * 40], np.zeros(40, np.int64)) for i in range(10)])
    for tau, g in ((3.21, 7), (6.17, 7), (2.0, 4)):
        s = scale_traces(t, tau, gamma=g, seed=1)
        allc = np.concatenate([r.conf for r in s.requests])
        assert s.gamma == g and allc.shape[1] == g
        assert expected_tau(allc) == pytest.approx(tau, rel=1e-3)            # calibrated by construction
        assert s.tau() == pytest.approx(tau, rel=0.05)                      # the drawn acceptance agrees
        assert s.meta["scaled"]["target_tau"] == tau
    with pytest.raises(ValueError, match="gamma"):
        scale_traces(t, 6.17, gamma=4)


def test_traces_round_trip_through_json_and_npz(tmp_path):
    t = hand_traces()
    t.meta = {"system": "static"}
    for name in ("t.json", "t.npz"):
        back = Traces.load(t.save(tmp_path / name))
        assert back.gamma == 2 and back.meta == {"system": "static"}
        assert [(r.request_id, r.workload, r.prompt_len) for r in back.requests] == [("r0", "math", 4), ("r1", "chat", 4)]
        assert all(np.allclose(a.conf, b.conf) and (a.full == b.full).all() for a, b in zip(t.requests, back.requests))


def test_the_recorder_marks_a_fully_accepted_trimmed_window_as_censored():
    from types import SimpleNamespace as NS
    from nanodspark.lab.traces import full_block_accepted, step_arrays

    from nanodspark.speculative import DecodeOut
    from nanodspark.step import DecodeRows
    # rows: (window, verified, accepted, leading run of acceptances over the verified drafts)
    rows = [("a", 4, 4, 2, 2), ("b", 2, 2, 1, 1), ("c", 2, 2, 2, 2), ("d", 2, 4, 1, 3)]
    col = lambda i: np.array([r[i] for r in rows], dtype=np.int64)      # noqa: E731
    out = DecodeOut(np.zeros((4, 5), np.int64), np.zeros((4, 4), np.int64), col(3) + 1, col(1), col(2), col(4),
                    np.ones(4, np.int64), np.ones(4, np.int64), np.full((4, 4), 0.5, np.float32),
                    np.zeros((4, 4), np.float32))
    decode = DecodeRows(np.arange(4), np.zeros(4, np.int64), out, np.array([NS(request_id=r[0]) for r in rows]))
    s = step_arrays(NS(step=3, seconds=0.1, decode=decode, prefill=[]), 4)
    assert full_block_accepted(s, 4).tolist() == [2, 1, -3, 3]      # full; rejection seen; censored (>= 2); ceiling


def test_simulate_command_writes_a_labelled_prediction(pair, measured, tmp_path, monkeypatch):
    """`bench simulate` end to end: the JSON says it is a prediction, scaled traces say their tau."""
    from nanodspark.lab import bench_serve, simulate as sim
    from nanodspark.lab.bench import build_parser
    _, traces, _ = measured["static"]
    traces.save(tmp_path / "tr.npz")
    CostTable.save(pair["cost"].plain, tmp_path / "plain.json")
    monkeypatch.setattr(bench_serve, "make_workload", lambda *a, **k: pair["work"])
    args = build_parser().parse_args(
        ["simulate", "--cost-table", str(pair["table"]), "--plain-table", str(tmp_path / "plain.json"),
         "--traces", str(tmp_path / "tr.npz"), "--concurrency", "1", "3", "--duration", "0.5", "--warmup-s", "0.1",
         "--max-num-batched-tokens", "2048", "--host-ms", "2", "--model", str(pair["dir"]),
         "--scale-tau", "3.5", "--gamma", "3", "--out", str(tmp_path / "p.json")])
    res = sim.simulate(args)
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved["kind"] == "prediction" and "tau 3.5" in saved["label"]
    assert {(r["mode"], r["concurrency"]) for r in saved["sweep"]} == {
        (m, c) for m in ("no-spec", "static", "compact") for c in (1, 3)}
    assert all(r["total_tok_s"] > 0 for r in saved["sweep"])
    assert any(p["ratio"] == "compact/static" for p in saved["paired"])
    assert res["step_cost"]["static"]["host_s"] == pytest.approx(0.002)



def test_profile_plain_times_the_target_alone_and_saves_a_table(tiny_dir, tmp_path):
    """`bench profile-plain`: T(R, 0) without a drafter, one row per batch size, that `load_table`
    reads back; the engine is left without requests."""
    from nanodspark.lab.bench import build_parser
    from nanodspark.lab.simulate import load_table, profile_plain
    from nanodspark.engine import LLMEngine as Engine
    out = tmp_path / "plain.json"
    args = build_parser().parse_args(["profile-plain", "--model", str(tiny_dir), "--batch-sizes", "1", "2",
                                      "--context", "8", "--repeats", "2", "--kv-gb", "0.05", "--out", str(out)])
    streams, add = [], Engine.add_request

    def spy(self, *a, **kw):
        req = add(self, *a, **kw)
        streams.append(req.stream_text)
        return req
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Engine, "add_request", spy)
        profile_plain(args)
    assert streams and not any(streams)      # no text decoded in the timed steps, as serving adds requests
    t = load_table(out)
    assert sorted(t.measurements) == [(1, 0), (2, 0)] and all(v > 0 for v in t.measurements.values())
    assert t.model_name.endswith("(no drafter)") and StepCost(None, t).decode_seconds(2, 8, spec=False) == t.predict(2, 0)


def test_simulate_refuses_speculation_without_traces(tmp_path):
    from nanodspark.lab.bench import build_parser
    from nanodspark.lab.simulate import simulate
    linear_table(0.001).save(tmp_path / "t.json")
    args = build_parser().parse_args(["simulate", "--cost-table", str(tmp_path / "t.json")])
    with pytest.raises(SystemExit, match="--traces"):
        simulate(args)


def test_a_plain_step_is_priced_as_no_speculation():
    """The ledger marks a plain step with budget -1: the simulator's price for it is the target's
    own table, not the speculative table at K = 0 (which holds the drafter's pass)."""
    from nanodspark.cost_table import CostTable
    from nanodspark.lab.simulate import StepCost
    cost = StepCost(CostTable({(b, k): 3e-3 + 1e-5 * k for b in (1, 8) for k in range(33)}),
                    CostTable({(b, 0): 1e-3 for b in (1, 8)}))
    assert cost.decode_seconds(8, -1) == pytest.approx(1e-3)
    assert cost.decode_seconds(8, 0) == pytest.approx(3e-3) and cost.decode_seconds(8, 0, spec=False) == pytest.approx(1e-3)


def test_a_cost_file_names_its_partial_step_profiles_apart(tmp_path):
    """One cost file holds the speculative table, the target's own and the partial steps'
    ("(draft F)"): each loader finds its own, and a partial step of ceil(F * R) drafting rows is
    priced by F's profile, any other count by the table of every row drafting (an upper bound)."""
    from nanodspark.lab.simulate import load_shares, load_table
    path = tmp_path / "c.json"
    CostTable({(4, k): 1e-3 * (26 + k) for k in range(9)}, model_name="m").save(path)
    CostTable({(4, 0): 20e-3}, model_name="m (no drafter)").save(path)
    CostTable({(4, k): 50e-3 for k in range(5)}, model_name="m (draft 0.5)").save(path)
    spec, plain, shares = load_table(path), load_table(path, plain=True), load_shares(path)
    assert spec.predict(4, 2) == pytest.approx(28e-3) and plain.predict(4, 0) == pytest.approx(20e-3)
    assert list(shares) == [0.5] and shares[0.5].predict(4, 1) == pytest.approx(50e-3)
    cost = StepCost(spec, plain, shares=shares)
    assert cost.decode_seconds(4, 2, drafting=2) == pytest.approx(50e-3)          # ceil(0.5 * 4) rows
    assert cost.decode_seconds(4, -1) == pytest.approx(20e-3) and cost.plain_step() is plain
    # the speculative engine's own plain step ("(draft 0)"): its plain steps' price, not no speculation's
    CostTable({(4, 0): 22e-3}, model_name="m (draft 0)").save(path)
    cost = StepCost(load_table(path), load_table(path, plain=True), shares=load_shares(path))
    assert cost.decode_seconds(4, -1) == pytest.approx(22e-3)
    assert cost.decode_seconds(4, 0, spec=False) == pytest.approx(20e-3)           # no speculation
    assert list(cost.partial_shares()) == [0.5] and cost.plain_step().predict(4, 0) == pytest.approx(22e-3)
    assert cost.decode_seconds(4, 2, drafting=1) == pytest.approx(28e-3)
    from nanodspark.cost_table import share_name, share_of
    assert share_of(share_name("m", 0.25)) == 0.25 and share_of("m (no drafter)") is None and share_of("m") is None


def test_a_lapsed_plain_step_is_priced_by_its_own_profile(tmp_path):
    """A cost file may hold the lapsed plain step's profile ("(lapsed)", `bench profile --lapse`):
    `load_table` passes over it, `load_lapsed` finds it, the ledger's LAPSED mark is priced by it
    (PLAIN still by the kept plain step's), and the plain price the scheduler reads is it where
    plain steps may lapse."""
    from nanodspark.lab.simulate import load_lapsed, load_shares, load_table
    from nanodspark.lab.traces import LAPSED, PLAIN
    path = tmp_path / "c.json"
    CostTable({(4, k): 1e-3 * (26 + k) for k in range(9)}, model_name="m").save(path)
    CostTable({(4, 0): 20e-3}, model_name="m (no drafter)").save(path)
    CostTable({(4, 0): 22e-3}, model_name="m (draft 0)").save(path)
    CostTable({(4, 0): 19e-3}, model_name="m (lapsed)").save(path)
    cost = StepCost(load_table(path), load_table(path, plain=True), shares=load_shares(path), lapsed=load_lapsed(path))
    assert cost.table.model_name == "m" and cost.lapsed.model_name == "m (lapsed)"
    assert cost.decode_seconds(4, LAPSED) == pytest.approx(19e-3) and cost.decode_seconds(4, PLAIN) == pytest.approx(22e-3)
    assert cost.plain_step(lapse=True) is cost.lapsed and cost.plain_step().predict(4, 0) == pytest.approx(22e-3)


def test_the_simulator_follows_the_engine_through_a_lapsed_run(pair, measured, tmp_path):
    """Where plain steps win (a cheap plain step, a dear drafting one), compact runs nothing but
    plain steps; past `verify_lapse_after` of them in a row they let the drafter's context lapse,
    the ledger marks them LAPSED and the virtual clock prices them by the lapsed profile. The
    simulator, given the same lapse, makes the same steps at the same times (the first two plain
    steps, kept, priced apart); compact-keep's plain steps are dearer."""
    from nanodspark import LLM
    from nanodspark.lab.simulate import load_lapsed, load_shares
    from nanodspark.lab.traces import LAPSED
    name, path = str(pair["dir"]), tmp_path / "cost.json"
    kw = dict(model_name=name, dtype="torch.float32", device="cpu")
    CostTable({(b, k): 0.200 + 0.004 * b + 0.010 * k for b in (1, 2, 3, 4) for k in range(0, 3 * b + 1)}, **kw).save(path)
    for suffix, base in ((" (draft 0)", 0.012), (" (lapsed)", 0.009)):
        CostTable({(b, 0): base + 0.001 * b for b in (1, 2, 3, 4)}, **{**kw, "model_name": name + suffix}).save(path)
    cost = dataclasses.replace(pair["cost"], table=CostTable.load(path, name, "torch.float32", "cpu", ()),
                               shares=load_shares(path), lapsed=load_lapsed(path))
    llm = LLM(name, use_tqdm=False, max_num_seqs=4, enable_prefix_cache=False, kv_cache_memory_gb=0.05,
              verify_mode="compact", cost_table=str(path), verify_lapse_after=2)
    _oracle(llm.engine, pair["conts"])
    run = engine_closed_loop(llm.engine, pair["work"], CLIENTS, WARMUP_S, WINDOW_S, cost=cost)
    rk = run.extra["accounting"]["decode_rk"]
    assert {k for _, k, *_ in rk} == {LAPSED} and sum(n for _, k, n, *_ in rk) > 10   # (the kept ones: in the warm-up)
    _, static_traces, mbt = measured["static"]
    sim = simulate_closed_loop("compact", pair["work"], static_traces, cost, CLIENTS, WARMUP_S, WINDOW_S, gamma=3,
                               max_num_seqs=4, max_num_batched_tokens=mbt, lapse_after=2)
    got = {r.index: [(round(t, 9), n) for t, n in r.chunks] for r in sim.records}
    assert got == {r.index: [(round(t, 9), n) for t, n in r.chunks] for r in run.records}
    keep = simulate_closed_loop("compact-keep", pair["work"], static_traces, cost, CLIENTS, WARMUP_S, WINDOW_S,
                                gamma=3, max_num_seqs=4, max_num_batched_tokens=mbt)
    assert summarize(keep)["total_tok_s"] < summarize(sim)["total_tok_s"]      # kept: dearer plain steps
