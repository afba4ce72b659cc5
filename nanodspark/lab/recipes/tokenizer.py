"""Train the 8k byte-level BPE tokenizer of the embedded default model.

    python -m nanodspark.lab.recipes.tokenizer --corpus build/corpus --out nanodspark/assets/default

Byte-level BPE (the GPT-2 scheme): text is first turned into bytes, each byte shown as one
printable character, so any string - any language, emoji, binary junk in code - has an
exact encoding and decoding; no "unknown" token exists. Training starts from the 256 byte
symbols and repeatedly merges the most frequent adjacent pair until the vocabulary has
8192 entries, four of which are the special tokens:

    0 <|endoftext|>   separates documents
    1 <|im_start|>    opens a ChatML turn
    2 <|im_end|>      closes a ChatML turn (the eos of chat generation)
    3 <|pad|>         padding; never in text

The training text is a fixed, deterministic sample of every training domain of the corpus
(capped per domain so that no domain dominates the merges); special-token strings are cut
out of it, so that no merge is spent on pieces of `<|im_start|>`. The same corpus gives the
same tokenizer.json byte for byte.

Writes tokenizer.json and tokenizer_config.json (ChatML chat template, eos "<|im_end|>",
stop_token_ids [<|im_end|>, <|endoftext|>]), prints chars/token per domain and records the token
counts in the corpus manifest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from nanodspark.lab.recipes.corpus import (
    SPECIAL_TOKENS,
    TRAIN_DOMAINS,
    VAL_DOMAINS,
    read_corpus_file,
    split_documents,
    take_by_md5,
)

VOCAB_SIZE = 8192
MIN_FREQUENCY = 2
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"

# How much of each training domain the BPE merges are learned from (MB of text).
TRAIN_MB = {"chat": 8.0, "math": 4.5, "literature": 4.0, "docs": 8.0, "dict": 2.0, "code": 8.0}

# ChatML, exactly as nanodspark.lab.workloads.format_chatml writes it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in SPECIAL_TOKENS))
PIECE_CHARS = 100_000


def pieces(text: str, size: int = PIECE_CHARS) -> Iterator[str]:
    """Cut text into pieces of about `size` characters at newlines (fast batch encoding)."""
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            nl = text.rfind("\n", start, end)
            end = nl + 1 if nl > start else end
        yield text[start:end]
        start = end


def training_texts(corpus: Path, train_mb: dict[str, float]) -> list[str]:
    """The BPE training text: per domain, an md5-ordered sample of whole documents, with
    special-token strings cut out, in pieces of at most ~100 KB."""
    out = []
    for domain, mb in train_mb.items():
        path = corpus / f"{domain}.txt.xz"
        if not path.exists():
            print(f"  (no {path.name}; skipped)", file=sys.stderr)
            continue
        docs = list(enumerate(split_documents(read_corpus_file(path))))
        docs = take_by_md5(docs, key=lambda d: d[0], size=lambda d: len(d[1]), max_bytes=mb * 1e6)
        for _, doc in docs:
            for part in _SPECIAL_RE.split(doc):
                out.extend(p for p in pieces(part) if p)
    return out


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=MIN_FREQUENCY,
        special_tokens=list(SPECIAL_TOKENS),  # ids 0..3, in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def tokenizer_config(tok) -> dict:
    """tokenizer_config.json in the layout transformers reads (PreTrainedTokenizerFast)."""
    added = {
        str(tok.token_to_id(s)): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True}
        for s in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000_000,
        # transformers 5 name for the other special tokens (so that decoding can skip them).
        "extra_special_tokens": [s for s in SPECIAL_TOKENS if s != PAD_TOKEN],
        # Generation stops on either: <|im_end|> ends a chat turn, <|endoftext|> a document.
        # (Not called "eos_token_ids": transformers reads that name as an alias of
        # eos_token_id and rewrites it to a single id on save_pretrained.)
        "stop_token_ids": [tok.token_to_id(EOS_TOKEN), tok.token_to_id("<|endoftext|>")],
        "chat_template": CHAT_TEMPLATE,
    }


def count_tokens(tok, text: str) -> int:
    """Tokens of a corpus file's text, encoded in ~100 KB pieces (in parallel)."""
    total = 0
    parts = list(pieces(text))
    for i in range(0, len(parts), 64):
        total += sum(len(e.ids) for e in tok.encode_batch(parts[i:i + 64], add_special_tokens=False))
    return total


def measure(tok, corpus: Path, names: list[str]) -> dict[str, dict]:
    """chars, tokens and chars/token of each corpus file."""
    out = {}
    for name in tqdm(names, desc="counting tokens", unit="file"):
        path = corpus / f"{name}.txt.xz"
        if not path.exists():
            continue
        text = read_corpus_file(path)
        n = count_tokens(tok, text)
        out[name] = {"chars": len(text), "tokens": n, "chars_per_token": round(len(text) / max(n, 1), 3)}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Train the 8k byte-level BPE of the default model.")
    ap.add_argument("--corpus", type=Path, default=Path("build/corpus"))
    ap.add_argument("--out", type=Path, default=Path("nanodspark/assets/default"))
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    ap.add_argument("--val-only", action="store_true", help="count tokens of the validation files only")
    args = ap.parse_args(argv)

    texts = training_texts(args.corpus, TRAIN_MB)
    mb = sum(len(t) for t in texts) / 1e6
    print(f"training BPE (vocab {args.vocab_size}) on {mb:.1f} M chars in {len(texts)} pieces", file=sys.stderr)
    tok = train_tokenizer(texts, args.vocab_size)
    assert tok.get_vocab_size(with_added_tokens=True) == args.vocab_size
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))

    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"), pretty=False)
    (args.out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok), indent=2) + "\n")
    sha = hashlib.sha256((args.out / "tokenizer.json").read_bytes()).hexdigest()
    print(f"wrote {args.out / 'tokenizer.json'} (sha256 {sha[:16]}...)", file=sys.stderr)

    names = list(VAL_DOMAINS) + ([] if args.val_only else list(TRAIN_DOMAINS))
    stats = measure(tok, args.corpus, names)
    print(f"\n{'file':<18}{'M chars':>10}{'M tokens':>10}{'chars/token':>13}")
    for name, s in stats.items():
        print(f"{name:<18}{s['chars'] / 1e6:>10.2f}{s['tokens'] / 1e6:>10.3f}{s['chars_per_token']:>13.2f}")

    manifest_path = args.corpus / "manifest.json"
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        for name, s in stats.items():
            entry = manifest["files"].get(f"{name}.txt.xz")
            if entry is not None:
                entry["tokens"] = s["tokens"]
                entry["chars_per_token"] = s["chars_per_token"]
        manifest["tokenizer"] = {"path": str(args.out / "tokenizer.json"), "sha256": sha,
                                 "vocab_size": args.vocab_size, "train_mb": TRAIN_MB}
        manifest_path.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
