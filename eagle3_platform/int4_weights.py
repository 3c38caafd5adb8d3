"""Few-row matmuls on a 4-bit target's own codes, with torch's int4 CPU kernel.

The embedded SmolLM2 ships as a GGUF Q4_1: each linear weight is, in groups of 32 along in_features,
lo + d·q with q in 0..15, and the prepared fp32 checkpoint holds those values exactly (checked:
every projection of all 30 layers reconstructs bitwise; the Q8_0 embedding does not lie on such a
grid and is left alone). A decode or verify step reads every weight for a few rows, so its cost is
the bytes read, and the codes are 1/8 of the fp32 weight. torch's int4 kernel
(`_weight_int4pack_mm_for_cpu`, what gpt-fast's CPU path runs) takes bf16 activations and bf16
scales, accumulates in fp32 and rounds its output to bf16: these matmuls have the bf16 dtype's
rounding (the weights it rebuilds are within ~2^-9 of the checkpoint's, as bf16 weights would be),
while the residual stream, norms and attention stay fp32. Its cost steps every 4 rows (it tiles rows
by 4) and it loses to fp32 from ~16-32 rows (it rebuilds the weights per tile), so only narrow inputs
take it (compute.int4_matmul_rows). SmolLM2's 210 linears, 2 threads, an Intel Xeon without
avx512_bf16 (~/.cache/eagle3-runs/s27/int4speed.py): 1 row 6.1 ms vs 16.4 ms fp32 row-major,
4 rows 8.2 vs 25.1, 8 rows 15.4 vs 33.2 packed, 256 rows 391 vs 212 packed; a whole target step over
300 cached tokens 41.9 -> 25.6 ms (1 row) and 72.0 -> 34.6 ms (4 rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32   # Q4_0/Q4_1's block along in_features; one of the kernel's group sizes
LEVELS = 15  # codes 0..15
# How far from the grid a value may lie: GRID_TOLERANCE steps d, plus fp32 rounding of the group's
# magnitude (GRID_RELATIVE: a few ulps, for groups whose step is tiny beside their offset). A GGUF
# dequantized in fp32 lands on it (SmolLM2's exactly); an fp32 or bf16 checkpoint's weights do not.
GRID_TOLERANCE, GRID_RELATIVE = 1e-3, 1e-6
N_MULTIPLE = 16  # out_features the kernel's layout takes


@dataclass(frozen=True)
class Int4Weight:
    packed: torch.Tensor        # the kernel's layout of the codes (opaque uint8)
    scales_zeros: torch.Tensor  # [in/GROUP, out, 2] bf16: w = (q - 8)·scale + zero
    out_features: int


def int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def grid_codes(weight: torch.Tensor) -> Int4Weight | None:
    """[out, in] -> its 4-bit codes, where every group of GROUP along in_features is lo + d·q
    (q in 0..LEVELS, d = (max - min)/LEVELS, as Q4_1 quantizes) to GRID_TOLERANCE; None where any
    value is off that grid (an fp32 or bf16 checkpoint: quantizing it would change the model), or
    where the kernel cannot take the shape."""
    out_f, in_f = weight.shape
    if in_f % GROUP or out_f % N_MULTIPLE or not int4_available():
        return None
    w, q, d, lo = _nearest_codes(weight)
    tolerance = GRID_TOLERANCE * d + GRID_RELATIVE * w.abs().amax(-1, keepdim=True)
    if ((q * d + lo - w).abs() > tolerance).any():  # on the grid or nothing: never quantize a model
        return None
    packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).reshape(out_f, in_f), 2)
    # the kernel rebuilds (q - 8)·scale + zero, so zero = lo + 8·d
    scales_zeros = torch.stack([d[..., 0], (lo + 8 * d)[..., 0]], dim=-1)  # [out, in/G, 2]
    return Int4Weight(packed, scales_zeros.transpose(0, 1).contiguous().to(torch.bfloat16), out_f)


def round_to_grid(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> the nearest values on a Q4_1 grid (per GROUP along in_features, lo + d·q with
    d = (max - min)/LEVELS): round-to-nearest 4-bit quantization, dequantized, in fp32. Only for the
    draft head, on request (draft/quant.int4_head): the target's weights are never rounded."""
    _, q, d, lo = _nearest_codes(weight)
    return (q * d + lo).reshape(weight.shape)


def _nearest_codes(weight: torch.Tensor):
    """[out, in] -> (w [out, in/G, G] fp32, its nearest codes q (float, 0..LEVELS) in the same shape,
    steps d and offsets lo [out, in/G, 1]): Q4_1's grid, d = (max - min)/LEVELS per group."""
    out_f, in_f = weight.shape
    w = weight.detach().float().reshape(out_f, in_f // GROUP, GROUP)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    d = (hi - lo) / LEVELS
    q = torch.round((w - lo) / torch.where(d > 0, d, torch.ones_like(d))).clamp_(0, LEVELS)
    return w, q, d, lo


def int4_matmul(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """[..., in] -> [..., out] = x @ Wᵀ in x's dtype, with bf16 rounding of x, the scales and the
    output (the module docstring); accumulation in fp32."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # [M, in]
    out = torch._weight_int4pack_mm_for_cpu(rows, w.packed, GROUP, w.scales_zeros)  # [M, out] bf16
    return out.to(x.dtype).reshape(*x.shape[:-1], w.out_features)
