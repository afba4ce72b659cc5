"""The benchmark harness runs end to end on a tiny model (no timing is asserted: the figures
only mean something on the GPU, where `python -m nanodspark.bench ...` produces them)."""
import argparse
import json
import shutil
import types
from pathlib import Path

import pytest

from nanodspark.lab import bench_engine as be
from nanodspark.lab import bench_profile as bp
from nanodspark.cost_table import CostTable

from test_verify import make_drafter


def test_profile_and_dspark_sweep_run_and_write_json_and_png(tiny_dir, tmp_path):
    model = tmp_path / "pair"
    shutil.copytree(tiny_dir, model)
    make_drafter(model, model / "drafter")
    table = tmp_path / "runs" / "cpu_econ" / "cost.json"          # a folder that does not exist yet (09 §5d)
    bp.profile(types.SimpleNamespace(model=str(model), batch_sizes=[1, 2], context=16, repeats=1, kv_gb=0.05,
                                     out=str(table)))
    saved = next(iter(json.loads(table.read_text()).values()))
    assert saved["model_name"] == str(model) and saved["notes"]["context"] == 16 and len(saved["raw"]) == len(saved["measurements"])
    out = tmp_path / "dspark.json"
    res = be.dspark_bench(types.SimpleNamespace(
        model=str(model), cost_table=str(table), concurrency=[1, 2], workloads=["mix", "math"], min_requests=2,
        max_tokens=4, prompt_tokens=32, temperature=0.0, mixed_concurrency=2, mixed_requests=4, data_dir=None,
        kv_gb=0.05, out=str(out), repeats=2))
    assert {(r["mode"], r["workload"], r["concurrency"]) for r in res["sweep"]} == {
        (m, w, c) for m in ("no-spec", "static", "compact") for w in ("mix", "math") for c in (1, 2)}
    assert all(r["tokens"] == max(r["concurrency"], 2) * 4 for r in res["sweep"])  # ignore_eos, 4 tokens each
    import torch                                    # the hardware is recorded, CPU runs too
    assert res["device"] == torch.cuda.get_device_name() if torch.cuda.is_available() else res["device"].startswith("cpu: ")
    assert all(len(r["repeats_total_tok_s"]) == 2 and r["total_tok_s"] in r["repeats_total_tok_s"] for r in res["sweep"])
    assert [(q["workload"], q["concurrency"]) for q in res["paired_compact_over_static"]] == [
        (w, c) for w in ("mix", "math") for c in (1, 2)]
    assert all(q["min"] <= q["compact_over_static"] <= q["max"] for q in res["paired_compact_over_static"])
    assert all(r["engine_steps"] >= 2 for r in res["sweep"])     # a prefill step and >= 1 decode step
    table = be.dspark_markdown(res)
    assert "| static / no-spec |" in table and "estimated" not in table
    spec_rows = [r for r in res["sweep"] if r["mode"] != "no-spec"]
    assert all(r["step_ms_measured"] > 0 for r in spec_rows) and all("step_ms_measured" not in r for r in res["sweep"] if r["mode"] == "no-spec")
    # host time per phase: every speculative phase is timed, and the phases tile the engine step
    assert all(set(r["phase_ms"]) == set(be.PHASES) for r in spec_rows)
    assert all(set(r["phase_ms"]) == set(be.PHASES) for r in res["sweep"] if r["mode"] == "no-spec")
    # (wall_s is rounded to the millisecond, hence the slack)
    assert all(0 < sum(r["phase_ms"].values()) <= 1e3 * (r["wall_s"] + 1e-3) / r["engine_steps"] for r in res["sweep"]), [
        (r["mode"], r["phase_ms"], r["wall_s"], r["engine_steps"]) for r in res["sweep"]]
    phases = be.phase_markdown(res)
    assert phases.count("\n") == len(res["sweep"]) + 1 and "| mix, 2, compact |" in phases
    assert set(res["mixed_traffic_cap_accept"]["by_workload"]) == {"math", "chat", "poetry", "code"}
    assert out.exists() and out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_dspark_sweep_with_a_compact_that_never_trims_and_an_aa_control(tiny_dir, tmp_path, monkeypatch):
    """--no-trim adds compact with a guard no gain passes: it verifies what static verifies, and
    its paired ratio to static is reported (compact's overhead alone); --aa adds a second static
    engine (the harness's own noise and bias); the order of the engines rotates every repeat."""
    model = tmp_path / "pair"
    shutil.copytree(tiny_dir, model)
    make_drafter(model, model / "drafter")
    table = tmp_path / "cost.json"
    CostTable({(1, 0): 0.01, (1, 2): 0.02, (2, 0): 0.01, (2, 4): 0.03}, model_name=str(model), dtype="torch.float32",
              device="cpu").save(table)
    calls, real = [], be.run_traffic

    def spy(llm, *a, **kw):
        calls.append(id(llm))
        return real(llm, *a, **kw)
    monkeypatch.setattr(be, "run_traffic", spy)
    res = be.dspark_bench(types.SimpleNamespace(
        model=str(model), cost_table=str(table), concurrency=[2], workloads=["math"], min_requests=2,
        max_tokens=6, prompt_tokens=32, temperature=0.0, mixed_concurrency=2, mixed_requests=4, data_dir=None,
        kv_gb=0.05, out=None, repeats=3, no_trim=True, aa=True))
    by = {r["mode"]: r for r in res["sweep"]}
    assert set(by) == {"no-spec", "static", "compact", "compact-no-trim", "static-b"}
    verified = {m: sum(w["verified"] for w in by[m]["by_workload"].values()) for m in by}
    assert verified["compact-no-trim"] == verified["static"] == verified["static-b"] > 0
    q = res["paired_compact_over_static"][0]
    assert q["no_trim_min"] <= q["no_trim_over_static"] <= q["no_trim_max"] and q["aa_min"] <= q["aa_over_static"] <= q["aa_max"]
    md = be.dspark_markdown(res)
    assert "compact-no-trim / static, paired" in md and "static-b / static (A/A control), paired" in md
    # a warm-up per engine, then rounds whose order rotates: A B C D E, B C D E A, C D E A B
    warm, timed = calls[:5], calls[5:20]
    assert timed[:5] == warm and timed[5:10] == warm[1:] + warm[:1] and timed[10:15] == warm[2:] + warm[:2]


def test_bench_prompts_fill_a_concurrency_larger_than_the_workload():
    ps = be.bench_prompts("chat", 200)               # chat has 80 prompts
    assert len(ps) == 200 and len({p.render() for p in ps}) == 80 and ps[80].render() == ps[0].render()


def test_pareto_png_draws_a_sweep_without_the_mix(tmp_path):
    rows = [{"mode": m, "workload": "math", "concurrency": c, "per_user_tok_s": 10.0 * c, "total_tok_s": 50.0 * c}
            for m in ("no-spec", "static", "compact") for c in (1, 4)]
    fig = be.pareto_png({"sweep": rows}, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert "workload math" in fig._suptitle.get_text()


def test_whole_step_profile_runs_real_engine_steps_with_forced_windows(tiny_dir, tmp_path):
    """The whole-step profiler times engine.step() with exactly K verified drafts over bs requests,
    and leaves the engine empty (no request, no block) when it is done."""
    from nanodspark import LLM
    model = tmp_path / "pair"
    shutil.copytree(tiny_dir, model)
    make_drafter(model, model / "drafter")
    llm = LLM(str(model), use_tqdm=False, max_num_seqs=3, kv_cache_memory_gb=0.05, verify_mode="compact")
    eng = llm.engine
    policy = eng.windows
    run = bp.whole_step_runner(llm, context_len=20)
    running = eng.scheduler.running
    for bs in (3, 1):
        run(bs, 0)                                   # a new batch size builds and prefills its batch
        # as serving adds them (LLM.generate, serve.py's engine core): no text decoded in the step,
        # else every step of the table carries host work that no served step does
        assert not any(r.stream_text for r in running)
        for k in (0, 2, bs * eng.gamma):
            before = sum(r.spec.verified for r in running)
            run(bs, k)
            assert len(running) == bs and all(r.is_decoding for r in running)
            assert sum(r.spec.verified for r in running) - before == k
        assert sum(r.spec.accepted for r in running) == 0      # no draft committed: acceptance held fixed
    run.close()
    # host time per phase of each batch size's steps (prefill excluded): what the table measured
    assert set(run.phases) == {3, 1} and all({"schedule", "launch", "result", "commit"} <= set(p)
                                             for p in run.phases.values())
    assert not eng.has_unfinished() and eng.windows is policy
    assert all(u["used"] == 0 for u in eng.kv_usage().values())
    # real prompts (cycled, cut to their last context_len tokens) instead of random tokens
    prompts = [list(range(3, 40)), [7, 8, 9]]
    run = bp.whole_step_runner(llm, context_len=20, prompts=prompts)
    run(3, 2)
    assert sorted(r.prompt_ids for r in running) == sorted([prompts[0][-20:], prompts[1], prompts[0][-20:]])
    run.close()
    assert not eng.has_unfinished()
    # prepare() keeps the profiled context fixed: once a request has grown past the slack, the
    # batch is rebuilt from the same prompts, untimed and outside the phase clock
    run = bp.whole_step_runner(llm, context_len=20, prompts=prompts, context_slack=4)
    run.prepare(3, 0)
    ids = {r.request_id for r in running}
    run(3, 0)                                        # K = 0: one token per request
    run.prepare(3, 0)                                # 2 tokens, within the slack: nothing to do
    assert {r.request_id for r in running} == ids and max(len(r.output_ids) for r in running) == 2
    while max(len(r.output_ids) for r in running) <= 4:
        run(3, 3 * eng.gamma)
    steps = eng.clock.steps
    run.prepare(3, 0)
    assert {r.request_id for r in running}.isdisjoint(ids) and all(len(r.output_ids) == 1 for r in running)
    assert sorted(r.prompt_ids for r in running) == sorted([prompts[0][-20:], prompts[1], prompts[0][-20:]])
    assert eng.clock.steps == steps and run.state["rebuilds"] >= 1
    run.close()
    assert not eng.has_unfinished() and all(u["used"] == 0 for u in eng.kv_usage().values())


def test_whole_step_profile_holds_acceptance_fixed(tiny_dir, tmp_path):
    """With a drafter whose every draft the target accepts, the profile still commits one token
    per request per step (the table prices verifying, not committing); `commit_drafts=True`
    (`--acceptance traffic`) commits them."""
    from nanodspark import LLM
    from test_verify import ORACLE, use_oracle
    model = tmp_path / "pair"
    shutil.copytree(tiny_dir, model)
    make_drafter(model, model / "drafter")
    llm = LLM(str(model), use_tqdm=False, max_num_seqs=2, kv_cache_memory_gb=0.05, verify_mode="compact", **ORACLE)
    eng, running = llm.engine, llm.engine.scheduler.running
    policy = eng.windows
    use_oracle(eng)
    for commit, want in ((False, 0), (True, 3 * 2 * eng.gamma)):
        run = bp.whole_step_runner(llm, context_len=20, prompts=[list(range(3, 40))], commit_drafts=commit)
        run.prepare(2, 0)
        for _ in range(3):
            run(2, 2 * eng.gamma)
        assert sum(r.spec.accepted for r in running) == want
        assert all(len(r.output_ids) == 1 + 3 + want // 2 for r in running)   # prefill token + 3 steps
        run.close()
    assert eng.windows is policy and not llm.engine.has_unfinished()


def test_profile_k_grid_is_dense_and_ends_at_full_blocks():
    assert bp.k_grid(1, 5) == [0, 1, 2, 3, 4, 5]
    g = bp.k_grid(64, 5, points=8)
    assert g[0] == 0 and g[-1] == 320 and len(g) == 9
    assert max(b - a for a, b in zip(g, g[1:])) == 40      # no gap wider than an eighth of the range


def test_kernel_goal_counts_of_the_committed_h200_run():
    """The counts the walkthrough quotes are what `bench kernels-table` derives from the JSON."""
    from nanodspark.lab import bench
    res = json.loads((Path(__file__).parent.parent / "benchmarks" / "kernels_h200.json").read_text())
    goals = bench.kernel_goals(res)
    assert (goals["bandwidth_ge_0.8_of_copy_at_ctx_ge_8k_batch_ge_8_graph"]["met"],
            goals["verify_q8_speedup_ge_2x_sdpa_graph"]["met"]) == (16, 11)
    assert goals["bandwidth_ge_0.8_of_copy_at_ctx_ge_8k_batch_ge_8"]["met"] == 13
    table = bench.kernels_markdown(res)
    assert table.count("\n") == len(res["rows"]) + 1 and "| 8 | 8k | 8 | 4 |" in table


def test_dspark_bench_without_concurrencies_runs_only_the_mixed_traffic(tiny_dir, tmp_path):
    model = tmp_path / "pair"
    shutil.copytree(tiny_dir, model)
    make_drafter(model, model / "drafter")
    out = tmp_path / "mixed.json"
    res = be.dspark_bench(types.SimpleNamespace(
        model=str(model), cost_table=None, concurrency=[], workloads=["mix"], min_requests=2,
        max_tokens=4, prompt_tokens=32, temperature=1.0, mixed_concurrency=2, mixed_requests=4, data_dir=None,
        kv_gb=0.05, out=str(out), repeats=1))
    assert res["sweep"] == [] and res["paired_compact_over_static"] == [] and res["model"] == str(model)
    by = res["mixed_traffic_cap_accept"]["by_workload"]
    assert set(by) == {"math", "chat", "poetry", "code"} and sum(m["requests"] for m in by.values()) == 4
    assert all(m["tau"] >= 1 for m in by.values())           # every step commits at least the bonus token
    assert json.loads(out.read_text())["temperature"] == 1.0 and not out.with_suffix(".png").exists()


def test_dspark_bench_with_no_mixed_requests_runs_only_the_sweep(tiny_dir, tmp_path):
    """--mixed-requests 0 skips the mixed traffic (it once crashed on an empty median)."""
    model = tmp_path / "pair"
    shutil.copytree(tiny_dir, model)
    make_drafter(model, model / "drafter")
    res = be.dspark_bench(types.SimpleNamespace(
        model=str(model), cost_table=None, concurrency=[2], workloads=["mix"], min_requests=2,
        max_tokens=4, prompt_tokens=32, temperature=0.0, mixed_concurrency=2, mixed_requests=0, data_dir=None,
        kv_gb=0.05, out="", repeats=1))
    assert res["mixed_traffic_cap_accept"] is None
    assert {r["mode"] for r in res["sweep"]} == {"no-spec", "static", "compact"} and str(model) in res["benchmark"]
    with pytest.raises(argparse.ArgumentTypeError, match="0 or more"):
        be._non_negative("-1")


def test_sampling_bench_smoke_runs_the_three_engines_and_writes_json(tiny_dir, tmp_path):
    """`python -m nanodspark.bench sampling --smoke` on a tiny pair: both parts, every engine,
    JSON with argv and the device, the table printed last."""
    from nanodspark.lab import bench_sampling as bs
    from nanodspark.lab.bench import build_parser
    model = tmp_path / "pair"
    shutil.copytree(tiny_dir, model)
    make_drafter(model, model / "drafter")
    out = tmp_path / "sampling.json"
    args = build_parser().parse_args(["sampling", "--smoke", "--model", str(model), "--out", str(out)])
    res = bs.run(args)
    saved = json.loads(out.read_text())
    assert saved["argv"] and saved["device"] and saved["torch"] == res["torch"]
    assert [r["workload"] for r in res["workloads"]] == ["math"] and [r["batch"] for r in res["batches"]] == [1, 2]
    for r in res["workloads"]:
        assert set(bs.WORKLOAD_ENGINES) <= set(r) and all(r[n]["tau"] >= 1 for n in bs.WORKLOAD_ENGINES)
    for r in res["batches"]:
        assert all(r[n]["tok_s"] > 0 for n in bs.ENGINES)
        assert r["coupled-bi"]["request0_same_as_first_batch"]       # the reproducible engine
    assert "| reproducible / fastest |" in bs.markdown(res)


def test_swa_bench_smoke_writes_both_tables(tiny_dir, tmp_path):
    """`bench swa --smoke`: the follow-up prefill table on a tiny random hybrid (window 16) and
    the drift table on the tiny pair; the token counts are the mechanism's, exactly."""
    from nanodspark.lab import bench_swa as bsw
    from nanodspark.lab.bench import build_parser
    model = tmp_path / "pair"
    shutil.copytree(tiny_dir, model)
    make_drafter(model, model / "drafter")
    out = tmp_path / "swa.json"
    args = build_parser().parse_args(["swa", "--smoke", "--prefixes", "64", "--drift-model", str(model),
                                      "--drift-keeps", "auto", "--out", str(out)])
    res = bsw.swa_bench(args)
    rows = {r["mode"]: r for r in res["prefill"]["rows"]}
    assert set(rows) == set(bsw.MODES) and res["prefill"]["models"][0]["exact_replay_tokens"] == 30
    # 64 prefix + 4 answer + 8 new tokens; turn 1 published 64 (blocks of 16): the hit
    assert rows["no-cache"]["prefilled"] == rows["no-cache"]["prompt_tokens"] == 76
    assert (rows["exact"]["replayed"], rows["exact"]["prefilled"]) == (30, 30 + 12)       # 2 * (16 - 1)
    assert (rows["bounded"]["replayed"], rows["bounded"]["prefilled"]) == (17, 17 + 12)   # auto, no drafter: 16 + 1
    assert (rows["snapshot"]["replayed"], rows["snapshot"]["prefilled"], rows["snapshot"]["snapshot_hits"]) == (0, 12, 1)
    assert all(r["ttft_ms"] > 0 for r in rows.values()) and rows["snapshot"]["prefill_cut"] > 0.8
    drift = {r["setting"]: r for r in res["drift"]["rows"]}
    assert set(drift) == {"exact", "bounded auto", "snapshot"} and res["drift"]["gamma"] == 4
    assert drift["exact"]["kl_max"] == 0 and drift["exact"]["continuation_identical"] == 1
    assert drift["snapshot"]["kl_max"] < 1e-9 and drift["snapshot"]["snapshot_hits"] == 2
    assert drift["bounded auto"]["replay_keep"] == 16 + 5 and drift["bounded auto"]["tau"] >= 1
    assert res["suffix_rule"]["deepinfer"] == 140 and res["device"] and res["torch"]
    assert res["random_weights"] == ["hybrid Qwen3 tiny shape, RANDOM weights"]
    assert all(r["random_weights"] for r in res["prefill"]["rows"]) and not res["skipped"]
    saved = json.loads(out.read_text())
    assert saved["argv"] and saved["prefill"]["rows"] and "| setting |" in bsw.markdown(saved)


def test_host_bench_times_every_phase_of_real_steps_and_records_the_command(tiny_dir, tmp_path, monkeypatch):
    from nanodspark.lab import bench_host as bh
    model = tmp_path / "pair"
    shutil.copytree(tiny_dir, model)
    make_drafter(model, model / "drafter")
    monkeypatch.setattr("sys.argv", ["nanodspark.bench", "host", "--batches", "3"])
    out = tmp_path / "host.json"
    res = bh.host_bench(argparse.Namespace(model=str(model), drafter=None, batches=[3], steps=3, repeats=1,
                                           prompt_len=16, stop=["zz"], stream_text=True, out=str(out),
                                           compact_plain=False, plain_hold=None, compact_drafting=False))
    (row,) = json.loads(out.read_text())["rows"]
    assert row["batch"] == 3 and row == res["rows"][0]
    assert all(row[k] >= 0 for k in bh.PHASES) and row["commit"] > 0      # the forward is not counted as launch
    assert row["total"] == pytest.approx(sum(row[k] for k in bh.PHASES), abs=2e-3)
    assert res["argv"][-3:] == ["host", "--batches", "3"] and "torch" in json.dumps(res["environment"])


def test_compact_plain_makes_the_real_cost_scheduler_choose_plain_steps(tiny_dir, tmp_path):
    """`bench host --compact-plain` times the cost scheduler's plain steps: every decode step of an
    engine with its tables runs without the drafter's pass, chosen by `draft_choice` itself."""
    from nanodspark import LLM, SamplingParams
    from nanodspark.lab.bench_host import force_plain_steps
    model = tmp_path / "pair"
    shutil.copytree(tiny_dir, model)
    make_drafter(model, model / "drafter")
    llm = LLM(str(model), use_tqdm=False, verify_mode="compact", max_num_seqs=4, verify_plain_hold=1)
    force_plain_steps(llm.engine)
    assert llm.engine.windows.scheduler.plain_hold == 1      # `--plain-hold` reaches the scheduler
    drafted, choices = [], []
    sched = llm.engine.windows.scheduler
    real = sched.draft_choice
    sched.draft_choice = lambda *a: (choices.append(real(*a)), choices[-1])[1]
    llm.engine.extra_observers.append(type("Spy", (), {"observe": lambda self, r: r.decode is not None and
                                                       drafted.append(int(r.decode.out.drafted.sum()))})())
    llm.generate([[5, 6, 7, 8]] * 3, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert drafted and not any(drafted)
    assert choices and all(c is not None and c.fraction == 0 for c in choices)


def test_compact_drafting_makes_the_real_cost_scheduler_hold_every_row_drafting(tiny_dir, tmp_path):
    """`bench host --compact-drafting` times the cost scheduler where drafting always pays: every
    decode step drafts every row, and the clear choice holds (`draft_choice` reads the relay only
    when the hold ends or the batch grows)."""
    from nanodspark import LLM, SamplingParams
    from nanodspark.lab.bench_host import force_drafting_steps
    model = tmp_path / "pair"
    shutil.copytree(tiny_dir, model)
    make_drafter(model, model / "drafter")
    llm = LLM(str(model), use_tqdm=False, verify_mode="compact", max_num_seqs=4, verify_plain_hold=4)
    force_drafting_steps(llm.engine)
    drafted, reads = [], []
    relay = llm.engine.windows.scheduler.relay
    real = relay.lagged_np
    relay.lagged_np = lambda *a, **k: (reads.append(k.get("prior", False)), real(*a, **k))[1]
    llm.engine.extra_observers.append(type("Spy", (), {"observe": lambda self, r: r.decode is not None and
                                                       drafted.append(r.decode.out.drafted.all())})())
    llm.generate([[5, 6, 7, 8]] * 4, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert len(drafted) >= 8 and all(drafted)
    assert 0 < sum(reads) < len(drafted) / 2      # draft_choice's reads (prior=True): held most steps


def test_engine_speed_times_engines_without_the_prefix_cache(tiny_dir, tmp_path, monkeypatch):
    """The repeats reuse their prompts; with the prefix cache on, nanodspark would prefill a
    fraction of what transformers prefills from the second repeat on. The timed engines run
    without it (the torch system runs on the CPU: no transformers, no profile)."""
    import nanodspark
    from nanodspark.lab import bench_speed as bsp
    built = []
    real = nanodspark.LLM

    def spy(*a, **kw):
        built.append(kw)
        return real(*a, **kw)
    monkeypatch.setattr(nanodspark, "LLM", spy)
    p = argparse.ArgumentParser()
    bsp.add_speed_args(p)
    out = tmp_path / "speed.json"
    res = bsp.engine_speed(p.parse_args(["--model", str(tiny_dir), "--systems", "torch", "--batches", "2",
                                         "--max-tokens", "4", "--repeats", "2", "--profile-steps", "0",
                                         "--kv-gb", "0.05", "--max-num-batched-tokens", "3", "--out", str(out)]))
    (row,) = res["rows"]
    assert row["tokens"] == 2 * 4 and len(row["seconds_all"]) == 2 and "error" not in row
    assert built and all(kw["enable_prefix_cache"] is False for kw in built)
    assert row["max_num_batched_tokens"] == 3      # the chunk the engines ran with is in the JSON
    assert json.loads(out.read_text())["rows"] == res["rows"]


def test_transformers_gets_the_same_mix_prompts_left_padded(tiny_dir, monkeypatch):
    """With `--prompts mix` the real prompts are shorter than `prompt_len` and of different
    lengths (24 to 75 tokens for the default model at 128): transformers must get those same
    ids, padded on the left and masked, not random prompts of the full length, or the two
    systems do different work."""
    import torch
    import transformers
    from nanodspark.lab import bench_speed as bsp
    from nanodspark.loader import Tokenizer
    ids, mask = bsp.hf_batch([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    seen = []

    class Model:
        def cuda(self):
            return self

        def eval(self):
            return self
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Model())
    monkeypatch.setattr(bsp, "time_hf", lambda model, ps, *a: seen.append(ps) or {"tokens_per_second": 1.0})
    p = argparse.ArgumentParser()
    bsp.add_speed_args(p)
    bsp.engine_speed(p.parse_args(["--model", str(tiny_dir), "--systems", "hf-static", "--batches", "3",
                                   "--prompts", "mix", "--prompt-len", "12"]))
    tok = Tokenizer(tiny_dir)
    want = bsp._prompts(3, 12, 0, tokenizer=tok, kind="mix")
    assert seen == [want]
    assert want != bsp._prompts(3, 12, tok.vocab_size)      # real text, not random ids


def test_whole_step_profile_in_the_overlapped_loop(tiny_dir, tmp_path):
    """`loop="overlap"`: each call launches a step with its K and commits the one before it (so
    after a settle call the step committed has the K asked for), and close() commits the step in
    flight and leaves the engine empty, in its own loop, with its own policy."""
    from nanodspark import LLM
    model = tmp_path / "pair"
    shutil.copytree(tiny_dir, model)
    make_drafter(model, model / "drafter")
    llm = LLM(str(model), use_tqdm=False, max_num_seqs=3, kv_cache_memory_gb=0.05, verify_mode="compact")
    eng, running = llm.engine, llm.engine.scheduler.running
    policy, own_loop = eng.windows, eng.overlap
    with pytest.raises(ValueError, match="loop"):
        bp.profiled_loop(eng, "async")
    assert bp.profiled_loop(eng, "auto") == eng.config.overlap
    run = bp.whole_step_runner(llm, context_len=20, loop="overlap")
    assert eng.overlap
    run(3, 0)
    for k in (2, 3 * eng.gamma, 1):
        run(3, k)                                    # settle: launches k, commits the step before
        before = sum(r.spec.verified for r in running)
        run(3, k)                                    # timed: launches k, commits the settle step (k)
        assert sum(r.spec.verified for r in running) - before == k
        assert eng.in_flight is not None             # its own step is still on its way
    run.prepare(3, 0)
    run.close()
    assert eng.in_flight is None and not eng.has_unfinished() and eng.windows is policy
    assert eng.overlap == own_loop and all(u["used"] == 0 for u in eng.kv_usage().values())


def test_union_length_counts_overlapping_kernels_once():
    """GPU busy time is the union of the kernels' intervals: overlaps and nesting count once,
    gaps not at all, in any order."""
    from nanodspark.lab.bench_speed import union_length
    assert union_length([(5, 7), (0, 2), (1, 3), (6, 6.5), (10, 11)]) == 3 + 2 + 1
    assert union_length([]) == 0.0
