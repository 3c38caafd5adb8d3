"""End to end on the real SmolLM2 target: features → train (a few steps) → SGLang export → reload."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from eagle3_platform.draft.export import load_export
from eagle3_platform.testing.synthetic import target_features
from eagle3_platform.draft.train import PRESETS, load_draft_dir, train


@pytest.mark.e2e
def test_smollm2_train_export_roundtrip(smollm2_dir, tmp_path):
    from eagle3_platform.draft.export import export_draft

    feats = target_features(smollm2_dir, tmp_path / "f", n_samples=4, min_len=24, max_len=48)
    cfg = replace(PRESETS["tiny"], max_steps=2, draft_vocab_size=256)
    s = train(smollm2_dir, [feats], tmp_path / "d", cfg, eval_dirs=[feats])
    assert s["steps"] == 2 and len(s["eval"]["acc"]) == cfg.ttt_steps
    out = export_draft(tmp_path / "d", tmp_path / "x", dtype="float32")
    c = json.loads((tmp_path / "x" / "config.json").read_text())
    assert (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (576, 9, 3, 64)
    assert c["vocab_size"] == 49152 and c["rope_theta"] == 100000.0
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert out["tensors"] == 15
    a, b = load_export(tmp_path / "x", smollm2_dir), load_draft_dir(tmp_path / "d", smollm2_dir)
    ids, aux = torch.randint(0, 49152, (1, 5)), torch.randn(1, 5, 3 * 576)
    with torch.no_grad():
        la = a.logits(a.backbone(a.embed(ids), a.project(aux), torch.arange(5)[None])[0])
        lb = b.logits(b.backbone(b.embed(ids), b.project(aux), torch.arange(5)[None])[0])
    # two model objects with the same fp32 weights: equal up to summation order (oneDNN may pick its
    # path by buffer alignment), far below what one wrong tensor or a bf16 rounding would move
    torch.testing.assert_close(la, lb, rtol=1e-6, atol=1e-6)
