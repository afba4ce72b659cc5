"""`python -m nanodspark.bench tp`: decode tok/s of the target under tensor parallelism, and the
all-reduce time per step (walkthrough chapter 14).

What is measured. For each TP size (1, 2, 4, 8, as many as there are GPUs) and each model shape,
`size` processes are spawned; each builds *its shard* of the model directly on its device with
**random weights** (no checkpoint: nothing to download, and the numbers do not depend on the
values), a paged KV cache of its own heads holding `--context` tokens of (random) KV per
request, and runs the target's decode forward (one token per request, paged attention,
all-reduces, logits all-gathered) for batch 1 and 64. tok/s = batch / step time (the median of
`--steps` timed steps; CUDA graphs replayed where CUDA is, each rank capturing its own, eager
otherwise). The all-reduce time per step is the step's own collectives (2L + 1 all-reduces of
[batch, hidden] and the logits all-gather) timed alone, back to back, on the same group.

Shapes: `qwen3-8b` (36 layers, hidden 4096, 32 q / 8 kv heads, dense MLP 12288, vocab 151936)
and `qwen3-30b-a3b` (48 layers, hidden 2048, 32 q / 4 kv heads, 128 experts top-8 of 768,
vocab 151936), from `lab/shapes.py`; `--layers N` keeps the first N layers so a run fits its
time budget; `tiny` is for the CPU test. TP 1 runs twice: without a process group (`world1: false`, the one-process
engine) and through the collectives with a world of 1 (`world1: true`, the code path of the
TP runs), so one GPU measures what the collectives' plumbing costs by itself.

Not measured: the drafter and speculation (chapter 9 has those), prefill, the engine's host
loop. Output: a table, and with `--out` every row as JSON beside the hardware, the versions and
the command.
"""
from __future__ import annotations

import json
import statistics
import time

from .shapes import SHAPES, shape_config   # the shapes (random weights) are shared with `bench profile`


def add_tp_args(p) -> None:
    p.add_argument("--shapes", nargs="+", default=["qwen3-8b", "qwen3-30b-a3b"], choices=sorted(SHAPES),
                   help="model shapes (random weights)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="TP sizes; on CUDA those above the GPU count are skipped")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size of the MoE shapes (divides each TP size)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64], help="batch sizes")
    p.add_argument("--context", type=int, default=1024, help="cached tokens per request")
    p.add_argument("--layers", type=int, default=0, help="keep the first N layers (0 = all)")
    p.add_argument("--steps", type=int, default=30, help="decode steps timed per point")
    p.add_argument("--warmup", type=int, default=3, help="untimed decode steps before them")
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--no-graphs", action="store_true", help="eager steps on CUDA too")
    p.add_argument("--timeout-s", type=float, default=900.0, help="give up on one TP size after this long")
    p.add_argument("--out", default=None, help="JSON file for every row")


def tp_bench(args) -> list[dict]:
    import torch
    import torch.multiprocessing as mp
    from ..distributed import _free_port
    cuda = torch.cuda.is_available() and args.device != "cpu"
    n_gpus = torch.cuda.device_count() if cuda else 0
    sizes = [s for s in args.tp if not cuda or s <= n_gpus]
    skipped = [s for s in args.tp if s not in sizes]
    rows = []
    ctx = mp.get_context("spawn")
    opts = {k: v for k, v in vars(args).items() if k != "func"}
    for size in sizes:
        q = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, size, port, cuda, opts, q), daemon=True)
                 for r in range(size)]
        for p in procs:
            p.start()
        try:
            got = q.get(timeout=args.timeout_s)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        if isinstance(got, str):
            raise RuntimeError(f"TP {size} failed:\n{got}")
        rows += got
    _print(rows, skipped, cuda, n_gpus)
    if args.out:
        from .bench_engine import environment       # hardware, versions and the exact command (argv)
        with open(args.out, "w") as f:
            json.dump({"benchmark": "tp", **environment(cuda), "random_weights": True, "gpus": n_gpus,
                       "skipped_tp": skipped, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")
    return rows


def _print(rows, skipped, cuda, n_gpus) -> None:
    print(f"\nTarget decode under tensor parallelism - RANDOM WEIGHTS, {n_gpus} GPU(s)" if cuda else
          "\nTarget decode under tensor parallelism - RANDOM WEIGHTS, CPU (gloo)")
    print(f"{'shape':>14} {'layers':>6} {'TP':>3} {'EP':>3} {'world1':>6} {'batch':>5} {'mode':>6} "
          f"{'step ms':>9} {'tok/s':>10} {'AR/step':>7} {'AR ms/step':>10} {'AR share':>8}")
    for r in rows:
        share = r["allreduce_ms_per_step"] / r["step_ms"] if r["step_ms"] else float("nan")
        print(f"{r['shape']:>14} {r['layers']:>6} {r['tp']:>3} {r['ep']:>3} {str(r['world1']):>6} {r['batch']:>5} "
              f"{r['mode']:>6} {r['step_ms']:>9.3f} {r['tok_s']:>10.1f} {r['allreduces_per_step']:>7} "
              f"{r['allreduce_ms_per_step']:>10.3f} {share:>8.1%}")
    if skipped:
        print(f"(TP {skipped} skipped: only {n_gpus} GPU(s) here)")


def _rank_main(rank, size, port, cuda, a, queue) -> None:
    import traceback
    try:
        rows = _run_rank(rank, size, port, cuda, a)
        if rank == 0:
            queue.put(rows)
    except BaseException:  # noqa: BLE001 - reported by the parent
        if rank == 0:
            queue.put(traceback.format_exc())
        raise


def _run_rank(rank, size, port, cuda, a) -> list[dict]:
    import torch
    import torch.distributed as dist
    from ..sharding import ShardLayout, TPGroup
    if cuda:
        torch.cuda.set_device(rank)
        device, dtype, backend = torch.device("cuda", rank), torch.bfloat16, "nccl"
    else:
        torch.set_num_threads(1)
        device, dtype, backend = torch.device("cpu"), torch.float32, "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    tp = TPGroup(dist.group.WORLD, size, rank, backend)
    rows = []
    try:
        for shape in a["shapes"]:
            ep = a["ep"] if "num_experts" in SHAPES[shape] and size % a["ep"] == 0 else 1
            for group in ((None, tp) if size == 1 else (tp,)):
                model, cfg = _random_model(shape, a["layers"], ShardLayout(rank, size, ep), group, device, dtype)
                for batch in a["batches"]:
                    rows.append(_measure(model, cfg, ShardLayout(rank, size, ep), group, tp, batch, a, device, dtype,
                                         cuda, shape))
                del model
                if cuda:
                    torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    return rows


def _random_model(shape, layers, layout, tp, device, dtype):
    """This rank's shard of `shape` with dummy weights (loader.dummy_model: the engine's rule)."""
    from ..config import ModelConfig
    from ..loader import dummy_model
    cfg = ModelConfig.from_dict(shape_config(shape, layers))
    return dummy_model(cfg, dtype, device, layout, tp, seed=1234 + layout.rank), cfg


def _measure(model, cfg, layout, group, tp, batch, a, device, dtype, cuda, shape) -> dict:
    import torch
    import torch.distributed as dist
    from ..sharding import local_config
    from ..model import GroupMeta, KVCache, PagedAttentionContext, ops_for
    ops = ops_for("triton" if cuda else "torch")
    if cuda:
        model.fuse()
    bs, ctx_len = 16, a["context"]
    per = -(-(ctx_len + 1) // bs)
    kv = KVCache(local_config(cfg, layout), {"full": batch * per + 1, "sliding": batch * per + 1}, bs, dtype, device)
    for t in kv.tensors.values():
        t.normal_(0.0, 1.0)
    tables = (torch.arange(batch * per, device=device, dtype=torch.int32).view(batch, per))
    pos = torch.full((batch,), ctx_len, dtype=torch.long, device=device)
    slots = (tables[:, ctx_len // bs].long() * bs + ctx_len % bs)
    meta = GroupMeta(tables, slots, torch.full((batch,), ctx_len + 1, dtype=torch.int32, device=device))
    groups = {g: meta for g in kv.groups}
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch,), device=device, generator=gen)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
    pctx = PagedAttentionContext(kv, cu, 1, groups, ops, tp=group)

    @torch.inference_mode()
    def step():
        return model.compute_logits(model(ids, pos, pctx).hidden)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)
        if group is not None:
            dist.barrier(group=group.group)     # every rank starts the timed step together

    for _ in range(a["warmup"]):
        step()
    mode, run = "eager", step
    if cuda and not a["no_graphs"]:
        s = torch.cuda.Stream(device)
        s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream(device).wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        mode, run = "graph", graph.replay
        run()
    times = []
    for _ in range(a["steps"]):
        sync()
        t0 = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    step_ms = 1e3 * statistics.median(times)
    # the step's own collectives, alone: 2L + 1 all-reduces of [batch, hidden] and the logits gather
    n_ar = 2 * cfg.num_hidden_layers + 1 if group is not None else 0
    ar_ms = gather_ms = 0.0
    if group is not None:
        buf = torch.randn(batch, cfg.hidden_size, device=device).to(dtype)
        part = torch.randn(batch, model.lm_head.rows, device=device).float().to(dtype)
        reps = max(3, a["steps"] // 3)
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            for _ in range(n_ar):
                dist.all_reduce(buf, group=group.group)
        if cuda:
            torch.cuda.synchronize(device)
        ar_ms = 1e3 * (time.perf_counter() - t0) / reps
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            group.all_gather_last(part)
        if cuda:
            torch.cuda.synchronize(device)
        gather_ms = 1e3 * (time.perf_counter() - t0) / reps
    return dict(shape=shape, layers=cfg.num_hidden_layers, tp=layout.size, ep=layout.ep_size,
                world1=group is not None, batch=batch, mode=mode,
                context=ctx_len, step_ms=round(step_ms, 4), tok_s=round(batch / (step_ms / 1e3), 2),
                allreduces_per_step=n_ar, allreduce_ms_per_step=round(ar_ms, 4), gather_ms=round(gather_ms, 4),
                dtype=str(dtype).removeprefix("torch."), random_weights=True)

