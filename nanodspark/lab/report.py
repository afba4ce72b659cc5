"""The results page's tables, generated from the committed JSON: `python -m nanodspark.bench report`.

`walkthrough/09_results.md` quotes its main tables from files under `benchmarks/`. Each table
is a `Figure` in `FIGURES` (nanodspark/lab/report_figures.py): a name, the JSON file(s) it reads,
the hardware, and rows of cell templates. A cell template is text with queries in angle
brackets, `<expr|fmt>`: `expr` is a path into the JSON, or paths and numbers joined by
` + `, ` - `, ` * `, ` / ` (spaces around the operator), and `fmt` a Python format spec. A path
is dotted keys (`*`: the one value of a one-key dict; `@NAME`: the table of a cost file whose
model name is NAME); `key[a=1,b=null]` picks the one element of a list whose fields match
(`null` matches None, `*` anything but None; on a list of lists the field names are indices);
`key[3]` indexes. With several files, a path starts with the file's
alias, `http:sweep[...]`. `{name}` in a template is replaced by the row's parameter first.

On the page each table sits between `<!-- report:NAME -->` and `<!-- /report -->`, followed by a
line naming the hardware, the JSON file(s) and the command each recorded (its `command`,
`commands`, `argv`, or a cost table's `notes.command`), written as it runs today: a bench
script's `argv` as `python -m nanodspark.bench`, a recipe under `nanodspark.lab.recipes`, the
device's output folder as `$OUT`. A figure may give its command in words instead.

    python -m nanodspark.bench report            print every table
    python -m nanodspark.bench report --write    regenerate the blocks of the page in place
    python -m nanodspark.bench report --check    exit 1, naming the figure and its file, when a
                                                 block differs from what its JSON gives, a block
                                                 is missing, or a file records no command

Text outside the blocks is not checked: a number quoted in prose is the writer's to keep.
"""
from __future__ import annotations

import ast
import json
import operator
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

PAGE = "walkthrough/09_results.md"
BEGIN = re.compile(r"^<!-- report:(?P<name>[\w-]+) -->$")
END = "<!-- /report -->"


@dataclass
class Figure:
    name: str                       # the block's name on the page
    files: dict[str, str]           # alias -> path under the root; the first is the default
    hardware: str
    header: list[str]
    rows: list[list[str]]           # cell templates; with `over`, one row template
    over: list[dict] = field(default_factory=list)   # parameters of each row
    command: str | None = None      # instead of the recorded command(s), when they need words


def recorded_command(doc) -> str | None:
    """The command a result file records, or None."""
    if not isinstance(doc, dict):
        return None
    for key in ("command", "commands", "argv", "gpu_command"):
        if doc.get(key):
            c = doc[key]
            if isinstance(c, dict):
                c = "; ".join(str(v) for v in c.values())
            elif isinstance(c, list):
                c = " ".join(c) if key == "argv" else "; ".join(str(v) for v in c)
            return normalize(str(c))
    for v in doc.values():                        # a cost table: {key: {..., "notes": {"command"}}}
        if isinstance(v, dict) and isinstance(v.get("notes"), dict) and v["notes"].get("command"):
            return normalize(v["notes"]["command"])
    return None


def normalize(cmd: str) -> str:
    cmd = re.sub(r"^\S*/nanodspark/bench(?:_engine)?\.py ", "python -m nanodspark.bench ", cmd)
    cmd = re.sub(r"^train_heads\.py ", "python train_heads.py ", cmd)
    return cmd.replace("/root/out/", "$OUT/").replace("nanodspark.recipes.", "nanodspark.lab.recipes.")


# ----------------------------------------------------------------------------- queries
def _match(item, cond: str) -> bool:
    name, op, want = re.fullmatch(r"\s*([\w-]+)\s*(!=|=)\s*(.*?)\s*", cond).groups()
    if isinstance(item, list):
        got = item[int(name)] if int(name) < len(item) else None
    elif isinstance(item, dict):
        got = item.get(name)
    else:
        return False
    if want == "*":
        ok = got is not None
    elif want == "null":
        ok = got is None
    elif isinstance(got, bool) or not isinstance(got, (int, float)):
        ok = str(got).lower() == want.lower() if isinstance(got, bool) else str(got) == want
    else:
        try:
            ok = float(got) == float(want)
        except ValueError:
            ok = False
    return ok if op == "=" else not ok


def get(doc, path: str):
    """Follow a path (see the module docstring) into a JSON document."""
    value = doc
    for seg in re.findall(r"[^.\[\]]+(?:\[[^\]]*\])*|\[[^\]]*\]", path):
        key, *filters = re.findall(r"^[^\[]*|\[[^\]]*\]", seg)
        if key == "*":                                # the one value of a one-key dict (a cost table)
            if not isinstance(value, dict) or len(value) != 1:
                raise KeyError(f"'*' needs a dict of one key in {path!r}")
            value = next(iter(value.values()))
        elif key.startswith("@"):                     # a cost file's table by its model name
            found = [v for k, v in value.items() if k.split("|")[0] == key[1:]]
            if len(found) != 1:
                raise KeyError(f"{key!r} names {len(found)} tables in {path!r}")
            value = found[0]
        elif key and isinstance(value, list) and key.isdigit():
            value = value[int(key)]
        elif key:
            if not isinstance(value, dict) or key not in value:
                raise KeyError(f"no key {key!r} in {path!r}")
            value = value[key]
        for f in filters:
            inner = f[1:-1]
            if re.fullmatch(r"-?\d+", inner):
                value = value[int(inner)]
                continue
            found = [x for x in value if all(_match(x, c) for c in inner.split(","))]
            if len(found) != 1:
                raise KeyError(f"{f} matches {len(found)} elements in {path!r}")
            value = found[0]
    return value


OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(docs: dict, default: str, expr: str):
    """A path, or paths and numbers joined by + - * / (spaces around each operator)."""
    tokens = re.split(r" ([-+*/]) ", expr)
    values, text = [], []
    for i, tok in enumerate(tokens):
        if i % 2:
            text.append(tok)
            continue
        if re.fullmatch(r"-?\d+(\.\d+)?", tok):
            text.append(tok)
            continue
        alias, _, rest = tok.partition(":")
        doc, path = (docs[alias], rest) if rest and alias in docs and "[" not in alias else (docs[default], tok)
        values.append(get(doc, path))
        text.append(f"v{len(values) - 1}")
    if len(values) == 1 and len(text) == 1:
        return values[0]

    def calc(node):
        if isinstance(node, ast.BinOp):
            return OPS[type(node.op)](calc(node.left), calc(node.right))
        if isinstance(node, ast.Name):
            return values[int(node.id[1:])]
        return node.value
    return calc(ast.parse(" ".join(text), mode="eval").body)


def cell(docs: dict, default: str, template: str, params: dict) -> str:
    for k, v in params.items():
        template = template.replace("{" + k + "}", str(v))

    def one(m):
        expr, _, fmt = m.group(1).partition("|")
        value = evaluate(docs, default, expr.strip())
        return format(value, fmt) if fmt else str(value)
    return re.sub(r"<([^<>]+)>", one, template)


# ----------------------------------------------------------------------------- rendering
def load(fig: Figure, root: Path) -> dict:
    docs = {}
    for alias, rel in fig.files.items():
        path = root / rel
        if not path.exists():
            raise SystemExit(f"report: figure {fig.name!r}: {rel} does not exist")
        docs[alias] = json.loads(path.read_text())
    return docs


def render(fig: Figure, root: Path) -> list[str]:
    docs, default = load(fig, root), next(iter(fig.files))
    rows = [[cell(docs, default, t, p) for t in fig.rows[0]] for p in fig.over] if fig.over else \
        [[cell(docs, default, t, {}) for t in r] for r in fig.rows]
    lines = ["| " + " | ".join(fig.header) + " |",
             "|" + "|".join("---:" if i else "---" for i in range(len(fig.header))) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    if fig.command:
        source = f"`{next(iter(fig.files.values()))}`; command: {fig.command}"
    else:
        source = "; ".join(f"`{rel}`: `{recorded_command(docs[a])}`" for a, rel in fig.files.items())
    return lines + ["", f"{fig.hardware}. {source}"]


def blocks(text: str) -> dict[str, tuple[int, int]]:
    """name -> (first line inside, line of the end marker) of every generated block."""
    lines, out, start = text.split("\n"), {}, None
    for i, line in enumerate(lines):
        m = BEGIN.match(line.strip())
        if m:
            start = (m.group("name"), i + 1)
        elif line.strip() == END and start:
            out[start[0]] = (start[1], i)
            start = None
    return out


def problems(root: Path, page: Path, figures) -> list[str]:
    text = page.read_text()
    lines, found, bad = text.split("\n"), blocks(text), []
    for fig in figures:
        for alias, rel in fig.files.items():
            path = root / rel
            if not path.exists():
                bad.append(f"figure {fig.name!r}: {rel} does not exist")
            elif recorded_command(json.loads(path.read_text())) is None and not fig.command:
                bad.append(f"figure {fig.name!r}: {rel} records no command")
        if fig.name not in found:
            bad.append(f"figure {fig.name!r} ({', '.join(fig.files.values())}): no block on {page.name}")
            continue
        a, b = found[fig.name]
        try:
            want, have = render(fig, root), lines[a:b]
        except (SystemExit, KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as e:
            bad.append(f"figure {fig.name!r} ({', '.join(fig.files.values())}) cannot be read from its JSON: {e}")
            continue
        if want != have:
            diff = next((i for i, (w, h) in enumerate(zip(want, have)) if w != h), min(len(want), len(have)))
            bad.append(f"figure {fig.name!r} ({', '.join(fig.files.values())}) differs from its JSON at block "
                       f"line {diff + 1}:\n  page: {have[diff] if diff < len(have) else '(missing)'}\n"
                       f"  json: {want[diff] if diff < len(want) else '(nothing)'}")
    for name in sorted(set(found) - {f.name for f in figures}):
        bad.append(f"block {name!r} on {page.name} has no figure in nanodspark/lab/report_figures.py")
    return bad


def write(root: Path, page: Path, figures) -> int:
    text = page.read_text()
    lines, by_name = text.split("\n"), {f.name: f for f in figures}
    for name, (a, b) in sorted(blocks(text).items(), key=lambda kv: -kv[1][0]):
        if name in by_name:
            lines[a:b] = render(by_name[name], root)
    page.write_text("\n".join(lines))
    return 0


def add_report_args(p):
    p.add_argument("--check", action="store_true",
                   help="compare every generated block of the page with its JSON; exit 1 on a difference")
    p.add_argument("--write", action="store_true", help="regenerate the page's blocks in place")
    p.add_argument("--only", nargs="*", default=None, help="print only these figures")
    p.add_argument("--root", default=".", help="the repository root")
    p.add_argument("--page", default=PAGE, help="the page, under the root")


def report(args) -> int:
    from .report_figures import FIGURES
    root = Path(args.root)
    page = root / args.page
    if args.check:
        bad = problems(root, page, FIGURES)
        for b in bad:
            print(f"report --check: {b}", file=sys.stderr)
        if not bad:
            print(f"report --check: {len(FIGURES)} figures of {args.page} match their JSON")
        return 1 if bad else 0
    if args.write:
        return write(root, page, FIGURES)
    for fig in FIGURES:
        if args.only is None or fig.name in args.only:
            print(f"## {fig.name}\n\n" + "\n".join(render(fig, root)) + "\n")
    return 0
