"""Continuous batching, chunked prefill, preemption, prefix caching, and bad input.

Every engine run is compared with a plain greedy loop over the dense (training) attention
path, which shares no code with the paged KV, the scheduler or the runner.
"""
import pytest
import torch

from nanodspark import LLM, SamplingParams
from nanodspark.request import Status
from nanodspark.model import DenseAttentionContext

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def dense_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    dev = model.lm_head.weight.device
    with torch.no_grad():
        for _ in range(n):
            S = len(ids)
            out = model(torch.tensor(ids, device=dev), torch.arange(S, device=dev), DenseAttentionContext(1, S))
            ids.append(int(model.compute_logits(out.hidden[-1:]).argmax()))
    return ids[len(prompt):]


def prompts(n, vocab, seed=0, lo=3, hi=60):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def drain(eng):
    """Step until the engine is idle. With the overlapped loop (CUDA's default) a step can still
    be in flight after the last request finished or was aborted; committing it streams nothing."""
    while eng.has_unfinished():
        assert list(eng.step()) == []


def check_no_leak(llm):
    for g, u in llm.engine.kv_usage().items():
        assert u["used"] == 0, (g, u)
    sched = llm.engine.scheduler
    for bm in sched.managers.values():
        bm.check_invariants([])


@pytest.fixture(scope="module")
def ref_llm(tiny_dir):
    return LLM(str(tiny_dir), use_tqdm=False)


def test_batch_equals_alone_and_dense(tiny_dir, ref_llm):
    ps = prompts(6, ref_llm.engine.model_config.vocab_size)
    together = [o.token_ids for o in ref_llm.generate(ps, GREEDY)]
    for p, t in zip(ps, together):
        assert t == dense_greedy(ref_llm.engine.model, p, GREEDY.max_tokens)
    alone = [ref_llm.generate([p], GREEDY)[0].token_ids for p in ps[:3]]
    assert alone == together[:3]
    check_no_leak(ref_llm)


def test_chunked_prefill_equals_unchunked(tiny_dir, ref_llm):
    ps = prompts(4, ref_llm.engine.model_config.vocab_size, seed=1, lo=40, hi=90)
    base = [o.token_ids for o in ref_llm.generate(ps, GREEDY)]
    chunked = LLM(str(tiny_dir), use_tqdm=False, max_num_batched_tokens=7, enable_prefix_cache=False)
    assert [o.token_ids for o in chunked.generate(ps, GREEDY)] == base
    check_no_leak(chunked)


def test_preemption_resumes_exactly(tiny_dir, ref_llm):
    ps = prompts(8, ref_llm.engine.model_config.vocab_size, seed=2, lo=20, hi=40)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = [o.token_ids for o in ref_llm.generate(ps, params)]
    # 16 blocks of 4 tokens cannot hold 8 requests of ~50 tokens: preemption must happen.
    small = LLM(str(tiny_dir), use_tqdm=False, num_kv_blocks=16, block_size=4)
    preempted = []
    orig = small.engine.scheduler.preempt
    small.engine.scheduler.preempt = lambda r: (preempted.append(r.request_id), orig(r))
    assert [o.token_ids for o in small.generate(ps, params)] == base
    assert preempted, "the test did not exercise preemption"
    check_no_leak(small)


def test_prefix_hit_equals_miss(tiny_dir):
    llm = LLM(str(tiny_dir), use_tqdm=False, block_size=4)
    vocab = llm.engine.model_config.vocab_size
    shared = prompts(1, vocab, seed=3, lo=70, hi=71)[0]
    a, b = shared + [1, 2, 3], shared + [4, 5]
    miss = LLM(str(tiny_dir), use_tqdm=False, block_size=4, enable_prefix_cache=False)
    expect = [o.token_ids for o in miss.generate([a, b], GREEDY)]
    first = llm.generate([a], GREEDY)[0].token_ids
    req = llm.engine.add_request(b, GREEDY)
    outs = []
    while req.status != Status.FINISHED:
        outs += llm.engine.step()
    assert req.tables == {} and first == expect[0]
    assert req.output_ids == expect[1]
    check_no_leak(llm)


def test_prefix_hit_reports_cached_tokens(tiny_dir):
    llm = LLM(str(tiny_dir), use_tqdm=False, block_size=4)
    p = list(range(10, 60))
    llm.generate([p], GREEDY)
    req = llm.engine.add_request(p + [7], GREEDY)
    llm.engine.step()
    assert req.tables["full"].num_cached_tokens == 48  # 50 shared tokens -> 12 full blocks


def test_generated_blocks_are_published_for_later_prompts(tiny_dir):
    """Blocks filled by *generated* tokens are published too (the engine commits a block once it
    is full), so a follow-up prompt that repeats prompt + output hits them."""
    llm = LLM(str(tiny_dir), use_tqdm=False, block_size=4)
    p = list(range(10, 31))                                   # 21 prompt tokens
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    req = llm.engine.add_request(p + out + [7], GREEDY)
    llm.engine.step()
    # 21 + 11 tokens had their K/V written (the last output token never is): 8 full blocks
    assert req.tables["full"].num_cached_tokens == 32


def _changed_after_construction(**bad) -> SamplingParams:
    p = SamplingParams()
    for k, v in bad.items():
        setattr(p, k, v)
    return p


def test_bad_input_is_rejected_and_engine_keeps_serving(tiny_dir, ref_llm):
    eng = ref_llm.engine
    vocab = eng.model_config.vocab_size
    good = eng.add_request([1, 2, 3], GREEDY)
    for prompt, params, msg in [
        ([], GREEDY, "empty"),
        ([vocab + 5], GREEDY, "out of range"),
        ([-1], GREEDY, "out of range"),
        ([1] * eng.max_model_len, GREEDY, "context limit"),
        ([1], _changed_after_construction(temperature=-1), "temperature"),   # construction refuses them
        ([1], _changed_after_construction(top_p=0), "top_p"),                # itself (test_llm_api.py);
        ([1], _changed_after_construction(max_tokens=0), "max_tokens"),      # the engine checks again
        ([1], _changed_after_construction(top_k=-2), "top_k"),
        ("text" if eng.tokenizer is None else 3.5, GREEDY, "tokenizer|prompt must be"),
    ]:
        with pytest.raises(ValueError, match=msg):
            eng.add_request(prompt, params)
    while good.status != Status.FINISHED:
        eng.step()
    assert len(good.output_ids) == GREEDY.max_tokens
    eng.release(good.request_id)
    check_no_leak(ref_llm)


def test_abort_frees_blocks(tiny_dir):
    llm = LLM(str(tiny_dir), use_tqdm=False)
    eng = llm.engine
    r1 = eng.add_request(list(range(1, 40)), SamplingParams(temperature=0, max_tokens=50))
    r2 = eng.add_request(list(range(2, 30)), SamplingParams(temperature=0, max_tokens=50))
    eng.step()
    eng.step()
    out = eng.abort(r1.request_id)
    assert out.finished and out.finish_reason == "abort" and r1.tables == {}
    eng.abort(r2.request_id)
    drain(eng)
    check_no_leak(llm)


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_dir, ref_llm):
    ps = prompts(3, ref_llm.engine.model_config.vocab_size, seed=5)
    sp = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=10, seed=123, ignore_eos=True)
    a = [o.token_ids for o in ref_llm.generate(ps, sp)]
    b = [ref_llm.generate([p], sp)[0].token_ids for p in ps]
    assert a == b
    unseeded = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    c = [o.token_ids for o in ref_llm.generate(ps, unseeded)]
    assert c != a  # the seed matters


def test_max_tokens_and_eos(tiny_dir, ref_llm):
    p = prompts(1, ref_llm.engine.model_config.vocab_size, seed=6)[0]
    out = ref_llm.generate([p], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    eos_tok = out.token_ids[2]
    eng = ref_llm.engine
    saved = eng.eos_ids
    eng.eos_ids = {eos_tok}
    try:
        o2 = ref_llm.generate([p], SamplingParams(temperature=0, max_tokens=5))[0]
    finally:
        eng.eos_ids = saved
    assert o2.finish_reason == "stop" and o2.token_ids == out.token_ids[:out.token_ids.index(eos_tok) + 1]


def test_triton_backend_equals_torch_backend(tiny_dir, ref_llm):
    """The engine with the Triton kernels (the interpreter on CPU, native on a GPU) generates
    the same greedy tokens as the reference attention path."""
    ps = prompts(3, ref_llm.engine.model_config.vocab_size, seed=9, lo=5, hi=40)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = [o.token_ids for o in ref_llm.generate(ps, params)]
    tri = LLM(str(tiny_dir), use_tqdm=False, attention_backend="triton", block_size=8)
    assert tri.engine.backend == "triton"
    assert [o.token_ids for o in tri.generate(ps, params)] == want
    check_no_leak(tri)


def test_stream_yields_the_same_tokens_and_abort_on_close_frees_blocks(tiny_dir, ref_llm):
    p = prompts(1, ref_llm.engine.model_config.vocab_size, seed=11)[0]
    want = ref_llm.generate([p], GREEDY)[0].token_ids
    outs = list(ref_llm.stream(p, GREEDY))
    assert [t for o in outs for t in o.new_token_ids] == want and outs[-1].finished
    it = ref_llm.stream(p, GREEDY)
    next(it)
    it.close()                      # the client went away: the request is aborted
    assert not ref_llm.engine.has_unfinished()      # nothing left in flight either (overlapped loop)
    check_no_leak(ref_llm)


def test_stop_strings_cut_the_text_and_finish(ref_llm):
    if ref_llm.tokenizer is None:
        pytest.skip("no tokenizer.json")
    prompt = "The quick brown fox"
    free = ref_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    out = ref_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == free.text[:free.text.index(stop)]
    assert len(out.token_ids) < len(free.token_ids)
    check_no_leak(ref_llm)


def test_incremental_detokenizer_equals_a_full_decode():
    """Streaming pieces decoded window by window add up to decode(all tokens), also when a
    token splits a multi-byte character; stop strings cut where a full-text search would."""
    import random
    from nanodspark.detokenizer import detokenize
    from nanodspark.request import Request
    from nanodspark.loader import Tokenizer, resolve_model_dir
    tok = Tokenizer(resolve_model_dir(None))
    rng = random.Random(0)
    text = "Tea ☕ and 日本語 café — naïve 🙂👍🏽 résumé.\n\nDone: ∑ x² ≥ 0.\n"
    cases = [tok.encode(text * 3)] + [[rng.randrange(13, 8192) for _ in range(60)] for _ in range(20)]
    for ids in cases:
        for stop in ([], ["\n\n"], ["x²"]):
            req = Request("r", [1], SamplingParams(stop=stop), 0, 10**6)
            pieces, i, hit = [], 0, False
            while i < len(ids) and not hit:
                n = rng.randint(1, 6)
                new, i = ids[i:i + n], min(len(ids), i + n)
                req.output_ids += new
                piece, hit = detokenize(tok, req, new, final=i == len(ids))
                assert "\ufffd" not in piece or i == len(ids) or tok.decode(ids[:i]).count("\ufffd")
                pieces.append(piece)
            full = tok.decode(ids)
            cut = min([full.find(s) for s in stop if s in full], default=-1)
            want = full[:cut] if cut >= 0 else full
            assert "".join(pieces) == want and req.text == want and hit == (cut >= 0)


def test_request_id_slices_match_all_ids():
    from nanodspark.request import Request
    r = Request("r", [5, 6, 7], SamplingParams(), 0, 10**6, output_ids=[8, 9])
    for a in range(7):
        for b in range(a, 8):
            assert r.ids(a, b) == r.all_ids[a:b]
    assert r.last_id == 9 and Request("q", [4], SamplingParams(), 0, 10**6).last_id == 4


def test_scheduler_knobs_live_in_engine_config():
    from nanodspark.config import EngineConfig
    from nanodspark import cost_scheduler as cs
    cfg = EngineConfig()
    assert (cfg.verify_min_gain, cfg.verify_lag) == (cs.DEFAULT_MIN_GAIN, cs.DEFAULT_LAG)
    for bad in ({"verify_min_gain": -0.1}, {"verify_lag": 0}):
        with pytest.raises(ValueError):
            EngineConfig(**bad)


def test_detokenizer_hold_is_bounded_for_invalid_utf8():
    """A stream that never completes a character cannot make the decode window grow for ever."""
    from nanodspark.detokenizer import DETOKENIZE_MAX_HOLD, detokenize
    from nanodspark.request import Request
    from nanodspark.loader import Tokenizer, resolve_model_dir
    tok = Tokenizer(resolve_model_dir(None))
    lead = next(i for i in range(13, 8192) if tok.decode([i]) == "\ufffd")   # e.g. a lone lead byte
    req = Request("r", [1], SamplingParams(), 0, 10**6)
    widest = 0
    for _ in range(3 * DETOKENIZE_MAX_HOLD):
        req.output_ids.append(lead)
        detokenize(tok, req, [lead], final=False)
        widest = max(widest, len(req.output_ids) - req.detok_prefix)
    assert req.detok_read > 0 and widest <= 2 * DETOKENIZE_MAX_HOLD + 2


def test_runner_refuses_rows_past_a_tables_reservation(ref_llm):
    """A step that computes a row without a reserved slot would write K/V into a block another
    request may own; the runner stops it with the positions in the message, before any work."""
    from nanodspark.runner import Chunk
    runner = ref_llm.engine.runner
    with pytest.raises(AssertionError, match="positions up to 7 on a table reserved for 6"):
        runner.prefill([Chunk(slot=0, start=5, token_ids=[1, 2, 3], reserved=6)])  # inside block 1, not reserved


@pytest.mark.parametrize("drafted", [False, True])
def test_a_poisoned_request_fails_alone(tiny_dir, tmp_path, drafted):
    """A request whose numbers break (here: its prompt holds a token whose embedding is NaN) is
    finished with reason "error"; every other request of the batch completes with the same tokens
    as without it, and nothing leaks. Fails on an engine that samples from NaN logits."""
    kw = dict(use_tqdm=False)
    if drafted:
        from test_verify import make_drafter
        kw["drafter_path"] = str(make_drafter(tiny_dir, tmp_path / "d"))
    bad_token = 7
    good = [p for p in prompts(5, 8192, seed=21, lo=5, hi=30) if bad_token not in p]
    want = [o.token_ids for o in LLM(str(tiny_dir), **kw).generate(good, GREEDY)]
    llm = LLM(str(tiny_dir), **kw)
    with torch.no_grad():
        llm.engine.model.model.embed_tokens.weight[bad_token] = float("nan")
    eng = llm.engine
    reqs = [eng.add_request(p, GREEDY) for p in good[:2]]
    poisoned = eng.add_request([3, 4, bad_token, 5], GREEDY)
    reqs += [eng.add_request(p, GREEDY) for p in good[2:]]
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert poisoned.finish_reason == "error" and poisoned.error
    assert any(o.request_id == poisoned.request_id and o.error for o in outs)
    assert [r.output_ids for r in reqs] == want
    check_no_leak(llm)


def test_token_budget_auto_is_8192_on_cuda_and_2048_on_cpu(tiny_dir):
    """0 (the default) resolves by device: on a GPU an eager prefill chunk costs its launches at
    any size, on a CPU its FLOPs. An explicit budget is kept, and a negative one is refused."""
    from nanodspark.config import EngineConfig
    from nanodspark.engine import auto_token_budget
    assert auto_token_budget(torch.device("cuda")) == 8192 and auto_token_budget(torch.device("cpu")) == 2048
    assert EngineConfig().max_num_batched_tokens == 0
    llm = LLM(str(tiny_dir), use_tqdm=False, drafter_path="none", device="cpu", kv_cache_memory_gb=0.01)
    assert llm.engine.config.max_num_batched_tokens == 2048 == llm.engine.scheduler.cfg.max_num_batched_tokens
    assert LLM(str(tiny_dir), use_tqdm=False, drafter_path="none", device="cpu", kv_cache_memory_gb=0.01,
               max_num_batched_tokens=7).engine.config.max_num_batched_tokens == 7
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=-1)


@pytest.mark.parametrize("drafted", [False, True])
def test_admission_waits_in_waves_and_changes_no_token(tiny_dir, ref_llm, tmp_path, drafted):
    """With `max_waiting_steps`, an arrival while others decode waits (at most that many steps,
    or until the queue holds `waiting_served_ratio` of the decoding requests, or a prefill runs
    anyway) so that one prefill serves several arrivals. The tokens are those of admitting at once.
    Fails if the wait is unbounded, counts wrongly, or holds back an arrival to an idle engine."""
    from nanodspark.scheduler import admission_due
    assert admission_due(1, 0, False, 0, 8, 0.25)            # nothing decodes: at once
    assert admission_due(1, 8, True, 0, 8, 0.25)             # a prefill runs anyway: ride along
    assert admission_due(2, 8, False, 0, 8, 0.25)            # the queue holds a quarter of the batch
    assert not admission_due(1, 8, False, 7, 8, 0.25) and admission_due(1, 8, False, 8, 8, 0.25)
    assert admission_due(1, 8, False, 0, 0, 0.25) and not admission_due(0, 0, False, 0, 8, 0.25)
    ps = prompts(4, ref_llm.engine.model_config.vocab_size, seed=5, lo=5, hi=20)
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = [ref_llm.generate([p], long)[0].token_ids for p in ps]
    kw = dict(use_tqdm=False, max_waiting_steps=3, waiting_served_ratio=1.0)
    if drafted:                     # verify windows, and reservations for them, in the same waves
        from test_verify import make_drafter
        kw["drafter_path"] = str(make_drafter(tiny_dir, tmp_path / "d"))
    llm = LLM(str(tiny_dir), **kw)
    eng = llm.engine
    first = [eng.add_request(p, long) for p in ps[:2]]       # an idle engine admits at once
    eng.step()
    assert all(r.status is Status.RUNNING for r in first)
    while not all(r.is_decoding for r in first):
        eng.step()
    late = eng.add_request(ps[2], long)
    held = 0
    while late.status is Status.WAITING:
        eng.step()
        held += 1
    assert held == 4        # three schedules held back, admitted by the fourth
    last = eng.add_request(ps[3], long)
    while eng.has_unfinished():
        eng.step()
    assert [r.output_ids for r in first + [late, last]] == want
    check_no_leak(llm)
    with pytest.raises(ValueError, match="max_waiting_steps"):
        LLM(str(tiny_dir), use_tqdm=False, max_waiting_steps=-1)
