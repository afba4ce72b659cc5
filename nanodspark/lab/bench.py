"""Benchmarks: `python -m nanodspark.bench <subcommand> [...]`.

The idea
    One entry point, one argparse subcommand per benchmark; each subcommand measures, writes
    every number to a JSON file (hardware, versions, the exact command, every row) and prints a
    short table last. Subcommands are registered in `build_parser`; add yours there.

    `kernels` (issue #3) times the Triton paged attention (kernels/paged_attention.py) on the
    attention shape of Qwen3-8B (32 query heads, 8 KV heads, head_dim 128, bf16, KV block 16)
    for decode (q_len 1) and verify (q_len 4, 8), batch 1/8/64/256, context 1k/8k/32k, next to
    torch SDPA on the same data held densely (`[B, H, S, D]` views, GQA through `enable_gqa`,
    the bottom-right causal mask for q_len > 1) and flex_attention (compiled; every new shape
    recompiles it, so by default it is tried only on the goal region, batch 8/64, ctx >= 8k,
    q_len 1/8, within a time budget). It also measures the device-to-device copy bandwidth in the same run, and
    reports the achieved bandwidth of the kernel,
        bytes = K/V that must be read (B * ctx * Hkv * D * 2 tensors * 2 bytes) + Q + O,
    over the median time, its fraction of the copy bandwidth (bytes read + written / time of a
    large `copy_`), and the speedups. A sweep of launch configurations, timed in CUDA-graph
    replay (so that host launch time is not measured), records what the heuristic `pick_config`
    leaves on the table at the goal-region shapes: stage 1 varies the compile-time parameters
    (tile rows and keys, warps, pipeline stages) at the default split count, stage 2 the split
    count with stage 1's best; each entry records the compiled kernel's registers and shared
    memory. `--sweep-only` runs just the sweep. `kernels-table JSON [--before JSON]` prints the
    walkthrough's table and the goal counts (eager and graph replay) of a saved run, no GPU.

Invariants
    * Times are medians from `triton.testing.do_bench` (CUDA events, L2 flushed between
      repetitions); `*_graph_us` are medians of CUDA-graph replays (`do_bench_cudagraph`),
      which also proves the kernel is capturable.
    * Every Triton output is compared with SDPA's (max abs difference recorded).
    * Combinations that do not fit in free device memory (paged cache + dense copy) are
      skipped and listed with the reason; so are rows past the time budget.
    * Without CUDA, `--smoke` runs the same code path on tiny shapes with the Triton
      interpreter and a wall-clock timer (a check of this script, not a measurement).

Tested against
    Run on an H200 (results: benchmarks/kernels_h200.json, discussed in
    walkthrough/03_kernels.md); the kernels' correctness is tests/test_kernels.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import statistics
import sys
import time

# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------


def _timer(use_cuda: bool, rep_ms: int):
    """(median ms of fn via events, median ms via graph replay or None)."""
    if use_cuda:
        from triton.testing import do_bench, do_bench_cudagraph

        def events(fn):
            return do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")

        def graph(fn):
            try:
                return do_bench_cudagraph(fn, rep=max(10, rep_ms // 3), return_mode="median")
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                return f"error: {type(e).__name__}: {str(e)[:120]}"
        return events, graph

    def wall(fn):
        fn()
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)
    return wall, (lambda fn: None)


def _copy_bandwidth(torch, events, device, nbytes):
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = events(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9, ms


def _sdpa_fn(torch, F, q, k, v, q_len, ctx, scale):
    """SDPA on dense [B, H, S, D] views; bottom-right causal for q_len > 1. (fn, variant)."""
    if q_len == 1:
        return (lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)), \
            "no mask"
    try:
        from torch.nn.attention.bias import causal_lower_right
        bias = causal_lower_right(q_len, ctx)
        fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale,  # noqa: E731
                                                    enable_gqa=True)
        fn()
        return fn, "causal_lower_right"
    except Exception:  # noqa: BLE001 - fall back to an explicit boolean mask
        i = torch.arange(q_len, device=q.device)[:, None] + (ctx - q_len)
        mask = torch.arange(ctx, device=q.device)[None, :] <= i
        return (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                       enable_gqa=True)), "bool mask"


class _Flex:
    """Compiled flex_attention within a time budget (compilation included)."""

    def __init__(self, torch, enabled: bool, budget_s: float):
        self.torch, self.budget, self.spent, self.error = torch, budget_s, 0.0, None
        self.fn = None
        if not enabled:
            self.error = "disabled"
            return
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            import torch._dynamo.config as dc
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(dc, name):
                    setattr(dc, name, 256)
            self.create_block_mask = create_block_mask
            self.fn = torch.compile(flex_attention)
        except Exception as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {str(e)[:160]}"

    def make(self, q, k, v, q_len, ctx, scale):
        """A callable, or a string saying why not."""
        if self.fn is None:
            return self.error
        if self.spent > self.budget:
            return "skipped: flex time budget spent"
        t0 = time.perf_counter()
        try:
            mask = None
            if q_len > 1:
                off = ctx - q_len
                mask = self.create_block_mask(lambda b, h, qi, kj: kj <= qi + off, None, None,
                                              q_len, ctx, device=q.device)
            fn = lambda: self.fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)  # noqa: E731
            fn()
            self.torch.cuda.synchronize()
            return fn
        except Exception as e:  # noqa: BLE001
            return f"error: {type(e).__name__}: {str(e)[:160]}"
        finally:
            self.spent += time.perf_counter() - t0


def _fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) else "-"


# The sweep's default shapes (batch, context, q_len): the goal region of issue #3 where the
# first heuristic configuration fell short (batch 8; q_len 8 at larger batches).
DEFAULT_SWEEP_SHAPES = [(8, 8192, 1), (8, 8192, 4), (8, 8192, 8), (8, 32768, 1), (8, 32768, 8),
                        (64, 8192, 8), (64, 32768, 8), (256, 8192, 8)]
SWEEP_SPLITS = [1, 2, 3, 4, 6, 8, 9, 12, 16, 17, 24, 32, 33, 48, 64]


def _compile_candidates(base, smoke: bool):
    """Stage-1 configurations: every (block_m, block_n, warps, stages) worth timing at `base`'s
    split count. block_m 16 is tried for taller tiles too (two query tiles share K/V via L2)."""
    from kernels import AttentionConfig
    block_ms = sorted({base.block_m, 16})
    if smoke:
        return [AttentionConfig(16, 32, base.num_splits, 4, 2)]
    return [AttentionConfig(bm, bn, base.num_splits, nw, st)
            for bm in block_ms for bn in (32, 64, 128) for nw in (4, 8) for st in (2, 3, 4)
            if (bm, bn, nw, st) != (base.block_m, base.block_n, base.num_warps, base.num_stages)]


def run_kernels(args) -> dict:
    import torch
    import torch.nn.functional as F

    use_cuda = torch.cuda.is_available()
    if not use_cuda and not args.smoke:
        sys.exit("bench kernels needs a CUDA GPU (or --smoke for a CPU check of this script)")
    # `kernels` first: without CUDA it selects the Triton interpreter, before Triton is imported.
    from kernels import AttentionConfig, paged_attention, pick_config
    import triton

    device = torch.device("cuda" if use_cuda else "cpu")
    events, graph = _timer(use_cuda, args.rep_ms)
    t_start = time.perf_counter()
    if args.smoke:
        Hq, Hkv, D, PAGE = 8, 2, 32, 16
        batches, contexts, q_lens = [1, 2], [64, 256], [1, 4]
    else:
        Hq, Hkv, D, PAGE = 32, 8, 128, 16
        batches, contexts, q_lens = args.batches, args.contexts, args.q_lens
    dtype, esize = torch.bfloat16, 2
    scale = D ** -0.5

    res = {
        "benchmark": "kernels",
        "command": "python -m nanodspark.bench " + " ".join(sys.argv[1:]),
        "hardware": {},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "triton": triton.__version__, "cuda": torch.version.cuda},
        "shape": {"q_heads": Hq, "kv_heads": Hkv, "head_dim": D, "dtype": "bfloat16",
                  "block_size": PAGE, "note": "Qwen3-8B attention" if not args.smoke else "smoke"},
        "bytes_counted": "B*ctx*Hkv*D*2(K,V)*2B + Q + O (each T*Hq*D*2B)",
        "timing": "triton.testing.do_bench median (CUDA events, L2 flushed); *_graph_us: "
                  "do_bench_cudagraph median",
        "rows": [], "skipped": [], "sweep": [],
    }
    if use_cuda:
        p = torch.cuda.get_device_properties(device)
        res["hardware"] = {"name": torch.cuda.get_device_name(device), "sms": p.multi_processor_count,
                           "memory_GiB": round(p.total_memory / 2**30, 1),
                           "capability": f"{p.major}.{p.minor}"}
    else:
        res["hardware"] = {"name": f"CPU ({platform.machine()}), Triton interpreter"}

    copy_bytes = (1 << 31) if use_cuda else (1 << 24)
    res["copy_GBps"], res["copy_ms"] = _copy_bandwidth(torch, events, device, copy_bytes)
    res["copy_bytes"] = copy_bytes
    copy_bw = res["copy_GBps"]
    print(f"device-to-device copy: {copy_bw:.0f} GB/s (read + write of {copy_bytes / 2**30:.1f} GiB)",
          flush=True)

    flex = _Flex(torch, use_cuda and not args.no_flex, args.flex_budget_s)

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)

    combos = [] if args.sweep_only else sorted(((b, c) for b in batches for c in contexts),
                                               key=lambda bc: bc[0] * bc[1])
    for B, ctx in combos:
        nblk = B * math.ceil(ctx / PAGE)
        kv_bytes = 2 * nblk * PAGE * Hkv * D * esize
        if time.perf_counter() - t_start > args.budget_s:
            res["skipped"].append({"batch": B, "ctx": ctx, "why": "time budget"})
            continue
        if use_cuda:
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info(device)[0]
            need = 2 * kv_bytes + (2 << 30)
            if need > 0.9 * free:
                res["skipped"].append({"batch": B, "ctx": ctx, "why":
                                       f"needs {need / 1e9:.0f} GB (paged cache + dense copy), "
                                       f"{free / 1e9:.0f} GB free"})
                print(f"skip B={B} ctx={ctx}: {res['skipped'][-1]['why']}", flush=True)
                continue
        gen_dev = device
        k_cache = torch.randn(nblk, PAGE, Hkv, D, dtype=dtype, device=gen_dev)
        v_cache = torch.randn(nblk, PAGE, Hkv, D, dtype=dtype, device=gen_dev)
        perm = torch.randperm(nblk, device=device)              # scattered pages
        tables = perm.view(B, -1).to(torch.int32)
        kv_lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
        # The same K/V held densely for SDPA / flex: [B, Hkv, ctx, D] views (unit stride on D).
        k_dense = k_cache[perm.view(B, -1)].view(B, -1, Hkv, D)[:, :ctx].transpose(1, 2)
        v_dense = v_cache[perm.view(B, -1)].view(B, -1, Hkv, D)[:, :ctx].transpose(1, 2)

        for q_len in q_lens:
            T = B * q_len
            q = torch.randn(T, Hq, D, dtype=dtype, device=device)
            cu = torch.arange(0, T + 1, q_len, dtype=torch.int32, device=device)
            out = torch.empty_like(q)
            cfg = pick_config(batch=B, num_kv_heads=Hkv, group=Hq // Hkv, head_dim=D,
                              max_q_len=q_len, max_kv_len=tables.shape[1] * PAGE, dtype=dtype,
                              device=device)
            tri = lambda: paged_attention(q, k_cache, v_cache, tables, cu, kv_lens,  # noqa: E731
                                          scale=scale, max_q_len=q_len, out=out)
            row = {"batch": B, "ctx": ctx, "q_len": q_len,
                   "config": {"block_m": cfg.block_m, "block_n": cfg.block_n,
                              "num_splits": cfg.num_splits, "num_warps": cfg.num_warps,
                              "num_stages": cfg.num_stages}}
            nbytes = 2 * B * ctx * Hkv * D * esize + 2 * T * Hq * D * esize   # K,V + Q,O
            row["bytes"] = nbytes
            try:
                row["triton_us"] = events(tri) * 1e3
                g = graph(tri)
                row["triton_graph_us"] = g * 1e3 if isinstance(g, float) else g
                row["triton_GBps"] = nbytes / (row["triton_us"] * 1e-6) / 1e9
                row["frac_of_copy"] = row["triton_GBps"] / copy_bw
            except Exception as e:  # noqa: BLE001
                row["triton_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            qd = q.view(B, q_len, Hq, D).transpose(1, 2)
            try:
                sdpa, row["sdpa_variant"] = _sdpa_fn(torch, F, qd, k_dense, v_dense, q_len, ctx,
                                                     scale)
                ref = sdpa().transpose(1, 2).reshape(T, Hq, D)
                tri()
                row["max_abs_diff_vs_sdpa"] = float((out.float() - ref.float()).abs().max())
                del ref
                row["sdpa_us"] = events(sdpa) * 1e3
                g = graph(sdpa)
                row["sdpa_graph_us"] = g * 1e3 if isinstance(g, float) else g
                if "triton_us" in row:
                    row["speedup_vs_sdpa"] = row["sdpa_us"] / row["triton_us"]
            except Exception as e:  # noqa: BLE001
                row["sdpa_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                if use_cuda:
                    torch.cuda.empty_cache()
            if use_cuda and not (args.flex_all or (B in (8, 64) and ctx >= 8192 and q_len in (1, 8))):
                row["flex_error"] = "not tried (only batch 8/64, ctx >= 8k, q 1/8; --flex-all)"
            elif use_cuda:
                fx = flex.make(qd, k_dense, v_dense, q_len, ctx, scale)
                if callable(fx):
                    try:
                        row["flex_us"] = events(fx) * 1e3
                        if "triton_us" in row:
                            row["speedup_vs_flex"] = row["flex_us"] / row["triton_us"]
                    except Exception as e:  # noqa: BLE001
                        row["flex_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                else:
                    row["flex_error"] = fx
            res["rows"].append(row)
            print(f"B={B:4d} ctx={ctx:6d} q={q_len:2d} triton {_fmt(row.get('triton_us'), '9.1f')} us "
                  f"({_fmt(row.get('frac_of_copy'), '.2f')} of copy)  sdpa {_fmt(row.get('sdpa_us'), '9.1f')} us"
                  f"  flex {_fmt(row.get('flex_us'), '9.1f')} us  maxdiff "
                  f"{_fmt(row.get('max_abs_diff_vs_sdpa'), '.3g')}", flush=True)
            save()
        del k_cache, v_cache, k_dense, v_dense, perm, tables

    # ---- a graph-timed sweep of launch configurations ------------------------------------------
    if args.sweep_shapes:
        shapes = [tuple(int(x) for x in sh.split(",")) for sh in args.sweep_shapes]
    else:
        shapes = [(2, 128, 1), (2, 128, 4)] if args.smoke else DEFAULT_SWEEP_SHAPES
    t_sweep = time.perf_counter()
    for B, ctx, q_len in shapes:
        if time.perf_counter() - t_sweep > args.sweep_budget_s:
            res["sweep"].append({"batch": B, "ctx": ctx, "q_len": q_len, "skipped": "sweep time budget"})
            continue
        nblk = B * math.ceil(ctx / PAGE)
        k_cache = torch.randn(nblk, PAGE, Hkv, D, dtype=dtype, device=device)
        v_cache = torch.randn(nblk, PAGE, Hkv, D, dtype=dtype, device=device)
        tables = torch.randperm(nblk, device=device).view(B, -1).to(torch.int32)
        kv_lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
        T = B * q_len
        q = torch.randn(T, Hq, D, dtype=dtype, device=device)
        cu = torch.arange(0, T + 1, q_len, dtype=torch.int32, device=device)
        out = torch.empty_like(q)
        base = pick_config(batch=B, num_kv_heads=Hkv, group=Hq // Hkv, head_dim=D, max_q_len=q_len,
                           max_kv_len=ctx, dtype=dtype, device=device)
        want = paged_attention(q, k_cache, v_cache, tables, cu, kv_lens, scale=scale,
                               max_q_len=q_len).float()
        nbytes = 2 * nblk * PAGE * Hkv * D * esize + 2 * T * Hq * D * esize

        def measure(c, stage):
            ent = {"batch": B, "ctx": ctx, "q_len": q_len, "stage": stage,
                   "config": dataclasses.asdict(c), "default": c == base}
            try:
                stats = {}
                fn = lambda: paged_attention(q, k_cache, v_cache, tables, cu, kv_lens,  # noqa: E731
                                             scale=scale, max_q_len=q_len, out=out, config=c)
                paged_attention(q, k_cache, v_cache, tables, cu, kv_lens, scale=scale,
                                max_q_len=q_len, out=out, config=c, stats=stats)
                ent.update(stats)
                ent["max_abs_diff_vs_default"] = float((out.float() - want).abs().max())
                g = graph(fn) if use_cuda else events(fn)
                if not isinstance(g, float):
                    raise RuntimeError(g)
                ent["us"] = g * 1e3
                ent["frac_of_copy"] = nbytes / (ent["us"] * 1e-6) / 1e9 / copy_bw
            except Exception as e:  # noqa: BLE001
                ent["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            res["sweep"].append(ent)
            return ent

        # stage 1: compile-time parameters (tile shape, warps, pipeline depth) at the default split
        best = measure(base, "default")
        for c in _compile_candidates(base, args.smoke):
            if time.perf_counter() - t_sweep > args.sweep_budget_s:
                break
            e = measure(c, "compile")
            if "us" in e and ("us" not in best or e["us"] < best["us"]):
                best = e
        # stage 2: the split count, with the best compile-time parameters of stage 1
        b = AttentionConfig(**best["config"])
        kv_tiles = math.ceil(ctx / b.block_n)
        for sp in SWEEP_SPLITS:
            if sp > kv_tiles or sp == b.num_splits or time.perf_counter() - t_sweep > args.sweep_budget_s:
                continue
            measure(dataclasses.replace(b, num_splits=sp), "splits")
        del k_cache, v_cache
        save()

    res["goals"] = kernel_goals(res)
    res["elapsed_s"] = time.perf_counter() - t_start
    save()
    return res


def add_graph_figures(res: dict) -> dict:
    """Per row, the CUDA-graph-replay versions of the bandwidth share and the SDPA speedup
    (launch time excluded), from the recorded times; idempotent, works on older JSON too."""
    for r in res["rows"]:
        g, sg = r.get("triton_graph_us"), r.get("sdpa_graph_us")
        if isinstance(g, float):
            r["frac_of_copy_graph"] = r["bytes"] / (g * 1e-6) / 1e9 / res["copy_GBps"]
            if isinstance(sg, float):
                r["speedup_vs_sdpa_graph"] = sg / g
    return res


def kernel_goals(res: dict) -> dict:
    """Issue #3's two goals, counted under do_bench (eager launches) and in graph replay."""
    add_graph_figures(res)
    out = {}
    for suffix in ("", "_graph"):
        frac, speed = "frac_of_copy" + suffix, "speedup_vs_sdpa" + suffix
        big = [r[frac] for r in res["rows"] if r["ctx"] >= 8192 and r["batch"] >= 8 and frac in r]
        ver = [r[speed] for r in res["rows"] if r["q_len"] == 8 and speed in r]
        out["bandwidth_ge_0.8_of_copy_at_ctx_ge_8k_batch_ge_8" + suffix] = {
            "met": sum(x >= 0.8 for x in big), "of": len(big), "min": min(big, default=None),
            "max": max(big, default=None)}
        out["verify_q8_speedup_ge_2x_sdpa" + suffix] = {
            "met": sum(x >= 2 for x in ver), "of": len(ver), "min": min(ver, default=None),
            "max": max(ver, default=None)}
    return out


def kernels_markdown(res: dict, before: dict | None = None) -> str:
    """The walkthrough's table of a `bench kernels` JSON (optionally next to an earlier run's
    graph-replay bandwidth share for the same rows)."""
    add_graph_figures(res)
    old = {}
    if before is not None:
        add_graph_figures(before)
        old = {(r["batch"], r["ctx"], r["q_len"]): r.get("frac_of_copy_graph") for r in before["rows"]}
    head = ["B", "ctx", "q", "splits", "Triton µs", "graph µs", "% of copy", "% of copy (graph)"] + \
        (["before (graph)"] if before is not None else []) + \
        ["SDPA µs", "SDPA graph µs", "× SDPA", "× SDPA (graph)", "flex µs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    pct = lambda x: _fmt(100 * x if isinstance(x, float) else None, ".0f")  # noqa: E731
    for r in res["rows"]:
        cells = [r["batch"], f"{r['ctx'] // 1024}k", r["q_len"], r["config"]["num_splits"],
                 _fmt(r.get("triton_us"), ".0f"), _fmt(r.get("triton_graph_us"), ".1f"),
                 pct(r.get("frac_of_copy")), pct(r.get("frac_of_copy_graph"))]
        if before is not None:
            cells.append(pct(old.get((r["batch"], r["ctx"], r["q_len"]))))
        cells += [_fmt(r.get("sdpa_us"), ".0f"), _fmt(r.get("sdpa_graph_us"), ".1f"),
                  _fmt(r.get("speedup_vs_sdpa"), ".2f"), _fmt(r.get("speedup_vs_sdpa_graph"), ".2f"),
                  _fmt(r.get("flex_us"), ".0f")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def cmd_kernels_table(args) -> int:
    with open(args.input) as f:
        res = json.load(f)
    before = None
    if args.before:
        with open(args.before) as f:
            before = json.load(f)
    print(kernels_markdown(res, before))
    for name, g in kernel_goals(res).items():
        print(f"goal {name}: met {g['met']}/{g['of']}")
    return 0


def sweep_summary(sweep: list) -> dict:
    """{(batch, ctx, q_len): {"default": entry, "best": entry}} over the timed sweep entries."""
    out = {}
    for e in sweep:
        if "us" not in e:
            continue
        d = out.setdefault((e["batch"], e["ctx"], e["q_len"]), {})
        if e.get("default"):
            d["default"] = e
        if "best" not in d or e["us"] < d["best"]["us"]:
            d["best"] = e
    return {k: d for k, d in out.items() if "default" in d}


def print_kernels_table(res: dict) -> None:
    print()
    print(f"{res['hardware'].get('name')} | torch {res['versions']['torch']} | triton "
          f"{res['versions']['triton']} | copy {res['copy_GBps']:.0f} GB/s")
    print(f"{'B':>4} {'ctx':>6} {'q':>2} | {'triton us':>9} {'graph us':>9} {'GB/s':>6} {'%copy':>5} "
          f"| {'sdpa us':>9} {'x':>5} | {'flex us':>9} {'x':>5} | split")
    for r in res["rows"]:
        print(f"{r['batch']:>4} {r['ctx']:>6} {r['q_len']:>2} | {_fmt(r.get('triton_us'), '9.1f')} "
              f"{_fmt(r.get('triton_graph_us'), '9.1f')} {_fmt(r.get('triton_GBps'), '6.0f')} "
              f"{_fmt(100 * r['frac_of_copy'] if 'frac_of_copy' in r else None, '5.0f')} | "
              f"{_fmt(r.get('sdpa_us'), '9.1f')} {_fmt(r.get('speedup_vs_sdpa'), '5.2f')} | "
              f"{_fmt(r.get('flex_us'), '9.1f')} {_fmt(r.get('speedup_vs_flex'), '5.2f')} | "
              f"{r['config']['num_splits']}")
    for s in res["skipped"]:
        print(f"skipped B={s['batch']} ctx={s['ctx']}: {s['why']}")
    for key, d in sweep_summary(res["sweep"]).items():
        bst, dft = d["best"], d["default"]
        print(f"sweep B={key[0]} ctx={key[1]} q={key[2]}: default {dft['us']:.1f} us "
              f"({100 * dft['frac_of_copy']:.0f}% copy, {dft.get('n_regs')} regs), best {bst['us']:.1f} us "
              f"({100 * bst['frac_of_copy']:.0f}% copy, {bst.get('n_regs')} regs) with {bst['config']}")
    for name, g in res.get("goals", {}).items():
        print(f"goal {name}: met {g['met']}/{g['of']} (min {_fmt(g['min'], '.2f')}, "
              f"max {_fmt(g['max'], '.2f')})")


def cmd_kernels(args) -> int:
    res = run_kernels(args)
    print_kernels_table(res)
    if args.out:
        print(f"wrote {args.out}")
    return 0


# ------------------------------------------------------------------------------------------------
# entry point
# ------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nanodspark.bench", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    defaults = argparse.ArgumentDefaultsHelpFormatter     # every --help shows each flag's default
    k = sub.add_parser("kernels", help="Triton paged attention vs SDPA / flex (GPU)", formatter_class=defaults)
    k.add_argument("--out", default=None, help="JSON file for every row")
    k.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256], help="batch sizes")
    k.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768],
                   help="context lengths (cached tokens per request)")
    k.add_argument("--q-lens", type=int, nargs="+", default=[1, 4, 8],
                   help="query tokens per request (1: decode, more: a verify window)")
    k.add_argument("--rep-ms", type=int, default=60, help="do_bench repetition time per timing")
    k.add_argument("--no-flex", action="store_true", help="skip flex_attention")
    k.add_argument("--flex-all", action="store_true",
                   help="try flex_attention on every row (each new shape recompiles it)")
    k.add_argument("--flex-budget-s", type=float, default=75.0,
                   help="stop trying flex_attention (compile included) after this long")
    k.add_argument("--sweep-budget-s", type=float, default=240.0,
                   help="stop the configuration sweep after this long (compiles included)")
    k.add_argument("--sweep-shapes", nargs="*", default=None, metavar="B,CTX,Q",
                   help="shapes of the configuration sweep (default: the goal-region misses)")
    k.add_argument("--sweep-only", action="store_true", help="only the configuration sweep")
    k.add_argument("--budget-s", type=float, default=280.0, help="skip rows started after this")
    k.add_argument("--smoke", action="store_true", help="tiny shapes; runs without CUDA")
    k.set_defaults(func=cmd_kernels)

    t = sub.add_parser("kernels-table", help="markdown table + goals of a `kernels` JSON (no GPU)",
                       formatter_class=defaults)
    t.add_argument("input", help="JSON written by `bench kernels`")
    t.add_argument("--before", default=None, help="an earlier run's JSON, for its graph-replay column")
    t.set_defaults(func=cmd_kernels_table)

    from . import bench_engine as be  # engine-level benchmarks live in their own files
    from . import bench_eplb as bl
    from . import bench_host as bh
    from . import bench_profile as bp
    from . import bench_serve as bsv
    from . import bench_sampling as bsa
    from . import bench_speed as bsp
    from . import bench_swa as bsw
    from . import bench_tp as btp
    from . import figures as fg
    from . import simulate as sim
    from . import speedup_figure as sfig
    from . import timeline as tl
    for name, helptext, add_args, run in (
            ("figures", "redraw every committed figure (benchmarks/*.png) from its data, no GPU",
             fg.add_figures_args, fg.figures),
            ("timeline", "PNG of decode steps: host phases over GPU kernels, sync vs overlapped loop",
             tl.add_timeline_args, tl.timeline),
            ("tp", "tensor parallel decode tok/s (TP 1/2/4/8, random weights) and all-reduce time per step",
             btp.add_tp_args, btp.tp_bench),
            ("engine", "tok/s beside transformers (dynamic, static cache), graphs and overlap, kernels per step",
             bsp.add_speed_args, bsp.engine_speed),
            ("host", "host ms per decode step by phase (schedule, launch, result, commit), any device",
             bh.add_host_args, bh.host_bench),
            ("profile", "profile the step cost T(bs, K) of target + drafter", bp.add_profile_args, bp.profile),
            ("serve", "steady state: C closed-loop clients, engine in-process or serve.py over HTTP; "
             "tok/s, TTFT, ITL, Pareto front", bsv.add_serve_args, bsv.serve_bench),
            ("dspark", "concurrency sweep: no speculation vs static vs compact (steady state; --traffic burst: "
             "the former batch of C)", bsv.add_dspark_args, bsv.dspark),
            ("simulate", "predict total and per-user tok/s per system and concurrency from a step-cost table "
             "and acceptance traces", sim.add_simulate_args, sim.simulate),
            ("profile-plain", "profile the step cost T(bs, 0) of the target without a drafter",
             sim.add_profile_plain_args, sim.profile_plain),
            ("speedup-figure", "PNG: total throughput over no speculation against concurrency, measured and "
             "predicted", sfig.add_args, sfig.run),
            ("pareto", "Pareto plot (PNG) of a `dspark` result: per-user vs total tok/s", be.add_pareto_args,
             be.pareto),
            ("dspark-table", "markdown table of a `dspark` result (no GPU)", be.add_dspark_table_args,
             be.dspark_table),
            ("eplb", "expert load balance on recorded routing, simulated EP 4/8, rebalancing a running engine",
             bl.add_eplb_args, bl.run),
            ("sampling", "tau and tok/s of coupled vs rejection verification per workload; the cost of "
             "batch invariance at batch 1/64/256", bsa.add_sampling_args, bsa.run),
            ("swa", "SWA replay and snapshots: follow-up prefill and TTFT, bounded replay drift", bsw.add_swa_args,
             bsw.swa_bench)):
        sp = sub.add_parser(name, help=helptext, description=helptext,
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        add_args(sp)
        sp.set_defaults(func=lambda a, run=run: run(a) and 0)   # the result is data; exit status 0
    from . import report as rp
    r = sub.add_parser("report", help="the results page's tables from the committed JSON: print, --write "
                       "the page's blocks, or --check them (no GPU)", formatter_class=defaults)
    rp.add_report_args(r)
    r.set_defaults(func=rp.report)                             # --check's exit status is the answer
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
