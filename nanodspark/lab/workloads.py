"""Named prompt sets for benchmarks: math, chat, poetry, code and mix.

Each workload is a fixed, seeded subset of a public evaluation set, so that numbers compare
across runs and machines:

    math    GSM8K test questions, as one user turn           (high acceptance)
    chat    MT-bench first turns, as one user turn           (medium acceptance)
    poetry  held-out songs-poems: the opening lines and an   (low acceptance)
            instruction to continue, as one user turn
    code    HumanEval prompts (signature + docstring), as    (high acceptance)
            raw text to complete, trailing newline stripped
    mix     the four above, interleaved round-robin

The data files are not part of the repository. They are read from `data_dir`, which defaults
to `$NANODSPARK_DATA`, else `../shared/data` next to the repository (or the working
directory), else `.carry/data` inside the repository (the folder a GPU run carries; fill it
with `python -m nanodspark.lab.workloads --copy-to .carry/data`).

Evaluation hygiene: the poems held out here are exactly the poems that the training corpus
(`nanodspark/lab/recipes/corpus.py`) leaves out; both call `split_poems`.

    >>> from nanodspark.lab.workloads import load_workload
    >>> prompts = load_workload("math", n=4)
    >>> prompts[0].render()        # ChatML text, ending with the assistant header
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

WORKLOADS = ("math", "chat", "poetry", "code", "mix")
DEFAULT_SIZES = {"math": 100, "chat": 80, "poetry": 100, "code": 164, "mix": 100}

# The files each workload reads (relative to the data dir).
DATA_FILES = {
    "math": "gsm8k_test.jsonl",
    "chat": "mt_bench_question.jsonl",
    "poetry": "songs_poems.txt",
    "code": "HumanEval.jsonl.gz",
}

# The poetry split is part of the data contract, not of a benchmark run: it never depends
# on the `seed` argument of load_workload. Changing these changes which poems are trained on.
POEM_SPLIT_SEED = 20261129
POEM_HELDOUT = 100
POEM_MIN_VERSE_LINES = 4

POETRY_INSTRUCTION = "Continue this poem:\n\n"

REPO_ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------
# ChatML: the one chat format of the project (training corpus, tokenizer template, prompts)
# --------------------------------------------------------------------------------------

ASSISTANT_HEADER = "<|im_start|>assistant\n"    # what the model's answer follows


def format_chatml(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """Render chat messages as ChatML text.

    Each message becomes `<|im_start|>{role}\\n{content}<|im_end|>\\n`. With
    `add_generation_prompt`, the header of the assistant's turn follows, so that the model's
    next tokens are the answer.
    """
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        parts.append(ASSISTANT_HEADER)
    return "".join(parts)


@dataclass
class Prompt:
    """One evaluation prompt.

    A chat prompt (`as_chat=True`) carries `messages` (role/content dicts); a completion
    prompt carries `text`. `meta` holds what a benchmark may want besides the prompt (the
    reference answer, the MT-bench category, the HumanEval entry point, ...).
    """

    workload: str
    id: str
    as_chat: bool
    messages: list[dict] | None = None
    text: str | None = None
    meta: dict = field(default_factory=dict)

    def render(self) -> str:
        """The prompt as the model sees it: ChatML with the assistant header, or the raw text."""
        if self.as_chat:
            return format_chatml(self.messages, add_generation_prompt=True)
        return self.text


# --------------------------------------------------------------------------------------
# Where the data lives
# --------------------------------------------------------------------------------------

def _candidate_data_dirs() -> list[Path]:
    env = os.environ.get("NANODSPARK_DATA")
    if env:
        return [Path(env)]
    return [
        REPO_ROOT.parent / "shared" / "data",
        Path.cwd().parent / "shared" / "data",
        REPO_ROOT / ".carry" / "data",
    ]


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The data directory to read: `data_dir` if given, else the first default that exists.

    When nothing exists, the first candidate is returned, so that the error raised for a
    missing file names a sensible path.
    """
    if data_dir is not None:
        return Path(data_dir)
    candidates = _candidate_data_dirs()
    for c in candidates:
        if c.is_dir():
            return c
    return candidates[0]


def data_file(name: str, data_dir: str | os.PathLike | None = None) -> Path:
    """Path of one data file; FileNotFoundError that says how to provide it if it is missing."""
    d = resolve_data_dir(data_dir)
    path = d / name
    if not path.is_file():
        raise FileNotFoundError(
            f"nanodspark needs the data file {path}, which does not exist. "
            f"Pass data_dir=..., set NANODSPARK_DATA to a folder that holds {name}, or put "
            f"the public data sets in ../shared/data next to the repository (see "
            f"../shared/data/README.md). For a GPU run, copy them into the carried folder "
            f"first: python -m nanodspark.lab.workloads --copy-to .carry/data"
        )
    return path


# --------------------------------------------------------------------------------------
# Readers (shared with nanodspark/lab/recipes/corpus.py)
# --------------------------------------------------------------------------------------

def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_poems(path: Path) -> list[str]:
    """The items of a fortune file: texts separated by lines that hold only `%`."""
    items, cur = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.rstrip("\r\n") == "%":
                items.append("".join(cur))
                cur = []
            else:
                cur.append(line)
    items.append("".join(cur))
    return [it.strip("\n") for it in items if it.strip()]


def verse_lines(poem: str) -> list[str]:
    """The lines of a poem without blank lines and without the `-- Author` attribution."""
    out = []
    for line in poem.splitlines():
        s = line.strip()
        if s and not s.startswith("--"):
            out.append(s)
    return out


def poem_opening(poem: str) -> str:
    """The opening a poetry prompt shows: the first two verse lines."""
    return "\n".join(verse_lines(poem)[:2])


def split_poems(poems: list[str]) -> tuple[list[int], list[int]]:
    """Fixed split of songs-poems into (train indices, held-out indices).

    Only poems with at least POEM_MIN_VERSE_LINES verse lines can be held out (so that
    there is something left to continue after the two-line opening). The choice is a seeded
    sample that depends only on POEM_SPLIT_SEED and the poems themselves. Held-out indices
    come back in file order.
    """
    eligible = [i for i, p in enumerate(poems) if len(verse_lines(p)) >= POEM_MIN_VERSE_LINES]
    heldout = sorted(random.Random(POEM_SPLIT_SEED).sample(eligible, POEM_HELDOUT))
    held = set(heldout)
    train = [i for i in range(len(poems)) if i not in held]
    return train, heldout


def humaneval_target_function(prompt: str, entry_point: str) -> str:
    """The part of a HumanEval prompt from `def <entry_point>(` on: signature and docstring.

    Used by the corpus to keep any source file that holds this text out of training (a
    stricter test than looking for the whole prompt, whose imports may differ).
    """
    i = prompt.find(f"def {entry_point}(")
    return prompt[i:] if i >= 0 else prompt


# --------------------------------------------------------------------------------------
# The workloads
# --------------------------------------------------------------------------------------

def _math(data_dir) -> list[Prompt]:
    rows = read_jsonl(data_file(DATA_FILES["math"], data_dir))
    out = []
    for i, r in enumerate(rows):
        answer = r["answer"].rsplit("####", 1)[-1].strip()
        out.append(Prompt("math", f"gsm8k-test-{i}", True,
                          messages=[{"role": "user", "content": r["question"]}],
                          meta={"answer": answer}))
    return out


def _chat(data_dir) -> list[Prompt]:
    rows = read_jsonl(data_file(DATA_FILES["chat"], data_dir))
    return [Prompt("chat", f"mt-bench-{r['question_id']}", True,
                   messages=[{"role": "user", "content": r["turns"][0]}],
                   meta={"category": r["category"], "second_turn": r["turns"][1]})
            for r in rows]


def _poetry(data_dir) -> list[Prompt]:
    poems = read_poems(data_file(DATA_FILES["poetry"], data_dir))
    _, heldout = split_poems(poems)
    return [Prompt("poetry", f"songs-poems-{i}", True,
                   messages=[{"role": "user", "content": POETRY_INSTRUCTION + poem_opening(poems[i])}],
                   meta={"opening": poem_opening(poems[i]), "poem": poems[i]})
            for i in heldout]


def _code(data_dir) -> list[Prompt]:
    # A HumanEval prompt ends in a newline, and our BPE merges a newline with the indentation
    # after it: ending on a bare newline asks the target to go on from a token it almost never
    # saw before a function body, and it writes new module-level code instead (the results
    # page). So the prompt is stripped, as bigcode-evaluation-harness's default `humaneval`
    # task does; meta["cut"] keeps what was cut.
    rows = read_jsonl(data_file(DATA_FILES["code"], data_dir))
    out = []
    for r in rows:
        text = r["prompt"].rstrip()
        out.append(Prompt("code", r["task_id"], False, text=text,
                          meta={"entry_point": r["entry_point"], "cut": r["prompt"][len(text):]}))
    return out


_LOADERS = {"math": _math, "chat": _chat, "poetry": _poetry, "code": _code}


def _seeded_order(items: list[Prompt], name: str, seed: int) -> list[Prompt]:
    # A seeded permutation: the subset of size n is its first n items, so smaller subsets
    # are prefixes of larger ones. The workload name is part of the seed so that the
    # workloads do not share one permutation.
    key = int(hashlib.md5(f"{name}:{seed}".encode()).hexdigest()[:8], 16)
    order = list(range(len(items)))
    random.Random(key).shuffle(order)
    return [items[i] for i in order]


def workload_size(name: str, data_dir: str | os.PathLike | None = None) -> int:
    """How many prompts the workload has in all (the largest `n` load_workload accepts)."""
    if name not in _LOADERS:
        raise ValueError(f"unknown single workload {name!r}; choose one of {', '.join(_LOADERS)}")
    return len(_LOADERS[name](data_dir))


def load_workload(name: str, n: int | None = None, seed: int = 0,
                  data_dir: str | os.PathLike | None = None) -> list[Prompt]:
    """A fixed, seeded subset of `n` prompts of the workload `name` (default sizes in DEFAULT_SIZES).

    The same (name, n, seed) always gives the same prompts in the same order, and for a
    given seed, the subset of size n is a prefix of any larger one.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    n = DEFAULT_SIZES[name] if n is None else n
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")

    if name == "mix":
        parts = [load_workload(w, seed=seed, data_dir=data_dir) for w in _LOADERS]
        mixed = [p for group in zip(*parts) for p in group]
        # The default subsets have different sizes; after the shortest runs out the rest
        # follow round-robin too.
        longest = max(len(p) for p in parts)
        for i in range(min(len(p) for p in parts), longest):
            mixed.extend(p[i] for p in parts if i < len(p))
        items = mixed
    else:
        items = _seeded_order(_LOADERS[name](data_dir), name, seed)

    if n > len(items):
        raise ValueError(f"workload {name!r} has {len(items)} prompts, asked for {n}")
    return items[:n]


def copy_data_files(dest: str | os.PathLike, data_dir: str | os.PathLike | None = None) -> list[Path]:
    """Copy the workload data files into `dest` (e.g. `.carry/data` before a GPU run)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for name in DATA_FILES.values():
        src = data_file(name, data_dir)
        shutil.copyfile(src, dest / name)
        out.append(dest / name)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Show a workload, or copy the workload data files.")
    ap.add_argument("name", nargs="?", default="mix", choices=WORKLOADS)
    ap.add_argument("--n", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--copy-to", default=None, help="copy the data files into this folder and exit")
    args = ap.parse_args(argv)
    if args.copy_to:
        for p in copy_data_files(args.copy_to, args.data_dir):
            print(p)
        return
    for p in load_workload(args.name, args.n, args.seed, args.data_dir):
        print(f"=== {p.workload} {p.id}")
        print(p.render())


if __name__ == "__main__":
    main()
