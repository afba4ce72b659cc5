"""The CPU engine's attention (`kernels.reference.paged_attention_batched`: every request of a
ragged batch at once, padded and masked) computes what the per-request reference computes."""
import pytest
import torch

from kernels.reference import paged_attention_batched, paged_attention_ref

from test_kernels import make_batch, random_case


def both(b, **kw):
    args = (b["q"], b["k_cache"], b["v_cache"], b["block_tables"], b["cu_seqlens_q"], b["kv_lens"])
    want = paged_attention_ref(*args, kv_start=b["kv_start"], **kw)
    got = paged_attention_batched(*args, kv_start=b["kv_start"], **kw)
    return got, want


@pytest.mark.parametrize("seed", range(12))
def test_batched_equals_the_reference(seed):
    case = random_case(seed)
    window = case.pop("window")
    b = make_batch(**case, window=window, dtype=torch.float32, device="cpu", seed=seed)
    got, want = both(b, scale=case["d"] ** -0.5, sliding_window=window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_batched_non_causal_rows_without_keys_and_a_long_batch():
    """The drafter's bidirectional block pass; a request that may read nothing; many requests."""
    b = make_batch(q_lens=[4, 4, 1], kv_lens=[9, 4, 30], hq=4, hkv=2, d=16, page=8, window=0,
                   kv_start=[0, 4, 2], dtype=torch.float32, device="cpu", seed=3)
    for causal in (True, False):
        got, want = both(b, scale=0.25, causal=causal)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    b = make_batch(q_lens=[1, 5] * 40, kv_lens=[7, 40] * 40, hq=2, hkv=1, d=16, page=4, window=6,
                   dtype=torch.float32, device="cpu", seed=4)
    got, want = both(b, scale=0.25, sliding_window=6)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
