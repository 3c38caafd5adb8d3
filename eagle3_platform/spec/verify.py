"""Verification of a draft tree against the target's logits from ONE forward over all nodes.

Both rules walk down from the root; each returns (path, bonus): `path` = accepted node ids starting
with the root (0), `bonus` = the token the target contributes after the last accepted node. The
tokens emitted by a verify step are tokens[path[1:]] + [bonus] (τ counts all of them).
"""
from __future__ import annotations

import torch

from eagle3_platform.model.sampling import greedy, sample, target_probs
from eagle3_platform.spec.tree import Tree


def verify_greedy(tree: Tree, logits: torch.Tensor) -> tuple[list[int], int]:
    """logits [N,V] (row i = target's next-token logits after node i's path).

    Invariant (losslessness): a node is accepted iff its token equals the target's argmax after its
    parent's path, so every emitted token is exactly what greedy decoding of the target would emit
    at that position; the bonus is the argmax after the accepted path. Hence greedy speculative output
    equals the target's greedy decoding token for token, whatever the draft proposes.
    """
    best = greedy(logits).tolist()  # [N] target greedy token after each node
    tokens, kids = tree.tokens.tolist(), tree.children()
    path = [0]
    while True:
        node = path[-1]
        nxt = next((c for c in kids[node] if tokens[c] == best[node]), None)
        if nxt is None:
            return path, best[node]
        path.append(nxt)


def verify_sampling(tree: Tree, logits: torch.Tensor, temperature: float,
                    gen: torch.Generator | None, min_mass: float = 1e-12) -> tuple[list[int], int]:
    """Tree speculative sampling: multi-candidate recursive rejection sampling (SpecInfer-style), with
    the draft's candidates treated as deterministic proposals (q = point mass), as in SGLang's
    `tree_speculative_sampling_target_only`.

    At a node with target distribution p and children c_1..c_k (distinct tokens, chosen by the draft
    without looking at the acceptance randomness): accept c_i with probability min(1, p(c_i)/q(c_i)) =
    p(c_i); on rejection the residual is norm(max(0, p - q)) = p with c_i zeroed, renormalised, and
    the next sibling is tried against it; if every child is rejected the bonus is drawn from the final
    residual. Invariant (distribution preservation): this is sequential sampling from p — "is it c_1?
    if not, from p | not c_1, is it c_2? ..." — so each emitted token is an exact draw from the
    target's distribution given the accepted prefix, whatever the draft proposes.
    """
    probs = target_probs(logits, temperature)  # [N,V]
    u = torch.rand(len(tree), generator=gen, dtype=torch.float64).tolist()  # one uniform per candidate
    tokens, kids = tree.tokens.tolist(), tree.children()
    path = [0]
    while True:
        node, accepted = path[-1], None
        p, mass, rejected = probs[node], 1.0, []  # residual = p with rejected tokens zeroed; mass = its sum
        for c in kids[node]:
            pc = float(p[tokens[c]])
            if u[c] * mass < pc:  # u < residual(c) / mass: accept c
                accepted = c
                break
            rejected.append(tokens[c])
            mass -= pc
        if accepted is None:
            return path, _sample_residual(p, rejected, mass, min_mass, gen)
        path.append(accepted)


def _sample_residual(p: torch.Tensor, rejected: list[int], mass: float, min_mass: float,
                     gen: torch.Generator | None) -> int:
    """Bonus token from p with the rejected tokens removed (multinomial renormalises)."""
    if not rejected or mass <= min_mass:  # mass ~0 is only reachable through rounding
        return sample(p, gen)
    residual = p.clone()
    residual[rejected] = 0.0
    # the rejected siblings may hold all of p's support while fp32 rounding leaves `mass` a few 1e-8
    # above zero: an all-zero residual is that same unreachable case (multinomial would raise)
    return sample(residual if float(residual.sum()) > 0 else p, gen)
