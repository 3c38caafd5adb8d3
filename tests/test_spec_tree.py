"""Tree masks, per-node positions and KV bookkeeping on hand-made trees (tiny target)."""
from __future__ import annotations

import pytest
import torch

from eagle3_platform.spec.tree import (Tree, ancestor_matrix, depths, keep_path_in_cache, path_to,
                                       tree_attention_mask, tree_positions)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
#   |
#   6
PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
TOKENS = torch.tensor([11, 21, 22, 31, 32, 33, 41])


def test_depths_positions_paths():
    assert depths(PARENTS).tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree_positions(PARENTS, 10).tolist() == [[10, 11, 11, 12, 12, 12, 13]]
    assert path_to(PARENTS, 6) == [0, 1, 3, 6]
    assert path_to(PARENTS, 5) == [0, 2, 5]
    assert Tree(TOKENS, PARENTS).children() == [[1, 2], [3, 4], [5], [6], [], [], []]


def test_exact_tree_mask():
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(ancestor_matrix(PARENTS), expected)
    mask = tree_attention_mask(PARENTS, past_len=3)
    assert mask.shape == (1, 1, 7, 10)
    assert (mask[0, 0, :, :3] == 0).all()  # the committed prefix is visible to every node
    neg = torch.finfo(torch.float32).min
    assert torch.equal(mask[0, 0, :, 3:], torch.where(expected, 0.0, neg))


def test_rejects_unordered_parents():
    with pytest.raises(ValueError):
        Tree(torch.tensor([1, 2, 3]), torch.tensor([-1, 2, 0]))


def _prefix(tiny_target, n=9):
    return torch.arange(5, 5 + n)[None]  # [1,n] arbitrary token ids


@torch.no_grad()
def _verify_forward(model, prefix, tokens, parents):
    out = model(input_ids=prefix, use_cache=True)
    cache, n = out.past_key_values, prefix.shape[1]
    tree_out = model(input_ids=tokens[None], attention_mask=tree_attention_mask(parents, n),
                     position_ids=tree_positions(parents, n), past_key_values=cache, use_cache=True)
    return tree_out.logits[0], cache, n


@torch.no_grad()
def test_tree_logits_equal_sequential_paths(tiny_target):
    model, prefix = tiny_target.model, _prefix(tiny_target)
    logits, _, _ = _verify_forward(model, prefix, TOKENS, PARENTS)
    for node in range(len(TOKENS)):
        seq = torch.cat([prefix, TOKENS[path_to(PARENTS, node)][None]], dim=1)
        ref = model(input_ids=seq).logits[0, -1]
        torch.testing.assert_close(logits[node], ref, atol=1e-4, rtol=1e-4)


@torch.no_grad()
@pytest.mark.parametrize("path", [[0], [0, 2, 5], [0, 1, 3, 6], [0, 1, 4]])
def test_kept_path_cache_equals_sequential_cache(tiny_target, path):
    model, prefix = tiny_target.model, _prefix(tiny_target)
    _, cache, n = _verify_forward(model, prefix, TOKENS, PARENTS)
    keep_path_in_cache(cache, n, path)
    seq = torch.cat([prefix, TOKENS[path][None]], dim=1)
    ref = model(input_ids=seq, use_cache=True).past_key_values
    assert cache.get_seq_length() == n + len(path)
    for got, want in zip(cache.layers, ref.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-4)
    # and decoding continues correctly from the pruned cache
    nxt = torch.tensor([[7]])
    got = model(input_ids=nxt, position_ids=torch.tensor([[n + len(path)]]), past_key_values=cache).logits
    want = model(input_ids=torch.cat([seq, nxt], dim=1)).logits[:, -1:]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
