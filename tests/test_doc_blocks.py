"""The walkthrough's commands run: every shell or Python block that a chapter marks as runnable
on a CPU is executed, its output compared with the output the chapter shows, and its time with
the time the chapter states.

The marker is an HTML comment on the line before the block (invisible on GitHub):

    <!-- cpu: 10 s -->            runs in CI (the default test run)
    <!-- cpu: 90 s, slow -->      runs with `pytest -m slow`

and, optionally, right after the block, the output it prints:

    <!-- output -->
    ```text
    B [0, 1, 3] hit 8 ...
    ```

Each expected line (`...` matches any text; blank lines are skipped) must appear in the actual
output, in order, so an abridged output can be shown. A chapter's blocks run in order in one
sandbox (a temporary folder whose entries link to the repository's, with `../shared` next to it
as in the repository), so a block may use what an earlier one of the same kind wrote. The time
is checked loosely: the block must finish within 3x the stated seconds + 10 s, measured as the
smaller of wall time and the child processes' CPU time (a loaded CI machine stretches the
first, several threads stretch the second); not under pytest-xdist, whose workers share the
cores. On a GPU machine the blocks run with CUDA hidden: they are the chapters' CPU commands."""
import functools
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "walkthrough").rglob("*.md")) + [ROOT / "README.md"]
MARK = re.compile(r"^<!-- cpu: (?P<s>\d+(?:\.\d+)?) s(?P<slow>, slow)? -->\s*$")
OUTPUT = re.compile(r"^<!-- output -->\s*$")
FENCE = re.compile(r"^```(?P<info>[\w+-]*)")


@dataclass
class Block:
    doc: str
    line: int
    lang: str
    code: str
    seconds: float
    slow: bool
    expected: str | None


def _fenced(lines, i):
    """The fenced block starting at lines[i]: (info, body, index after the closing fence)."""
    m = FENCE.match(lines[i])
    assert m, f"line {i + 1}: a marker must be followed by a fenced block"
    j = i + 1
    while not lines[j].startswith("```"):
        j += 1
    return m.group("info"), "\n".join(lines[i + 1:j]) + "\n", j + 1


def blocks_of(path: Path) -> list[Block]:
    lines, out, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        m = MARK.match(lines[i])
        if not m:
            i += 1
            continue
        marker_line = i + 1
        info, code, i = _fenced(lines, i + 1)
        expected = None
        k = i
        while k < len(lines) and not lines[k].strip():
            k += 1
        if k < len(lines) and OUTPUT.match(lines[k]):
            _, expected, i = _fenced(lines, k + 1)
        out.append(Block(path.relative_to(ROOT).as_posix(), marker_line, info or "bash", code, float(m.group("s")),
                         bool(m.group("slow")), expected))
    return out


def matches(expected: str, actual: str) -> bool:
    """Every non-blank expected line, `...` a wildcard, appears in the actual lines in order."""
    got = [line.rstrip() for line in actual.splitlines()]
    j = 0
    for want in (w.rstrip() for w in expected.splitlines() if w.strip()):
        pat = re.compile("^" + ".*".join(re.escape(p) for p in want.split("...")) + "$")
        while j < len(got) and not pat.match(got[j]):
            j += 1
        if j == len(got):
            return False
        j += 1
    return True


def sandbox(tmp: Path) -> Path:
    """tmp/repo links to every top-level entry of the repository; tmp/shared to ../shared."""
    repo = tmp / "repo"
    repo.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git", ".venv", "runs", "build", ".hypothesis", ".pytest_cache"):
            (repo / entry.name).symlink_to(entry)
    if (ROOT.parent / "shared").exists():
        (tmp / "shared").symlink_to(ROOT.parent / "shared")
    return repo


def run_block(b: Block, cwd: Path) -> tuple[str, float]:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONDONTWRITEBYTECODE="1",
               CUDA_VISIBLE_DEVICES="")           # the chapters' CPU commands: on a GPU machine they run on its CPU
    env.pop("TRITON_INTERPRET", None)             # as a reader's shell has it: kernels/ decides
    if b.lang in ("bash", "sh", "shell", "console"):
        cmd = ["bash", "-eo", "pipefail", "-c", b.code]
    elif b.lang == "python":
        cmd = [sys.executable, "-c", b.code]
    else:
        raise AssertionError(f"{b.doc}:{b.line}: cannot run a {b.lang!r} block")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=max(900, 20 * b.seconds))      # a hang, not slowness: slowness is checked below
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0 and NUMPY_REFUSES in proc.stdout and interpreter_cannot_index():
        pytest.skip(f"{b.doc}:{b.line}: this Triton's interpreter cannot run with this NumPy (README, known problems)")
    assert proc.returncode == 0, f"{b.doc}:{b.line} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
    return proc.stdout, min(wall, cpu)


NUMPY_REFUSES = "only 0-dimensional arrays can be converted"
PROBE = """
import torch, kernels, triton, triton.language as tl
@triton.jit
def k(p, o):
    acc = 0
    for i in range(tl.load(p), 3):
        acc += i
    tl.store(o, acc)
o = torch.zeros(1, dtype=torch.int32)
k[(1,)](torch.ones(1, dtype=torch.int32), o)
assert o.item() == 3
"""


@functools.cache
def interpreter_cannot_index() -> bool:
    """Whether Triton's interpreter here fails a loop bounded by a loaded value with NumPy's
    refusal: Triton 3.6 keeps kernel scalars as 1-element arrays, which NumPy >= 2.4 will not
    turn into an int. Then a chapter's CPU command cannot run its kernels on this machine's CPU
    (the device image pairs them); on the GPU the kernels are compiled and unaffected."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=300)
    return proc.returncode != 0 and NUMPY_REFUSES in proc.stdout


def check(b: Block, cwd: Path) -> None:
    out, seconds = run_block(b, cwd)
    if b.expected is not None:
        assert matches(b.expected, out), f"{b.doc}:{b.line}: the output differs from the chapter's:\n{out[-3000:]}"
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        return        # the stated time is for a run of its own; beside other workers it says nothing
    assert seconds <= 3 * b.seconds + 10, f"{b.doc}:{b.line} took {seconds:.0f} s; the chapter says {b.seconds:.0f} s"


def _docs(slow: bool):
    return [p for p in DOCS if any(b.slow == slow for b in blocks_of(p))]


@pytest.mark.parametrize("path", _docs(False), ids=lambda p: p.name)
def test_quick_blocks_run(path, tmp_path):
    cwd = sandbox(tmp_path)
    for b in blocks_of(path):
        if not b.slow:
            check(b, cwd)


@pytest.mark.slow
@pytest.mark.parametrize("path", _docs(True), ids=lambda p: p.name)
def test_slow_blocks_run(path, tmp_path):
    """Every marked block of the chapter, quick ones included, in the chapter's order."""
    cwd = sandbox(tmp_path)
    for b in blocks_of(path):
        check(b, cwd)


def test_the_harness_parses_and_matches():
    assert matches("a ... c\n\nx", "a b c\ny\nx") and not matches("x\na ... c", "a b c\nx")
    md = "\n".join(["text", "<!-- cpu: 5 s -->", "```bash", "echo hi", "```", "", "<!-- output -->", "```text",
                    "hi", "```", "<!-- cpu: 70 s, slow -->", "```python", "print(1)", "```"])
    tmp = ROOT / "build" / "test_doc_blocks.md"
    tmp.parent.mkdir(exist_ok=True)
    tmp.write_text(md)
    try:
        bs = blocks_of(tmp)
    finally:
        tmp.unlink()
    assert [(b.lang, b.seconds, b.slow, b.expected) for b in bs] == [("bash", 5.0, False, "hi\n"),
                                                                    ("python", 70.0, True, None)]
    assert shutil.which("bash")
