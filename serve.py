"""`python serve.py [MODEL] [flags]`: serve a model over an OpenAI-compatible HTTP API.

The idea
--------
Check that the port is free, start the engine core (`nanodspark/server/core.py`: the engine in a
process of its own, apart from HTTP and text) and wait until it is ready, log a start-up summary
(model, drafter, dtype, device, KV blocks and tokens, concurrency, CUDA graphs), then serve the
FastAPI app of `nanodspark/server/app.py` with uvicorn (and, with `--api-server-count N`, from
N-1 more API processes on the same port). With no model it serves the embedded
default pair (`nanodspark/assets/default`) on CUDA if present, else the CPU, at
http://127.0.0.1:8000, and prints a curl to paste. `--single-process` runs the engine in a thread
of the server's process instead (one interpreter lock for both; simpler to read and debug).

Flags are not written out by hand: every field of `EngineConfig` becomes a flag from its
metadata (`max_num_seqs` -> `--max-num-seqs`, a bool -> `--x` / `--no-x`, a `Literal` -> choices,
a tuple -> a comma-separated list), under its group, with its help and default. vLLM's
spellings are aliases: `--enable-prefix-caching`, `--gpu-memory-utilization` (of
`--kv-memory-fraction`) and `--enforce-eager` (`--no-cuda-graphs`). The model may be given as
the first argument, as `vllm serve MODEL` takes it, or as `--model`.

Server-only flags: `--host`, `--port`, `--api-key` (or the environment variable
`NANODSPARK_API_KEY`: Bearer auth on every /v1 route), `--served-model-name`, `--max-queue`,
`--max-body-bytes`, `--prepare-threads`, `--prepare-inline-bytes`, `--log-level`,
`--single-process`, `--api-server-count N` (N API processes on the one engine core, sharing the
port: nanodspark/server/api_servers.py). They are not fields of `EngineConfig`.

Parallel: `--tensor-parallel-size N [--expert-parallel-size M]`: the engine core starts N-1
worker processes itself (distributed.py); under `torchrun --nproc-per-node N serve.py ...` the
engine runs in the serving process of rank 0 and the other ranks run forwards. A lost worker
stops the server with exit status 1 and the error.

Invariants: binds 127.0.0.1 unless `--host` says otherwise; a busy port, a missing model or a
bad setting is a one-line error (exit status 2) before anything is loaded; SIGINT/SIGTERM stop
uvicorn, whose lifespan exit stops the engine core (or thread), so no process outlives the server.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import time
import types
import typing
from pathlib import Path

from nanodspark.config import GROUPS, EngineConfig

SERVER_FLAGS = ("model", "model_tag", "host", "port", "api_key", "max_queue", "served_model_name", "log_level",
                "max_body_bytes", "prepare_threads", "prepare_inline_bytes", "single_process", "api_server_count")
API_KEY_ENV = "NANODSPARK_API_KEY"
# `--device` takes "cuda:N" too, so it is checked by a function, not a Literal.
DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
DTYPE_CHOICES = typing.get_args(typing.get_type_hints(EngineConfig)["dtype"])
VLLM_ALIASES = {"enable_prefix_cache": "--enable-prefix-caching", "kv_memory_fraction": "--gpu-memory-utilization"}

log = logging.getLogger("nanodspark.server")


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


def _optional(tp):
    """`X | None` -> X; other types as they are."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _shown(default) -> str:
    if isinstance(default, tuple):
        return ",".join(str(x) for x in default)
    return "unset" if default is None else str(default)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="Serve a model with nanodspark over an OpenAI-compatible API (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /version, /health, /metrics).")
    from nanodspark.server.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_PREPARE_INLINE_BYTES, DEFAULT_PREPARE_THREADS
    srv = ap.add_argument_group("server")
    srv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                     help="a Hugging Face checkpoint directory (as `vllm serve MODEL`; or --model); "
                          "default: the embedded nanodspark/assets/default")
    srv.add_argument("--model", default=None, help="the same, as a flag")
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to bind (default: 127.0.0.1; 0.0.0.0 exposes the server to the network)")
    srv.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    srv.add_argument("--api-key", default=None,
                     help=f"every /v1 request must send 'Authorization: Bearer KEY' (else 401); /health, /metrics, "
                          f"/version, /tokenize, /detokenize stay open (default: ${API_KEY_ENV}, else no key)")
    srv.add_argument("--served-model-name", default=None,
                     help="the model id clients send (default: the model directory's name)")
    srv.add_argument("--max-queue", type=int, default=0,
                     help="most requests in flight in the server; beyond it 429 (default: 0 = max_num_seqs + "
                          "max_waiting)")
    srv.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="INT",
                     help=f"largest request body accepted; larger ones get 413 before they are read "
                          f"(default: {DEFAULT_MAX_BODY_BYTES})")
    srv.add_argument("--prepare-threads", type=int, default=DEFAULT_PREPARE_THREADS, metavar="INT",
                     help="worker threads that parse, validate and tokenize request bodies, off the event loop "
                          f"(default: {DEFAULT_PREPARE_THREADS})")
    srv.add_argument("--prepare-inline-bytes", type=int, default=DEFAULT_PREPARE_INLINE_BYTES, metavar="INT",
                     help="bodies up to this size are prepared on the event loop, cheaper than a thread hop; "
                          f"0: every body in a worker thread (default: {DEFAULT_PREPARE_INLINE_BYTES})")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                     help="log level of the server, the engine core and uvicorn (default: info)")
    srv.add_argument("--api-server-count", type=int, default=1, metavar="INT",
                     help="API server processes in front of the one engine core, sharing the port: more of "
                          "them serve more concurrent streams (HTTP, JSON, text each in its own process; "
                          "default: 1)")
    srv.add_argument("--single-process", action="store_true",
                     help="run the engine in a thread of the server's process, not in an engine-core process "
                          "(default: off)")
    groups = {g: ap.add_argument_group(f"engine: {g}", f"{what} (EngineConfig)") for g, what in GROUPS.items()}
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if not f.metadata.get("cli", True):
            continue
        group = groups[f.metadata["group"]]
        flags = ["--" + f.name.replace("_", "-")] + ([VLLM_ALIASES[f.name]] if f.name in VLLM_ALIASES else [])
        tp = _optional(hints[f.name])
        # SUPPRESS: a flag not given leaves the field to EngineConfig's own default.
        kw = dict(dest=f.name, default=argparse.SUPPRESS, help=f"{f.metadata['help']} (default: {_shown(f.default)})")
        if tp is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
        elif f.name == "device":
            group.add_argument(*flags, type=_device, metavar="{" + ",".join(DEVICE_CHOICES) + "}", **kw)
        elif typing.get_origin(tp) is typing.Literal:
            group.add_argument(*flags, choices=typing.get_args(tp), **kw)
        elif typing.get_origin(tp) in (typing.Union, types.UnionType):   # int | Literal["auto"]: EngineConfig reads it
            words = [str(a) for t in typing.get_args(tp) for a in (typing.get_args(t) or [t.__name__.upper()])]
            group.add_argument(*flags, type=str, metavar="{" + ",".join(words) + "}", **kw)
        elif tp in (int, float, str):
            group.add_argument(*flags, type=tp, metavar=tp.__name__.upper(), **kw)
        elif typing.get_origin(tp) in (tuple, list):
            group.add_argument(*flags, type=_sequence(tp), metavar="LIST", **kw)
        else:  # a structured field: give it as JSON
            group.add_argument(*flags, type=json.loads, metavar="JSON", **kw)
    groups["execution"].add_argument("--enforce-eager", dest="cuda_graphs", action="store_false",
                                     default=argparse.SUPPRESS, help="vLLM's spelling of --no-cuda-graphs")
    return ap


def engine_config(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    kwargs = {k: v for k, v in vars(args).items() if k in names}
    return EngineConfig.from_kwargs(**kwargs, use_tqdm=True)   # progress bars while capturing graphs


def api_key_of(args: argparse.Namespace) -> str | None:
    """--api-key, else the environment variable NANODSPARK_API_KEY, else no key."""
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def curl_example(url: str, model: str, api_key: str | None = None) -> str:
    body = ('{"model": "%s", "messages": [{"role": "user", "content": "Hello! Who are you?"}], '
            '"max_tokens": 64}') % model
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    return f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d {shlex.quote(body)}"


def _torchrun_rank() -> int | None:
    """This process's rank under torchrun, or None when not launched by it."""
    return int(os.environ["RANK"]) if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ else None


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.model_tag and args.model and args.model_tag != args.model:
        ap.error(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
    model = args.model_tag or args.model
    from nanodspark.loader import DEFAULT_MODEL_DIR
    model_dir = Path(model) if model else DEFAULT_MODEL_DIR
    if not (model_dir / "config.json").is_file():
        what = "the embedded default model" if model is None else "the model"
        print(f"error: {what} was not found at {model_dir} (no config.json). Pass the path of a Hugging Face "
              "checkpoint directory (config.json + *.safetensors): python serve.py PATH, or --model PATH.",
              file=sys.stderr)
        return 2
    try:
        cfg = engine_config(args)
    except (TypeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    api_key = api_key_of(args)
    if args.api_server_count < 1:
        print("error: --api-server-count must be 1 or more", file=sys.stderr)
        return 2
    if args.api_server_count > 1 and (args.single_process or _torchrun_rank() is not None):
        print("error: --api-server-count > 1 needs the engine-core process: not with --single-process or torchrun",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(message)s")
    rank = _torchrun_rank()
    sock = None
    if not rank:
        try:
            from nanodspark.server.api_servers import listen_socket
            sock = listen_socket(args.host, args.port, reuse_port=args.api_server_count > 1)
        except OSError as e:
            print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}. Stop what holds it or pass "
                  "--port N.", file=sys.stderr)
            return 2
    # uvicorn handles SIGINT/SIGTERM itself once it runs (graceful shutdown, then the lifespan exit
    # stops the engine) and afterwards re-raises the signal into the handler found before it
    # started. Make that handler a KeyboardInterrupt for SIGTERM too, so both end here with status 0
    # (and a signal while the model loads stops the engine core too).
    signal.signal(signal.SIGTERM, _interrupt)
    single = args.single_process or rank is not None
    core = engine = None
    log.info("loading %s (%s)", model_dir, "in this process" if single else "in the engine-core process")
    t0 = time.monotonic()
    try:
        if single:
            from nanodspark.llm import build_engine
            from nanodspark.server import EngineInfo
            engine = build_engine(model, cfg)         # a torchrun worker rank never returns from here
            info = EngineInfo.of(engine, load_seconds=time.monotonic() - t0, model=str(model_dir))
        else:
            from nanodspark.server import CoreClient
            core = CoreClient(model, cfg, args.log_level, links=args.api_server_count)
            info = core.wait_ready()
    except KeyboardInterrupt:
        if core is not None:
            core.kill()
        return 130
    except Exception as e:  # noqa: BLE001 - CoreStartError, or the engine's own error in one process
        from nanodspark.server import CoreStartError
        user_error = isinstance(e, (FileNotFoundError, ValueError)) or getattr(e, "kind", None) == "load"
        if not user_error and not isinstance(e, CoreStartError):
            raise
        print(f"error: could not load {model_dir}: {e}" + ("\nPass the path of a Hugging Face checkpoint "
              "directory: python serve.py PATH." if user_error else ""), file=sys.stderr)
        return 2 if user_error else 1

    from nanodspark.server import HTTPServer, create_app
    for line in info.summary():
        log.info(line)
    name = args.served_model_name or ("nanodspark-default" if model is None else model_dir.resolve().name)
    app_kwargs = dict(model_name=name, max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                      prepare_threads=args.prepare_threads, api_key=api_key,
                      prepare_inline_bytes=args.prepare_inline_bytes)
    server_kwargs = dict(host=args.host, port=args.port, timeout_graceful_shutdown=5)
    folder = tempfile.mkdtemp(prefix="nanodspark-metrics-") if args.api_server_count > 1 else None
    app = create_app(engine if single else core, **app_kwargs, share_metrics=folder and (folder, 0))
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{args.port}"
    where = info.device if info.world == 1 else \
        f"{info.world} {info.device.split(':')[0]} ranks (tensor parallel)"
    workers = "" if not info.worker_pids else \
        "tensor-parallel workers: " + ", ".join(f"rank {i + 1} pid {p}" for i, p in enumerate(info.worker_pids)) + "\n"
    process = "" if single else f"engine core: pid {core.process.pid}\n"
    process += f"HTTP: {http_stack()}\n"
    apis = None

    def banner():
        print(f"\nnanodspark is serving {name!r} on {where} at {url}/v1\n{process}{workers}"
              f"Try:\n  {curl_example(url, name, api_key)}\n", flush=True)

    server = HTTPServer(app, on_ready=banner, log_level=args.log_level, **server_kwargs,
                        on_shutdown=lambda: apis is not None and apis.stop())
    try:
        if args.api_server_count > 1:
            from nanodspark.server.api_servers import ApiServers
            apis = ApiServers(core, sock.getsockname()[:2], model, app_kwargs, server_kwargs, folder,
                              args.log_level)
            pids = apis.wait_ready()
            process += f"API servers: {len(pids) + 1} processes (pid {os.getpid()}, " + \
                ", ".join(str(p) for p in pids) + ")\n"
            apis.watch(lambda message: setattr(server, "should_exit", True))
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    except RuntimeError as e:         # an API process that did not start
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if apis is not None:
            apis.stop()               # a no-op after a clean shutdown
        app.state.server.loop.stop()  # a no-op after a clean lifespan exit; stops the engine after a forced one
        if engine is not None:
            engine.shutdown()         # the tensor-parallel workers, if any (the core stops its own)
        sock.close()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    error = app.state.server.loop.error or (apis is not None and apis.error)
    if error:
        print(f"error: the engine stopped: {error}" if not isinstance(error, str) else f"error: {error}",
              file=sys.stderr)
        return 1
    return 0


def http_stack() -> str:
    """The event loop and HTTP parser uvicorn picks ("auto": the compiled ones when installed)."""
    import importlib.util
    have = lambda name: importlib.util.find_spec(name) is not None   # noqa: E731
    stack = f"{'uvloop' if have('uvloop') else 'asyncio'} + {'httptools' if have('httptools') else 'h11'}"
    if not (have("uvloop") and have("httptools")):
        stack += " (pip install uvloop httptools: a faster front end)"
    return stack


def _interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
