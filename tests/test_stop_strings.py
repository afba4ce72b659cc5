"""Stop strings end a request at the token that completes them: in the text, in `token_ids`, in
usage and in the stream, the same with a drafter (a verify step commits several tokens at once)
as without one. Target-only decoding (one token per step) is the reference; issue 28."""
import random

import pytest
import torch

from nanodspark import LLM, SamplingParams
from nanodspark.cost_table import CostTable
from nanodspark.detokenizer import commit_text
from nanodspark.loader import Tokenizer, resolve_model_dir
from nanodspark.request import Request

PROMPTS = ["Once upon a time", "The little cat", "Tom and Lily went to the park.", "One day,", "She said",
           "Mom made a cake"]
MODES = ["static", "compact", "cap-accept"]


@pytest.fixture(scope="module")
def target_only():
    return LLM(drafter_path="none", use_tqdm=False, dtype="float32", device="cpu")    # as the speculative engines below


@pytest.fixture(scope="module")
def cost_table(tmp_path_factory):
    """A step cost that grows with the verify tokens, so compact and cap-accept really trim
    (about half the drafts on these prompts) instead of falling back to static."""
    path = tmp_path_factory.mktemp("cost") / "cost.json"
    CostTable({(b, k): 1.0 + 0.1 * b + 0.05 * k for b in (1, 2, 4, 8, 16, 32, 64) for k in range(65)},
              model_name="default", dtype="torch.float32", device="cpu").save(path)
    return str(path)


@pytest.fixture(scope="module")
def reference(target_only):
    """(cases, target-only outputs): per prompt, the issue's stop (" a") and a piece of the
    free-running text, so that stops complete at varied places; greedy, ignore_eos. A case is
    (prompt, params, the free-running token ids)."""
    rng = random.Random(0)
    free = target_only.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    cases = []
    for p, f in zip(PROMPTS, free):
        i = rng.randrange(1, max(2, len(f.text) - 4))
        for stop in {" a", f.text[i:i + rng.randint(1, 4)]}:
            if stop.strip(" ") or stop == " ":
                cases.append((p, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[stop]), f.token_ids))
    cases.sort(key=lambda c: (PROMPTS.index(c[0]), c[1].stop != [" a"]))   # the repro first
    return cases, target_only.generate([c[0] for c in cases], [c[1] for c in cases])


def test_target_only_keeps_the_token_that_completes_the_stop(target_only, reference):
    """The reference itself: token_ids end at the first token whose text completes the stop."""
    tok = target_only.tokenizer
    cs, got = reference
    stopped = 0
    for (prompt, params, free_ids), g in zip(cs, got):
        stop = params.stop[0]
        k = next((k for k in range(1, len(free_ids) + 1) if stop in tok.decode(free_ids[:k])), None)
        if k is None:
            assert g.finish_reason == "length" and g.token_ids == free_ids
            continue
        stopped += 1
        full = tok.decode(free_ids[:k])
        assert g.finish_reason == "stop" and g.token_ids == free_ids[:k], (prompt, stop)
        assert g.text == full[:full.index(stop)]
    assert stopped >= len(cs) // 2


@pytest.mark.parametrize("mode", MODES)
def test_speculative_stops_where_target_only_stops(reference, cost_table, mode):
    """Token ids, text, finish reason and usage equal target-only decoding, in every verify mode;
    streamed token ids and text add up to the same. Fails on the old code: the accepted drafts
    after the stop stayed in `token_ids` (the issue's repro is the first case)."""
    spec = LLM(use_tqdm=False, verify_mode=mode, cost_table=cost_table, dtype="float32", device="cpu")
    assert spec.engine.drafter is not None
    cs, want = reference
    got = spec.generate([c[0] for c in cs], [c[1] for c in cs])
    verified, drafted = sum(g.spec["verified"] for g in got), sum(g.spec["drafted"] for g in got)
    assert sum(g.spec["accepted"] for g in got) > 0
    assert (verified < 0.8 * drafted) == (mode != "static")     # compact and cap-accept trimmed
    for (prompt, params, _), w, g in zip(cs, want, got):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason), (prompt, params.stop)
    multi = 0
    for (prompt, params, _), w in zip(cs[:4], want[:4]):
        outs = list(spec.stream(prompt, params))
        assert [t for o in outs for t in o.new_token_ids] == w.token_ids
        assert "".join(o.text_delta for o in outs) == w.text
        assert outs[-1].finished and outs[-1].num_output_tokens == len(w.token_ids)   # usage
        multi += max(len(o.new_token_ids) for o in outs) > 1
    assert multi > 0          # verify steps did commit several tokens at once


def test_commit_text_in_chunks_equals_one_token_per_step():
    """Committing a stream in random chunks keeps exactly the tokens, and streams exactly the
    text, that committing it one token per step does, also when the stop completes inside a
    multi-byte character or a chunk ends mid-character."""
    tok = Tokenizer(resolve_model_dir(None))
    rng = random.Random(1)
    text = "Tea ☕ and 日本語 café — naïve 🙂👍🏽 résumé.\n\nDone: ∑ x² ≥ 0.\n"
    streams = [tok.encode(text * 2)] + [[rng.randrange(13, 8192) for _ in range(50)] for _ in range(10)]

    def run(ids, stop, chunker):
        req = Request("r", [1], SamplingParams(stop=stop), 0, 10**6)
        pieces, i = [], 0
        while i < len(ids):
            new = ids[i:i + chunker()]
            i += len(new)
            req.output_ids += new
            delta, hit, keep = commit_text(tok, req, new, final=i == len(ids))
            pieces.append(delta)
            if hit:
                assert len(req.output_ids) == i - len(new) + keep
                break
        return req.output_ids, "".join(pieces), req.text

    for ids in streams:
        full = tok.decode(ids)
        for stop in (["\n\n"], ["x²"], ["本"], ["👍"], [" a", "é"], [full[20:23]]):
            want = run(ids, stop, lambda: 1)
            for _ in range(3):
                assert run(ids, stop, lambda: rng.randint(2, 7)) == want, stop


def test_text_decoded_once_at_the_finish_equals_the_streamed_text():
    """A request that streams no text (`stream_text=False`, as `LLM.generate` adds them) and has no
    stop string is not decoded step by step; its text at the finish, and on an abort, is what
    the streamed request's text is, multi-byte characters included."""
    tok = Tokenizer(resolve_model_dir(None))
    rng = random.Random(2)
    ids = tok.encode("Tea ☕ and 日本語 café — naïve 🙂👍🏽 résumé.\n" * 3) + [rng.randrange(13, 8192) for _ in range(40)]

    def run(stream: bool, upto: int):
        req = Request("r", [1], SamplingParams(), 0, 10**6, stream_text=stream)
        i, text = 0, ""
        while i < upto:
            new = ids[i:min(upto, i + rng.randint(1, 6))]
            i += len(new)
            req.output_ids += new
            delta = commit_text(tok, req, new, final=i == len(ids))[0]
            text += delta
            if not stream and i < len(ids):
                assert delta == "" and req.text == "", "decoded before the finish"
        return req, text

    streamed, text = run(True, len(ids))
    quiet, quiet_text = run(False, len(ids))
    assert quiet.text == quiet_text == streamed.text == text == tok.decode(ids)


def test_generate_decodes_only_at_the_finish_and_an_aborted_unstreamed_request_keeps_its_text(target_only):
    eng = target_only.engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (out,) = target_only.generate(["Once upon a time"], params, use_tqdm=False)
    streamed = "".join(o.text_delta for o in target_only.stream("Once upon a time", params))
    assert out.text == streamed == eng.tokenizer.decode(out.token_ids)
    req = eng.add_request("The little cat", params, stream_text=False)
    for _ in range(4):
        eng.step()
    assert req.output_ids and req.text == ""
    final = eng.abort(req.request_id)
    assert req.text == final.text_delta == eng.tokenizer.decode(req.output_ids)
    while eng.has_unfinished():        # (the overlapped loop's step in flight: it streams nothing more)
        assert list(eng.step()) == []
    eng.release(req.request_id)
    assert req.request_id not in eng.requests
