"""Paged KV cache bookkeeping: block pool, block tables, prefix cache (walkthrough/02_paged_kv.md).

This file implements the paged KV chapter. It decides *where* every token's K/V lives: the host
bookkeeping owns no tensors, `row_cache_index` / `table_cache_index` turn device block tables
into cache indices for a forward, and the kernels (`kernels/store_kv.py`,
`kernels/paged_attention.py`) move the data.

The idea
--------
The KV cache of one KV group is a pool of `num_blocks` fixed-size blocks of `block_size` token
entries. A request does not get one contiguous region; it gets a *block table*: a list of
physical block ids, where logical block `i` holds token positions `[i*bs, (i+1)*bs)`. So token
position `p` lives at cache index `blocks[p // bs] * bs + p % bs`. Memory is reserved one block at a time, no
request fragments the pool, and two requests can point at the same physical block.

Sharing is what the prefix cache does. When a block is full of *committed* tokens we publish it
under a chain hash `h_i = hash((h_{i-1}, tokens of block i))`, which names the whole prefix up to
and including block `i`. A later prompt walks its own chain and reuses every block it finds, so
it skips computing that prefix.

Invariants (checked by `BlockManager.check_invariants`)
-------------------------------------------------------
* Ownership: a block is referenced by `ref_count[b]` live tables (each at most once). A block
  with `ref_count == 0` is free, i.e. in exactly one of the two free lists; a referenced block is
  in neither. Only published blocks are ever shared (`ref_count > 1` implies published).
* Published blocks are full, hold committed tokens, and are read-only: a table only writes
  positions `>= num_hashed_blocks * bs`, which are in blocks it alone owns.
* A free published block keeps its K/V and its hash until the pool needs it: allocation takes
  unpublished blocks first, then evicts the least recently freed published block (removing
  its hash). A block with `ref_count > 0` is never evicted.
* A prefix hit of `n` tokens guarantees that the returned blocks hold exactly the K/V of
  `token_ids[:n]` (the hash chain is verified against the stored tokens and parent hash), that
  `n` is a multiple of `bs`, and that `n <= len(prompt) - 1`: the last prompt token is always
  computed, because its logits are needed to sample the first output token.
* Every mutating method is atomic: it raises `NoFreeBlocks` (or `AssertionError` on misuse)
  before changing anything.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

_ROOT_HASH = 0  # parent hash of block 0


class NoFreeBlocks(RuntimeError):
    """The pool cannot supply the blocks asked for; nothing was changed."""


@dataclass
class BlockTable:
    """One request's table in one KV group."""
    blocks: list[int] = field(default_factory=list)  # physical block ids; -1 = released
    num_tokens: int = 0          # positions with reserved cache entries (may include speculative ones)
    num_cached_tokens: int = 0   # prefix-cache hit length at allocation (multiple of block_size)
    num_hashed_blocks: int = 0   # leading full blocks already published in the prefix cache
    last_hash: int = _ROOT_HASH  # chain hash of block num_hashed_blocks - 1 (the next's parent)


def chain_hash(parent: int, tokens: Sequence[int]) -> int:
    """Hash of a block given its parent's hash: names the whole prefix ending with this block.
    Python's tuple hash of ints is deterministic; hits are verified against the stored
    (parent hash, tokens), so only a collision of two parent chains could fool the cache, which
    a production engine makes negligible with a cryptographic hash (e.g. sha256)."""
    return hash((parent, tuple(tokens)))


class BlockManager:
    """Block pool + prefix cache of one KV group."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_count = [0] * num_blocks
        # A published block remembers its hash and the (parent hash, tokens) key it was built from.
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_key: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks
        self.cache: dict[int, int] = {}  # chain hash -> physical block id
        # Free blocks in two lists: unpublished ones (taken first) and published ones in the
        # order they were freed (an LRU: the oldest is evicted first, when nothing else is left).
        self.free_plain: deque[int] = deque(range(num_blocks))
        self.free_cached: OrderedDict[int, None] = OrderedDict()

    # ---- pool -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_new_blocks: int) -> bool:
        return num_new_blocks <= self.num_free_blocks

    def _take_free_block(self) -> int:
        # BEGIN STUDENT paged-kv take-free-block
        if self.free_plain:
            b = self.free_plain.popleft()
        else:  # evict the least recently freed published block: its hash goes with it
            b, _ = self.free_cached.popitem(last=False)
            del self.cache[self.block_hash[b]]
            self.block_hash[b] = self.block_key[b] = None
        assert self.ref_count[b] == 0
        self.ref_count[b] = 1
        return b
        # END STUDENT paged-kv

    def _incref(self, b: int) -> None:
        # BEGIN STUDENT paged-kv incref
        if self.ref_count[b] == 0:  # a free published block being hit: take it off the free list
            del self.free_cached[b]
        self.ref_count[b] += 1
        # END STUDENT paged-kv

    def _decref(self, b: int) -> None:
        # BEGIN STUDENT paged-kv decref
        assert self.ref_count[b] > 0, f"double free of block {b}"
        self.ref_count[b] -= 1
        if self.ref_count[b] == 0:
            if self.block_hash[b] is None:
                self.free_plain.append(b)
            else:  # keeps its K/V and hash: a later prompt may still hit it
                self.free_cached[b] = None
        # END STUDENT paged-kv

    # ---- prefix cache -----------------------------------------------------------------------
    def _lookup(self, token_ids: Sequence[int], max_tokens: int) -> tuple[list[int], int]:
        """Walk the hash chain over the full blocks of token_ids[:max_tokens] up to a miss."""
        # BEGIN STUDENT paged-kv lookup
        hits, h, bs = [], _ROOT_HASH, self.block_size
        if not self.enable_prefix_cache:
            return hits, h
        for i in range(max_tokens // bs):
            key = (h, tuple(token_ids[i * bs:(i + 1) * bs]))
            b = self.cache.get(chain_hash(*key))
            if b is None or self.block_key[b] != key:  # miss, or a hash collision
                break
            hits.append(b)
            h = self.block_hash[b]
        return hits, h
        # END STUDENT paged-kv

    def match_prefix(self, token_ids: Sequence[int]) -> int:
        """How many prompt tokens allocate_prompt would take from the cache (no side effects).
        With several KV groups, the engine takes the min over groups and passes it as the cap."""
        cap = (len(token_ids) - 1) // self.block_size * self.block_size
        return len(self._lookup(token_ids, cap)[0]) * self.block_size

    def prefix_blocks(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """The cached blocks a prompt's first `max_tokens` tokens would hit (no side effects)."""
        return self._lookup(token_ids, max_tokens)[0]

    def allocate_prompt(self, token_ids: Sequence[int],
                        max_cached_tokens: int | None = None) -> BlockTable:
        """A new table holding the prompt: cached prefix blocks shared, the rest fresh."""
        # BEGIN STUDENT paged-kv allocate-prompt
        n, bs = len(token_ids), self.block_size
        assert n > 0, "empty prompt"
        cap = (n - 1) // bs * bs  # never the whole prompt: the last token must be computed
        if max_cached_tokens is not None:
            cap = min(cap, max_cached_tokens)
        hits, h = self._lookup(token_ids, cap)
        num_new = self.blocks_for(n) - len(hits)
        # Hit blocks with ref_count 0 are counted as free but are about to be taken by us.
        available = self.num_free_blocks - sum(self.ref_count[b] == 0 for b in hits)
        if num_new > available:
            raise NoFreeBlocks(f"prompt needs {num_new} new blocks, {available} free")
        for b in hits:  # take the hits first, so that the evictions below cannot pick them
            self._incref(b)
        blocks = hits + [self._take_free_block() for _ in range(num_new)]
        return BlockTable(blocks, num_tokens=n, num_cached_tokens=len(hits) * bs,
                          num_hashed_blocks=len(hits), last_hash=h)
        # END STUDENT paged-kv

    def commit(self, table: BlockTable, token_ids: Sequence[int], start: int = 0) -> None:
        """token_ids: the request's committed tokens (prompt + output, K/V written) from position
        `start` on. Publishes the blocks that became full, so later prompts can hit them. A
        caller that passes only the tokens from `published_tokens(table)` on pays for the new
        tokens, not for the whole request, every step."""
        assert start + len(token_ids) <= table.num_tokens, (
            f"committing tokens without reserved cache entries: positions {start}..{start + len(token_ids)} "
            f"of a table reserved for {table.num_tokens} ({table.num_hashed_blocks} blocks published)")
        # BEGIN STUDENT paged-kv commit
        if not self.enable_prefix_cache:
            return
        bs = self.block_size
        assert start <= table.num_hashed_blocks * bs, "commit must cover the first unpublished block"
        for i in range(table.num_hashed_blocks, (start + len(token_ids)) // bs):
            lo = i * bs - start
            key = (table.last_hash, tuple(token_ids[lo:lo + bs]))
            h, b = chain_hash(*key), table.blocks[i]
            # b == -1: released by a sliding window, nothing to publish (the chain goes on).
            # h already cached: another request published the same prefix first; keep theirs.
            if b != -1 and h not in self.cache:
                assert self.block_hash[b] is None and self.ref_count[b] == 1
                self.cache[h], self.block_hash[b], self.block_key[b] = b, h, key
            table.last_hash, table.num_hashed_blocks = h, i + 1
        # END STUDENT paged-kv

    def published_tokens(self, table: BlockTable) -> int:
        """Positions already published by `commit` (whole blocks)."""
        return table.num_hashed_blocks * self.block_size

    # ---- growing, rolling back, releasing ---------------------------------------------------
    def ensure_capacity(self, table: BlockTable, num_tokens: int) -> None:
        """Reserve cache entries for positions < num_tokens (decode, speculative windows)."""
        # BEGIN STUDENT paged-kv ensure-capacity
        if num_tokens <= table.num_tokens:
            return
        need = self.blocks_for(num_tokens) - len(table.blocks)
        if need > self.num_free_blocks:
            raise NoFreeBlocks(f"need {need} new blocks, {self.num_free_blocks} free")
        table.blocks.extend(self._take_free_block() for _ in range(need))
        table.num_tokens = num_tokens
        # END STUDENT paged-kv

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Roll back to num_tokens reserved tokens (rejected speculative tokens): frees the
        blocks past it. Stale K/V left in the last kept block is overwritten by the next write."""
        assert num_tokens <= table.num_tokens, "truncate cannot grow a table"
        assert num_tokens >= table.num_hashed_blocks * self.block_size, \
            "truncate below the published prefix"
        # BEGIN STUDENT paged-kv truncate
        keep = self.blocks_for(num_tokens)
        for b in reversed(table.blocks[keep:]):
            if b != -1:
                self._decref(b)
        del table.blocks[keep:]
        table.num_tokens = num_tokens
        # END STUDENT paged-kv

    def release_outside_window(self, table: BlockTable, window: int, num_committed: int) -> int:
        """Sliding-window groups: free the blocks wholly before position num_committed - window
        (no future query, which sits at a position >= num_committed, can attend to them)."""
        assert window > 0
        # BEGIN STUDENT paged-kv release-window
        released = 0
        for i in range(min(max(num_committed - window, 0) // self.block_size, len(table.blocks))):
            if table.blocks[i] != -1:
                self._decref(table.blocks[i])
                table.blocks[i] = -1
                released += 1
        return released
        # END STUDENT paged-kv

    def free(self, table: BlockTable) -> None:
        """The request is done (finished or aborted). Published blocks stay cached but evictable.
        Blocks are freed last-first, so the tail of a chain is evicted before its head."""
        # BEGIN STUDENT paged-kv free
        for b in reversed(table.blocks):
            if b != -1:
                self._decref(b)
        table.blocks, table.num_tokens = [], 0  # an empty table: freeing it again is a no-op
        table.num_cached_tokens, table.num_hashed_blocks, table.last_hash = 0, 0, _ROOT_HASH
        # END STUDENT paged-kv

    # ---- cache indices ----------------------------------------------------------------------
    def cache_index(self, table: BlockTable, pos: int) -> int:
        """Flat cache index of token position pos; -1 if its block was released."""
        # BEGIN STUDENT paged-kv cache-index
        assert 0 <= pos < table.num_tokens, f"position {pos} has no reserved cache entry"
        b = table.blocks[pos // self.block_size]
        return -1 if b == -1 else b * self.block_size + pos % self.block_size
        # END STUDENT paged-kv

    def cache_indices(self, table: BlockTable, start: int, end: int) -> list[int]:
        return [self.cache_index(table, p) for p in range(start, end)]

    # ---- checking ---------------------------------------------------------------------------
    def check_invariants(self, live_tables: Iterable[BlockTable]) -> None:
        """Assert the invariants of the module docstring. live_tables: every table that has
        been allocated and not freed (the manager keeps no list of them; the engine does)."""
        bs, expected = self.block_size, [0] * self.num_blocks
        for t in live_tables:
            held = [b for b in t.blocks if b != -1]
            assert len(held) == len(set(held)), f"block twice in one table: {t.blocks}"
            assert len(t.blocks) == self.blocks_for(t.num_tokens), t
            assert t.num_cached_tokens % bs == 0, t
            assert t.num_cached_tokens <= t.num_hashed_blocks * bs <= t.num_tokens, t
            for b in held:
                expected[b] += 1
        assert self.ref_count == expected, "ref counts differ from the live tables"
        plain, cached = list(self.free_plain), list(self.free_cached)
        assert len(set(plain + cached)) == len(plain) + len(cached), "free list duplicates"
        assert set(plain + cached) == {b for b in range(self.num_blocks) if expected[b] == 0}
        assert all(self.block_hash[b] is None for b in plain)
        assert all(self.block_hash[b] is not None for b in cached)
        for b in range(self.num_blocks):
            assert expected[b] <= 1 or self.block_hash[b] is not None, "shared private block"
            h = self.block_hash[b]
            assert (h is None) == (self.block_key[b] is None)
            assert h is None or (self.cache.get(h) == b and chain_hash(*self.block_key[b]) == h)
            assert h is None or len(self.block_key[b][1]) == bs
        assert len(self.cache) == sum(h is not None for h in self.block_hash)


# ----------------------------------------------------------------------------- on the device
# A forward addresses the cache through the device copies of the tables (device_state.py), with
# no host sync: these are `BlockManager.cache_index` for many positions at once.
def table_cache_index(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache index of each position of each request: block_tables int32 [R, W], positions
    [R, n] -> int64 [R, n]; -1 where the table has no block (a padding row)."""
    col = (positions // block_size).clamp(0, block_tables.shape[1] - 1)
    blk = block_tables.gather(1, col).long()
    return torch.where(blk >= 0, blk * block_size + positions % block_size, -1)


def row_cache_index(block_tables: torch.Tensor, row_req: torch.Tensor, positions: torch.Tensor,
                    block_size: int) -> torch.Tensor:
    """Cache index of each packed row: block_tables [R, W], row_req [T] (its request), positions [T]."""
    col = (positions // block_size).clamp(0, block_tables.shape[1] - 1)
    blk = block_tables[row_req, col].long()
    return torch.where(blk >= 0, blk * block_size + positions % block_size, -1)
