"""Ragged CUDA-graph verify: a decode step as one graph replay (walkthrough/10_ragged_graphs.md).

Why graphs. A decode step of a small model launches hundreds of tiny kernels; launched one by
one from Python, the host takes ~10x longer than the GPU work, and the step costs the same
whatever its tokens. A CUDA graph records the launches of one step once and replays them with
one call, so a step then costs what its kernels cost (DSpark section 6.4; vLLM / SGLang graph runners).

What a graph needs. Every tensor it reads must live at a fixed address with a fixed shape, and
nothing inside may read a device value on the host. So:

* **Tiers.** A graph is captured for a *tier* `(slots, tokens)`: `slots` request rows and
  `tokens` packed verify rows. A step of R requests whose windows add up to N verify rows
  (anchors included) replays the smallest captured tier with slots >= R and tokens >= N; the
  extra request rows are padding (the scratch slot, no rows), the extra token rows belong to no
  request and store nothing (`pack_rows`). Keying on *both* numbers is what keeps the metadata
  geometry fixed (SGLang's crash when one token tier meant two slot layouts). Static and plain
  decoding need one token tier per slot count (`slots * (1 + gamma)`); a trimming verify mode
  adds smaller token tiers (`graph_token_fractions`), so a trimmed step replays a genuinely
  smaller graph; a plain step (no drafter pass) replays a tier of one row per request.
* **Static inputs.** One flat int64 buffer holds every input of every tier (slots, valid,
  window caps, budget, trim flag); a step writes it with one host-to-device copy.
  Everything else a step reads is the device state (device_state.py), also at fixed addresses.
* **Packing on the device.** The per-request verify lengths are chosen on the device (from the
  drafts' confidences), so `cu_seqlens`, positions, slot mappings and logit rows are derived
  there too (`pack_rows`); kernels read them from device memory, and host-side launch
  parameters (grid sizes, split counts) depend on the tier's shapes only.
* **One pool.** Tiers are captured largest first into one shared memory pool; they never run
  at the same time, so their activations can share memory.

A decode batch larger than the largest tier runs eagerly (a step's prefill chunks run before
its decode batch, graphed by tiers of their own: runner.py); on a CPU the same padded buffers
are run eagerly ("eager replay"), which is how the CPU tests hold the padding logic equal to
the unpadded step.

Invariants: a replay's outputs equal an eager run of the same step on the same padded buffers
bit for bit (same kernels, same shapes), and equal the unpadded eager step up to the summation
order of GEMMs of another height; padding rows never write the KV cache or the device state.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


@dataclass
class RowLayout:
    """The packed ragged layout of one verify batch (device tensors)."""
    cu_seqlens: torch.Tensor   # int32 [R + 1]: request r owns rows cu[r]:cu[r+1]
    row_req: torch.Tensor      # int64 [T]: the request of each row (padding rows: the last request)
    row_off: torch.Tensor      # int64 [T]: the row's index inside its request's window (0 = anchor)
    row_valid: torch.Tensor    # bool [T]: False for the padding rows past cu[R]


def pack_rows(rows: torch.Tensor, tokens: int) -> RowLayout:
    """Lay R requests' `rows` [R] (int64, sum <= tokens) out in `tokens` packed rows, on the
    device with no host sync. Example: rows [2, 1, 4], tokens 8 -> cu [0, 2, 3, 7], row_req
    [0, 0, 1, 2, 2, 2, 2, 2], row_off [0, 1, 0, 0, 1, 2, 3, 0], the last row padding."""
    # BEGIN STUDENT ragged-graphs pack-rows
    R = rows.shape[0]
    cu = torch.zeros(R + 1, dtype=torch.long, device=rows.device)
    cu[1:] = torch.cumsum(rows, 0)
    t = torch.arange(tokens, device=rows.device)
    row_req = torch.searchsorted(cu[1:], t, right=True).clamp(max=R - 1)
    valid = t < cu[-1]
    row_off = torch.where(valid, t - cu[row_req], 0)
    return RowLayout(cu.to(torch.int32), row_req, row_off, valid)
    # END STUDENT ragged-graphs


def tier_list(batch_sizes, gamma: int, fractions=(1.0,), max_slots: int | None = None) -> list[tuple[int, int]]:
    """(slots, tokens) tiers: for each slot count b, tokens b + ceil(f * b * gamma) per fraction."""
    # BEGIN STUDENT ragged-graphs tier-list
    tiers = set()
    for b in batch_sizes:
        if max_slots is not None and b > max_slots:
            continue
        for f in fractions:
            tiers.add((b, b + -(-int(round(f * b * gamma * 1000)) // 1000)))
    return sorted(tiers)
    # END STUDENT ragged-graphs


def pick_tier(tiers: list[tuple[int, int]], requests: int, tokens: int) -> tuple[int, int] | None:
    """The smallest tier holding `requests` slots and `tokens` rows (fewest tokens, then slots)."""
    # BEGIN STUDENT ragged-graphs pick-tier
    fits = [t for t in tiers if t[0] >= requests and t[1] >= tokens]
    return min(fits, key=lambda t: (t[1], t[0])) if fits else None
    # END STUDENT ragged-graphs


class StaticInputs:
    """The flat int64 input buffer of every tier: [slots | valid | window_cap] (max_slots each),
    then budget and trim; `batch(slots)` views it as a tier's `DecodeBatch` (speculative.py; the
    class is handed in, `make`, so that this file does not import the step it replays)."""

    def __init__(self, max_slots: int, device, make):
        self.max_slots, self.device, self.make = max_slots, device, make
        self.buf = torch.zeros(3 * max_slots + 2, dtype=torch.long, device=device)
        pin = torch.device(device).type == "cuda"
        # Two host copies, used in turn: while step n+1 is written, step n's copy may still be
        # queued behind step n-1 on the stream (the overlapped loop), so it needs its own.
        self.hosts = [torch.zeros(3 * max_slots + 2, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.host_arrays = [h.numpy() for h in self.hosts]     # numpy views of them, to write into
        self.turn = 0

    def batch(self, slots: int):
        """The `DecodeBatch` of a tier of `slots` rows: views of the device buffer."""
        M, b = self.max_slots, self.buf
        return self.make(b[:slots], b[M:M + slots], b[2 * M:2 * M + slots], b[3 * M], b[3 * M + 1])

    def write(self, slots, scratch: int, tier_slots: int, window_cap, gamma: int, budget: int, trim: bool) -> None:
        """Fill a host copy (padding rows: the scratch slot, invalid; window_cap None: gamma for
        every row) and send it in one copy. A host copy is reused two steps later, after the step
        that used it has been read (at most one step is in flight), so its copy has run."""
        self.turn ^= 1
        M, R = self.max_slots, len(slots)
        h = self.host_arrays[self.turn]
        h[:R] = slots
        h[R:tier_slots] = scratch
        h[M:M + tier_slots] = 0
        h[M:M + R] = 1
        h[2 * M:2 * M + R] = gamma if window_cap is None else window_cap
        h[3 * M], h[3 * M + 1] = budget, int(trim)
        self.buf.copy_(self.hosts[self.turn], non_blocking=True)


class RaggedGraphs:
    """Captures the decode step per (tier, variant) and replays it.

    `step_fn(batch, tokens, *variant) -> (ints, floats)` is the decode step on the static inputs'
    `DecodeBatch`, returning its packed outputs (`DecodeOut.pack`); the variant (greedy_only,
    truncates[, draft]) selects the sampling code the graph holds (argmax only; full sampling;
    with the top-k/top-p sort) and, with a third entry False, a plain step without the drafter."""

    def __init__(self, step_fn, inputs: StaticInputs, tiers: list[tuple[int, int]], device, use_graphs: bool,
                 scratch: int):
        self.step_fn, self.inputs, self.tiers, self.device, self.scratch = step_fn, inputs, tiers, device, scratch
        self.use_graphs = use_graphs and torch.device(device).type == "cuda"
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    def capture(self, variants, progress: bool = True, tiers=None) -> None:
        """Capture every tier (or `tiers`) for each variant, largest first, into one memory pool."""
        if not self.use_graphs:
            return
        from tqdm.auto import tqdm
        keys = [(t, v) for v in variants for t in sorted(self.tiers if tiers is None else tiers, reverse=True)]
        t0 = time.perf_counter()
        before = torch.cuda.memory_allocated(self.device)
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        # No garbage collection while capturing: freeing an old engine's graphs or tensors then
        # is an operation a capturing stream forbids, and it invalidates the capture (seen on the
        # H200 when a second LLM was built in a process that had dropped the first).
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            for tier, variant in tqdm(keys, desc="capture CUDA graphs", disable=not progress, leave=False):
                self._capture(tier, variant)
        finally:
            if was_enabled:
                gc.enable()
        torch.cuda.synchronize(self.device)
        self.capture_seconds += time.perf_counter() - t0
        self.capture_bytes = torch.cuda.memory_allocated(self.device) - before

    def drop(self) -> None:
        """Forget every graph and their pool: a pool whose graphs are gone cannot be captured into
        again (the allocator asserts), so a later capture starts a new one."""
        self.graphs.clear()
        self.pool = None
        if self.use_graphs:
            gc.collect()
            torch.cuda.synchronize(self.device)

    def warm(self, variants) -> None:
        """Run every tier once eagerly on padding inputs (compiles kernels; lets a caller record
        the shapes a decode step uses, e.g. to tune its GEMMs before capture)."""
        for tier in self.tiers:
            for v in variants:
                self.inputs.write([], self.scratch, tier[0], None, 0, 0, False)
                self.step_fn(self.inputs.batch(tier[0]), tier[1], *v)

    def _capture(self, tier, variant) -> None:
        slots, tokens = tier
        batch = self.inputs.batch(slots)
        # Run the step on the padded scratch inputs first: compiles every Triton kernel and
        # settles the allocator; the padding row is invalid, so nothing is written.
        self.inputs.write([], self.scratch, slots, None, 0, 0, False)
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            self.step_fn(batch, tokens, *variant)
        torch.cuda.current_stream(self.device).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = self.step_fn(batch, tokens, *variant)
        self.graphs[(tier, variant)] = (g, out)

    def captured(self, tier, variant) -> bool:
        return (tier, variant) in self.graphs

    def run(self, tier, variant) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay (or, without a graph for this key, run eagerly) on the inputs already written."""
        entry = self.graphs.get((tier, variant))
        if entry is not None:
            entry[0].replay()
            return entry[1]
        return self.step_fn(self.inputs.batch(tier[0]), tier[1], *variant)
