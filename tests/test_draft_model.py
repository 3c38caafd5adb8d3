"""Draft model: SGLang names, config from target (incl. RoPE scaling), incremental decoding, and the
training/inference contract: TTT step-k logits equal a sequential backbone chain with a KV cache."""
from __future__ import annotations

import pytest
import torch

from eagle3_platform.draft.metrics import acceptance_length, simulated_acceptance
from eagle3_platform.draft.model import DraftConfig, Eagle3Draft, build_draft, target_hf_config
from eagle3_platform.draft.ttt import ttt_forward

SGLANG_NAMES = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight",
    "d2t", "t2d"}


@pytest.fixture(scope="module")
def draft(tiny_target_dir):
    cfg = DraftConfig.from_target(target_hf_config(tiny_target_dir), 48, [1, 3, 4])
    torch.manual_seed(0)
    return build_draft(tiny_target_dir, cfg).eval()


def test_names_and_shapes_match_sglang(draft):
    sd = draft.head_state_dict()
    assert set(sd) == SGLANG_NAMES
    H = draft.cfg.hidden_size
    assert sd["fc.weight"].shape == (H, 3 * H)
    assert sd["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H
    assert sd["lm_head.weight"].shape == (48, H)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert not draft.embed_tokens.weight.requires_grad


def test_config_from_target_rope_scaling():
    hf = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "rms_norm_eps": 1e-5, "max_position_embeddings": 16384, "vocab_size": 100,
          "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}}
    cfg = DraftConfig.from_target(hf, 10, [1, 2, 3])
    assert cfg.head_dim == 16 and cfg.rope_theta == 5e5 and cfg.rope_scaling["rope_type"] == "llama3"
    assert DraftConfig.from_dict(cfg.to_dict()) == cfg
    m = Eagle3Draft(cfg)
    assert m.rotary.rope_type == "llama3"
    legacy = {**hf, "rope_parameters": None, "rope_theta": 5e5,
              "rope_scaling": {k: v for k, v in hf["rope_parameters"].items() if k != "rope_theta"}}
    assert DraftConfig.from_target(legacy, 10, [1, 2, 3]) == cfg


def test_incremental_backbone_equals_full(draft):
    torch.manual_seed(1)
    B, T, H = 2, 7, draft.cfg.hidden_size
    ids, g = torch.randint(0, 400, (B, T)), torch.randn(B, T, 3 * H)
    pos = torch.arange(T).expand(B, T)
    with torch.no_grad():
        full, _ = draft.backbone(draft.embed(ids), draft.project(g), pos)
        h1, kv = draft.backbone(draft.embed(ids[:, :4]), draft.project(g[:, :4]), pos[:, :4])
        h2, _ = draft.backbone(draft.embed(ids[:, 4:]), draft.project(g[:, 4:]), pos[:, 4:], past_kv=kv)
    torch.testing.assert_close(torch.cat([h1, h2], 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T", [1, 3])
def test_grouped_drafting_attention_matches_sdpa(draft, monkeypatch, T):
    """Short queries (drafting) use grouped matmuls over the cache, long ones (a prompt) sdpa over
    repeated heads; both compute the same attention, with and without a mask."""
    import eagle3_platform.draft.model as model_mod

    torch.manual_seed(3)
    B, P, H = 2, 11, draft.cfg.hidden_size
    ids, g = torch.randint(0, 400, (B, P + T)), torch.randn(B, P + T, 3 * H)
    pos = torch.arange(P + T).expand(B, -1)
    allowed = torch.rand(B, 1, T, P + T) < 0.7
    allowed[..., P:] = torch.eye(T, dtype=torch.bool)  # every query sees itself
    masks = [None, torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)]
    out = {}
    with torch.no_grad():
        _, kv = draft.backbone(draft.embed(ids[:, :P]), draft.project(g[:, :P]), pos[:, :P])
        for grouped_up_to in (model_mod.MAX_GROUPED_QUERY, 0):  # 0: every query length goes to sdpa
            monkeypatch.setattr(model_mod, "MAX_GROUPED_QUERY", grouped_up_to)
            out[grouped_up_to] = [draft.backbone(draft.embed(ids[:, P:]), draft.project(g[:, P:]), pos[:, P:],
                                                 m, kv)[0] for m in masks]
    for got, want in zip(out[model_mod.MAX_GROUPED_QUERY], out[0]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_ttt_steps_equal_sequential_drafting_with_cache(draft):
    """What the engine does at inference (one token per step, cache = step-0 prefix + own guesses)
    must equal what TTT trains on."""
    torch.manual_seed(2)
    B, T, H, K = 1, 9, draft.cfg.hidden_size, 4
    ids, g = torch.randint(0, 400, (B, T)), torch.randn(B, T, 3 * H)
    with torch.no_grad():
        ttt = [lg for _, lg in ttt_forward(draft, g, ids, K)]
        nxt = torch.cat([ids[:, 1:], torch.zeros(B, 1, dtype=torch.long)], 1)
        h0, (k0, v0) = draft.backbone(draft.embed(nxt), draft.project(g), torch.arange(T)[None])
        for t in range(T - K):
            torch.testing.assert_close(draft.logits(h0[:, t]), ttt[0][:, t], atol=1e-5, rtol=1e-5)
            past, h = (k0[:, :, :t + 1], v0[:, :, :t + 1]), h0[:, t:t + 1]
            for k in range(1, K):
                h, (kn, vn) = draft.backbone(draft.embed(ids[:, t + 1 + k:t + 2 + k]), h,
                                             torch.tensor([[t + k]]), past_kv=past)
                past = (torch.cat([past[0], kn], 2), torch.cat([past[1], vn], 2))
                torch.testing.assert_close(draft.logits(h)[:, 0], ttt[k][:, t], atol=1e-5, rtol=1e-5)


def test_to_target_ids(draft):
    d2t = torch.arange(48) * 2                          # draft i -> target 3i
    t2d = torch.zeros(draft.cfg.vocab_size, dtype=torch.bool)
    t2d[torch.arange(48) * 3] = True
    m = Eagle3Draft(draft.cfg)
    m.set_vocab(d2t, t2d)
    assert m.to_target_ids(torch.tensor([0, 1, 5])).tolist() == [0, 3, 15]


def test_simulated_acceptance_and_tau():
    assert simulated_acceptance([]) == 1.0
    assert simulated_acceptance([1.0, 1.0, 1.0]) == 4.0
    assert simulated_acceptance([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    with pytest.raises(ValueError):
        simulated_acceptance([1.5])
    assert acceptance_length(30, 10) == 3.0 and acceptance_length(0, 0) is None
