"""SWA bounded replay: after a prefix hit on a hybrid model, exact replay equals a cold prefill,
a shorter (bounded) replay is an approximation, and replay never writes into shared blocks."""
import torch

from nanodspark import LLM, SamplingParams
from nanodspark.swa_replay import exact_replay_tokens, plan_replay

WINDOW = 16  # the tiny_dir fixture: 2 full + 2 sliding layers, window 16


def test_plan_replay():
    assert plan_replay(0, 128, 3) == plan_replay(0, 128, 3, 140)
    assert plan_replay(0, 128, 3).start == 0
    assert plan_replay(64, 128, 0).start == 64                       # no sliding layers: no replay
    assert exact_replay_tokens(128, 3) == 381
    assert plan_replay(1024, 128, 3) == type(plan_replay(0, 1, 1))(1024 - 381, 1024)
    assert plan_replay(1024, 128, 3, keep_tokens=140).start == 884  # DeepSeek-V4.1's 140 = 128 + 12
    assert plan_replay(100, 128, 3, keep_tokens=140).start == 0


def first_logits(llm, prompt):
    """Logits of the first sampled position (captured from the model's logits head)."""
    eng = llm.engine
    seen = []
    orig = eng.model.compute_logits

    def spy(hidden, ops=None):
        res = orig(hidden, ops)
        seen.append(res.clone())
        return res
    eng.model.compute_logits = spy
    req = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    while eng.has_unfinished():
        eng.step()
    del eng.model.compute_logits
    eng.release(req.request_id)
    return seen[-1][-1], req


def test_exact_replay_equals_cold_prefill_and_bounded_replay_drifts(tiny_dir):
    torch.manual_seed(0)
    shared = torch.randint(0, 300, (96,)).tolist()
    prompt = shared + [5, 6, 7]
    cold = LLM(str(tiny_dir), use_tqdm=False, block_size=4, enable_prefix_cache=False)
    want, _ = first_logits(cold, prompt)

    exact = LLM(str(tiny_dir), use_tqdm=False, block_size=4)
    exact.generate([shared + [1]], SamplingParams(temperature=0, max_tokens=1))
    full = exact.engine.kv_cache.tensors["full"].clone()
    cached_before = sorted(exact.engine.scheduler.managers["full"].cache.values())
    got, req = first_logits(exact, prompt)
    assert req.replay_until == 96 and req.kv_start == 96 - exact_replay_tokens(WINDOW, 2)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # replay rows stored nothing into the (shared, prefix-cached) full-attention blocks
    cached = torch.tensor(sorted(exact.engine.scheduler.managers["full"].cache.values()))
    assert len(cached) == 24 and cached.tolist() == cached_before
    assert torch.equal(exact.engine.kv_cache.tensors["full"][:, :, cached], full[:, :, cached])

    bounded = LLM(str(tiny_dir), use_tqdm=False, block_size=4, swa_replay_tokens=WINDOW + 2)
    bounded.generate([shared + [1]], SamplingParams(temperature=0, max_tokens=1))
    approx, req = first_logits(bounded, prompt)
    assert req.kv_start == 96 - (WINDOW + 2)
    drift = (approx - want).abs().max().item()
    assert drift > 1e-4, "a replay shorter than N*(W-1) should not be exact with 2 stacked sliding layers"
