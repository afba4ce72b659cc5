"""Tests of nanodspark/paged_kv.py from the inside: unit tests per method that also check its
internal state (reference counts, the hash cache, the free lists, `check_invariants`), then a
hypothesis state machine that drives a small pool like an engine would (prefill, speculative
windows, rollback, sliding-window release, free) and checks it against a model computed from the
live tables and a shadow KV. What any implementation must do, through public names only, is in
tests/test_paged_kv_contract.py (the course grades with it); a case that needs nothing internal
lives there, not here."""
import pytest
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from nanodspark.paged_kv import BlockManager, BlockTable, NoFreeBlocks


def snapshot(m: BlockManager):
    return (list(m.ref_count), list(m.free_plain), list(m.free_cached), dict(m.cache),
            list(m.block_hash))


def prefilled(m: BlockManager, prompt):
    """allocate + commit, as the engine does once the prompt's K/V is written."""
    t = m.allocate_prompt(prompt)
    m.commit(t, prompt)
    return t


# ---- pool basics ------------------------------------------------------------------------------
def test_pool_counts_and_blocks_for():
    m = BlockManager(8, 4)
    assert (m.num_free_blocks, m.num_used_blocks) == (8, 0)
    assert [m.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert m.can_allocate(8) and not m.can_allocate(9)
    t = m.allocate_prompt(list(range(9)))
    assert len(t.blocks) == 3 == len(set(t.blocks)) and t.num_tokens == 9
    assert t.num_cached_tokens == 0 and m.num_used_blocks == 3
    m.check_invariants([t])


def test_cache_indices():
    m = BlockManager(8, 4)
    m.allocate_prompt([9])  # take a block so the next table does not start at block 0
    t = m.allocate_prompt(list(range(6)))
    b0, b1 = t.blocks
    assert m.cache_index(t, 0) == b0 * 4 and m.cache_index(t, 5) == b1 * 4 + 1
    assert m.cache_indices(t, 2, 6) == [b0 * 4 + 2, b0 * 4 + 3, b1 * 4, b1 * 4 + 1]
    with pytest.raises(AssertionError):
        m.cache_index(t, 6)  # no reserved cache entry


# ---- prefix cache -----------------------------------------------------------------------------
def test_prefix_hit_shares_full_blocks():
    m = BlockManager(16, 4)
    a = prefilled(m, list(range(10)))  # blocks 0..1 full -> published, block 2 partial
    assert a.num_hashed_blocks == 2 and len(m.cache) == 2
    b = m.allocate_prompt(list(range(8)) + [50, 51, 52])
    assert b.num_cached_tokens == 8 and b.blocks[:2] == a.blocks[:2]
    assert b.blocks[2] != a.blocks[2] and b.num_hashed_blocks == 2
    assert [m.ref_count[x] for x in b.blocks] == [2, 2, 1]
    m.check_invariants([a, b])


def test_hit_never_covers_whole_prompt():
    m = BlockManager(16, 4)
    a = prefilled(m, list(range(8)))
    assert m.allocate_prompt(list(range(8))).num_cached_tokens == 4   # last token computed
    assert m.allocate_prompt(list(range(9))).num_cached_tokens == 8
    assert m.allocate_prompt(list(range(4))).num_cached_tokens == 0
    assert m.match_prefix(list(range(8))) == 4 and m.match_prefix(list(range(9))) == 8
    assert m.allocate_prompt(list(range(9)), max_cached_tokens=4).num_cached_tokens == 4
    assert a.num_tokens == 8


def test_prefix_cache_disabled():
    m = BlockManager(16, 4, enable_prefix_cache=False)
    prefilled(m, list(range(9)))
    t = m.allocate_prompt(list(range(9)))
    assert t.num_cached_tokens == 0 and not m.cache and t.num_hashed_blocks == 0
    m.truncate(t, 0)  # nothing published, so rolling back to 0 is legal


def test_commit_publishes_only_full_committed_blocks():
    m = BlockManager(16, 4)
    t = m.allocate_prompt([1, 2, 3])
    m.ensure_capacity(t, 10)
    m.commit(t, [1, 2, 3, 4, 5, 6, 7])
    assert t.num_hashed_blocks == 1 and len(m.cache) == 1
    m.commit(t, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert t.num_hashed_blocks == 2 and len(m.cache) == 2
    assert m.allocate_prompt([1, 2, 3, 4, 5, 6, 7, 8, 0]).num_cached_tokens == 8
    with pytest.raises(AssertionError):
        m.commit(t, list(range(11)))  # more tokens than reserved entries


def test_commit_from_an_offset_equals_commit_of_the_whole_list():
    """The engine passes only the tokens from `published_tokens` on; the result is the same."""
    ids = list(range(1, 23))
    whole, tail = BlockManager(16, 4), BlockManager(16, 4)
    a, b = whole.allocate_prompt(ids[:3]), tail.allocate_prompt(ids[:3])
    for m, t in ((whole, a), (tail, b)):
        m.ensure_capacity(t, len(ids))
    for n in (3, 7, 9, 16, 22):                      # committed tokens after successive steps
        whole.commit(a, ids[:n])
        start = tail.published_tokens(b)
        tail.commit(b, ids[start:n], start)
        assert (b.num_hashed_blocks, b.last_hash) == (a.num_hashed_blocks, a.last_hash) == (n // 4, b.last_hash)
    assert set(tail.cache) == set(whole.cache) and len(tail.cache) == 5
    c = tail.allocate_prompt([9, 9, 9])
    tail.ensure_capacity(c, 12)
    with pytest.raises(AssertionError, match="first unpublished block"):   # skipping block 0
        tail.commit(c, ids[4:8], 4)


def test_duplicate_content_keeps_first_publisher():
    m = BlockManager(16, 4)
    a = m.allocate_prompt([1, 2, 3, 4, 5])
    b = m.allocate_prompt([1, 2, 3, 4, 5])  # nothing cached yet: computes its own copy
    m.commit(a, [1, 2, 3, 4, 5])
    m.commit(b, [1, 2, 3, 4, 5])
    assert m.cache[m.block_hash[a.blocks[0]]] == a.blocks[0]
    assert m.block_hash[b.blocks[0]] is None and b.num_hashed_blocks == 1
    m.free(b)
    assert b.blocks == [] and m.num_free_blocks == 14
    m.check_invariants([a])


# ---- atomic failures ---------------------------------------------------------------------------
def test_allocate_prompt_atomic_failure():
    m = BlockManager(4, 4)
    t = m.allocate_prompt(list(range(12)))
    before = snapshot(m)
    with pytest.raises(NoFreeBlocks):
        m.allocate_prompt(list(range(100, 108)))
    assert snapshot(m) == before
    m.check_invariants([t])


def test_allocate_prompt_counts_free_hit_blocks_as_taken():
    m = BlockManager(3, 4)
    m.free(prefilled(m, list(range(9))))  # 2 published free blocks + 1 plain free block
    before = snapshot(m)
    # Hits 2 blocks (both free, so they are not "extra" free space) and needs 2 more: only 1.
    with pytest.raises(NoFreeBlocks):
        m.allocate_prompt(list(range(8)) + [20, 21, 22, 23, 24])
    assert snapshot(m) == before
    t = m.allocate_prompt(list(range(8)) + [20])  # needs 1 more: fits
    assert t.num_cached_tokens == 8 and m.num_free_blocks == 0
    m.check_invariants([t])


def test_ensure_capacity_grows_and_fails_atomically():
    m = BlockManager(4, 4)
    t = m.allocate_prompt([1, 2, 3])
    m.ensure_capacity(t, 9)
    assert len(t.blocks) == 3 and t.num_tokens == 9
    m.ensure_capacity(t, 5)  # already there: no-op, never shrinks
    assert t.num_tokens == 9
    before, blocks = snapshot(m), list(t.blocks)
    with pytest.raises(NoFreeBlocks):
        m.ensure_capacity(t, 17)
    assert snapshot(m) == before and t.blocks == blocks and t.num_tokens == 9
    m.check_invariants([t])


# ---- rollback ---------------------------------------------------------------------------------
def test_truncate_frees_rejected_blocks():
    m = BlockManager(8, 4)
    t = prefilled(m, [1, 2, 3, 4, 5])
    m.ensure_capacity(t, 13)  # a speculative window of 8 tokens
    assert m.num_free_blocks == 4
    m.truncate(t, 6)  # 1 of 8 accepted
    assert len(t.blocks) == 2 and t.num_tokens == 6 and m.num_free_blocks == 6
    m.check_invariants([t])
    with pytest.raises(AssertionError):
        m.truncate(t, 3)  # below the published block 0
    with pytest.raises(AssertionError):
        m.truncate(t, 7)  # truncate cannot grow
    m.truncate(t, 4)
    assert len(t.blocks) == 1
    m.check_invariants([t])


# ---- sliding window ---------------------------------------------------------------------------
def test_release_outside_window():
    m = BlockManager(8, 4)
    t = m.allocate_prompt(list(range(20)))
    # Keep positions >= 17 - 6 = 11: blocks 0 ([0,4)) and 1 ([4,8)) are wholly before it.
    assert m.release_outside_window(t, window=6, num_committed=17) == 2
    assert t.blocks[:2] == [-1, -1] and -1 not in t.blocks[2:]
    assert m.release_outside_window(t, window=6, num_committed=17) == 0  # idempotent
    assert m.release_outside_window(t, window=6, num_committed=18) == 1  # block 2 = [8, 12)
    assert m.release_outside_window(t, window=6, num_committed=21) == 0  # block 3 = [12, 16)
    assert m.cache_indices(t, 10, 14) == [-1, -1, t.blocks[3] * 4, t.blocks[3] * 4 + 1]
    assert m.num_free_blocks == 8 - 5 + 3
    m.check_invariants([t])
    m.free(t)
    assert m.num_free_blocks == 8
    m.check_invariants([])


# ---- free and eviction ------------------------------------------------------------------------
def test_free_and_lru_eviction():
    m = BlockManager(5, 2)
    a = prefilled(m, [1, 2, 3, 4, 5])          # blocks: [1,2] [3,4] published, [5] private
    b = prefilled(m, [7, 8, 9])                # [7,8] published, [9] in block 3
    m.free(a)
    m.free(a)                                  # freeing an emptied table is a no-op
    assert m.num_free_blocks == 3 and len(m.free_plain) == 1 and len(m.cache) == 3
    # The plain block goes first, then published ones, least recently freed first; a frees
    # its tail first, so [3,4] is evicted before [1,2].
    c = m.allocate_prompt([0, 0, 0])           # needs 2: plain block + evict [3,4]
    assert m.match_prefix([1, 2, 3, 4, 5]) == 2
    assert m.ref_count[b.blocks[0]] == 1 and m.block_hash[b.blocks[0]] is not None
    with pytest.raises(NoFreeBlocks):          # [1,2] is free; b's blocks are never evicted
        m.allocate_prompt([0] * 5)
    m.check_invariants([b, c])


def test_hit_takes_block_off_free_list():
    m = BlockManager(4, 2)
    m.free(prefilled(m, [1, 2, 3]))
    assert m.num_free_blocks == 4 and len(m.free_cached) == 1
    t = m.allocate_prompt([1, 2, 3])
    assert t.num_cached_tokens == 2 and m.num_free_blocks == 2 and not m.free_cached
    m.check_invariants([t])


def test_check_invariants_catches_wrong_tables():
    m = BlockManager(4, 2)
    t = m.allocate_prompt([1, 2, 3])
    with pytest.raises(AssertionError):
        m.check_invariants([])       # a live table is missing: ref counts disagree
    with pytest.raises(AssertionError):
        m.check_invariants([t, BlockTable([t.blocks[0]], num_tokens=1)])


# ---- the state machine ------------------------------------------------------------------------
class Req:
    def __init__(self, table, prompt):
        self.table = table
        self.view = list(prompt)  # what this request wrote at positions [0, table.num_tokens)
        self.c = len(prompt)      # committed tokens (K/V written and accepted)


TOKENS = st.integers(0, 1)  # a tiny vocabulary
# Prompts: a cut of one of a few shared "system prompts" plus a random tail, so hits are common.
BASES = [[0, 1, 1, 0, 1, 0, 0, 1, 1, 1], [1] * 10, [0, 1] * 5]
PROMPTS = st.builds(lambda base, cut, tail: base[:cut] + tail, st.sampled_from(BASES),
                    st.integers(1, 10), st.lists(TOKENS, max_size=3))


class PagedKVMachine(RuleBasedStateMachine):
    @initialize(bs=st.sampled_from([1, 2, 4]), nb=st.integers(3, 24), cache=st.booleans())
    def setup(self, bs, nb, cache):
        self.m, self.bs, self.nb = BlockManager(nb, bs, cache), bs, nb
        self.reqs: list[Req] = []
        self.shadow = {}  # physical block -> list of the tokens whose K/V it holds
        self.history = []  # committed token lists seen so far: follow-up prompts extend them

    def write(self, req, start, tokens):
        """The engine's store_kv: only into blocks this request owns alone and never published."""
        for p, tok in zip(range(start, start + len(tokens)), tokens):
            s = self.m.cache_index(req.table, p)
            b = s // self.bs
            assert s >= 0 and self.m.ref_count[b] == 1 and self.m.block_hash[b] is None
            self.shadow.setdefault(b, [None] * self.bs)[p % self.bs] = tok
            req.view[p] = tok

    @rule(data=st.data())
    def add_follow_up(self, data):
        """A prompt that repeats (part of) an earlier conversation, outputs included."""
        if self.history:
            seq = data.draw(st.sampled_from(self.history))
            cut = data.draw(st.integers(1, len(seq)))
            self.add_request(seq[:cut] + data.draw(st.lists(TOKENS, max_size=2)))

    @rule(prompt=PROMPTS)
    def add_request(self, prompt):
        n, expected_hit, before = len(prompt), self.m.match_prefix(prompt), snapshot(self.m)
        try:
            t = self.m.allocate_prompt(prompt)
        except NoFreeBlocks:
            assert snapshot(self.m) == before
            assert self.m.num_free_blocks < self.m.blocks_for(n)  # refused only when no fit
            event("prompt refused: no free blocks")
            return
        hit = t.num_cached_tokens
        event(f"prefix hit: {hit > 0}")
        if len(self.m.cache) < len(before[3]):
            event("published block evicted")
        assert hit == expected_hit and hit % self.bs == 0 and hit <= (n - 1) // self.bs * self.bs
        assert self.m.enable_prefix_cache or hit == 0
        for i in range(hit // self.bs):  # the hit blocks hold exactly the requested prefix
            assert self.shadow[t.blocks[i]] == prompt[i * self.bs:(i + 1) * self.bs]
        req = Req(t, prompt)
        self.write(req, hit, prompt[hit:])  # prefill of the uncached part
        self.m.commit(t, prompt)
        self.reqs.append(req)
        self.history.append(list(prompt))

    @rule(data=st.data(), draft=st.lists(TOKENS, min_size=1, max_size=6))
    def decode_step(self, data, draft):
        """One whole speculative step of one request: reserve + write a window, verify."""
        if self.reqs:
            req = data.draw(st.sampled_from(self.reqs))
            self.speculate(data, draft, req)
            self.verify(data, req)

    @rule(data=st.data(), draft=st.lists(TOKENS, min_size=1, max_size=6))
    def speculate(self, data, draft, req=None):
        """Reserve and write a speculative window right after the committed tokens."""
        if not self.reqs:
            return
        req = req or data.draw(st.sampled_from(self.reqs))
        t, before, blocks = req.table, snapshot(self.m), list(req.table.blocks)
        try:
            self.m.ensure_capacity(t, req.c + len(draft))
        except NoFreeBlocks:
            assert snapshot(self.m) == before and t.blocks == blocks
            event("window refused: no free blocks")
            return
        req.view += [None] * (t.num_tokens - len(req.view))
        self.write(req, req.c, draft)

    @rule(data=st.data())
    def verify(self, data, req=None):
        """Accept some of the written speculative tokens, roll back the rest, commit."""
        if not self.reqs:
            return
        req = req or data.draw(st.sampled_from(self.reqs))
        written = [tok is not None for tok in req.view[req.c:]] + [False]
        accepted = data.draw(st.integers(0, written.index(False)))  # a written run of drafts
        req.c += accepted
        used = self.m.num_used_blocks
        self.m.truncate(req.table, req.c)
        del req.view[req.c:]
        assert self.m.num_used_blocks <= used
        event(f"rollback freed blocks: {self.m.num_used_blocks < used}")
        self.m.commit(req.table, req.view)
        self.history.append(list(req.view))

    @rule(data=st.data(), window=st.integers(1, 8))
    def release_window(self, data, window):
        if not self.reqs:
            return
        req = data.draw(st.sampled_from(self.reqs))
        old = list(req.table.blocks)
        n = self.m.release_outside_window(req.table, window, req.c)
        edge = max(req.c - window, 0) // self.bs  # blocks [0, edge) are wholly outside
        assert req.table.blocks[:edge] == [-1] * min(edge, len(old))
        assert req.table.blocks[edge:] == old[edge:]
        assert n == sum(b != -1 for b in old[:edge])
        event(f"window released blocks: {n > 0}")

    @rule(data=st.data())
    def finish(self, data):
        if not self.reqs:
            return
        req = data.draw(st.sampled_from(self.reqs))
        self.m.free(req.table)
        self.reqs.remove(req)

    @invariant()
    def bookkeeping_is_exact(self):
        if not hasattr(self, "m"):
            return
        tables = [r.table for r in self.reqs]
        self.m.check_invariants(tables)
        model = [0] * self.nb  # the ref counts, recomputed from the live tables
        for t in tables:
            for b in t.blocks:
                if b != -1:
                    model[b] += 1
        assert self.m.ref_count == model
        assert self.m.num_free_blocks == model.count(0)
        for b, h in enumerate(self.m.block_hash):  # a published block holds its tokens
            if h is not None:
                assert self.shadow[b] == list(self.m.block_key[b][1])
        for r in self.reqs:  # nobody overwrote a live request's K/V (committed or speculative)
            for p in range(len(r.view)):
                s = self.m.cache_index(r.table, p)
                if s != -1 and r.view[p] is not None:
                    assert self.shadow[s // self.bs][p % self.bs] == r.view[p]

    def teardown(self):
        if not hasattr(self, "m"):
            return
        for r in self.reqs:
            self.m.free(r.table)
        self.m.check_invariants([])
        assert self.m.num_free_blocks == self.nb and self.m.num_used_blocks == 0


PagedKVMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_paged_kv_state_machine = PagedKVMachine.TestCase
