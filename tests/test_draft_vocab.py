"""Draft vocabulary: top-Vd response tokens, ties by id, padding, d2t/t2d invariants, shard counting."""
from __future__ import annotations

import pytest
import torch

from eagle3_platform.draft.vocab import (build_vocab, check_vocab, count_response_tokens, load_vocab,
                                         save_vocab)


def test_top_tokens_ties_by_id_and_offsets():
    counts = torch.zeros(20, dtype=torch.int64)
    counts[[7, 3, 15, 9]] = torch.tensor([5, 5, 9, 1])
    d2t, t2d, stats = build_vocab(counts, 20, 3)
    target_ids = (d2t + torch.arange(3)).tolist()
    assert target_ids == [3, 7, 15]              # 15 (9), then the tie 3 vs 7 (5 each); 9 (1) dropped
    assert d2t.tolist() == [3, 6, 13] and d2t.dtype == torch.int64
    assert t2d.nonzero().flatten().tolist() == [3, 7, 15] and t2d.dtype == torch.bool
    assert stats["coverage"] == pytest.approx(19 / 20) and stats["padded_ids"] == 0


def test_pads_with_unused_ids_when_few_tokens():
    d2t, t2d, stats = build_vocab({5: 2, 2: 1}, 10, 5)
    assert (d2t + torch.arange(5)).tolist() == [0, 1, 2, 3, 5]
    assert stats["padded_ids"] == 3 and stats["distinct_response_tokens"] == 2
    check_vocab(d2t, t2d)


def test_check_vocab_rejects_inconsistent():
    d2t, t2d, _ = build_vocab({1: 3, 4: 2}, 8, 2)
    bad = t2d.clone()
    bad[6] = True
    with pytest.raises(ValueError):
        check_vocab(d2t, bad)
    with pytest.raises(ValueError):
        build_vocab({1: 1}, 8, 9)


def test_count_from_shards_and_roundtrip(tmp_path):
    from eagle3_platform.testing.synthetic import random_features

    meta = {"target_id": "t", "weights_hash": "h", "capture_layer_ids": [1, 2, 3]}
    d = random_features(tmp_path / "f", meta, vocab_size=50, hidden_size=8, n_samples=5, seq_len=20)
    counts = count_response_tokens([d], 50)
    from eagle3_platform.features.shards import ShardDataset

    ds = ShardDataset([d])
    want = torch.zeros(50, dtype=torch.int64)
    for i in range(len(ds)):
        s = ds[i]
        want += torch.bincount(s["input_ids"][s["loss_mask"].bool()], minlength=50)
    assert torch.equal(counts, want) and counts.sum() > 0
    d2t, t2d, stats = build_vocab(counts, 50, 16)
    save_vocab(tmp_path / "v.safetensors", d2t, t2d, stats)
    d2, t2, s2 = load_vocab(tmp_path / "v.safetensors")
    assert torch.equal(d2, d2t) and torch.equal(t2, t2d) and s2 == stats
