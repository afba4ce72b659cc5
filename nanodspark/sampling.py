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

    Batched over rows: greedy rows are one-hot; the other rows are scaled by their own
    temperature, then top-k and top-p are applied to every row at once (one sort) with
    per-row limits (top_k 0 and top_p 1 keep everything)."""
    z = logits.float()
    out = torch.empty_like(z)
    dev, V = z.device, z.shape[-1]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    rest = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        g = torch.tensor(greedy, device=dev)
        out[g] = torch.nn.functional.one_hot(z[g].argmax(-1), V).float()
    if rest:
        idx = torch.tensor(rest, device=dev)
        ps = [params[i] for i in rest]
        zz = z[idx] / torch.tensor([p.temperature for p in ps], device=dev)[:, None]
        if any(p.top_k or p.top_p < 1 for p in ps):
            zz = _top_k_top_p(zz, ps)
        out[idx] = torch.softmax(zz, dim=-1)
    return out


def _top_k_top_p(z: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) what top-k and then top-p remove, row by row, in one sort."""
    dev, V = z.device, z.shape[-1]
    sorted_z, order = z.sort(dim=-1, descending=True)
    k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in ps], device=dev)
    kth = sorted_z.gather(1, (k - 1)[:, None])
    sorted_z = sorted_z.masked_fill(sorted_z < kth, float("-inf"))   # ties with the k-th survive
    probs = torch.softmax(sorted_z, dim=-1)
    top_p = torch.tensor([p.top_p for p in ps], device=dev)[:, None]
    # keep tokens until the mass before them reaches top_p; rows with top_p = 1 keep everything
    # (a rounded cumsum can pass 1.0 before the tail, which must not cut a plain row's tail)
    drop = (probs.cumsum(-1) - probs >= top_p) & (top_p < 1)
    sorted_z = sorted_z.masked_fill(drop, float("-inf"))
    return torch.full_like(z, float("-inf")).scatter_(1, order, sorted_z)


def sample_tokens(probs: torch.Tensor, params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of `probs` [N, V] (a device tensor; the caller syncs once).

    Greedy rows take the argmax. Rows that share a generator (the engine's default one) are
    drawn in one call; a request with its own seed draws from its own generator, so its tokens
    do not depend on the rest of the batch."""
    toks = probs.argmax(-1)
    groups: dict[int, list[int]] = {}
    for i, (p, g) in enumerate(zip(params, generators)):
        if not p.greedy:
            groups.setdefault(id(g), []).append(i)
    for rows in groups.values():
        idx = torch.tensor(rows, device=probs.device)
        toks[idx] = torch.multinomial(probs[idx], 1, generator=generators[rows[0]])[:, 0]
    return toks


def make_generator(seed: int | None, device: torch.device, fallback: torch.Generator) -> torch.Generator:
    if seed is None:
        return fallback
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
