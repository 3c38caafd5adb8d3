"""Draft trees as flat parent arrays, their depths and ancestor (attention) matrices.

A tree of N nodes is `tokens` [N] + `parents` [N] with node 0 the root and parents[i] < i (parents
always precede children, so a mask row only ever looks left). The root is the last accepted token: it
is not in the target's KV cache yet, so one verify forward over all N nodes yields the target's
distribution after the root *and* after every drafted node.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tree:
    tokens: torch.Tensor  # [N] int64 target-vocab ids; tokens[0] = root
    parents: torch.Tensor  # [N] int64; parents[0] = -1, parents[i] < i

    def __post_init__(self):
        p = self.parents.tolist()
        if p[0] != -1 or any(not 0 <= q < i for i, q in enumerate(p) if i > 0):
            raise ValueError(f"parents must be topologically ordered with root 0: {p}")

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def children(self) -> list[list[int]]:
        """children[i] = node ids whose parent is i, in node order (= drafting preference order)."""
        kids: list[list[int]] = [[] for _ in range(len(self))]
        for i, q in enumerate(self.parents.tolist()[1:], start=1):
            kids[q].append(i)
        return kids


def root_only(token: int) -> Tree:
    """The degenerate tree of plain decoding: verify just the pending token."""
    return Tree(torch.tensor([token]), torch.tensor([-1]))


def depths(parents: torch.Tensor) -> torch.Tensor:
    """[N] -> [N] depth of each node (root 0)."""
    d = [0] * parents.numel()
    for i, q in enumerate(parents.tolist()[1:], start=1):
        d[i] = d[q] + 1
    return torch.tensor(d, dtype=torch.long)


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """[N] -> bool [N,N]; A[i,j] = node j is node i or one of its ancestors."""
    n = parents.numel()
    anc = torch.eye(n, dtype=torch.bool)
    for i, q in enumerate(parents.tolist()[1:], start=1):
        anc[i] |= anc[q]  # parents precede children, so row q is already complete
    return anc


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask -> additive float mask of the same shape: 0 where attention is allowed, dtype-min
    elsewhere (finite: a fully masked row gives garbage, never NaN)."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def path_to(parents: torch.Tensor, node: int) -> list[int]:
    """Node ids from the root down to `node`, inclusive."""
    p = parents.tolist()
    path = [node]
    while p[path[-1]] != -1:
        path.append(p[path[-1]])
    return path[::-1]
