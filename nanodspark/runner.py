"""Builds the inputs of one forward over a packed ragged batch and runs it.

A step hands the runner a list of `Chunk`s, one per request: the token ids it feeds this step
and the position of the first one. A prefill chunk, a single decode token and a verify window
(`[anchor, draft_1 .. draft_w]`) are all just chunks; only `logit_rows` differs (the last row, or
every row). The runner turns chunks into flat tensors (`input_ids`, `positions`,
`cu_seqlens_q`) and, per KV group, block tables, slot mappings and KV lengths, then calls the
model with a `PagedAttentionContext`. Nothing here mutates a request: the caller applies the
returned `ForwardResult`.

Invariants: the KV of positions `< chunk.start` is already in the cache (or, for SWA replay rows,
in the full-attention group only); a chunk's blocks were reserved by the scheduler before the
forward; rows below `chunk.replay_until` do not store into the prefix-cached `full` group.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .model import CausalLM, GroupMeta, KVCache, PagedAttentionContext
from .paged_kv import BlockTable


@dataclass
class Chunk:
    tables: dict[str, BlockTable]      # the request's block table per KV group
    start: int                         # position of token_ids[0]
    token_ids: list[int]
    logit_rows: str = "last"           # "last" | "all" | "none"
    replay_until: int = 0              # SWA replay: rows before this position skip the full group
    kv_start: int = 0                  # sliding layers read no position below this


@dataclass
class ForwardResult:
    logits: torch.Tensor               # [N, V] fp32, rows in chunk order as asked by logit_rows
    logit_offsets: list[int]           # chunk i owns logits[logit_offsets[i]:logit_offsets[i+1]]
    captured: list[torch.Tensor] = field(default_factory=list)  # [T, H] per captured layer
    cu_seqlens: list[int] = field(default_factory=list)         # row offsets of the chunks


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, backend: str, device: torch.device):
        self.model, self.kv_cache, self.backend, self.device = model, kv_cache, backend, device
        self.block_size = kv_cache.block_size

    def _slots(self, table: BlockTable, positions: range, skip_below: int) -> list[int]:
        bs = self.block_size
        # Writing past the reservation would land in a block another request may own.
        assert not positions or positions[-1] < table.num_tokens, (
            f"positions up to {positions[-1]} on a table reserved for {table.num_tokens}")
        return [-1 if p < skip_below or table.blocks[p // bs] < 0
                else table.blocks[p // bs] * bs + p % bs for p in positions]

    def build_context(self, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionContext, list[int]]:
        ids, pos, cu = [], [], [0]
        for c in chunks:
            ids += c.token_ids
            pos += range(c.start, c.start + len(c.token_ids))
            cu.append(cu[-1] + len(c.token_ids))
        groups = {}
        for g in self.kv_cache.layout:
            tables = [c.tables[g] for c in chunks]
            width = max(1, max(len(t.blocks) for t in tables))
            # one tensor from padded lists: a torch op per request costs ~10 us of host time each
            bt = torch.tensor([t.blocks + [-1] * (width - len(t.blocks)) for t in tables], dtype=torch.int32)
            slots = []
            for c, t in zip(chunks, tables):
                skip = c.replay_until if g == "full" else 0
                slots += self._slots(t, range(c.start, c.start + len(c.token_ids)), skip)
            groups[g] = GroupMeta(
                block_tables=bt.to(self.device),
                slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
                kv_lens=torch.tensor([c.start + len(c.token_ids) for c in chunks], dtype=torch.int32, device=self.device),
                kv_start=(torch.tensor([c.kv_start for c in chunks], dtype=torch.int32, device=self.device)
                          if g == "sliding" else None))
        ctx = PagedAttentionContext(self.kv_cache, torch.tensor(cu, dtype=torch.int32, device=self.device),
                                    max(len(c.token_ids) for c in chunks), groups, self.backend)
        return (torch.tensor(ids, dtype=torch.long, device=self.device),
                torch.tensor(pos, dtype=torch.long, device=self.device), ctx, cu)

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk], capture_layers: tuple[int, ...] = ()) -> ForwardResult:
        ids, pos, ctx, cu = self.build_context(chunks)
        out = self.model(ids, pos, ctx, capture_layers)
        rows, offsets = [], [0]
        for i, c in enumerate(chunks):
            if c.logit_rows == "all":
                rows += range(cu[i], cu[i + 1])
            elif c.logit_rows == "last":
                rows.append(cu[i + 1] - 1)
            offsets.append(len(rows))
        logits = self.model.compute_logits(out.hidden[torch.tensor(rows, dtype=torch.long, device=self.device)])
        return ForwardResult(logits, offsets, out.captured, cu)
