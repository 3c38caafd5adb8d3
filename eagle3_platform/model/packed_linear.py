"""Linear layers on oneDNN's packed weight layout, for inference on CPU.

torch's CPU `linear` reads a row-major weight at 7-30 GB/s for the few rows of a decode step or a
verify; the same weight reordered once into oneDNN's blocked layout reads at 20-57 GB/s (bf16, 2
threads, the shapes of SmolLM2-135M: 1.2-3x per call): a whole decode step ~1.4-1.5x faster, with logits
bitwise equal to the row-major ones. It changes the kernel, not the dtype (fp32 accumulation either
way), and every path runs on it alike: plain decoding and EAGLE-3, the servers, the losslessness tests.
This is the pair of ops torch's own compiler emits for frozen CPU linears; here it needs no compile.

Sibling projections of one input (an attention's q/k/v, an MLP's gate/up: `SIBLINGS`) become one
packed matmul over their stacked weights: the first sibling called computes all of them, the others
take their slice. Five calls per layer become two (a whole forward 1.01-1.06x faster).

Wide inputs (`wide_rows`, compute.wide_matmul_rows): where bf16 arithmetic is slow (an Intel CPU with
avx512_bf16 but no AMX), a bf16 weight is also held packed in fp32, and matmuls of at least that
many rows (prefill chunks, verify steps of a batch, regeneration's batches) run on it: compute-bound
there, and fp32 multiplies ~1.6x faster than bf16 at 48 rows. A few rows stay on the bf16 weight,
whose half bytes win while streaming weights is the cost. Same products (bf16 values are exact in
fp32), fp32 accumulation either way; the output is rounded to the input's dtype.

Narrow inputs (`narrow_rows`, compute.narrow_matmul_rows): where torch's row-major kernel beats the
packed one for a few rows (fp32 on an Intel CPU whose VM hides avx512_bf16, at 1-3 rows), the
row-major weight is kept too and inputs of fewer rows use it.

4-bit inputs (`int4_rows`, compute.int4_matmul_rows): where a weight lies exactly on a GGUF grid (the
embedded SmolLM2's Q4_1 projections, one 4-bit plane; its Q8_0 tied lm_head, two), inputs of fewer
rows multiply on its codes (int4_weights.py: 1/8 or 1/4 of the fp32 bytes, bf16 rounding; a
two-plane weight only below int4_weights.TWO_PLANE_ROWS). Checked first. The codes are read off the
weight as given; `dtype` casts the other copies after (a bf16 model's weights are off the grid).
"""
from __future__ import annotations

import torch
from torch import nn

from eagle3_platform.model.int4_weights import grid_codes, int4_matmul, rows_on_codes


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> the same weight in oneDNN's blocked layout (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[..., in] -> [..., out] = x @ Wᵀ + b with W from pack_weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedWeight:
    """A weight (and bias) packed for oneDNN; a bf16 one with wide_rows > 0 also in fp32, which
    inputs of at least wide_rows rows multiply instead; with narrow_rows > 0 its row-major weight
    kept too, which inputs of fewer rows multiply; with int4_rows > 0 and the weight on a 4-bit grid,
    its codes too, which inputs of fewer rows multiply first. Invariant: every path gives x @ Wᵀ + b
    in x's dtype within one rounding of it (same products, fp32 accumulation, another summation
    order), except the codes' path: within bf16 rounding of it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, wide_rows: int = 0,
                 narrow_rows: int = 0, int4_rows: int = 0, dtype: torch.dtype | None = None):
        weight = weight.detach()
        self.int4 = grid_codes(weight) if int4_rows else None  # before a cast rounds it off the grid
        weight = weight if dtype is None else weight.to(dtype)
        bias = bias if dtype is None or bias is None else bias.to(dtype)
        self.packed, self.bias = pack_weight(weight), bias
        self.int4_rows = 0 if self.int4 is None else rows_on_codes(self.int4, int4_rows)
        self.narrow_rows = narrow_rows if narrow_rows > self.int4_rows else 0  # the codes serve fewer
        self.rowmajor = weight.contiguous() if self.narrow_rows else None
        self.wide_rows = wide_rows if weight.dtype == torch.bfloat16 else 0
        self.wide = pack_weight(weight.float()) if self.wide_rows else None
        self.wide_bias = None if bias is None or not self.wide_rows else bias.detach().float()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.int4 is not None and x.numel() < self.int4_rows * x.shape[-1]:
            out = int4_matmul(x, self.int4)
            return out if self.bias is None else out + self.bias
        if self.rowmajor is not None and x.numel() < self.narrow_rows * x.shape[-1]:
            return torch.nn.functional.linear(x, self.rowmajor, self.bias)
        if self.wide is not None and x.numel() >= self.wide_rows * x.shape[-1]:
            return packed_matmul(x.float(), self.wide, self.wide_bias).to(x.dtype)
        return packed_matmul(x, self.packed, self.bias)


class PackedLinear(nn.Module):
    """y = x @ Wᵀ + b with W held in oneDNN's layout (an opaque tensor: not a parameter, not in the
    state dict, no autograd). Built from an nn.Linear, whose weight it replaces."""

    def __init__(self, linear: nn.Linear, wide_rows: int = 0, narrow_rows: int = 0, int4_rows: int = 0,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_packed = PackedWeight(linear.weight, linear.bias, wide_rows, narrow_rows, int4_rows, dtype)
        bias = self.weight_packed.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.weight_packed.bias = self.bias  # one tensor: the module's parameter is the one multiplied

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return self.weight_packed.matmul(x)

    def extra_repr(self) -> str:
        w = self.weight_packed
        return (f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"
                + (f", fp32 from {w.wide_rows} rows" if w.wide_rows else "")
                + (f", row-major below {w.narrow_rows} rows" if w.narrow_rows else "")
                + (f", int4 codes below {w.int4_rows} rows" if w.int4_rows else ""))


SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # Llama-family: one input each


class SharedInput:
    """Sibling linears of one input as one packed matmul. Not a module: its FusedProjections are."""

    def __init__(self, linears: list[nn.Linear], wide_rows: int = 0, narrow_rows: int = 0,
                 int4_rows: int = 0, dtype: torch.dtype | None = None):
        self.sizes = [lin.out_features for lin in linears]
        biases = [lin.bias for lin in linears]
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.weight_packed = PackedWeight(torch.cat([lin.weight.detach() for lin in linears]), bias,
                                          wide_rows, narrow_rows, int4_rows, dtype)
        self._state: tuple = (None, (), frozenset())  # (input, its outputs, siblings served)

    def project(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Sibling i's output for x: [..., in] -> [..., sizes[i]] (a view of the shared output).
        Invariant: equals sibling i's own linear on x; a new input object computes afresh (the held
        reference keeps the old one alive, so `is` cannot be fooled by a reused address). The state is
        read and replaced as one tuple: a concurrent caller can only cause a recomputation."""
        held, outs, served = self._state
        if held is not x or i in served:
            out = self.weight_packed.matmul(x)
            held, outs, served = x, out.split(self.sizes, dim=-1), frozenset()
        served = served | {i}
        # every sibling served: let go of the input and the output
        self._state = (None, (), frozenset()) if len(served) == len(self.sizes) else (held, outs, served)
        return outs[i]


class FusedProjection(nn.Module):
    """Stands in for one sibling linear (same in/out features); the matmul is its SharedInput's."""

    def __init__(self, shared: SharedInput, index: int, in_features: int):
        super().__init__()
        self.shared, self.index = shared, index
        self.in_features, self.out_features = in_features, shared.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.project(x, self.index)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fused={self.index}"


def pack_linears(model: nn.Module, wide_rows: int = 0, narrow_rows: int = 0, int4_rows: int = 0,
                 dtype: torch.dtype | None = None) -> int:
    """Swap every CPU nn.Linear of `model` for a PackedLinear in place (siblings of one input for
    FusedProjections); returns how many. A tied lm_head gets its own packed copy (the embedding keeps
    its weight). wide_rows > 0: bf16 weights also packed in fp32 for inputs of that many rows or more
    (PackedWeight); narrow_rows > 0: the row-major weight kept for inputs of fewer rows; int4_rows >
    0: weights on a 4-bit grid also held as codes for inputs of fewer rows. dtype: the packed weights
    cast to it after their codes were taken (load_target: an fp32 checkpoint on a 4-bit grid, run in
    bf16); the model's other parameters are the caller's to cast. No-op without oneDNN."""
    if not packing_available():
        return 0
    fused = fuse_siblings(model, wide_rows, narrow_rows, int4_rows, dtype)
    return fused + swap_linears(
        model, lambda lin: PackedLinear(lin, wide_rows, narrow_rows, int4_rows, dtype)
        if lin.weight.device.type == "cpu" else lin)


def fuse_siblings(model: nn.Module, wide_rows: int = 0, narrow_rows: int = 0, int4_rows: int = 0,
                  dtype: torch.dtype | None = None) -> int:
    """Each module holding a SIBLINGS group as CPU nn.Linears of one dtype and in_features gets
    FusedProjections in their place; returns how many linears were replaced."""
    fused = 0
    for parent in list(model.modules()):
        for names in SIBLINGS:
            linears = [getattr(parent, n, None) for n in names]
            if not all(type(lin) is nn.Linear and lin.weight.device.type == "cpu" for lin in linears):
                continue
            if len({(lin.in_features, lin.weight.dtype, lin.bias is None) for lin in linears}) != 1:
                continue
            shared = SharedInput(linears, wide_rows, narrow_rows, int4_rows, dtype)
            for i, (name, lin) in enumerate(zip(names, linears)):
                setattr(parent, name, FusedProjection(shared, i, lin.in_features))
            fused += len(names)
    return fused


def int4_weight_count(model: nn.Module) -> int:
    """How many of `model`'s packed weights hold 4-bit codes (a fused group counts once)."""
    weights = {id(w): w for m in model.modules() for w in [_packed_weight(m)] if w is not None}
    return sum(w.int4 is not None for w in weights.values())


def _packed_weight(module: nn.Module) -> PackedWeight | None:
    if isinstance(module, PackedLinear):
        return module.weight_packed
    return module.shared.weight_packed if isinstance(module, FusedProjection) else None


def swap_linears(model: nn.Module, swap) -> int:
    """Replace every nn.Linear of `model`, in place, by swap(linear) (which may hand the layer back
    unchanged); returns how many were replaced."""
    linears = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    swapped = 0
    for parent, name, child in linears:
        new = swap(child)
        if new is not child:
            setattr(parent, name, new)
            swapped += 1
    return swapped
