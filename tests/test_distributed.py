"""Tensor and expert parallelism on the CPU: gloo, 2 and 4 processes, tiny models; the engine
and serve.py tests run again over NCCL where two GPUs are (skipped elsewhere).

* the loader gives each rank only its shard, read slice by slice (no rank holds the model);
* TP logits equal single-process logits (float32, |diff| <= 1e-6 + 1e-5 |ref|: the only
  difference is the summation order of the all-reduced partial sums) for Qwen3 dense (tied
  embeddings), Llama (a vocabulary that does not split evenly), Qwen3-MoE with TP inside the
  experts and with EP, at 2 and 4 ranks (4 ranks: fewer KV heads than ranks, replicated);
* the engine with speculation, TP 2, gives the single-process greedy tokens; every rank's
  digest of its step outputs is the same (same scheduler decisions, same sampled tokens);
* a worker killed mid-generation makes the engine raise `WorkerLost` promptly (no hang).
"""
import os
import pickle
import signal
import time

import pytest
import torch

from conftest import make_hf_model, random_drafter
from nanodspark import LLM, SamplingParams
from nanodspark.distributed import WorkerLost
from nanodspark.sharding import ShardLayout
from nanodspark.loader import load_model, load_sharded
from nanodspark.model import DenseAttentionContext

TOL = dict(atol=1e-6, rtol=1e-5)   # measured: at most 6e-8 on logits of magnitude ~0.2
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


# ----------------------------------------------------------------------------- a world of processes
def _rank_main(rank, world, port, fn, args, queue):
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        queue.put((rank, pickle.dumps(fn(rank, world, *args)), None))   # by value, not shared memory
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback
        queue.put((rank, None, traceback.format_exc()))


def run_world(fn, world, *args, timeout=120):
    """Run fn(rank, world, *args) in `world` forked gloo processes (forked: no process imports
    torch again; each runs single-threaded); returns the results by rank. The engine itself
    spawns its workers (the production path), which the engine tests use."""
    import torch.multiprocessing as mp
    from nanodspark.distributed import _free_port
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, fn, args, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    try:
        deadline = time.monotonic() + timeout
        while len(out) < world:
            rank, res, err = q.get(timeout=max(1, deadline - time.monotonic()))
            assert err is None, f"rank {rank} failed:\n{err}"
            out[rank] = pickle.loads(res)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world)]


# ----------------------------------------------------------------------------- models
CASES = {   # name -> (kind, make_hf_model keywords, expert_parallel sizes to try); two layers each
    "qwen3": ("qwen3", dict(tie=True, num_hidden_layers=2), (1,)),
    "llama": ("llama", dict(vocab_size=318, num_hidden_layers=2), (1,)),
    "qwen3_moe": ("qwen3_moe", dict(window=8, num_hidden_layers=2), (1, 2, 4)),   # one full, one sliding
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {name: make_hf_model(kind, tmp_path_factory.mktemp(name), **kw)[0]
            for name, (kind, kw, _) in CASES.items()}


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 318, (13,), generator=g), torch.arange(13)


def _logits(model, tp=None):
    ids, pos = _inputs()
    with torch.no_grad():
        out = model(ids, pos, DenseAttentionContext(1, ids.shape[0], tp=tp))
        return model.compute_logits(out.hidden)


def _tp_logits(rank, world, jobs):
    """Every job at TP 4 (the whole world), then at TP 2 (ranks {0, 1} and {2, 3}: two groups of
    two processes, so one world of four processes checks both sizes)."""
    import torch.distributed as dist
    from nanodspark.sharding import TPGroup
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    res = {}
    for size, group in ((4, dist.group.WORLD), (2, pairs[rank // 2])):
        r = rank % size
        tp = TPGroup(group, size, r, "gloo")
        for name, path, ep in jobs:
            if ep <= size:
                model = load_model(path, layout=ShardLayout(r, size, ep), tp=tp)
                res[(name, size, ep)] = _logits(model, tp)
    return res


def test_tp_logits_equal_single_process(models):
    jobs = [(name, str(models[name]), ep) for name, (_, _, eps) in CASES.items() for ep in eps]
    results = run_world(_tp_logits, 4, jobs)
    checked = 0
    for name, path, ep in jobs:
        ref = _logits(load_model(path))
        for size in (2, 4):
            for rank, res in enumerate(results):
                if (name, size, ep) in res:
                    got = res[(name, size, ep)]
                    assert got.shape == ref.shape
                    torch.testing.assert_close(got, ref, **TOL, msg=f"{name} ep={ep} rank {rank} of {size}")
                    checked += 1
    assert checked == 4 * 5 + 4 * 4          # TP 4: five jobs on four ranks; TP 2: four jobs (ep <= 2)


def test_loader_reads_only_each_ranks_shard(models, monkeypatch):
    """In one process: rank r of 4 is built from the checkpoint without any process group. Each
    rank reads no more than it holds, holds well under the whole model, and no rank opens the
    experts of another expert group."""
    for name in ("qwen3_moe", "llama"):
        path = models[name]
        full = sum(p.numel() for p in load_model(path).parameters())
        reads, locals_ = [], []
        for rank in range(4):
            stats = {}
            m = load_sharded(path, ShardLayout(rank, 4, 2 if name == "qwen3_moe" else 1), stats=stats)
            held = sum(p.numel() for p in m.parameters())
            assert stats["elements_read"] <= stats["local_elements"] == held
            assert held < 0.5 * full, (name, rank, held, full)
            reads.append(stats["elements_read"])
            locals_.append(held)
            if name == "qwen3_moe":
                layer = m.model.layers[1].mlp
                assert layer.experts.gate_proj.shape[0] == 4 and layer.ep.first == (rank // 2) * 4
                assert m.model.layers[1].self_attn.n_kv == 1          # 2 KV heads over 4 ranks
        # together the ranks read the model once, plus what every rank keeps a copy of (norms,
        # router, replicated KV heads)
        assert full <= sum(reads) < 2 * full
    # and the reads really are slices: no full-size sharded tensor is ever materialised
    from safetensors import safe_open
    seen = []
    real = safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *a):
            return self.f.__exit__(*a)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, k):
            seen.append(("whole", k))
            return self.f.get_tensor(k)

        def get_slice(self, k):
            seen.append(("slice", k))
            return self.f.get_slice(k)

    import nanodspark.loader as loader
    monkeypatch.setattr(loader, "safe_open", Spy)
    load_sharded(models["qwen3_moe"], ShardLayout(1, 2, 2))
    assert seen and all(kind == "slice" for kind, _ in seen)


def test_layout_refuses_a_split_that_does_not_divide(models):
    from nanodspark.config import ModelConfig
    cfg = ModelConfig.from_json(models["qwen3"])
    with pytest.raises(ValueError, match="num_attention_heads=4 is not a multiple of 3"):
        ShardLayout(0, 3).check(cfg)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        ShardLayout(0, 2, 2).check(cfg)


# ----------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def spec_dir(tmp_path_factory):
    """A tiny hybrid Qwen3-MoE target with a random drafter in `drafter/` (speculation on)."""
    out = tmp_path_factory.mktemp("tp_spec")
    make_hf_model("qwen3_moe", out, window=16, vocab_size=8192)
    d = random_drafter(load_model(out), gamma=3, num_layers=1, std=0.2)
    d.save(out / "drafter")
    return out


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 8192, (n,), generator=g).tolist() for n in (5, 23, 40)]


ENGINE = dict(use_tqdm=False, device="cpu", num_kv_blocks=64, max_num_seqs=4, dist_timeout_s=30)
# Where two GPUs are, the same tests run again over NCCL: one rank a GPU, decode steps replayed
# from CUDA graphs that capture the all-reduces (CUDA's defaults). float32 there too, so that the
# only difference from one process is the order of the all-reduced sums, as on the CPU.
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA GPUs"))]


@pytest.mark.parametrize("device", DEVICES)
def test_engine_tp2_with_speculation_equals_one_process_and_a_killed_worker_stops_it(spec_dir, device, monkeypatch):
    """One TP-2 engine (EP 2 for the MoE layers): greedy and seeded sampling equal one process,
    also with the overlapped loop, and every rank's step digest agrees; then a worker is killed mid-generation and the next
    step raises `WorkerLost`, promptly (gloo reports the closed connection; under NCCL rank 0's
    watch of its workers names the dead one). Rank 0 captures its graphs only once the workers
    serve, by telling them to capture too (a capture runs the step's collectives)."""
    from nanodspark.distributed import Parallel
    from nanodspark.worker import Worker
    ENGINE = dict(globals()["ENGINE"], device=device, dtype="float32")
    ref = LLM(str(spec_dir), **ENGINE)
    assert ref.engine.drafter is not None
    want = [o.token_ids for o in ref.generate(_prompts(), GREEDY)]
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=8)
    want_seeded = [o.token_ids for o in ref.generate(_prompts()[:2], seeded)]
    order = []
    for cls, name in ((Parallel, "ready"), (Parallel, "capture"), (Worker, "capture")):
        real = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, *a, _r=real, _n=f"{cls.__name__}.{name}", **k:
                            order.append(_n) or _r(self, *a, **k))
    llm = LLM(str(spec_dir), tensor_parallel_size=2, expert_parallel_size=2, **ENGINE)
    assert order == ["Parallel.ready", "Parallel.capture", "Worker.capture"], order
    eng = llm.engine
    par = eng.parallel
    try:
        assert par.world == 2 and eng.kv_cache.tensors["full"].shape[-2] == 1   # its own KV head (of 2)
        assert par.backend == ("nccl" if device == "cuda" else "gloo")
        eng.overlap = False                    # the plain loop first (CUDA's default is overlapped)
        assert [o.token_ids for o in llm.generate(_prompts(), GREEDY)] == want
        assert [o.token_ids for o in llm.generate(_prompts()[:2], seeded)] == want_seeded
        # the overlapped loop (CUDA's default; here forced on the CPU): launch n+1, then commit n
        eng.overlap = True
        assert [o.token_ids for o in llm.generate(_prompts()[1:], GREEDY)] == want[1:]
        # host-decided windows that differ per request and per step reach every rank (rank 0
        # decides, the plan carries them); verification stays lossless
        from nanodspark.windows import ForcedWindows
        eng.windows = ForcedWindows(eng.gamma, lambda reqs: [(r.num_output + i) % 4 for i, r in enumerate(reqs)])
        assert [o.token_ids for o in llm.generate(_prompts()[:2], GREEDY)] == want[:2]
        digests = par.digests()
        assert par.steps > 0 and len(set(digests)) == 1, digests
        if device == "cuda":   # the steps replayed graphs with NCCL's all-reduces inside
            assert eng.executor.graphs.use_graphs and eng.executor.graphs.graphs
            return             # a killed worker under NCCL: the serve.py test, in a process of its own
        # a worker dies mid-generation
        eng.add_request(_prompts()[1], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        eng.step()
        os.kill(par.procs[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerLost, match="tensor-parallel"):
            for _ in range(1000):
                eng.step()
        assert time.monotonic() - t0 < 20
    finally:
        llm.shutdown()
    assert all(not p.is_alive() for p in par.procs)


# ----------------------------------------------------------------------------- serve.py
@pytest.mark.parametrize("device", DEVICES)
def test_serve_py_tp2_serves_the_default_pair_and_stops_when_a_worker_dies(device):
    """`python serve.py --tensor-parallel-size 2` on the CPU (gloo) or two GPUs (NCCL): the
    default pair (target and drafter) answers with one process's greedy text; a worker killed
    while a stream is running makes the server exit with status 1 and the error, within a bound
    (under NCCL a step stuck in a collective with the dead peer waits out `--dist-timeout-s`)."""
    import re
    import socket
    import subprocess
    import sys
    from pathlib import Path

    import httpx
    root = Path(__file__).resolve().parents[1]
    prompt = "Once upon a time"
    one = LLM(use_tqdm=False, device=device, dtype="float32")
    want = one.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].text
    del one
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, str(root / "serve.py"), "--tensor-parallel-size", "2", "--device", device,
                          "--dtype", "float32", "--port", str(port), "--log-level", "warning", "--dist-timeout-s", "30"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines = []
    try:
        deadline = time.monotonic() + 150
        while not any(line.lstrip().startswith("curl ") for line in lines):
            line = p.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(lines)
            lines.append(line)
        banner = "".join(lines)
        assert f"2 {device} ranks (tensor parallel)" in banner, banner
        worker = int(re.search(r"rank 1 pid (\d+)", banner).group(1))
        base = f"http://127.0.0.1:{port}"
        r = httpx.post(base + "/v1/completions", timeout=60,
                       json={"model": "nanodspark-default", "prompt": prompt, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        # a worker dies while a long stream runs
        with httpx.stream("POST", base + "/v1/completions", timeout=60,
                          json={"model": "nanodspark-default", "prompt": prompt, "max_tokens": 2000,
                                "temperature": 0, "stream": True, "ignore_eos": True}) as stream:
            chunks = stream.iter_lines()
            next(c for c in chunks if c.startswith("data:"))
            os.kill(worker, signal.SIGKILL)
            rest = "".join(chunks)
        assert "engine stopped" in rest and "tensor-parallel worker" in rest, rest[-500:]
        assert p.wait(30 if device == "cpu" else 90) == 1
        out = banner + p.stdout.read()
        assert "error: the engine stopped: tensor-parallel worker" in out, out[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


# ----------------------------------------------------------------------------- the bench
def test_bench_tp_runs_on_the_cpu_and_reports_allreduce_time(tmp_path):
    """`python -m nanodspark.bench tp` at TP 2 (EP 2) on a tiny random MoE shape over gloo: rows
    for each batch with tok/s and the step's all-reduce count (2L + 1) and time."""
    import json
    from nanodspark.lab.bench import main
    out = tmp_path / "tp.json"
    assert main(["tp", "--shapes", "tiny", "--tp", "2", "--ep", "2", "--batches", "1", "3", "--steps", "2",
                 "--warmup", "1", "--context", "20", "--device", "cpu", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["random_weights"] is True and res["benchmark"] == "tp"
    assert res["device"].startswith("cpu: ") and res["torch"] and "argv" in res    # what ran it, on what
    rows = res["rows"]
    assert [(r["tp"], r["ep"], r["batch"]) for r in rows] == [(2, 2, 1), (2, 2, 3)]
    for r in rows:
        assert r["tok_s"] > 0 and r["allreduces_per_step"] == 2 * 2 + 1 and r["allreduce_ms_per_step"] > 0


def test_rank_0_stops_waiting_when_a_worker_dies_before_the_ranks_meet():
    """A worker that exits before the rendezvous (e.g. a script without a __main__ guard) ends
    rank 0's wait at once with a message that says why, instead of at the timeout; a
    rendezvous that completes returns its value, and its error is raised as it is."""
    import time
    from types import SimpleNamespace
    from nanodspark.distributed import meet_watching
    dead = SimpleNamespace(name="nanodspark-tp1", exitcode=1)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="__main__"):
        meet_watching([dead], lambda: time.sleep(30), poll_s=0.05)
    assert time.perf_counter() - t0 < 5
    alive = SimpleNamespace(name="nanodspark-tp1", exitcode=None)
    assert meet_watching([alive], lambda: "met", poll_s=0.05) == "met"
    with pytest.raises(ValueError, match="bad"):
        meet_watching([alive], lambda: (_ for _ in ()).throw(ValueError("bad")), poll_s=0.05)
