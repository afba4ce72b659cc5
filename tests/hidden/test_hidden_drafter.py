"""Hidden tests of the `drafter` unit (run by `course grade`, never exported): the Markov and
confidence heads against their formulas on the weights, a batch of blocks against one block at a
time, and the training mask's pattern."""
import pytest
import torch

from nanodspark.drafter_training import training_attention

from conftest import make_hf_model, random_drafter
from nanodspark.loader import load_model


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d, _ = make_hf_model("qwen3", tmp_path_factory.mktemp("t_hidden"), window=0, num_hidden_layers=4, seed=2)
    return load_model(d)


def make(target, **kw):
    d = random_drafter(target, gamma=3, num_layers=1, std=0.2, mask_token_id=5, seed=3, **kw)
    with torch.no_grad():
        if d.config.markov_rank:
            d.markov_w2.weight.normal_(0, 0.5)
    return d


def test_heads_are_their_formulas_on_the_weights(target):
    d = make(target)
    H, V = d.config.hidden_size, d.config.vocab_size
    prev = torch.tensor([3, 17, 200, 3])
    h = torch.randn(4, H)
    with torch.no_grad():
        w1, w2 = d.markov_w1.weight[prev], d.markov_w2.weight                  # [4, r], [V, r]
        torch.testing.assert_close(d.markov_bias(prev), (w1 @ w2.t()).float(), atol=1e-5, rtol=1e-4)
        head = d.confidence_head
        want = h @ head.weight[0, :H] + w1 @ head.weight[0, H:] + head.bias[0]
        torch.testing.assert_close(d.confidence_logit(h, prev), want, atol=1e-5, rtol=1e-4)
    plain = random_drafter(target, gamma=3, num_layers=1, std=0.2, markov_rank=0, confidence=False)
    assert plain.markov_bias(prev) == 0.0
    assert torch.equal(plain.confidence_logit(h, prev), torch.zeros(4))


def test_a_batch_of_blocks_equals_each_block_alone(target):
    d = make(target)
    bs, g = 4, d.config.gamma
    cache = torch.randn(d.config.num_layers, 2, 12, bs, d.config.num_key_value_heads, d.config.head_dim)
    tables = torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]], dtype=torch.int32)
    anchors, pos = torch.tensor([11, 40]), torch.tensor([9, 14])
    with torch.no_grad():
        both = d.propose(anchors, pos, cache.clone(), tables, bs, None)
        for r in range(2):
            one = d.propose(anchors[r:r + 1], pos[r:r + 1], cache.clone(), tables[r:r + 1], bs, None)
            assert one.tokens[0].tolist() == both.tokens[r].tolist()
            torch.testing.assert_close(one.conf_logits[0], both.conf_logits[r], atol=1e-5, rtol=1e-4)
    assert both.tokens.shape == (2, g)


def test_the_training_mask_lets_a_block_see_its_context_and_itself_only():
    B, A, S, g = 2, 3, 10, 2
    anchors = torch.tensor([[2, 5, 9], [1, 4, 7]])
    # equal scores (zero queries), one-hot values reveal which keys each query read: context key j -> e_j, block key m -> e_(S+m)
    N = B * A * g
    q = torch.zeros(N, 1, S + A * g)
    eye = torch.eye(S + A * g)
    kv_ctx = [eye[:S][None, :, None, :].expand(B, S, 1, S + A * g).contiguous()]
    attend = training_attention(kv_ctx, kv_ctx, anchors, g)
    k = torch.zeros(N, 1, S + A * g)
    v = eye[S:][None].expand(B, A * g, S + A * g).reshape(N, 1, S + A * g)
    out = attend.fn(0, q, k, v, 1.0).view(B, A * g, S + A * g) > 0
    for b in range(B):
        for a in range(A):
            for s in range(g):
                row = out[b, a * g + s]
                assert row[:S].tolist() == [j < anchors[b, a] for j in range(S)]
                assert row[S:].tolist() == [m // g == a for m in range(A * g)]
