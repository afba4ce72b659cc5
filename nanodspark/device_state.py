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
becomes decoding without a sampling step on the device (its prefill ended one token short of the end, or a
prefix hit left only the last token), and the block-table entries it allocates. `StateWrites` collects those writes during scheduling
and `apply` turns them into a few host-to-device copies on the step's stream, so they are ordered
after every step already launched (a recycled slot is never overwritten under a running step).

Invariants. Slot `scratch` (the last one) belongs to no request: padding rows of a CUDA-graph
batch read it, and its block tables are all -1, so padding stores nothing. A slot's table holds
the request's blocks in columns `0 .. len(table.blocks) - 1`; other columns are stale and never
read (attention reads below kv_len, and the window and kv_start skip released blocks).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling import SamplingTensors


def h2d(data, dtype, device) -> torch.Tensor:
    """A host list as a device tensor without blocking the host: through pinned memory (PyTorch's
    caching host allocator keeps the pinned block alive until the copy has run), since a copy
    from pageable memory may wait for the stream, which would stall an overlapped loop."""
    t = torch.tensor(data, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


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
        self.tables = {g: torch.full((S, max_blocks), -1, dtype=torch.int32, device=device) for g in groups}
        self.max_blocks = max_blocks

    def sampling(self, slots: torch.Tensor, truncates: bool) -> SamplingTensors:
        return SamplingTensors(self.temperature[slots], self.top_k[slots], self.top_p[slots], self.seed[slots],
                               truncates)

    def apply(self, w: "StateWrites") -> None:
        """Copy the host's writes into the state (stream-ordered; a few small copies)."""
        if not (w.params or w.anchors or w.tables):         # most steps: nothing new
            return
        dev = self.device
        if w.params:
            cols = list(zip(*w.params))
            slots = h2d(cols[0], torch.long, dev)
            for name, values in zip(("limit_len", "kv_start", "top_k", "seed", "temperature", "top_p"), cols[1:]):
                t = getattr(self, name)
                t[slots] = h2d(values, t.dtype, dev)
            self.draft_start[slots] = 0          # its prefill feeds the drafter's context from position 0
        if w.anchors:
            s, n, t = (h2d(c, torch.long, dev) for c in zip(*w.anchors))
            self.seq_len[s], self.last_token[s] = n, t
        for g, entries in w.tables.items():
            if entries:
                e = h2d(entries, torch.long, dev)
                self.tables[g][e[:, 0], e[:, 1]] = e[:, 2].to(torch.int32)
        w.clear()


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
