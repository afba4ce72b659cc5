"""`python serve.py [--model DIR] [engine flags]`: serve a model over an OpenAI-compatible HTTP API.

The idea
--------
Load one `LLMEngine`, wrap it in the FastAPI app of `nanodspark/server/app.py`, and run it with
uvicorn. With no arguments it serves the embedded default model (`nanodspark/assets/default`)
on CUDA if present, else the CPU, at http://127.0.0.1:8000, and prints a curl to paste.

Flags are not written out by hand: every field of `EngineConfig` becomes a flag
(`max_num_seqs` -> `--max-num-seqs`, a bool `enable_prefix_cache` -> `--enable-prefix-cache` /
`--no-enable-prefix-cache`, a tuple -> a comma-separated list), with the field's default and its
one-line comment as help. So a new engine knob is a server flag the moment it exists. A string
field whose comment lists its values (`# "static" | "compact" | "cap-accept"`) gets those as
argparse `choices`, so the comment in config.py is the one list; `--device` and `--dtype`, whose
comments do not list values, are checked against `DEVICE_CHOICES` and `DTYPE_CHOICES` below
(tests/test_hardening.py checks those against the engine).

Server-only flags: `--model`, `--host`, `--port`, `--max-queue`, `--served-model-name`,
`--log-level`, and the input limits `--max-body-bytes` (413 beyond it) and `--prepare-threads`
(the worker threads that parse and tokenize request bodies). The limits are server-only, so
they are arguments of `create_app`, not fields of `EngineConfig` (chapter 08, section 9).

Parallel: `--tensor-parallel-size N [--expert-parallel-size M]` starts N-1 worker processes
itself (distributed.py); under `torchrun --nproc-per-node N serve.py ...` rank 0 serves and the
other ranks run forwards. A lost worker stops the server with exit status 1 and the error.

Invariants: binds 127.0.0.1 unless `--host` says otherwise; a missing model is a one-line error
naming `--model` (exit status 2), not a traceback; SIGINT/SIGTERM stop uvicorn, whose lifespan
exit stops and joins the engine thread.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import shlex
import signal
import sys
import types
import typing
from pathlib import Path

from nanodspark.config import EngineConfig

SERVER_FLAGS = ("model", "host", "port", "max_queue", "served_model_name", "log_level", "max_body_bytes",
                "prepare_threads")
# Values of the two enumerated fields whose config.py comment does not list them (the engine's
# pick_device / pick_dtype accept these; "cuda:N" picks a GPU).
DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def _field_help() -> dict[str, str]:
    """The `# comment` of each EngineConfig field, read from its source: the one at the end of
    its line, or, for a field with none, a comment line right below it."""
    try:
        lines = inspect.getsource(EngineConfig).splitlines()
    except (OSError, TypeError):
        return {}
    helps = {}
    for i, line in enumerate(lines):
        m = re.match(r"^\s+(\w+):[^#]*?(?:#\s*(.*))?$", line)
        if not m or line.lstrip().startswith("#"):
            continue
        text = m.group(2)
        if text is None and i + 1 < len(lines):
            below = re.match(r"^\s+#\s*(?!---)(.*)$", lines[i + 1])
            text = below.group(1) if below else None
        if text:
            helps[m.group(1)] = text.strip()
    return helps


def _listed_choices(comment: str) -> list[str] | None:
    """The values a field comment enumerates as `"a" | "b" | "c"`, or None."""
    if "|" not in comment:
        return None
    values = re.findall(r'"([^"]+)"', comment)
    return values if len(values) >= 2 else None


def _device(name: str) -> str:
    if name in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", name):
        return name
    raise argparse.ArgumentTypeError(f"invalid choice: {name!r} (choose from {', '.join(DEVICE_CHOICES)})")


def _sequence(tp):
    """A comma-separated (or JSON) list -> a tuple of the element type of `tp` (tuple[int, ...])."""
    elem = next((a for a in typing.get_args(tp) if a is not Ellipsis), str)

    def parse(text: str):
        text = text.strip()
        items = json.loads(text) if text.startswith("[") else [t for t in text.split(",") if t.strip()]
        try:
            return tuple(elem(x) for x in items)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {elem.__name__}, got {text!r}")
    return parse


def _scalar(tp):
    """The field type with `X | None` unwrapped to `X` (a `tuple[int, ...]` stays as it is);
    `int | str` is read as text (EngineConfig turns digits into an int)."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return tp
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return (str if str in args else args[0]) if args else tp


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="Serve a model with nanodspark over an OpenAI-compatible API "
                    "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).")
    ap.add_argument("--model", default=None,
                    help="a Hugging Face checkpoint directory; default: the embedded nanodspark/assets/default")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1; 0.0.0.0 exposes the server to the network)")
    ap.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    ap.add_argument("--max-queue", type=int, default=0,
                    help="most requests in flight in the server; beyond it 429. 0 (default) = max_num_seqs + max_waiting")
    ap.add_argument("--served-model-name", default=None,
                    help="the model id clients send; default: the model directory's name")
    ap.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                    help="uvicorn log level (default: info)")
    from nanodspark.server.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_PREPARE_THREADS
    ap.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="INT",
                    help=f"largest request body accepted; larger ones get 413 before they are read "
                         f"(default: {DEFAULT_MAX_BODY_BYTES})")
    ap.add_argument("--prepare-threads", type=int, default=DEFAULT_PREPARE_THREADS, metavar="INT",
                    help="worker threads that parse, validate and tokenize request bodies, off the event loop "
                         f"and the engine thread (default: {DEFAULT_PREPARE_THREADS})")
    eng = ap.add_argument_group("engine (fields of nanodspark.config.EngineConfig)")
    helps = _field_help()
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name == "use_tqdm":
            continue
        flag = "--" + f.name.replace("_", "-")
        tp = _scalar(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else "(computed)"
        # SUPPRESS: a flag not given leaves the field to EngineConfig's own default.
        kw = dict(dest=f.name, default=argparse.SUPPRESS, help=f"{helps.get(f.name, '')} (default: {default})")
        if tp is bool:
            eng.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif f.name == "device":
            eng.add_argument(flag, type=_device, metavar="{" + ",".join(DEVICE_CHOICES) + "}", **kw)
        elif f.name == "dtype":
            eng.add_argument(flag, choices=DTYPE_CHOICES, **kw)
        elif tp is str and _listed_choices(helps.get(f.name, "")):
            eng.add_argument(flag, choices=_listed_choices(helps[f.name]), **kw)
        elif tp in (int, float, str):
            eng.add_argument(flag, type=tp, metavar=tp.__name__.upper(), **kw)
        elif typing.get_origin(tp) in (tuple, list):
            eng.add_argument(flag, type=_sequence(tp), metavar="LIST", **kw)
        else:  # a structured field: give it as JSON
            eng.add_argument(flag, type=json.loads, metavar="JSON", **kw)
    return ap


def engine_config(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    kwargs = {k: v for k, v in vars(args).items() if k in names}
    return EngineConfig.from_kwargs(**kwargs, use_tqdm=False)


def curl_example(url: str, model: str) -> str:
    body = ('{"model": "%s", "messages": [{"role": "user", "content": "Hello! Who are you?"}], '
            '"max_tokens": 64}') % model
    return f"curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d {shlex.quote(body)}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from nanodspark.loader import DEFAULT_MODEL_DIR
    model_dir = Path(args.model) if args.model else DEFAULT_MODEL_DIR
    if not (model_dir / "config.json").is_file():
        what = "the embedded default model" if args.model is None else "the model"
        print(f"error: {what} was not found at {model_dir} (no config.json). "
              "Pass --model PATH to a Hugging Face checkpoint directory (config.json + *.safetensors).",
              file=sys.stderr)
        return 2
    try:
        cfg = engine_config(args)
    except (TypeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from nanodspark.llm import build_engine
    from nanodspark.server import HTTPServer, create_app

    try:
        engine = build_engine(args.model, cfg)
    except (FileNotFoundError, ValueError) as e:  # CheckpointError is a ValueError
        print(f"error: could not load {model_dir}: {e}\nPass --model PATH to a Hugging Face checkpoint "
              "directory.", file=sys.stderr)
        return 2
    name = args.served_model_name or ("nanodspark-default" if args.model is None else model_dir.resolve().name)
    app = create_app(engine, model_name=name, max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                     prepare_threads=args.prepare_threads)
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{args.port}"

    par = engine.parallel
    where = f"{engine.device}" if par is None else f"{par.world} {engine.device.type} ranks (tensor parallel)"
    workers = "" if par is None or not par.procs else \
        "tensor-parallel workers: " + ", ".join(f"rank {i + 1} pid {p.pid}" for i, p in enumerate(par.procs)) + "\n"

    def banner():
        print(f"\nnanodspark is serving {name!r} on {where} at {url}/v1\n{workers}"
              f"Try:\n  {curl_example(url, name)}\n", flush=True)

    server = HTTPServer(app, on_ready=banner, host=args.host, port=args.port, log_level=args.log_level,
                        timeout_graceful_shutdown=5)
    # uvicorn handles SIGINT/SIGTERM itself (graceful shutdown, then the lifespan exit joins the
    # engine thread) and afterwards re-raises the signal into the handler found before it started.
    # Make that handler a KeyboardInterrupt for SIGTERM too, so both end here with status 0.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        app.state.server.loop.stop()  # a no-op after a clean lifespan exit; joins after a forced one
        engine.shutdown()             # the tensor-parallel workers, if any
    error = app.state.server.loop.error
    if error is not None:
        print(f"error: the engine stopped: {error}", file=sys.stderr)
        return 1
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
