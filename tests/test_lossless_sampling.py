"""Sampled speculative output follows the target's distribution, through the engine, in every
verify mode and whatever clamps the window.

Two tiny targets (2 layers) with random drafters. Positions 1-3 of a continuation have an exact
law, computed with dense fp32 forwards over every prefix and `sampling.target_probs` (the one
rule of temperature, top-k and top-p). The engine generates N continuations of one prompt per
configuration: verify mode x what clamps the window --

  none    long outputs, full windows: nothing clamps;
  limit   max_tokens = 3: the length limit clamps the first verify step to one draft;
  cap     windows forced per request (from its id, never from its drafts): in compact the target
          verifies fewer drafts, in cap-accept it verifies all and commits at most the window;
  budget  a steep step-cost table: the cost scheduler's budget trims (compact, cap-accept).
  lagged  (its own test) each window sized from the drafts of the request's previous step, as
          the cost scheduler sizes its budget from confidences `lag` steps old: lossless only
          because a draft proposed again at a position gets fresh noise. With the speculative
          noise keyed by position alone (the rule before that fix) the third position fails at
          p < 1e-12; the test checks both, so it can tell the two rules apart.

* T = 1 (fast): a 4-token vocabulary, logits scaled so that the target's laws are far from the
  drafter's (rejections and residuals happen often); engine seeds.
* T = 0.8, top_p = 0.9, top_k = 40 (slow), engine seeds and per-request seeds: a 64-token
  vocabulary, so that top-k really cuts (the 40 kept tokens hold about three quarters of the
  tempered mass) and top-p then cuts again (about 35 tokens survive). A sampled token outside
  the kept set fails at once.

Power. Each position is a Pearson chi-square against its exact law at 1 % false alarms, with
d = (tokens of nonzero probability) - 1 degrees of freedom. A law at total variation 0.02 from
the exact one has chi-square divergence at least 4 * 0.02^2 = 0.0016 (Cauchy-Schwarz), so with N
draws the statistic's noncentrality is at least 0.0016 N. Power 0.9 needs a noncentrality of
19.2 at d = 3 (critical value 11.34) and 51.8 at d = 63 (critical value 92.0; scipy: ncx2), hence
N = 12,030 draws per configuration for the 4-token vocabulary and 32,359 for the 64-token one
(position 1 keeps at most 40 tokens, but positions 2 and 3 mix many prefixes' kept sets, so up
to all 64 have probability; fewer degrees of freedom only raise the power). The seeds are fixed:
the suite is deterministic.
"""
import zlib

import numpy as np
import pytest
import torch

from nanodspark import LLM, SamplingParams
from nanodspark import sampling as sampling_module
from nanodspark.step import WindowPlan
from nanodspark.windows import ForcedWindows, WindowPolicy
from nanodspark.cost_table import CostTable
from nanodspark.loader import load_model
from nanodspark.model import DenseAttentionContext
from nanodspark.sampling import target_probs
from nanodspark.lab.drift_check import chi2_pooled, chi2_sf

from conftest import EXACT, make_hf_model, random_drafter

GAMMA, PROMPT = 3, [1, 3, 0, 2]
ALPHA = 0.01                 # false alarms per position
MODES = ["static", "compact", "cap-accept"]
CLAMPS = ["none", "limit", "cap", "budget"]
T1 = dict(temperature=1.0)
TRUNCATED = dict(temperature=0.8, top_p=0.9, top_k=40)
# vocabulary, final-norm scale (peakedness), draws per configuration (the power calculation above)
NARROW = dict(vocab=4, norm=40.0, n=12_030)
WIDE = dict(vocab=64, norm=8.0, n=32_359)


def build_pair(root, vocab: int, norm: float):
    """A tiny target (checkpoint on disk, its final norm scaled) and a random drafter for it."""
    from safetensors.torch import load_file, save_file
    make_hf_model("qwen3", root / "m", vocab_size=vocab, num_hidden_layers=2, seed=3)
    f = next((root / "m").glob("*.safetensors"))
    sd = load_file(f)
    sd["model.norm.weight"] *= norm          # sharper laws: rejections and residuals happen often
    save_file(sd, f, metadata={"format": "pt"})
    target = load_model(root / "m")
    random_drafter(target, gamma=GAMMA, num_layers=1, std=0.3, seed=4, mask_token_id=0).save(root / "d")
    meas = {(bs, k): 1e-3 * (1 + bs) * (1.0 + 0.5 * (k > 1.5 * bs)) + 1e-6 * k for bs in (1, 8, 64, 512, 1024)
            for k in sorted({round(GAMMA * bs * i / 12) for i in range(13)})}
    CostTable(measurements=meas, model_name=str(root / "m"), dtype=str(torch.float32), device="cpu").save(root / "c.json")
    return root, target


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("lossless"), NARROW["vocab"], NARROW["norm"])


@pytest.fixture(scope="module")
def wide_pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("lossless_wide"), WIDE["vocab"], WIDE["norm"])


@torch.no_grad()
def exact_laws(target, params: SamplingParams, n: int = 3) -> torch.Tensor:
    """[n, V]: the law of each of the first n continuation tokens under `params`: one dense fp32
    forward per position over every prefix, weighted by the prefix's probability."""
    V = target.config.vocab_size
    prefixes, weight, laws = torch.tensor([PROMPT]), torch.ones(1, dtype=torch.float64), []
    for i in range(n):
        B, L = prefixes.shape
        out = target(prefixes.reshape(-1), torch.arange(L).repeat(B), DenseAttentionContext(B, L))
        logits = target.compute_logits(out.hidden.view(B, L, -1)[:, -1])
        joint = weight[:, None] * target_probs(logits, [params] * B).double()     # [B, V]
        laws.append(joint.sum(0))
        if i + 1 < n:
            keep = joint.reshape(-1) > 0                                            # prune what top-k/p cut
            prefixes = torch.cat([prefixes.repeat_interleave(V, 0), torch.arange(V).repeat(B)[:, None]], 1)[keep]
            weight = joint.reshape(-1)[keep]
    return torch.stack(laws)


def chi2_p(tokens: list[int], law: torch.Tensor) -> tuple[float, float]:
    """Pearson statistic and p-value of `tokens` against `law` (the chi-square tail, as the
    regularized upper incomplete gamma function, `drift_check.chi2_sf`)."""
    counts = torch.bincount(torch.tensor(tokens), minlength=law.shape[0]).double()
    expected = law * len(tokens)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was sampled"
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, chi2_sf(stat, int(keep.sum()) - 1)


def forced_window(req) -> int:
    """A window per request from its id alone (never from its drafts): 0 .. gamma."""
    return zlib.crc32(req.request_id.encode()) % (GAMMA + 1)


def generate(root, mode: str, clamp: str, sampling: dict, seeded: bool, n: int, seed: int = 7):
    table = str(root / "c.json") if clamp == "budget" else None
    llm = LLM(str(root / "m"), use_tqdm=False, **EXACT, drafter_path=str(root / "d"), max_num_seqs=1024,
              max_num_batched_tokens=8192, seed=seed, verify_mode=mode, cost_table=table)
    eng = llm.engine
    if clamp == "cap":
        eng.windows = ForcedWindows(eng.gamma, lambda reqs: [forced_window(r) for r in reqs])
    max_tokens = 3 if clamp == "limit" else 8
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=(i if seeded else None), **sampling)
              for i in range(n)]
    outs = llm.generate([PROMPT] * n, params)
    return llm, outs


@pytest.mark.parametrize("clamp", CLAMPS)
@pytest.mark.parametrize("mode", MODES)
def test_positions_follow_the_target_law(pair, mode, clamp):
    check(pair, mode, clamp, T1, seeded=False, n=NARROW["n"])


@pytest.mark.slow
@pytest.mark.parametrize("seeded", [False, True], ids=["engine-seeds", "request-seeds"])
@pytest.mark.parametrize("clamp", CLAMPS)
@pytest.mark.parametrize("mode", MODES)
def test_positions_follow_the_truncated_law(wide_pair, mode, clamp, seeded):
    check(wide_pair, mode, clamp, TRUNCATED, seeded, n=WIDE["n"])


def test_the_wide_pair_truncates_twice(wide_pair):
    """top-k = 40 and top-p = 0.9 each change the wide target's laws (so the slow suite tests both)."""
    _, target = wide_pair
    laws = exact_laws(target, SamplingParams(**TRUNCATED))
    no_k = exact_laws(target, SamplingParams(**{**TRUNCATED, "top_k": 0}))
    no_p = exact_laws(target, SamplingParams(**{**TRUNCATED, "top_p": 1.0}))
    support = int((laws[0] > 0).sum())           # position 1: one prefix, one kept set
    assert 30 <= support < 40, support
    assert (laws - no_k).abs().sum(1).min() > 0.02 and (laws - no_p).abs().sum(1).min() > 0.02
    assert torch.allclose(laws.sum(1), torch.ones(3, dtype=torch.float64))


def check(pair, mode, clamp, sampling: dict, seeded: bool, n: int):
    root, target = pair
    laws = exact_laws(target, SamplingParams(**sampling))
    llm, outs = generate(root, mode, clamp, sampling, seeded, n)
    tests = [chi2_p([o.token_ids[i] for o in outs], laws[i]) for i in range(3)]
    assert all(p > ALPHA for _, p in tests), (mode, clamp, sampling, [(round(s, 1), round(p, 4)) for s, p in tests])
    verified = sum(o.spec["verified"] for o in outs)
    accepted = sum(o.spec["accepted"] for o in outs)
    assert verified > 0 and 0.05 < accepted / verified < 0.95      # drafts were judged, both ways
    if mode != "static" and clamp in ("cap", "budget"):             # the clamp really clamped
        assert verified < GAMMA * sum(o.spec["steps"] for o in outs) * 0.9


class LaggedWindows(WindowPolicy):
    """A window per request from the drafts of its previous step (lag 1): the full block when the
    old draft at the position this step proposes first was token `x`, none otherwise. Nothing here
    reads the drafts of the step it plans -- but if an old draft and the new one at that position
    share their noise, the window depends on the new draft all the same."""

    def __init__(self, gamma: int, x: int = 0):
        self.gamma, self.x, self.prev = gamma, x, {}

    def observe(self, result) -> None:
        d = result.decode
        if d is not None:
            for i, slot in enumerate(d.slots):
                self.prev[int(slot)] = (int(d.generations[i]), d.out.drafts[i].copy(), int(d.out.count[i]))

    def plan(self, rows, step: int) -> WindowPlan:
        caps = []
        for slot, gen in zip(rows.slots, rows.generations):
            old = self.prev.get(int(slot))       # (generation, drafts, committed) of its last step
            first = old[1][old[2]] if old and old[0] == int(gen) and old[2] < self.gamma else -1
            caps.append(self.gamma if first == self.x else 0)
        return WindowPlan(len(rows.slots) * self.gamma, False, np.asarray(caps, dtype=np.int64))


@pytest.mark.parametrize("keyed", ["anchor", "position"])
@pytest.mark.parametrize("mode", ["compact", "cap-accept"])
def test_a_window_sized_from_old_drafts_keeps_the_law(pair, monkeypatch, mode, keyed):
    """Fresh noise per attempt is what keeps a lagged window lossless (verify.py): keyed by the
    anchor too, every position follows its law; keyed by position alone, the window admits the
    new draft by looking at the old one, and position 3 drifts far past any false alarm."""
    if keyed == "position":
        keyed_by_position = sampling_module.noise_key
        monkeypatch.setattr(sampling_module, "noise_key",
                            lambda seed, position, stream, attempt=None: keyed_by_position(seed, position, stream))
    root, target = pair
    laws = exact_laws(target, SamplingParams(**T1))
    # synchronous steps: the policy peeks at the step just before (lag 1); in the overlapped loop
    # (CUDA's default) it would see the step before that, whose drafts sit at other positions
    llm = LLM(str(root / "m"), use_tqdm=False, **EXACT, drafter_path=str(root / "d"), max_num_seqs=1024,
              max_num_batched_tokens=8192, seed=7, verify_mode=mode, overlap=False)
    llm.engine.windows = LaggedWindows(llm.engine.gamma)
    n = NARROW["n"]
    outs = llm.generate([PROMPT] * n, [SamplingParams(max_tokens=8, ignore_eos=True, **T1) for _ in range(n)])
    tests = [chi2_p([o.token_ids[i] for o in outs], laws[i]) for i in range(3)]
    shown = [(round(s, 1), float(f"{p:.3g}")) for s, p in tests]
    assert tests[0][1] > ALPHA and tests[1][1] > ALPHA, shown      # position 1-2: no earlier step to peek at
    if keyed == "anchor":
        assert tests[2][1] > ALPHA, shown
    else:
        assert tests[2][1] < 1e-6, shown
    windows = np.asarray([o.spec["verified"] for o in outs])
    assert 0 < windows.mean() < GAMMA * 2                             # the lagged policy opened some windows, not all


def test_the_chi_square_tail_and_pooling_of_the_drift_check():
    """The tail is the chi-square's (critical value 11.34 at 3 degrees of freedom is the 1 % point);
    pooled counts drawn from their own law pass, counts drawn from a law 0.05 away in total
    variation fail, and a sampled token of probability 0 is an error, not a pooled count."""
    assert chi2_sf(11.345, 3) == pytest.approx(0.01, abs=2e-4) and chi2_sf(0.0, 0) == 1.0
    g = torch.Generator().manual_seed(0)
    law = torch.tensor([0.4, 0.3, 0.2, 0.05, 0.03, 0.02, 0.0]).double()
    shifted = law + torch.tensor([-0.05, 0.05, 0, 0, 0, 0, 0]).double()
    n = 20000
    own = torch.bincount(torch.multinomial(law, n, True, generator=g), minlength=7).numpy()
    other = torch.bincount(torch.multinomial(shifted, n, True, generator=g), minlength=7).numpy()
    assert chi2_pooled(own, (law * n).numpy())[2] > 0.001
    assert chi2_pooled(other, (law * n).numpy())[2] < 1e-6
    with pytest.raises(AssertionError, match="probability 0"):
        chi2_pooled(own + (torch.arange(7) == 6).numpy(), (law * n).numpy())
