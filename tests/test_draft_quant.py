"""Head weights at inference (draft/quant.py): the int8 math and the layers it takes, the packed copy,
and that the engine stays lossless with either."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

from eagle3_platform.draft.quant import INT8_MAX_ROWS, Int8Linear, int4_head, int8_head, packed_head
from eagle3_platform.model.int4_weights import int4_available
from eagle3_platform.model.packed_linear import FusedProjection, PackedLinear, int4_weight_count, packing_available
from eagle3_platform.spec.config import PRESETS, SpecConfig
from eagle3_platform.spec.engine import SpecEngine
from eagle3_platform.testing.spec import VariedTargetConfig, random_draft, varied_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _linear(n_out, n_in, dtype, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(n_in, n_out, bias=False)
    lin.weight.data = lin.weight.data.to(dtype)
    return lin


def test_quantization_error_is_at_most_half_a_step_per_weight():
    lin = _linear(48, 64, torch.float32)
    q = Int8Linear(lin)
    assert q.q.dtype == torch.int8 and q.q.abs().max() <= 127
    step = q.scale.float()[:, None]  # [N,1]
    assert ((q.weight - lin.weight).abs() <= step / 2 + 1e-7).all()
    assert (q.q.abs().amax(1) == 127).all()  # every row uses its full range


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_both_paths_compute_x_times_the_dequantized_weight(dtype, tol):
    q = Int8Linear(_linear(40, 96, dtype))
    ref_w = q.weight.float()
    for rows in (1, 2, INT8_MAX_ROWS, INT8_MAX_ROWS + 1, 9):  # the int8 GEMV, then the dense GEMM
        x = torch.randn(1, rows, 96).to(dtype)
        y = q(x)
        assert y.shape == (1, rows, 40) and y.dtype == dtype
        ref = x.float() @ ref_w.T
        assert (y.float() - ref).abs().max() <= tol * ref.abs().max()


def test_int8_head_is_a_copy_sharing_only_the_frozen_parts():
    target = varied_target(None, VariedTargetConfig(vocab_size=96))
    draft = random_draft(target, 64)
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    quantized = int8_head(draft)
    assert isinstance(quantized.lm_head, Int8Linear) and isinstance(quantized.fc, Int8Linear)
    assert isinstance(quantized.midlayer.mlp.down_proj, Int8Linear)
    assert isinstance(draft.lm_head, nn.Linear) and isinstance(draft.midlayer.self_attn.q_proj, nn.Linear)
    assert all(torch.equal(v, draft.state_dict()[k]) for k, v in before.items())  # the original untouched
    assert quantized.embed_tokens is draft.embed_tokens and quantized.d2t is draft.d2t
    h = torch.randn(1, 1, draft.cfg.hidden_size)
    with torch.no_grad():  # the same head, up to int8 rounding of its weights
        assert torch.allclose(quantized.logits(h), draft.logits(h), atol=0.05 * draft.logits(h).abs().max())


def test_layers_the_kernel_cannot_take_stay_dense():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.ok, self.odd = nn.Linear(32, 8, bias=False), nn.Linear(24, 8, bias=False)

    m = int8_head(Two())
    assert isinstance(m.ok, Int8Linear) and isinstance(m.odd, nn.Linear)  # 24 inputs: not a multiple of 16


def test_head_weights_setting_is_validated():
    with pytest.raises(ValueError, match="head_weights"):
        SpecConfig(head_weights="int3")


@pytest.mark.skipif(not packing_available(), reason="torch built without oneDNN")
def test_packed_head_is_a_copy_with_the_same_logits():
    target = varied_target(None, VariedTargetConfig(vocab_size=96))
    draft = random_draft(target, 64)
    packed = packed_head(draft)
    assert isinstance(packed.lm_head, PackedLinear) and isinstance(packed.midlayer.mlp.down_proj, PackedLinear)
    assert isinstance(packed.midlayer.self_attn.q_proj, FusedProjection)  # q/k/v one matmul
    assert isinstance(packed.midlayer.mlp.gate_proj, FusedProjection)
    assert isinstance(draft.lm_head, nn.Linear)  # the original untouched
    assert packed.embed_tokens is draft.embed_tokens and packed.d2t is draft.d2t
    aux = torch.randn(1, 3, 3 * draft.cfg.hidden_size)
    h = torch.randn(1, 1, draft.cfg.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(packed.logits(h), draft.logits(h), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed.project(aux), draft.project(aux), atol=1e-5, rtol=1e-5)


needs_int4 = pytest.mark.skipif(not (packing_available() and int4_available()),
                                reason="torch without oneDNN or its int4 CPU kernel")


@needs_int4
def test_int4_head_is_a_rounded_copy_drafting_few_rows_on_its_codes():
    target = varied_target(None, VariedTargetConfig(vocab_size=96))
    draft = random_draft(target, 64)
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    rounded = int4_head(draft, int4_rows=5)
    # lm_head, fc, o_proj, down_proj, q/k/v (one fused weight), gate/up (one)
    assert int4_weight_count(rounded) == 6
    assert rounded.lm_head.weight_packed.int4_rows == 5
    assert all(torch.equal(v, draft.state_dict()[k]) for k, v in before.items())  # the original untouched
    assert rounded.embed_tokens is draft.embed_tokens and rounded.d2t is draft.d2t
    h = torch.randn(1, 1, draft.cfg.hidden_size)
    with torch.no_grad():  # the same head up to 4-bit rounding of its weights (and bf16 on the codes)
        want = draft.logits(h)
        torch.testing.assert_close(rounded.logits(h), want, rtol=0, atol=0.1 * want.abs().max().item())


@needs_int4
@pytest.mark.parametrize("rows", [1, 8])
def test_a_bf16_int4_head_drafts_in_bf16_like_the_rounded_fp32_head(rows):
    """A bf16 engine's head (cast in place before it is rounded): few rows on its codes, wider ones on
    the rounded weight in bf16; both within bf16 rounding of the fp32 head rounded to the same grid."""
    target = varied_target(None, VariedTargetConfig(vocab_size=96))
    draft = random_draft(target, 64)
    want_head = int4_head(draft, int4_rows=5)
    bf16 = copy.deepcopy(draft).cast_parameters(torch.bfloat16)
    rounded = int4_head(bf16, int4_rows=5)
    assert int4_weight_count(rounded) == 6 and rounded.lm_head.weight_packed.int4_rows == 5
    assert next(rounded.parameters()).dtype == torch.bfloat16
    h = torch.randn(1, rows, draft.cfg.hidden_size)
    with torch.no_grad():
        got, want = rounded.logits(h.bfloat16()), want_head.logits(h)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0, atol=0.05 * want.abs().max().item())


@pytest.mark.parametrize("preset", ["chain", "tree"])
def test_engine_is_lossless_with_the_int4_head(tiny_target, preset, monkeypatch):
    """fp32 target: only the head is rounded, the target verifies, so output equals plain greedy."""
    if not (packing_available() and int4_available()):
        pytest.skip("torch without oneDNN or its int4 CPU kernel")
    import eagle3_platform.spec.engine as engine_mod

    monkeypatch.setattr(engine_mod, "int4_probe_rows", lambda: 9)  # the machine's probe, not measured here
    target = varied_target(tiny_target)
    draft = random_draft(target, 64)
    ids = target.tokenizer("a b c d e f")["input_ids"]
    plain, _ = SpecEngine(target, None, PRESETS["baseline"]).generate(ids, 16)
    engine = SpecEngine(target, draft, replace(PRESETS[preset], head_weights="int4"))
    assert int4_weight_count(engine.draft) > 0 and int4_weight_count(target.model) == 0
    out, stats = engine.generate(ids, 16)
    assert out == plain and stats["verify_steps"] >= 1


def test_auto_head_weights_follow_the_target(tiny_target, monkeypatch):
    """int4 where the target decodes on 4-bit codes (its meta says below how many rows), else packed."""
    import eagle3_platform.spec.engine as engine_mod

    monkeypatch.setattr(engine_mod, "int4_probe_rows", lambda: pytest.fail("the target's rows come first"))
    target = varied_target(tiny_target)
    draft = random_draft(target, 64)
    assert SpecEngine(target, draft, PRESETS["chain"]).head_weights == "packed"
    if not (packing_available() and int4_available()):
        return
    on_codes = replace(target, meta={**target.meta, "int4_rows": 9})
    engine = SpecEngine(on_codes, draft, PRESETS["chain"])
    assert engine.head_weights == "int4" and engine.draft.lm_head.weight_packed.int4_rows == 9
    bf16 = varied_target(tiny_target, pack=False)  # row-major, so it can be cast; only its dtype is read
    bf16_on_codes = replace(bf16, model=bf16.model.to(torch.bfloat16), meta=on_codes.meta)
    engine = SpecEngine(bf16_on_codes, copy.deepcopy(draft), PRESETS["chain"])  # the engine casts its head
    assert engine.head_weights == "int4" and engine.draft.lm_head.weight_packed.int4_rows == 9
    assert next(engine.draft.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("preset", ["chain", "tree"])
def test_engine_is_lossless_with_the_int8_the_packed_and_the_native_head(tiny_target, preset):
    """fp32 target: output equals plain greedy decoding with any head; the int8 engine's copy of the
    head is quantized, the packed engine's is on oneDNN's layout, the native engine's is neither."""
    target = varied_target(tiny_target)
    draft = random_draft(target, 64)
    ids = target.tokenizer("a b c d e f")["input_ids"]
    plain, _ = SpecEngine(target, None, PRESETS["baseline"]).generate(ids, 16)
    int8_engine = SpecEngine(target, draft, replace(PRESETS[preset], head_weights="int8"))
    native_engine = SpecEngine(target, draft, replace(PRESETS[preset], head_weights="native"))
    assert isinstance(int8_engine.draft.lm_head, Int8Linear)
    packed_engine = SpecEngine(target, draft, replace(PRESETS[preset], head_weights="packed"))
    assert isinstance(native_engine.draft.lm_head, nn.Linear)
    if packing_available():
        assert isinstance(packed_engine.draft.lm_head, PackedLinear)
    for engine in (int8_engine, packed_engine, native_engine):
        out, stats = engine.generate(ids, 16)
        assert out == plain and stats["verify_steps"] >= 1
