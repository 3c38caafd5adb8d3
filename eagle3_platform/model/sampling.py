"""Choosing the target's next token from its logits: the greedy choice and the sampling distribution.

Regeneration's decode loop, the head's training targets and the engine's verification all choose
tokens the same way, so they share this module (docs/ARCHITECTURE.md §2).
"""
from __future__ import annotations

import torch


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] argmax (the first index of the maximum, as argmax). Through max(): torch's
    bf16 argmax is ~6x slower on CPU, and max() needs no fp32 copy (1 thread, bf16 x 49152:
    5 rows 0.84 / 0.16 / 0.14 ms argmax / fp32 argmax / max; 1024 rows 176 / 119 / 31 ms)."""
    return logits.max(dim=-1).indices


def target_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[..., V] logits -> fp32 probabilities at `temperature` (> 0); the same p the baseline samples."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(p: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=gen))
