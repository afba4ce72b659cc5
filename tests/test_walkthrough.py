"""The walkthrough's examples are code: its `>>>` examples run as doctests, and every file and
command-line entry point it names exists (docs that drift from the code fail here)."""
import doctest
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "walkthrough").rglob("*.md"))   # the chapters and the results notebooks


@pytest.mark.parametrize("path", [p for p in CHAPTERS if ">>> " in p.read_text()], ids=lambda p: p.name)
def test_doctests_in_chapter(path):
    result = doctest.testfile(str(path), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.parametrize("path", CHAPTERS + [ROOT / "README.md"], ids=lambda p: p.name)
def test_named_files_and_modules_exist(path):
    text = path.read_text()
    for rel in set(re.findall(r"`((?:nanodspark|kernels|tests)/[\w/]+\.py)`", text)):
        assert (ROOT / rel).exists(), f"{path.name} names {rel}, which does not exist"
    for rel in set(re.findall(r"(benchmarks/[\w/.-]+\.(?:json|png|txt))", text)):
        assert (ROOT / rel).exists(), f"{path.name} cites {rel}, which is not committed"
    for mod in set(re.findall(r"python3? -m (nanodspark(?:\.\w+)+)", text)):
        assert (ROOT / (mod.replace(".", "/") + ".py")).exists(), f"{path.name} runs {mod}, which does not exist"


def test_shipped_file_hashes_match_chapter_04():
    import hashlib
    text = (ROOT / "walkthrough" / "04_default_model.md").read_text()
    listed = re.findall(r"^([0-9a-f]{64})  (\S+)$", text, flags=re.M)
    assert len(listed) >= 8
    for digest, rel in listed:
        path = ROOT / "nanodspark" / "assets" / "default" / rel
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, f"{rel} changed; update chapter 04"
