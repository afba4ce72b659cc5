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

A request may have a step *in flight* (launched, result not yet read: engine.py `step`). Then
the host's `num_computed` and `output_ids` are one step old, the device knows better
(device_state.py), and `inflight` counts the launched steps that will bring it tokens.

Invariants: `num_computed <= num_tokens`; a request is decoding when only its last token lacks
KV, or when its prompt is computed and its first token is in flight (`is_decoding`);
`text == decode(output_ids[:detok_read])` up to a stop string; a finished request holds no block
tables and no slot; the counters of `SpecStats` only grow. Walkthrough chapter 01.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, fields
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

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def as_dict(self) -> dict:
        tau = self.committed / self.steps if self.steps else 0.0
        d = dict(steps=self.steps, drafted=self.drafted, verified=self.verified,
                 accepted=self.accepted, committed=self.committed, tau=round(tau, 4))
        if self.ceiling:
            d["ceiling"] = self.ceiling
        return d


class _Hot:
    """A request field that lives in the running batch's arrays while the request holds a slot
    (batch.py), and on the request otherwise: per-step code updates the arrays for the whole batch
    at once, and reading the field still gives the current value."""

    def __set_name__(self, owner, name):
        self.name, self.own = name, "_" + name

    def __get__(self, req, owner=None):
        if req is None:
            return self
        rows = req._rows
        return int(getattr(rows, self.name)[req.slot]) if rows is not None else getattr(req, self.own)

    def __set__(self, req, value):
        rows = req._rows
        if rows is not None:
            getattr(rows, self.name)[req.slot] = value
        else:
            setattr(req, self.own, value)


class Request:
    """One request. While it holds a slot its step counters and output tokens live in the running
    batch (batch.py); `output_ids` then builds a list (O(length): not for per-step paths, which use
    `ids`, `last_id`, `num_tokens`)."""
    num_computed = _Hot()                 # tokens with KV in the cache
    inflight = _Hot()                     # launched steps that will bring it tokens
    decode_inflight = _Hot()              # ... of which decode steps (they move num_computed)

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, seed: int, limit_len: int,
                 output_ids: list[int] | None = None, stream_text: bool = True):
        self.request_id, self.prompt_ids, self.params = request_id, prompt_ids, params
        self.seed = seed                  # the noise key of its sampling (its own, or drawn at add_request)
        self.limit_len = limit_len        # prompt + max_tokens, capped by max_model_len
        self._rows = None                 # the running batch while it holds a slot (batch.py)
        self._output = list(output_ids or [])
        self._spec = SpecStats()
        self._num_computed = self._inflight = self._decode_inflight = 0
        self.tables: dict[str, BlockTable] = {}
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.replay_until = 0             # SWA replay rows (see swa_replay.py)
        self.kv_start = 0                 # first position its sliding layers read
        self.admitted_at = 0              # num_computed when last admitted: the prefix hit less any replay
        self.text = ""                    # decoded output so far (= decode(output_ids[:detok_read]))
        self.emitted = 0                  # characters of `text` already streamed
        self.detok_prefix = 0             # incremental detokenizer (detokenizer.py): the window starts here
        self.detok_read = 0               # ... and `text` covers output_ids[:detok_read]
        self.stream_text = stream_text    # decode text every step (streaming, stop strings); False: once, at
                                          # the finish (offline `generate`: nobody reads the deltas)
        self.arrival = time.monotonic()
        self.scheduled_time: float | None = None     # when first admitted (its wait in the queue ends)
        self.first_token_time: float | None = None   # when the first output token was committed (TTFT)
        self.finish_time: float | None = None
        self.error: str | None = None     # why the engine aborted it (finish_reason "error")
        self.slot = -1                    # device-state row while admitted (device_state.py, batch.py)
        self.generation = 0               # bumps each time the slot is given out (the relay's guard)
        self.synced: dict[str, int] = {}  # block-table entries mirrored on the device
        self.device_anchor = False        # the device state holds its anchor (a sampling step ran there)

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, {self.status.value}, {self.num_tokens} tokens)"

    # -- tokens ----------------------------------------------------------------------------
    @property
    def output_ids(self) -> list[int]:
        """The output so far, as a new list when the request holds a slot (O(length))."""
        rows = self._rows
        return rows.output(self.slot) if rows is not None else self._output

    @output_ids.setter
    def output_ids(self, ids: list[int]) -> None:
        if self._rows is not None:
            self._rows.out_len[self.slot] = 0
            self._rows.append(self.slot, list(ids))
        else:
            self._output = list(ids)

    @property
    def num_output(self) -> int:
        rows = self._rows
        return int(rows.out_len[self.slot]) if rows is not None else len(self._output)

    def append_output(self, ids: list[int]) -> None:
        if self._rows is not None:
            self._rows.append(self.slot, ids)
        else:
            self._output.extend(ids)

    def output_slice(self, start: int, stop: int) -> list[int]:
        """output_ids[start:stop] without building the whole list (the detokenizer's window)."""
        rows = self._rows
        return rows.output(self.slot, start, stop) if rows is not None else self._output[start:stop]

    def truncate_output(self, n: int) -> None:
        """Keep the first n output tokens (a stop string completed before the last)."""
        if self._rows is not None:
            self._rows.out_len[self.slot] = min(n, self.num_output)
        else:
            del self._output[n:]

    @property
    def all_ids(self) -> list[int]:
        """Prompt + output as a new list: O(length), so not for per-step paths (`ids`, `last_id`)."""
        return self.prompt_ids + self.output_ids

    def ids(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop] without building all_ids (per-step paths: cost ~ the slice)."""
        n = len(self.prompt_ids)
        if stop <= n:
            return self.prompt_ids[start:stop]
        rows = self._rows
        tail = rows.output(self.slot, max(start - n, 0), stop - n) if rows is not None \
            else self._output[max(start - n, 0):stop - n]
        return (self.prompt_ids[start:] if start < n else []) + tail

    @property
    def last_id(self) -> int:
        n = self.num_output
        return self.ids(len(self.prompt_ids) + n - 1, len(self.prompt_ids) + n)[0] if n else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + self.num_output

    @property
    def is_decoding(self) -> bool:
        nc, n = self.num_computed, self.num_tokens
        return nc == n - 1 or (self.inflight > 0 and nc == n)

    @property
    def spec(self) -> SpecStats:
        """Its speculative counters (a snapshot while it holds a slot)."""
        rows = self._rows
        return rows.spec_stats(self.slot) if rows is not None else self._spec


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


class StepOutputs:
    """What one `LLMEngine.step` produced: a sequence of `RequestOutput`, one per request that
    got tokens or finished. The decode rows of requests nothing happened to (no finish, no text)
    are kept as arrays and turned into `RequestOutput`s only when read (iterating, indexing): a
    consumer that reads `outputs` and `rows()` costs no Python per such request."""

    def __init__(self):
        self.outputs: list[RequestOutput] = []     # built by the engine (finished, text, prefill)
        self._rows: list[tuple] = []
        self._built: list[RequestOutput] | None = None

    def add(self, out: RequestOutput | None) -> None:
        if out is not None:
            self.outputs.append(out)
            self._built = None

    def add_rows(self, requests, tokens, counts, spec, num_output) -> None:
        if len(requests):
            self._rows.append((requests, tokens, counts, spec, num_output))
            self._built = None

    @property
    def finished(self) -> list[RequestOutput]:
        return [o for o in self.outputs if o.finished]

    def rows(self) -> list[tuple]:
        """The quiet decode rows, as arrays: (requests [n] object, tokens [n, k], counts [n], spec
        [n, 6] (SpecStats' counters, in its field order), output lengths [n]); request i's new
        tokens are tokens[i, :counts[i]]. No request is both here and in `outputs`."""
        return self._rows

    def _build(self) -> list[RequestOutput]:
        if self._built is None:
            built = list(self.outputs)
            names = SpecStats.names()
            for reqs, toks, counts, spec, nout in self._rows:
                for req, row, n, sp, m in zip(reqs.tolist(), toks.tolist(), counts.tolist(), spec.tolist(),
                                              nout.tolist()):
                    built.append(RequestOutput(req.request_id, row[:n], "", False, None, len(req.prompt_ids), m,
                                               SpecStats(**dict(zip(names, sp))).as_dict()))
            self._built = built
        return self._built

    def __iter__(self):
        return iter(self._build())

    def __len__(self) -> int:
        return len(self._build())

    def __getitem__(self, i):
        return self._build()[i]

    def __bool__(self) -> bool:
        return bool(self.outputs or self._rows)
