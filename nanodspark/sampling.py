"""Per-request sampling: temperature, top-k, top-p and seeds, on the device and in batches.

`SamplingParams` is what a user asks for; a bad value is a clear `ValueError` at construction
(and `validate()` again when the request reaches the engine, after any later change). A temperature below `GREEDY_BELOW` is
greedy (dividing logits by 1e-38 overflows to inf and the softmax to NaN; every engine draws
this line somewhere).

Sampling is a pure function of the distribution and a *key*. Each request has a 64-bit seed
(its own, or one drawn from the engine's generator when it is admitted). The token at position
`p` is `argmax_v (log P_p(v) + G_v)` where `G_v = -log(-log(u_v))` and `u_v` is a hash of
(seed, p, stream, v): the Gumbel-max trick, which samples `P_p` exactly when the `u_v` are
independent uniforms. Three consequences:

* no generator state: a row's token does not depend on the batch, on padding, on CUDA-graph
  replay or on when the host looks at it — which is what lets sampling run inside a captured
  graph and an overlapped loop (ragged_graphs.py, engine.py `step`);
* recompute after preemption draws the same tokens;
* streams keep independent draws apart: the drafter, the acceptance test, the residual and the
  target's own sample at one position use different streams (verify.py); the speculative
  streams are also keyed by the verify step's anchor, so a position proposed again by a later
  step is drawn afresh (the target's own stream is not: it is what target-only decoding draws).

`target_probs` turns logits into the distribution that is actually sampled (and that
speculative verification must preserve): with temperature 0 it is one-hot on the argmax, so
greedy decoding is the T -> 0 limit of the same code. The uniforms have 24 bits, so `G` is
truncated at about 17.3 (a tail of probability 3e-8 per draw).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

GREEDY_BELOW = 1e-5          # temperatures below this sample greedily
_M32 = 0xFFFFFFFF
# Streams of independent draws at one position (see verify.py and drafter.py).
STREAM_TARGET, STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL = 1, 2, 3, 4
STREAM_SYNTHETIC = 5       # a benchmark's stand-in acceptance (verify.SyntheticAcceptance)


@dataclass
class SamplingParams:
    temperature: float = 1.0      # 0 (or below GREEDY_BELOW) = greedy
    top_p: float = 1.0            # nucleus mass kept, in (0, 1]
    top_k: int = 0                # keep the k most likely tokens; 0 = all
    max_tokens: int = 64          # most new tokens
    stop: list[str] = field(default_factory=list)  # strings that end the generation (not returned)
    seed: int | None = None       # per-request seed for reproducible sampling
    ignore_eos: bool = False      # keep going past end-of-sequence tokens

    def __post_init__(self):      # a bad value fails here, where it was written
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def truncates(self) -> bool:
        """Does this request cut the distribution (top-k / top-p)?"""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1)

    def validate(self) -> "SamplingParams":
        def bad(msg):
            raise ValueError(msg)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not 0 <= self.temperature <= 100:
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


# ----------------------------------------------------------------------------- keyed noise
def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) on int64 tensors holding values in
    [0, 2^32); every product stays below 2^63, so no signed overflow happens on any device."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def noise_key(seed: torch.Tensor, position: torch.Tensor, stream: int,
              attempt: torch.Tensor | None = None) -> torch.Tensor:
    """One 32-bit key per row from (seed, position, stream[, attempt]): int64 [N]. `attempt`
    (the anchor's position of a verify step) makes a speculative draw at a position fresh each
    time a step proposes that position again (verify.py says why that matters)."""
    seed = seed.long()
    lo, hi = seed & _M32, (seed >> 32) & _M32
    k = _mix32(_mix32(lo) ^ hi)
    k = _mix32(k ^ (position.long() & _M32))
    if attempt is not None:
        k = _mix32(k ^ ((attempt.long() * 0x165667B1) & _M32))
    return _mix32(k ^ (stream * 0x27D4EB2F))


def _to_uniform(h: torch.Tensor) -> torch.Tensor:
    """24 high bits -> a float32 uniform in (0, 1), never 0 or 1."""
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def uniforms(seed: torch.Tensor, position: torch.Tensor, stream: int,
             attempt: torch.Tensor | None = None) -> torch.Tensor:
    """One uniform per row [N]."""
    return _to_uniform(_mix32(noise_key(seed, position, stream, attempt)))


def gumbel_argmax(log_weights: torch.Tensor, seed: torch.Tensor, position: torch.Tensor,
                  stream: int, attempt: torch.Tensor | None = None) -> torch.Tensor:
    """argmax_v (log_weights[n, v] + G(seed[n], position[n], stream[, attempt], v)) -> int64 [N]:
    a sample of softmax(log_weights[n]) (rows may hold -inf; a row that is all -inf returns 0)."""
    N, V = log_weights.shape
    key = noise_key(seed, position, stream, attempt)
    v = (torch.arange(V, device=log_weights.device, dtype=torch.long) * 0x61C88647) & _M32
    u = _to_uniform(_mix32(_mix32(key[:, None] ^ v[None, :])))
    return (log_weights.float() - torch.log(-torch.log(u))).argmax(-1)


# ----------------------------------------------------------------------------- batches of requests
@dataclass
class SamplingTensors:
    """The sampling parameters of N rows, on the device (one request may own several rows)."""
    temperature: torch.Tensor     # float32 [N]; 0 = greedy
    top_k: torch.Tensor           # int64 [N]; 0 = off
    top_p: torch.Tensor           # float32 [N]; 1 = off
    seed: torch.Tensor            # int64 [N]
    truncates: bool = False       # does any row use top-k / top-p (host-known: selects the sort)

    @classmethod
    def from_params(cls, params: list[SamplingParams], seeds: list[int], device) -> "SamplingTensors":
        return cls(torch.tensor([0.0 if p.greedy else float(p.temperature) for p in params], device=device),
                   torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
                   torch.tensor([float(p.top_p) for p in params], device=device),
                   torch.tensor(seeds, dtype=torch.long, device=device),
                   any(p.truncates for p in params))

    def rows(self, index: torch.Tensor) -> "SamplingTensors":
        return SamplingTensors(self.temperature[index], self.top_k[index], self.top_p[index], self.seed[index],
                               self.truncates)


def probs_from_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Row n of `logits` [N, V] -> the distribution row n samples from (fp32), on the device with
    no host sync: greedy rows one-hot on the argmax; the others scaled by their temperature, then
    top-k and top-p (one sort, only when `st.truncates`)."""
    z = logits.float()
    greedy = st.temperature < GREEDY_BELOW
    zz = z / torch.where(greedy, 1.0, st.temperature)[:, None]
    if st.truncates:
        zz = _top_k_top_p(zz, st.top_k, st.top_p)
    probs = torch.softmax(zz, dim=-1)
    onehot = torch.zeros_like(z).scatter_(1, z.argmax(-1, keepdim=True), 1.0)   # F.one_hot would sync
    return torch.where(greedy[:, None], onehot, probs)


def _top_k_top_p(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k and then top-p remove, row by row, in one sort."""
    V = z.shape[-1]
    # stable: tied logits keep their vocabulary order, whatever sort the batch's shape selects, so the
    # tokens a top-p cut keeps among ties are the same in any batch (batch_invariant)
    sorted_z, order = z.sort(dim=-1, descending=True, stable=True)
    k = torch.where((top_k > 0) & (top_k < V), top_k, V)
    kth = sorted_z.gather(1, (k - 1)[:, None])
    sorted_z = sorted_z.masked_fill(sorted_z < kth, float("-inf"))   # ties with the k-th survive
    probs = torch.softmax(sorted_z, dim=-1)
    tp = top_p[:, None]
    # keep tokens until the mass before them reaches top_p; rows with top_p = 1 keep everything
    # (a rounded cumsum can pass 1.0 before the tail, which must not cut a plain row's tail)
    drop = (probs.cumsum(-1) - probs >= tp) & (tp < 1)
    sorted_z = sorted_z.masked_fill(drop, float("-inf"))
    return torch.full_like(z, float("-inf")).scatter_(1, order, sorted_z)


def sample_from_probs(probs: torch.Tensor, st: SamplingTensors, position: torch.Tensor,
                      stream: int = STREAM_TARGET) -> torch.Tensor:
    """One token per row of `probs` [N, V]; greedy rows take the argmax."""
    drawn = gumbel_argmax(torch.log(probs), st.seed, position, stream)
    return torch.where(st.temperature < GREEDY_BELOW, probs.argmax(-1), drawn)


# ----------------------------------------------------------------------------- row lists (host API)
def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`probs_from_logits` for a list of `SamplingParams` (one per row)."""
    return probs_from_logits(logits, SamplingTensors.from_params(params, [0] * len(params), logits.device))


def sample_tokens(probs: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                  positions: list[int], stream: int = STREAM_TARGET) -> torch.Tensor:
    """One token per row of `probs` [N, V], row n keyed by (seeds[n], positions[n], stream)."""
    st = SamplingTensors.from_params(params, seeds, probs.device)
    return sample_from_probs(probs, st, torch.tensor(positions, device=probs.device), stream)


def draw_seed(generator: torch.Generator) -> int:
    """A request seed for a request that gave none, from the engine's generator."""
    return int(torch.randint(0, 2**62, (1,), generator=generator))

