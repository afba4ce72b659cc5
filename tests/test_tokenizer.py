"""The committed 8k byte-level BPE (nanodspark/assets/default/tokenizer.json)."""

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from nanodspark.lab.workloads import format_chatml

ASSETS = Path(__file__).resolve().parent.parent / "nanodspark" / "assets" / "default"
SPECIALS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<|pad|>": 3}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(ASSETS / "tokenizer.json"))


@pytest.fixture(scope="module")
def config():
    return json.loads((ASSETS / "tokenizer_config.json").read_text())


def roundtrip(tok, text):
    return tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False)


def test_vocab_size_and_specials(tok):
    assert tok.get_vocab_size(with_added_tokens=True) == 8192
    for s, i in SPECIALS.items():
        assert tok.token_to_id(s) == i
        assert tok.encode(s, add_special_tokens=False).ids == [i]
    ids = tok.encode("<|im_start|>user\nhello there<|im_end|>\n", add_special_tokens=False).ids
    assert ids[0] == 1 and ids.count(2) == 1 and 0 not in ids


def test_byte_level_settings(tok):
    # no prefix space: "hello" at the start of a text is not " hello"
    assert not tok.encode("hello", add_special_tokens=False).tokens[0].startswith("\u0120")  # "Ġ" = space
    assert tok.encode(" hello", add_special_tokens=False).tokens[0].startswith("\u0120")
    # every one of the 256 bytes has its own token, so nothing is unknown
    assert all(tok.encode(chr(c), add_special_tokens=False).ids for c in range(256))


SAMPLES = [
    "",
    "Hello, world!",
    "  leading spaces, trailing spaces  \n\n\ttabs\tand\r\nCRLF\r\n",
    "Natalia sold 48/2 = 24 clips in May.\nThe answer is 72.",
    "def f(x: int) -> int:\n    \"\"\"Docstring.\"\"\"\n    return {k: v for k, v in zip(x, x[1:])}  # comment\n",
    "Grüße aus Köln — naïve café, ½ €, Ελληνικά, русский, עברית, العربية",
    "中文字符和日本語のテキスト、한국어 텍스트",
    "emoji 🙂👍🏽🇺🇸 and ZWJ 👩‍👩‍👧 and combining e\u0301 a\u0308",
    "\x00\x01\x7f control chars and \u200b zero width and \ufeff BOM",
    "<|im_start|>user\nWrite a poem.<|im_end|>\n<|im_start|>assistant\n",
    "doc one<|endoftext|>doc two<|endoftext|>",
    "<|im_start without end, <| pad |>, <|endoftext",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_roundtrip_samples(tok, text):
    assert roundtrip(tok, text) == text


def test_roundtrip_random_text(tok):
    rng = random.Random(0)
    ranges = [(0x20, 0x7E), (0x09, 0x0D), (0xA0, 0x24F), (0x370, 0x4FF), (0x590, 0x6FF),
              (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x10000, 0x1007F)]
    for _ in range(200):
        parts = []
        for _ in range(rng.randint(1, 40)):
            lo, hi = rng.choice(ranges)
            parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 8))))
            parts.append(rng.choice(["", " ", "  ", "\n", "\t", "    "]))
        text = "".join(parts)
        assert roundtrip(tok, text) == text


def test_roundtrip_source_code(tok):
    text = Path(__file__).read_text(encoding="utf-8")
    assert roundtrip(tok, text) == text
    # code compresses: well under one token per character
    assert len(tok.encode(text, add_special_tokens=False).ids) < len(text) / 2


def test_tokenizer_config(config):
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|pad|>"
    assert config["stop_token_ids"] == [2, 0]
    assert {v["content"]: int(k) for k, v in config["added_tokens_decoder"].items()} == SPECIALS


def test_chat_template_is_chatml(config):
    jinja2 = pytest.importorskip("jinja2")
    template = jinja2.Environment().from_string(config["chat_template"])
    messages = [{"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4.\nThe answer is 4."},
                {"role": "user", "content": "Thanks!"}]
    for gen in (False, True):
        assert template.render(messages=messages, add_generation_prompt=gen) == format_chatml(messages, gen)
