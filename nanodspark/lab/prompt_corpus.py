"""Where the drafter's training prompts come from (`train_heads.py`, phase `data`): the beginnings
of *training* documents of the corpus (`nanodspark.lab.recipes.corpus`), never evaluation prompts.

A corpus is a folder of `DOMAIN.txt.xz` files, documents separated by the EOT marker. A prompt is
a document's text up to its assistant header (chat, math), or its first 60-400 characters.
`write_prompt_corpus` keeps a small copy that still serves `training_prompts`, so that the prompts
can travel with a large target to a machine without the corpus.
"""
from __future__ import annotations

import lzma
import random
from pathlib import Path

from ..loader import EOT
from .workloads import ASSISTANT_HEADER

ROOT = Path(__file__).resolve().parents[2]
TRAIN_DOMAINS = ("chat", "math", "code", "literature", "docs")   # add "distill" with --domains (chapter 09)


def corpus_documents(path: Path) -> list[str]:
    """The documents of one corpus file that can give a training prompt (longer than 80 characters)."""
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return [d for d in f.read().split(EOT) if len(d) > 80]


def training_prompts(corpus: Path, n: int, seed: int, domains=TRAIN_DOMAINS) -> list[str]:
    """Beginnings of training documents, spread evenly over `domains`."""
    rng = random.Random(seed)
    out = []
    domains = [d for d in domains if (corpus / f"{d}.txt.xz").exists()]
    per = n // max(1, len(domains)) + 1
    for dom in domains:
        docs = corpus_documents(corpus / f"{dom}.txt.xz")
        for d in rng.sample(docs, min(per, len(docs))):
            if ASSISTANT_HEADER in d:
                out.append(d[: d.index(ASSISTANT_HEADER) + len(ASSISTANT_HEADER)])
            else:
                cut = rng.randint(60, min(400, len(d) - 1))
                out.append(d[:cut])
    rng.shuffle(out)
    return out[:n]


def write_prompt_corpus(corpus: Path, out: Path, docs: int, chars: int, domains=TRAIN_DOMAINS) -> dict:
    """A small copy of the corpus that still serves `training_prompts`: per domain, its first
    `docs` documents longer than 80 characters, each cut to `chars` characters (a prompt uses at
    most the first 400, or the text up to the assistant header; a chat turn longer than `chars`
    becomes a plain cut, 1 of 3,761 at 6,000). It lets the prompts travel with a large target,
    as the SmolLM2 run of chapter 09 did (5,000 and 6,000)."""
    out.mkdir(parents=True, exist_ok=True)
    kept = {}
    for dom in domains:
        src = corpus / f"{dom}.txt.xz"
        if not src.exists():
            continue
        keep = [d[:chars] for d in corpus_documents(src)[:docs]]
        with lzma.open(out / src.name, "wt", encoding="utf-8") as f:
            f.write(EOT.join(keep))
        kept[dom] = len(keep)
    return kept


CORPUS_DIRS = (ROOT / ".carry" / "corpus", ROOT / "build" / "corpus")   # where --corpus is looked for
BUILD_CORPUS = ("python -m nanodspark.lab.recipes.corpus --out build/corpus   (about 3 min; it downloads from "
                "PyPI and Debian)")


def find_corpus(given: str | None, files: tuple[str, ...]) -> Path:
    """--corpus, or the first of CORPUS_DIRS holding any of `files`; a one-line SystemExit that says
    how to build it when there is none (a fresh clone has no corpus: it is built, not committed)."""
    if given:
        if not any((Path(given) / f).exists() for f in files):
            raise SystemExit(f"train_heads.py: {given} holds none of {', '.join(files)}; build the corpus "
                             f"first: {BUILD_CORPUS}")
        return Path(given)
    for d in CORPUS_DIRS:
        if any((d / f).exists() for f in files):
            return d
    raise SystemExit(f"train_heads.py: no corpus in .carry/corpus or build/corpus, and the data and proxy phases "
                     f"read one; build it first: {BUILD_CORPUS}")
