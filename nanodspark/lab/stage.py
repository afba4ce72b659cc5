"""Carry large files to the device in checksummed pieces: pack here, take each call, assemble there.

    python -m nanodspark.lab.stage pack build/smol --name smol_target --piece-mib 20   # here, once
    python -m nanodspark.lab.stage plan --name smol_target                             # the calls to make
    python -m nanodspark.lab.stage resplit --name smol_target --piece-mib 16           # the tree grew
    python -m nanodspark.lab.stage take                                                # device, every call
    python -m nanodspark.lab.stage assemble --name smol_target --into /tmp/t/smol      # device, last call

The idea
    A device call carries the working tree and at most 64 MiB in all; a warm device keeps what a
    call left outside the tree (under /tmp) until it goes back. So a folder too large for one
    call is packed into one tar, cut into pieces of `--piece-mib`, each with its sha256 in a
    manifest (`<name>.json`, small: every call carries it). Each call carries the manifest and
    the next pieces (`.carry/stage/`, which `.gitignore` keeps out of git, and the device keeps
    while warm), and `take` copies every piece present into `/tmp/stage` (outside the tree, where
    no later call's copy can replace it), checking its sha256 as it lands. `assemble` then joins
    the pieces, checks the whole tar's sha256, unpacks it and checks every file's. The same
    `pack` runs on the device to bring a folder back through $OUT (files of at most 16 MiB).

Invariants
    * Nothing is unpacked unless every piece and the whole tar match the manifest; a missing piece
      is named, with the call that carries it (`plan`). Exit status 3: a checksum differs; 4: a
      piece is missing.
    * Pieces are byte ranges of one uncompressed tar (`--xz` compresses it first), in order; a
      piece is never larger than `--piece-mib` MiB.
    * Only the standard library: it runs on a bare device before anything is installed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

CALL_LIMIT = 64 * 2**20            # what one device call carries, the working tree included
DEFAULT_SRC = Path(".carry/stage")
DEFAULT_DST = Path("/tmp/stage")


def sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def pack(folders: list[Path], name: str, out: Path, piece_mib: float, xz: bool = False) -> dict:
    """Tar `folders` (each under its own name), cut it into pieces, write `<name>.json`."""
    out.mkdir(parents=True, exist_ok=True)
    files = []
    buf = out / f"{name}.tar"
    with tarfile.open(buf, "w") as tar:
        for folder in folders:
            folder = Path(folder)
            for p in sorted(folder.rglob("*")) if folder.is_dir() else [folder]:
                if p.is_file():
                    arc = str(Path(folder.name) / p.relative_to(folder)) if folder.is_dir() else folder.name
                    tar.add(p, arcname=arc, recursive=False)
                    files.append({"path": arc, "bytes": p.stat().st_size, "sha256": sha256(p)})
    if xz:
        with open(buf, "rb") as f, lzma.open(out / f"{name}.tar.xz", "wb", preset=6) as g:
            shutil.copyfileobj(f, g, 1 << 22)
        buf.unlink()
        buf = out / f"{name}.tar.xz"
    pieces = _cut(buf, name, out, piece_mib)
    manifest = {"name": name, "format": "tar.xz" if xz else "tar", "bytes": buf.stat().st_size, "sha256": sha256(buf),
                "piece_mib": piece_mib, "pieces": pieces, "files": files}
    buf.unlink()
    (out / f"{name}.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def _cut(data_path: Path, name: str, out: Path, piece_mib: float) -> list[dict]:
    """Cut one file into `<name>.000`, `.001`, ... of at most `piece_mib` MiB; their manifest entries."""
    step = int(piece_mib * 2**20)
    if step <= 0:
        raise ValueError("--piece-mib must be positive")
    for old in out.glob(f"{name}.[0-9][0-9][0-9]"):
        old.unlink()
    pieces, size = [], data_path.stat().st_size
    with open(data_path, "rb") as f:
        for i in range(max(1, -(-size // step))):
            data = f.read(step)
            (out / f"{name}.{i:03d}").write_bytes(data)
            pieces.append({"file": f"{name}.{i:03d}", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return pieces


def resplit(name: str, src: Path, piece_mib: float) -> dict:
    """Cut a packed folder's pieces again at another size (the tree grew, or the default model's
    shards left it), without packing again: joined and checked first."""
    m = json.loads((src / f"{name}.json").read_text())
    joined = src / f"{name}.joined"
    h = hashlib.sha256()
    with open(joined, "wb") as out:
        for p in m["pieces"]:
            data = (src / p["file"]).read_bytes()
            if hashlib.sha256(data).hexdigest() != p["sha256"]:
                raise SystemExit(f"error: {src / p['file']} does not match its manifest")
            h.update(data)
            out.write(data)
    if h.hexdigest() != m["sha256"]:
        raise SystemExit(f"error: the joined {name} does not match its manifest")
    m["pieces"], m["piece_mib"] = _cut(joined, name, src, piece_mib), piece_mib
    joined.unlink()
    (src / f"{name}.json").write_text(json.dumps(m, indent=1))
    return m


def _manifests(src: Path, name: str | None) -> list[dict]:
    paths = [src / f"{name}.json"] if name else sorted(src.glob("*.json"))
    found = [json.loads(p.read_text()) for p in paths if p.exists()]
    if not found:
        raise SystemExit(f"no manifest {'for ' + name + ' ' if name else ''}in {src}")
    return found


def take(src: Path = DEFAULT_SRC, dst: Path = DEFAULT_DST, name: str | None = None) -> dict:
    """Copy the pieces present in `src` (and their manifests) into `dst`, each checked. Returns
    {name: [pieces now in dst, of how many]}; raises SystemExit(3) on a checksum mismatch."""
    dst.mkdir(parents=True, exist_ok=True)
    report = {}
    for m in _manifests(src, name):
        (dst / f"{m['name']}.json").write_text(json.dumps(m, indent=1))
        for p in m["pieces"]:
            here, there = src / p["file"], dst / p["file"]
            if here.exists() and not (there.exists() and there.stat().st_size == p["bytes"]):
                if sha256(here) != p["sha256"]:
                    print(f"error: {here} does not match its manifest (sha256)", file=sys.stderr)
                    raise SystemExit(3)
                shutil.copyfile(here, there)
        have = [p["file"] for p in m["pieces"] if (dst / p["file"]).exists()]
        report[m["name"]] = (len(have), len(m["pieces"]))
        print(f"{m['name']}: {len(have)} of {len(m['pieces'])} pieces in {dst}", flush=True)
    return report


def assemble(name: str, into: Path, dst: Path = DEFAULT_DST) -> Path:
    """Join `name`'s pieces in `dst`, check them and the whole, unpack into `into`, check every
    file. Returns `into`."""
    m = json.loads((dst / f"{name}.json").read_text())
    missing = [p["file"] for p in m["pieces"] if not (dst / p["file"]).exists()]
    if missing:
        print(f"error: {name} lacks {len(missing)} piece(s): {', '.join(missing)} "
              f"(carry them on a call that runs `take`)", file=sys.stderr)
        raise SystemExit(4)
    whole = hashlib.sha256()
    joined = dst / f"{name}.joined"
    with open(joined, "wb") as out:
        for p in m["pieces"]:
            data = (dst / p["file"]).read_bytes()
            if hashlib.sha256(data).hexdigest() != p["sha256"]:
                print(f"error: piece {p['file']} of {name} does not match its manifest", file=sys.stderr)
                raise SystemExit(3)
            whole.update(data)
            out.write(data)
    if whole.hexdigest() != m["sha256"]:
        print(f"error: the joined {name} does not match its manifest", file=sys.stderr)
        raise SystemExit(3)
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(joined, "r:xz" if m["format"] == "tar.xz" else "r:") as tar:
        for member in tar:
            if member.name.startswith("/") or ".." in Path(member.name).parts or not member.isfile():
                raise SystemExit(f"error: refusing to unpack {member.name!r}")
            if hasattr(tarfile, "data_filter"):
                tar.extract(member, into, filter="data")
            else:
                tar.extract(member, into)
    joined.unlink()
    for f in m["files"]:
        if sha256(into / f["path"]) != f["sha256"]:
            print(f"error: {into / f['path']} does not match its manifest", file=sys.stderr)
            raise SystemExit(3)
    print(f"{name}: {len(m['files'])} files checked in {into}", flush=True)
    return into


def tree_bytes(root: Path = Path(".")) -> int:
    """What a device call sends besides carried paths: tracked files and untracked ones git does
    not ignore (0 outside a git checkout)."""
    try:
        names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                               capture_output=True, check=True).stdout.split(b"\0")
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum((root / n.decode()).stat().st_size for n in names if n and (root / n.decode()).is_file())


def plan(names: list[str], src: Path = DEFAULT_SRC, tree: int | None = None, limit: int = CALL_LIMIT,
         last: list[str] = ()) -> list[list[str]]:
    """The carry list of each call: every call carries the manifests, then as many pieces (in
    order) as fit beside the working tree (`tree` bytes) under the call's limit and its 8 paths;
    `last` (paths the working call needs besides, e.g. data) goes with the last pieces."""
    ms = [m for n in names for m in _manifests(src, n)]
    tree = tree_bytes() if tree is None else tree
    fixed = [str(src / f"{m['name']}.json") for m in ms]
    room = limit - tree - sum((src / f"{m['name']}.json").stat().st_size for m in ms) - (1 << 20)
    calls, cur, used = [], [], 0
    for m in ms:
        for p in m["pieces"]:
            if p["bytes"] > room:
                raise SystemExit(f"a piece of {p['bytes'] / 2**20:.1f} MiB does not fit beside a working tree of "
                                 f"{tree / 2**20:.1f} MiB: pack with a smaller --piece-mib")
            if used + p["bytes"] > room or len(fixed) + len(cur) >= 8:
                calls.append(fixed + cur)
                cur, used = [], 0
            cur.append(str(src / p["file"]))
            used += p["bytes"]
    extra = sum(_size(Path(x)) for x in last)
    if cur and (used + extra > room or len(fixed) + len(cur) + len(last) > 8):
        calls.append(fixed + cur)
        cur = []
    calls.append(fixed + cur + list(last))
    return calls


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else \
        (path.stat().st_size if path.exists() else 0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nanodspark.lab.stage", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="tar folders, cut into checksummed pieces")
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--name", required=True)
    p.add_argument("--out", type=Path, default=DEFAULT_SRC)
    p.add_argument("--piece-mib", type=float, default=20.0,
                   help="piece size (a call carries 64 MiB with the working tree; $OUT takes 16 MiB files)")
    p.add_argument("--xz", action="store_true", help="compress the tar first (slow; weights compress little)")
    t = sub.add_parser("take", help="copy the pieces present into --dst, checked (device, every call)")
    t.add_argument("--src", type=Path, default=DEFAULT_SRC)
    t.add_argument("--dst", type=Path, default=DEFAULT_DST)
    t.add_argument("--name", default=None)
    a = sub.add_parser("assemble", help="join, check and unpack (device, once every piece was taken)")
    a.add_argument("--name", required=True)
    a.add_argument("--into", type=Path, required=True)
    a.add_argument("--dst", type=Path, default=DEFAULT_DST)
    r = sub.add_parser("resplit", help="cut packed pieces again at another --piece-mib (no new tar)")
    r.add_argument("--name", required=True)
    r.add_argument("--src", type=Path, default=DEFAULT_SRC)
    r.add_argument("--piece-mib", type=float, required=True)
    q = sub.add_parser("plan", help="print the carry list of each device call")
    q.add_argument("--name", nargs="+", required=True)
    q.add_argument("--src", type=Path, default=DEFAULT_SRC)
    q.add_argument("--last", nargs="*", default=[], help="paths the last call carries besides (data, a corpus)")
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        m = pack(args.folders, args.name, args.out, args.piece_mib, args.xz)
        print(f"{args.name}: {m['bytes'] / 2**20:.1f} MiB in {len(m['pieces'])} pieces, {len(m['files'])} files, "
              f"manifest {args.out / (args.name + '.json')}")
    elif args.cmd == "take":
        take(args.src, args.dst, args.name)
    elif args.cmd == "resplit":
        m = resplit(args.name, args.src, args.piece_mib)
        print(f"{args.name}: {len(m['pieces'])} pieces of at most {args.piece_mib:g} MiB")
    elif args.cmd == "assemble":
        assemble(args.name, args.into, args.dst)
    else:
        tree = tree_bytes()
        print(f"working tree {tree / 2**20:.1f} MiB; each call also carries the manifests and runs `take`:")
        for i, carry in enumerate(plan(args.name, args.src, tree, last=args.last), 1):
            print(f"call {i}: carry {json.dumps(carry)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
