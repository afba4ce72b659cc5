"""What the device knows about each running request, indexed by a request *slot*.

Idea. A decode or verify step needs, per request, the position of its anchor, the anchor token
itself, its block tables and its sampling parameters. The host could send them every step, but
then step n+1 cannot be launched before the host has read step n's result (the anchor of n+1 is
the bonus token of n). So the device keeps them: `seq_len[s]` (tokens of slot s with KV in the
cache) and `last_token[s]` (the anchor) are advanced *by the step itself* on the device when it
accepts drafts, and the next step reads them there (SGLang's future map indexed by request-pool
slot; vLLM's async scheduling). The host learns them one step late (engine.py `step`).

The host writes only what it decides or knows: a request's sampling parameters, limits and
sliding-window start when it is admitted (its drafter context then starts at 0; a lapsed
plain step moves `draft_start` on the device, speculative.py), its anchor and length when it
becomes decoding without a sampling step on the device (its prefill ended one token short of
the end, or a prefix hit left only the last token), and the block-table entries it allocates.
`StateWrites` collects those writes during scheduling and `apply` sends them in one
host-to-device copy on the step's stream (each copy costs the host tens of microseconds), so
they are ordered after every step already launched (a recycled slot is never overwritten under
a running step).

Invariants. Slot `scratch` (the last one) belongs to no request: padding rows of a CUDA-graph
batch read it, and its block tables are all -1, so padding stores nothing. A slot's table holds
the request's blocks in columns `0 .. len(table.blocks) - 1`; other columns are stale and never
read (attention reads below kv_len, and the window and kv_start skip released blocks).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .sampling import SamplingTensors


class DeviceState:
    def __init__(self, num_slots: int, groups: list[str], max_blocks: int, device):
        S = num_slots + 1                               # + the scratch slot
        self.scratch, self.device = num_slots, device
        z = dict(device=device, dtype=torch.long)
        self.seq_len = torch.zeros(S, **z)
        self.last_token = torch.zeros(S, **z)
        self.limit_len = torch.zeros(S, **z)            # min(prompt + max_tokens, max_model_len)
        self.kv_start = torch.zeros(S, dtype=torch.int32, device=device)
        self.draft_start = torch.zeros(S, dtype=torch.int32, device=device)   # first drafter context position
        self.temperature = torch.zeros(S, device=device)
        self.top_k = torch.zeros(S, **z)
        self.top_p = torch.ones(S, device=device)
        self.seed = torch.zeros(S, **z)
        # every group's tables in one tensor, so that one indexed write fills the entries of all of them
        self._tables = torch.full((len(groups), S, max_blocks), -1, dtype=torch.int32, device=device)
        self.tables = {g: self._tables[i] for i, g in enumerate(groups)}
        self._group = {g: i for i, g in enumerate(groups)}
        self.max_blocks = max_blocks
        # the writes' staging: two pinned host buffers used in turn (a step's copy may still be
        # queued behind the step in flight; at most one is, so a buffer is free again two steps
        # later, as for the decode inputs, ragged_graphs.py), and the device buffer they fill
        self._cuda = torch.device(device).type == "cuda"
        self._hosts, self._dev, self._turn = [], None, 0

    def sampling(self, slots: torch.Tensor, truncates: bool) -> SamplingTensors:
        return SamplingTensors(self.temperature[slots], self.top_k[slots], self.top_p[slots], self.seed[slots],
                               truncates)

    def apply(self, w: "StateWrites") -> None:
        """Copy the host's writes into the state: one host-to-device copy of every write, then one
        indexed store per field, all stream-ordered (most steps: nothing, or a few table entries)."""
        if not (w.params or w.anchors or w.tables):
            return
        parts = []
        if w.params:      # (slot, limit, kv_start, top_k, seed | temperature, top_p as float64 bits)
            ints = np.array([r[:5] for r in w.params], dtype=np.int64)
            floats = np.array([r[5:] for r in w.params], dtype=np.float64)
            parts.append(np.concatenate([ints, floats.view(np.int64)], axis=1).reshape(-1))
        if w.anchors:     # (slot, seq_len, last_token)
            parts.append(np.asarray(w.anchors, dtype=np.int64).reshape(-1))
        tables = [(self._group[g], np.asarray(e, dtype=np.int64)) for g, e in w.tables.items() if e]
        for i, e in tables:   # (group, slot, column, block)
            parts.append(np.concatenate([np.full((len(e), 1), i, dtype=np.int64), e], axis=1).reshape(-1))
        d = self._send(np.concatenate(parts))
        at = 0
        if w.params:
            n = len(w.params)
            c, at = d[at:at + 7 * n].view(n, 7), at + 7 * n
            s = c[:, 0]
            self.limit_len[s], self.kv_start[s], self.top_k[s], self.seed[s] = c[:, 1], c[:, 2].int(), c[:, 3], c[:, 4]
            f = c[:, 5:].contiguous().view(torch.float64).float()
            self.temperature[s], self.top_p[s] = f[:, 0], f[:, 1]
            self.draft_start[s] = 0          # its prefill feeds the drafter's context from position 0
        if w.anchors:
            n = len(w.anchors)
            c, at = d[at:at + 3 * n].view(n, 3), at + 3 * n
            self.seq_len[c[:, 0]], self.last_token[c[:, 0]] = c[:, 1], c[:, 2]
        if tables:
            c = d[at:].view(-1, 4)
            self._tables[c[:, 0], c[:, 1], c[:, 2]] = c[:, 3].int()
        w.clear()

    def _send(self, a: np.ndarray) -> torch.Tensor:
        """`a` (int64) on the device, through this turn's pinned buffer (grown when too small)."""
        self._turn ^= 1
        if not self._hosts or self._hosts[0].numel() < len(a):
            size = max(1024, 2 * len(a))     # a buffer dropped here is kept by the allocator until its copy ran
            self._hosts = [torch.empty(size, dtype=torch.long, pin_memory=self._cuda) for _ in range(2)]
            self._dev = torch.empty(size, dtype=torch.long, device=self.device)
        h = self._hosts[self._turn]
        h.numpy()[:len(a)] = a
        self._dev[:len(a)].copy_(h[:len(a)], non_blocking=self._cuda)
        return self._dev[:len(a)]


@dataclass
class StateWrites:
    """Host writes collected while a step is scheduled, applied once at launch."""
    params: list[tuple] = field(default_factory=list)   # (slot, limit, kv_start, top_k, seed, temperature, top_p)
    anchors: list[tuple] = field(default_factory=list)  # (slot, seq_len, last_token) known on the host
    tables: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)   # group -> (slot, col, block)

    def clear(self) -> None:
        self.params.clear()
        self.anchors.clear()
        self.tables.clear()
