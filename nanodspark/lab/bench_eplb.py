"""EPLB benchmark: `python -m nanodspark.bench eplb [--quick] [--out JSON]` (walkthrough 12).

Part 1, placement on recorded routing. Two sources of routing, both recorded per step and per
MoE layer as tokens per logical expert:

* `default:<workload>`: the default MoE target (nanodspark/assets/default: 8 experts, top-2,
  5 MoE layers) with its drafter, serving each workload (math, chat, poetry, code) and the
  mixed traffic (`mix`) through the engine with EPLB's recorder on and no rebalancing. A step
  is an engine step (prefill chunks and speculative verify windows; graph padding is not
  counted).
* `qwen3-30b-a3b-shaped:mix`: a stack of `--qwen-layers` MoE layers with the MoE shape of
  Qwen3-30B-A3B (128 experts, top-8, hidden 2048, expert FFN 768; smaller hidden sizes on a
  CPU) and **random weights**. Its routers are **biased to be skewed**: each layer adds
  `skew * log p_e` to the router logits, p a Zipf(1) popularity over a random permutation of
  the experts. It is fed real text: the mixed workload's prompts, embedded by the default
  target's token embedding and lifted to the hidden size by a fixed random projection, in
  steps of `--qwen-tokens-per-step` tokens; each layer adds its experts' output to the stream.
  This is a stand-in for a large MoE's skew, not Qwen3's real routing.

For each simulated EP size (ranks = equal slices of the slots) and number of redundant slots:
"before" is the model as trained, one slot per expert, expert e on rank e // (experts / EP);
"after" is the EPLB placement (global policy) computed from the first half of the steps (the
window) and evaluated on the second half (held out; `*_in_sample` on the first half). An
expert's tokens are split evenly over its replicas (the routing rule does that up to one token
per expert and step). Figures: balancedness = mean over layers of mean_r(load_r) /
max_r(load_r) on the evaluated steps' summed load; per-step balancedness (the same, per step,
averaged over steps: a small step is noisy whatever the placement); straggler = max / mean;
the modelled MoE time `sum over steps and layers of max_r load_r` against `mean_r load_r`.

Part 2, the running engine (default target; CUDA graphs and the overlapped loop on a GPU):
greedy output with rebalancing every `--engine-interval` steps (8 redundant slots, EP 4)
against the engine without EPLB (must be identical), the wall time of each rebalance (read the
window, place, move the weights, synchronise), and the decode step time (the steps after every
request has been prefilled; recorder's `advance` included) of the engine without EPLB, with
replica mapping only (`ExpertBalancer.set_recording(False)`) and with mapping + recording (no redundant slot),
over `--engine-repeats` interleaved runs in a rotating order (medians): the overhead of
recording as a share of a decode step, and of EPLB's forward hooks in all.

JSON: hardware, versions, the exact command, every row. `--quick` is the bounded version
(< 60 s on an H200); the test suite runs it on a tiny model on the CPU.
"""
from __future__ import annotations

import gc
import json
import math
import statistics
import sys
import time

import torch

QUICK = dict(prompts=12, max_tokens=48, qwen_layers=2, qwen_steps=16, qwen_tokens_per_step=512,
             engine_prompts=16, engine_max_tokens=48, engine_interval=8, engine_repeats=3)
FULL = dict(prompts=32, max_tokens=128, qwen_layers=4, qwen_steps=64, qwen_tokens_per_step=1024,
            engine_prompts=32, engine_max_tokens=128, engine_interval=16, engine_repeats=5)
QWEN3_30B_A3B_MOE = dict(num_experts=128, top_k=8, hidden=2048, intermediate=768)
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


def add_eplb_args(p) -> None:
    p.add_argument("--model", default=None, help="a MoE checkpoint; default: the embedded default target")
    p.add_argument("--data-dir", default=None, help="folder of the workload data (default: ../shared/data)")
    p.add_argument("--out", default=None, help="JSON file for every figure")
    p.add_argument("--quick", action="store_true", help="the bounded run (< 60 s on an H200)")
    p.add_argument("--workloads", nargs="+", default=["math", "chat", "poetry", "code", "mix"],
                   help="workloads whose routing is recorded")
    p.add_argument("--ep-sizes", type=int, nargs="+", default=[4, 8], help="simulated expert-parallel sizes")
    p.add_argument("--redundant", type=int, nargs="+", default=[0, 8, 32], help="redundant expert slots compared")
    p.add_argument("--prompts", type=int, default=None, help="prompts per workload (default: 32, quick 12)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per prompt (default: 128, quick 48)")
    p.add_argument("--qwen-layers", type=int, default=None, help="MoE layers of the Qwen3-30B-A3B-shaped stack")
    p.add_argument("--qwen-hidden", type=int, default=None, help="its hidden size (default 2048 on CUDA, 128 on CPU)")
    p.add_argument("--qwen-intermediate", type=int, default=None, help="its expert FFN size (768 on CUDA, 32 on CPU)")
    p.add_argument("--qwen-steps", type=int, default=None, help="steps of synthetic routing (none: 64, quick 16)")
    p.add_argument("--qwen-tokens-per-step", type=int, default=None,
                   help="tokens routed per step (none: 1024, quick 512)")
    p.add_argument("--qwen-skew", type=float, default=1.0, help="router bias = skew * log Zipf(1) popularity")
    p.add_argument("--engine-prompts", type=int, default=None,
                   help="prompts of the running-engine part (none: 32, quick 16)")
    p.add_argument("--engine-max-tokens", type=int, default=None,
                   help="tokens per prompt there (none: 128, quick 48)")
    p.add_argument("--engine-interval", type=int, default=None, help="steps between rebalances in part 2")
    p.add_argument("--engine-repeats", type=int, default=None, help="timed repeats there (none: 5, quick 3)")
    p.add_argument("--skip-engine", action="store_true", help="part 1 only")
    p.add_argument("--kv-gb", type=float, default=1.0, help="KV cache memory (GB)")


def resolve(args):
    base = QUICK if args.quick else FULL
    for k, v in base.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    cuda = torch.cuda.is_available()
    args.qwen_hidden = args.qwen_hidden or (QWEN3_30B_A3B_MOE["hidden"] if cuda else 128)
    args.qwen_intermediate = args.qwen_intermediate or (QWEN3_30B_A3B_MOE["intermediate"] if cuda else 32)
    return args


# ----------------------------------------------------------------------------- part 1: placement
def naive_slot_load(logical: torch.Tensor) -> torch.Tensor:
    """One slot per expert in expert order: the load per slot is the logical load."""
    return logical.double()


def evaluate(steps: torch.Tensor, ep: int, redundant: int) -> dict:
    """Before / after figures of one (EP size, redundant slots) on per-step logical load
    `steps [S, L, N]`: EPLB placed on the first half, evaluated on the second (module docstring)."""
    from ..eplb import balance_stats, colocated_replicas, rebalance_experts, replica_load
    S, L, N = steps.shape
    half = max(1, S // 2)
    fit, test = steps[:half], (steps[half:] if S > 1 else steps)
    phy2log, _, _ = rebalance_experts(fit.sum(0), N + redundant, 1, 1, ep, policy="global")

    def figures(part, slot_load_of):
        agg = balance_stats(slot_load_of(part.sum(0)), ep)
        per_step, t_max, t_mean = [], 0.0, 0.0
        for s in part:
            st = balance_stats(slot_load_of(s), ep)
            if st["balancedness"] is not None:
                per_step.append(st["balancedness"])
            t_max += st["modelled_moe_time"]["max_rank"]
            t_mean += st["modelled_moe_time"]["mean_rank"]
        return agg["balancedness"], agg["straggler"], statistics.mean(per_step) if per_step else None, t_max, t_mean

    b0, s0, p0, tmax0, tmean0 = figures(test, naive_slot_load)
    b1, s1, p1, tmax1, tmean1 = figures(test, lambda x: replica_load(x, phy2log))
    bi, si, _, _, _ = figures(fit, lambda x: replica_load(x, phy2log))
    return {"ep_size": ep, "redundant": redundant, "slots_per_rank": (N + redundant) // ep,
            "steps_fit": int(fit.shape[0]), "steps_eval": int(test.shape[0]),
            "pairs_eval": int(test.sum()),
            "balancedness_before": b0, "balancedness_after": b1, "balancedness_after_in_sample": bi,
            "straggler_before": s0, "straggler_after": s1, "straggler_after_in_sample": si,
            "step_balancedness_before": p0, "step_balancedness_after": p1,
            "moe_time_max_rank_before": tmax0, "moe_time_max_rank_after": tmax1, "moe_time_mean_rank": tmean0,
            "modelled_moe_speedup": tmax0 / tmax1 if tmax1 else None,
            "colocated_replicas": colocated_replicas(phy2log, ep)}


def formatted(row: dict) -> dict:
    """A row's figures as text: balance to 3 places, the rest to 2, "n/a" for a window without traffic."""
    return {k: ("n/a" if v is None else f"{v:.3f}" if "balanced" in k else f"{v:.2f}")
            for k, v in row.items() if isinstance(v, (float, int)) or v is None}


def placement_rows(source: str, steps: torch.Tensor, args) -> list[dict]:
    rows = []
    N = steps.shape[2]
    for ep in args.ep_sizes:
        for r in args.redundant:
            if (N + r) % ep:
                print(f"  skip {source} EP {ep} +{r}: {N + r} slots not divisible by {ep}", flush=True)
                continue
            row = {"source": source, **evaluate(steps, ep, r)}
            rows.append(row)
            f = formatted(row)
            print(f"  {source:28s} EP {ep} +{r:2d}: balancedness {f['balancedness_before']} -> "
                  f"{f['balancedness_after']} (in-sample {f['balancedness_after_in_sample']}), "
                  f"straggler {f['straggler_before']} -> {f['straggler_after']}, modelled MoE "
                  f"speed-up {f['modelled_moe_speedup']}x", flush=True)
    return rows


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def max_seqs(args) -> int:
    return max(args.prompts, args.engine_prompts)


def make_llm(args, **kw):
    from .. import LLM
    cfg = dict(use_tqdm=False, kv_cache_memory_gb=args.kv_gb, graph_batch_sizes=GRAPH_BATCH_SIZES,
               max_num_batched_tokens=4096, enable_prefix_cache=False)
    cfg.update(kw)
    return LLM(args.model, **cfg)


def map_only_llm(args, **kw):
    """An engine whose MoE layers map tokens to replicas without counting them (the control of the
    recording overhead): recording is turned off on its balancer after construction, and its CUDA
    graphs, which traced the recorder in, are captured again."""
    llm = make_llm(args, eplb=True, eplb_interval=0, **kw)
    llm.engine.eplb.set_recording(False)
    graphs = llm.engine.executor.graphs
    if graphs.graphs:
        keys = sorted({variant for _, variant in graphs.graphs})
        graphs.graphs.clear()          # freed here, not while the new ones are being captured
        gc.collect()
        graphs.capture(keys, progress=False)
    return llm


def record_default_target(args, llm) -> dict[str, torch.Tensor]:
    """Per-step logical load [steps, L, N] of the default target serving each workload, on an
    engine with the recorder on and no redundant slot (slot e = expert e)."""
    from .. import SamplingParams
    from .bench_engine import bench_prompts
    bal, tok = llm.engine.eplb, llm.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    out = {}
    for w in args.workloads:
        prompts = [p.render() for p in bench_prompts(w, args.prompts, args.data_dir)]
        if tok is None:              # a checkpoint without tokenizer (tests): bytes as ids
            prompts = [[3 + b % 200 for b in p.encode()[:64]] for p in prompts]
        bal.recorder.reset()
        llm.generate(prompts, params)
        out[w] = bal.recorder.per_step().clone()          # R = 0, trivial placement: slot e = expert e
        print(f"recorded default:{w}: {out[w].shape[0]} steps, {int(out[w].sum())} (token, expert) pairs",
              flush=True)
    bal.recorder.reset()
    return out


def qwen_stack_routing(args, device) -> tuple[torch.Tensor, dict]:
    """Per-step logical load [steps, L, 128] of the random Qwen3-30B-A3B-shaped stack (docstring)."""
    from ..loader import load_model, Tokenizer, resolve_model_dir
    from ..model import RMSNorm, ops_for
    from .bench_engine import bench_prompts
    E, K = QWEN3_30B_A3B_MOE["num_experts"], QWEN3_30B_A3B_MOE["top_k"]
    H, I, L = args.qwen_hidden, args.qwen_intermediate, args.qwen_layers
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(1234)                 # the biases, the permutations, the lift
    dgen = torch.Generator(device).manual_seed(1234)          # the weights, drawn where they live

    def randn(*shape, fan_in):
        return (torch.randn(*shape, generator=dgen, device=device, dtype=torch.float32) / math.sqrt(fan_in)).to(dtype)

    # the text: the default target's tokenizer and token embedding (real, trained), lifted to H
    default_dir = resolve_model_dir(None)
    emb = load_model(default_dir).model.embed_tokens.weight.detach().float()
    tok = Tokenizer(default_dir)
    stream = []
    need = args.qwen_steps * args.qwen_tokens_per_step
    prompts = bench_prompts("mix", 100, args.data_dir)
    while len(stream) < need:
        for p in prompts:
            stream += tok.encode(p.render())
    ids = torch.tensor(stream[:need])
    lift = torch.randn(emb.shape[1], H, generator=gen) / math.sqrt(emb.shape[1])
    norms = [RMSNorm(H, 1e-6).to(device, dtype) for _ in range(L)]
    layers = []
    for _ in range(L):
        zipf = 1.0 / torch.arange(1, E + 1, dtype=torch.float32)
        bias = args.qwen_skew * torch.log(zipf / zipf.sum())[torch.randperm(E, generator=gen)]
        layers.append(dict(router=randn(E, H, fan_in=H), bias=bias.to(device), gate=randn(E, I, H, fan_in=H),
                           up=randn(E, I, H, fan_in=H), down=randn(E, H, I, fan_in=I)))
    ops = ops_for("triton" if device.type == "cuda" else "torch")
    steps = torch.zeros(args.qwen_steps, L, E, dtype=torch.long)
    with torch.inference_mode():
        for s in range(args.qwen_steps):
            chunk = ids[s * args.qwen_tokens_per_step:(s + 1) * args.qwen_tokens_per_step]
            x = (emb[chunk] @ lift).to(device, dtype)
            for l, lay in enumerate(layers):
                h = norms[l](x)
                probs = torch.softmax((h @ lay["router"].t()).float() + lay["bias"], dim=-1)
                w, top = torch.topk(probs, K, dim=-1)
                w = (w / w.sum(-1, keepdim=True)).to(dtype)          # Qwen3: norm_topk_prob
                steps[s, l] = torch.bincount(top.flatten(), minlength=E).cpu()
                x = x + ops.experts(h, top, w, lay["gate"], lay["up"], lay["down"])
    shape = {"num_experts": E, "top_k": K, "hidden": H, "intermediate": I, "layers": L, "dtype": str(dtype),
             "steps": args.qwen_steps, "tokens_per_step": args.qwen_tokens_per_step, "skew": args.qwen_skew,
             "weights": "random (normal, 1/sqrt(fan-in)); router bias skew * log Zipf(1) popularity per layer",
             "input": "mix workload prompts, default target's token embedding lifted by a random projection"}
    del layers
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return steps, shape


# ----------------------------------------------------------------------------- part 2: the engine
def engine_part(args, recording) -> dict:
    """`recording`: the engine of part 1 (recorder on, no redundant slot, never rebalances)."""
    from .. import SamplingParams
    from .bench_engine import bench_prompts
    n = args.engine_prompts
    prompts = [p.render() for p in bench_prompts("mix", n, args.data_dir)]
    base = dict(max_num_seqs=max_seqs(args))
    t0 = time.perf_counter()
    ref = make_llm(args, **base)
    init_s = time.perf_counter() - t0
    if ref.tokenizer is None:
        prompts = [[3 + b % 200 for b in p.encode()[:64]] for p in prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.engine_max_tokens, ignore_eos=True)
    want = ref.generate(prompts, greedy)
    ep = 4
    bal_llm = make_llm(args, eplb=True, eplb_interval=args.engine_interval, eplb_window=args.engine_interval,
                       eplb_num_redundant_experts=8, eplb_ep_size=ep, **base)
    got = bal_llm.generate(prompts, greedy)
    bal = bal_llm.engine.eplb
    secs = [r["seconds"] for r in bal.rebalances]
    identical = [a.token_ids for a in got] == [b.token_ids for b in want]
    out = {"prompts": n, "max_tokens": args.engine_max_tokens, "interval": args.engine_interval,
           "ep_size": ep, "redundant": 8, "greedy_identical": identical, "rebalances": len(secs),
           "rebalance_seconds": {"median": statistics.median(secs) if secs else None,
                                 "max": max(secs) if secs else None,
                                 "move_s_max": max((r["move_s"] for r in bal.rebalances), default=None),
                                 "placement_s_max": max((r["placement_s"] for r in bal.rebalances), default=None)},
           "moved_slots_median": statistics.median(r["moved_slots"] for r in bal.rebalances) if secs else None,
           "balancedness_before_last": bal.rebalances[-1]["balancedness_before"] if secs else None,
           "balancedness_after_predicted_last": bal.rebalances[-1]["balancedness_after_predicted"] if secs else None,
           "cuda_graphs": bool(bal_llm.engine.executor.graphs.graphs), "engine_init_s": round(init_s, 2)}
    print(f"engine: greedy identical with rebalancing every {args.engine_interval} steps: {identical}; "
          f"{len(secs)} rebalances, median {out['rebalance_seconds']['median']} s, "
          f"max {out['rebalance_seconds']['max']} s", flush=True)
    del bal_llm
    # overhead: the same decode-heavy traffic on three engines, interleaved, medians
    engines = {"off": ref, "map_only": map_only_llm(args, **base),
               "map_and_record": recording}
    times = {k: [] for k in engines}
    for e in engines.values():
        e.generate(prompts, greedy)                       # warm-up
    for rep in range(args.engine_repeats):
        order = list(engines)[rep % 3:] + list(engines)[:rep % 3]
        for name in order:
            eng = engines[name].engine
            reqs = [eng.add_request(p, greedy, queue_limit=False) for p in prompts]
            steps, t0 = 0, None
            while eng.has_unfinished():
                if t0 is None and all(r.is_decoding for r in reqs):   # decode steps only
                    _sync()
                    t0 = time.perf_counter()
                eng.step()
                steps += t0 is not None
            _sync()
            if t0 is not None and steps:
                times[name].append((time.perf_counter() - t0) / steps)
            for r in reqs:
                eng.release(r.request_id)
    med = {k: statistics.median(v) for k, v in times.items()}
    out["step_ms"] = {k: round(1e3 * v, 4) for k, v in med.items()}
    out["step_ms_all"] = {k: [round(1e3 * x, 4) for x in v] for k, v in times.items()}
    out["recording_share_of_step"] = (med["map_and_record"] - med["map_only"]) / med["map_only"]
    out["eplb_share_of_step"] = (med["map_and_record"] - med["off"]) / med["off"]
    print(f"engine step ms: {out['step_ms']}; recording {100 * out['recording_share_of_step']:.2f} % of a step, "
          f"EPLB in all (map + record) {100 * out['eplb_share_of_step']:.2f} %", flush=True)
    return out


# ----------------------------------------------------------------------------- entry
def run(args) -> dict:
    from .bench_engine import environment
    args = resolve(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    res = {"benchmark": "eplb", "command": "python -m nanodspark.bench " + " ".join(sys.argv[1:]),
           "hardware": {}, "versions": environment(), "args": {k: v for k, v in vars(args).items() if k != "func"},
           "policy": "global (one group, one node), slots GPU-major; before = one slot per expert in order",
           "rows": []}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        res["hardware"] = {"name": torch.cuda.get_device_name(device), "memory_GiB": round(p.total_memory / 2**30, 1)}
    else:
        res["hardware"] = {"name": res["versions"]["device"]}

    def save():
        res["elapsed_s"] = round(time.perf_counter() - t0, 2)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)

    phases, t = {}, time.perf_counter()

    def lap(name):
        nonlocal t
        phases[name] = round(time.perf_counter() - t, 2)
        t = time.perf_counter()

    recording = make_llm(args, eplb=True, eplb_interval=0, eplb_window=100_000, max_num_seqs=max_seqs(args))
    lap("engine_init")
    for w, steps in record_default_target(args, recording).items():
        res["rows"] += placement_rows(f"default:{w}", steps, args)
    lap("default_target")
    save()
    steps, res["qwen_stack"] = qwen_stack_routing(args, device)
    print(f"recorded qwen3-30b-a3b-shaped:mix: {steps.shape[0]} steps of {args.qwen_tokens_per_step} tokens", flush=True)
    res["rows"] += placement_rows("qwen3-30b-a3b-shaped:mix", steps, args)
    lap("qwen_stack")
    save()
    if not args.skip_engine:
        res["engine"] = engine_part(args, recording)
        lap("engine")
    res["phase_s"] = phases
    save()
    print(markdown(res))
    if args.out:
        print(f"wrote {args.out} ({res['elapsed_s']} s)")
    return res


def markdown(res: dict) -> str:
    """The walkthrough's table of a result."""
    head = "| source | EP | redundant | balancedness before → after (held out) | straggler before → after | " \
           "per-step balancedness before → after | modelled MoE speed-up |"
    lines = [head, "|---|---:|---:|---|---|---|---:|"]
    for r in res["rows"]:
        f = formatted(r)
        lines.append(f"| {r['source']} | {r['ep_size']} | {r['redundant']} | {f['balancedness_before']} → "
                     f"{f['balancedness_after']} | {f['straggler_before']} → {f['straggler_after']} | "
                     f"{f['step_balancedness_before']} → {f['step_balancedness_after']} | "
                     f"{f['modelled_moe_speedup']}× |")
    return "\n".join(lines)
