"""The overlapped decode loop: the host prepares step n+1 while the GPU runs step n.

Why. With CUDA graphs a step's GPU work is a few replays; what is left between two steps is
host work — scheduling, block allocation, building the inputs, reading the result, committing,
detokenizing, stop checks, metrics. Run one after the other, the GPU idles during all of it.
Overlapped, one step's host work hides behind the other's GPU work (SGLang's zero-overhead
scheduler; vLLM's async scheduling; reference/components.md §5.3).

The timeline (one loop iteration, `OverlapLoop.step`; chapter 11 draws it from measurements):

    host:  schedule n+1 | launch n+1 (H2D inputs, replays queued) | wait n | commit n
    GPU:   ........ step n runs ............................ | step n+1 runs ......

What makes it possible:

* Step n+1's inputs that depend on step n never visit the host: the anchor (bonus or
  correction token) and the accepted length live in the device state (device_state.py), which
  step n writes and step n+1 reads, in stream order.
* The host schedules n+1 from state one step old. A decoding request with a step in flight
  reserves KV for that step *and* n+1 (scheduler.py `reservation`); the unused slots go back
  when step n is committed.
* The cost scheduler's budget for n+1 uses confidences from step n-1 (verify_lag 2, paper
  §5.2): exactly the newest ones the host has. That lag is what lets it run a step ahead.
* A request that finished in step n (EOS, stop string, max_tokens, abort) may be in step n+1
  already: its device row is inert if it hit its limit, and whatever n+1 commits for it is
  dropped at commit — never streamed. Its blocks are freed when n is committed; step n+1 may
  still write into them, but anything launched later is ordered after it on the stream.
* Preempting a request with a step in flight would free blocks under it: the scheduler raises
  `Drain`, and the loop commits step n before it schedules again.

Lossless: every token is computed by the same device step as in the synchronous loop; only
the moment the host reads it moves. `SyncLoop` is the reference: launch, wait, commit.
"""
from __future__ import annotations

from torch.profiler import record_function

from .scheduler import Drain


class SyncLoop:
    """Launch, wait, commit: one step at a time."""
    pending = None

    def __init__(self, engine):
        self.engine = engine

    def step(self):
        eng = self.engine
        eng.clock.start()
        with record_function("schedule"):
            plan = eng.schedule()
        eng.clock.lap("schedule")
        if not plan:
            return []
        with record_function("launch"):
            handle = eng.launch(plan)
        eng.clock.lap("launch")
        with record_function("wait"):
            result = handle.result()
        eng.clock.lap("wait")
        with record_function("commit"):
            outs = eng.commit(result)
        eng.clock.lap("commit")
        eng.clock.steps += 1
        return outs

    def forget(self) -> None:
        pass


class OverlapLoop:
    """Launch step n+1, then commit step n (at most one step in flight)."""

    def __init__(self, engine):
        self.engine = engine
        self.pending = None          # the StepHandle in flight

    def step(self):
        # BEGIN STUDENT overlap step
        eng = self.engine
        eng.clock.start()
        outs = []
        with record_function("schedule"):
            try:
                plan = eng.schedule()
            except Drain:            # a preemption needs the step in flight committed first
                outs = self._commit_pending()
                plan = eng.schedule()
        eng.clock.lap("schedule")
        with record_function("launch"):
            handle = eng.launch(plan) if plan else None
        eng.clock.lap("launch")
        outs += self._commit_pending()
        self.pending = handle
        if handle is not None:
            eng.clock.steps += 1
        return outs
        # END STUDENT overlap

    def _commit_pending(self):
        # BEGIN STUDENT overlap commit-pending
        if self.pending is None:
            return []
        handle, self.pending = self.pending, None
        with record_function("wait"):
            result = handle.result()
        self.engine.clock.lap("wait")
        with record_function("commit"):
            outs = self.engine.commit(result)
        self.engine.clock.lap("commit")
        return outs
        # END STUDENT overlap

    def forget(self) -> None:
        """Drop the step in flight (after an engine-wide failure)."""
        self.pending = None
