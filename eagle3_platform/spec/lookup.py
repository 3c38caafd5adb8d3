"""Prompt lookup beside the EAGLE-3 head: an n-gram continuation from the request's own tokens, drafted
as one more branch of the verify tree.

A small target repeats itself and its prompt (code, quoted text, lists), and there the next tokens
are often a copy of what followed the last occurrence of the current n-gram. That costs no forward:
the tail of the sequence (the pending root included) is matched against the earlier tokens, longest
n-gram first (lookup_ngram down to 1), latest occurrence first, and the tokens that followed become
a chain hung under the root. Where its first tokens agree with the head's tree it shares those nodes.
A longer match earns a longer chain, at most 2^(n-1) tokens for an n-token match: the first token
after a 1-token match is right about a fifth of the time, after a 4-token match most of the time,
and every proposed token widens the verify.
Verification is unchanged (verify.py), so output is too: greedy output equals target greedy
decoding whatever either drafter proposes; the branch only adds verify width (in bf16 on CPU, 5 more
query tokens cost about as much as one).

A match also rides the server's plain steps at batch 1 (`plain_step`, batch.py): where the draft-size
policy decodes plainly because the head's forwards do not pay, a copy still costs no forward, and a
verify of a few tokens costs little more than one decode step at batch 1, so any match is verified.
At batch 2 a plain step verifies only matches of 3+ tokens, chains of at most 4: the verify is padded
to the wider row and a wider verify leaves the int4 kernel, so only matches whose copy is mostly
right pay. From 4 rows up an extra verified token costs more than it brings. The policy credits what
plain steps accept to plain decoding (policy.py).

This is the embedded engine's addition (SGLang's EAGLE-3 worker has no lookup branch; its NGRAM
algorithm is a separate drafter), so reports name it apart from the head's own acceptance.
"""
from __future__ import annotations

import torch

from eagle3_platform.draft.answer_ngrams import OWN_MATCH, AnswerNgrams
from eagle3_platform.spec.tree import Tree


PLAIN_STEP_MATCH = 1  # the shortest match a plain step verifies (any match pays at batch 1)
PAIR_STEP_MATCH, PAIR_STEP_TOKENS = 3, 4  # ... of two rows, and the longest chain it verifies there
PLAIN_LOOKUP_ROWS = 2  # plain steps of at most this many rows verify lookup matches


def lookup(history: list[int], max_tokens: int, max_ngram: int) -> list[int]:
    """Tokens that followed the latest earlier occurrence of history's last n tokens (n = max_ngram
    down to 1; the first n that matches wins) -> up to min(max_tokens, 2^(n-1)) ids, [] when nothing
    matches."""
    return lookup_match(history, max_tokens, max_ngram)[0]


def lookup_match(history: list[int], max_tokens: int, max_ngram: int) -> tuple[list[int], int]:
    """lookup's tokens and the length n of the match they follow (0: none)."""
    if max_tokens < 1 or len(history) < 2:
        return [], 0
    seq = torch.tensor(history)
    for n in range(min(max_ngram, len(history) - 1), 0, -1):
        windows = seq[:-1].unfold(0, n, 1)  # [L-n, n]: every n-gram that has a successor in history
        hits = (windows == seq[-n:]).all(dim=1).nonzero()[:, 0]
        if hits.numel():
            start = int(hits[-1]) + n  # the latest occurrence: recent text predicts best
            return history[start:start + min(max_tokens, 2 ** (n - 1))], n
    return [], 0


def graft(tree: Tree, chain: list[int]) -> Tree:
    """tree + chain hung under the root: follows existing nodes while their tokens agree, then appends
    the rest as new nodes (parents precede children, as Tree requires)."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    kids = tree.children()
    node = 0
    for i, tok in enumerate(chain):
        same = next((c for c in kids[node] if tokens[c] == tok), None)
        if same is None:
            for t in chain[i:]:
                tokens.append(t)
                parents.append(node)
                node = len(tokens) - 1
            break
        node = same
    return Tree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


class LookupDrafter:
    """An EAGLE drafter plus a prompt-lookup branch. Keeps the request's tokens (x_1 .. pending root:
    what prefill and commit hand every drafter) and forwards everything else to the head's drafter.
    With `answers` (draft/answer_ngrams.py) and answer_tokens > 0, a plain step of a row alone whose own
    text matches fewer than OWN_MATCH tokens drafts the branch from the target's training answers
    instead, at most answer_tokens of them (SpecConfig.answer_tokens)."""

    def __init__(self, head, max_tokens: int, max_ngram: int, answers: AnswerNgrams | None = None,
                 answer_tokens: int = 0):
        self.head, self.max_tokens, self.max_ngram = head, max_tokens, max_ngram
        self.answers = answers if answer_tokens > 0 else None
        self.answer_tokens = answer_tokens
        self.history: list[int] = []
        self.last_lookup = 0  # tokens the last proposal's lookup branch held

    def prefill(self, aux, next_tokens):
        self.history = next_tokens.tolist()
        self.head.prefill(aux, next_tokens)

    def commit(self, aux, next_tokens):
        self.history += next_tokens.tolist()
        self.head.commit(aux, next_tokens)

    def catch_up(self) -> None:
        self.head.catch_up()

    def propose(self, root: int, max_tokens: int | None = None) -> Tree:
        return self.extend(self.head.propose(root, max_tokens), max_tokens)

    def plain_step(self, tree: Tree, rows: int = 1) -> Tree:
        """tree (a plain step's root) + the lookup branch where the match is long enough for a step of
        `rows` rows (PLAIN_STEP_MATCH alone, PAIR_STEP_MATCH in a pair, whose chain is capped at
        PAIR_STEP_TOKENS), else tree: the copy the head's drafts are not needed for."""
        alone = rows == 1
        cap = self.max_tokens if alone else min(self.max_tokens, PAIR_STEP_TOKENS)
        if alone:
            return self._branch(tree, self._chain(cap, PLAIN_STEP_MATCH))
        chain, n = lookup_match(self.history, cap, self.max_ngram)  # a pair: long own matches only
        return self._branch(tree, chain if n >= PAIR_STEP_MATCH else [])

    def extend(self, tree: Tree, max_tokens: int | None = None) -> Tree:
        """The head's tree + the lookup branch. A server's per-step draft size max_tokens caps each
        branch's depth (the head's tree and the lookup chain alike), so every draft size verifies the
        same two kinds of candidates and the policy's per-depth acceptance (policy.py) holds across
        sizes. (Capping their sum instead, the branch filling what the head left, measured worse:
        bench_batch.py.)"""
        cap = self.max_tokens if max_tokens is None else min(self.max_tokens, max_tokens)
        return self._branch(tree, lookup(self.history, cap, self.max_ngram))

    def _chain(self, cap: int, min_match: int) -> list[int]:
        """A plain step's branch: the request's own continuation after a match of OWN_MATCH+ tokens,
        else the answers' chain where they have one, else the own match if it has min_match+ tokens.
        Only plain steps draft from the answers: beside the head's chain their branch makes the verify
        wider than the 4-row tile of the int4 kernel for no gain, while in place of a plain step's weak
        1-token own match it costs no more width, and one token where there was no match."""
        chain, n = lookup_match(self.history, cap, self.max_ngram)
        if n < OWN_MATCH and self.answers is not None:
            drafted = self.answers.chain(self.history, min(cap, self.answer_tokens))
            if drafted:
                return drafted
        return chain if n >= min_match else []

    def _branch(self, tree: Tree, chain: list[int]) -> Tree:
        """tree + chain grafted under its root (tree itself when chain is empty), counted in last_lookup."""
        self.last_lookup = len(chain)
        return graft(tree, chain) if chain else tree
