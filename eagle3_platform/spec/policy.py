"""How many draft tokens a batched step verifies per sequence: k in 0..k_max (0 = plain decoding).

A step over B sequences with draft size k costs c(B, k) seconds (drafting + one verify forward over
about B·(k+1) tokens) and emits B·(1 + a(k)) tokens, a(k) = mean accepted draft tokens per sequence.
On a CPU a 5-token verify costs about one decode at B = 1 but several at B = 8, so the best k falls
as the batch grows. The policy picks, per step, the k with the most tokens per second,
(1 + a(k)) / c(B, k)·B: what SGLang users tune by hand with --speculative-num-draft-tokens.

Acceptance: per depth d, r_d = P(a draft that reached d-1 goes on to d) and h_d = P(a depth-d token is
accepted | its parent was), so a(k) = sum over d <= k of prod over j <= d of r_j·h_j. Conditional
rates keep one chat request (low acceptance) from writing off the depths that code requests use.
Each is a running mean that starts from one optimistic pseudo-step, so one unlucky early step cannot
write a depth off for good.

Cost: per batch-size bucket (powers of two), a running least-squares line c/B = c0 + c1·m in the
deepest draft m of the step; every step refines it, so the cost of an unmeasured k is predicted, not
paid for. Plain decoding (no head at all, so off the line) has its own running mean, is always a
candidate once measured, and is credited with the prompt-lookup tokens its plain steps accept. One
stalled plain step counts at most PLAIN_STALL times that mean; the head's catch-up after plain steps
and new requests' prompts are charged to drafting, not to a size's line.

Exploration: a new bucket starts from the nearest measured bucket's choice and widens one size at a
time, never above what a smaller bucket chose (cap). A neighbour of the best k is re-measured every
`explore_every` steps, backing off (up to MAX_EXPLORE_GAP) where it is clearly worse and keeping
re-measures within EXPLORE_BUDGET of the time; a k is left only for one SWITCH_MARGIN faster.
Invariants: 0 <= k <= cap(bucket) <= k_max, and once a bucket has timed a plain step plain decoding
is always a candidate there, so a head that does not pay on this machine and load is not used.
"""
from __future__ import annotations

import math
from collections import Counter

EMA = 0.1  # weight of a new step in the running means (acceptance and the cost lines)
SWITCH_MARGIN = 0.02  # leave the current k only for a predicted gain above 2%
MAX_EXPLORE_GAP = 256  # steps of a bucket between re-measures once its choice has held for a while
CLOSE_RATE = 0.1  # a neighbour predicted within 10% of the best is re-measured at the base rate
EXPLORE_BUDGET = 0.03  # re-measures may cost at most this share of a bucket's time (catch-up included)
PLAIN_STALL = 1.5  # a plain step is counted at most this times plain decoding's running cost


class CostLine:
    """Exponentially weighted least squares of y = c0 + c1·m (y: seconds per step and sequence, m: the
    step's deepest draft)."""

    def __init__(self):
        self.n = 0
        self.mk = self.my = self.skk = self.sky = 0.0

    def add(self, k: float, y: float) -> None:
        if self.n == 0:
            self.mk, self.my = float(k), y
        else:  # exponentially weighted mean and (co)variance, West's incremental form
            dk, dy = k - self.mk, y - self.my
            self.mk += EMA * dk
            self.my += EMA * dy
            self.skk = (1 - EMA) * (self.skk + EMA * dk * dk)
            self.sky = (1 - EMA) * (self.sky + EMA * dk * dy)
        self.n += 1

    @property
    def ready(self) -> bool:
        return self.skk > 0  # two different depths seen (all equal: skk stays exactly 0)

    def coef(self) -> tuple[float, float]:
        """(c0, c1); c1 >= 0: a longer draft never costs less (a negative slope is noise)."""
        c1 = max(0.0, self.sky / self.skk) if self.ready else 0.0
        return max(self.my - c1 * self.mk, 1e-9), c1

    def predict(self, k: float) -> float:
        c0, c1 = self.coef()
        return c0 + c1 * k


class DraftSizePolicy:
    def __init__(self, k_max: int, explore_every: int = 16):
        self.k_max, self.explore_every = k_max, explore_every
        self.lines: dict[int, CostLine] = {}  # B bucket -> per-sequence cost line in the depth drafted
        self.plain: dict[int, float] = {}  # B bucket -> running mean cost per sequence of a plain step
        self.plain_accepted: dict[int, float] = {}  # B bucket -> ... lookup tokens a plain step accepted
        self._plain_lookups: set[int] = set()  # B buckets whose plain steps verified a lookup match
        self.caps: dict[int, tuple[int, int]] = {}  # B bucket -> (lowest, highest) draft size chosen there
        self.depth_drafted: dict[int, float] = {}  # d -> r_d = P(draft reaches d | it reached d-1)
        self.depth_accept: dict[int, float] = {}  # d -> h_d = P(depth d accepted | parent was, drafted)
        self.hist: Counter = Counter()  # k -> steps
        self.current: int | None = None
        self._incumbent: dict[int, int] = {}  # B bucket -> its chosen k (re-measures aside)
        self._updates: Counter = Counter()  # (r|h, d) -> updates so far
        self._steps: Counter = Counter()  # B bucket -> steps chosen for it
        self._gap: dict[int, int] = {}  # B bucket -> steps between its re-measures
        self._next_explore: dict[int, int] = {}  # B bucket -> its step count at the next re-measure
        self._re_measures: Counter = Counter()  # B bucket -> neighbours re-measured so far
        self._plain_at: dict[int, int] = {}  # B bucket -> its step count at its last plain step
        self.catch_up: dict[int, float] = {}  # B bucket -> running mean seconds of a first draft's catch-up
        self.prompt_charge: dict[int, float] = {}  # B bucket -> seconds per step and sequence the head
        # spends on new requests' prompts while drafting (running mean per step of the bucket)
        self._since_prompt: dict[int, int] = {}  # B bucket -> drafting steps since its last prompt catch-up
        self._pending: dict[int, int] = {}  # B bucket -> the k its last choice re-measures
        self.explore_cost: dict[tuple[int, int], float] = {}  # (B bucket, incumbent k) -> what re-measuring
        # away from it cost, in the incumbent's steps (running mean)
        self._last_k: int | None = None  # the draft size of the last observed step (any batch size)

    def choose(self, batch_size: int) -> int:
        b = _bucket(batch_size)
        self._steps[b] += 1
        line = self.lines.get(b)
        if line is None:  # a new bucket: what its nearest measured neighbour does best
            k = self._nearest_best(b)
        elif not line.ready:  # one depth measured here: a neighbouring size gives a second point
            lo, hi = self.caps[b]
            if lo > 0:
                k = lo - 1
            elif hi == 0:  # plain decoding only, so far
                k = min(1, self.k_max)
            else:  # drafts were asked for here, yet none reached depth 1 (the head never confident
                # enough, no lookup match): plain decoding, a draft now and then until one is made
                k = min(1, self.k_max) if self._steps[b] % self.explore_every == 0 else 0
        else:
            k = self._best_or_re_measure(b, batch_size)
        self.current = k = min(k, self.cap(b))
        return k

    def cap(self, b: int) -> int:
        """The largest draft size bucket b may choose: the choice of the nearest smaller bucket that has
        made one (k_max where none has). A verify's cost per sequence only grows with the batch while
        acceptance does not, so where fewer rows decode plainly (or draft k), more rows gain nothing from
        drafting more, and exploring it costs them."""
        smaller = [s for s in list(self._incumbent) if s < b]
        return self._incumbent[max(smaller)] if smaller else self.k_max

    def _best_or_re_measure(self, b: int, batch_size: int) -> int:
        if b not in self.plain:  # what every size must beat: measured before a choice is trusted
            return 0
        k, n = self.best(batch_size), self._steps[b]
        if k != self._incumbent.get(b):  # a new choice: re-measure its neighbours soon
            self._incumbent[b], self._gap[b] = k, self.explore_every
            self._next_explore[b] = n + self._explore_gap(b, k)
        if n < self._next_explore[b]:
            return k
        self._re_measures[b] += 1
        side = 1 if self._re_measures[b] % 2 else -1  # alternate sides, the longer draft first
        side = 1 if k == 0 else -1 if k == self.k_max else side  # at an end: its one neighbour
        other, rates = min(self.cap(b), max(0, k + side)), self.rates(batch_size)
        if k >= 2 and b in self._plain_lookups and self._re_measures[b] % 3 == 0:
            other = 0  # plain decoding's worth moves with its lookup matches: a neighbour of every size
        if rates.get(other, 0.0) < rates[k] * (1 - CLOSE_RATE):  # clearly worse: wait longer next time
            self._gap[b] = min(2 * self._gap[b], MAX_EXPLORE_GAP)
        self._next_explore[b] = n + self._explore_gap(b, k)
        self._pending[b] = other
        return other

    def _explore_gap(self, b: int, k: int) -> int:
        """Steps to the next re-measure of bucket b's neighbours of k: its back-off gap, and at least
        what keeps re-measures within EXPLORE_BUDGET of the time at what they cost away from k."""
        budget = math.ceil(self.explore_cost.get((b, k), 0.0) / EXPLORE_BUDGET)
        return min(max(self._gap[b], budget), MAX_EXPLORE_GAP)

    def accepted(self, k: int) -> float:
        """a(k): expected accepted draft tokens per sequence at draft size k (unknown depths: 1)."""
        total, g = 0.0, 1.0
        for d in range(1, k + 1):
            g *= self.depth_drafted.get(d, 1.0) * self.depth_accept.get(d, 1.0)  # g_d
            total += g
        return total

    def depth(self, k: int, batch_size: int) -> float:
        """E[m]: the deepest draft of batch_size rows at draft size k (rows independent)."""
        total, reach = 0.0, 1.0
        for d in range(1, k + 1):
            reach *= self.depth_drafted.get(d, 1.0)  # P(one row drafts depth d)
            total += 1 - (1 - reach) ** batch_size  # P(some row does)
        return total

    def rates(self, batch_size: int, lines: dict | None = None,
              plain: dict | None = None) -> dict[int, float]:
        """k -> predicted tokens per second and sequence in batch_size's bucket ({} if unmeasured), for
        the sizes measured there and one beyond either end: the line interpolates, it is not trusted
        far outside what it saw (the verify cost turns convex once a batch's tokens fill the cores).
        lines/plain: snapshots to read instead of the live tables (a server thread)."""
        b = _bucket(batch_size)
        line = (self.lines if lines is None else lines).get(b)
        if line is None or not line.ready:
            return {}
        lo, hi = self.caps[b]
        cost = {k: line.predict(self.depth(k, batch_size))
                for k in range(max(0, lo - 1), min(self.cap(b), hi + 1) + 1)}
        plain_cost = (self.plain if plain is None else plain).get(b)
        charge = self.prompt_charge.get(b, 0.0)  # what drafting spends on new prompts, per step
        cost = {k: c + (charge if k else 0.0) for k, c in cost.items()}
        if plain_cost is not None:  # measured, so always a candidate: no walk down to it
            cost[0] = plain_cost
        a0 = self.plain_accepted.get(b, 0.0)  # what a plain step's lookup matches added (1-2 rows)
        return {k: (1 + (self.accepted(k) if k else a0)) / c for k, c in sorted(cost.items())}

    def best(self, batch_size: int, lines: dict | None = None, plain: dict | None = None) -> int:
        rates = self.rates(batch_size, lines, plain)
        if not rates:
            return self.cap(_bucket(batch_size))
        k = max(rates, key=rates.get)
        kept = self._incumbent.get(_bucket(batch_size))  # not a candidate once the cap fell below it
        if kept in rates and rates[k] <= rates[kept] * (1 + SWITCH_MARGIN):
            return kept
        return k

    def observe(self, batch_size: int, k: int, seconds: float | None, accepted: list[int],
                drafted: list[int] | None = None, catch_up_s: float = 0.0,
                prompt_catch_up_s: float = 0.0) -> None:
        """One finished step at draft size k: its wall time (without the head's catch-up; None where
        the step did other work too, e.g. carried prompt chunks: then acceptance and the catch-up are
        learnt, not cost), each sequence's accepted draft tokens, the depth its draft reached (None: k
        for every row, a draft never cut short) and the seconds its drafters spent before drafting on
        the steps decoded plainly since they last drafted (Batch.resume_catch_up_s), and before drafting
        for the first time on their prompts (the rest of Batch.catch_up_s)."""
        drafted = [k] * len(accepted) if drafted is None else drafted
        b = _bucket(batch_size)
        if self._pending.pop(b, None) == k:  # the re-measure chosen for this bucket, away from its incumbent
            self._re_measured(b, self._incumbent[b], batch_size, seconds, accepted,
                              catch_up_s + prompt_catch_up_s)
        if k > 0 and self._last_k == 0:  # the first draft after plain steps: what returning to drafts
            # cost, the prompts of the rows that joined meanwhile included (timed before the forward)
            prev, x = self.catch_up.get(b), catch_up_s + prompt_catch_up_s
            self.catch_up[b] = x if prev is None else prev + EMA * (x - prev)
            self._since_prompt[b] = 0
        elif k > 0:  # drafting goes on: a new row's prompt, spread over the drafting steps since the last
            self._since_prompt[b] = gap = self._since_prompt.get(b, 0) + 1
            if prompt_catch_up_s > 0:
                prev, w = self.prompt_charge.get(b, 0.0), _per_step_weight(gap)
                self.prompt_charge[b] = prev + w * (prompt_catch_up_s / gap / batch_size - prev)
                self._since_prompt[b] = 0
        self._last_k = k
        self.hist[k] += 1
        if seconds is not None:
            self._observe_cost(b, k, seconds / batch_size, drafted, accepted)
        for d in range(1, k + 1):
            parents = [m for m in drafted if m >= d - 1]  # drafts that reached depth d-1
            if not parents:
                break
            self._update(self.depth_drafted, "r", d, sum(m >= d for m in parents) / len(parents))
            tried = [a for a, m in zip(accepted, drafted) if a >= d - 1 and m >= d]  # parent accepted
            if tried:
                self._update(self.depth_accept, "h", d, sum(a >= d for a in tried) / len(tried))

    def _re_measured(self, b: int, incumbent: int, batch_size: int, seconds: float | None,
                     accepted: list[int], catch_up_s: float) -> None:
        """What a re-measure away from `incumbent` cost, in the incumbent's steps: its catch-up and the
        time its step took beyond what the incumbent takes for as many tokens (a mean of the first
        1/EMA, then running: one re-measure that caught up on eight prompts does not set it alone)."""
        rate = self.rates(batch_size).get(incumbent)
        if not rate:
            return
        tokens = 1 + (self.accepted(incumbent) if incumbent else self.plain_accepted.get(b, 0.0))
        step = batch_size * tokens / rate  # seconds of one incumbent step (rate: the batch's tokens/s)
        extra = catch_up_s + (0.0 if seconds is None else seconds - (batch_size + sum(accepted)) / rate)
        self._update(self.explore_cost, "explore", (b, incumbent), max(0.0, extra) / step, prior=None)

    def _observe_cost(self, b: int, k: int, y: float, drafted: list[int], accepted: list[int]) -> None:
        """A step's seconds per sequence y at draft size k in bucket b: the sizes timed (the line's
        range), the cost line, plain's mean (cost and the lookup tokens it accepted)."""
        lo, hi = self.caps.get(b, (k, k))
        self.caps[b] = (min(lo, k), max(hi, k))
        m = max(drafted, default=0)
        if k == 0 and b in self.plain:  # one stalled plain step counts as a slow one, no more
            y = min(y, PLAIN_STALL * self.plain[b])
        if k > 0 or m == 0:  # a plain step that verified a lookup match ran no head: off the line
            self.lines.setdefault(b, CostLine()).add(m, y)
        if k == 0:  # the mean forgets per step of the bucket, as the line does, not per plain step
            gap = max(1, self._steps[b] - self._plain_at.get(b, 0))  # >= 1: an observe without a choose
            prev, w = self.plain.get(b), _per_step_weight(gap)
            self.plain[b] = y if prev is None else prev + w * (y - prev)
            self._plain_at[b] = self._steps[b]
            # what its lookup match added: a property of the text, not the machine, and 0-8 tokens
            # from one step to the next, so a running mean per plain step (one re-measure after a
            # long drafted stretch must not replace it), its first 1/EMA steps weighing alike
            if m:
                self._plain_lookups.add(b)
            self._update(self.plain_accepted, "a0", b, sum(accepted) / max(len(accepted), 1), prior=None)

    def _update(self, means: dict, kind: str, key: int, x: float, prior: float | None = 1.0) -> None:
        """means[key] <- x: the mean of a pseudo-step at `prior` (None: none) and the first 1/EMA
        updates, then an exponential running mean."""
        self._updates[kind, key] += 1
        n = self._updates[kind, key] + (prior is not None)
        mean = means.get(key, 0.0 if prior is None else prior)
        means[key] = mean + (x - mean) * max(EMA, 1 / n)

    def info(self) -> dict:
        """For /server_info: the current choice, steps per draft size, per batch-size bucket the best k,
        the cost line (ms per step and sequence: intercept, and per depth of the deepest draft) and
        plain decoding's measured cost, and per depth how often a draft reached it and its token was
        accepted."""
        # snapshots (dict() copies in one C call): the engine thread updates these while a server
        # thread reads them
        hist, accept, reach = dict(self.hist), dict(self.depth_accept), dict(self.depth_drafted)
        lines = {b: line for b, line in dict(self.lines).items() if line.ready}
        plain, gaps, catch_up = dict(self.plain), dict(self._gap), dict(self.catch_up)
        explore, charge = dict(self.explore_cost), dict(self.prompt_charge)
        return {"draft_size_current": self.current,
                "draft_size_hist": {str(k): n for k, n in sorted(hist.items())},
                "draft_size_by_batch": {str(b): self.best(b, lines, plain) for b in sorted(lines)},
                "step_cost_ms_by_batch": {str(b): [round(1e3 * c, 3) for c in lines[b].coef()]
                                          for b in sorted(lines)},
                "plain_step_ms_by_batch": {str(b): round(1e3 * c, 3) for b, c in sorted(plain.items())},
                "plain_step_lookup_tokens_by_batch": {str(b): round(a, 3) for b, a
                                                      in sorted(dict(self.plain_accepted).items())},
                "catch_up_ms_by_batch": {str(b): round(1e3 * c, 3) for b, c in sorted(catch_up.items())},
                "prompt_catch_up_ms_by_batch": {str(b): round(1e3 * c, 3) for b, c in sorted(charge.items())},
                "drafted_rate_by_depth": {str(d): round(p, 3) for d, p in sorted(reach.items())},
                "accept_rate_by_depth": {str(d): round(q, 3) for d, q in sorted(accept.items())},
                "re_measure_gap_by_batch": {str(b): g for b, g in sorted(gaps.items())},
                "re_measure_cost_steps": {f"{b}:{k}": round(c, 3) for (b, k), c in sorted(explore.items())}}

    def _nearest_best(self, bucket: int) -> int:
        measured = [b for b, line in self.lines.items() if line.ready]
        if not measured:
            return self.k_max  # the very first steps: full drafts teach every depth's acceptance
        nearest = min(measured, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))
        return self.best(nearest)


def policy_step(policy: DraftSizePolicy | None, batch,
                draft_size: int | None = None) -> tuple[int | None, list]:
    """One step of `batch`'s running rows at the draft size `policy` chooses for their number, the
    policy then told what it cost and accepted (observe_step); without a policy, at `draft_size`
    (Batch.step's cap). -> (the size, the step's (request, tokens) rows). A server's worker does the
    same around steps that may carry prompt chunks (serve/worker.py)."""
    k = policy.choose(len(batch.rows)) if policy is not None else draft_size
    rows = batch.step(k)
    if policy is not None:
        observe_step(policy, batch, k, rows)
    return k, rows


def observe_step(policy: DraftSizePolicy, batch, k: int, rows: list, timed: bool = True) -> None:
    """Tell `policy` what the step `batch` just ran at draft size k cost and accepted, as a server
    does: rows = the (request, tokens) of its running rows; timed=False where the step did other
    work too (it carried prompt chunks): then acceptance and the catch-up are learnt, not cost."""
    policy.observe(len(rows), k, batch.step_s if timed else None,
                   [r.last_accepted for r, _ in rows], [r.last_drafted for r, _ in rows],
                   batch.resume_catch_up_s, batch.catch_up_s - batch.resume_catch_up_s)


def _per_step_weight(gap: int) -> float:
    """The weight of a value that stands for `gap` steps of a bucket in a mean that forgets EMA per step."""
    return 1 - (1 - EMA) ** gap


def _bucket(batch_size: int) -> int:
    """The power of two at or above batch_size."""
    return 1 << (batch_size - 1).bit_length()
