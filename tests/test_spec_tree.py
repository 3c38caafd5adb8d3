"""Tree masks, per-node positions and KV bookkeeping on hand-made trees (tiny target)."""
from __future__ import annotations

import pytest
import torch

from eagle3_platform.model.kv_cache import GrowingCache
from eagle3_platform.model.ragged import RaggedCache
from eagle3_platform.spec.tree import Tree, ancestor_matrix, depths, path_to


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
    cache = RaggedCache()
    cache.lengths = torch.tensor([3, 5])  # two rows: 3 and 5 committed tokens
    assert cache.begin(7) == 12
    mask = cache.mask(torch.stack([expected, torch.eye(7, dtype=torch.bool)]))
    assert mask.shape == (2, 1, 7, 12)
    assert mask[0, 0, :, :3].all() and mask[1, 0, :, :5].all()  # each row's committed prefix
    assert torch.equal(mask[0, 0, :, 3:10], expected) and not mask[0, 0, :, 10:].any()
    assert torch.equal(mask[1, 0, :, 5:], torch.eye(7, dtype=torch.bool))


def test_rejects_unordered_parents():
    with pytest.raises(ValueError):
        Tree(torch.tensor([1, 2, 3]), torch.tensor([-1, 2, 0]))


def _prefix(tiny_target, n=9):
    return torch.arange(5, 5 + n)[None]  # [1,n] arbitrary token ids


@torch.no_grad()
def _verify_forward(model, prefix, tokens, parents):
    """The prefix into a one-row RaggedCache, then one forward over the tree (mask + positions)."""
    n, prompt = prefix.shape[1], GrowingCache()
    model(input_ids=prefix, past_key_values=prompt, use_cache=True)
    cache = RaggedCache()
    cache.add_row(prompt, n)
    cache.begin(len(tokens))
    tree_out = model(input_ids=tokens[None], attention_mask=cache.mask(ancestor_matrix(parents)[None]),
                     position_ids=n + depths(parents)[None], past_key_values=cache, use_cache=True)
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
    cache.keep(0, path)
    seq = torch.cat([prefix, TOKENS[path][None]], dim=1)
    ref = model(input_ids=seq, use_cache=True).past_key_values
    assert cache.get_seq_length() == n + len(path)
    for keys, values, want in zip(cache.keys, cache.values, ref.layers):
        torch.testing.assert_close(keys[:1, :, :n + len(path)], want.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(values[:1, :, :n + len(path)], want.values, atol=1e-5, rtol=1e-4)
    # and decoding continues correctly from the pruned cache
    nxt = torch.tensor([[7]])
    cache.begin(1)
    got = model(input_ids=nxt, position_ids=torch.tensor([[n + len(path)]]), past_key_values=cache).logits
    want = model(input_ids=torch.cat([seq, nxt], dim=1)).logits[:, -1:]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
