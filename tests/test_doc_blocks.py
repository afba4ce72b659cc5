"""Every command in the README and the walkthrough runs from a fresh clone, as written, in the
virtual environment the README's Quickstart creates and activates (`.venv`): each shell or
Python block is executed, its output compared with the output the chapter shows, and its time
with the time the chapter states. A command block without a marker fails
`test_every_command_block_is_marked`.

The marker is an HTML comment on the line before the block (invisible on GitHub):

    <!-- cpu: 10 s -->                  runs in CI (the default test run)
    <!-- cpu: 90 s, slow -->            runs with `pytest -m slow` (minutes of CPU)
    <!-- cpu: 20 s, serves -->          starts a server in the background; the blocks after it in the
                                        same file talk to it (its port: `--port N`, else 8000); it is
                                        stopped when the file's blocks are done
    <!-- cpu: 200 s, slow, needs: build/corpus -->   runs once an earlier block (or the checkout)
                                        made that path, and is skipped, saying so, otherwise
    <!-- gpu -->                        a GPU machine's command (a device call's $OUT, CUDA)
    <!-- setup -->                      creates and fills the venv; CI runs it (.ci/run runs the
                                        README's TEST-COMMAND in a fresh venv), `-m slow` runs it
                                        in a fresh copy (test_setup_blocks_install_a_fresh_clone)

and, optionally, right after the block, the output it prints:

    <!-- output -->
    ```text
    B [0, 1, 3] hit 8 ...
    ```

Each expected line (`...` matches any text; blank lines are skipped) must appear in the actual
output, in order, so an abridged output can be shown. A file's blocks run in order in one
sandbox shaped like a fresh clone: a temporary folder whose entries link to the files git
tracks (no `.carry/`, `build/` or `runs/`), with `../shared` next to it as in the repository and
`.venv` standing for this interpreter's environment, activated (`PATH`, `VIRTUAL_ENV`), so a
block may use what an earlier one of the same kind wrote. The time is checked loosely: the block
must finish within 3x the stated seconds + 10 s, measured as the smaller of wall time and the
child processes' CPU time (a loaded CI machine stretches the first, several threads stretch the
second); not under pytest-xdist, whose workers share the cores. On a GPU machine the blocks run
with CUDA hidden: they are the chapters' CPU commands."""
import contextlib
import fcntl
import functools
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "walkthrough").rglob("*.md")) + [ROOT / "README.md"]
MARK = re.compile(r"^\s*<!-- cpu: (?P<s>\d+(?:\.\d+)?) s(?P<flags>(?:, [^>]+?)?) -->\s*$")
OTHER_MARK = re.compile(r"^\s*<!-- (?P<kind>gpu|setup|TEST-COMMAND)(?::[^>]*)? -->\s*$")
OUTPUT = re.compile(r"^\s*<!-- output -->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<info>[\w+-]*)")
SHELLS = ("bash", "sh", "shell", "console")
COMMAND_START = re.compile(r"^\s*(python3? |pip |mkdir |curl |cp |torchrun |NANODSPARK_DATA=)")


@dataclass
class Block:
    doc: str
    line: int
    lang: str
    code: str
    seconds: float
    slow: bool
    expected: str | None
    serves: bool = False
    needs: list[str] = field(default_factory=list)


def _fenced(lines, i):
    """The fenced block starting at lines[i]: (info, body with the fence's indent removed,
    index after the closing fence)."""
    m = FENCE.match(lines[i])
    assert m, f"line {i + 1}: a marker must be followed by a fenced block"
    indent, j = len(m.group("indent")), i + 1
    while not lines[j].lstrip().startswith("```"):
        j += 1
    return m.group("info"), "\n".join(line[indent:] for line in lines[i + 1:j]) + "\n", j + 1


def _flags(text: str) -> tuple[bool, bool, list[str]]:
    slow, serves, needs = False, False, []
    for f in (x.strip() for x in text.split(",") if x.strip()):
        if f == "slow":
            slow = True
        elif f == "serves":
            serves = True
        elif f.startswith("needs:"):
            needs.append(f.split(":", 1)[1].strip())
        else:
            raise AssertionError(f"unknown marker flag {f!r}")
    return slow, serves, needs


def blocks_of(path: Path) -> list[Block]:
    """The blocks marked `cpu: ...` of a file, in order."""
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
        slow, serves, needs = _flags(m.group("flags"))
        out.append(Block(path.relative_to(ROOT).as_posix(), marker_line, info or "bash", code, float(m.group("s")),
                         slow, expected, serves, needs))
    return out


def command_blocks(path: Path) -> list[tuple[int, str, str, str | None]]:
    """Every fenced block that is a command to run: (line, info, body, its marker or None). A
    shell block; a Python block that starts with an import (not a `>>>` doctest, nor an excerpt
    of the source); an untyped block that starts with a command."""
    lines, out, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        if not FENCE.match(lines[i]):
            i += 1
            continue
        start = i
        info, body, i = _fenced(lines, i)
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = lines[k].strip() if k >= 0 and (MARK.match(lines[k]) or OTHER_MARK.match(lines[k])) else None
        first = next((b for b in body.splitlines() if b.strip() and not b.lstrip().startswith("#")), "")
        if info in SHELLS or (info == "python" and re.match(r"(import|from) ", first)) or \
                (info == "" and COMMAND_START.match(first)):
            out.append((start + 1, info, body, marker))
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


@functools.cache
def clone_entries() -> tuple[str, ...]:
    """The top-level names a fresh clone has: what git tracks or would add (not ignored)."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard"], text=True,
                             capture_output=True, check=True, timeout=60).stdout
        return tuple(sorted({line.split("/", 1)[0] for line in out.splitlines() if line}))
    except (OSError, subprocess.SubprocessError):      # not a git checkout: everything but what git ignores
        skip = {".git", ".venv", ".carry", "runs", "build", ".hypothesis", ".pytest_cache", "__pycache__"}
        return tuple(sorted(e.name for e in ROOT.iterdir() if e.name not in skip))


def shared_dir() -> Path | None:
    """`../shared` beside the repository, or the folder above $NANODSPARK_DATA (its `data`)."""
    if (ROOT.parent / "shared").exists():
        return ROOT.parent / "shared"
    data = os.environ.get("NANODSPARK_DATA")
    return Path(data).resolve().parent if data and Path(data).name == "data" else None


def sandbox(tmp: Path) -> Path:
    """tmp/repo: a fresh clone's entries (links), `.venv` = this interpreter's environment;
    tmp/shared: ../shared."""
    repo = tmp / "repo"
    repo.mkdir()
    for name in clone_entries():
        if (ROOT / name).exists():
            (repo / name).symlink_to(ROOT / name)
    if sys.prefix != sys.base_prefix:                 # this interpreter's venv, as the README's activated .venv
        (repo / ".venv").symlink_to(Path(sys.prefix))
    else:                                             # no venv: a bin/ whose python is this interpreter
        (repo / ".venv" / "bin").mkdir(parents=True)
        for name in ("python", "python3"):
            (repo / ".venv" / "bin" / name).symlink_to(sys.executable)
    shared = shared_dir()
    if shared is not None:
        (tmp / "shared").symlink_to(shared)
    return repo


def block_env(cwd: Path) -> dict:
    venv_bin = cwd / ".venv" / "bin"
    env = dict(os.environ, PATH=f"{venv_bin}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}"
                               f"{os.environ.get('PATH', '')}",
               VIRTUAL_ENV=str(cwd / ".venv"), PYTHONDONTWRITEBYTECODE="1",
               CUDA_VISIBLE_DEVICES="")           # the chapters' CPU commands: on a GPU machine they run on its CPU
    env.pop("TRITON_INTERPRET", None)             # as a reader's shell has it: kernels/ decides
    env.pop("PYTHONHOME", None)
    for k in ("no_proxy", "NO_PROXY"):            # the chapters' servers are local: no proxy on the way
        env[k] = ",".join(x for x in (env.get(k), "127.0.0.1", "localhost") if x)
    return env


def command(b: Block) -> list[str]:
    if b.lang in SHELLS:
        return ["bash", "-eo", "pipefail", "-c", b.code]
    if b.lang == "python":
        return ["python", "-c", b.code]
    raise AssertionError(f"{b.doc}:{b.line}: cannot run a {b.lang!r} block")


def _kill_group(proc) -> None:
    """What a block left running (a server started with `&`) goes with it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)


def run_block(b: Block, cwd: Path) -> tuple[str, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(command(b), cwd=cwd, env=block_env(cwd), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(900, 20 * b.seconds))   # a hang, not slowness: checked below
    finally:
        _kill_group(proc)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0 and NUMPY_REFUSES in out and interpreter_cannot_index():
        pytest.skip(f"{b.doc}:{b.line}: this Triton's interpreter cannot run with this NumPy (README, known problems)")
    assert proc.returncode == 0, f"{b.doc}:{b.line} failed (exit {proc.returncode}):\n{out[-3000:]}"
    return out, min(wall, cpu)


def _port(b: Block) -> int:
    m = re.search(r"--port[ =](\d+)", b.code)
    return int(m.group(1)) if m else 8000


def _port_busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))     # never through a proxy


def start_server(b: Block, cwd: Path, log: Path) -> subprocess.Popen:
    """Run a `serves` block in the background until its /health answers 200."""
    port = _port(b)
    if _port_busy(port):
        pytest.skip(f"{b.doc}:{b.line}: port {port} is already in use on this machine, so its server cannot start")
    proc = subprocess.Popen(command(b), cwd=cwd, env=block_env(cwd), stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 3 * b.seconds + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{b.doc}:{b.line}: the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError):
            with DIRECT.open(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        time.sleep(0.5)
    stop_server(proc)
    raise AssertionError(f"{b.doc}:{b.line}: no /health on port {port} after {3 * b.seconds + 10:.0f} s; "
                         f"the chapter says {b.seconds:.0f} s:\n{log.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    _kill_group(proc)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def ports_lock(blocks):
    """Files whose blocks serve on fixed ports run one at a time (pytest-xdist workers)."""
    if not any(b.serves for b in blocks):
        yield
        return
    with open(Path(tempfile.gettempdir()) / "nanodspark_doc_blocks_ports.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


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


def run_doc(path: Path, tmp_path: Path, slow: bool) -> None:
    """The file's blocks in order (with `slow`, every one; else the quick ones); servers stopped at
    the end; blocks whose `needs:` is missing are skipped, and said so."""
    blocks = [b for b in blocks_of(path) if slow or not b.slow]
    cwd, servers, missing = sandbox(tmp_path), [], []
    with ports_lock(blocks):
        try:
            for b in blocks:
                absent = [n for n in b.needs if not (cwd / n).exists()]
                for n in [n for n in absent if (ROOT / n).exists()]:     # built in this checkout already
                    (cwd / n).parent.mkdir(parents=True, exist_ok=True)
                    (cwd / n).symlink_to(ROOT / n)
                    absent.remove(n)
                if absent:
                    missing.append(f"{b.doc}:{b.line} needs {', '.join(absent)}")
                elif b.serves:
                    servers.append(start_server(b, cwd, tmp_path / f"server_{b.line}.log"))
                else:
                    check(b, cwd)
        finally:
            for s in servers:
                stop_server(s)
    if missing:
        pytest.skip("; ".join(missing))


def _docs(slow: bool):
    return [p for p in DOCS if any(b.slow == slow for b in blocks_of(p))]


@pytest.mark.parametrize("path", _docs(False), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_quick_blocks_run(path, tmp_path):
    run_doc(path, tmp_path, slow=False)


@pytest.mark.slow
@pytest.mark.parametrize("path", _docs(True), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_slow_blocks_run(path, tmp_path):
    """Every marked block of the chapter, quick ones included, in the chapter's order."""
    run_doc(path, tmp_path, slow=True)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_command_block_is_marked(path):
    """A command nobody runs drifts: every command block says how it is run (a CPU time, slow, a
    GPU machine's, or setup), and uses the activated venv's `python` (no `.venv/bin/`, no
    `python3` but to create the venv)."""
    for line, info, body, marker in command_blocks(path):
        where = f"{path.relative_to(ROOT)}:{line}"
        assert marker, f"{where}: a command block without a marker (<!-- cpu: N s -->, ..., <!-- gpu -->)"
        assert info, f"{where}: a marked block says its language (```bash or ```python)"
        if "setup" in marker or "TEST-COMMAND" in marker:
            continue
        assert ".venv/bin/" not in body, f"{where}: run commands in the activated venv, not through .venv/bin/"
        assert not re.search(r"(^|[\s;&|(])python3 ", body), f"{where}: `python`, not `python3`, after activation"


def test_the_quickstart_creates_and_activates_the_venv_with_extras_that_exist():
    section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^(\w+) = \[", section, flags=re.M))
    assert {"serve", "test", "lab", "gpu"} <= extras
    readme = ROOT / "README.md"
    setups = [body for _, _, body, marker in command_blocks(readme) if marker and ("setup" in marker
                                                                                   or "TEST-COMMAND" in marker)]
    assert len(setups) >= 2
    for body in setups:
        assert "python3 -m venv .venv" in body and re.search(r"(source|\.) \.venv/bin/activate", body), body
        for group in re.findall(r'pip install [^\n]*?-e "\.\[([\w,]+)\]"', body):
            assert set(group.split(",")) <= extras, f"an extra pyproject.toml does not have: {group}"
    text = readme.read_text()
    assert "every command" in text.split("## Quickstart", 1)[1].split("##", 1)[0]   # the convention, stated once


@pytest.mark.slow
def test_setup_blocks_install_a_fresh_clone(tmp_path):
    """The README's Quickstart install, run as written in a copy of the tracked files (network:
    PyPI; minutes), then the package imports and serve.py answers --help in that venv."""
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in clone_entries():
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, clone / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        elif src.exists():
            shutil.copy2(src, clone / name)
    readme = ROOT / "README.md"
    setup = next(body for _, _, body, marker in command_blocks(readme) if marker and "setup" in marker)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(str(Path(sys.prefix))))
    proc = subprocess.run(["bash", "-eo", "pipefail", "-c", setup + "\npython -c 'import nanodspark' && "
                           "python serve.py --help | head -3"], cwd=clone, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "usage: serve.py" in proc.stdout


def test_the_harness_parses_and_matches():
    assert matches("a ... c\n\nx", "a b c\ny\nx") and not matches("x\na ... c", "a b c\nx")
    md = "\n".join(["text", "<!-- cpu: 5 s -->", "```bash", "echo hi", "```", "", "<!-- output -->", "```text",
                    "hi", "```", "<!-- cpu: 70 s, slow -->", "```python", "import sys", "```",
                    "1. a step", "   <!-- cpu: 9 s, slow, serves, needs: build/corpus -->", "   ```bash",
                    "   python serve.py --port 8123", "   ```", "<!-- gpu -->", "```bash", "python x.py", "```",
                    "```", "python y.py", "```", "```python", ">>> 1", "```"])
    tmp = ROOT / "build" / "test_doc_blocks.md"
    tmp.parent.mkdir(exist_ok=True)
    tmp.write_text(md)
    try:
        bs, cmds = blocks_of(tmp), command_blocks(tmp)
    finally:
        tmp.unlink()
    assert [(b.lang, b.seconds, b.slow, b.expected, b.serves, b.needs) for b in bs] == [
        ("bash", 5.0, False, "hi\n", False, []), ("python", 70.0, True, None, False, []),
        ("bash", 9.0, True, None, True, ["build/corpus"])]
    assert bs[2].code == "python serve.py --port 8123\n" and _port(bs[2]) == 8123
    assert [(info, marker is not None) for _, info, _, marker in cmds] == [
        ("bash", True), ("python", True), ("bash", True), ("bash", True), ("", False)]
    assert shutil.which("bash")
