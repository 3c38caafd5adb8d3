"""Weight-only int8 for the draft head at inference (after gpt-fast's WeightOnlyInt8Linear).

A batch-1 draft step multiplies one row by each weight matrix, so its time is the time to read the
weights: the head's lm_head over 8192 draft tokens plus its layer are ~18 MB in bf16, read 4-5 times
per verify step while the 270 MB target has evicted them from the CPU's caches. torch's int8 GEMV
(`_weight_int8pack_mm`) reads half the bytes: one row against [8192,576] takes about half the time
of bf16. It scales with the rows, though (at 8 rows it is slower than bf16), so above `INT8_MAX_ROWS`
rows the layer multiplies by its dequantized weight instead; both compute x @ (q * s)^T, so a token's
draft does not depend on the path. Output stays lossless: the target verifies every draft token; only
which tokens get drafted can change (τ is the same either way; scripts/bench_decode.py).

`packed_head` (the "auto" choice where the target is not on 4-bit codes): bf16 weights on oneDNN's
blocked layout (model/packed_linear.py). With the target's 270 MB streaming between draft forwards, it
reads the head's lm_head faster than the int8 GEMV does (~0.75x its time at 1 row, ~0.5x at 8 rows);
int8 stays selectable (`head_weights="int8"`).

`int4_head` (`head_weights="int4"`): the head's linears rounded to a 4-bit grid (Q4_1's, per 32
inputs) and packed with their codes (model/int4_weights.py), so a draft forward of a few rows reads 1/8 of
the fp32 bytes (1/4 of bf16's); wider inputs multiply on the rounded weights in the head's dtype. Only
the head is rounded. In a bf16 engine a chain_adaptive step costs ~6% less than with the packed bf16
head, τ unchanged (bench_decode).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

INT8_MAX_ROWS = 4  # int8 GEMV up to here; bf16 GEMM on the dequantized weight above (crossover 4-6)
INT8_K_MULTIPLE = 16  # torch 2.13's CPU bf16 kernel gives wrong sums for other input widths


def int8_supported(linear: nn.Linear) -> bool:
    return (hasattr(torch.ops.aten, "_weight_int8pack_mm") and linear.weight.device.type == "cpu"
            and linear.in_features % INT8_K_MULTIPLE == 0)


class Int8Linear(nn.Module):
    """y = x @ (q * s)^T: q int8 [N,K], s [N] per output channel (symmetric, amax / 127)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("Int8Linear takes bias-free layers (the head has none)")
        dtype = linear.weight.dtype
        w = linear.weight.detach().float()  # [N,K]
        scale = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)  # [N]
        scale = scale.to(dtype).float()  # the kernel multiplies by s in x's dtype: dequantize with that s
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("q", q)
        self.register_buffer("scale", scale.to(dtype))
        self.register_buffer("weight", (q.float() * scale[:, None]).to(dtype))  # [N,K] for many rows
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x):  # [..., K] -> [..., N]
        rows = x.numel() // self.in_features
        if rows > INT8_MAX_ROWS or x.dtype != self.scale.dtype:
            return F.linear(x, self.weight)
        y = torch._weight_int8pack_mm(x.reshape(rows, self.in_features).contiguous(), self.q, self.scale)
        return y.view(*x.shape[:-1], self.out_features)


def int8_head(draft: nn.Module) -> nn.Module:
    """A copy of the head whose Linear layers hold int8 weights (where the kernel supports them); the
    frozen embedding, RoPE and vocab maps are shared with `draft`, which is left as it was."""
    return _head_copy(draft, lambda lin: Int8Linear(lin) if int8_supported(lin) else lin)


def packed_head(draft: nn.Module, narrow_rows: int = 0) -> nn.Module:
    """A copy of the head on oneDNN-packed weights (model/packed_linear.py: q/k/v and gate/up fused; inputs
    of fewer than narrow_rows rows on the row-major weights), `draft` left as it was."""
    from eagle3_platform.model.packed_linear import pack_linears

    copied = _head_copy(draft)
    pack_linears(copied, narrow_rows=narrow_rows)
    return copied


def int4_head(draft: nn.Module, int4_rows: int, narrow_rows: int = 0) -> nn.Module:
    """A copy of the head whose linears lie on a 4-bit grid (int4_weights.round_to_grid), packed
    with their codes for inputs of fewer than int4_rows rows (narrow_rows: see packed_head); `draft`
    left as it was. Lossy for the head alone: the target still verifies every drafted token.
    A bf16 head is rounded from its bf16 values (the grid's step is far coarser than bf16's), and
    its wider inputs multiply on the rounded weight in bf16."""
    from eagle3_platform.model.int4_weights import GROUP, N_MULTIPLE, round_to_grid
    from eagle3_platform.model.packed_linear import pack_linears

    dtype = next(draft.parameters()).dtype

    def rounded(lin: nn.Linear) -> nn.Linear:
        if lin.in_features % GROUP or lin.out_features % N_MULTIPLE:
            return lin  # a shape the kernel cannot take keeps its weights
        new = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)  # fp32: on the grid
        new.load_state_dict({"weight": round_to_grid(lin.weight),
                             **({"bias": lin.bias.detach().float()} if lin.bias is not None else {})})
        return new.requires_grad_(False)

    copied = _head_copy(draft, rounded)
    pack_linears(copied, narrow_rows=narrow_rows, int4_rows=int4_rows, dtype=dtype)
    return copied


def _head_copy(draft: nn.Module, swap=None) -> nn.Module:
    """A copy of the head sharing its frozen embedding and RoPE; its linears through `swap` if given."""
    from eagle3_platform.model.packed_linear import swap_linears

    copied = copy.copy(draft)
    copied._modules = {name: m if name in ("embed_tokens", "rotary") else copy.deepcopy(m)
                       for name, m in draft._modules.items()}
    if swap is not None:
        swap_linears(copied, swap)
    return copied
