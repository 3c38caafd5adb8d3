"""Few-row matmuls on a 4-bit target's own codes (model/int4_weights.py) and where they are used."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from eagle3_platform.model import compute
from eagle3_platform.model.int4_weights import (GROUP, LEVELS, TWO_PLANE_ROWS, grid_codes, int4_available, int4_matmul,
                                          round_to_grid)
from eagle3_platform.model.packed_linear import PackedLinear, fuse_siblings, int4_weight_count, packing_available

pytestmark = pytest.mark.skipif(not (int4_available() and packing_available()),
                                reason="torch without its int4 CPU kernel or oneDNN")
BF16_TOL = dict(rtol=2e-2, atol=2e-2)  # the codes' path rounds inputs, scales and outputs to bf16


def test_codes_rebuild_a_grid_weight_within_bf16_rounding():
    torch.manual_seed(0)
    w = round_to_grid(torch.randn(96, 128) / 10)  # [out, in]
    codes = grid_codes(w)
    assert codes is not None and codes.out_features == 96
    eye = torch.eye(128)  # row i of the product is column i of W: every code, scale and zero read back
    torch.testing.assert_close(int4_matmul(eye, codes), w.T, rtol=0, atol=w.abs().max().item() * 2 ** -7)
    x = torch.randn(2, 3, 128)  # [..., in] -> [..., out], in x's dtype
    out = int4_matmul(x, codes)
    assert out.shape == (2, 3, 96) and out.dtype is torch.float32
    torch.testing.assert_close(out, x @ w.T, **BF16_TOL)


def test_bf16_inputs_strided_or_not_multiply_on_the_codes():
    """A bf16 model hands the codes bf16 inputs, some of them strided views (regeneration's sliced
    hidden states): the same product as a contiguous copy, in bf16."""
    torch.manual_seed(0)
    w = round_to_grid(torch.randn(96, 128) / 10)
    codes = grid_codes(w)
    x = torch.randn(3, 256).bfloat16()[:, ::2]  # [3, 128], not contiguous
    assert not x.is_contiguous()
    out = int4_matmul(x, codes)
    assert out.dtype is torch.bfloat16
    torch.testing.assert_close(out, int4_matmul(x.contiguous(), codes))
    torch.testing.assert_close(out.float(), x.float() @ w.T, **BF16_TOL)


def q8_0(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> the nearest values on Q8_0's grid (d·q per GROUP, d = max|w|/127), as a GGUF
    Q8_0 tensor dequantizes (the embedded SmolLM2's embedding and tied lm_head)."""
    g = w.reshape(w.shape[0], -1, GROUP)
    d = g.abs().amax(-1, keepdim=True) / 127
    return (torch.round(g / d) * d).reshape(w.shape)


def test_a_q8_0_weight_is_two_planes_that_sum_to_it():
    torch.manual_seed(0)
    w = q8_0(torch.randn(48, 96) / 10)
    codes = grid_codes(w)
    assert codes is not None and len(codes.planes) == 2
    torch.testing.assert_close(int4_matmul(torch.eye(96), codes), w.T, rtol=0, atol=w.abs().max().item() * 2 ** -7)
    x = torch.randn(3, 96)
    torch.testing.assert_close(int4_matmul(x, codes), x @ w.T, **BF16_TOL)
    assert len(grid_codes(round_to_grid(w)).planes) == 1  # Q4_1's grid first: one plane where it fits
    w[5, 7] += w[5, :GROUP].abs().max() / 127 / 2  # half a step off Q8_0's grid (and Q4_1's)
    assert grid_codes(w) is None


def test_two_plane_weights_serve_fewer_rows_than_one_plane(monkeypatch):
    import eagle3_platform.model.packed_linear as pl

    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=False)
    with torch.no_grad():
        lin.weight.copy_(q8_0(lin.weight))
    layer = PackedLinear(lin, narrow_rows=4, int4_rows=17)
    assert layer.weight_packed.int4_rows == TWO_PLANE_ROWS < 17
    seen = []
    for name in ("packed_matmul", "int4_matmul"):
        real = getattr(pl, name)
        monkeypatch.setattr(pl, name, lambda *a, real=real, name=name: seen.append(name) or real(*a))
    for rows, path in ((TWO_PLANE_ROWS - 1, "int4_matmul"), (TWO_PLANE_ROWS, "packed_matmul")):
        x = torch.randn(rows, 64)
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), lin(x), **BF16_TOL)
        assert seen == [path]
        seen.clear()


def test_constant_groups_are_on_the_grid():
    w = torch.full((16, 64), 0.25)
    w[:, GROUP:] = round_to_grid(torch.randn(16, GROUP))
    codes = grid_codes(w)
    assert codes is not None
    bf16_step = w.abs().max().item() * 2 ** -7
    torch.testing.assert_close(int4_matmul(torch.eye(64), codes), w.T, rtol=0, atol=bf16_step)


@pytest.mark.parametrize("shape", [(64, 64), (64, 48), (24, 64)])
def test_weights_off_the_grid_or_of_other_shapes_get_no_codes(shape):
    """An fp32 checkpoint is not quantized behind the user's back; nor is a shape the kernel refuses
    (in_features not a multiple of GROUP, out_features not a multiple of 16)."""
    torch.manual_seed(0)
    w = torch.randn(shape)
    assert grid_codes(w) is None
    if shape[1] % GROUP == 0 and shape[0] % 16 == 0:
        w = round_to_grid(w)
        assert grid_codes(w) is not None
        group = w[3, :GROUP]
        lo, hi = group.min(), group.max()
        j = next(j for j in range(GROUP) if lo < group[j] < hi)
        w[3, j] = lo + (hi - lo) / LEVELS / 2  # one value halfway between two codes of its group
        assert grid_codes(w) is None


@pytest.mark.parametrize("bias", [False, True])
def test_narrow_inputs_multiply_on_the_codes_and_wide_ones_on_the_packed_weight(monkeypatch, bias):
    import eagle3_platform.model.packed_linear as pl

    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(round_to_grid(lin.weight))
    layer = PackedLinear(lin, narrow_rows=4, int4_rows=9)
    assert layer.weight_packed.rowmajor is None  # the codes serve every row the row-major copy would
    seen = []
    for name in ("packed_matmul", "int4_matmul"):
        real = getattr(pl, name)
        monkeypatch.setattr(pl, name, lambda *a, real=real, name=name: seen.append(name) or real(*a))
    for shape, path in (((1, 64), "int4_matmul"), ((2, 4, 64), "int4_matmul"), ((9, 64), "packed_matmul")):
        x = torch.randn(shape)
        with torch.inference_mode():
            out = layer(x)
        assert seen == [path]
        seen.clear()
        torch.testing.assert_close(out, lin(x), **BF16_TOL)
    assert "int4 codes below 9 rows" in repr(layer)


def test_off_grid_weights_keep_the_fp32_kernels():
    torch.manual_seed(0)
    layer = PackedLinear(nn.Linear(64, 96, bias=False), narrow_rows=4, int4_rows=9)
    w = layer.weight_packed
    assert w.int4 is None and w.int4_rows == 0 and w.narrow_rows == 4 and w.rowmajor is not None


def test_fused_siblings_hold_one_set_of_codes():
    torch.manual_seed(0)
    attn = nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = (nn.Linear(64, n, bias=False) for n in (64, 32, 32))
    for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
        with torch.no_grad():
            lin.weight.copy_(round_to_grid(lin.weight))
    x = torch.randn(1, 64)
    want = [lin(x) for lin in (attn.q_proj, attn.k_proj, attn.v_proj)]
    assert fuse_siblings(attn, int4_rows=5) == 3 and int4_weight_count(attn) == 1
    with torch.inference_mode():
        for got, ref in zip((attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)), want):
            torch.testing.assert_close(got, ref, **BF16_TOL)


def test_auto_uses_codes_below_the_decode_dtypes_probe(monkeypatch):
    monkeypatch.setattr(compute, "int4_probe_rows", lambda dtype="float32": {"float32": 13, "bfloat16": 5}[dtype])
    monkeypatch.setattr(compute, "cpu_flags", lambda: frozenset({"avx512f"}))
    assert compute.int4_matmul_rows("auto") == 13
    assert compute.int4_matmul_rows("float32") == compute.int4_matmul_rows("bfloat16") == 0  # as asked
    assert compute.int4_matmul_rows("auto", "cuda") == 0
    monkeypatch.setattr(compute, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
    assert compute.int4_matmul_rows("auto") == 5  # bf16 decode: measured against bf16's kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_probe_answers_one_past_a_probed_row_count(dtype):
    assert compute._measure_int4_rows(dtype, reps=1) in {0, *(r + 1 for r in compute.INT4_PROBE_ROWS)}


@pytest.fixture
def grid_target_dir(tiny_target_dir, tmp_path):
    """The tiny target with its layers' projections on a Q4_1 grid (the embedding left off it)."""
    out = tmp_path / "grid-target"
    shutil.copytree(tiny_target_dir, out)
    (weights,) = out.glob("*.safetensors")
    sd = load_file(weights)
    sd = {k: round_to_grid(v) if k.endswith("proj.weight") else v for k, v in sd.items()}
    save_file(sd, weights, metadata={"format": "pt"})
    return out


def test_target_on_a_grid_decodes_on_its_codes_under_auto(grid_target_dir, monkeypatch):
    """load_target records how many weights hold codes and below how many rows they serve; a decode
    step's logits stay within bf16 rounding of the fp32 kernels', and greedy decoding on the codes
    agrees with fp32 greedy decoding (reported, not exact: another rounding)."""
    from eagle3_platform.model.target import load_target
    from eagle3_platform.spec.config import PRESETS
    from eagle3_platform.spec.engine import SpecEngine

    monkeypatch.setattr(compute, "cpu_flags", lambda: frozenset({"avx512f"}))
    monkeypatch.setattr(compute, "rowmajor_matmul_rows", lambda dtype: 3)
    monkeypatch.setattr(compute, "int4_probe_rows", lambda dtype: 9)
    codes, fp32 = load_target(grid_target_dir, dtype="auto"), load_target(grid_target_dir, dtype="float32")
    layers = codes.model.config.num_hidden_layers
    assert codes.meta["int4_rows"] == 9 and codes.meta["int4_linears"] == 4 * layers  # qkv, o, gate/up, down
    assert fp32.meta["int4_rows"] == fp32.meta["int4_linears"] == 0
    ids = torch.randint(5, codes.model.config.vocab_size, (5, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():  # one 8-token sequence at a time: 8 rows per matmul, the codes' side of 9
        got = torch.cat([codes.model(row[None]).logits for row in ids])  # [5, 8, V]
        want = torch.cat([fp32.model(row[None]).logits for row in ids])
    torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9  # a near-tie may flip
    out, _ = SpecEngine(codes, None, PRESETS["baseline"]).generate(ids[0].tolist(), 8)  # decode steps run
    assert len(out) == 8


def test_target_on_a_grid_decodes_in_bf16_on_its_codes_taken_before_the_cast(grid_target_dir, monkeypatch):
    """Where decode runs in bf16 (native bf16), the codes come from the checkpoint's fp32 values (bf16
    rounds them off the grid): the model is the bf16 one (parameters bf16, RoPE's frequencies fp32),
    inputs of the probe's rows or more take its bf16 kernels (the same logits as a bf16 load), fewer
    take the codes (within bf16 rounding of fp32)."""
    from eagle3_platform.model.target import load_target
    from eagle3_platform.spec.config import PRESETS
    from eagle3_platform.spec.engine import SpecEngine

    monkeypatch.setattr(compute, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
    monkeypatch.setattr(compute, "dense_bf16_speedup", lambda: 4.0)
    monkeypatch.setattr(compute, "rowmajor_matmul_rows", lambda dtype: 0)
    monkeypatch.setattr(compute, "int4_probe_rows", lambda dtype: {"bfloat16": 5}[dtype])
    codes, bf16 = load_target(grid_target_dir, dtype="auto"), load_target(grid_target_dir, dtype="bfloat16")
    fp32 = load_target(grid_target_dir, dtype="float32")
    layers = codes.model.config.num_hidden_layers
    assert codes.meta["dtype"] == "bfloat16" and codes.meta["int4_rows"] == 5
    assert codes.meta["int4_linears"] == 4 * layers and bf16.meta["int4_linears"] == 0
    assert {p.dtype for p in codes.model.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in codes.model.buffers()} == {b.dtype for b in bf16.model.buffers()}
    ids = torch.randint(5, codes.model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(codes.model(ids).logits, bf16.model(ids).logits)  # 8 rows: bf16 kernels
        got, want = codes.model(ids[:, :3]).logits, fp32.model(ids[:, :3]).logits  # 3 rows: the codes
    torch.testing.assert_close(got.float(), want, rtol=5e-2, atol=5e-2)
    out, _ = SpecEngine(codes, None, PRESETS["baseline"]).generate(ids[0].tolist(), 8)  # decode steps run
    assert len(out) == 8
    two = torch.cat([ids, ids.flip(-1)])  # batched generate (regeneration's path) on the codes
    with torch.inference_mode():
        gen = codes.model.generate(two, attention_mask=torch.ones_like(two), max_new_tokens=3, do_sample=False,
                                   pad_token_id=0)
    assert gen.shape == (2, 11)


def test_off_grid_target_records_no_codes(tiny_target_dir, monkeypatch):
    from eagle3_platform.model.target import load_target

    monkeypatch.setattr(compute, "cpu_flags", lambda: frozenset({"avx512f"}))
    monkeypatch.setattr(compute, "rowmajor_matmul_rows", lambda dtype: 3)
    monkeypatch.setattr(compute, "int4_probe_rows", lambda dtype: 9)
    t = load_target(tiny_target_dir, dtype="auto")
    assert t.meta["int4_linears"] == 0 and t.meta["int4_rows"] == 0 and t.meta["rowmajor_rows"] == 3


@pytest.mark.e2e
def test_smollm2_projections_and_tied_lm_head_lie_on_their_grids(smollm2_dir, monkeypatch):
    """The embedded target as prepared: its 210 projections on Q4_1's grid (fused: 4 weights per
    layer) and its tied lm_head on Q8_0's (two planes), so under auto on an fp32 machine every weight
    a decode step reads has codes; one decode step's logits stay within bf16 rounding of fp32's."""
    from eagle3_platform.model.target import load_target

    monkeypatch.setattr(compute, "cpu_flags", lambda: frozenset({"avx512f"}))
    monkeypatch.setattr(compute, "rowmajor_matmul_rows", lambda dtype: 4)
    monkeypatch.setattr(compute, "int4_probe_rows", lambda dtype: 17)
    codes, fp32 = load_target(smollm2_dir, dtype="auto"), load_target(smollm2_dir, dtype="float32")
    layers = codes.model.config.num_hidden_layers
    assert codes.meta["int4_linears"] == 4 * layers + 1
    head = codes.model.lm_head.weight_packed
    assert len(head.int4.planes) == 2 and head.int4_rows == TWO_PLANE_ROWS
    ids = codes.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        got, want = codes.model(ids).logits[0, -1], fp32.model(ids).logits[0, -1]
    torch.testing.assert_close(got, want, rtol=0, atol=0.05 * want.abs().max().item())
    assert got.argmax() == want.argmax()


@pytest.mark.e2e
def test_smollm2_in_bf16_generates_batched_on_its_codes(smollm2_dir, monkeypatch):
    """The embedded target under auto where decode runs in bf16 (native bf16): codes below 5 rows, read
    off the fp32 checkpoint. Batched greedy generate (regeneration's path: the lm_head reads the last
    positions as a strided view) runs, and its first token is the bf16 model's."""
    from eagle3_platform.model.target import load_target

    monkeypatch.setattr(compute, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
    monkeypatch.setattr(compute, "dense_bf16_speedup", lambda: 4.0)
    monkeypatch.setattr(compute, "rowmajor_matmul_rows", lambda dtype: 0)
    monkeypatch.setattr(compute, "int4_probe_rows", lambda dtype: {"bfloat16": 5}[dtype])
    codes, bf16 = load_target(smollm2_dir, dtype="auto"), load_target(smollm2_dir, dtype="bfloat16")
    assert codes.meta["int4_linears"] == 4 * codes.model.config.num_hidden_layers + 1
    tok = codes.tokenizer
    ids = tok(["The capital of France is", "One, two, three,"], return_tensors="pt", padding=True,
              padding_side="left")
    with torch.inference_mode():
        got = codes.model.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
        want = bf16.model.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert got.shape == want.shape
    n = ids.input_ids.shape[1]
    assert (got[:, n] == want[:, n]).float().mean().item() >= 0.5  # a near-tie may flip (another rounding)
