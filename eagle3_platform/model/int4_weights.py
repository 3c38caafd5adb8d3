"""Few-row matmuls on a 4-bit target's own codes, with torch's int4 CPU kernel.

The embedded SmolLM2 ships as a GGUF Q4_1: each linear weight is, in groups of 32 along in_features,
lo + d·q with q in 0..15, and the prepared fp32 checkpoint holds those values exactly (checked:
every projection of all 30 layers reconstructs bitwise). Its embedding, which the lm_head shares, is
a Q8_0 (d·q, q in -127..127 per 32), which the same kernel multiplies as two 4-bit planes (q + 128 =
16·hi + lo). A decode or verify step reads every weight for a few rows, so its cost is the bytes
read, and the codes are 1/8 (1/4 for two planes) of the fp32 weight. torch's int4 kernel
(`_weight_int4pack_mm_for_cpu`, what gpt-fast's CPU path runs) takes bf16 activations and bf16
scales, accumulates in fp32 and rounds its output to bf16: these matmuls have the bf16 dtype's
rounding (the weights it rebuilds are within ~2^-9 of the checkpoint's, as bf16 weights would be),
while the residual stream, norms and attention stay fp32. Its cost steps every 4 rows (it tiles rows
by 4) and it loses to fp32 from ~16-32 rows (it rebuilds the weights per tile), so only narrow inputs
take it (compute.int4_matmul_rows). Without avx512_bf16, SmolLM2's 210 linears run ~2-3x faster on
the codes than in fp32 at 1-8 rows and ~2x slower at 256; a whole target step ~1.6-2x faster.
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
# A two-plane (Q8_0) weight reads twice the codes and runs the kernel twice, so it wins over fp32 at
# fewer rows than one plane: on SmolLM2's tied lm_head a whole target step is ~10% faster at 1-2
# rows, even at 5, slower from 6.
TWO_PLANE_ROWS = 5


@dataclass(frozen=True)
class Int4Plane:
    packed: torch.Tensor        # the kernel's layout of the codes (opaque uint8)
    scales_zeros: torch.Tensor  # [in/GROUP, out, 2] bf16: w = (q - 8)·scale + zero


@dataclass(frozen=True)
class Int4Weight:
    planes: tuple[Int4Plane, ...]  # W = the sum of the planes' weights (Q4_1: one; Q8_0: two)
    out_features: int


def int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def grid_codes(weight: torch.Tensor) -> Int4Weight | None:
    """[out, in] -> its 4-bit codes, where every group of GROUP along in_features lies on a GGUF grid
    to GRID_TOLERANCE: Q4_1's (lo + d·q, q in 0..LEVELS, d = (max - min)/LEVELS) as one plane, or
    Q8_0's (d·q, q in -127..127, d = max|w|/127) as two (q + 128 = 16·hi + lo, hi and lo 4-bit: the
    kernel multiplies each, the sum is the weight). None where any value is off both grids (an fp32
    or bf16 checkpoint: quantizing it would change the model), or where the kernel cannot take the
    shape."""
    out_f, in_f = weight.shape
    if in_f % GROUP or out_f % N_MULTIPLE or not int4_available():
        return None
    w = _groups(weight)  # [out, in/G, G] fp32, read once for both grids
    q, d, lo = _nearest_codes(w)
    if _on_grid(w, q * d + lo, d):
        return Int4Weight((_plane(q, d, lo + 8 * d),), out_f)  # the kernel rebuilds (q - 8)·d + zero
    q, d = _nearest_int8_codes(w)
    if _on_grid(w, q * d, d):
        hi, lo4 = (q + 128).div(16, rounding_mode="floor"), (q + 128).remainder(16)  # [out, in/G, G]
        # (hi - 8)·16d + 0 and (lo4 - 8)·d + 8d sum to (16·hi + lo4 - 128)·d = q·d
        return Int4Weight((_plane(hi, 16 * d, torch.zeros_like(d)), _plane(lo4, d, 8 * d)), out_f)
    return None


def rows_on_codes(w: Int4Weight, probed: int) -> int:
    """Below how many rows a weight's codes serve: a one-plane weight below what the machine's probe
    found (compute.int4_matmul_rows), a two-plane one below TWO_PLANE_ROWS at most."""
    return probed if len(w.planes) == 1 else min(probed, TWO_PLANE_ROWS)


def _on_grid(w: torch.Tensor, rebuilt: torch.Tensor, d: torch.Tensor) -> bool:
    tolerance = GRID_TOLERANCE * d + GRID_RELATIVE * w.abs().amax(-1, keepdim=True)
    return bool(((rebuilt - w).abs() <= tolerance).all())  # on the grid or nothing: never quantize


def _plane(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> Int4Plane:
    """codes q [out, in/G, G] (float, 0..LEVELS), scale and zero [out, in/G, 1] -> the kernel's plane."""
    out_f = q.shape[0]
    packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).reshape(out_f, -1), 2)
    scales_zeros = torch.stack([scale[..., 0], zero[..., 0]], dim=-1)  # [out, in/G, 2]
    return Int4Plane(packed, scales_zeros.transpose(0, 1).contiguous().to(torch.bfloat16))


def round_to_grid(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> the nearest values on a Q4_1 grid (per GROUP along in_features, lo + d·q with
    d = (max - min)/LEVELS): round-to-nearest 4-bit quantization, dequantized, in fp32. Only for the
    draft head, on request (draft/quant.int4_head): the target's weights are never rounded."""
    q, d, lo = _nearest_codes(_groups(weight))
    return (q * d + lo).reshape(weight.shape)


def _groups(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out, in/G, G] fp32: the groups a GGUF block scales together."""
    out_f, in_f = weight.shape
    return weight.detach().float().reshape(out_f, in_f // GROUP, GROUP)


def _nearest_codes(w: torch.Tensor):
    """groups w [out, in/G, G] -> (their nearest codes q (float, 0..LEVELS) in the same shape, steps d
    and offsets lo [out, in/G, 1]): Q4_1's grid, d = (max - min)/LEVELS per group."""
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    d = (hi - lo) / LEVELS
    return torch.round((w - lo) / _nonzero(d)).clamp_(0, LEVELS), d, lo


def _nearest_int8_codes(w: torch.Tensor):
    """groups w [out, in/G, G] -> (their nearest codes q (float, -127..127), steps d [out, in/G, 1]):
    Q8_0's grid, d = max|w|/127 per group (its largest value is ±127 steps)."""
    d = w.abs().amax(-1, keepdim=True) / 127
    return torch.round(w / _nonzero(d)).clamp_(-127, 127), d


def _nonzero(d: torch.Tensor) -> torch.Tensor:
    """d with its zero steps (constant groups) as 1: every code of such a group is 0."""
    return torch.where(d > 0, d, torch.ones_like(d))


def int4_matmul(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """[..., in] -> [..., out] = x @ Wᵀ in x's dtype, with bf16 rounding of x, the scales and each
    plane's output (the module docstring); accumulation in fp32."""
    # the kernel takes contiguous rows; a bf16 x's .to() is no copy, and a strided view stays strided
    # (checks, not no-op calls: a small op's dispatch costs µs, and a step makes ~120 of these)
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # [M, in]
    if not rows.is_contiguous():
        rows = rows.contiguous()
    first, *rest = (torch._weight_int4pack_mm_for_cpu(rows, p.packed, GROUP, p.scales_zeros)
                    for p in w.planes)  # [M, out] bf16 each
    if not rest and x.dtype == torch.bfloat16:  # one plane, bf16 in and out: the kernel's output is the
        return first.view(*x.shape[:-1], w.out_features)  # answer (no fp32 round trip: 2 ops fewer)
    out = first.float()
    for plane in rest:  # the planes' sum in fp32
        out += plane
    if x.dtype != torch.float32:
        out = out.to(x.dtype)
    return out.view(*x.shape[:-1], w.out_features)
