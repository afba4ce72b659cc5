"""The running batch: the host's state of every admitted request, as arrays indexed by slot.

Why. At batch 256 a step that touches every request's Python object costs the host tens of
microseconds per request, longer than a small model's GPU step. The engine only needs Python per
request when something happens to it (it arrives, finishes, streams text, crosses a KV block);
the rest — counting computed tokens, appending the new tokens, the length and EOS checks, the
speculative counters — is the same arithmetic for every row, done here once per step with numpy
(vLLM's persistent input batch; SGLang's request-pool arrays).

What lives here while a request holds a slot: its computed and in-flight counters, its output
tokens (a growing `[slots, capacity]` buffer), its limits and its `SpecStats` counters. The
`Request` object reads them through its properties (request.py), so code that handles one
request still sees current values; `attach` copies a request's own values in when it is
admitted, `detach` copies them back when it leaves (finished or preempted).

Invariants: `req[s].slot == s` for every live slot; a slot's arrays are the request's only
copy of its hot fields while it is attached; `out[s, :out_len[s]]` is its output; a detached
request has `_rows is None`. `generation[s]` grows with every hand-out of slot `s`, so a step
launched before a slot changed hands can tell (the engine drops such rows at commit).
"""
from __future__ import annotations

import numpy as np

from .request import Request, SpecStats

SPEC = SpecStats.names()          # steps, drafted, verified, accepted, committed, ceiling


class RunningBatch:
    def __init__(self, num_slots: int, capacity: int = 256):
        S = num_slots + 1                                # + the scratch slot (device_state.py)
        self.num_slots = num_slots
        self.req = np.empty(S, dtype=object)             # slot -> Request (None when free)
        self.live = np.zeros(S, dtype=bool)
        self.generation = np.zeros(S, dtype=np.int64)
        self.num_computed = np.zeros(S, dtype=np.int64)
        self.inflight = np.zeros(S, dtype=np.int64)
        self.decode_inflight = np.zeros(S, dtype=np.int64)
        self.prompt_len = np.zeros(S, dtype=np.int64)
        self.limit_len = np.zeros(S, dtype=np.int64)
        self.ignore_eos = np.zeros(S, dtype=bool)
        self.greedy = np.zeros(S, dtype=bool)
        self.truncates = np.zeros(S, dtype=bool)
        self.text = np.zeros(S, dtype=bool)              # needs text every step (streams, or has stop strings)
        self.decoding = np.zeros(S, dtype=bool)          # in the decode set (scheduler.py)
        self.reserved = np.zeros(S, dtype=np.int64)      # positions every KV group's table covers
        self.lapsed = np.zeros(S, dtype=bool)            # its drafter context lapsed: what it publishes holds none
        self.spec = np.zeros((S, len(SPEC)), dtype=np.int64)
        self.out_len = np.zeros(S, dtype=np.int64)
        self.out = np.zeros((S, capacity), dtype=np.int32)
        self._free = list(range(num_slots))[::-1]

    # -- slots --------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def attach(self, req: Request) -> int:
        """Give `req` a free slot and move its hot fields into the arrays."""
        s = self._free.pop()
        self.generation[s] += 1
        req.slot, req.generation, req.synced, req.device_anchor = s, int(self.generation[s]), {}, False
        out, p = req._output, req.params
        self._fit(len(out))
        self.req[s], self.live[s] = req, True
        self.num_computed[s], self.inflight[s], self.decode_inflight[s] = (req._num_computed, req._inflight,
                                                                            req._decode_inflight)
        self.prompt_len[s], self.limit_len[s] = len(req.prompt_ids), req.limit_len
        self.ignore_eos[s], self.greedy[s], self.truncates[s] = p.ignore_eos, p.greedy, p.truncates
        self.text[s] = req.stream_text or bool(p.stop)
        self.decoding[s], self.reserved[s], self.lapsed[s] = False, 0, False
        self.spec[s] = [getattr(req._spec, k) for k in SPEC]
        self.out[s, :len(out)] = out
        self.out_len[s] = len(out)
        req._rows = self
        return s

    def detach(self, req: Request) -> None:
        """Copy `req`'s hot fields back to it and free its slot."""
        s = req.slot
        if s < 0 or req._rows is not self:
            return
        req._output = self.output(s)
        req._num_computed, req._inflight, req._decode_inflight = (int(self.num_computed[s]), int(self.inflight[s]),
                                                                  int(self.decode_inflight[s]))
        req._spec = self.spec_stats(s)
        req._rows = None
        self.req[s], self.live[s], self.decoding[s] = None, False, False
        self._free.append(s)
        req.slot, req.synced = -1, {}

    # -- tokens -------------------------------------------------------------------------------
    def output(self, s: int, start: int = 0, stop: int | None = None) -> list[int]:
        n = int(self.out_len[s])
        stop = n if stop is None else min(stop, n)
        return self.out[s, start:stop].tolist()

    def append(self, s: int, ids: list[int]) -> None:
        n = int(self.out_len[s])
        self._fit(n + len(ids))
        self.out[s, n:n + len(ids)] = ids
        self.out_len[s] = n + len(ids)

    def append_rows(self, slots: np.ndarray, tokens: np.ndarray, counts: np.ndarray) -> None:
        """Append `tokens[i, :counts[i]]` to slot `slots[i]`'s output, every row at once. Whole rows
        are written (one assignment, no mask): the tokens past a row's count land beyond its
        `out_len`, where nothing reads them, and the next append writes over them."""
        if not len(slots):
            return
        start = self.out_len[slots]
        self._fit(int(start.max()) + tokens.shape[1])
        self.out[slots[:, None], start[:, None] + np.arange(tokens.shape[1])] = tokens
        self.out_len[slots] = start + counts

    def _fit(self, n: int) -> None:
        if n > self.out.shape[1]:
            grown = np.zeros((self.out.shape[0], max(n, 2 * self.out.shape[1])), dtype=np.int32)
            grown[:, :self.out.shape[1]] = self.out
            self.out = grown

    def spec_stats(self, s: int) -> SpecStats:
        return SpecStats(*self.spec[s].tolist())
