"""The tables of walkthrough/09_results.md, declared: which JSON each reads and where (the query
language is in report.py). `python -m nanodspark.bench report --write` regenerates the page's
blocks from these; `--check` fails when a block and its JSON disagree."""
from .report import Figure

H200 = "One NVIDIA H200, torch 2.11.0+cu130, Triton 3.6.0"
BATCHES = [{"b": b} for b in (1, 16, 64, 256)]

KERNEL_ROWS = [{"b": b, "c": c, "q": q} for b, c in ((8, 8192), (8, 32768), (64, 8192), (64, 32768),
                                                      (256, 8192), (256, 32768)) for q in (1, 4, 8)]
_K = "rows[batch={b},ctx={c},q_len={q}]"

_SPEED = "rows[system={loop},batch={b},drafter={d}]"
_PLAIN, _SPEC = _SPEED.replace("{d}", "null"), _SPEED.replace("{d}", "*")
PAIR_ROW = ["{loop_name}", "{b}", f"<{_PLAIN}.tokens_per_second|,.0f>",
            f"<{_SPEC}.tokens_per_second|,.0f> (<{_SPEC}.tau|.2f>)",
            f"<{_SPEC}.tokens_per_second / {_PLAIN}.tokens_per_second|.2f>",
            f"<{_PLAIN}.profile.step_ms|.2f> / <{_SPEC}.profile.step_ms|.2f>",
            f"<{_PLAIN}.profile.gpu_idle_ms_per_step / {_PLAIN}.profile.step_ms * 100|.0f> % · "
            f"<{_SPEC}.profile.gpu_idle_ms_per_step / {_SPEC}.profile.step_ms * 100|.0f> %"]
PAIR_HEADER = ["loop", "batch", "tok/s, no drafter", "tok/s, drafter (τ)", "spec / plain",
               "step ms, plain / spec", "GPU idle per step, plain · spec"]
PAIR_OVER = [{"loop": loop, "loop_name": name, "b": b} for loop, name in (("graphs", "graphs, sync"),
                                                                         ("overlap", "overlap"))
             for b in (1, 16, 64, 256)]

_HL = "runs.{run}[batch={b}]"
_PHASES = " / ".join(f"<{_HL}.{p}|.2f>" for p in ("schedule", "launch_less_forward", "result", "commit"))

_SS = "sweep[mode={m},concurrency={c}].total_tok_s"
_PAIRED = "paired[concurrency={c},ratio={r}].median"
_G = "sweep[mode={m},concurrency={c}].total_tok_s"
_ACC = "sweep[mode={m},concurrency={{c}}].accounting"
_DEC = ("s:sweep[mode={m},concurrency={{c}}].accounting.decode_only_s / "
        "s:sweep[mode={m},concurrency={{c}}].accounting.decode_only_steps")
_T = "@{T}"                                     # a table of a cost file, by its model name
_SMOL = "smollm2-135m (random weights)"
# one row of benchmarks/api_servers_h200.json's summary (% (concurrency, client processes))
_APIS = "a:summary[call={call},side=n{n},concurrency=%d,clients=%d]"


def _paired_cell(ratio: str) -> str:
    """A sweep's paired ratio at concurrency {c}: the median of its rounds (min–max)."""
    return (f"<{_PAIRED}|.2f> (<paired[concurrency={{c}},ratio={ratio}].min|.2f>–"
            f"<paired[concurrency={{c}},ratio={ratio}].max|.2f>)").replace("{r}", ratio)


_AT_LOAD = ("static/no-spec", "compact/no-spec", "compact/static", "static-b/static")
_AT_LOAD_HEADS = ["static / no-spec", "compact / no-spec", "compact / static", "A/A: static-b / static"]


def _host_cells(field: str = _ACC + ".host_phases_s", phases=("launch", "commit", "result"),
                systems=("no-spec", "compact")) -> list[str]:
    """Two systems' host time per phase at concurrency {c} (no-spec's and compact's), one cell each."""
    return [" · ".join(f"<{field.format(m=m)}.{ph}|.2f>" for ph in phases) for m in systems]


def _at_load(name: str, path: str, caption: str, concurrencies, tok_s: bool = False) -> Figure:
    """A sweep's paired ratios of no-spec, static, compact and the A/A control, and the host's
    seconds per phase of the window (launch, commit, waiting for the GPU)."""
    heads = ["concurrency"] + ["no-spec tok/s"] * tok_s + _AT_LOAD_HEADS
    cells = ["{c}"] + [f"<{_SS}|,.0f>".replace("{m}", "no-spec")] * tok_s + [_paired_cell(r) for r in _AT_LOAD]
    return Figure(name, {"s": path}, caption,
                  heads + ["host s, launch · commit · waiting for the GPU: no-spec", "the same: compact"],
                  [cells + _host_cells()], [{"c": c} for c in concurrencies])


def _ratio_range(row: str) -> str:
    return f"<{row}.over_in_process|.2f> (<{row}.over_in_process_min|.2f>–<{row}.over_in_process_max|.2f>)"


# compact's steps in which some, none and all of the requests drafted (a partial step, a plain one)
_COMPACT_STEPS = " · ".join(f"<{_ACC.format(m='compact')}.{f}|.0f>" for f in ("partial_steps", "plain_steps", "steps"))

_SERVER = {"cpu_300_unhardened": "CPU, the server before its hardening, 300 requests at 32",
           "cpu_300": "CPU, 300 requests at 32", "cpu_2000": "CPU, 2,000 requests at 64",
           "cpu_2000_seed1": "CPU, 2,000 requests at 64, a second call (`--seed 1`)",
           "h200": "H200, 2,000 requests at 64"}

def _profile(name: str, path: str, gamma: int, hardware: str, batches=(1, 16, 64, 128, 256),
             trend: bool = True, table: str | None = None) -> Figure:
    """A step-cost profile: per batch size, the raw step at K = 0 and with full blocks, their
    ratio, the trend gate's z (`trend`: a profile of one round has none) and what the table
    (monotone, gated) keeps for full blocks. `table`: the model name of the file's table
    shown, where the file holds several."""
    head = ["batch", "ms per step, K = 0", f"ms, full blocks (K = {gamma} × batch)", "full / K = 0",
            "trend z", "in the table, full blocks"]
    row = ["{b}", "<*.raw[0={b},1=0].2 * 1000|.2f>", "<*.raw[0={b},1={k}].2 * 1000|.2f>",
           "<*.raw[0={b},1={k}].2 / *.raw[0={b},1=0].2|.2f>", "<*.notes.trend_z.{b}|.2f>",
           "<*.measurements[0={b},1={k}].2 * 1000|.2f>"]
    if not trend:
        del head[4], row[4]
    if table is not None:
        row = [r.replace("<*.", f"<@{table}.").replace("/ *.", f"/ @{table}.") for r in row]
    return Figure(name, {"t": path}, hardware, head, [row], [{"b": b, "k": gamma * b} for b in batches])


def _prediction(name: str, key: str, shape: str) -> Figure:
    """`bench simulate` at τ 3.21 and 6.17 on a shape's H200 tables: speedups by concurrency."""
    return Figure(name, {"lo": f"benchmarks/prediction_{key}_tau3.21_h200.json",
                         "hi": f"benchmarks/prediction_{key}_tau6.17_h200.json"},
                  f"A PREDICTION (`bench simulate`, on a CPU) from the H200 step-cost tables of {shape}, acceptance "
                  "traces of the default pair scaled to τ 3.21 and 6.17 at block 7, prefill priced at 5 ms + 30 µs "
                  "per token (assumed, not measured), admission in waves",
                  ["concurrency", "τ 3.21: static / no-spec", "τ 3.21: compact / no-spec", "τ 3.21: compact / static",
                   "τ 6.17: static / no-spec", "τ 6.17: compact / static"],
                  [["{c}"] + [f"<{a}:{_G.replace('{m}', m)} / {a}:{_G.replace('{m}', d)}|.2f>"
                              for a, m, d in (("lo", "static", "no-spec"), ("lo", "compact", "no-spec"),
                                              ("lo", "compact", "static"), ("hi", "static", "no-spec"),
                                              ("hi", "compact", "static"))]],
                  [{"c": c} for c in (1, 16, 64, 128, 256)])


def _simulator_check(name: str, pair: str, hardware: str, held_out: bool = False,
                     concurrencies=(1, 16, 64, 256), held_out_head: str = "error, fitted without this concurrency",
                     systems=("no-spec", "static", "compact")) -> Figure:
    """`bench simulate --compare` at each concurrency: measured against predicted total tok/s
    (`held_out`: also predicted with the overheads fitted on the other concurrencies only)."""
    files = {f"c{c}": f"benchmarks/simulator_check_{pair}_c{c}.json" for c in concurrencies}
    head = ["concurrency", "system", "measured tok/s", "predicted tok/s", "error"]
    row = ["{c}", "{m}", "<c{c}:compare[mode={m}].measured_total|,.0f>", "<c{c}:compare[mode={m}].predicted_total|,.0f>",
           "<c{c}:compare[mode={m}].total_error * 100|+.1f> %"]
    if held_out:
        files.update({f"h{c}": f"benchmarks/simulator_loo_{pair}_c{c}.json" for c in concurrencies})
        head += [held_out_head]
        row += ["<h{c}:compare[mode={m}].total_error * 100|+.1f> %"]
    return Figure(name, files, hardware, head, [row],
                  [{"c": c, "m": m} for c in concurrencies for m in systems])


def _thesis_8b(name: str, law: str, caption: str) -> Figure:
    """The Qwen3-8B shape under one synthetic acceptance law: no-spec / static / compact by
    concurrency, their ratios, drafts verified and tokens committed per request-step."""
    per_step = lambda field, extra="": " · ".join(          # noqa: E731
        f"<{_ACC.format(m=m)}.{field} / {_ACC.format(m=m)}.decode_request_steps{extra}|.2f>" for m in ("static", "compact"))
    return Figure(name, {"s": f"benchmarks/steady_state_qwen3_8b_law{law}_h200.json"}, H200 + caption,
                  ["concurrency", "no-spec tok/s", "static tok/s", "compact tok/s", "static / no-spec",
                   "compact / no-spec", "compact / static", "drafts verified per request-step, static · compact",
                   "tokens per request-step, static · compact"],
                  [["{c}"] + [f"<{_SS}|,.0f>".replace("{m}", m) for m in ("no-spec", "static", "compact")]
                   + [f"<{_PAIRED}|.2f>".replace("{r}", r) for r in ("static/no-spec", "compact/no-spec",
                                                                     "compact/static")]
                   + [per_step("drafts_verified"), per_step("drafts_accepted", " + 1")]],
                  [{"c": c} for c in (1, 16, 64, 256)])


def _host_phases(name: str, kind: str, machine: str, hardware: str, runs, what: str) -> Figure:
    """`bench host` by phase, three runs one after the other: a baseline, the cost scheduler's
    choice held (the default) and made every step (`--plain-hold 1`), from
    benchmarks/host_{kind}_{file}_{machine}.json; `runs`: (alias, file, column label) each."""
    files = {a: f"benchmarks/host_{kind}_{f}_{machine}.json" for a, f, _ in runs}
    phases = "schedule / launch less the forward / result / commit"
    head = ["batch"] + [h for _, _, label in runs for h in (label.format(phases=phases), "total")]
    return Figure(name, files, hardware + "; " + what, head,
                  [["{b}"] + [cell for a in files for cell in (
                      " / ".join(f"<{a}:rows[batch={{b}}].{k}|.2f>" for k in ("schedule", "launch_less_forward",
                                                                              "result", "commit")),
                      f"<{a}:rows[batch={{b}}].total|.2f>")]],
                  [{"b": 64}, {"b": 256}])


def _host_plain(name: str, machine: str, hardware: str) -> Figure:
    """Plain decoding beside compact's plain steps (`--compact-plain`)."""
    return _host_phases(name, "plain", machine, hardware,
                        (("n", "nospec", "plain decoding: {phases}"), ("c", "compact", "compact, plain steps: {phases}"),
                         ("h", "compact_hold1", "the same, choosing every step (`--plain-hold 1`)")),
                        "plain decoding (`--drafter none`) and the cost scheduler choosing a plain step at every step "
                        "(`--compact-plain`; the choice held 8 steps, the default, and made every step), one after "
                        "the other")


def _host_drafting(name: str, machine: str, hardware: str) -> Figure:
    """Static beside compact with every row drafting (`--compact-drafting`)."""
    return _host_phases(name, "drafting", machine, hardware,
                        (("s", "static", "static: {phases}"), ("c", "compact", "compact, every row drafting: {phases}"),
                         ("h", "compact_hold1", "the same, choosing every step (`--plain-hold 1`)")),
                        "the default pair, static (full blocks, no scheduler) and the cost scheduler choosing every "
                        "row drafting at every step (`--compact-drafting`; the clear choice held 8 steps, the default, "
                        "and made every step), one after the other")


FIGURES = [
    Figure("kernels", {"k": "benchmarks/kernels_h200.json"}, H200 + " (Qwen3-8B attention shape, bf16, pages of 16)",
           ["batch", "context", "q_len", "Triton, graph µs", "% of copy bandwidth (graph)", "SDPA, graph µs",
            "SDPA / Triton (graph)"],
           [["{b}", "{c}", "{q}", f"<{_K}.triton_graph_us|.1f>",
             f"<{_K}.bytes / {_K}.triton_graph_us / copy_GBps / 10|.0f>",
             f"<{_K}.sdpa_graph_us|.1f>", f"<{_K}.sdpa_graph_us / {_K}.triton_graph_us|.2f>"]], KERNEL_ROWS),

    Figure("engine-vs-transformers", {"e": "benchmarks/engine_speed_qwen3_0.6b_h200.json"},
           H200 + "; Qwen3-0.6B shape, random weights, 128 random-token prompts, 64 new tokens, greedy, "
           "prefill included, prefix cache off, medians of 3",
           ["batch", "transformers, static cache (compiled), tok/s", "graphs, sync, tok/s (× hf)",
            "graphs + overlap, tok/s (× hf)", "GPU idle per step, sync · overlap"],
           [["{b}", "<rows[system=hf-static,batch={b}].tokens_per_second|,.0f>",
             "<rows[system=graphs,batch={b}].tokens_per_second|,.0f> (<ratios[system=graphs,batch={b}].over_hf_static|.2f>)",
             "<rows[system=overlap,batch={b}].tokens_per_second|,.0f> (<ratios[system=overlap,batch={b}].over_hf_static|.2f>)",
             "<rows[system=graphs,batch={b}].profile.gpu_idle_ms_per_step / rows[system=graphs,batch={b}].profile.step_ms"
             " * 100|.0f> % · <rows[system=overlap,batch={b}].profile.gpu_idle_ms_per_step / "
             "rows[system=overlap,batch={b}].profile.step_ms * 100|.0f> %"]], BATCHES),

    Figure("prefill-chunk", {"e": "benchmarks/engine_chunk_ab_qwen3_h200.json"},
           H200 + "; Qwen3-0.6B shape, random weights, overlapped loop, one call",
           ["batch", "chunk 2,048, tok/s", "chunk 8,192, tok/s", "8,192 / 2,048"],
           [["{b}", "<runs.2048.rows[batch={b}].tokens_per_second|,.0f>",
             "<runs.8192.rows[batch={b}].tokens_per_second|,.0f>",
             "<runs.8192.rows[batch={b}].tokens_per_second / runs.2048.rows[batch={b}].tokens_per_second|.2f>"]],
           [{"b": 64}, {"b": 256}]),

    Figure("default-pair-speed", {"e": "benchmarks/engine_speed_default_pair_h200.json"},
           H200 + "; the default pair, mixed-workload prompts cut to 128 tokens, 64 new tokens, greedy, prefix "
           "cache off, medians of 3", PAIR_HEADER, [PAIR_ROW], PAIR_OVER),

    Figure("smollm2-pair-speed", {"e": "benchmarks/engine_speed_smollm2_pair_h200.json"},
           H200 + "; SmolLM2-135M-Instruct (pretrained weights) and a DSpark drafter trained for it, mix prompts, "
           "64 new tokens, greedy, prefill chunk 2,048", PAIR_HEADER, [PAIR_ROW], PAIR_OVER,
           command="`python -m nanodspark.bench engine --model .carry/smol --drafter .carry/smol_dr/dspark --prompts mix "
                   "--systems graphs overlap --batches 1 16 64 256 --repeats 3 --profile-steps 6 --out "
                   "$OUT/engine_smol.json` (the file's `argv` names the same folders under `/tmp/t`)"),

    Figure("host-light-phases", {"h": "benchmarks/host_light_h200.json"},
           H200 + " (its 16-core host); the default pair with its drafter, synchronous step, medians of 12 steps × 3 "
           "repeats, before and after alternating in one call",
           ["engine, round", "batch 64: schedule / launch less the forward / result / commit", "batch 64 total",
            "batch 256: schedule / launch less the forward / result / commit", "batch 256 total"],
           [["{name}", _PHASES.replace("{b}", "64"), f"<{_HL}.total|.2f>".replace("{b}", "64"),
             _PHASES.replace("{b}", "256"), f"<{_HL}.total|.2f>".replace("{b}", "256")]],
           [{"run": "host_old_1", "name": "before, 1"}, {"run": "host_old_2", "name": "before, 2"},
            {"run": "host_new_1", "name": "after, 1"}, {"run": "host_new_2", "name": "after, 2"},
            {"run": "host_old_stream", "name": "before, text streamed in the engine"},
            {"run": "host_new_stream", "name": "after, text streamed in the engine"}],
           command="`bash tests/device/measure.sh step` (its `bench host` lines, each in the file's `commands`: "
                   "`python -m nanodspark.bench host --batches 64 256 --steps 12 --repeats 3`, with `--stream-text` for "
                   "text streamed; the engine before, from its own folder, with `--offline` for no text in the step)"),

    Figure("host-light-engine", {"e": "benchmarks/engine_host_light_h200.json"},
           H200 + "; `bench engine`, the default target without its drafter, overlapped loop, 128 random-token "
           "prompts, 128 new tokens, prefill included, prefix cache off, medians of 3",
           ["engine, round", "batch 64 tok/s", "batch 256 tok/s", "GPU busy, 64 · 256"],
           [["{name}", "<runs.{run}.rows[batch=64,drafter=null].tokens_per_second|,.0f>",
             "<runs.{run}.rows[batch=256,drafter=null].tokens_per_second|,.0f>",
             "<runs.{run}.rows[batch=64,drafter=null].profile.gpu_busy|.2f> · "
             "<runs.{run}.rows[batch=256,drafter=null].profile.gpu_busy|.2f>"]],
           [{"run": "engine_old_1", "name": "before, 1"}, {"run": "engine_old_2", "name": "before, 2"},
            {"run": "engine_new_1", "name": "after, 1"}, {"run": "engine_new_2", "name": "after, 2"}],
           command="`bash tests/device/measure.sh step` (its `bench engine` lines; each run's `argv` is in the file)"),

    Figure("gpu-busy", {"e": "benchmarks/engine_busy_h200.json"},
           H200 + "; the default pair, overlapped loop, no text in the step, 128 random-token prompts, 128 new tokens, "
           "medians of 2",
           ["batch", "drafter", "tok/s", "step ms", "GPU busy", "kernels per step"],
           [["{b}", "{name}", "<rows[batch={b},drafter={d}].tokens_per_second|,.0f>",
             "<rows[batch={b},drafter={d}].profile.step_ms|.2f>", "<rows[batch={b},drafter={d}].profile.gpu_busy|.2f>",
             "<rows[batch={b},drafter={d}].profile.kernels_per_step|.0f>"]],
           [{"b": b, "d": d, "name": name} for b in (64, 256) for d, name in (("null", "no"), ("*", "yes"))]),

    Figure("gpu-busy-smollm2-shape", {"e": "benchmarks/engine_busy_smollm2_shape_h200.json"},
           H200 + "; the SmolLM2-135M pair's shapes with RANDOM WEIGHTS (`--shape smollm2-135m`: the target and "
           "the drafter train_heads.py trains for it, 2 layers, gamma 5), drafts accepted by a synthetic law (each "
           "request's rate uniform in 0.3–0.6, τ as the trained drafter's 1.8), overlapped loop, no text in the "
           "step, 128 random-token prompts, 128 new tokens, medians of 2",
           ["batch", "drafter", "tok/s", "τ", "step ms", "GPU busy", "kernels per step"],
           [["{b}", "{name}", "<rows[batch={b},drafter={d}].tokens_per_second|,.0f>", "{tau}",
             "<rows[batch={b},drafter={d}].profile.step_ms|.2f>", "<rows[batch={b},drafter={d}].profile.gpu_busy|.2f>",
             "<rows[batch={b},drafter={d}].profile.kernels_per_step|.0f>"]],
           [{"b": b, "d": d, "name": name, "tau": "1" if d == "null" else f"<rows[batch={b},drafter=*].tau|.2f>"}
            for b in (64, 256) for d, name in (("null", "no"), ("*", "yes"))]),

    Figure("host-per-step", {"h": "benchmarks/host_h200.json"},
           H200 + " (its 16-core host); `bench host`, the default pair with its drafter, synchronous step (the result "
           "phase holds the wait for the GPU), medians of 12 steps × 3 repeats",
           ["batch", "schedule", "launch less the forward", "result (with the GPU wait)", "commit", "total",
            "host work without the GPU wait"],
           [["{b}", "<rows[batch={b}].schedule|.3f>", "<rows[batch={b}].launch_less_forward|.3f>",
             "<rows[batch={b}].result|.3f>", "<rows[batch={b}].commit|.3f>", "<rows[batch={b}].total|.2f>",
             "<rows[batch={b}].schedule + rows[batch={b}].launch_less_forward + rows[batch={b}].commit|.2f> + the "
             "result's copy"]],
           [{"b": 1}, {"b": 64}, {"b": 256}]),

    Figure("serve-http", {"http": "benchmarks/serve_http_h200.json", "same": "benchmarks/serve_engine_h200.json"},
           H200 + "; the default pair, closed loop, mix workload, greedy, 128 ± 25 % new tokens, prefix cache off, "
           "admission in waves; `serve.py` spawned per system (engine core in its own process, uvloop + httptools), "
           "one 6 s window after 3 s; in-process: `bench serve --frontend engine` at 64 and 256 in the same device call",
           ["concurrency", "HTTP, no drafter", "HTTP, drafter", "HTTP: drafter / none", "in-process, drafter",
            "HTTP / in-process (drafter)", "TTFT p50 ms, HTTP (drafter)"],
           [["{c}", "<http:sweep[mode=no-spec,concurrency={c}].total_tok_s|,.0f>",
             "<http:sweep[mode=static,concurrency={c}].total_tok_s|,.0f>",
             "<http:sweep[mode=static,concurrency={c}].total_tok_s / http:sweep[mode=no-spec,concurrency={c}].total_tok_s|.2f>",
             "{inproc}", "{ratio}", "<http:sweep[mode=static,concurrency={c}].ttft_ms.p50|.0f>"]],
           [{"c": 1, "inproc": "", "ratio": ""}, {"c": 16, "inproc": "", "ratio": ""}] +
           [{"c": c, "inproc": f"<same:sweep[mode=static,concurrency={c}].total_tok_s|,.0f>",
             "ratio": f"<http:sweep[mode=static,concurrency={c}].total_tok_s / "
                      f"same:sweep[mode=static,concurrency={c}].total_tok_s|.2f>"} for c in (64, 256)]),

    Figure("serve-front", {"before": "benchmarks/front_before_relay_h200.json", "relay": "benchmarks/front_relay_h200.json",
                           "engA": "benchmarks/front_relay_engine_h200.json",
                           "threads": "benchmarks/front_threads_h200.json", "inline": "benchmarks/front_inline_h200.json",
                           "engB": "benchmarks/serve_engine_h200.json"},
           H200 + "; the default pair with its drafter (static windows), closed loop at 64 and 256, mix workload, "
           "greedy, one 6 s window after 3 s; each row's in-process figure from the same device call (A: rows 1–2, "
           "uvloop + h11; B: rows 3–4, uvloop + httptools). Device calls differ in host speed, so compare rows "
           "within a call",
           ["API process", "call", "HTTP tok/s, 64 · 256", "÷ in-process, 64 · 256", "TTFT p50 ms, 64 · 256"],
           [["{name}", "{call}",
             "<{k}:sweep[concurrency=64].total_tok_s|,.0f> · <{k}:sweep[concurrency=256].total_tok_s|,.0f>",
             "<{k}:sweep[concurrency=64].total_tok_s / {e}:sweep[mode=static,concurrency=64].total_tok_s|.2f> · "
             "<{k}:sweep[concurrency=256].total_tok_s / {e}:sweep[mode=static,concurrency=256].total_tok_s|.2f>",
             "<{k}:sweep[concurrency=64].ttft_ms.p50|.0f> · <{k}:sweep[concurrency=256].ttft_ms.p50|.0f>"]],
           [{"name": "a delivery and a chunk per step, metrics per row (before)", "call": "A", "k": "before", "e": "engA"},
            {"name": "the relay, merged chunks, metrics in bulk", "call": "A", "k": "relay", "e": "engA"},
            {"name": "the same, every body prepared in a worker thread", "call": "B", "k": "threads", "e": "engB"},
            {"name": "the same, small bodies prepared on the event loop (the default)", "call": "B", "k": "inline",
             "e": "engB"}]),

    Figure("serve-api", {"a": "benchmarks/api_lean_h200.json"},
           H200 + "; the default pair with its drafter (static windows), closed loop, mix workload, greedy; in each "
           "call the servers are up at once and warmed, then rounds old new [swi swi] new old, one 6 s window after "
           "2 s at 256 and at 64; medians of two rounds, ÷ in-process (min–max) against the engine in-process in the "
           "same call. old: 06ab263; new: the lean stream path; swi: new with `sys.setswitchinterval(0.0005)` in "
           "both server processes (an experiment, not adopted)",
           ["call", "API process", "HTTP tok/s, 64 · 256", "÷ in-process at 64", "÷ in-process at 256",
            "TTFT ms at 256: client p50 · server mean", "API process cores at 256"],
           [["{call}", "{side}",
             "<a:summary[call={call},side={side},concurrency=64].total_tok_s|,.0f> · "
             "<a:summary[call={call},side={side},concurrency=256].total_tok_s|,.0f>",
             "<a:summary[call={call},side={side},concurrency=64].over_in_process|.2f> "
             "(<a:summary[call={call},side={side},concurrency=64].over_in_process_min|.2f>–"
             "<a:summary[call={call},side={side},concurrency=64].over_in_process_max|.2f>)",
             "<a:summary[call={call},side={side},concurrency=256].over_in_process|.2f> "
             "(<a:summary[call={call},side={side},concurrency=256].over_in_process_min|.2f>–"
             "<a:summary[call={call},side={side},concurrency=256].over_in_process_max|.2f>)",
             "<a:summary[call={call},side={side},concurrency=256].ttft_p50_ms|.0f> · "
             "<a:summary[call={call},side={side},concurrency=256].first_token_after_submit_ms|.0f>",
             "<a:summary[call={call},side={side},concurrency=256].api_cpu_share|.2f>"]],
           [{"call": c, "side": s} for c, sides in (("1", ("old", "new")), ("2", ("old", "new", "swi")),
                                                      ("3", ("old", "new"))) for s in sides]),

    Figure("serve-api-servers", {"a": "benchmarks/api_servers_h200.json"},
           H200 + "; the default pair with its drafter (static windows), closed loop, mix workload, greedy; "
           "`serve.py --api-server-count N` for N = 1, 2, 4, the three servers up at once and warmed, then rounds "
           "n1 n2 n4 n4 n2 n1, one 6 s window after 2 s at 256 and at 64 from one client process; medians of two "
           "rounds, ÷ in-process (min–max) against the engine in-process in the same call; call 1 on 7fbbec1, "
           "call 2 on 3a8c5c7 (the core's split in a thread of its own)",
           ["call", "API processes", "HTTP tok/s, 64 · 256", "÷ in-process at 64", "÷ in-process at 256",
            "per-user tok/s at 256", "TTFT p50 ms at 256", "cores at 256: API processes · client"],
           [["{call}", "{n}", f"<{_APIS % (64, 1)}.total_tok_s|,.0f> · <{_APIS % (256, 1)}.total_tok_s|,.0f>",
             _ratio_range(_APIS % (64, 1)), _ratio_range(_APIS % (256, 1)),
             f"<{_APIS % (256, 1)}.per_user_tok_s|,.0f>", f"<{_APIS % (256, 1)}.ttft_p50_ms|.0f>",
             f"<{_APIS % (256, 1)}.api_cpu_share|.2f> · <{_APIS % (256, 1)}.client_cpu_share|.2f>"]],
           [{"call": c, "n": n} for c in ("1", "2") for n in (1, 2, 4)]),

    Figure("serve-api-servers-two-clients", {"a": "benchmarks/api_servers_h200.json"},
           H200 + "; call 2 of the table above, each round's server also at 256 from two client processes of 128 "
           "streams at once (their tok/s summed); medians of two rounds",
           ["API processes", "tok/s at 256: one client · two", "÷ in-process: one client · two",
            "client cores: one · two"],
           [["{n}"] + [" · ".join(f"<{_APIS % (256, k)}.{field}|{fmt}>" for k in (1, 2))
                       for field, fmt in (("total_tok_s", ",.0f"), ("over_in_process", ".2f"),
                                          ("client_cpu_share", ".2f"))]],
           [{"call": "2", "n": n} for n in (1, 2, 4)]),

    Figure("server-load", {k: f"benchmarks/server_load_{k}.json" for k in _SERVER},
           "`python serve.py` (the default pair) on loopback; CPU rows on 2 shared cores, float32",
           ["run", "requests ok", "errors (5xx or dropped)", "fault replies not as expected", "latency p50 / p99 s", "output tok/s",
            "leaked KV blocks", "resident MiB, after warm-up → end"],
           [[name, f"<{k}:requests_ok|,>", f"<{k}:errors|>", f"<{k}:fault_mismatch|>",
             f"<{k}:latency_p50_s|.2f> / <{k}:latency_p99_s|.2f>", f"<{k}:output_tokens_per_s|,.0f>",
             f"<{k}:leaked_kv_blocks|.0f>",
             f"<{k}:memory_start.resident_bytes / 1048576|,.0f> → <{k}:memory_end.resident_bytes / 1048576|,.0f>"]
            for k, name in _SERVER.items()]),

    Figure("thesis-steady-state", {"s": "benchmarks/steady_state_default_overlap_table_h200.json"},
           H200 + "; the default pair in-process, closed loop, mix workload (128 ± 25 % new tokens), greedy, "
           "prefix cache off, admission in waves (the default), compact on the table profiled in the overlapped "
           "loop, one 5 s window per engine after 2 s, one round",
           ["concurrency", "no-spec tok/s", "static tok/s", "compact tok/s", "static-b tok/s",
            "static / no-spec", "compact / static", "A/A: static-b / static"],
           [["{c}"] + [f"<{_SS}|,.0f>".replace("{m}", m) for m in ("no-spec", "static", "compact", "static-b")]
            + [f"<{_PAIRED}|.2f>".replace("{r}", r) for r in ("static/no-spec", "compact/static", "static-b/static")]],
           [{"c": 1}, {"c": 16}, {"c": 64}, {"c": 256}]),

    Figure("thesis-rounds", {"s": "benchmarks/steady_state_default_rounds_h200.json"},
           H200 + "; as above, two rounds in rotating order, each engine warmed by an unmeasured 3 s round and "
           "the engines' objects frozen out of the garbage collector first; paired medians (min–max)",
           ["concurrency", "static / no-spec", "compact / no-spec", "compact / static", "A/A: static-b / static"],
           [["{c}"] + [f"<{_PAIRED}|.2f> (<{_PAIRED.replace('median', 'min')}|.2f>–<{_PAIRED.replace('median', 'max')}|.2f>)"
                       .replace("{r}", r) for r in ("static/no-spec", "compact/no-spec", "compact/static",
                                                     "static-b/static")]],
           [{"c": 64}, {"c": 256}]),

    Figure("admission-waves", {"w": "benchmarks/steady_state_default_h200.json",
                               "a": "benchmarks/steady_state_admit_at_once_h200.json"},
           H200 + "; the default pair in-process, as above, both in one call: admission at once "
                  "(`--max-waiting-steps 0`) and in waves (up to 8 steps, the default with CUDA graphs)",
           ["system", "concurrency", "at once: tok/s", "in waves: tok/s", "waves / at once",
            "TTFT p50 ms, at once / waves", "engine steps, at once / waves"],
           [["{m}", "{c}", "<a:sweep[mode={m},concurrency={c}].total_tok_s|,.0f>",
             "<w:sweep[mode={m},concurrency={c}].total_tok_s|,.0f>",
             "<w:sweep[mode={m},concurrency={c}].total_tok_s / a:sweep[mode={m},concurrency={c}].total_tok_s|.2f>",
             "<a:sweep[mode={m},concurrency={c}].ttft_ms.p50|.1f> / <w:sweep[mode={m},concurrency={c}].ttft_ms.p50|.1f>",
             "<a:sweep[mode={m},concurrency={c}].engine_steps|,.0f> / <w:sweep[mode={m},concurrency={c}].engine_steps|,.0f>"]],
           [{"m": m, "c": c} for m in ("no-spec", "static") for c in (64, 256)]),

    Figure("thesis-smollm2", {"s": "benchmarks/steady_state_smollm2_h200.json"},
           H200 + "; the SmolLM2-135M-Instruct pair (its exported target and a drafter trained on it for 270 s on "
           "the H200) in-process, closed loop, mix workload (128 ± 25 % new tokens), greedy, prefix cache off, "
           "admission in waves, one 10 s window per engine after 3 s, one round",
           ["concurrency", "no-spec tok/s", "static tok/s", "compact tok/s", "static / no-spec", "compact / no-spec",
            "compact / static", "A/A: static-b / static", "drafts verified per request-step, static · compact",
            "accepted / verified, static · compact"],
           [["{c}"] + [f"<{_SS}|,.0f>".replace("{m}", m) for m in ("no-spec", "static", "compact")]
            + [f"<{_PAIRED}|.2f>".replace("{r}", r) for r in ("static/no-spec", "compact/no-spec", "compact/static",
                                                              "static-b/static")]
            + [" · ".join(f"<{_ACC.format(m=m)}.drafts_verified / {_ACC.format(m=m)}.decode_request_steps|.2f>"
                          for m in ("static", "compact")),
               " · ".join(f"<{_ACC.format(m=m)}.drafts_accepted / {_ACC.format(m=m)}.drafts_verified|.2f>"
                          for m in ("static", "compact"))]],
           [{"c": 1}, {"c": 16}, {"c": 64}, {"c": 256}]),

    Figure("prefill-graphs", {"de": "benchmarks/prefill_graphs_ab_default_eager_h200.json",
                              "dg": "benchmarks/prefill_graphs_ab_default_h200.json",
                              "se": "benchmarks/prefill_graphs_ab_smollm2_shape_eager_h200.json",
                              "sg": "benchmarks/prefill_graphs_ab_smollm2_shape_h200.json"},
           H200 + "; in-process, closed loop, mix workload, greedy, prefix cache off, admission in waves, one 5 s "
           "window per engine after 2 s; each pair's two runs (`--eager-prefill`, then prefill graphs, the "
           "default) in one call; the SmolLM2 pair's shapes with RANDOM WEIGHTS and a synthetic law (0.3–0.6)",
           ["pair", "system", "concurrency", "eager prefill: tok/s", "prefill graphs: tok/s", "graphs / eager",
            "prefill tiers captured"],
           [["{name}", "{m}", "{c}", "<{p}e:" + _SS + "|,.0f>", "<{p}g:" + _SS + "|,.0f>",
             "<{p}g:" + _SS + " / {p}e:" + _SS + "|.2f>", "<{p}g:" + _ACC.replace("{{c}}", "{c}") + ".prefill_graphs|.0f>"]],
           [{"p": p, "name": name, "m": m, "c": c} for p, name in (("d", "default"), ("s", "SmolLM2 shapes"))
            for m in ("no-spec", "static") for c in (64, 256)]),

    Figure("profile-against-served-smollm2-shape", {"t": "benchmarks/cost_table_smollm2_shape_h200.json",
                                                    "s": "benchmarks/steady_state_smollm2_shape_law_h200.json"},
           H200 + "; the SmolLM2 shapes (RANDOM WEIGHTS): each kind of step as its profile prices it (the table, "
           "timed in the overlapped loop, no text in the step, context 256) and as the sweep's decode-only steps "
           "cost at that concurrency in the one-round sweep under verify.py's law (its accounting: their seconds over "
           "their count; drafts committed at the law's rate); a dash where the sweep ran no step of that kind",
           ["batch", "every row drafting: profile, full blocks", "static: served", "served / profile",
            "plain step of the speculative engine: profile (draft 0)", "compact's plain step: served",
            "the target alone: profile", "no-spec: served", "served / profile"],
           [["{c}", f"<t:{_T}.raw[0={{c}},1={{k}}].2 * 1000|.2f>".replace("{T}", "{full}"),
             f"<{_DEC.format(m='static')} * 1000|.2f>",
             f"<{_DEC.format(m='static')} / t:{_T}.raw[0={{c}},1={{k}}].2|.2f>".replace("{T}", "{full}"),
             f"<t:{_T}.raw[0={{c}},1=0].2 * 1000|.2f>".replace("{T}", "{zero}"), "{plain}",
             f"<t:{_T}.raw[0={{c}},1=0].2 * 1000|.2f>".replace("{T}", "{alone}"),
             f"<{_DEC.format(m='no-spec')} * 1000|.2f>",
             f"<{_DEC.format(m='no-spec')} / t:{_T}.raw[0={{c}},1=0].2|.2f>".replace("{T}", "{alone}")]],
           [{"c": c, "k": 5 * c, "full": _SMOL, "zero": _SMOL + " (draft 0)", "alone": _SMOL + " (no drafter)",
             "plain": f"<{_DEC.format(m='compact').replace('{c}', str(c))} * 1000|.2f>" if c >= 128 else "–"}
            for c in (1, 16, 64, 128, 256)]),

    Figure("steady-default-prefill-graphs", {"s": "benchmarks/steady_state_default_prefill_graphs_h200.json"},
           H200 + "; the default pair in-process, closed loop, mix workload, greedy, prefix cache off, admission "
           "in waves, prefill graphs, compact on the overlapped-loop profile, one 5 s window per engine after "
           "2 s, one round",
           ["concurrency", "no-spec tok/s", "static tok/s", "compact tok/s", "static / no-spec", "compact / static",
            "A/A: static-b / static", "drafts verified per request-step, compact"],
           [["{c}"] + [f"<{_SS}|,.0f>".replace("{m}", m) for m in ("no-spec", "static", "compact")]
            + [f"<{_PAIRED}|.2f>".replace("{r}", r) for r in ("static/no-spec", "compact/static", "static-b/static")]
            + [f"<{_ACC.format(m='compact')}.drafts_verified / {_ACC.format(m='compact')}.decode_request_steps|.2f>"]],
           [{"c": 64}, {"c": 256}]),

    _host_plain("host-plain-steps", "cpu",
                "The 2-core CPU of the development machine, torch 2.13.0+cpu; the default pair, synchronous step, "
                "medians of 12 steps × 5 repeats"),
    _host_plain("host-plain-steps-h200", "h200",
                H200 + "; the same on the device machine's host, CUDA graphs (`result` holds the wait for the GPU), "
                "medians of 12 steps × 3 repeats"),

    _host_drafting("host-drafting-steps", "cpu", "The 2-core CPU of the development machine, torch 2.13.0+cpu; "
                   "synchronous step, medians of 12 steps × 3 repeats"),

    Figure("steady-default-rows", {"s": "benchmarks/steady_state_default_rows_h200.json"},
           H200 + "; the default pair in-process as in the sweep above, the closed loop reading the step's quiet "
           "rows as arrays, one 5 s window per engine after 2 s, one round",
           ["concurrency", "no-spec tok/s", "static tok/s", "static-b tok/s", "static / no-spec",
            "A/A: static-b / static"],
           [["{c}"] + [f"<{_SS}|,.0f>".replace("{m}", m) for m in ("no-spec", "static", "static-b")]
            + [f"<{_PAIRED}|.2f>".replace("{r}", r) for r in ("static/no-spec", "static-b/static")]],
           [{"c": 64}, {"c": 256}]),

    _profile("cost-profile-smollm2", "benchmarks/cost_table_smollm2_h200.json", 5,
             H200 + "; the SmolLM2-135M-Instruct pair, whole synchronous steps with CUDA graphs, context 256, mix "
                    "prompts, 3 rounds"),

    _profile("cost-profile-default-overlap", "benchmarks/cost_table_default_overlap_h200.json", 5,
             H200 + "; the default pair, whole steps timed in the overlapped loop (`--loop overlap`) with CUDA "
                    "graphs, context 256, mix prompts, 2 rounds", batches=(1, 16, 64, 256)),

    _profile("cost-profile-default", "benchmarks/cost_table_default_h200.json", 5,
             H200 + "; the default pair, whole synchronous steps with CUDA graphs, context 256, mix prompts, 2 rounds"),

    _profile("cost-profile-8b", "benchmarks/cost_table_qwen3_8b_random_h200.json", 7,
             H200 + "; Qwen3-8B shape with random weights (`load_format=\"dummy\"`) and a 5-layer drafter of "
                    "block 7, whole steps with CUDA graphs timed in the overlapped loop, context 256, mix prompts, "
                    "1 round", trend=False),

    _profile("cost-profile-30b", "benchmarks/cost_table_qwen3_30b_a3b_random_h200.json", 7,
             H200 + "; Qwen3-30B-A3B shape (48 layers, 128 experts, top-8) with random weights and a 5-layer "
                    "drafter of block 7, whole steps with CUDA graphs timed in the overlapped loop, context 256, "
                    "mix prompts, 1 round", batches=(1, 16, 64, 256), trend=False),

    _simulator_check("simulator-check", "default",
                     "`bench simulate` on a CPU, from the default pair's H200 profiles timed in the overlapped loop, "
                     "the static traces of the sweep above at each concurrency (at 256: 5 MB, not committed) and the "
                     "overheads fitted to that sweep per whole run (`--calibrate-from`, `--calibrate-by run`); "
                     "the last column fits them on the other three concurrencies only (`--calibrate-concurrency`); "
                     "measured: that sweep", held_out=True),

    _simulator_check("simulator-check-smollm2", "smollm2",
                     "`bench simulate` on a CPU, from the SmolLM2 pair's H200 profile (no plain profile: no "
                     "speculation is priced at K = 0 of the speculative table, which still holds the drafter's pass), "
                     "the static traces of its sweep and the overheads fitted to that sweep; measured: that sweep"),

    _profile("cost-profile-default-notext", "benchmarks/cost_table_default_notext_h200.json", 5,
             H200 + "; the default pair, whole steps timed in the overlapped loop with CUDA graphs, no text decoded "
                    "in the step (as serving adds requests), context 256, mix prompts, 2 rounds; the first of the "
                    "file's three tables (every row drafting)", batches=(1, 16, 64, 256), table="default"),

    Figure("thesis-default-notext", {"s": "benchmarks/steady_state_default_notext_h200.json"},
           H200 + "; the default pair in-process, closed loop, mix workload, greedy, prefix cache off, admission in "
           "waves, compact on the profiles above (its own plain step priced by the draft-0 table), one 5 s window "
           "per engine after 2 s, one round; the host's wait for the GPU per step is the `result` phase",
           ["concurrency", "no-spec tok/s", "static tok/s", "compact tok/s", "static / no-spec", "compact / static",
            "A/A: static-b / static", "static: ms per step waiting for the GPU · the whole step"],
           [["{c}"] + [f"<{_SS}|,.0f>".replace("{m}", m) for m in ("no-spec", "static", "compact")]
            + [f"<{_PAIRED}|.2f>".replace("{r}", r) for r in ("static/no-spec", "compact/static", "static-b/static")]
            + ["<sweep[mode=static,concurrency={c}].phase_ms.result|.2f> · "
               f"<{_DEC.format(m='static')} * 1000|.2f>"]],
           [{"c": 1}, {"c": 16}, {"c": 64}, {"c": 256}]),

    Figure("law-price", {"o": "benchmarks/served_probe_smollm2_16_noise_law_h200.json",
                         "n": "benchmarks/served_probe_smollm2_16_h200.json"},
           H200 + "; the SmolLM2 shapes (RANDOM WEIGHTS) at concurrency 16: each system in the engine's closed loop "
           "(text-free), 40 steady-state steps under torch.profiler, and the profile's own step (a fixed batch of "
           "16, full blocks, no law, nothing committed) in the same call; two calls, the first with the law drawing "
           "the sampler's keyed noise, the second with the law of `verify.py` (the no-spec and profile rows run the "
           "same code in both: their difference is the spread between calls); device µs are the sums of the "
           "kernels per step (the first file's sum also holds the `launch` marker's span, subtracted here)",
           ["system", "device µs per step: keyed-noise law", "the law of verify.py", "kernels per step: keyed-noise "
            "law · the law of verify.py", "decode-only ms per step, served: keyed-noise law · the law of verify.py"],
           [["{label}", "<o:systems.{sys}.device_us - o:systems.{sys}.top_kernels[0=launch].1|,.0f>",
             "<n:systems.{sys}.device_us|,.0f>", "<o:systems.{sys}.kernels|.0f> · <n:systems.{sys}.kernels|.0f>",
             "{served}"]],
           [{"sys": k, "label": label,
             "served": (f"<o:systems.{k}.decode_only_ms|.2f> · <n:systems.{k}.decode_only_ms|.2f>"
                        if k != "profile's step" else "–")}
            for k, label in (("no-spec", "no-spec, served"), ("static, served", "static, served (law 0.3–0.6)"),
                             ("static, served, law 0:0", "static, served (law 0:0, nothing accepted)"),
                             ("profile's step", "the profile's step (every row drafting, no law)"))]),

    Figure("thesis-smollm2-shape-law", {"s": "benchmarks/steady_state_smollm2_shape_law_rounds_h200.json"},
           H200 + "; the SmolLM2 shapes (RANDOM WEIGHTS, the law 0.3–0.6 at the price of verify.py's law), "
           "in-process, text-free, closed loop, mix workload, greedy, prefix cache off, compact as "
           "`--verify-lapse-after 0` runs it (its plain steps keep the drafter's context), on the shapes' four profiles "
           "(`.carry/smol/cost_new.json` is `benchmarks/cost_table_smollm2_shape_h200.json`), two rounds in rotating "
           "order, paired medians (min–max)",
           ["concurrency", "no-spec tok/s", "static tok/s", "compact tok/s", "static / no-spec", "compact / no-spec",
            "compact / static", "A/A: static-b / static", "compact: plain steps / steps"],
           [["{c}"] + [f"<{_SS}|,.0f>".replace("{m}", m) for m in ("no-spec", "static", "compact")]
            + [_paired_cell(r)
               for r in ("static/no-spec", "compact/no-spec", "compact/static", "static-b/static")]
            + [f"<{_ACC.format(m='compact')}.plain_steps|.0f> / <{_ACC.format(m='compact')}.steps|.0f>"]],
           [{"c": c} for c in (1, 16, 64, 128, 256)]),

    Figure("thesis-smollm2-shape-law-clock", {"s": "benchmarks/steady_state_smollm2_shape_law_clock_h200.json"},
           H200 + "; as the two-round sweep above, compact with and without the step clock (`verify_step_clock`), "
           "two rounds in rotating order, paired medians (min–max), another call; plain steps / steps of each of "
           "the clock's two runs",
           ["concurrency", "static / no-spec", "compact / no-spec", "step clock / no-spec", "step clock / compact",
            "step clock: plain steps / steps, by round"],
           [["{c}"] + [_paired_cell(r)
                       for r in ("static/no-spec", "compact/no-spec", "compact-clock/no-spec", "compact-clock/compact")]
            + [" · ".join(f"<runs[mode=compact-clock,concurrency={{c}},repeat={i}].accounting.plain_steps|.0f> / "
                          f"<runs[mode=compact-clock,concurrency={{c}},repeat={i}].accounting.steps|.0f>" for i in (0, 1))]],
           [{"c": c} for c in (16, 64, 128)]),

    _simulator_check("simulator-check-smollm2-shape-law", "smollm2_shape_law",
                     "`bench simulate` on a CPU, from the SmolLM2 shapes' four H200 profiles, the static traces of a "
                     "one-round sweep under verify.py's law (recorded in it, `benchmarks/steady_state_smollm2_shape_"
                     "law_h200.json`, a call before the two-round one) and the overheads fitted to that sweep per "
                     "whole run; the last column fits them on the other four concurrencies only; measured: that sweep",
                     held_out=True, concurrencies=(1, 16, 64, 128, 256)),

    Figure("thesis-textfree", {"s": "benchmarks/steady_state_smollm2_shape_textfree_h200.json",
                               "d": "benchmarks/steady_state_default_textfree_h200.json"},
           H200 + "; both pairs in-process with the engines text-free, as `serve.py`'s engine core runs them (no "
           "text decoded in the step, not even at a request's finish), on the profiles above (carried as "
           "`.carry/smol/cost_new.json` and `.carry/probe/cost_default_notext.json`), one 5 s window per engine "
           "after 2 s, one round, both sweeps in one call; the SmolLM2 shapes with RANDOM WEIGHTS and the law "
           "0.3–0.6 drawing the sampler's keyed noise (its drafting steps about 0.2 ms dearer than under verify.py's law)",
           ["pair", "concurrency", "no-spec tok/s", "static tok/s", "compact tok/s", "static / no-spec",
            "compact / no-spec", "compact / static", "A/A: static-b / static", "compact: plain steps / steps",
            "ms per decode-only step: no-spec · static · compact"],
           [["{name}", "{c}"] + [f"<{{f}}:{_SS}|,.0f>".replace("{m}", m) for m in ("no-spec", "static", "compact")]
            + [f"<{{f}}:{_PAIRED}|.2f>".replace("{r}", r) for r in ("static/no-spec", "compact/no-spec",
                                                                  "compact/static", "static-b/static")]
            + ["<{f}:sweep[mode=compact,concurrency={c}].accounting.plain_steps|.0f> / "
               "<{f}:sweep[mode=compact,concurrency={c}].accounting.steps|.0f>",
               " · ".join(f"<{{f}}:sweep[mode={m},concurrency={{c}}].accounting.decode_only_s / "
                          f"{{f}}:sweep[mode={m},concurrency={{c}}].accounting.decode_only_steps * 1000|.2f>"
                          for m in ("no-spec", "static", "compact"))]],
           [{"f": f, "name": name, "c": c} for f, name in (("s", "SmolLM2 shapes"), ("d", "default")) for c in (16, 64, 256)]),

    Figure("thesis-default-hold", {"s": "benchmarks/steady_state_default_hold_h200.json"},
           H200 + "; the default pair in-process, text-free, on its profiles without text (`.carry/probe/"
           "cost_default_notext.json`), compact holding a clear choice of every row drafting, two rounds in "
           "rotating order, paired medians (min–max), another call",
           ["concurrency", "static / no-spec", "compact / no-spec", "compact / static", "A/A: static-b / static",
            "no-spec tok/s, by round", "static-b tok/s, by round"],
           [["{c}"] + [_paired_cell(r)
                       for r in ("static/no-spec", "compact/no-spec", "compact/static", "static-b/static")]
            + [" · ".join(f"<runs[mode={m},concurrency={{c}},repeat={i}].total_tok_s|,.0f>" for i in (0, 1))
               for m in ("no-spec", "static-b")]],
           [{"c": 64}, {"c": 256}]),

    Figure("drift-check", {"d": "benchmarks/drift_check_h200.json"},
           H200 + "; `nanodspark.lab.drift_check`: the default pair in bf16 with CUDA graphs, temperature 1, no "
           "per-request seeds, 4 new tokens, batch 256, 8,000 samples, the steep synthetic step-cost table (about "
           "0.04 drafts verified per step); each position against the target's law (exact at positions 0-1, "
           "conditional on the sampled prefix after), small categories pooled",
           ["verify mode", "prompt", "position 1 (prefill)", "position 2", "position 3", "position 4"],
           [["{mode}", "{prompt}", "<runs[{i}].results[pos=0,kind=exact].p|.2f>",
             "<runs[{i}].results[pos=1,kind=cond].p|.2f>", "<runs[{i}].results[pos=2,kind=cond].p|.2f>",
             "<runs[{i}].results[pos=3,kind=cond].p|.2f>"]],
           [{"i": 0, "mode": "cap-accept", "prompt": "story"}, {"i": 1, "mode": "compact", "prompt": "story"},
            {"i": 2, "mode": "target only", "prompt": "story"}, {"i": 3, "mode": "cap-accept", "prompt": "code"}]),

    _thesis_8b("thesis-8b", "0.475-0.97",
               "; the Qwen3-8B shape with RANDOM WEIGHTS and DSpark's default drafter (5 layers, block 7), its "
               "drafts accepted by a synthetic law (each request's rate uniform in 0.475–0.97; not the target's "
               "output), in-process, closed loop, mix prompts cut to 128 tokens, 96 ± 25 % new tokens, greedy, prefix "
               "cache off, admission in waves, compact on the profiles above (the drafter's and the target's own, one "
               "file), one 5 s window per engine after 2 s, one round"),

    Figure("thesis-8b-aa-low", {"a": "benchmarks/steady_state_qwen3_8b_aa_low_h200.json"},
           H200 + "; the A/A control of the table above at 1 and 16: two static engines, the same law and work, "
                  "another call",
           ["concurrency", "static tok/s", "static-b tok/s", "static-b / static"],
           [["{c}", f"<a:{_SS}|,.0f>".replace("{m}", "static"), f"<a:{_SS}|,.0f>".replace("{m}", "static-b"),
             f"<a:{_PAIRED}|.3f>".replace("{r}", "static-b/static")]],
           [{"c": 1}, {"c": 16}]),

    _thesis_8b("thesis-8b-high", "0.862-0.99",
               "; as above, a high acceptance (each request's rate uniform in 0.862–0.99, τ about 6, the paper's "
               "Qwen3-8B figure on GSM8K is 6.17), another call"),

    Figure("thesis-8b-plain", {"s": "benchmarks/steady_state_qwen3_8b_plain_steps_h200.json"},
           H200 + "; as above, a lower acceptance (each request's rate uniform in 0.30–0.96): compact with plain "
           "steps (the default when the cost file holds the target's profile) and without them "
           "(`--no-verify-plain-steps`: it drafts every step), in one call",
           ["concurrency", "no-spec tok/s", "compact tok/s", "compact, drafting every step, tok/s",
            "compact / no-spec", "drafting every step / no-spec", "compact / drafting every step",
            "drafts verified per request-step, compact · drafting every step"],
           [["{c}"] + [f"<{_SS}|,.0f>".replace("{m}", m) for m in ("no-spec", "compact", "compact-no-plain")]
            + [f"<{_PAIRED}|.2f>".replace("{r}", r) for r in ("compact/no-spec", "compact-no-plain/no-spec",
                                                              "compact/compact-no-plain")]
            + [" · ".join(f"<{_ACC.format(m=m)}.drafts_verified / {_ACC.format(m=m)}.decode_request_steps|.2f>"
                          for m in ("compact", "compact-no-plain"))]],
           [{"c": c} for c in (1, 16, 64, 128, 256)]),

    Figure("thesis-8b-partial", {"s": "benchmarks/steady_state_qwen3_8b_partial_h200.json"},
           H200 + "; the law 0.475–0.97 and the work of the first table, compact reading the cost file that holds "
           "the profiles of steps where a quarter and a half of the batch draft (`bench profile --draft-fraction`) "
           "beside the full and the target's own, in one call",
           ["concurrency", "no-spec tok/s", "static tok/s", "compact tok/s", "static / no-spec", "compact / no-spec",
            "compact / static", "compact's steps: some drafting · none drafting · all"],
           [["{c}"] + [f"<{_SS}|,.0f>".replace("{m}", m) for m in ("no-spec", "static", "compact")]
            + [f"<{_PAIRED}|.2f>".replace("{r}", r) for r in ("static/no-spec", "compact/no-spec", "compact/static")]
            + [_COMPACT_STEPS]],
           [{"c": c} for c in (1, 16, 64, 128, 256)]),

    Figure("thesis-8b-partial-ab", {"p": "benchmarks/steady_state_qwen3_8b_partial_vs_plain_h200.json"},
           H200 + "; the same law, work and cost file, compact with and without partial drafting "
           "(`compact-no-partial`: every request drafts, or none), in one call",
           ["concurrency", "no-spec tok/s", "compact tok/s", "without partial drafting, tok/s", "compact / no-spec",
            "without / no-spec", "compact / without", "compact's steps: some drafting · none drafting · all"],
           [["{c}"] + [f"<{_SS}|,.0f>".replace("{m}", m) for m in ("no-spec", "compact", "compact-no-partial")]
            + [f"<{_PAIRED}|.2f>".replace("{r}", r) for r in ("compact/no-spec", "compact-no-partial/no-spec",
                                                              "compact/compact-no-partial")]
            + [_COMPACT_STEPS]],
           [{"c": c} for c in (64, 128, 256)]),

    Figure("thesis-8b-partial-c256", {"f": "benchmarks/steady_state_qwen3_8b_partial_c256_h200.json"},
           H200 + "; the same at 256 only, the engine as it is now (a request without lagged confidences counts as "
           "the batch's mean when choosing who drafts), one call",
           ["concurrency", "compact tok/s", "without partial drafting, tok/s", "compact / without",
            "compact's steps: some drafting · none drafting · all"],
           [["{c}"] + [f"<{_SS}|,.0f>".replace("{m}", m) for m in ("compact", "compact-no-partial")]
            + [f"<{_PAIRED}|.3f>".replace("{r}", "compact/compact-no-partial")]
            + [_COMPACT_STEPS]],
           [{"c": 256}]),

    Figure("thesis-8b-partial-now", {"n": "benchmarks/steady_state_qwen3_8b_partial_now_h200.json"},
           H200 + "; the same law, work and cost file at 1–128, the engine as it is now, all four systems in one call",
           ["concurrency", "no-spec tok/s", "static tok/s", "compact tok/s", "without partial drafting, tok/s",
            "compact / no-spec", "compact / static", "compact / without", "compact's steps: some drafting · none drafting · all"],
           [["{c}"] + [f"<{_SS}|,.0f>".replace("{m}", m) for m in ("no-spec", "static", "compact", "compact-no-partial")]
            + [f"<{_PAIRED}|.3f>".replace("{r}", r) for r in ("compact/no-spec", "compact/static",
                                                              "compact/compact-no-partial")]
            + [_COMPACT_STEPS]],
           [{"c": c} for c in (1, 16, 64, 128)]),

    Figure("plain-step-8b", {"a": "benchmarks/plain_probe_qwen3_8b_128_h200.json",
                             "b": "benchmarks/plain_probe_qwen3_8b_256_h200.json"},
           H200 + "; the Qwen3-8B shape with RANDOM WEIGHTS, a batch of decoding requests (random prompts of "
           "137–200 tokens), steps timed in the overlapped loop, the two engines in 5 alternating rounds of 24 "
           "steps (median); device time and idle gaps from 16 profiled steps each",
           ["batch", "target alone: ms per step", "compact's plain step: ms", "plain / alone",
            "device µs per step: alone · plain", "device idle µs per step: alone · plain"],
           [["{b}", "<{f}:step_ms.target alone.median|.2f>", "<{f}:step_ms.compact, plain step.median|.2f>",
             "<{f}:step_ms.compact, plain step.median / {f}:step_ms.target alone.median|.3f>",
             "<{f}:device_us_per_step.target alone|,.0f> · <{f}:device_us_per_step.compact, plain step|,.0f>",
             "<{f}:idle.target alone.idle_us_per_step|.0f> · <{f}:idle.compact, plain step.idle_us_per_step|.0f>"]],
           [{"b": 128, "f": "a"}, {"b": 256, "f": "b"}]),

    Figure("plain-probe-smollm2", {"a": "benchmarks/plain_probe_smollm2_128_h200.json",
                                   "b": "benchmarks/plain_probe_smollm2_256_h200.json"},
           H200 + "; the SmolLM2-135M pair's shapes with RANDOM WEIGHTS, a batch of decoding requests (random "
           "prompts of 137–200 tokens, no text in the step), the plain step forced (no choice): compact's plain step "
           "keeping the drafter's context, the one letting it lapse, and the target alone, steps timed in the "
           "overlapped loop, the three engines in 3 alternating rounds of 24 steps (median); device time from 16 "
           "profiled steps each; one call",
           ["batch", "target alone: ms per step", "plain step, context kept: ms", "plain step, context lapsed: ms",
            "kept / alone · lapsed / alone", "device µs per step: alone · kept · lapsed"],
           [["{b}", "<{f}:step_ms.target alone.median|.2f>", "<{f}:step_ms.compact, plain step.median|.2f>",
             "<{f}:step_ms.compact, lapsed plain step.median|.2f>",
             "<{f}:step_ms.compact, plain step.median / {f}:step_ms.target alone.median|.3f> · "
             "<{f}:step_ms.compact, lapsed plain step.median / {f}:step_ms.target alone.median|.3f>",
             "<{f}:device_us_per_step.target alone|,.0f> · <{f}:device_us_per_step.compact, plain step|,.0f> · "
             "<{f}:device_us_per_step.compact, lapsed plain step|,.0f>"]],
           [{"b": 128, "f": "a"}, {"b": 256, "f": "b"}]),

    Figure("plain-profile-smollm2-lapse", {"t": "benchmarks/cost_table_smollm2_shape_lapse_h200.json"},
           H200 + "; the SmolLM2 shapes (RANDOM WEIGHTS): the plain steps' profiles of one call (whole steps in the "
           "overlapped loop, no text in the step, context 256; `bench profile` with mix prompts, `bench "
           "profile-plain` with random prompts of one length), ms per step",
           ["batch", "every row drafting, K = 0", "plain step, context kept (draft 0)", "plain step, context "
            "lapsed (lapsed)", "lapsed / kept", "the target alone (no drafter)"],
           [["{b}", f"<t:@{_SMOL}.raw[0={{b}},1=0].2 * 1000|.2f>",
             f"<t:@{_SMOL} (draft 0).raw[0={{b}},1=0].2 * 1000|.2f>",
             f"<t:@{_SMOL} (lapsed).raw[0={{b}},1=0].2 * 1000|.2f>",
             f"<t:@{_SMOL} (lapsed).raw[0={{b}},1=0].2 / t:@{_SMOL} (draft 0).raw[0={{b}},1=0].2|.2f>",
             f"<t:@{_SMOL} (no drafter).raw[0={{b}},1=0].2 * 1000|.2f>"]],
           [{"b": b} for b in (1, 16, 64, 128, 256)]),

    Figure("thesis-smollm2-shape-lapse", {"s": "benchmarks/steady_state_smollm2_shape_lapse_h200.json"},
           H200 + "; the SmolLM2 shapes (RANDOM WEIGHTS, the law 0.3–0.6), in-process, text-free, closed loop, mix "
           "workload, greedy, prefix cache off, on the profiles above (measured first, in the same call); compact "
           "letting the drafter's context lapse after 16 plain steps in a row (the default) and compact keeping it "
           "(`--verify-lapse-after 0`), two rounds in rotating order, paired medians (min–max)",
           ["concurrency", "no-spec tok/s", "compact tok/s", "static / no-spec", "compact / no-spec",
            "compact, context kept / no-spec", "compact / context kept", "compact / static", "A/A: static-b / static",
            "compact: plain steps / steps"],
           [["{c}"] + [f"<{_SS}|,.0f>".replace("{m}", m) for m in ("no-spec", "compact")]
            + [_paired_cell(r)
               for r in ("static/no-spec", "compact/no-spec", "compact-keep/no-spec", "compact/compact-keep",
                         "compact/static", "static-b/static")]
            + [f"<{_ACC.format(m='compact')}.plain_steps|.0f> / <{_ACC.format(m='compact')}.steps|.0f>"]],
           [{"c": c} for c in (16, 64, 128, 256)]),

    _simulator_check("simulator-check-smollm2-shape-lapse", "smollm2_shape_lapse",
                     "`bench simulate` on a CPU, from the five profiles above, the static traces of the one-round "
                     "sweep under the same law (another call, `benchmarks/traces/smollm2_shape_law_static_mix_c*.npz`) "
                     "and the overheads fitted per whole run to no-spec's and static's runs of the sweep above only "
                     "(`--calibrate-systems no-spec static`): compact and compact-keep are predicted, not fitted; "
                     "measured: that sweep", concurrencies=(16, 64, 128, 256),
                     systems=("no-spec", "static", "compact", "compact-keep")),

    _at_load("thesis-smollm2-shape-lapse-rounds", "benchmarks/steady_state_smollm2_shape_lapse_rounds_h200.json",
             H200 + "; as the sweep above, at load only, on its profiles (`.carry/smol/cost_lapse.json` is "
             "`benchmarks/cost_table_smollm2_shape_lapse_h200.json`), three rounds in rotating order, another call; "
             "paired medians (min–max); the host's seconds in each phase of the 5 s window (median over rounds)",
             (64, 128, 256)),

    Figure("host-probe-smollm2-shared", {"b": "benchmarks/plain_probe_smollm2_256_shared_h200.json"},
           H200 + "; as the probe above at batch 256, with a step's state writes in one copy and the drafter's "
                  "context on the target's block tables; the host's milliseconds per phase, unprofiled; one call",
           ["engine", "ms per step", "device µs per step", "host ms: schedule · launch · commit"],
           [["{e}", "<b:step_ms.{e}.median|.3f>", "<b:device_us_per_step.{e}|,.0f>",
             " · ".join(f"<b:host_ms_per_step.{{e}}.{ph}|.2f>" for ph in ("schedule", "launch", "commit"))]],
           [{"e": e} for e in ("target alone", "compact, plain step", "compact, lapsed plain step")]),

    _at_load("thesis-smollm2-shape-shared", "benchmarks/steady_state_smollm2_shape_shared_h200.json",
             H200 + "; the SmolLM2 shapes (RANDOM WEIGHTS, the law 0.3–0.6), in-process, text-free, closed loop, "
             "mix workload, greedy, prefix cache off, on the lapse sweep's profiles (`.carry/smol/cost_lapse.json` is "
             "`benchmarks/cost_table_smollm2_shape_lapse_h200.json`); a step's state writes in one copy, the "
             "drafter's context on the target's block tables, the plain hold kept when the batch grows; two rounds "
             "in rotating order, paired medians (min–max); the host's seconds in each phase of the 5 s window "
             "(median over rounds)", (16, 64, 128, 256), tok_s=True),

    _at_load("thesis-smollm2-shape-shared-rounds", "benchmarks/steady_state_smollm2_shape_shared_rounds_h200.json",
             H200 + "; as the sweep above, at load only, three rounds in rotating order, another call; paired "
             "medians (min–max); the host's seconds in each phase of the 5 s window (median over rounds)",
             (64, 128, 256)),

    Figure("thesis-smollm2-shape-narrow", {"s": "benchmarks/steady_state_smollm2_shape_narrow_h200.json"},
           H200 + "; as the sweep above, at 256 only, a plain step's result without draft columns, two rounds in "
           "rotating order, another call (on a machine whose host kept this 256 batch GPU-bound: no-spec waited "
           "for the GPU 1.0 ms a step); paired medians (min–max); host milliseconds per step",
           ["concurrency"] + _AT_LOAD_HEADS + ["host ms, launch · commit: no-spec", "the same: compact"],
           [["{c}"] + [_paired_cell(r) for r in _AT_LOAD]
            + _host_cells("sweep[mode={m},concurrency={{c}}].phase_ms", ("launch", "commit"))],
           [{"c": 256}]),

    _at_load("thesis-smollm2-shape-final", "benchmarks/steady_state_smollm2_shape_final_h200.json",
             H200 + "; the SmolLM2 shapes (RANDOM WEIGHTS, the law 0.3–0.6), in-process, text-free, closed loop, "
             "mix workload, greedy, prefix cache off, on the lapse sweep's profiles (`.carry/smol/cost_lapse.json` is "
             "`benchmarks/cost_table_smollm2_shape_lapse_h200.json`), with the changes above; two rounds in rotating "
             "order, paired medians (min–max); the host's seconds in each phase of the 5 s window (median over "
             "rounds)", (1, 16, 64, 128, 256), tok_s=True),

    Figure("thesis-smollm2-shape-light", {"l": "benchmarks/steady_state_smollm2_shape_light_h200.json",
                                          "m": "benchmarks/steady_state_smollm2_shape_light_256_h200.json"},
           H200 + "; as the sweep above, a plain step's commit lighter (its counters in two array operations, "
           "the relay's stamps written when read, no numpy on the plain step's flag), three rounds in rotating "
           "order, two calls (the second at 256 only); paired medians (min–max); host milliseconds per step "
           "(the median round's)",
           ["call", "concurrency"] + _AT_LOAD_HEADS + ["host ms, launch · commit: no-spec", "the same: compact"],
           [["{call}", "{c}"] + [_paired_cell(r).replace("<", "<{f}:") for r in _AT_LOAD]
            + _host_cells("{{f}}:sweep[mode={m},concurrency={{c}}].phase_ms", ("launch", "commit"))],
           [{"f": "l", "call": "first", "c": 128}, {"f": "l", "call": "first", "c": 256},
            {"f": "m", "call": "second", "c": 256}]),

    _profile("cost-profile-default-lapse", "benchmarks/cost_table_default_lapse_h200.json", 5,
             H200 + "; the default pair, whole steps timed in the overlapped loop with CUDA graphs, no text decoded "
                    "in the step, context 256, mix prompts, 2 rounds; the first of the file's four tables (every row "
                    "drafting; the others: its plain step keeping and letting lapse the drafter's context, the "
                    "target alone)", batches=(1, 16, 64, 256), table="default"),

    Figure("thesis-default-flat", {"s": "benchmarks/steady_state_default_flat_h200.json"},
           H200 + "; the default pair in-process, text-free, closed loop, mix workload, greedy, prefix cache off, "
           "compact on the flat profile above through the cost scheduler's own policy (it verifies full blocks, "
           "as static does), one 5 s window per engine after 2 s, one round, in the call that profiled; host "
           "milliseconds per step",
           ["concurrency", "static / no-spec", "compact / static", "A/A: static-b / static",
            "drafts verified per request-step, static · compact", "host ms, launch · commit: static", "the same: compact"],
           [["{c}"] + [f"<s:{_PAIRED}|.2f>".replace("{r}", r) for r in ("static/no-spec", "compact/static",
                                                                        "static-b/static")]
            + [" · ".join(f"<s:{_ACC.format(m=m)}.drafts_verified / s:{_ACC.format(m=m)}.decode_request_steps|.2f>"
                          for m in ("static", "compact"))]
            + _host_cells("s:sweep[mode={m},concurrency={{c}}].phase_ms", ("launch", "commit"), ("static", "compact"))],
           [{"c": c} for c in (1, 16, 64, 256)]),

    _at_load("thesis-default-fallback", "benchmarks/steady_state_default_static_fallback_h200.json",
             H200 + "; the default pair as above, on the same profile, compact planning with static windows (its "
                    "table is flat: nothing to trim), two rounds in rotating order, another call; paired medians "
                    "(min–max); the host's seconds in each phase of the 5 s window (median over rounds)",
             (1, 16, 64, 256), tok_s=True),

    _simulator_check("simulator-check-default-fallback", "default_fallback",
                     "`bench simulate` on a CPU, from the default pair's H200 profiles above (every row drafting and "
                     "the target alone), the static traces of the two-round sweep above (at 256: 5 MB, not "
                     "committed) and the overheads fitted to that sweep per whole run; the last column fits them on "
                     "the other three concurrencies only; measured: that sweep", held_out=True),

    Figure("thesis-8b-partial-predicted", {"p": "benchmarks/prediction_qwen3_8b_partial_h200.json"},
           "A PREDICTION (`bench simulate` on a CPU): the engine's scheduler as it is now, on the cost file above "
           "and the static traces of the measured sweep at 128, prefill priced at 5 ms + 30 µs per token (assumed)",
           ["concurrency", "compact / no-spec", "without partial drafting / no-spec", "compact / without"],
           [["{c}"] + [f"<p:{_PAIRED}|.3f>".replace("{r}", r) for r in
                       ("compact/no-spec", "compact-no-partial/no-spec", "compact/compact-no-partial")]],
           [{"c": c} for c in (64, 128, 256)]),

    Figure("thesis-8b-static", {"s": "benchmarks/steady_state_qwen3_8b_law0.30-0.96_h200.json",
                                "a": "benchmarks/steady_state_qwen3_8b_aa_h200.json"},
           H200 + "; the law of the table above (0.30–0.96), static against compact drafting every step (its cost "
           "file held no plain profile), with the A/A control (two static engines, another invocation of the "
           "same call)",
           ["concurrency", "no-spec tok/s", "static tok/s", "compact, drafting every step, tok/s", "static / no-spec",
            "compact / static", "A/A: static-b / static"],
           [["{c}"] + [f"<{_SS}|,.0f>".replace("{m}", m) for m in ("no-spec", "static", "compact")]
            + [f"<{_PAIRED}|.2f>".replace("{r}", r) for r in ("static/no-spec", "compact/static")]
            + [f"<a:{_PAIRED}|.3f>".replace("{r}", "static-b/static")]],
           [{"c": 64}, {"c": 256}]),

    _simulator_check("simulator-check-8b", "qwen3_8b",
                     "`bench simulate` on a CPU, from the Qwen3-8B shape's H200 profiles above (with and without the "
                     "drafter), the static traces of the measured sweep at each concurrency, prefill priced at 5 ms + "
                     "30 µs per token (assumed, not fitted); measured: the sweep of the first table",
                     concurrencies=(1, 16, 64, 256)),

    _prediction("prediction-8b", "qwen3_8b", "the Qwen3-8B shape (random weights)"),
    _prediction("prediction-30b", "qwen3_30b_a3b",
                "the Qwen3-30B-A3B shape (random weights, timed in the overlapped loop; the τ are the paper's "
                "Qwen3-8B figures: none are given for this target)"),

    Figure("graphs-profile", {"t": "benchmarks/cost_table_graphs_h200.json"},
           H200 + "; the default pair, whole steps with CUDA graphs and the overlapped loop, context 256, 2 repeats",
           ["batch", "measured ms per step, K = 0", "measured, full blocks (K = 5 × batch)", "trend z",
            "in the table (flattened by the gate), every K", "host ms: schedule / launch / wait / commit"],
           [["{b}", "<*.raw[0={b},1=0].2 * 1000|.2f>", "<*.raw[0={b},1={k}].2 * 1000|.2f>",
             "<*.notes.trend_z.{b}|.2f>", "<*.measurements[0={b},1=0].2 * 1000|.2f>",
             " / ".join(f"<*.notes.phases_ms_by_bs.{{b}}.{p}|.2f>"
                        for p in ("schedule", "launch", "wait", "commit"))]],
           [{"b": 1, "k": 5}, {"b": 64, "k": 320}, {"b": 128, "k": 640}]),

    Figure("graphs-sweep", {"d": "benchmarks/dspark_graphs_h200.json"},
           H200 + "; the default pair, mix workload, greedy, 2 repeats, on the profile above",
           ["concurrency", "no-spec tok/s", "static tok/s", "compact tok/s", "static / no-spec",
            "compact / static, paired median (min–max)"],
           [["{c}", "<" + _G.replace("{m}", "no-spec") + "|,.0f>", "<" + _G.replace("{m}", "static") + "|,.0f>",
             "<" + _G.replace("{m}", "compact") + "|,.0f>",
             "<" + _G.replace("{m}", "static") + " / " + _G.replace("{m}", "no-spec") + "|.2f>",
             "<paired_compact_over_static[concurrency={c}].compact_over_static|.2f> "
             "(<paired_compact_over_static[concurrency={c}].min|.2f>–<paired_compact_over_static[concurrency={c}].max|.2f>)"]],
           [{"c": 64}, {"c": 256}]),

    Figure("shipped-profile", {"t": "benchmarks/cost_table_h200.json"},
           H200 + "; the default pair, whole eager steps, context 256, no draft committed, 7 repeats, trend gate",
           ["batch", "ms per step, K = 0", "ms per step, full blocks", "full / K = 0"],
           [["{b}", "<*.measurements[0={b},1=0].2 * 1000|.1f>",
             "<*.measurements[0={b},1={k}].2 * 1000|.1f>",
             "<*.measurements[0={b},1={k}].2 / "
             "*.measurements[0={b},1=0].2|.2f>"]],
           [{"b": b, "k": 5 * b} for b in (1, 4, 16, 64, 128, 256)]),

    Figure("drafter-tau", {"r": "benchmarks/drafter/train_heads_report.json"},
           "One NVIDIA H200; the shipped drafter and its step-matched DFlash ablation, static full blocks, "
           "40 prompts per workload, 96 new tokens",
           ["workload", "DSpark τ, T = 0 / 1", "DFlash τ, T = 0 / 1", "DSpark / DFlash, T = 0 / 1"],
           [["{w}", "<tau.dspark.{w}.T=0.tau|.2f> / <tau.dspark.{w}.T=1.tau|.2f>",
             "<tau.dflash.{w}.T=0.tau|.2f> / <tau.dflash.{w}.T=1.tau|.2f>",
             "<tau.dspark.{w}.T=0.tau / tau.dflash.{w}.T=0.tau|.2f> / <tau.dspark.{w}.T=1.tau / tau.dflash.{w}.T=1.tau|.2f>"]],
           [{"w": w} for w in ("math", "chat", "poetry", "code")],
           command="`python train_heads.py --out runs/gpu/drafter --data-dir .carry/data --phases calibrate,eval "
                   "--eval-n 40` (the file's `argv`; the training call before it is in `benchmarks/INDEX.md`)"),

    Figure("calibration-ece", {"r": "benchmarks/drafter/train_heads_report.json"},
           "One NVIDIA H200; ECE of the survival per draft position, 272 prompts to fit and 272 held out, T = 1",
           ["", "pos 1", "2", "3", "4", "5"],
           [["plain STS"] + [f"<calibration.plain.after[{i}].ece * 100|.2f> %" for i in range(5)],
            ["STS + shift (shipped)"] + [f"<calibration.shifted.after[{i}].ece * 100|.2f> %" for i in range(5)]]),

    Figure("sampling", {"s": "benchmarks/sampling_h200.json"},
           H200 + "; the default pair, T = 1, 128 new tokens, medians of 5",
           ["batch", "rejection tok/s", "coupled tok/s", "coupled, batch-invariant tok/s",
            "reproducible / fastest"],
           [["{b}", "<batches[batch={b}].rejection.tok_s|,.0f>", "<batches[batch={b}].coupled.tok_s|,.0f>",
             "<batches[batch={b}].coupled-bi.tok_s|,.0f>", "<batches[batch={b}].reproducible_over_fastest_tok_s|.2f>"]],
           [{"b": 1}, {"b": 64}, {"b": 256}]),

    Figure("swa-prefill", {"s": "benchmarks/swa_h200.json"},
           H200 + ", bf16; a Qwen3-0.6B-shaped hybrid with random weights (14 of 28 layers sliding, window 128); "
           "a follow-up of 32 answer + 64 new tokens after a shared prefix",
           ["follow-up after a prefix of", "2k: rows / TTFT ms", "8k: rows / TTFT ms", "32k: rows / TTFT ms"],
           [["{name}"] + [f"<prefill.rows[random_weights=true,mode={{mode}},prefix={p}].prefilled|,> / "
                          f"<prefill.rows[random_weights=true,mode={{mode}},prefix={p}].ttft_ms|.1f>"
                          for p in (2048, 8192, 32768)]],
           [{"mode": "no-cache", "name": "no prefix cache"}, {"mode": "exact", "name": "prefix cache + exact replay"},
            {"mode": "bounded", "name": "+ bounded replay"}, {"mode": "snapshot", "name": "+ snapshot"}]),

    Figure("swa-drift", {"s": "benchmarks/swa_h200.json"},
           H200 + ", bf16; the default pair, 80 MT-bench second turns, against exact replay",
           ["setting", "next-token KL mean / max", "top-1 agree", "continuation identical", "τ"],
           [["{s}", "<drift.rows[setting={s}].kl_mean|.1e> / "
             "<drift.rows[setting={s}].kl_max|.1e>", "<drift.rows[setting={s}].top1_agree * 100|.0f> %",
             "<drift.rows[setting={s}].continuation_identical * 100|.1f> %", "<drift.rows[setting={s}].tau|.3f>"]],
           [{"s": s} for s in ("exact", "bounded 128", "bounded auto", "bounded 256", "snapshot")]),

    Figure("eplb", {"e": "benchmarks/eplb_h200.json"},
           H200 + "; simulated EP 8, balance on held-out steps",
           ["routing", "balancedness before", "after, + 0 / + 8 / + 32 redundant", "straggler after, + 0 / + 8 / + 32"],
           [["{name}", "<rows[source={src},ep_size=8,redundant=0].balancedness_before|.3f>",
             " / ".join(f"<rows[source={{src}},ep_size=8,redundant={r}].balancedness_after|.3f>" for r in (0, 8, 32)),
             " / ".join(f"<rows[source={{src}},ep_size=8,redundant={r}].straggler_after|.2f>" for r in (0, 8, 32))]],
           [{"src": "default:mix", "name": "default target (8 experts), mixed prompts"},
            {"src": "qwen3-30b-a3b-shaped:mix", "name": "Qwen3-30B-A3B-shaped stack (128 experts, top-8, random "
                                                       "weights, skewed router)"}]),

    Figure("eplb-engine", {"e": "benchmarks/eplb_h200.json"},
           H200 + "; a running engine, 32 requests, CUDA graphs, overlapped loop, rebalanced every 16 steps",
           ["greedy output identical", "rebalance, median ms", "step ms: off / replica map / map + recording",
            "recording's share of a step"],
           [["<engine.greedy_identical>", "<engine.rebalance_seconds.median * 1000|.1f>",
             "<engine.step_ms.off|.2f> / <engine.step_ms.map_only|.2f> / <engine.step_ms.map_and_record|.2f>",
             "<engine.recording_share_of_step * 100|.2f> %"]]),

    Figure("tp", {"t": "benchmarks/tp_h200.json"},
           H200 + ", bf16, random weights; the target's decode step alone, CUDA-graph replay, 1,024 cached tokens, "
           "median of 30 steps",
           ["shape", "batch 1: ms / tok/s", "batch 64: ms / tok/s", "world of 1 through the collectives, b1 / b64 ms"],
           [["{name}", "<rows[shape={s},world1=false,batch=1].step_ms|.2f> / <rows[shape={s},world1=false,batch=1].tok_s|,.0f>",
             "<rows[shape={s},world1=false,batch=64].step_ms|.2f> / <rows[shape={s},world1=false,batch=64].tok_s|,.0f>",
             "<rows[shape={s},world1=true,batch=1].step_ms|.2f> / <rows[shape={s},world1=true,batch=64].step_ms|.2f>"]],
           [{"s": "qwen3-8b", "name": "Qwen3-8B, 36 layers"}, {"s": "qwen3-30b-a3b", "name": "Qwen3-30B-A3B, 48 layers"}]),

    Figure("default-target", {"t": "benchmarks/default_target_train_log.json"},
           "One NVIDIA H200; the shipped default target's training run",
           ["parameters", "steps", "tokens", "seconds", "validation loss (nats/token): math / code / chat / "
            "shakespeare / poetry"],
           [["<params|,>", "<steps|,>", "<tokens|,>", "<train_seconds|.0f>",
             " / ".join(f"<final_val.{d}|.2f>" for d in ("math", "code", "chat", "shakespeare", "poetry"))]]),
]
