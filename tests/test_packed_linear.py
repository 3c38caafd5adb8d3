"""oneDNN-packed linear layers: same outputs as nn.Linear (within rounding), swapped in by load_target."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from eagle3_platform.model.packed_linear import PackedLinear, pack_linears, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch built without oneDNN")

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(dtype, bias):
    torch.manual_seed(0)
    lin = nn.Linear(48, 80, bias=bias).to(dtype)
    packed = PackedLinear(lin)
    x = torch.randn(3, 7, 48, dtype=dtype)
    with torch.inference_mode():
        for inp in (x, x[:, 2:5], x[:, -1:], x.transpose(0, 1)):  # 3-D, sliced and transposed views
            torch.testing.assert_close(packed(inp).float(), lin(inp).float(), **TOL[dtype])
    assert packed(x).shape == (3, 7, 80)


def test_pack_linears_swaps_every_linear_and_keeps_state_dict_clean(tiny_target_dir):
    from eagle3_platform.model.target import load_target

    plain = load_target(tiny_target_dir, pack=False)
    packed = load_target(tiny_target_dir)
    n_linear = sum(type(m) is nn.Linear for m in plain.model.modules())
    assert plain.meta["packed_linears"] == 0
    assert packed.meta["packed_linears"] == n_linear > 0
    assert not any(type(m) is nn.Linear for m in packed.model.modules())
    # the opaque packed weights are neither parameters nor state: checkpoints and .to() never see them
    assert all(not t.is_mkldnn for t in packed.model.state_dict().values())
    ids = torch.randint(0, plain.model.config.vocab_size, (2, 24))
    with torch.inference_mode():
        torch.testing.assert_close(packed.model(ids).logits, plain.model(ids).logits, **TOL[torch.float32])


def test_packed_model_logits_match_row_major_in_bf16(tiny_target_dir):
    """Packing changes the kernel, not the arithmetic: a bf16 model's logits agree within rounding."""
    from eagle3_platform.model.target import load_target
    from eagle3_platform.testing.spec import VariedTargetConfig, varied_target

    base = load_target(tiny_target_dir, pack=False)
    plain = varied_target(base, VariedTargetConfig(seed=3), pack=False).model.to(torch.bfloat16)
    packed = type(plain)(plain.config).to(torch.bfloat16).eval()
    packed.load_state_dict(plain.state_dict())
    assert pack_linears(packed) > 0
    ids = torch.randint(0, plain.config.vocab_size, (2, 16))
    with torch.inference_mode():
        a, b = plain(ids).logits.float(), packed(ids).logits.float()
    assert (a - b).abs().max() <= 2e-2 * a.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_sibling_projections_share_one_matmul_and_match_their_linears(dtype, bias):
    """q/k/v (or gate/up) of one input: one matmul, each sibling its slice; a new input, or a sibling
    asked twice for the same input, computes afresh."""
    from eagle3_platform.model.packed_linear import FusedProjection, fuse_siblings

    torch.manual_seed(0)
    attn = nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = (nn.Linear(48, n, bias=bias).to(dtype) for n in (48, 16, 16))
    plain = {n: getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")}
    assert fuse_siblings(attn) == 3
    assert all(type(getattr(attn, n)) is FusedProjection for n in plain)
    for x in (torch.randn(2, 5, 48, dtype=dtype), torch.randn(3, 1, 48, dtype=dtype)):
        with torch.inference_mode():
            outs = {n: getattr(attn, n)(x) for n in plain}
            for n, lin in plain.items():
                assert outs[n].shape == (*x.shape[:-1], lin.out_features)
                torch.testing.assert_close(outs[n].float(), lin(x).float(), **TOL[dtype])
        base = outs["q_proj"].untyped_storage().data_ptr()
        assert all(o.untyped_storage().data_ptr() == base for o in outs.values())  # one output
    with torch.inference_mode():
        first = attn.q_proj(x)
        again = attn.q_proj(x)  # same input, same sibling: a new matmul, not the old slice
    assert again.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    torch.testing.assert_close(again, first)


def test_load_target_fuses_each_layers_siblings(tiny_target_dir):
    from eagle3_platform.model.packed_linear import FusedProjection
    from eagle3_platform.model.target import load_target

    model = load_target(tiny_target_dir).model
    for layer in model.model.layers:
        for name in ("q_proj", "k_proj", "v_proj"):
            assert type(getattr(layer.self_attn, name)) is FusedProjection
        assert type(layer.mlp.gate_proj) is FusedProjection and type(layer.mlp.up_proj) is FusedProjection
        assert type(layer.mlp.down_proj) is PackedLinear and type(layer.self_attn.o_proj) is PackedLinear


@pytest.mark.parametrize("bias", [False, True])
def test_wide_bf16_inputs_multiply_on_fp32_weights_within_one_bf16_rounding(monkeypatch, bias):
    """wide_rows 8: inputs of 8+ rows take the fp32 copy, fewer the bf16 weight; both equal the fp32
    product of the bf16 values within one bf16 rounding, and the output stays bf16."""
    import eagle3_platform.model.packed_linear as pl

    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(lin, wide_rows=8)
    seen = []
    real = pl.packed_matmul
    monkeypatch.setattr(pl, "packed_matmul", lambda x, w, b: seen.append(x.dtype) or real(x, w, b))
    for shape, path in (((2, 3, 64), torch.bfloat16), ((2, 4, 64), torch.float32), ((9, 64), torch.float32),
                        ((1, 7, 64), torch.bfloat16)):
        x = torch.randn(shape).to(torch.bfloat16)
        with torch.inference_mode():
            out = packed(x)
        assert seen.pop() is path and out.dtype is torch.bfloat16
        want = x.float() @ lin.weight.float().T + (lin.bias.float() if bias else 0)
        # one bf16 rounding of the output: relative 2^-8
        assert ((out.float() - want).abs() <= want.abs() * 2 ** -8 + 1e-6).all()
    assert "fp32 from 8 rows" in repr(packed)


def test_wide_copies_are_bf16_only_and_shared_inputs_take_them(monkeypatch):
    import eagle3_platform.model.packed_linear as pl

    fp32 = PackedLinear(nn.Linear(16, 16), wide_rows=2)
    assert fp32.weight_packed.wide is None and fp32.weight_packed.wide_rows == 0  # already fp32
    attn = nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = (nn.Linear(32, 32, bias=False).to(torch.bfloat16) for _ in range(3))
    plain = attn.q_proj
    assert pl.fuse_siblings(attn, wide_rows=4) == 3
    seen = []
    real = pl.packed_matmul
    monkeypatch.setattr(pl, "packed_matmul", lambda x, w, b: seen.append(x.dtype) or real(x, w, b))
    x = torch.randn(5, 32).to(torch.bfloat16)
    with torch.inference_mode():
        out = attn.q_proj(x)
    assert seen == [torch.float32] and out.dtype is torch.bfloat16
    torch.testing.assert_close(out.float(), plain(x).float(), **TOL[torch.bfloat16])


@pytest.mark.parametrize("bias", [False, True])
def test_narrow_inputs_multiply_on_the_row_major_weight(monkeypatch, bias):
    """narrow_rows 4: inputs of fewer rows take torch's row-major kernel, 4+ the packed one; both
    equal nn.Linear's output (another kernel: fp32 summation order only)."""
    import eagle3_platform.model.packed_linear as pl

    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=bias)
    packed = PackedLinear(lin, narrow_rows=4)
    seen = []
    real = pl.packed_matmul
    monkeypatch.setattr(pl, "packed_matmul", lambda x, w, b: seen.append("packed") or real(x, w, b))
    for shape, path in (((1, 64), "rowmajor"), ((1, 3, 64), "rowmajor"), ((2, 2, 64), "packed"),
                        ((9, 64), "packed")):
        x = torch.randn(shape)
        with torch.inference_mode():
            out = packed(x)
        assert (seen.pop() if seen else "rowmajor") == path and not seen
        torch.testing.assert_close(out, lin(x), rtol=1e-5, atol=1e-5)
    assert "row-major below 4 rows" in repr(packed)
    assert PackedLinear(lin).weight_packed.rowmajor is None  # narrow_rows 0: no second copy


def test_shared_inputs_take_the_row_major_weight_when_narrow(monkeypatch):
    import eagle3_platform.model.packed_linear as pl

    torch.manual_seed(0)
    mlp = nn.Module()
    mlp.gate_proj, mlp.up_proj = nn.Linear(32, 48, bias=False), nn.Linear(32, 48, bias=False)
    gate, up = mlp.gate_proj, mlp.up_proj
    assert pl.fuse_siblings(mlp, narrow_rows=2) == 2
    monkeypatch.setattr(pl, "packed_matmul", lambda *a: pytest.fail("packed kernel for one row"))
    x = torch.randn(1, 32)
    with torch.inference_mode():
        torch.testing.assert_close(mlp.gate_proj(x), gate(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mlp.up_proj(x), up(x), rtol=1e-5, atol=1e-5)
