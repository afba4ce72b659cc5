"""Per-request sampling: temperature, top-k, top-p and seeds.

`SamplingParams` is what a user asks for; `validate()` turns a bad value into a clear
`ValueError` before the request reaches the engine. `target_probs` turns logits into the
distribution that is actually sampled (and that speculative verification must preserve): with
temperature 0 it is one-hot on the argmax, so greedy decoding is the T -> 0 limit of the same
code path. Each request with a `seed` owns a `torch.Generator`, so its output does not depend on
what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    temperature: float = 1.0      # 0 = greedy
    top_p: float = 1.0            # nucleus mass kept, in (0, 1]
    top_k: int = 0                # keep the k most likely tokens; 0 = all
    max_tokens: int = 64          # most new tokens
    stop: list[str] = field(default_factory=list)  # strings that end the generation (not returned)
    seed: int | None = None       # per-request seed for reproducible sampling
    ignore_eos: bool = False      # keep going past end-of-sequence tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> "SamplingParams":
        def bad(msg):
            raise ValueError(msg)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            bad(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            bad(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop must be a list of non-empty strings")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad(f"seed must be an integer, got {self.seed!r}")
        return self


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Row i of `logits` [N, V] -> the distribution request params[i] samples from (fp32).

    Greedy rows and plain-temperature rows are done as one batched op each; only rows with
    top-k or top-p need their own pass."""
    z = logits.float()
    out = torch.empty_like(z)
    dev = z.device
    greedy = [i for i, p in enumerate(params) if p.greedy]
    plain = [i for i, p in enumerate(params) if not p.greedy and not p.top_k and p.top_p >= 1]
    if greedy:
        g = torch.tensor(greedy, device=dev)
        out[g] = torch.nn.functional.one_hot(z[g].argmax(-1), z.shape[-1]).float()
    if plain:
        idx = torch.tensor(plain, device=dev)
        temp = torch.tensor([params[i].temperature for i in plain], device=dev)
        out[idx] = torch.softmax(z[idx] / temp[:, None], dim=-1)
    for i, p in enumerate(params):
        if not p.greedy and (p.top_k or p.top_p < 1):
            out[i] = _one_row(z[i], p)
    return out


def _one_row(z: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    if p.greedy:
        return torch.nn.functional.one_hot(z.argmax(), z.shape[-1]).float()
    z = z / p.temperature
    if p.top_k and p.top_k < z.shape[-1]:
        kth = torch.topk(z, p.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    if p.top_p < 1:
        sorted_p, idx = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # keep tokens until the mass before them reaches top_p
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p * keep)
        probs = probs / probs.sum()
    return probs


def sample_from(probs: torch.Tensor, generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of `probs` [N, V], each row with its own generator."""
    return [int(torch.multinomial(probs[i], 1, generator=g)) for i, g in enumerate(generators)]


def make_generator(seed: int | None, device: torch.device, fallback: torch.Generator) -> torch.Generator:
    if seed is None:
        return fallback
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
