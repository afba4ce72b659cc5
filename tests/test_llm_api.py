"""The offline API as a user meets it (nanodspark/llm.py): bad sampling parameters fail where they
are written, a dict of parameters works, a prompt plus `max_tokens` past the context is refused as
the server refuses it (and leaves nothing queued), `LLM.chat` goes through the chat template, and
the results have vLLM's shape (`.outputs[0].text`) beside the flat fields."""
import pytest

from nanodspark import LLM, SamplingParams

GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), use_tqdm=False, max_model_len=96)


def idle(llm) -> bool:
    eng = llm.engine
    return not eng.has_unfinished() and not eng.requests


@pytest.mark.parametrize("bad, field", [
    (dict(temperature=-1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=1.5), "top_p"), (dict(top_p=0), "top_p"), (dict(max_tokens=-5), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"), (dict(top_k=-2), "top_k"), (dict(stop=[""]), "stop"),
    (dict(seed=1.5), "seed")])
def test_bad_sampling_params_fail_at_construction(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_validate_still_checks_a_changed_params():
    p = SamplingParams(temperature=0.5, stop="x")
    assert p.stop == ["x"] and p.validate() is p
    p.top_p = 2.0
    with pytest.raises(ValueError, match="top_p"):
        p.validate()


def test_a_dict_of_params_is_converted_and_unknown_fields_are_refused(llm):
    prompt = list(range(10, 30))
    assert llm.generate([prompt], GREEDY)[0].token_ids == \
        llm.generate([prompt], SamplingParams(**GREEDY))[0].token_ids
    with pytest.raises(ValueError, match=r"unknown sampling parameter\(s\) \['temprature'\]"):
        llm.generate([prompt], {"temprature": 0})
    with pytest.raises(TypeError, match="SamplingParams or a dict"):
        llm.generate([prompt], 0.5)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([prompt], {"max_tokens": -5})
    assert idle(llm)


def test_prompt_plus_max_tokens_past_the_context_is_refused_and_nothing_is_queued(llm):
    limit = llm.engine.max_model_len
    prompt = list(range(5, 5 + limit - 10))            # room for 10 new tokens
    with pytest.raises(ValueError, match=r"maximum context length is 96 tokens.*set max_tokens to at most 10"):
        llm.generate([list(range(5, 25)), prompt], SamplingParams(temperature=0, max_tokens=11))
    assert idle(llm)                                   # the good first prompt was not left queued
    with pytest.raises(ValueError, match="the prompt alone has 96"):
        llm.generate([list(range(1, limit + 1))], GREEDY)
    with pytest.raises(ValueError, match="at most 10"):
        next(iter(llm.stream(prompt, SamplingParams(max_tokens=11))))
    assert idle(llm)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"   # exactly at the limit: all of it


def test_vllm_output_shape_beside_the_flat_fields(llm):
    prompts = ["Once upon a time", "def f(x):"]
    outs = llm.generate(prompts, sampling_params=SamplingParams(**GREEDY))
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        assert (c.text, c.token_ids, c.finish_reason, c.index) == (o.text, o.token_ids, o.finish_reason, 0)
        assert o.prompt == p and o.prompt_token_ids == llm.tokenizer.encode(p) and o.finished
        assert len(c.token_ids) == 6 and c.finish_reason == "length"
    ids = llm.tokenizer.encode(prompts[0])
    by_dict = llm.generate([{"prompt": prompts[0]}, {"prompt_token_ids": ids}], GREEDY)
    assert [o.token_ids for o in by_dict] == [outs[0].token_ids] * 2
    assert by_dict[0].prompt == prompts[0] and by_dict[1].prompt is None


def test_chat_applies_the_chat_template(llm):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 plus 4?"}]
    text = llm.tokenizer.apply_chat_template(conv, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    one = llm.chat(conv, SamplingParams(**GREEDY))
    assert len(one) == 1 and one[0].prompt == text
    assert one[0].token_ids == llm.generate(text, GREEDY)[0].token_ids
    two = llm.chat([conv, conv[1:]], GREEDY)
    assert len(two) == 2 and two[0].token_ids == one[0].token_ids and two[1].prompt != text
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"role": "robot", "content": "hi"}], GREEDY)
    assert idle(llm)
