"""How many draft tokens a batched step verifies per sequence: k in 0..k_max (0 = plain decoding).

A step over B sequences with draft size k costs c(B, k) seconds (drafting + one verify forward over
about B·(k+1) tokens) and emits B·(1 + a(k)) tokens, a(k) = mean accepted draft tokens per sequence.
On a CPU a 5-token verify costs about one decode at B = 1 but several at B = 8, so the best k falls
as the batch grows. The policy keeps running means of c(B, k) (measured wall time of whole steps) and
a(k), and picks the k with the most tokens per second:  B·(1 + a(k)) / c(B, k).
This is what SGLang users tune by hand with --speculative-num-draft-tokens, chosen per step here.

Exploration: a (B, k) never measured is tried first (each once); then every `explore_every` steps a
neighbour of the best k is measured again, so the choice follows the load and the acceptance.
"""
from __future__ import annotations

from collections import Counter

EMA = 0.2  # weight of a new measurement in the running means


class DraftSizePolicy:
    def __init__(self, k_max: int, explore_every: int = 16):
        self.k_max, self.explore_every = k_max, explore_every
        self.cost: dict[tuple[int, int], float] = {}  # (B, k) -> seconds per step
        self.accepted: dict[int, float] = {0: 0.0}  # k -> mean accepted draft tokens per sequence
        self.hist: Counter = Counter()  # k -> steps
        self.current: int | None = None
        self._steps = 0

    def choose(self, batch_size: int) -> int:
        self._steps += 1
        untried = [k for k in range(self.k_max + 1) if (batch_size, k) not in self.cost]
        if untried:
            k = untried[-1]  # largest first: acceptance is learnt from full drafts
        else:
            k = self.best(batch_size)
            if self._steps % self.explore_every == 0:  # re-measure a neighbour, alternating sides
                side = 1 if (self._steps // self.explore_every) % 2 else -1
                k = min(self.k_max, max(0, k + side))
        self.current = k
        return k

    def best(self, batch_size: int) -> int:
        rates = {k: batch_size * (1 + self.accepted.get(k, k)) / self.cost[batch_size, k]
                 for k in range(self.k_max + 1) if (batch_size, k) in self.cost}
        return max(rates, key=rates.get) if rates else self.k_max

    def observe(self, batch_size: int, k: int, seconds: float, accepted: list[int]) -> None:
        """One finished step: its wall time and each sequence's accepted draft tokens."""
        self.hist[k] += 1
        key = (batch_size, k)
        self.cost[key] = seconds if key not in self.cost else (1 - EMA) * self.cost[key] + EMA * seconds
        if k > 0 and accepted:
            mean = sum(accepted) / len(accepted)
            self.accepted[k] = mean if k not in self.accepted else (1 - EMA) * self.accepted[k] + EMA * mean

    def info(self) -> dict:
        """For /server_info: the current choice, steps per draft size, the best k per batch size."""
        sizes = sorted({b for b, _ in self.cost})
        return {"draft_size_current": self.current,
                "draft_size_hist": {str(k): n for k, n in sorted(self.hist.items())},
                "draft_size_by_batch": {str(b): self.best(b) for b in sizes},
                "accepted_per_draft_size": {str(k): round(a, 3) for k, a in sorted(self.accepted.items())}}
