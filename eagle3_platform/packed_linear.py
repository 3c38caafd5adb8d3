"""Linear layers on oneDNN's packed weight layout, for inference on CPU.

torch's CPU `linear` reads a row-major weight at 7-30 GB/s for the few rows of a decode step or a
verify; the same weight reordered once into oneDNN's blocked layout reads at 20-57 GB/s (bf16, 2
threads, the shapes of SmolLM2-135M: 1.2-3x per call). Whole model, bf16, 2 threads, 300 cached
tokens: a decode step 44.3 -> 29.0 ms, batch 8 58.7 -> 42.1 ms, with logits bitwise equal to the
row-major ones in that check. It changes the kernel, not the dtype (fp32 accumulation either way), and
every path runs on it alike: plain decoding and EAGLE-3, the servers, the losslessness tests.
This is the pair of ops torch's own compiler emits for frozen CPU linears; here it needs no compile.
"""
from __future__ import annotations

import torch
from torch import nn


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    """y = x @ Wᵀ + b with W held in oneDNN's layout (an opaque tensor: not a parameter, not in the
    state dict, no autograd). Built from an nn.Linear, whose weight it replaces."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def pack_linears(model: nn.Module) -> int:
    """Swap every CPU nn.Linear of `model` for a PackedLinear in place; returns how many. A tied
    lm_head gets its own packed copy (the embedding keeps its weight). No-op without oneDNN."""
    if not packing_available():
        return 0
    return swap_linears(model, lambda lin: PackedLinear(lin) if lin.weight.device.type == "cpu" else lin)


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
