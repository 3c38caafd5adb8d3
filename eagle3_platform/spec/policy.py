"""How many draft tokens a batched step verifies per sequence: k in 0..k_max (0 = plain decoding).

A step over B sequences with draft size k costs c(B, k) seconds (drafting + one verify forward over
about B·(k+1) tokens) and emits B·(1 + a(k)) tokens, a(k) = mean accepted draft tokens per sequence.
On a CPU a 5-token verify costs about one decode at B = 1 but several at B = 8, so the best k falls
as the batch grows. The policy picks the k with the most tokens per second,  (1 + a(k)) / c(B, k)·B.
This is what SGLang users tune by hand with --speculative-num-draft-tokens, chosen per step here.

Acceptance and depth: a draft is cut where the head doubts it (min_draft_prob) and a cap k only
limits how deep it may go, so a step is charged for the depth its drafts reached, not for k. Per depth
d, each conditional on the parent: r_d = P(a draft that reached depth d-1 goes on to d), h_d = P(a
depth-d token is accepted | its parent was and it was drafted). Then g_d = P(d tokens accepted) =
prod over j <= d of r_j·h_j (never above the parent's), and a(k) = g_1 + ... + g_k. Why conditional:
P(2 accepted) moves with the workload (a chat turn ~0.01, code ~0.5 for the demo head) mostly through
g_1, which every drafting step measures, while h_2 is measured only where it matters (steps whose depth
1 was accepted, mostly code), so a re-measure at k + 1 during code moves it where it matters. Before
(unconditional g_d), one chat request wrote depths 2-4 off and the policy stayed at k = 1 at batch 1
through the code requests that followed: 0.80x of plain decoding's decode time where a fixed cap of 4
gave 0.73x; conditional, 0.74x (demo head, 36 held-out prompts one at a time, 1 thread, session 15).
(Means that age, so one fresh re-measure replaces a stale value, were tried and dropped: at batch 1
one step is one coin flip, and the choice followed the flips down to plain decoding.) Each is a
running mean that starts from one optimistic pseudo-step (1.0) and averages its first 1/EMA updates,
so one unlucky early step cannot write a depth off for good.
Cost: per batch-size bucket (1, 2, 3-4, 5-8, 9-16, ...; neighbouring sizes cost about the same per
sequence), a running least-squares line  c/B = c0 + c1·m  in the deepest draft m of the step's rows
(drafting runs that many forwards of the head and the verify is padded to the widest row). A cap k is
predicted to reach E[m] = sum over d <= k of P(some of the B rows drafts depth d). Every step refines
the line of its bucket, whatever its k, so wall-time noise averages out over all steps instead of one
cell per k, and the cost of a k never measured in the bucket is predicted rather than paid for.
Plain decoding (k = 0) is judged by its own steps: a bucket measures one as soon as its line is ready,
and from then on k = 0 is always a candidate, predicted by the running mean of its plain steps rather
than read off the line. (It used to wait for the bucket's first re-measure, explore_every steps after
the choice last changed: at batch 2 on 2 cores the first 62 steps walked over sizes 4, 3, 2, 1, each
slower than plain decoding, before plain decoding was measured at all; s41/c2trace.py.) Plain
decoding runs no head at all, so the first depth costs more than the next ones (the head's forward,
its catch-up, a verify of twice the tokens): a line through all the steps put plain decoding above its
cost, and since each further depth paid on that line, the walk down one size at a time could stall
at 1-4. At batch 8 on 2 cores (Locust, c = 8, 60 s) the policy spent 203 of 370 steps at
k = 1 before it reached 0, which its final line put 13% faster.
A plain step of one or two rows still verifies their prompt-lookup matches (lookup.py, batch.py): no
head forward, so it is timed as plain decoding, off the line, and the lookup tokens it accepted are
credited to k = 0: rate(0) = (1 + a0) / c0, a0 a running mean per plain step and row. Drafts are
rated with the tokens their own lookup branch adds; before, plain steps with a match were not timed
and k = 0 was worth one token, which favoured drafting wherever the request's text repeats. Since a0
moves with the text, in such a bucket every third re-measure is of plain decoding, whatever size is
chosen: from k = 4 the walk to it through 3, 2, 1 would not happen (the test's weak head without it:
23-100% of the last 200 steps still drafting in 3 of 6 seeds, against 0.5-7.5% with it).
Plain decoding's mean forgets per step of its bucket, as the line does, not per plain step: a plain
step that comes after g steps of drafting weighs 1 - (1 - EMA)^g. Where drafting is the choice, plain
steps are re-measures up to MAX_EXPLORE_GAP steps apart, and this box's speed drifts up to 2x within
minutes (the same 24 requests through the baseline worker: 53 s, then 90 s; s31/loop2.py), as does a
step's cost from one request's context length to the next. A plain mean that moved 10% per plain step
kept a cost measured in a slow minute for thousands of steps: with the machine 3x slower for its first
80 steps and plain decoding 16% faster per token, 7 of 10 seeded runs stayed on drafts (the test).
A plain step counts at most PLAIN_STALL times that mean, on the line too: a single stalled step
(seen in 2 of 8 cold cells at batch 8: 264 ms against ~27, cause not found: no realloc, no GC in
it) took the mean from 3.3 to 6.3 ms a sequence, the policy went to drafts at ~2x a plain step's
cost for ~1.4x its tokens, and, measuring no plain step while drafting, stayed there ~110 steps
(that cell 133 tok/s, the others 152-180; ~/.cache/eagle3-runs/s54/episodes.py). Clipped, a real
slowdown is still followed, at up to 5% a plain step. A stalled draft step is not clipped: it can
only push the choice toward plain decoding, and a re-measure brings it back.
Exploration: a bucket seen for the first time starts from the best k of the nearest measured bucket
(k_max on the very first step), then, while the drafts' depth has not varied there, a neighbouring
size, which gives the line a second point; a size is only chosen within one of the sizes measured in
its bucket, so the range widens step by step, and never above what the nearest smaller bucket chose
(DraftSizePolicy.cap: more rows never draft more than fewer rows found worth it). A neighbour of the best k is measured again after
`explore_every` steps of a bucket, so the choice follows the load and the acceptance. A neighbour
predicted more than CLOSE_RATE slower doubles the wait before the next re-measure (up to
MAX_EXPLORE_GAP steps); a change of choice resets it. Why back off: where one size
clearly wins (plain decoding at batch 8 on 2 cores) every re-measure is a step at a losing size plus
the head's catch-up over the steps it skipped, ~10% of throughput at a fixed 1 in 16
(scripts/bench_batch.py); where sizes are close, a re-measure costs little and keeps the line honest.
A k is only left for one predicted to be `SWITCH_MARGIN` faster (no flapping on noise).
Drafting after plain steps also pays the head's catch-up: the steps decoded without a draft are
appended to every row's draft KV before it drafts again (batch.py times it apart from the step, so the
line and the plain mean compare steady states). It is measured at each first draft after plain steps
(with the prompts of the rows that joined meanwhile, which that draft appends too) and reported,
not charged to a size's rate: with the cpu head on 2 cores it was ~10 ms a return at batch 2 and
5-7 ms at batch 1 (s41/c2trace2.py), ~1.5% of a step, and a charge spread over explore_every steps
kept the policy on plain decoding after a long plain stretch (whose return carries a long backlog,
once) when a draft had become 4-5% faster.
It sets how often re-measures come instead. At batch 8 on 2 cores (demo head, 8 closed-loop clients;
~/.cache/eagle3-runs/s52/trace2.py) a re-measure of k = 1 from plain decoding took 54-67 ms against
a 25 ms plain step, most of it the head catching up on eight rows' plain steps and on the prompts of
the rows that joined meanwhile, and re-measures came every ~14 steps (a line within a few % of plain
decoding flipped the choice, and a new choice re-measures soon): ~10% of the time. Each re-measure's
cost beyond what the incumbent takes for as many tokens, its catch-up included, is averaged per
(bucket, incumbent) in incumbent steps, and the next re-measure waits at least that over
EXPLORE_BUDGET (3%: one worth two plain steps comes every ~70 steps, one that costs nothing at the
base rate). (Since session 56 a catch-up appends only the newest entries of a backlog, drafter.py's
RESUME_WINDOW and PROMPT_WINDOW, so both costs below are smaller than the figures here, measured before.)
New requests' prompts are charged: a row's first draft appends its whole prompt to the head's KV
(~5-8 ms for a chat prompt), which drafting pays once per request and plain decoding never. Per
bucket, while drafting goes on, each prompt caught up is spread over the drafting steps since the
previous one, per sequence, in a running mean (forgetting per step, as plain's) added to every draft
size's cost: at batch 1 a 64-token request spreads one prompt over ~45 steps (~1% of a step); at
batch 8 one joins every ~8 steps (~3%), which turns a 1-token draft even with plain decoding in step
cost into a loss. The prompts a return from plain decoding appends are that return's catch-up, not
a sample of the charge: spread over the plain stretch they missed every request that joined and
finished undrafted in it (8 prompts over 200 steps at batch 8 read 0.32x the steady charge), and
the mean, which forgets per step, took that value whole, right where the choice to return is made.
(Spread over single steps instead, the mean swung 0.7-1.4x between joins.)
Both, measured together (~/.cache/eagle3-runs/s52/inproc2.py: the server's worker in process, demo
head, C closed-loop clients, 4 rounds of 20 s cells, the modes rotated in one process), output tok/s
against the baseline engine's, before -> after: C = 8 0.902x -> 0.982x, C = 2 0.975x -> 0.966x, C = 1
1.061x -> 1.144x; the head forced to plain decoding (a row alone still verifying its lookup match)
1.014x, 1.038x, 1.178x: with this head the policy still drafts where it should not, less often.
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
        drafting more, and exploring it costs them. The server's worker in process (demo head, fp32, 2
        cores, the report's prompts, 4 warm-up requests, then 20 s cells at C = 1, 2, 4, 8; 3 rounds,
        ~/.cache/eagle3-runs/s59/sweep_cap.py): drafted steps at C = 4-8 1-1.5% with the cap, 2-8%
        without; output tok/s against the baseline server 1.153 / 0.967 / 0.855 / 1.082 with it,
        1.118 / 0.975 / 0.855 / 0.968 without (cells spread ±10-15%)."""
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
