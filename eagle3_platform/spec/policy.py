"""How many draft tokens a batched step verifies per sequence: k in 0..k_max (0 = plain decoding).

A step over B sequences with draft size k costs c(B, k) seconds (drafting + one verify forward over
about B·(k+1) tokens) and emits B·(1 + a(k)) tokens, a(k) = mean accepted draft tokens per sequence.
On a CPU a 5-token verify costs about one decode at B = 1 but several at B = 8, so the best k falls
as the batch grows. The policy keeps running means of c(B, k) (measured wall time of whole steps) and
of g_d = P(a sequence's draft token at depth d is accepted), learnt from every step whose draft
reached depth d, so a(k) = g_1 + ... + g_k is monotone in k and shared across k and B. It picks the
k with the most tokens per second:  B·(1 + a(k)) / c(B, k).
This is what SGLang users tune by hand with --speculative-num-draft-tokens, chosen per step here.

Costs are kept per batch-size bucket (1, 2, 3-4, 5-8, 9-16, ...): neighbouring sizes cost about the
same per sequence, and a batch that drains row by row would otherwise re-explore at every size.
Exploration: a (bucket, k) never measured is tried first (each once); then every `explore_every`
steps a neighbour of the best k is measured again, so the choice follows the load and the acceptance.
"""
from __future__ import annotations

from collections import Counter

EMA = 0.2  # weight of a new measurement in the running means


class DraftSizePolicy:
    def __init__(self, k_max: int, explore_every: int = 16):
        self.k_max, self.explore_every = k_max, explore_every
        self.cost: dict[tuple[int, int], float] = {}  # (B bucket, k) -> seconds per step and sequence
        self.depth_accept: dict[int, float] = {}  # d -> P(depth-d draft token accepted)
        self.hist: Counter = Counter()  # k -> steps
        self.current: int | None = None
        self._steps = 0

    def choose(self, batch_size: int) -> int:
        self._steps += 1
        untried = [k for k in range(self.k_max + 1) if (_bucket(batch_size), k) not in self.cost]
        if untried:
            k = untried[-1]  # largest first: acceptance is learnt from full drafts
        else:
            k = self.best(batch_size)
            if self._steps % self.explore_every == 0:  # re-measure a neighbour, alternating sides
                side = 1 if (self._steps // self.explore_every) % 2 else -1
                k = min(self.k_max, max(0, k + side))
        self.current = k
        return k

    def accepted(self, k: int) -> float:
        """a(k): expected accepted draft tokens per sequence at draft size k (unknown depths: 1)."""
        return sum(self.depth_accept.get(d, 1.0) for d in range(1, k + 1))

    def best(self, batch_size: int, cost: dict | None = None) -> int:
        b, cost = _bucket(batch_size), self.cost if cost is None else cost
        rates = {k: (1 + self.accepted(k)) / cost[b, k]  # x B: the same B for every k
                 for k in range(self.k_max + 1) if (b, k) in cost}
        return max(rates, key=rates.get) if rates else self.k_max

    def observe(self, batch_size: int, k: int, seconds: float, accepted: list[int]) -> None:
        """One finished step at draft size k: its wall time and each sequence's accepted draft tokens."""
        self.hist[k] += 1
        _update(self.cost, (_bucket(batch_size), k), seconds / batch_size)  # per sequence
        for d in range(1, k + 1) if accepted else ():
            _update(self.depth_accept, d, sum(a >= d for a in accepted) / len(accepted))

    def info(self) -> dict:
        """For /server_info: the current choice, steps per draft size, the best k per batch size."""
        # snapshots (dict() copies in one C call): the engine thread updates these while a server
        # thread reads them
        hist, accept, cost = dict(self.hist), dict(self.depth_accept), dict(self.cost)
        return {"draft_size_current": self.current,
                "draft_size_hist": {str(k): n for k, n in sorted(hist.items())},
                "draft_size_by_batch": {str(b): self.best(b, cost) for b in sorted({b for b, _ in cost})},
                "accept_rate_by_depth": {str(d): round(g, 3) for d, g in sorted(accept.items())}}


def _bucket(batch_size: int) -> int:
    """The power of two at or above batch_size."""
    return 1 << (batch_size - 1).bit_length()


def _update(means: dict, key, value: float) -> None:
    means[key] = value if key not in means else (1 - EMA) * means[key] + EMA * value
