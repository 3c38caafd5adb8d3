"""SGLang export: exact names/shapes/dtypes, refusal (nothing written), round trip with identical logits."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_platform.draft.export import export_draft, expected_tensors, load_export
from eagle3_platform.draft.model import DraftConfig, build_draft, target_hf_config
from eagle3_platform.draft.train import DRAFT_WEIGHTS, load_draft_dir, save_draft_dir
from eagle3_platform.draft.vocab import build_vocab

DESIGN_NAMES = {"fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                "midlayer.post_attention_layernorm.weight", "norm.weight",
                "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
                "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
                "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
                "midlayer.mlp.down_proj.weight", "lm_head.weight", "d2t", "t2d"}


@pytest.fixture()
def draft_dir(tiny_target_dir, tmp_path):
    hf = target_hf_config(tiny_target_dir)
    counts = torch.randint(0, 50, (hf["vocab_size"],))
    d2t, t2d, _ = build_vocab(counts, hf["vocab_size"], 40)
    torch.manual_seed(0)
    draft = build_draft(tiny_target_dir, DraftConfig.from_target(hf, 40, [1, 3, 4]), True, d2t, t2d)
    with torch.no_grad():
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)   # non-trivial norms etc.
    return save_draft_dir(tmp_path / "draft", draft, {"target": {"target_id": "tiny"}})


def _logits(draft, seed=0):
    g = torch.Generator().manual_seed(seed)
    H, T = draft.cfg.hidden_size, 6
    ids = torch.randint(0, draft.cfg.vocab_size, (1, T), generator=g)
    aux = torch.randn(1, T, 3 * H, generator=g)
    with torch.no_grad():
        h, _ = draft.backbone(draft.embed(ids), draft.project(aux), torch.arange(T)[None])
        return draft.logits(h)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_identical_logits(draft_dir, tiny_target_dir, tmp_path, dtype):
    out = tmp_path / "export"
    summary = export_draft(draft_dir, out, dtype=dtype)
    assert summary["tensors"] == 15
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 40 and cfg["vocab_size"] == 421 and cfg["tie_word_embeddings"] is False
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == DESIGN_NAMES and not any("embed" in n for n in tensors)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["lm_head.weight"].dtype == getattr(torch, dtype)
    # d2t/t2d: the same Vd target ids
    ids = tensors["d2t"] + torch.arange(40)
    assert tensors["t2d"].sum() == 40 and tensors["t2d"][ids].all()

    original = load_draft_dir(draft_dir, tiny_target_dir)
    if dtype == "bfloat16":   # the export rounds weights to bf16; compare with the same rounding
        with torch.no_grad():
            for p in original.parameters():
                if p.requires_grad:
                    p.copy_(p.to(torch.bfloat16).float())
    loaded = load_export(out, tiny_target_dir)
    # two model objects with the same weights: equal up to summation order, not necessarily bitwise
    torch.testing.assert_close(_logits(loaded), _logits(original), rtol=1e-6, atol=1e-6)
    assert torch.equal(loaded.to_target_ids(torch.arange(40)), original.to_target_ids(torch.arange(40)))


@pytest.mark.parametrize("tamper", ["extra_name", "misnamed", "wrong_shape", "wrong_dtype", "bad_t2d"])
def test_refuses_and_writes_nothing(draft_dir, tmp_path, tamper):
    path = draft_dir / DRAFT_WEIGHTS
    sd = load_file(str(path))
    if tamper == "extra_name":
        sd["embed_tokens.weight"] = torch.zeros(421, 64)
    elif tamper == "misnamed":
        sd["midlayer.self_attn.qkv_proj.weight"] = sd.pop("midlayer.self_attn.q_proj.weight")
    elif tamper == "wrong_shape":
        sd["lm_head.weight"] = torch.zeros(41, 64)
    elif tamper == "wrong_dtype":
        sd["d2t"] = sd["d2t"].to(torch.int32)
    else:
        sd["t2d"] = sd["t2d"].clone()
        sd["t2d"][int((~sd["t2d"]).nonzero()[0])] = True
    save_file(sd, str(path))
    out = tmp_path / "export"
    with pytest.raises(ValueError, match="refusing"):
        export_draft(draft_dir, out)
    assert not out.exists() and not (tmp_path / "export.tmp").exists()


def test_expected_tensors_follow_config(draft_dir):
    cfg = DraftConfig.from_dict(json.loads((draft_dir / "draft_config.json").read_text())["draft"])
    from eagle3_platform.draft.export import sglang_config

    want = expected_tensors(sglang_config(cfg, "bfloat16"))
    assert set(want) == DESIGN_NAMES
    assert want["fc.weight"][0] == (64, 192) and want["midlayer.self_attn.k_proj.weight"][0] == (32, 128)


# ---- the rope the export writes: what SGLang's get_rope reads as the head's rotary ---------------------
def _rope_cfg(rope_parameters, max_positions=131072):
    from transformers import LlamaConfig

    c = {**LlamaConfig(num_hidden_layers=4).to_dict(), "max_position_embeddings": max_positions,
         "rope_parameters": {"rope_theta": 150000.0, **rope_parameters}}
    return DraftConfig.from_target(c, 32, [0, 1, 2])


def test_yarn_is_written_with_every_value_sglang_would_default_otherwise():
    from eagle3_platform.draft.export import sglang_rope_scaling

    gpt_oss = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
               "original_max_position_embeddings": 4096}
    assert sglang_rope_scaling(_rope_cfg(gpt_oss)) == gpt_oss  # nothing to spell out; truncate kept false
    # transformers: factor = max positions / original where absent, betas 32/1 where 0, truncate true
    bare = sglang_rope_scaling(_rope_cfg({"rope_type": "yarn", "original_max_position_embeddings": 4096,
                                          "beta_fast": 0}, max_positions=65536))
    assert bare == {"rope_type": "yarn", "original_max_position_embeddings": 4096, "factor": 16.0,
                    "beta_fast": 32, "beta_slow": 1, "truncate": True}
    assert sglang_rope_scaling(_rope_cfg({})) is None  # plain RoPE: rope_theta alone


@pytest.mark.parametrize("rope,why", [
    ({"rope_type": "dynamic", "factor": 2.0}, "'dynamic'"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32,
      "original_max_position_embeddings": 4096}, "'longrope'"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "attention_factor": 1.0},
     "attention_factor"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "extrapolation_factor": 0.5},
     "SGLang only"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "mscale": 0.0,
      "mscale_all_dim": 1.0}, "mscale"),
])
def test_a_rope_sglang_cannot_reproduce_is_refused_at_export(rope, why, draft_dir, tmp_path):
    from eagle3_platform.draft.export import sglang_rope_scaling
    from eagle3_platform.model.families import UnsupportedTarget

    with pytest.raises(UnsupportedTarget, match=why):
        sglang_rope_scaling(_rope_cfg(rope))
    meta = json.loads((draft_dir / "draft_config.json").read_text())
    meta["draft"]["rope_scaling"] = rope
    (draft_dir / "draft_config.json").write_text(json.dumps(meta))
    with pytest.raises(UnsupportedTarget, match=why):
        export_draft(draft_dir, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_yarn_attention_factor_equal_to_sglangs_scale_is_exported():
    import math

    from eagle3_platform.draft.export import sglang_rope_scaling

    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
            "attention_factor": 0.1 * math.log(4.0) + 1.0}
    assert sglang_rope_scaling(_rope_cfg(rope))["attention_factor"] == rope["attention_factor"]
