"""serve.py's API process over a stand-in engine core that makes tokens at a fixed pace.

Why: at high concurrency the HTTP front end, not the engine, can bound what a client gets. A
core that emits `--tokens` tokens per live request every `--step-ms` (no model, no GPU: a
thread of this process that loops over the live requests, ~0.1 of a core) isolates the API side:
HTTP, the output processor, detokenizing, metrics and SSE. Drive it with `bench serve
--frontend http --url ...` and read the client's tok/s beside the offered rate (256 streams
× 3 tokens every 5 ms offer 153,600 tok/s), and profile it meanwhile (py-spy: `pip install
py-spy`). From the repository's root:

    PYTHONPATH=. python tests/device/fake_core.py --port 18740 --step-ms 5 --tokens 3 &
    python -m nanodspark.bench serve --frontend http --url http://127.0.0.1:18740 \\
        --systems static --concurrency 256 --warmup-s 2 --duration 6
    py-spy record -p $(pgrep -f fake_core.py) -d 6 -r 250 --format raw -o api.raw
"""
from __future__ import annotations

import argparse
import threading
import time

import numpy as np

from nanodspark.loader import Tokenizer
from nanodspark.server.app import HTTPServer, create_app
from nanodspark.server.core import CoreClient
from nanodspark.server.engine_loop import SPEC_FIELDS, EngineInfo, Relay, StepOutputs

MODEL = "nanodspark/assets/default"


class FakeCore(CoreClient):
    """`CoreClient`'s interface; requests get `tokens` ids per step until their max_tokens."""

    def __init__(self, step_s: float, tokens: int):
        self.step_s, self.tokens = step_s, tokens
        self.tokenizer = Tokenizer(MODEL)
        self.vocab = np.arange(300, 5000, dtype=np.int64)   # plain word pieces
        self.info = EngineInfo(model=MODEL, max_model_len=8192, vocab_size=49152, max_request_tokens=8192,
                               max_num_seqs=512, max_waiting=1024, device="fake", dtype="none", drafter=None,
                               gamma=0, block_size=16, kv_blocks=1, kv_groups=["full"])
        self._lock = threading.Lock()
        self._new: list = []
        self._live: dict[str, list] = {}          # id -> [left, made]
        self._stopping = False
        self.error = None
        self.on_fatal = None

    def submit(self, request_id, prompt_ids, params) -> None:
        with self._lock:
            self._new.append((request_id, params.max_tokens))

    def abort(self, request_id) -> None:
        with self._lock:
            self._new.append((request_id, 0))

    def abort_all(self) -> None:
        with self._lock:
            self._new += [(rid, 0) for rid in self._live]

    def start(self, deliver, loop) -> None:
        self._thread = threading.Thread(target=self._run, args=(Relay(deliver, loop).post,), daemon=True)
        self._thread.start()

    def _run(self, post) -> None:
        rng = np.random.default_rng(0)
        nspec = len(SPEC_FIELDS)
        next_t = time.perf_counter()
        while not self._stopping:
            next_t += self.step_s
            time.sleep(max(0.0, next_t - time.perf_counter()))
            out = StepOutputs()
            with self._lock:
                new, self._new = self._new, []
            for rid, max_tokens in new:
                if max_tokens == 0:                      # an abort
                    if self._live.pop(rid, None) is not None:
                        out.finished[len(out.request_ids)] = ("abort", None)
                        out.request_ids.append(rid)
                        out.num_tokens.append(0)
                        out.spec.extend([0] * nspec)
                    continue
                out.admitted.append(("accepted", rid))
                self._live[rid] = [max_tokens, 0]
            ids = list(self._live)
            if ids:
                toks = rng.choice(self.vocab, size=len(ids) * self.tokens)
                j = 0
                for rid in ids:
                    st = self._live[rid]
                    n = min(self.tokens, st[0])
                    st[0] -= n
                    st[1] += 1
                    if st[0] == 0:
                        out.finished[len(out.request_ids)] = ("length", None)
                        del self._live[rid]
                    out.request_ids.append(rid)
                    out.num_tokens.append(n)
                    out.token_ids.extend(toks[j:j + n].tolist())
                    out.spec.extend([st[1], 0, 0, 0, st[1], 0][:nspec])
                    j += n
            if out:
                post(out)

    def stop(self, timeout=None) -> None:
        self._stopping = True

    @property
    def alive(self) -> bool:
        return not self._stopping


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=18740)
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument("--tokens", type=int, default=3, help="tokens per request per step")
    a = p.parse_args()
    app = create_app(FakeCore(a.step_ms / 1e3, a.tokens), model_name="fake")
    print(f"fake core: {a.tokens} tokens per request every {a.step_ms} ms", flush=True)
    HTTPServer(app, host="127.0.0.1", port=a.port, log_level="warning").run()


if __name__ == "__main__":
    main()
