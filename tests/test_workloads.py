"""Workloads (nanodspark/lab/workloads.py) and evaluation hygiene of the corpus recipe.

The data-dependent tests need ../shared/data (next to the repository, or $NANODSPARK_DATA);
they are skipped where it is absent. Nothing here uses the network.
"""

import json

import pytest

from nanodspark.lab import workloads as W
from nanodspark.lab.recipes import corpus as C

HAVE_DATA = all((W.resolve_data_dir() / f).is_file() for f in W.DATA_FILES.values())
needs_data = pytest.mark.skipif(not HAVE_DATA, reason="../shared/data not available")


def norm(s: str) -> str:
    return " ".join(s.split())


# ----------------------------------------------------------------- workloads

@needs_data
@pytest.mark.parametrize("name", W.WORKLOADS)
def test_each_workload_loads_with_default_size(name):
    prompts = W.load_workload(name)
    assert len(prompts) == W.DEFAULT_SIZES[name]
    assert len({p.id for p in prompts}) == len(prompts)
    for p in prompts:
        assert isinstance(p, W.Prompt)
        if p.as_chat:
            assert p.messages and p.messages[-1]["role"] == "user" and p.messages[-1]["content"].strip()
            assert p.render().endswith("<|im_start|>assistant\n")
        else:
            assert p.text and p.render() == p.text
    if name != "mix":
        assert {p.workload for p in prompts} == {name}


@needs_data
def test_workload_contents():
    math = W.load_workload("math", n=5)
    assert all(p.as_chat and p.meta["answer"] for p in math)
    chat = W.load_workload("chat")
    assert {p.meta["category"] for p in chat} >= {"writing", "coding", "math"}
    code = W.load_workload("code")
    assert all(not p.as_chat and "def " + p.meta["entry_point"] + "(" in p.text for p in code)
    # stripped of HumanEval's trailing newline (a bare-newline token; 09_results.md §4f)
    he = {r["task_id"]: r["prompt"] for r in W.read_jsonl(W.data_file("HumanEval.jsonl.gz"))}
    assert all(p.text == p.text.rstrip() and p.text + p.meta["cut"] == he[p.id] for p in code)
    assert all(p.meta["cut"] for p in code)
    assert {p.id for p in code} == {f"HumanEval/{i}" for i in range(164)}
    poetry = W.load_workload("poetry")
    for p in poetry:
        assert p.messages[0]["content"].startswith(W.POETRY_INSTRUCTION)
        assert p.messages[0]["content"].endswith(p.meta["opening"])
    mix = W.load_workload("mix", n=8)
    assert [p.workload for p in mix] == ["math", "chat", "poetry", "code"] * 2


@needs_data
def test_subsets_are_fixed_and_seeded():
    a = W.load_workload("math", n=20, seed=0)
    b = W.load_workload("math", n=20, seed=0)
    assert [p.id for p in a] == [p.id for p in b]
    # a smaller subset is a prefix of a larger one
    assert [p.id for p in W.load_workload("math", n=7)] == [p.id for p in a[:7]]
    # another seed, another subset
    assert [p.id for p in W.load_workload("math", n=20, seed=1)] != [p.id for p in a]
    with pytest.raises(ValueError):
        W.load_workload("chat", n=81)
    with pytest.raises(ValueError):
        W.load_workload("nonsense")


@needs_data
def test_poetry_uses_the_split_shared_with_the_corpus():
    poems = W.read_poems(W.data_file("songs_poems.txt"))
    train, heldout = W.split_poems(poems)
    assert len(heldout) == W.POEM_HELDOUT and not set(train) & set(heldout)
    assert sorted(train + heldout) == list(range(len(poems)))
    ids = {p.id for p in W.load_workload("poetry")}
    assert ids == {f"songs-poems-{i}" for i in heldout}
    # the corpus recipe holds out exactly these poems
    _, val = C.poem_documents()
    assert [norm(v) for v in val] == [norm(poems[i]) for i in heldout]


def test_missing_data_dir_gives_a_clear_error(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as e:
        W.load_workload("math", data_dir=missing)
    msg = str(e.value)
    assert "gsm8k_test.jsonl" in msg and str(missing) in msg and "NANODSPARK_DATA" in msg


def test_data_dir_from_environment(tmp_path, monkeypatch):
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(5)]
    (tmp_path / "gsm8k_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("NANODSPARK_DATA", str(tmp_path))
    assert W.resolve_data_dir() == tmp_path
    prompts = W.load_workload("math", n=5)
    assert sorted(p.meta["answer"] for p in prompts) == ["0", "2", "4", "6", "8"]


def test_chatml_format():
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    assert W.format_chatml(msgs) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
    assert W.format_chatml(msgs[:1], add_generation_prompt=True).endswith("<|im_end|>\n<|im_start|>assistant\n")


# ----------------------------------------------------------------- corpus pieces and hygiene

def test_gsm8k_formatting():
    row = {"question": "Tom has 3 bags of 4 apples. How many apples?",
           "answer": "He has 3*4=<<3*4=12>>12 apples.\n#### 12"}
    text = C.gsm8k_conversation(row)
    assert text == ("<|im_start|>user\nTom has 3 bags of 4 apples. How many apples?<|im_end|>\n"
                    "<|im_start|>assistant\nHe has 3*4=12 apples.\nThe answer is 12.<|im_end|>\n")


def test_needle_index_finds_rewrapped_needles():
    needles = ["the quick brown fox jumps over the lazy dog", "Try not. Do.", "def f(x):\n    return x"]
    idx = C.NeedleIndex(needles)
    assert idx.find("xx the quick brown fox\n  jumps over   the lazy dogs") is not None
    assert idx.find("Yoda said: Try   not.\nDo. Or not.") == "Try not. Do."
    assert idx.find("the quick brown fox jumps over a lazy dog") is None
    assert idx.find("def f(x): return x") is not None
    assert idx.find("") is None


def test_python_source_files_is_deterministic_and_filtered(tmp_path):
    root = tmp_path / "lib"
    (root / "pkg" / "tests").mkdir(parents=True)
    (root / "site-packages").mkdir()
    for i in range(20):
        (root / "pkg" / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 20)
    (root / "pkg" / "tests" / "helper.py").write_text("x = 1\n")
    (root / "pkg" / "test_thing.py").write_text("x = 1\n")
    (root / "site-packages" / "other.py").write_text("x = 1\n")
    (root / "big.py").write_text("x = 1\n" * 80_000)
    secret = 'def add(a, b):\n    """Add two numbers.\n    >>> add(1, 2)\n    3\n    """\n'
    (root / "leak.py").write_text("import os\n\n" + secret.replace("    ", "\t") + "    return a + b\n")

    files = C.python_source_files(root, max_bytes=1e9, seed=0, exclude=[secret])
    names = {n for n, _ in files}
    assert names == {f"pkg/mod{i}.py" for i in range(20)}
    assert files == C.python_source_files(root, max_bytes=1e9, seed=0, exclude=[secret])
    small = C.python_source_files(root, max_bytes=2000, seed=0, exclude=[secret])
    assert 0 < len(small) < 20 and [n for n, _ in small] == [n for n, _ in files[:len(small)]]
    other = C.python_source_files(root, max_bytes=2000, seed=1, exclude=[secret])
    assert [n for n, _ in other] != [n for n, _ in small]


@needs_data
def test_no_evaluation_prompt_in_training_text():
    """The training text that comes from ../shared/data holds no evaluation prompt.

    Checked by brute force (whitespace-normalized substring search), independently of the
    NeedleIndex that the recipe uses to drop documents.
    """
    docs = C.shared_training_documents()
    assert len(docs["math"]) > 7000 and len(docs["literature"]) > 800
    flat = " ".join(norm(d) for group in docs.values() for d in group).encode("utf-8")

    data = W.resolve_data_dir()
    he = W.read_jsonl(data / "HumanEval.jsonl.gz")
    poems = W.read_poems(data / "songs_poems.txt")
    _, heldout = W.split_poems(poems)
    prompts = (
        [r["question"] for r in W.read_jsonl(data / "gsm8k_test.jsonl")]
        + [t for r in W.read_jsonl(data / "mt_bench_question.jsonl") for t in r["turns"]]
        + [r["prompt"] for r in he]
        + [poems[i] for i in heldout]
        + [p.meta["opening"] for p in W.load_workload("poetry")]
    )
    leaked = [p for p in prompts if norm(p).encode("utf-8") in flat]
    assert not leaked, f"{len(leaked)} evaluation prompts in training text, e.g. {leaked[0][:200]!r}"


@needs_data
def test_eval_needles_cover_every_workload_prompt():
    needles = C.eval_needles()
    idx = C.NeedleIndex(C.all_needles(needles))
    for name in ("math", "chat", "poetry"):
        for p in W.load_workload(name):
            assert idx.find(p.messages[-1]["content"]) is not None
    for p in W.load_workload("code"):
        assert idx.find(p.text) is not None


@needs_data
def test_shakespeare_split():
    train, val = C.shakespeare_documents()
    total = sum(map(len, train)) + sum(map(len, val))
    assert 0.08 < sum(map(len, val)) / total < 0.12
    assert not set(train) & set(val)
