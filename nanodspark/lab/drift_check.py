"""Does sampled speculative output follow the target's law on the shipped default pair?

An engine-level check at the scale of a real vocabulary: N continuations of one prompt,
temperature 1 (or any SamplingParams), `max_tokens` new tokens, no per-request seeds unless
asked, `ignore_eos`, one engine per arm with up to `--batch` requests at once. Each output
position is tested against the target itself, not against a second sampled arm:

  position 0   exact law (one dense fp32 forward of the prompt);
  position 1   exact law (a dense fp32 forward of prompt + t for every token t of the vocabulary);
  position i   conditionally on the sample's own prefix: the expected count of token v is the sum
               over samples of P(v | prefix) (dense fp32 forwards of every observed prefix). A
               Pearson statistic of such counts is about as conservative as a multinomial one
               (a sum of non-identical categoricals has at most the multinomial variance).

Categories with expected count below 5 are pooled into one. `--cost-table steep` writes a
synthetic step-cost table T(bs, K) = 10 ms * (1 + slope * K / bs) so the cost scheduler trims
hard; `--engine KEY=VALUE` sets engine options (`cpu_overlap=1` runs the overlapped loop on the
CPU). The report also says which step produced each position (the prefill, or the request's
first, second, ... verify step). Run against another checkout with `PYTHONPATH=<checkout>
python nanodspark/lab/drift_check.py ...` from that checkout (absolute imports, for that).

    python -m nanodspark.lab.drift_check --mode cap-accept --n 4000 --cost-table steep
    python -m nanodspark.lab.drift_check ... --engine device=cuda --engine dtype=bfloat16   (the GPU path)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

STORY = "Once upon a time"


def steep_table(path: Path, gamma: int, model_name: str = "default", slope: float = 1.0,
                dtype: str = "float32", device: str = "cpu") -> Path:
    """T(bs, K) = 10 ms * (1 + slope * K / bs) on a grid of batch sizes and K = 0 .. bs * gamma,
    keyed for an engine of that dtype and device type (an engine reads only its own key)."""
    from nanodspark.cost_table import CostTable
    meas = {}
    for bs in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        for k in range(0, bs * gamma + 1, max(1, bs * gamma // 40)):
            meas[(bs, k)] = 0.01 * (1 + slope * k / bs)
        meas[(bs, bs * gamma)] = 0.01 * (1 + slope * gamma)
    CostTable(measurements=meas, model_name=model_name, dtype=str(getattr(torch, dtype)),
              device=torch.device(device).type).save(path)
    return path


class StepLog:
    """An engine observer: per decode step, per request, (step, count, window, verified, ceiling)."""

    def __init__(self):
        self.rows: dict[str, list] = {}

    def observe(self, result) -> None:
        if hasattr(result, "commits"):                 # a checkout with one Commit per request
            for c in result.commits:
                if c.verify is not None:
                    v = c.verify
                    self.rows.setdefault(c.request.request_id, []).append(
                        (result.step, c.advanced, v.window, v.verified, v.ceiling))
            return
        d = result.decode
        if d is None or not len(d.slots):
            return
        o = d.out
        for i, req in enumerate(d.requests):
            self.rows.setdefault(req.request_id, []).append(
                (result.step, int(o.count[i]), int(o.windows[i]), int(o.verified[i]), int(o.ceiling[i])))


def force_overlap(eng) -> None:
    """Run the overlapped loop (a one-step delay: step n+1 planned and launched before step n is
    committed) on the CPU, where the engine would choose the synchronous one. Before any request."""
    from nanodspark.scheduler import Scheduler
    from nanodspark.swa_replay import look_back
    old = eng.scheduler
    if hasattr(eng, "in_flight"):                      # the delay lives in LLMEngine.step
        eng.overlap = True
        eng.scheduler = Scheduler(eng.config, eng.model_config, old.managers, look_back(eng.gamma, 2), eng.batch)
    else:                                              # a checkout whose loops are in overlap_loop.py
        from nanodspark.overlap_loop import OverlapLoop
        eng.scheduler = Scheduler(eng.config, eng.model_config, old.managers, look_back(eng.gamma, 2))
        eng.loop = OverlapLoop(eng)


def chi2_pooled(counts: np.ndarray, expected: np.ndarray, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson statistic, degrees of freedom and p-value, small expected categories pooled."""
    big = expected >= min_expected
    c = list(counts[big]) + [counts[~big].sum()]
    e = list(expected[big]) + [expected[~big].sum()]
    c, e = np.array(c, dtype=np.float64), np.array(e, dtype=np.float64)
    keep = e > 0
    assert c[~keep].sum() == 0, "a token of probability 0 was sampled"
    c, e = c[keep], e[keep]
    stat = float(((c - e) ** 2 / e).sum())
    df = len(c) - 1
    return stat, df, chi2_sf(stat, df)


def chi2_sf(stat: float, df: int) -> float:
    """P(chi-square with df degrees of freedom > stat): the regularized upper incomplete gamma."""
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


class Target:
    """Dense fp32 next-token laws of the target under one SamplingParams."""

    def __init__(self, model_path, params):
        from nanodspark.loader import load_model
        self.model = load_model(model_path)
        self.params = params

    @torch.no_grad()
    def next_laws(self, seqs: list[list[int]], chunk: int = 512) -> torch.Tensor:
        """[len(seqs), V] float64: the law of the token after each sequence (all of one length)."""
        from nanodspark.model import DenseAttentionContext
        from nanodspark.sampling import target_probs
        out = []
        S = len(seqs[0])
        for i in range(0, len(seqs), chunk):
            block = torch.tensor(seqs[i:i + chunk])
            B = block.shape[0]
            pos = torch.arange(S).repeat(B)
            h = self.model(block.reshape(-1), pos, DenseAttentionContext(B, S)).hidden.view(B, S, -1)[:, -1]
            logits = self.model.compute_logits(h)
            out.append(target_probs(logits, [self.params] * B).double())
        return torch.cat(out)


def analyse(prompt_ids: list[int], tokens: np.ndarray, target: Target) -> list[dict]:
    """Per position: chi-square (pooled), df, p against the exact or prefix-conditional law."""
    N, n_pos = tokens.shape
    V = target.model.config.vocab_size
    res = []
    law0 = target.next_laws([prompt_ids])[0].numpy()
    res.append(dict(pos=0, kind="exact", **_test(tokens[:, 0], law0 * N, V)))
    if n_pos > 1:
        cond1 = target.next_laws([prompt_ids + [t] for t in range(V)]).numpy()     # [V, V]
        law1 = law0 @ cond1
        res.append(dict(pos=1, kind="exact", **_test(tokens[:, 1], law1 * N, V)))
        res.append(dict(pos=1, kind="cond", **_test(tokens[:, 1], cond1[tokens[:, 0]].sum(0), V)))
    for i in range(2, n_pos):
        laws = target.next_laws([prompt_ids + row[:i].tolist() for row in tokens]).numpy()
        res.append(dict(pos=i, kind="cond", **_test(tokens[:, i], laws.sum(0), V)))
    return res


def _test(col: np.ndarray, expected: np.ndarray, V: int) -> dict:
    counts = np.bincount(col, minlength=V).astype(np.float64)
    stat, df, p = chi2_pooled(counts, expected)
    return dict(chi2=round(stat, 1), df=df, p=p)


def run_arm(mode: str, n: int, batch: int, max_tokens: int, seed: int, table: str | None, prompt: str,
            sampling: dict, seeded: bool, drafter: str | None = None, engine: dict | None = None):
    from nanodspark import LLM, SamplingParams
    kw = dict(use_tqdm=False, dtype="float32", device="cpu", max_num_seqs=batch, seed=seed,
              max_num_batched_tokens=8192)
    if mode == "target":
        kw["drafter_path"] = "none"
    else:
        kw.update(verify_mode=mode, cost_table=table)
        if drafter:
            kw["drafter_path"] = drafter
    kw.update(engine or {})
    overlap = bool(kw.pop("cpu_overlap", 0))
    llm = LLM(None, **kw)
    if overlap:
        force_overlap(llm.engine)
    log = StepLog()
    if mode != "target":
        llm.engine.extra_observers.append(log)
    ids = llm.tokenizer.encode(prompt)
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=(seed * 1_000_003 + i) if seeded else None,
                             **sampling) for i in range(n)]
    t = time.time()
    outs = llm.generate([ids] * n, params)
    el = time.time() - t
    toks = np.array([o.token_ids for o in outs], dtype=np.int64)
    spec = dict(verified=sum(o.spec["verified"] for o in outs) if mode != "target" else 0,
                accepted=sum(o.spec["accepted"] for o in outs) if mode != "target" else 0,
                steps=sum(o.spec["steps"] for o in outs) if mode != "target" else 0)
    # where each output position came from: 0 = the prefill, k = the request's k-th verify step
    origin = np.zeros((n, max_tokens), dtype=np.int64)
    rids = [o.request_id for o in outs] if hasattr(outs[0], "request_id") else None
    if rids and log.rows:
        for j, rid in enumerate(rids):
            p = 1
            for k, (_, count, *_rest) in enumerate(log.rows.get(rid, []), start=1):
                origin[j, p:p + count] = k
                p += count
    return ids, toks, spec, el, origin, log


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="cap-accept", help="static | compact | cap-accept | target")
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="the engine seed (requests without one draw from it)")
    ap.add_argument("--seeded", action="store_true", help="per-request seeds")
    ap.add_argument("--cost-table", default="steep", help="steep (synthetic) | none | a JSON path")
    ap.add_argument("--prompt", default=STORY)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--slope", type=float, default=1.0, help="the steep table's slope (1: the issue's)")
    ap.add_argument("--engine", action="append", default=[], help="KEY=VALUE engine options (ints/floats parsed)")
    ap.add_argument("--json", default=None, help="write the result here")
    a = ap.parse_args(argv)
    from nanodspark import SamplingParams
    from nanodspark.loader import resolve_model_dir
    sampling = dict(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k)
    engine = {}
    for kv in a.engine:
        k, v = kv.split("=", 1)
        engine[k] = int(v) if v.lstrip("-").isdigit() else float(v) if v.replace(".", "", 1).isdigit() else v
    table = None
    if a.cost_table == "steep":
        table = str(steep_table(Path(tempfile.mkdtemp()) / "steep.json", 5, slope=a.slope,
                                dtype=engine.get("dtype", "float32"), device=engine.get("device", "cpu")))
    elif a.cost_table != "none":
        table = a.cost_table
    ids, toks, spec, el, origin, log = run_arm(a.mode, a.n, a.batch, a.max_tokens, a.seed, table, a.prompt,
                                              sampling, a.seeded, engine=engine)
    target = Target(resolve_model_dir(None), SamplingParams(**sampling))
    res = analyse(ids, toks, target)
    steps = spec["steps"]
    import nanodspark
    print(f"code {nanodspark.__file__}")
    print(f"mode={a.mode} n={a.n} batch={a.batch} seed={a.seed} seeded={a.seeded} table={a.cost_table} "
          f"slope={a.slope} engine={engine} prompt={a.prompt!r} {sampling} gen {el:.0f}s")
    if steps:
        print(f"  verified/step {spec['verified'] / steps:.3f}  accepted/verified "
              f"{spec['accepted'] / max(spec['verified'], 1):.3f}  steps/request {steps / a.n:.2f}")
        for i in range(a.max_tokens):
            u, c = np.unique(origin[:, i], return_counts=True)
            print(f"  position {i} from: " + ", ".join(f"{'prefill' if k == 0 else f'verify step {k}'} {v}"
                                                       for k, v in zip(u, c)))
    for r in res:
        print(f"  position {r['pos']} ({r['kind']}): chi2 {r['chi2']} on {r['df']} df, p = {r['p']:.3g}")
    if a.json:
        from .bench_engine import environment
        cmd = "python -m nanodspark.lab.drift_check " + " ".join(sys.argv[1:])
        Path(a.json).write_text(json.dumps(dict(command=cmd, environment=environment(), args=vars(a), spec=spec,
                                                results=res, seconds=el)))
    return res


if __name__ == "__main__":
    main()
