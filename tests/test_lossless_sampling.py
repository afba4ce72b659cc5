"""Sampled speculative output follows the target's distribution, through the engine, in every
verify mode and whatever clamps the window.

The target is tiny (2 layers, a 4-token vocabulary, its logits scaled so that its laws are far
from the drafter's), so positions 1-3 of a continuation have an exact law computed by
enumerating every continuation with a dense fp32 forward and `sampling.target_probs` (the one
rule of temperature, top-k and top-p). The engine generates N continuations of one prompt per
configuration: verify mode x what clamps the window --

  none    long outputs, full windows: nothing clamps;
  limit   max_tokens = 3: the length limit clamps the first verify step to one draft;
  cap     windows forced per request (from its id, never from its drafts): in compact the target
          verifies fewer drafts, in cap-accept it verifies all and commits at most the window;
  budget  a steep step-cost table: the cost scheduler's budget trims (compact, cap-accept).

Power. Each position is a Pearson chi-square with 3 degrees of freedom against its exact law
at 1 % false alarms (critical value 11.34). A law at total variation 0.02 from the exact one
has chi-square divergence at least 4 * 0.02^2 (Cauchy-Schwarz), so with N draws the
statistic's noncentrality is at least 0.0016 N; power 0.9 needs a noncentrality of 19.2 (scipy:
ncx2), hence N = 12,030 draws per configuration. The seeds are fixed: the suite is deterministic.

"""
import itertools
import zlib

import pytest
import torch

from nanodspark import LLM, SamplingParams
from nanodspark.windows import ForcedWindows
from nanodspark.cost_table import CostTable
from nanodspark.loader import load_model
from nanodspark.model import DenseAttentionContext
from nanodspark.sampling import target_probs

from conftest import EXACT, make_hf_model, random_drafter

V, GAMMA, PROMPT = 4, 3, [1, 3, 0, 2]
N = 12_030                   # draws per configuration (the power calculation above)
CRITICAL = 11.34             # chi-square, 3 degrees of freedom, P(> 11.34) = 0.01
MODES = ["static", "compact", "cap-accept"]
CLAMPS = ["none", "limit", "cap", "budget"]
SAMPLINGS = {"T1": dict(temperature=1.0), "T0.8-p0.9-k40": dict(temperature=0.8, top_p=0.9, top_k=40)}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target with peaked laws and a random drafter for it (checkpoints on disk)."""
    from safetensors.torch import load_file, save_file
    root = tmp_path_factory.mktemp("lossless")
    make_hf_model("qwen3", root / "m", vocab_size=V, num_hidden_layers=2, seed=3)
    f = next((root / "m").glob("*.safetensors"))
    sd = load_file(f)
    sd["model.norm.weight"] *= 40            # sharper laws: rejections and residuals happen often
    save_file(sd, f, metadata={"format": "pt"})
    target = load_model(root / "m")
    random_drafter(target, gamma=GAMMA, num_layers=1, std=0.3, seed=4, mask_token_id=0).save(root / "d")
    meas = {(bs, k): 1e-3 * (1 + bs) * (1.0 + 0.5 * (k > 1.5 * bs)) + 1e-6 * k for bs in (1, 8, 64, 512, 1024)
            for k in sorted({round(GAMMA * bs * i / 12) for i in range(13)})}
    CostTable(measurements=meas, model_name=str(root / "m"), dtype=str(torch.float32), device="cpu").save(root / "c.json")
    return root, target


def exact_laws(target, params: SamplingParams, n: int = 3) -> torch.Tensor:
    """[n, V]: the law of each of the first n continuation tokens under `params`, by enumeration."""
    laws = torch.zeros(n, V, dtype=torch.float64)
    with torch.no_grad():
        for seq in itertools.product(range(V), repeat=n):
            ids = PROMPT + list(seq)
            out = target(torch.tensor(ids), torch.arange(len(ids)), DenseAttentionContext(1, len(ids)))
            logits = target.compute_logits(out.hidden)[len(PROMPT) - 1:len(ids) - 1]
            probs = target_probs(logits, [params] * n).double()
            p = probs[torch.arange(n), torch.tensor(seq)].prod()
            for i, t in enumerate(seq):
                laws[i, t] += p
    return laws


def chi2(tokens: list[int], law: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    expected = law * len(tokens)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was sampled"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def forced_window(req) -> int:
    """A window per request from its id alone (never from its drafts): 0 .. gamma."""
    return zlib.crc32(req.request_id.encode()) % (GAMMA + 1)


def generate(root, mode: str, clamp: str, sampling: dict, seeded: bool, seed: int = 7):
    table = str(root / "c.json") if clamp == "budget" else None
    llm = LLM(str(root / "m"), use_tqdm=False, **EXACT, drafter_path=str(root / "d"), max_num_seqs=1024,
              max_num_batched_tokens=8192, seed=seed, verify_mode=mode, cost_table=table)
    eng = llm.engine
    if clamp == "cap":
        eng.windows = ForcedWindows(eng.gamma, lambda reqs: [forced_window(r) for r in reqs])
    max_tokens = 3 if clamp == "limit" else 8
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=(i if seeded else None), **sampling)
              for i in range(N)]
    outs = llm.generate([PROMPT] * N, params)
    return llm, outs


@pytest.mark.parametrize("clamp", CLAMPS)
@pytest.mark.parametrize("mode", MODES)
def test_positions_follow_the_target_law(pair, mode, clamp):
    check(pair, mode, clamp, "T1", seeded=False)


@pytest.mark.slow
@pytest.mark.parametrize("seeded", [False, True], ids=["engine-seeds", "request-seeds"])
@pytest.mark.parametrize("clamp", CLAMPS)
@pytest.mark.parametrize("mode", MODES)
def test_positions_follow_the_truncated_law(pair, mode, clamp, seeded):
    check(pair, mode, clamp, "T0.8-p0.9-k40", seeded)


def check(pair, mode, clamp, sampling, seeded):
    root, target = pair
    params = SamplingParams(**SAMPLINGS[sampling])
    laws = exact_laws(target, params)
    llm, outs = generate(root, mode, clamp, SAMPLINGS[sampling], seeded)
    stats = [chi2([o.token_ids[i] for o in outs], laws[i]) for i in range(3)]
    assert all(s < CRITICAL for s in stats), (mode, clamp, sampling, [round(s, 1) for s in stats])
    verified = sum(o.spec["verified"] for o in outs)
    accepted = sum(o.spec["accepted"] for o in outs)
    assert verified > 0 and 0.05 < accepted / verified < 0.95      # drafts were judged, both ways
    if mode != "static" and clamp in ("cap", "budget"):             # the clamp really clamped
        assert verified < GAMMA * sum(o.spec["steps"] for o in outs) * 0.9
