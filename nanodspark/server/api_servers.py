"""Several API processes on one engine core: `serve.py --api-server-count N` (chapter 08).

The idea
--------
At high concurrency one API process is the bound: HTTP parsing, JSON, detokenizing and the
server-sent events of every stream run under one interpreter lock. vLLM's `--api-server-count`
answers that with several API processes in front of one engine core; so does this file:

    serve.py = API process 0 ── link 0 ──▶ engine core (core.py: one EngineLoop, a Fanout)
      ApiServers: start, watch, stop            │ each request noted with its link,
    API process 1 … N-1 (run_api_server) ── link i ──▶ its outputs sent back on that link

* One port, a listening socket per API process, each bound with `SO_REUSEPORT`: the kernel
  spreads new connections evenly over them by a hash of the client's address and port, and a
  connection stays with the process that took it. (One socket shared by all balances badly: the
  process that wakes first accepts a whole burst of connections.)
* Each API process has its own link (two pipes, core.py), tokenizer, event loop, worker threads
  and metrics; they share nothing but the socket and a folder where each writes its metrics, so
  /metrics from any of them answers for all (metrics.py).

Lifecycle: serve.py starts the core and waits until it is ready, then starts the other API
processes and waits for each to listen. On shutdown it stops them first (SIGTERM: each aborts
its requests and leaves its link), then itself, which stops the core. An API process that dies
stops the server with exit status 1, as a lost core does; the core aborts the dead one's requests.

Invariants
----------
* Request ids are unique across the processes (uuid4), so the core's routing never collides.
* The core never outlives serve.py (end-of-file on link 0 stops it); an extra API process never
  outlives the core (end-of-file or `stopped` on its link ends it).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import socket
import sys
import threading

from .core import CoreClient, CoreLink, CoreStartError

log = logging.getLogger("nanodspark.server")


def listen_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The server's socket, bound now (before any weight is read) and handed to uvicorn, so a
    busy port is an error at once and nobody can take the port while the model loads.
    `reuse_port`: other API processes bind the same port too (`SO_REUSEPORT`)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn binds its own
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class ApiServers:
    """API processes 1 … N-1 of `serve.py`: one per extra link of `core`, each listening on
    `address` (host, port) beside serve.py's own socket."""

    def __init__(self, core: CoreClient, address: tuple, model_path, app_kwargs: dict, server_kwargs: dict,
                 metrics_folder: str, log_level: str = "info"):
        ctx = mp.get_context("spawn")
        self.processes, self._ready = [], []
        self.stopping = False
        self.error: str | None = None
        for index, (commands, outputs) in enumerate(core.extra_links, start=1):
            ready_r, ready_w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=run_api_server, name=f"nanodspark-api-{index}",
                            args=(index, address, commands, outputs, ready_w, model_path, app_kwargs, server_kwargs,
                                  metrics_folder, log_level))
            p.start()
            for conn in (ready_w, commands, outputs):
                conn.close()      # the child holds them now: its death is our end-of-file
            self.processes.append(p)
            self._ready.append(ready_r)

    def wait_ready(self, timeout: float = 300) -> list[int]:
        """Wait until every API process listens; their pids. Raises RuntimeError if one exits."""
        pids = []
        for index, (p, conn) in enumerate(zip(self.processes, self._ready), start=1):
            if not conn.poll(timeout):
                raise RuntimeError(f"API server process {index} did not start within {timeout:.0f} s")
            try:
                pids.append(conn.recv())
            except EOFError:
                p.join(5)
                raise RuntimeError(f"API server process {index} exited (status {p.exitcode}) before it was "
                                   "ready; its error is above") from None
        return pids

    def watch(self, on_death) -> None:
        """Call `on_death(message)` (a thread) if an API process exits while the server runs."""
        def run():
            sentinels = {p.sentinel: (i, p) for i, p in enumerate(self.processes, start=1)}
            ended = mp.connection.wait(list(sentinels))
            if self.stopping:
                return
            index, p = sentinels[ended[0]]
            p.join(1)
            self.error = f"API server process {index} exited (status {p.exitcode})"
            log.error("%s; shutting the server down", self.error)
            on_death(self.error)
        threading.Thread(target=run, name="nanodspark-api-watch", daemon=True).start()

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM every API process (each ends its streams and leaves its link), then wait."""
        self.stopping = True
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                log.warning("API server process %s did not stop within %s s; killing it", p.name, timeout)
                p.kill()
                p.join()
        for conn in self._ready:
            conn.close()


def run_api_server(index: int, address: tuple, commands, outputs, ready, model_path, app_kwargs: dict,
                   server_kwargs: dict, metrics_folder: str, log_level: str = "info") -> None:
    """API process `index`: a link to the core, the app, uvicorn on its socket of the shared port."""
    logging.basicConfig(level=log_level.upper(), format=f"%(levelname)s:     (API server {index}) %(message)s")
    from .app import HTTPServer, create_app
    link = CoreLink(model_path, commands, outputs)
    try:
        link.wait_ready()
        sock = listen_socket(*address, reuse_port=True)
    except (CoreStartError, OSError) as e:
        log.error("%s", e)
        sys.exit(1)
    app = create_app(link, **app_kwargs, share_metrics=(metrics_folder, index))
    server = HTTPServer(app, on_ready=lambda: ready.send(os.getpid()), log_level=log_level, **server_kwargs)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        link.stop(10)
        ready.close()
        sock.close()
    sys.exit(1 if link.error is not None else 0)
