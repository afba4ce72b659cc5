"""The offline API: `LLM(model_path, **engine_kwargs)`, `generate` and `stream`.

A thin layer over `LLMEngine` (engine.py): it adds requests, steps the engine until they finish
and returns their outputs. The server (nanodspark/server/) drives the same engine in a loop of
its own. Walkthrough chapter 01.
"""
from __future__ import annotations

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


class LLM:
    """`LLM(model_path, **engine_kwargs).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model_path: str | None = None, **engine_kwargs):
        self.engine = build_engine(model_path, EngineConfig.from_kwargs(**engine_kwargs))
        self.tokenizer = self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (`tensor_parallel_size > 1`)."""
        self.engine.shutdown()

    def stream(self, prompt, params: SamplingParams | None = None):
        """Yield the `RequestOutput`s of one request as its tokens are committed (a verify step
        can commit several at once). Closing the iterator early aborts the request. Either way
        the overlapped loop's step in flight is committed (it streams nothing more) when no
        other request is left, so the engine is idle afterwards, as after `generate`."""
        eng = self.engine
        req = eng.add_request(prompt, params, queue_limit=False)
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

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[GenerationOutput]:
        from tqdm.auto import tqdm
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        eng = self.engine
        reqs = [eng.add_request(p, sp, queue_limit=False, stream_text=False) for p, sp in zip(prompts, plist)]
        show = (self.engine.config.use_tqdm if use_tqdm is None else use_tqdm) and len(reqs) > 1
        bar = tqdm(total=len(reqs), desc="generate", disable=not show)
        while any(r.status != Status.FINISHED for r in reqs) or eng.in_flight:
            for out in eng.step():
                if out.finished:
                    bar.update(1)
        bar.close()
        results = [GenerationOutput(r.request_id, r.prompt_ids, r.output_ids, r.text, r.finish_reason,
                                    r.spec.as_dict()) for r in reqs]
        for r in reqs:
            eng.release(r.request_id)
        return results
