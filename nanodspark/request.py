"""A request and what the engine answers about it: the nouns of the engine.

The idea: a request is the token list `prompt + output`, of which the first `num_computed`
tokens have KV in the cache. Everything else on it is the state that the parts of a step need
between steps: its block tables (one per KV group, `paged_kv.py`), its SWA replay rows
(`swa_replay.py`), its incremental detokenizer window (`detokenizer.py`), its speculative
counters (`SpecStats`) and its timestamps. The engine answers with plain records:
`RequestOutput` after every step that touched a request (the new tokens and their text, for
streaming), `GenerationOutput` once per prompt from `LLM.generate`.

Who changes a request: the scheduler (tables, slot, `num_computed` and `status` at admission
and preemption, scheduler.py) and the engine (engine.py: at launch, the host-known prefill rows
and the in-flight counters; at commit, the output, `num_computed` of decode steps, text, stop)
with the detokenizer it calls. The step itself never does (step.py). Nothing here does work;
these are data.

A request may have a step *in flight* (launched, result not yet read: overlap_loop.py). Then
the host's `num_computed` and `output_ids` are one step old, the device knows better
(device_state.py), and `inflight` counts the launched steps that will bring it tokens.

Invariants: `num_computed <= num_tokens`; a request is decoding when only its last token lacks
KV, or when its prompt is computed and its first token is in flight (`is_decoding`);
`text == decode(output_ids[:detok_read])` up to a stop string; a finished request holds no block
tables and no slot; the counters of `SpecStats` only grow. Walkthrough chapter 01 §4.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from .paged_kv import BlockTable
from .sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Speculative counters of one request (paper names: tau = committed per verify step)."""
    steps: int = 0          # verify steps
    drafted: int = 0        # draft tokens produced (gamma per step)
    verified: int = 0       # draft tokens the target verified (the windows)
    accepted: int = 0       # draft tokens accepted
    committed: int = 0      # tokens committed by verify steps (accepted + 1 each)
    ceiling: int = 0        # cap-accept: tokens a full-block verify would have committed

    def as_dict(self) -> dict:
        tau = self.committed / self.steps if self.steps else 0.0
        d = dict(steps=self.steps, drafted=self.drafted, verified=self.verified,
                 accepted=self.accepted, committed=self.committed, tau=round(tau, 4))
        if self.ceiling:
            d["ceiling"] = self.ceiling
        return d


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int                             # the noise key of its sampling (its own, or drawn at add_request)
    limit_len: int                        # prompt + max_tokens, capped by max_model_len
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    tables: dict[str, BlockTable] = field(default_factory=dict)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    replay_until: int = 0                 # SWA replay rows (see swa_replay.py)
    kv_start: int = 0                     # first position its sliding layers read
    admitted_at: int = 0                  # num_computed when last admitted: the prefix hit less any replay
    text: str = ""                        # decoded output so far (= decode(output_ids[:detok_read]))
    emitted: int = 0                      # characters of `text` already streamed
    detok_prefix: int = 0                 # incremental detokenizer (detokenizer.py): the decode window starts here
    detok_read: int = 0                   # ... and `text` covers output_ids[:detok_read]
    stream_text: bool = True              # decode text every step (streaming, stop strings); False: once, at
                                          # the finish (offline `generate`: nobody reads the deltas)
    spec: SpecStats = field(default_factory=SpecStats)
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None  # when the first output token was committed (TTFT)
    finish_time: float | None = None
    error: str | None = None              # why the engine aborted it (finish_reason "error")
    slot: int = -1                        # device-state row while admitted (device_state.py)
    generation: int = 0                   # bumps each time the slot is given out (the relay's guard)
    synced: dict[str, int] = field(default_factory=dict)  # block-table entries mirrored on the device
    device_anchor: bool = False           # the device state holds its anchor (a sampling step ran there)
    inflight: int = 0                     # launched steps that will bring it tokens
    decode_inflight: int = 0              # ... of which decode steps (they move num_computed)

    @property
    def all_ids(self) -> list[int]:
        """Prompt + output as a new list: O(length), so not for per-step paths (`ids`, `last_id`)."""
        return self.prompt_ids + self.output_ids

    def ids(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop] without building all_ids (per-step paths: cost ~ the slice)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n:stop - n]
        return self.prompt_ids[start:stop] + (self.output_ids[:stop - n] if stop > n else [])

    @property
    def last_id(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_decoding(self) -> bool:
        return self.num_computed == self.num_tokens - 1 or (self.inflight > 0 and self.num_computed == self.num_tokens)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    spec: dict
    error: str | None = None          # why the engine failed it (finish_reason "error")


@dataclass
class CompletionOutput:
    """One completion of a prompt, shaped as vLLM's (`GenerationOutput.outputs[0]`)."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None     # not computed here (no logprobs)
    logprobs: None = None


@dataclass
class GenerationOutput:
    """What `LLM.generate` / `LLM.chat` return per prompt: flat fields, and vLLM's shape beside
    them (`.prompt`, `.prompt_token_ids`, `.outputs[0].text / .token_ids / .finish_reason`)."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    spec: dict
    prompt: str | None = None                   # the prompt's text (None when given as token ids)
    finished: bool = True

    @property
    def outputs(self) -> list[CompletionOutput]:
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason)]
