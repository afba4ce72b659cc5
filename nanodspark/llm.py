"""The offline API: `LLM(model_path, **engine_kwargs)`, `generate`, `chat` and `stream`.

A thin layer over `LLMEngine` (engine.py): it adds requests, steps the engine until they finish
and returns their outputs. The server (nanodspark/server/) drives the same engine in a loop of
its own. Walkthrough chapter 01.

What a vLLM script expects works unchanged: `generate(prompts, sampling_params)` takes strings,
token-id lists or `{"prompt": ...}` / `{"prompt_token_ids": ...}` dicts, and each result has
`.outputs[0].text`, `.outputs[0].token_ids`, `.outputs[0].finish_reason`, `.prompt` and
`.prompt_token_ids` beside the flat `.text`, `.token_ids`, `.finish_reason`, `.spec`.

Invariants
    * Requests are checked before any is queued: sampling parameters (a `SamplingParams`, or a
      dict of its fields), the prompt, and the context. A prompt plus `max_tokens` past the
      model's context (`max_model_len`) is refused with a `ValueError` that gives the arithmetic,
      as the server answers 400 `context_length_exceeded`; nothing is cut silently.
    * A batch that fails leaves no request behind in the engine.
"""
from __future__ import annotations

from dataclasses import fields

from .config import EngineConfig
from .engine import LLMEngine
from .request import GenerationOutput, Status
from .sampling import SamplingParams


def build_engine(model_path: str | None, cfg: EngineConfig) -> LLMEngine:
    """The engine for `cfg`; with tensor parallelism, the process group first (distributed.py):
    rank 0 gets the engine, a worker rank of a torchrun world serves steps and exits there."""
    from . import distributed
    if not distributed.wanted(cfg):
        return LLMEngine(model_path, cfg)
    parallel = distributed.Parallel.start(cfg, model_path)      # spawns the workers, or joins torchrun's
    if parallel.rank != 0:
        distributed.serve_as_worker(parallel, model_path, cfg)   # never returns
    return LLMEngine(model_path, cfg, parallel)


_FIELDS = {f.name for f in fields(SamplingParams)}


def as_sampling_params(params) -> SamplingParams:
    """A `SamplingParams`, a dict of its fields (converted), or None (the defaults)."""
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params.validate()
    if isinstance(params, dict):
        unknown = sorted(set(params) - _FIELDS)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; SamplingParams has {sorted(_FIELDS)}")
        return SamplingParams(**params)
    raise TypeError(f"sampling parameters must be a SamplingParams or a dict of its fields, not "
                    f"{type(params).__name__}")


class LLM:
    """`LLM(model_path, **engine_kwargs).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model_path: str | None = None, **engine_kwargs):
        self.engine = build_engine(model_path, EngineConfig.from_kwargs(**engine_kwargs))
        self.tokenizer = self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (`tensor_parallel_size > 1`)."""
        self.engine.shutdown()

    # ------------------------------------------------------------------ checks before queuing
    def _prompt(self, prompt) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a string, a list of token ids, or a vLLM prompt dict."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise ValueError("a prompt must be a string, a list of token ids, or a dict with 'prompt' or "
                         "'prompt_token_ids'")

    def _check_context(self, num_prompt: int, max_tokens: int) -> None:
        limit = self.engine.max_model_len
        if num_prompt >= limit:
            raise ValueError(f"this model's maximum context length is {limit} tokens, and the prompt alone has "
                             f"{num_prompt} (a request needs room for at least one new token); shorten the prompt")
        if num_prompt + max_tokens > limit:
            raise ValueError(f"this model's maximum context length is {limit} tokens; the request asks for "
                             f"{num_prompt + max_tokens} ({num_prompt} in the prompt + {max_tokens} for max_tokens); "
                             f"set max_tokens to at most {limit - num_prompt} or shorten the prompt")

    def _prepare(self, prompts, sampling_params) -> list[tuple[str | None, list[int], SamplingParams]]:
        single = isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} sampling parameters for {len(prompts)} prompts: give "
                                 "one per prompt, or a single one for all")
            plist = [as_sampling_params(p) for p in sampling_params]
        else:
            plist = [as_sampling_params(sampling_params)] * len(prompts)
        out = []
        for p, sp in zip(prompts, plist):
            text, ids = self._prompt(p)
            if ids:                       # an empty prompt: the engine's own error says so
                self._check_context(len(ids), sp.max_tokens)
            out.append((text, ids, sp))
        return out

    # ------------------------------------------------------------------ the API
    def generate(self, prompts, sampling_params: SamplingParams | dict | list | None = None,
                 use_tqdm: bool | None = None) -> list[GenerationOutput]:
        """One `GenerationOutput` per prompt, in order. `prompts`: one prompt or a list of them
        (strings, token-id lists, or vLLM prompt dicts); `sampling_params`: one for all or one
        per prompt. A prompt plus `max_tokens` past the context raises `ValueError` before any
        request is queued (the server's 400 `context_length_exceeded`)."""
        from tqdm.auto import tqdm
        batch = self._prepare(prompts, sampling_params)
        eng, reqs = self.engine, []
        try:
            for _, ids, sp in batch:
                reqs.append(eng.add_request(ids, sp, queue_limit=False, stream_text=False))
        except Exception:
            for r in reqs:                # a refused request leaves no other queued behind it
                eng.abort(r.request_id)
                eng.release(r.request_id)
            raise
        show = (eng.config.use_tqdm if use_tqdm is None else use_tqdm) and len(reqs) > 1
        bar = tqdm(total=len(reqs), desc="generate", disable=not show)
        left = {r.request_id for r in reqs if r.status != Status.FINISHED}
        while left or eng.in_flight:
            done = [o.request_id for o in eng.step().finished if o.request_id in left]   # not every row: O(finished)
            left.difference_update(done)
            bar.update(len(done))
        bar.close()
        results = [GenerationOutput(r.request_id, r.prompt_ids, r.output_ids, r.text, r.finish_reason,
                                    r.spec.as_dict(), prompt=text) for r, (text, _, _) in zip(reqs, batch)]
        for r in reqs:
            eng.release(r.request_id)
        return results

    def chat(self, messages, sampling_params: SamplingParams | dict | list | None = None,
             use_tqdm: bool | None = None, add_generation_prompt: bool = True) -> list[GenerationOutput]:
        """Generate the assistant's reply to one conversation (a list of `{"role", "content"}`
        messages) or to each of a list of conversations, through the tokenizer's chat template
        (as the server's /v1/chat/completions does). One `GenerationOutput` per conversation."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer.json, so it has no chat template: use generate "
                             "with token ids")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {role, content} dicts, or a list of such lists")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        texts = [self.tokenizer.apply_chat_template(list(c), add_generation_prompt=add_generation_prompt)
                 for c in convs]
        return self.generate(texts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt, sampling_params: SamplingParams | dict | None = None):
        """Yield the `RequestOutput`s of one request as its tokens are committed (a verify step
        can commit several at once). Closing the iterator early aborts the request. Either way
        the overlapped loop's step in flight is committed (it streams nothing more) when no
        other request is left, so the engine is idle afterwards, as after `generate`. The
        context is checked as in `generate`."""
        (_, ids, sp), = self._prepare([prompt], sampling_params)
        eng = self.engine
        req = eng.add_request(ids, sp, queue_limit=False)
        try:
            while req.status != Status.FINISHED:
                for out in eng.step():
                    if out.request_id == req.request_id:
                        yield out
        finally:
            if req.status != Status.FINISHED:
                eng.abort(req.request_id)
            while eng.in_flight and not (eng.scheduler.running or eng.scheduler.waiting):
                eng.step()
            eng.release(req.request_id)
