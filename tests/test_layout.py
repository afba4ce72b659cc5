"""The house has three rooms (walkthrough/00_design.md): the core at the top of `nanodspark/`,
the server in `nanodspark/server/`, the lab in `nanodspark/lab/`. The core never imports the
other two; this walks every import of every core module (function-level imports included) with
`ast`, so a new core file is checked the day it is added."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "nanodspark"
ENTRY_POINTS = {"bench.py", "course.py"}   # `python -m nanodspark.bench` / `.course`: hand their arguments to the lab
CORE = sorted(p for p in PKG.glob("*.py") if p.name not in ENTRY_POINTS)
ROOMS = ("nanodspark.lab", "nanodspark.server")


def imported_modules(source: str, package: str) -> set[str]:
    """Absolute names of every module that `source` (a module of `package`) imports: relative
    imports resolved, `from . import x` counted as importing `package.x`, and
    `importlib.import_module("...")` / `__import__("...")` with a literal name too."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)   # `from nanodspark import lab`
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(str(node.args[0].value))
    return names


def imports_of(path: Path) -> set[str]:
    return imported_modules(path.read_text(), ".".join(path.relative_to(ROOT).parts[:-1]))


def in_a_room(module: str) -> bool:
    return any(module == r or module.startswith(r + ".") for r in ROOMS)


def test_the_walk_sees_every_kind_of_import():
    assert "nanodspark.runner" in imports_of(PKG / "engine.py")                     # `from .runner import`
    assert "nanodspark.swa_replay" in imports_of(PKG / "engine.py")                 # inside a method
    assert "nanodspark.cost_table" in imports_of(PKG / "lab" / "profile_stats.py")  # `from ..cost_table`
    for src in ("from .lab import plots", "from . import server", "import nanodspark.lab.workloads",
                "def f():\n    from .lab.bench import main", "import importlib\nimportlib.import_module('nanodspark.lab')"):
        assert any(in_a_room(m) for m in imported_modules(src, "nanodspark")), src
    assert not any(in_a_room(m) for m in imported_modules("from .loader import EOT\nimport labrador", "nanodspark"))


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.name)
def test_core_never_imports_the_lab_or_the_server(path):
    bad = sorted(m for m in imports_of(path) if in_a_room(m))
    assert not bad, f"core module nanodspark/{path.name} imports {bad}; core must not depend on the lab or the server"


def core_graph() -> dict[str, set[str]]:
    """Core module -> the core modules it imports (function-level imports included)."""
    names = {f"nanodspark.{p.stem}" for p in CORE}
    return {f"nanodspark.{p.stem}": {m for m in imports_of(p) if m in names} - {f"nanodspark.{p.stem}"}
            for p in CORE if p.stem != "__init__"}


def test_no_import_circle_in_the_core():
    """Module A importing B importing ... A, even through an import inside a function, is a circle
    (engine -> distributed -> loader -> distributed -> engine was one)."""
    graph, state, stack = core_graph(), {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"
    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert "nanodspark.engine" in graph["nanodspark.llm"]             # the walk sees the edges


def test_the_rooms_are_packages_that_pip_installs():
    """Every package under nanodspark/ is listed in pyproject.toml, so `pip install .` ships it."""
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"([\w.]+)"', re.search(r"^packages = \[(.*)\]$", text, re.M).group(1)))
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in PKG.rglob("__init__.py")}
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
    assert {"nanodspark.server", "nanodspark.lab", "nanodspark.lab.recipes"} <= found


def test_moved_names_are_found_in_their_own_modules():
    """engine.py no longer re-exports what moved out of it: each name is imported from its home."""
    import nanodspark
    import nanodspark.engine as engine
    import nanodspark.request as request
    import nanodspark.scheduler as scheduler
    for name in ("Status", "SpecStats", "Request", "RequestOutput", "GenerationOutput"):
        assert getattr(request, name).__module__ == "nanodspark.request"
    assert scheduler.Scheduler.__module__ == "nanodspark.scheduler"
    assert nanodspark.RequestOutput is request.RequestOutput
    assert not hasattr(engine, "__all__")


def test_server_public_names():
    pytest.importorskip("fastapi")
    import nanodspark.server as server
    for name in ("create_app", "OpenAIServer", "HTTPServer", "EngineLoop", "Metrics", "APIError",
                 "bad_request", "get_field", "message_text", "sse_event", "usage_of", "parse_sampling"):
        assert name in server.__all__ and hasattr(server, name)


@pytest.mark.parametrize("name, command", [("bench", "dspark-table"), ("course", "grade")])
def test_entry_point_runs_the_lab_cli(capsys, name, command):
    import importlib
    entry = importlib.import_module(f"nanodspark.{name}")
    with pytest.raises(SystemExit) as e:
        entry.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m nanodspark.{name}") and command in out


def test_course_entry_point_lists_the_units(capsys):
    from nanodspark import course
    assert course.main(["list"]) == 0 and "eplb" in capsys.readouterr().out


@pytest.mark.parametrize("script", sorted((ROOT / "tests" / "device").glob("*.sh")), ids=lambda p: p.name)
def test_device_scripts_parse_and_refuse_an_unknown_stage(script):
    """The device scripts run only on the GPU machine, where a syntax error costs a call and its
    warm window (the SmolLM2 chain loses its carried teacher). Check them here: `bash -n`, and a
    staged script must refuse a stage it does not know before it does anything."""
    import subprocess
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    if "stage=" in script.read_text():
        r = subprocess.run(["bash", str(script), "no-such-stage"], capture_output=True, text=True)
        assert r.returncode == 2 and "unknown stage" in r.stderr


DOCSTRING_LINES = 40
CORE_CODE = sorted([*PKG.glob("*.py"), *(PKG / "server").glob("*.py"), *(ROOT / "kernels").glob("*.py")])
OUTSIDE = ("components.md", "ARCHITECTURE.md", "../shared", "§")   # files outside the repo, chapter sections


@pytest.mark.parametrize("path", CORE_CODE, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_core_module_docstrings_fit_a_screen(path):
    """A module docstring says the idea, the invariants and the paper section; teaching prose
    goes to the file's walkthrough chapter."""
    tree = ast.parse(path.read_text())
    if ast.get_docstring(tree) is None:
        return
    doc = tree.body[0]
    lines = doc.end_lineno - doc.lineno + 1
    assert lines <= DOCSTRING_LINES, f"{path.relative_to(ROOT)}: module docstring of {lines} lines"


@pytest.mark.parametrize("path", CORE_CODE, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_core_code_cites_only_what_the_repository_has(path):
    """Comments and docstrings point at files of this repository and at chapters by number or
    name: a file outside it is not there for a reader, and a chapter's section numbers move."""
    text = path.read_text()
    bad = [(i, s) for i, line in enumerate(text.splitlines(), 1) for s in OUTSIDE if s in line]
    assert not bad, f"{path.relative_to(ROOT)} cites " + ", ".join(f"{s!r} (line {i})" for i, s in bad)


def test_the_design_chapter_cites_only_the_repository():
    assert "ARCHITECTURE.md" not in (ROOT / "walkthrough" / "00_design.md").read_text()
