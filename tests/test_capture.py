"""forward_capture returns exactly what output_hidden_states would, at the cost of a plain forward."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from eagle3_platform.features.capture import forward_capture


def _ids(target, n=12, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, target.meta["vocab_size"], (b, n), generator=g)


@torch.no_grad()
def test_aux_and_last_hidden_equal_output_hidden_states(tiny_target):
    model, layers = tiny_target.model, tiny_target.layer_ids
    ids = _ids(tiny_target)
    ref = model(ids, output_hidden_states=True)
    out = forward_capture(model, ids, layers)
    H = model.config.hidden_size
    assert out.aux_hidden.shape == (2, 12, 3 * H) and out.last_hidden.shape == (2, 12, H)
    for k, i in enumerate(layers):
        # layer id i = output of decoder layer i = hidden_states[i + 1]
        torch.testing.assert_close(out.aux_hidden[..., k * H:(k + 1) * H], ref.hidden_states[i + 1],
                                   rtol=0, atol=0)
    post_norm = model.model(ids).last_hidden_state
    torch.testing.assert_close(out.last_hidden, post_norm, rtol=0, atol=0)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
    # the final state is post-norm: lm_head(last_hidden) is the logits
    torch.testing.assert_close(model.lm_head(out.last_hidden), ref.logits)


@torch.no_grad()
def test_no_logits_path_and_hooks_removed(tiny_target):
    model, layers = tiny_target.model, tiny_target.layer_ids
    ids = _ids(tiny_target, seed=1)
    hooks_before = sum(len(m._forward_hooks) for m in model.modules())
    a = forward_capture(model, ids, layers)
    b = forward_capture(model, ids, layers, compute_logits=False)
    assert b.logits is None
    torch.testing.assert_close(a.aux_hidden, b.aux_hidden, rtol=0, atol=0)
    torch.testing.assert_close(a.last_hidden, b.last_hidden, rtol=0, atol=0)
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks_before
    last = forward_capture(model, ids, layers, logits_to_keep=1)  # a prefill reads one row of logits
    assert last.logits.shape == (2, 1, model.config.vocab_size)
    torch.testing.assert_close(last.logits[:, 0], a.logits[:, -1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last.aux_hidden, a.aux_hidden, rtol=0, atol=0)


@torch.no_grad()
def test_padding_mask_gives_same_features_as_unpadded(tiny_target):
    model, layers = tiny_target.model, tiny_target.layer_ids
    long, short = _ids(tiny_target, n=10, b=1, seed=2), _ids(tiny_target, n=6, b=1, seed=3)
    batch = torch.zeros(2, 10, dtype=torch.long)
    mask = torch.zeros(2, 10, dtype=torch.long)
    batch[0], mask[0] = long[0], 1
    batch[1, :6], mask[1, :6] = short[0], 1  # right padding
    out = forward_capture(model, batch, layers, attention_mask=mask)
    solo = forward_capture(model, short, layers)
    torch.testing.assert_close(out.aux_hidden[1, :6], solo.aux_hidden[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.last_hidden[1, :6], solo.last_hidden[0], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_cache_and_4d_mask_continue_a_prefix(tiny_target):
    model, layers = tiny_target.model, tiny_target.layer_ids
    ids = _ids(tiny_target, n=9, b=1, seed=4)
    full = forward_capture(model, ids, layers)
    pre = forward_capture(model, ids[:, :6], layers, past_key_values=DynamicCache(), use_cache=True)
    n, past = 3, 6
    mask = torch.full((1, 1, n, past + n), float("-inf"))
    mask[..., :past] = 0
    mask[..., past:] = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
    step = forward_capture(model, ids[:, 6:], layers, attention_mask=mask,
                           position_ids=torch.arange(past, past + n)[None],
                           past_key_values=pre.past_key_values, use_cache=True)
    torch.testing.assert_close(step.aux_hidden[0], full.aux_hidden[0, 6:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step.logits[0], full.logits[0, 6:], atol=1e-5, rtol=1e-5)


def test_bad_layer_ids_rejected(tiny_target):
    with pytest.raises(ValueError, match="invalid"):
        forward_capture(tiny_target.model, _ids(tiny_target), [1, 99])
