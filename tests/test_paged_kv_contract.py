"""The paged KV contract, through public names only (the course's `paged-kv` unit).

tests/test_paged_kv.py checks the reference from the inside (its ref counts, free lists and hash
maps). These tests check only what a caller can see — tables, cache indices, prefix-hit lengths,
free-block counts, `NoFreeBlocks` — so a student's BlockManager with other internals passes
them too: a block is *used* exactly when some live table holds it, a hit returns blocks that
hold exactly the requested prefix (a shadow KV written through `cache_index` says what each block
holds), and a refused call changes nothing a caller can observe."""
import pytest
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from nanodspark import paged_kv
from nanodspark.paged_kv import BlockManager, NoFreeBlocks

PROBES = [list(range(12)), list(range(8)) + [50, 51, 52], [1, 2, 3, 4, 5, 6, 7, 8, 9], [7, 8, 9, 10, 11]]


def observable(m: BlockManager, tables=()):
    """Everything a caller can see of the pool: free blocks, hits of a few probe prompts, the tables."""
    return (m.num_free_blocks, m.num_used_blocks, [m.match_prefix(p) for p in PROBES],
            [(list(t.blocks), t.num_tokens, t.num_cached_tokens, t.num_hashed_blocks, t.last_hash) for t in tables])


def prefilled(m: BlockManager, prompt):
    """allocate + commit, as the engine does once the prompt's K/V is written."""
    t = m.allocate_prompt(prompt)
    m.commit(t, prompt)
    return t


def held(tables):
    return {b for t in tables for b in t.blocks if b != -1}


# ---- pool and cache indices -------------------------------------------------------------------
def test_allocation_reserves_whole_blocks_and_cache_indices_follow_the_table():
    m = BlockManager(8, 4)
    assert (m.num_free_blocks, m.num_used_blocks) == (8, 0)
    m.allocate_prompt([9])                                # so the next table does not start at block 0
    t = m.allocate_prompt(list(range(9)))
    assert len(t.blocks) == 3 == len(set(t.blocks)) and t.num_tokens == 9 and t.num_cached_tokens == 0
    assert m.num_used_blocks == 4 and m.num_free_blocks == 4
    assert [m.cache_index(t, p) for p in range(9)] == [t.blocks[p // 4] * 4 + p % 4 for p in range(9)]
    assert m.cache_indices(t, 2, 6) == [m.cache_index(t, p) for p in range(2, 6)]
    with pytest.raises(AssertionError):
        m.cache_index(t, 9)                                      # no reserved cache entry there


# ---- prefix cache -----------------------------------------------------------------------------
def test_prefix_hit_shares_full_blocks_and_caps_at_the_last_token():
    m = BlockManager(16, 4)
    a = prefilled(m, list(range(10)))                     # blocks 0..1 full -> published, block 2 partial
    assert a.num_hashed_blocks == 2 and m.published_tokens(a) == 8
    used = m.num_used_blocks
    b = m.allocate_prompt(list(range(8)) + [50, 51, 52])
    assert b.num_cached_tokens == 8 and b.blocks[:2] == a.blocks[:2] and b.blocks[2] not in a.blocks
    assert b.num_hashed_blocks == 2 and m.num_used_blocks == used + 1   # the shared blocks cost nothing
    # the last prompt token is always computed: a fully cached prompt recomputes its last block
    c = prefilled(m, list(range(8)))
    assert m.allocate_prompt(list(range(8))).num_cached_tokens == 4
    assert m.allocate_prompt(list(range(9))).num_cached_tokens == 8
    assert m.allocate_prompt(list(range(4))).num_cached_tokens == 0
    assert m.match_prefix(list(range(8))) == 4 and m.match_prefix(list(range(9))) == 8
    assert m.allocate_prompt(list(range(9)), max_cached_tokens=4).num_cached_tokens == 4
    assert c.num_tokens == 8


def test_a_hit_needs_the_whole_chain():
    m = BlockManager(16, 4)
    prefilled(m, [1, 1, 1, 1, 2, 2, 2, 2, 3])
    # the same second block after another first block names another prefix: no hit
    assert m.allocate_prompt([0, 1, 1, 1, 2, 2, 2, 2, 3]).num_cached_tokens == 0
    assert m.match_prefix([1, 1, 1, 1, 2, 2, 2, 2, 3]) == 8


def test_a_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(paged_kv, "chain_hash", lambda parent, tokens: 7)    # everything collides
    m = BlockManager(16, 2)
    prefilled(m, [1, 2, 3])
    assert m.allocate_prompt([1, 2, 3]).num_cached_tokens == 2
    assert m.allocate_prompt([5, 6, 3]).num_cached_tokens == 0             # same hash, other tokens


def test_without_the_prefix_cache_nothing_is_shared():
    m = BlockManager(16, 4, enable_prefix_cache=False)
    a = prefilled(m, list(range(9)))
    t = m.allocate_prompt(list(range(9)))
    assert t.num_cached_tokens == 0 and t.num_hashed_blocks == 0 and not set(t.blocks) & set(a.blocks)
    m.truncate(t, 0)                                      # nothing published, so rolling back to 0 is legal
    assert t.blocks == [] and m.num_used_blocks == 3


def test_commit_publishes_only_full_committed_blocks_from_any_offset():
    m = BlockManager(16, 4)
    t = m.allocate_prompt([1, 2, 3])
    m.ensure_capacity(t, 10)
    m.commit(t, [1, 2, 3, 4, 5, 6, 7])
    assert t.num_hashed_blocks == 1 and m.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 4
    m.commit(t, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert t.num_hashed_blocks == 2 and m.allocate_prompt([1, 2, 3, 4, 5, 6, 7, 8, 0]).num_cached_tokens == 8
    with pytest.raises(AssertionError):
        m.commit(t, list(range(11)))                      # more tokens than reserved entries
    # committing only the new tokens (from published_tokens on) equals committing them all
    ids = list(range(1, 23))
    whole, tail = BlockManager(16, 4), BlockManager(16, 4)
    a, b = whole.allocate_prompt(ids[:3]), tail.allocate_prompt(ids[:3])
    whole.ensure_capacity(a, len(ids))
    tail.ensure_capacity(b, len(ids))
    for n in (3, 7, 9, 16, 22):
        whole.commit(a, ids[:n])
        start = tail.published_tokens(b)
        tail.commit(b, ids[start:n], start)
        assert (b.num_hashed_blocks, b.last_hash) == (a.num_hashed_blocks, a.last_hash) and b.num_hashed_blocks == n // 4
    assert tail.match_prefix(ids + [0]) == whole.match_prefix(ids + [0]) == 20
    c = tail.allocate_prompt([9, 9, 9])
    tail.ensure_capacity(c, 12)
    with pytest.raises(AssertionError, match="first unpublished block"):    # skipping block 0
        tail.commit(c, ids[4:8], 4)


def test_the_first_publisher_of_a_prefix_keeps_it():
    m = BlockManager(16, 4)
    a = m.allocate_prompt([1, 2, 3, 4, 5])
    b = m.allocate_prompt([1, 2, 3, 4, 5])                # nothing cached yet: computes its own copy
    m.commit(a, [1, 2, 3, 4, 5])
    m.commit(b, [1, 2, 3, 4, 5])
    assert b.num_hashed_blocks == 1                       # the chain goes on even when nothing is published
    m.free(b)
    assert b.blocks == [] and m.num_free_blocks == 14     # b's copy was private: really freed
    assert m.allocate_prompt([1, 2, 3, 4, 9]).blocks[0] == a.blocks[0]


# ---- atomic failures --------------------------------------------------------------------------
def test_a_refused_prompt_changes_nothing():
    m = BlockManager(4, 4)
    t = m.allocate_prompt(list(range(12)))
    before = observable(m, [t])
    with pytest.raises(NoFreeBlocks):
        m.allocate_prompt(list(range(100, 108)))
    assert observable(m, [t]) == before


def test_free_hit_blocks_count_as_taken():
    m = BlockManager(3, 4)
    m.free(prefilled(m, list(range(9))))                  # 2 published free blocks + 1 unpublished one
    before = observable(m)
    # hits 2 blocks (both free, so they are not extra free space) and needs 2 more: only 1 is left
    with pytest.raises(NoFreeBlocks):
        m.allocate_prompt(list(range(8)) + [20, 21, 22, 23, 24])
    assert observable(m) == before
    t = m.allocate_prompt(list(range(8)) + [20])          # needs 1 more: fits
    assert t.num_cached_tokens == 8 and m.num_free_blocks == 0


def test_ensure_capacity_grows_and_fails_atomically():
    m = BlockManager(4, 4)
    t = m.allocate_prompt([1, 2, 3])
    m.ensure_capacity(t, 9)
    assert len(t.blocks) == 3 and t.num_tokens == 9
    m.ensure_capacity(t, 5)                               # already there: a no-op, never shrinks
    assert t.num_tokens == 9
    before = observable(m, [t])
    with pytest.raises(NoFreeBlocks):
        m.ensure_capacity(t, 17)
    assert observable(m, [t]) == before


# ---- rollback and windows ---------------------------------------------------------------------
def test_truncate_frees_the_blocks_of_rejected_drafts():
    m = BlockManager(8, 4)
    t = prefilled(m, [1, 2, 3, 4, 5])
    m.ensure_capacity(t, 13)                              # a speculative window of 8 tokens
    assert m.num_free_blocks == 4
    m.truncate(t, 6)                                      # 1 of 8 accepted
    assert len(t.blocks) == 2 and t.num_tokens == 6 and m.num_free_blocks == 6
    with pytest.raises(AssertionError):
        m.truncate(t, 3)                                  # below the published block 0
    with pytest.raises(AssertionError):
        m.truncate(t, 7)                                  # truncate cannot grow
    m.truncate(t, 4)
    assert len(t.blocks) == 1 and m.num_free_blocks == 7


def test_release_outside_window():
    m = BlockManager(8, 4)
    t = m.allocate_prompt(list(range(20)))
    # keep positions >= 17 - 6 = 11: blocks 0 ([0, 4)) and 1 ([4, 8)) are wholly before it
    assert m.release_outside_window(t, window=6, num_committed=17) == 2
    assert t.blocks[:2] == [-1, -1] and -1 not in t.blocks[2:]
    assert m.release_outside_window(t, window=6, num_committed=17) == 0  # idempotent
    assert m.release_outside_window(t, window=6, num_committed=18) == 1  # block 2 = [8, 12)
    assert m.release_outside_window(t, window=6, num_committed=21) == 0  # block 3 = [12, 16) still read
    assert m.cache_indices(t, 10, 14) == [-1, -1, t.blocks[3] * 4, t.blocks[3] * 4 + 1]
    assert m.num_free_blocks == 8 - 5 + 3
    m.free(t)
    assert m.num_free_blocks == 8


def test_a_released_published_block_stays_cached():
    m = BlockManager(8, 2)
    t = prefilled(m, [1, 2, 3, 4, 5])
    m.release_outside_window(t, window=1, num_committed=5)
    assert t.blocks[:2] == [-1, -1]
    assert m.allocate_prompt([1, 2, 3, 4, 9]).num_cached_tokens == 4


# ---- free and eviction ------------------------------------------------------------------------
def test_free_then_evict_unpublished_first_then_least_recently_freed():
    m = BlockManager(5, 2)
    a = prefilled(m, [1, 2, 3, 4, 5])                     # [1,2] [3,4] published, [5] private
    b = prefilled(m, [7, 8, 9])                           # [7,8] published, [9] private
    m.free(a)
    m.free(a)                                             # freeing an emptied table is a no-op
    assert m.num_free_blocks == 3 and m.match_prefix([1, 2, 3, 4, 5]) == 4
    # needs 2: the unpublished block, then the least recently freed published one; a freed its
    # tail first, so [3,4] goes and [1,2] stays
    c = m.allocate_prompt([0, 0, 0])
    assert m.match_prefix([1, 2, 3, 4, 5]) == 2 and m.match_prefix([7, 8, 9]) == 2
    with pytest.raises(NoFreeBlocks):                     # [1,2] is free; b's blocks are never evicted
        m.allocate_prompt([0] * 5)
    assert m.num_free_blocks == 1 and set(c.blocks).isdisjoint(b.blocks)


def test_a_hit_takes_its_block_off_the_free_list():
    m = BlockManager(4, 2)
    m.free(prefilled(m, [1, 2, 3]))
    assert m.num_free_blocks == 4
    t = m.allocate_prompt([1, 2, 3])
    assert t.num_cached_tokens == 2 and m.num_free_blocks == 2
    m.allocate_prompt([6, 6, 6, 6])                       # takes the last 2: the hit block is not among them
    assert m.num_free_blocks == 0 and m.cache_index(t, 0) // 2 == t.blocks[0]


# ---- the state machine ------------------------------------------------------------------------
class Req:
    def __init__(self, table, prompt):
        self.table = table
        self.view = list(prompt)   # what this request wrote at positions [0, table.num_tokens)
        self.c = len(prompt)       # committed tokens (K/V written and accepted)


TOKENS = st.integers(0, 1)
BASES = [[0, 1, 1, 0, 1, 0, 0, 1, 1, 1], [1] * 10, [0, 1] * 5]
PROMPTS = st.builds(lambda base, cut, tail: base[:cut] + tail, st.sampled_from(BASES),
                    st.integers(1, 10), st.lists(TOKENS, max_size=3))


class PublicPagedKVMachine(RuleBasedStateMachine):
    """Plays engine on a small pool through the public API, with a shadow KV: for every physical
    block, the tokens whose K/V was written there (through `cache_index`)."""

    @initialize(bs=st.sampled_from([1, 2, 4]), nb=st.integers(3, 24), cache=st.booleans())
    def setup(self, bs, nb, cache):
        self.m, self.bs, self.nb = BlockManager(nb, bs, cache), bs, nb
        self.reqs: list[Req] = []
        self.shadow = {}
        self.history = []

    def write(self, req, start, tokens):
        """store_kv: a write lands in a block no other live request holds."""
        others = held(r.table for r in self.reqs if r is not req)
        for p, tok in zip(range(start, start + len(tokens)), tokens):
            s = self.m.cache_index(req.table, p)
            assert s >= 0 and s // self.bs not in others
            self.shadow.setdefault(s // self.bs, [None] * self.bs)[p % self.bs] = tok
            req.view[p] = tok

    @rule(data=st.data())
    def add_follow_up(self, data):
        if self.history:
            seq = data.draw(st.sampled_from(self.history))
            self.add_request(seq[:data.draw(st.integers(1, len(seq)))] + data.draw(st.lists(TOKENS, max_size=2)))

    @rule(prompt=PROMPTS)
    def add_request(self, prompt):
        n, expected_hit, before = len(prompt), self.m.match_prefix(prompt), observable(self.m)
        try:
            t = self.m.allocate_prompt(prompt)
        except NoFreeBlocks:
            assert observable(self.m) == before
            assert self.m.num_free_blocks < self.m.blocks_for(n)   # refused only when it cannot fit
            event("prompt refused")
            return
        hit = t.num_cached_tokens
        event(f"prefix hit: {hit > 0}")
        assert hit == expected_hit and hit % self.bs == 0 and hit <= (n - 1) // self.bs * self.bs
        assert self.m.enable_prefix_cache or hit == 0
        assert len(t.blocks) == self.m.blocks_for(n) and t.num_tokens == n
        for i in range(hit // self.bs):                   # the hit blocks hold exactly the prefix
            assert self.shadow[t.blocks[i]] == prompt[i * self.bs:(i + 1) * self.bs]
        req = Req(t, prompt)
        self.write(req, hit, prompt[hit:])
        self.m.commit(t, prompt)
        if self.m.enable_prefix_cache:       # its full blocks are found again at once (nothing evicts them)
            assert self.m.match_prefix(prompt + [0]) == n // self.bs * self.bs
        self.reqs.append(req)
        self.history.append(list(prompt))

    @rule(data=st.data(), draft=st.lists(TOKENS, min_size=1, max_size=6))
    def speculate(self, data, draft):
        if not self.reqs:
            return
        req = data.draw(st.sampled_from(self.reqs))
        t, before = req.table, observable(self.m, [req.table])
        try:
            self.m.ensure_capacity(t, req.c + len(draft))
        except NoFreeBlocks:
            assert observable(self.m, [req.table]) == before
            event("window refused")
            return
        req.view += [None] * (t.num_tokens - len(req.view))
        self.write(req, req.c, draft)

    @rule(data=st.data())
    def verify(self, data):
        if not self.reqs:
            return
        req = data.draw(st.sampled_from(self.reqs))
        written = [tok is not None for tok in req.view[req.c:]] + [False]
        req.c += data.draw(st.integers(0, written.index(False)))
        used = self.m.num_used_blocks
        self.m.truncate(req.table, req.c)
        del req.view[req.c:]
        assert self.m.num_used_blocks <= used and req.table.num_tokens == req.c
        self.m.commit(req.table, req.view)
        self.history.append(list(req.view))

    @rule(data=st.data(), window=st.integers(1, 8))
    def release_window(self, data, window):
        if not self.reqs:
            return
        req = data.draw(st.sampled_from(self.reqs))
        old = list(req.table.blocks)
        n = self.m.release_outside_window(req.table, window, req.c)
        edge = max(req.c - window, 0) // self.bs
        assert req.table.blocks[:edge] == [-1] * min(edge, len(old)) and req.table.blocks[edge:] == old[edge:]
        assert n == sum(b != -1 for b in old[:edge])

    @rule(data=st.data())
    def finish(self, data):
        if self.reqs:
            req = data.draw(st.sampled_from(self.reqs))
            self.m.free(req.table)
            assert req.table.blocks == []
            self.reqs.remove(req)

    @invariant()
    def used_blocks_are_the_held_ones_and_nobody_lost_its_kv(self):
        if not hasattr(self, "m"):
            return
        assert self.m.num_used_blocks == len(held(r.table for r in self.reqs))
        assert self.m.num_free_blocks + self.m.num_used_blocks == self.nb
        for r in self.reqs:
            assert len(set(b for b in r.table.blocks if b != -1)) == sum(b != -1 for b in r.table.blocks)
            for p in range(len(r.view)):
                s = self.m.cache_index(r.table, p)
                if s != -1 and r.view[p] is not None:
                    assert self.shadow[s // self.bs][p % self.bs] == r.view[p]

    def teardown(self):
        if hasattr(self, "m"):
            for r in self.reqs:
                self.m.free(r.table)
            assert self.m.num_free_blocks == self.nb and self.m.num_used_blocks == 0


PublicPagedKVMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_paged_kv_public_state_machine = PublicPagedKVMachine.TestCase
