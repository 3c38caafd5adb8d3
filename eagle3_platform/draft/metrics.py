"""Acceptance metrics: the ONE implementation shared by training eval, the engine and the report."""
from __future__ import annotations

from collections.abc import Sequence


def simulated_acceptance(acc: Sequence[float]) -> float:
    """Expected accepted length of a chain draft, bonus token included: 1 + Σ_k Π_{i≤k} acc_i.

    acc[k] is the top-1 accuracy of TTT step k (conditioned, as in training, on the ground-truth prefix),
    so Π_{i≤k} acc_i approximates P(first k+1 draft tokens all accepted). The leading 1 is the bonus
    token the target always contributes per verify step — the same convention as acceptance_length()."""
    total, run = 1.0, 1.0
    for a in acc:
        if not 0.0 <= float(a) <= 1.0:
            raise ValueError(f"accuracy {a!r} outside [0, 1]")
        run *= float(a)
        total += run
    return total


def acceptance_length(generated_tokens: float, verify_steps: float) -> float | None:
    """τ = generated tokens / verify steps (includes the bonus token; SGLang's definition).
    None when nothing was verified yet (τ is undefined there, not 0)."""
    if generated_tokens < 0 or verify_steps < 0:
        raise ValueError("generated_tokens and verify_steps must be non-negative")
    return generated_tokens / verify_steps if verify_steps else None
