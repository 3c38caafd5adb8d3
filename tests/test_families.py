"""The target-family registry (model/families.py) and the engine on every family: capture layers,
nested configs, refusals, attention layouts, the head's config, and greedy output (single requests and
a batch of different lengths, plain and speculative) equal to the target's own transformers greedy
decoding, fp32."""
from __future__ import annotations

import pytest
import torch

from eagle3_platform.model import families
from eagle3_platform.model.families import (CHUNKED, FULL, SLIDING, UnsupportedTarget, attention_layout,
                                            capture_layer_ids, family_of)
from eagle3_platform.testing.zoo import ZOO, build_zoo_model, zoo_config, zoo_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("n", range(3, 41))
def test_capture_layers_distinct_in_range_and_sglangs_from_7(n):
    ids = capture_layer_ids(n)
    assert len(set(ids)) == 3 and ids == sorted(ids) and 0 <= ids[0] and ids[-1] < n
    if n >= 7:
        assert ids == [1, n // 2 - 1, n - 4]


def test_capture_refuses_too_shallow():
    with pytest.raises(UnsupportedTarget, match="three layers"):
        capture_layer_ids(2)


def test_unregistered_family_is_refused_with_what_is_missing():
    from transformers import Gemma2Config, GPT2Config

    for cfg in (GPT2Config(), Gemma2Config()):
        with pytest.raises(UnsupportedTarget, match=f"{cfg.model_type!r} is not registered.*decoder layers"):
            family_of(cfg)


def test_prepare_target_refuses_an_unregistered_checkpoint(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from eagle3_platform.model.target import prepare_target

    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "g")
    with pytest.raises(UnsupportedTarget, match="'gpt2' is not registered"):
        prepare_target(str(tmp_path / "g"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _cfg(family):
    z = ZOO[family]
    return zoo_config(z, 300, 1, 0)


@pytest.mark.parametrize("family,kinds", [
    ("llama", {FULL}), ("qwen2", {FULL}), ("qwen3", {FULL}), ("qwen3_moe", {FULL}), ("phi3", {FULL}),
    ("mistral", {SLIDING}), ("gemma3_text", {SLIDING, FULL}), ("gemma3", {SLIDING, FULL}), ("llama4", {CHUNKED, FULL}),
    ("gpt_oss", {SLIDING, FULL}), ("mistral3", {FULL})])
def test_attention_layouts(family, kinds):
    cfg = _cfg(family)
    lay = attention_layout(cfg)
    assert set(lay.kinds) == kinds and len(lay.kinds) == families.text_config(cfg).num_hidden_layers
    assert (lay.window == 16) == (SLIDING in kinds) and (lay.chunk == 16) == (CHUNKED in kinds)
    assert lay.additive == (family == "gpt_oss") == lay.sinks  # sinks: transformers' eager kernel, additive masks
    assert families.step_loop(cfg) == (family in ("llama", "mistral3"))  # Mistral-3: no window


def test_mistral_without_window_takes_the_step_loop():
    from transformers import MistralConfig

    assert families.step_loop(MistralConfig(sliding_window=None, num_hidden_layers=4))
    assert not families.step_loop(MistralConfig(sliding_window=4096, num_hidden_layers=4))


def test_nested_configs_read_through_their_text_config():
    from transformers import Gemma3Config

    cfg = _cfg("llama4")
    assert cfg.model_type == "llama4" and families.text_config(cfg).num_hidden_layers == 4
    g = Gemma3Config(text_config=dict(num_hidden_layers=5, hidden_size=64))
    assert families.text_config(g).num_hidden_layers == 5 and family_of(g).decoder == "model.language_model"
    d = g.to_dict()
    assert families.text_config(d)["num_hidden_layers"] == 5  # dicts (config.json) too
    assert "language_model.model.embed_tokens.weight" in families.checkpoint_names(_cfg("llama4"), "embed_tokens")
    m = _cfg("mistral3")  # Mistral-3: a mistral text_config, the decoder under model.language_model
    assert families.text_config(m).model_type == "mistral" and family_of(m).decoder == "model.language_model"
    assert families.causal_lm_class(m).__name__ == "Mistral3ForConditionalGeneration"
    assert families.causal_lm_class(_cfg("gemma3")).__name__ == "AutoModelForCausalLM"


def test_head_config_is_silu_full_rotary_whatever_the_target():
    from transformers import Gemma3TextConfig, Phi3Config

    from eagle3_platform.draft.export import sglang_config
    from eagle3_platform.draft.model import DraftConfig

    g = DraftConfig.from_target(Gemma3TextConfig(num_hidden_layers=8), 32, [1, 3, 4])
    assert g.hidden_act == "silu" and g.rope_theta == 1_000_000.0  # the full-attention layers' RoPE
    c = sglang_config(g, "bfloat16")
    assert c["hidden_act"] == "silu" and c["target_hidden_size"] == g.hidden_size
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    p = DraftConfig.from_target(Phi3Config(partial_rotary_factor=0.75), 32, [1, 2, 3])
    assert p.rope_scaling is None and "partial_rotary_factor" not in p.rope_parameters()
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 24, "long_factor": [1.0] * 24,
                "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    phi4 = DraftConfig.from_target({**Phi3Config().to_dict(), "rope_parameters": longrope}, 32, [1, 2, 3])
    assert phi4.rope_scaling is None  # factors sized for 3/4 of the dims cannot rotate all of them


# ---- the engine on every family ---------------------------------------------------------------------
PROMPTS = ["What is the capital of France? Explain step by step.", "def add(a, b): write a sort",
           "Summarize the following article about the quick brown fox and the lazy dog in detail."]


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zoo")


def _loaded(family, zoo_dir):
    import os

    from eagle3_platform.model.target import load_target, prepare_target

    os.environ.setdefault("EAGLE3_CACHE", str(zoo_dir / "cache"))
    src = build_zoo_model(family, zoo_dir / family)
    prepare_target(str(src), zoo_dir / f"{family}-target")
    return zoo_dir / f"{family}-target", load_target(zoo_dir / f"{family}-target")


def _ids(tok, text):
    from eagle3_platform.data.chat import render_prompt

    return render_prompt(tok, [{"role": "user", "content": text}])


def _batched(engine, prompts, max_new):
    """The prompts prefilled, then decoded together in one batch (rows of different lengths) until each
    is done -> each one's tokens."""
    batch = engine.batch()
    reqs = [batch.open(ids, max_new) for ids in prompts]
    out = {r: batch.prefill(r, None) for r in reqs}
    for r in [r for r in batch.rows if r.done]:
        batch.close(r)
    while batch.rows:
        for r, toks in batch.step():
            out[r] += toks
        for r in [r for r in batch.rows if r.done]:
            batch.close(r)
    return [out[r] for r in reqs]


@pytest.mark.parametrize("family", sorted(ZOO))
def test_engine_greedy_equals_transformers_greedy(family, zoo_dir):
    from eagle3_platform.spec.config import PRESETS
    from eagle3_platform.spec.engine import SpecEngine
    from eagle3_platform.spec.eval import reference_greedy, reference_model
    from eagle3_platform.testing.spec import random_draft

    target_dir, target = _loaded(family, zoo_dir)
    assert target.meta["family"] == ZOO[family].family
    ref_model = reference_model(target_dir, target)
    plain = SpecEngine(target, None, PRESETS["baseline"])
    spec = SpecEngine(target, random_draft(target, 64), PRESETS["tree"])
    prompts = [_ids(target.tokenizer, p) for p in PROMPTS]
    refs = [reference_greedy(ref_model, ids, 40, plain.eos_ids) for ids in prompts]
    assert len(prompts[2]) + len(refs[2]) > 32  # past the zoo's 16-token windows and chunks
    assert len({t for r in refs for t in r}) > 10  # outputs that vary: the check is not vacuous
    for engine in (plain, spec):
        assert [engine.generate(ids, 40)[0] for ids in prompts] == refs
        assert _batched(engine, prompts, 40) == refs


def test_the_old_masks_would_differ(zoo_dir, monkeypatch):
    """The check above can fail: ragged masks without the layout (full attention everywhere) break
    Gemma-3's sliding-window greedy output."""
    import eagle3_platform.spec.batch as batch_mod
    from eagle3_platform.spec.config import PRESETS
    from eagle3_platform.spec.engine import SpecEngine
    from eagle3_platform.spec.eval import reference_greedy, reference_model

    target_dir, target = _loaded("gemma3_text", zoo_dir)
    ref_model = reference_model(target_dir, target)
    plain = SpecEngine(target, None, PRESETS["baseline"])
    prompts = [_ids(target.tokenizer, p) for p in PROMPTS]
    refs = [reference_greedy(ref_model, ids, 40, plain.eos_ids) for ids in prompts]
    monkeypatch.setattr(batch_mod, "attention_layout", lambda config: None)
    assert _batched(plain, prompts, 40) != refs


def test_zoo_tokenizers_use_the_families_templates():
    for z in ZOO.values():
        tok, name = zoo_tokenizer(z)
        assert name in (z.template, "chatml")
        text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                       add_generation_prompt=True)
        assert "hi" in text and tok.convert_tokens_to_ids(tok.eos_token) is not None
