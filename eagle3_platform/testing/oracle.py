"""A drafter that proposes from a known continuation (tests; upper-bound measurements).

Given the sequence the target will produce (e.g. its greedy output), it drafts trees whose correct
chain is `correct_depth(step)` tokens long, with a wrong sibling placed before or after the correct
child on every level and wrong tokens below the correct chain — so verification exercises full
acceptance, rejection of a first child with acceptance of a later sibling, and early rejection.
"""
from __future__ import annotations

import random

import torch

from eagle3_platform.spec.tree import Tree


class OracleDrafter:
    def __init__(self, continuation: list[int], vocab_size: int, depth: int, seed: int = 0,
                 siblings: bool = True, always_correct: bool = False):
        self.cont, self.vocab, self.depth = list(continuation), vocab_size, depth
        self.rng = random.Random(seed)
        self.siblings, self.always_correct = siblings, always_correct
        self.known = 0  # generated tokens seen so far (the pending root included)

    def prefill(self, aux, next_tokens) -> None:
        self.known = 1  # next_tokens ends with the first generated token

    def commit(self, aux, next_tokens) -> None:
        self.known += int(next_tokens.numel())  # accepted tokens + bonus

    def _wrong(self, right: int) -> int:
        return (right + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab

    def propose(self, root: int, max_tokens: int | None = None) -> Tree:
        """max_tokens: keep the first draft nodes only (parents precede children: still a tree)."""
        tree = self._propose(root)
        if max_tokens is None or len(tree) <= max_tokens + 1:
            return tree
        return Tree(tree.tokens[:max_tokens + 1], tree.parents[:max_tokens + 1])

    def _propose(self, root: int) -> Tree:
        truth = self.cont[self.known:self.known + self.depth]
        good = len(truth) if self.always_correct else self.rng.randint(0, len(truth))
        tokens, parents, node = [root], [-1], 0
        for level in range(self.depth):
            right = truth[level] if level < good else None
            tok = right if right is not None else self._wrong(truth[level] if level < len(truth) else 0)
            kids = [tok] + ([self._wrong(tok)] if self.siblings else [])
            if self.rng.random() < 0.5:
                kids.reverse()  # the correct child is not always tried first
            for t in kids:
                tokens.append(t)
                parents.append(node)
            node = len(tokens) - len(kids) + kids.index(tok)  # continue below the (would-be) right one
        return Tree(torch.tensor(tokens), torch.tensor(parents))
