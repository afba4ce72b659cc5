"""Hidden tests of the `paged-kv` unit (run by `course grade`, never exported): prefix hits on
prompts that share prefixes, against a plain model of the cache (no eviction: the pool is large),
and cache indices against the table."""
import random

from nanodspark.paged_kv import BlockManager


def test_prefix_hits_against_a_model_of_the_cache():
    rng = random.Random(14)
    for bs in (1, 2, 4, 8):
        m = BlockManager(4096, bs)
        published: set[tuple[int, ...]] = set()         # every full-block prefix committed so far
        stems = [[rng.randint(0, 3) for _ in range(rng.randint(0, 20))] for _ in range(6)]
        tables = []
        for _ in range(60):
            prompt = rng.choice(stems) + [rng.randint(0, 3) for _ in range(rng.randint(1, 12))]
            cap = (len(prompt) - 1) // bs * bs
            want = 0
            while want + bs <= cap and tuple(prompt[:want + bs]) in published:
                want += bs
            assert m.match_prefix(prompt) == want
            t = m.allocate_prompt(prompt)
            assert t.num_cached_tokens == want and t.num_tokens == len(prompt)
            assert len({b for b in t.blocks}) == len(t.blocks) == -(-len(prompt) // bs)
            m.commit(t, prompt)
            published |= {tuple(prompt[:k]) for k in range(bs, len(prompt) + 1, bs)}
            tables.append(t)
            if rng.random() < 0.3:                      # a finished request: its blocks stay cached
                m.free(tables.pop(rng.randrange(len(tables))))
        for t in tables:
            assert [m.cache_index(t, p) for p in range(t.num_tokens)] == [t.blocks[p // bs] * bs + p % bs
                                                                   for p in range(t.num_tokens)]


def test_shared_blocks_are_held_once_and_freed_when_the_last_holder_goes():
    m = BlockManager(32, 4)
    prompt = list(range(13))
    a = m.allocate_prompt(prompt)
    m.commit(a, prompt)
    used = m.num_used_blocks
    others = [m.allocate_prompt(prompt[:12] + [99 + i]) for i in range(3)]
    assert all(t.blocks[:3] == a.blocks[:3] and t.num_cached_tokens == 12 for t in others)
    assert m.num_used_blocks == used + 3                 # one private block each
    for t in [a] + others:
        m.free(t)
    assert m.num_used_blocks == 0 and m.num_free_blocks == 32
    assert m.match_prefix(prompt) == 12                  # freed, still cached
