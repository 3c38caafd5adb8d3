"""The server's per-step draft size: tokens per second from measured step cost and acceptance."""
from __future__ import annotations

import random

import pytest

from eagle3_platform.spec.policy import CostLine, DraftSizePolicy


def _simulate(policy, batch_size, cost, accept_depth, steps=200, noise=0.0, seed=0):
    """Drive the policy with a synthetic machine: cost(k) seconds per step (times a uniform noise
    factor in 1 ± noise), every sequence accepts `accept_depth` draft tokens when the draft is that
    long. -> the draft sizes chosen."""
    rng, chosen = random.Random(seed), []
    for _ in range(steps):
        k = policy.choose(batch_size)
        seconds = cost(k) * (1 + noise * (2 * rng.random() - 1))
        policy.observe(batch_size, k, seconds, [min(k, accept_depth)] * batch_size)
        chosen.append(k)
    return chosen


def test_first_steps_draft_fully_then_the_fastest_size_is_kept():
    p = DraftSizePolicy(k_max=4)
    assert [p.choose(1) for _ in range(1)] == [4]  # full drafts first: every depth's acceptance
    # verification nearly free (a CPU at batch 1) and the head good for 3 tokens: draft 3
    chosen = _simulate(DraftSizePolicy(4), 1, lambda k: 0.030 + 0.001 * k, accept_depth=3)
    assert chosen[:2] == [4, 3] and chosen[-1] == 3 and chosen[-50:].count(3) >= 45
    # verification expensive (a big batch) and a weak head: plain decoding
    chosen = _simulate(DraftSizePolicy(4), 16, lambda k: 0.100 * (1 + 1.5 * k), accept_depth=1)
    assert chosen[-1] == 0 and chosen[-50:].count(0) >= 45


def test_the_cost_line_fits_noisy_steps():
    line, rng = CostLine(), random.Random(1)
    assert not line.ready
    for i in range(400):
        k = i % 3
        line.add(k, (0.010 + 0.004 * k) * (1 + 0.2 * (2 * rng.random() - 1)))
    c0, c1 = line.coef()
    assert line.ready and abs(c0 - 0.010) < 0.0015 and abs(c1 - 0.004) < 0.0015
    flat = CostLine()
    for k, y in [(0, 0.02), (1, 0.019)]:  # a longer draft measured cheaper: noise, not a discount
        flat.add(k, y)
    assert flat.coef()[1] == 0.0


def test_noise_does_not_make_the_choice_flap():
    """± 15 % wall-time noise on every step, two sizes within 1 % of each other and one clearly
    worse: the policy settles on a good size and stays there (apart from its periodic re-measures)."""
    p = DraftSizePolicy(k_max=2, explore_every=16)
    accept = {0: 0.0, 1: 0.5, 2: 0.5}
    rate = {0: 1.0, 1: 1.005, 2: 0.8}  # tokens/s relative to plain decoding
    cost = {k: (1 + accept[k]) / rate[k] * 0.03 for k in rate}
    chosen = _simulate(p, 4, cost.get, accept_depth=1, steps=400, noise=0.15)
    tail = chosen[-160:]
    assert tail.count(2) <= 10  # the slow size only as an occasional neighbour re-measure
    switches = sum(a != b for a, b in zip(tail, tail[1:]))
    assert switches <= 30  # re-measures come and go (≤ 2 switches each per 16 steps), no flapping


def test_acceptance_is_learnt_per_depth_and_reported():
    p = DraftSizePolicy(k_max=4)
    p.observe(2, 4, 0.05, [0, 2])  # one sequence accepted nothing, the other 2 tokens
    # one optimistic pseudo-step (1.0) + this step: a single step cannot write a depth off. Each depth
    # is conditional on its parent: depth 2 and 3 were tried by the second row only, depth 4 by none
    assert p.depth_accept == {1: 0.75, 2: 1.0, 3: 0.5} and p.depth_drafted == {d: 1.0 for d in range(1, 5)}
    for _ in range(60):
        p.observe(2, 4, 0.05, [0, 2])
    assert abs(p.depth_accept[1] - 0.5) < 0.02 and abs(p.depth_accept[3]) < 0.02
    assert abs(p.accepted(2) - 1.0) < 0.04 and abs(p.accepted(4) - 1.0) < 0.08
    p.observe(2, 3, 0.04, [0, 2])
    info = p.info()
    assert info["draft_size_hist"] == {"3": 1, "4": 61} and info["accept_rate_by_depth"]["1"] < 0.52
    assert list(info["draft_size_by_batch"]) == ["2"]
    c0_ms, c1_ms = info["step_cost_ms_by_batch"]["2"]
    assert abs(c1_ms - 5.0) < 1e-3 and abs(c0_ms - 5.0) < 1e-3  # 20 ms/seq at k=3, 25 at k=4


def test_a_deeper_token_is_expected_only_after_its_parent():
    p = DraftSizePolicy(k_max=3)
    p.depth_accept = {1: 0.2, 2: 0.6}  # depth 2 accepted in 60% of the steps whose depth 1 was; 3 unknown
    p.depth_drafted = {1: 1.0, 2: 0.5}  # half the drafts stop at depth 1
    assert abs(p.accepted(3) - (0.2 + 0.2 * 0.5 * 0.6 * (1 + 1))) < 1e-9  # g_3 = g_2 · (1 · 1)
    assert abs(p.depth(2, 1) - 1.5) < 1e-9 and abs(p.depth(2, 4) - (1 + 1 - 0.5 ** 4)) < 1e-9


def test_a_neighbour_is_re_measured_so_the_choice_follows_the_machine():
    p = DraftSizePolicy(k_max=4, explore_every=4)
    cost = {k: 0.03 for k in range(5)}
    _simulate(p, 1, cost.get, accept_depth=4, steps=20)
    assert p.best(1) == 4
    cost.update({k: 0.03 * (1 + 2 * k) for k in range(5)})  # the machine got busy: drafts became dear
    chosen = _simulate(p, 1, cost.get, accept_depth=4, steps=200)
    assert p.best(1) == 0 and chosen[-40:].count(0) >= 30  # the rest: re-measures of k = 1


def test_re_measures_back_off_while_the_choice_holds_and_resume_when_it_changes():
    """Plain decoding clearly best at batch 8 (a 2-core CPU): the periodic re-measure of k = 1 is a
    losing step each time, so its period doubles (16, 32, ... 256 steps); when the choice changes the
    re-measures come every 16 steps again."""
    p = DraftSizePolicy(k_max=4, explore_every=16)
    cost = lambda k: 0.04 * (1 + 1.5 * k)  # noqa: E731  (a 1-token draft: 2 tokens for 2.5x the cost)
    chosen = _simulate(p, 8, cost, accept_depth=1, steps=1200)
    assert p.best(8) == 0
    assert chosen[-600:].count(0) >= 597  # at most 3 re-measures, not 600 / 16 = 37
    assert p.info()["re_measure_gap_by_batch"] == {"8": 256}
    # drafting became cheap (the batch shrank, the machine got quiet): back to short gaps, k follows
    chosen = _simulate(p, 8, lambda k: 0.04 * (1 + 0.02 * k), accept_depth=4, steps=400)
    assert p.best(8) >= 2 and chosen[-100:].count(p.best(8)) >= 80
    assert p.info()["re_measure_gap_by_batch"]["8"] <= 256


def test_a_new_batch_size_starts_from_its_neighbours_choice_not_a_full_draft():
    """The first steps at batch 16 must not verify 16 full drafts (5x the tokens of a decode step)
    when batch 8 already showed that plain decoding wins."""
    p = DraftSizePolicy(k_max=4)
    _simulate(p, 8, lambda k: 0.09 * (1 + 1.5 * k), accept_depth=1, steps=60)
    assert p.best(8) == 0
    first = _simulate(p, 16, lambda k: 0.19 * (1 + 1.5 * k), accept_depth=1, steps=20)
    assert first == [0] * 20  # batch 8 decodes plainly: more rows never draft (the cap)
    assert p.choose(3) == 0  # bucket 4: nearest measured is 8 (or 1/2 if they were), not k_max


def test_more_rows_never_draft_more_than_fewer_rows_chose():
    """The cap: batch 1 settled on plain decoding (a weak head), so batch 2 decodes plainly too, even
    on a machine where its drafts would look cheap, and re-measures nothing; once batch 1 chooses to
    draft 2, batch 2 may explore up to 2 and no further."""
    p = DraftSizePolicy(k_max=4)
    _simulate(p, 1, lambda k: 0.03 * (1 + 1.5 * k), accept_depth=0, steps=60)
    assert p.best(1) == 0 and p.cap(2) == 0 and p.cap(1) == 4
    assert _simulate(p, 2, lambda k: 0.04 + 0.001 * k, accept_depth=4, steps=80) == [0] * 80
    p._incumbent[1] = 2  # batch 1's choice moved up (its own re-measures would do this)
    later = _simulate(p, 2, lambda k: 0.04 + 0.001 * k, accept_depth=4, steps=80)
    assert max(later) == 2 and later[-20:].count(2) >= 18 and p.cap(4) == 2
    p._incumbent[1] = 0  # batch 1 back to plain decoding: batch 2's choice of 2 is above its cap now
    assert _simulate(p, 2, lambda k: 0.04 + 0.001 * k, accept_depth=4, steps=20) == [0] * 20
    assert p.best(2) == 0 and p.info()["draft_size_by_batch"]["2"] == 0


def test_a_size_far_outside_the_measured_ones_is_not_chosen_on_extrapolation():
    """Sizes 0 and 1 measured at a batch of 4 on a line that would make 4 look best (cheap drafts, an
    optimistic prior for the unmeasured depths): the policy climbs one size at a time, measuring as it
    goes, and stops where the real (convex) cost says."""
    p = DraftSizePolicy(k_max=4)
    real = {0: 0.040, 1: 0.044, 2: 0.060, 3: 0.090, 4: 0.130}  # verification fills the cores from k = 2
    for k in (0, 1):
        p.observe(4, k, real[k], [min(k, 1)] * 4)  # depth 1 always accepted
    assert set(p.rates(4)) == {0, 1, 2}  # 3 and 4 are not predicted from a line through 0 and 1
    chosen = _simulate(p, 4, real.get, accept_depth=1, steps=100)
    assert chosen[-30:].count(1) >= 25 and chosen.count(4) <= 3


def _simulate_cut(policy, batch_size, cost, reach, accept, steps, seed=0):
    """Drafts cut short as a confident-only head cuts them: a row's draft goes one depth deeper with
    probability `reach` (at most k deep), each drafted token is accepted after its parent with
    probability `accept`; a step costs cost(deepest draft of the batch). -> the draft sizes chosen."""
    rng, chosen = random.Random(seed), []
    for _ in range(steps):
        k = policy.choose(batch_size)
        drafted = [next((d for d in range(k) if rng.random() >= reach), k) for _ in range(batch_size)]
        accepted = [next((d for d in range(m) if rng.random() >= accept), m) for m in drafted]
        policy.observe(batch_size, k, cost(max(drafted)), accepted, drafted)
        chosen.append(k)
    return chosen


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_plain_step_is_credited_with_the_lookup_tokens_it_verified(seed):
    """Batch 1, a weak head: a draft of 4 gives ~1.25 tokens for ~1.2 decode steps (4% more than one
    token a step), while a plain step that verifies the request's own lookup match gives ~1.64 tokens
    for 1.05 steps (no head forward, a slightly wider verify). Credited with what its matches add (and
    kept off the drafts' cost line, which they would flatten), plain decoding wins."""
    p, rng, chosen = DraftSizePolicy(k_max=4), random.Random(seed), []
    for _ in range(400):
        k = p.choose(1)
        if k:
            drafted = [next((d for d in range(k) if rng.random() >= 0.5), k)]
            accepted = [next((d for d in range(drafted[0]) if rng.random() >= 0.4), drafted[0])]
            cost = 0.030 * (1.15 + 0.05 * drafted[0])
        else:  # a lookup match of 1-4 tokens; the first 40% right, each next one 60%
            drafted = [rng.choice([1, 2, 4])]
            accepted = [next((d for d in range(drafted[0]) if rng.random() >= (0.4 if d == 0 else 0.6)),
                             drafted[0])]
            cost = 0.030 * 1.05
        p.observe(1, k, cost * rng.uniform(0.95, 1.05), accepted, drafted)
        chosen.append(k)
    assert chosen[-200:].count(0) >= 170
    info = p.info()
    assert 0.3 < info["plain_step_lookup_tokens_by_batch"]["1"] < 1.0  # 0.64 on average
    assert abs(info["plain_step_ms_by_batch"]["1"] - 31.5) < 1.5


def test_a_draft_size_is_charged_for_the_depth_drafted_so_a_chat_turn_does_not_pin_it_low():
    """Batch 1, a head forward 10% of a decode step. A chat request first: the head rarely drafts
    past depth 1 and is often wrong, so deep caps gain little, but they cost little either (the drafts
    are cut, not the cap). Then code: deep drafts, mostly right; the best size is the largest. The
    policy must get there, not stay at k = 1 because depths 2-4 looked useless during the chat turn."""
    p = DraftSizePolicy(k_max=4)
    cost = lambda m: 0.030 * (1 + 0.1 * m)  # noqa: E731
    _simulate_cut(p, 1, cost, reach=0.3, accept=0.3, steps=60)
    chosen = _simulate_cut(p, 1, cost, reach=0.9, accept=0.85, steps=100, seed=1)
    assert chosen[-50:].count(4) >= 40
    info = p.info()
    assert info["drafted_rate_by_depth"]["1"] > 0.7 and info["accept_rate_by_depth"]["1"] > 0.7
    assert info["step_cost_ms_by_batch"]["1"][1] > 1.0  # ~3 ms per depth, learnt from the drafts' spread


@pytest.mark.parametrize("seed", [0, 1, 3])
def test_plain_decoding_is_judged_by_its_own_steps_not_a_line_through_drafted_ones(seed):
    """Batch 8, the first depth dear and the next ones cheap (the head's forward and a verify of twice
    the tokens come with any draft): plain decoding is 18% faster than a 1-token draft, while on the
    drafted steps' line each further depth pays. A line through all the steps put plain decoding above
    its cost and the choice stayed at 1-4 (the policy before this test); measured on its own, plain
    decoding wins within the first 150 steps."""
    p = DraftSizePolicy(k_max=4)
    rng = random.Random(seed)
    cost = lambda m: 0.08 * (1 + (0.5 + 0.1 * m if m else 0)) * rng.uniform(0.9, 1.1)  # noqa: E731
    chosen = _simulate_cut(p, 8, cost, reach=0.9, accept=0.4, steps=300, seed=seed)
    assert chosen[:150].count(0) >= 90 and chosen[-100:].count(0) >= 95
    assert abs(p.info()["plain_step_ms_by_batch"]["8"] - 10.0) < 0.5  # 80 ms / 8 sequences


def test_a_cut_draft_costs_its_depth_in_every_row_of_a_batch():
    """Batch 8 where each depth drafted costs 60% of a decode step (the verify fills the cores): the
    deepest row sets the cost (a draft of 1 costs 1.6x for 1.3 tokens), so plain decoding is kept."""
    p = DraftSizePolicy(k_max=4)
    cost = lambda m: 0.08 * (1 + 0.6 * m)  # noqa: E731
    chosen = _simulate_cut(p, 8, cost, reach=0.5, accept=0.6, steps=300)
    r1 = p.depth_drafted[1]  # ~half the rows draft depth 1: nearly every batch of 8 has one that does
    assert 0 < r1 < 1 and abs(p.depth(1, 8) - (1 - (1 - r1) ** 8)) < 1e-9 and p.depth(1, 8) > r1
    assert chosen[-100:].count(0) >= 90


def test_a_head_that_never_drafts_is_not_paid_for_at_every_step():
    """Every draft cut before depth 1 (a head below min_draft_prob, no lookup match): the steps'
    deepest draft is always 0, so the cost line never gets a slope. After its first walk down the
    policy decodes plainly, drafting only every explore_every-th step; once a draft reaches depth 1
    the line has its second point and the usual choice takes over."""
    p = DraftSizePolicy(k_max=4, explore_every=16)
    chosen = _simulate_cut(p, 1, lambda m: 0.03 * (1 + 0.1 * m), reach=0.0, accept=0.0, steps=200)
    assert chosen[:5] == [4, 3, 2, 1, 0]
    assert chosen[-160:].count(0) >= 150 and 0 < chosen[-160:].count(1) <= 10
    # the head turns confident (code): drafts reach depth 1 and deeper; drafting takes over
    chosen = _simulate_cut(p, 1, lambda m: 0.03 * (1 + 0.1 * m), reach=0.9, accept=0.9, steps=200, seed=1)
    assert chosen[-50:].count(0) <= 5


@pytest.mark.parametrize("seed", [0, 3, 5])
def test_a_plain_cost_measured_while_the_machine_was_slow_is_forgotten(seed):
    """The machine 3x slower for the first 80 steps (a noisy neighbour, or a long context), then
    steady; plain decoding 16% faster per token than any draft of this weak head. The first plain steps
    come while the machine is slow, and while the optimistic first acceptance keeps the policy drafting,
    plain decoding is re-measured only every 16-256 steps: its remembered cost must follow the machine
    as the drafts' line does, not move 10% per re-measure (which kept the slow cost for thousands of
    steps: the policy stayed on drafts in 7 of 10 seeds)."""
    p, rng, chosen = DraftSizePolicy(k_max=4), random.Random(seed), []
    for i in range(600):
        k = p.choose(1)
        drafted = [next((d for d in range(k) if rng.random() >= 0.9), k)]
        accepted = [next((d for d in range(m) if rng.random() >= 0.2), m) for m in drafted]
        cost = 0.03 * ((1.3 + 0.1 * drafted[0]) if k else 1.0) * (3.0 if i < 80 else 1.0)
        p.observe(1, k, cost * rng.uniform(0.9, 1.1), accepted, drafted)
        chosen.append(k)
    assert chosen[-300:].count(0) >= 270
    assert abs(p.info()["plain_step_ms_by_batch"]["1"] - 30.0) < 3.0


def test_a_new_batch_size_measures_plain_decoding_before_it_trusts_a_choice():
    """Batch 1 drafts fully (verification nearly free); batch 2 arrives where every draft size is
    slower than plain decoding. Plain decoding is measured as soon as batch 2's line is ready (its third
    step), not at its first re-measure after explore_every steps of losing sizes, and then kept."""
    p = DraftSizePolicy(k_max=4, explore_every=16)
    _simulate(p, 1, lambda k: 0.030 + 0.001 * k, accept_depth=4, steps=40)
    assert p.best(1) == 4
    first = _simulate(p, 2, lambda k: 0.044 * (1 + 1.5 * k), accept_depth=1, steps=40)
    assert first[:3] == [4, 3, 0] and first[-20:].count(0) >= 18
    assert "2" in p.info()["plain_step_ms_by_batch"]


def _simulate_switches(policy, cost, catch_up, steps):
    """Batch 2, depth 1 accepted in one row of two, nothing deeper; a draft step after plain ones
    first pays catch_up seconds (timed apart, as batch.py does). -> the draft sizes chosen."""
    chosen = []
    for _ in range(steps):
        k = policy.choose(2)
        after_plain = bool(chosen) and chosen[-1] == 0 and k > 0
        policy.observe(2, k, cost(k), [min(k, 1), 0], [k, k], catch_up if after_plain else 0.0)
        chosen.append(k)
    return chosen


@pytest.mark.parametrize("catch_up", [0.0, 0.08])
def test_the_head_catch_up_after_plain_steps_is_reported_not_charged(catch_up):
    """Plain decoding is the choice (drafts were dear), then a 1-token draft becomes 3.9% faster in
    steady state (2 · 1.5 tokens for 1.444x a plain step); drafting again after plain steps first
    costs the head's catch-up. The policy moves to the draft and stays whatever the catch-up: a return
    after a long plain stretch carries that stretch's backlog once, so spread over the next steps it
    would keep plain decoding where the draft is faster. The catch-up is reported."""
    p = DraftSizePolicy(k_max=4, explore_every=16)
    _simulate_switches(p, lambda k: 0.044 if k == 0 else 0.080 + 0.03 * (k - 1), catch_up, steps=200)
    assert p.best(2) == 0
    cost = lambda k: 0.044 if k == 0 else 0.0635 + 0.03 * (k - 1)  # noqa: E731
    tail = _simulate_switches(p, cost, catch_up, steps=600)[-300:]
    assert tail.count(1) >= 270 and p.best(2) == 1
    assert abs(p.info()["catch_up_ms_by_batch"]["2"] - 1e3 * catch_up) < 1e-6


def test_a_step_that_carried_prompt_chunks_teaches_acceptance_but_not_cost():
    """seconds None (the worker's steps with prompt chunks riding along, whose time is not the draft
    size's): acceptance, the histogram and the catch-up (timed before the forward) are learnt; the
    cost line, the sizes it was timed at and plain decoding's cost are not."""
    p = DraftSizePolicy(k_max=4)
    for _ in range(5):
        p.observe(2, 4, 0.05, [1, 3])
        p.observe(2, 0, 0.03, [0, 0])
    before = (p.info()["step_cost_ms_by_batch"], p.info()["plain_step_ms_by_batch"], dict(p.caps))
    accept, catch_up = dict(p.depth_accept), p.catch_up[2]
    for _ in range(20):
        p.observe(2, 4, None, [4, 4], catch_up_s=1.0)  # a slow step: prompt tokens rode along
        p.observe(2, 0, None, [0, 0])
        p.observe(2, 1, None, [1, 1])  # a size never timed: the line is not stretched to it
    info = p.info()
    assert (info["step_cost_ms_by_batch"], info["plain_step_ms_by_batch"], dict(p.caps)) == before
    assert p.depth_accept[4] > accept[4] and p.catch_up[2] > catch_up
    assert info["draft_size_hist"] == {"0": 25, "1": 20, "4": 25}


@pytest.mark.parametrize("catch_up", [0.0, 0.05])
def test_re_measures_that_pay_a_catch_up_come_as_rarely_as_the_budget_says(catch_up):
    """Batch 8, plain decoding best but a 1-token draft only 7% slower (within CLOSE_RATE, so its
    re-measures do not back off by the rate alone), and every draft after plain steps first pays `catch_up` seconds (the
    head's backlog: two plain steps' worth). Re-measuring k = 1 every 16 steps would spend ~13% of the
    time on catch-ups; the policy spaces them so they cost about EXPLORE_BUDGET (3%) of it, and
    reports what one cost. Without a catch-up they stay at the base rate."""
    p, B = DraftSizePolicy(k_max=4, explore_every=16), 8
    cost = lambda k: 0.025 if k == 0 else 0.0368 * (1 + 0.2 * (k - 1))  # noqa: E731  1.4 tokens a row at k = 1
    chosen = []
    for _ in range(1000):
        k = p.choose(B)
        after_plain = bool(chosen) and chosen[-1] == 0 and k > 0
        p.observe(B, k, cost(k), [min(k, 1) if b < 3 else 0 for b in range(B)], None,
                  catch_up if after_plain else 0.0)
        chosen.append(k)
    tail = chosen[-700:]
    re_measures = sum(a == 0 and b > 0 for a, b in zip(tail, tail[1:]))
    assert p.best(B) == 0
    if catch_up:
        assert re_measures <= 15  # ~700 / 70: a re-measure costs ~2.1 plain steps, 3% of 70 steps
        assert abs(p.info()["re_measure_cost_steps"]["8:0"] - 2.07) < 0.2
    else:
        assert re_measures >= 30  # every 16 steps (the rate is within CLOSE_RATE: no back-off)


@pytest.mark.parametrize("prompt_s", [0.0, 0.02])
def test_drafting_is_charged_what_the_head_spends_on_new_prompts(prompt_s):
    """Batch 8, a new request every 8 steps; a 1-token draft is 5% faster than plain decoding per
    step, but before a row's first draft the head appends its prompt (prompt_s seconds, timed apart
    from the step). Drafting at every step then pays prompt_s / 8 a step (10% of a plain one), so
    plain decoding is faster overall, and the policy sees it; with free prompts it drafts."""
    p, B, waiting, chosen = DraftSizePolicy(k_max=4, explore_every=16), 8, 0, []
    cost = lambda k: 0.025 if k == 0 else 0.0328 * (1 + 0.2 * (k - 1))  # noqa: E731  1.375 tokens a row
    for step in range(1000):
        waiting += step % 8 == 0  # prompts whose rows have not drafted yet
        k = p.choose(B)
        caught_up = prompt_s * waiting if k else 0.0
        waiting = waiting if k == 0 else 0
        p.observe(B, k, cost(k), [min(k, 1) if b < 3 else 0 for b in range(B)], None, 0.0, caught_up)
        chosen.append(k)
    tail = chosen[-300:]
    if prompt_s:
        assert p.best(B) == 0 and tail.count(0) >= 270
        assert abs(p.prompt_charge[8] - prompt_s / 8 / B) < 0.2 * prompt_s / 8 / B  # per step and row
    else:
        assert p.best(B) == 1 and tail.count(1) >= 270


def test_a_return_to_drafting_after_a_plain_stretch_does_not_dilute_the_prompt_charge():
    """Batch 8, a request joins every 8 steps and a row's first draft appends its prompt (prompt_s).
    While drafting goes on that is prompt_s / 8 a step. After 200 plain steps the return to drafting
    appends the prompts of the 8 rows that joined meanwhile and are still running (the others finished
    undrafted): spread over the 200 steps that is 25x too little, and it used to replace the charge
    (0.32x the steady one here, right where the choice to return is made; and spread per step, the
    charge swung to 1.40x after a join). It is what the return cost instead (catch_up), and the
    charge keeps what steady drafting pays."""
    p, B, prompt_s = DraftSizePolicy(k_max=4), 8, 0.02
    steady = prompt_s / 8 / B  # seconds per step and row

    def run(k, steps, step0):
        for step in range(step0, step0 + steps):
            p.choose(B)  # the worker asks first; the test sets the size
            joined = prompt_s if k and step % 8 == 0 else 0.0
            p.observe(B, k, 0.03, [min(k, 1)] + [0] * (B - 1), None, 0.0, joined)

    run(1, 64, 1)
    assert abs(p.prompt_charge[B] - steady) < 0.05 * steady
    run(0, 200, 65)
    p.choose(B)
    p.observe(B, 1, 0.03, [1] + [0] * (B - 1), None, 0.004, B * prompt_s)  # the return
    run(1, 15, 266)
    assert abs(p.prompt_charge[B] - steady) < 0.05 * steady
    assert abs(p.catch_up[B] - (0.004 + B * prompt_s)) < 1e-9  # the return's backlog, its prompts included


@pytest.mark.parametrize("seed", [1, 3, 6])
def test_one_stalled_plain_step_does_not_send_the_policy_to_drafts(seed):
    """Batch 8, plain decoding settled (a 1-token draft costs 1.45x a plain step for ~1.3x its
    tokens); then one plain step stalls at 10x (a server saw 264 ms against ~27). It counts as a slow
    plain step, not as ten: without the clip plain's mean doubled and the policy drafted in 57-82 of
    the next 149 steps, measuring no plain step meanwhile."""
    p, rng, chosen = DraftSizePolicy(k_max=4), random.Random(seed), []
    for i in range(300):
        k = p.choose(8)
        drafted = [next((d for d in range(k) if rng.random() >= 0.6), k) for _ in range(8)]
        accepted = [next((d for d in range(m) if rng.random() >= 0.5), m) for m in drafted]
        m = max(drafted)
        cost = 0.026 * ((1.45 + 0.15 * (m - 1)) if m else 1.0) * rng.uniform(0.93, 1.07)
        if i == 150:
            assert k == 0
            cost *= 10
        p.observe(8, k, cost, accepted, drafted)
        chosen.append(k)
    assert chosen[100:150].count(0) >= 45
    assert chosen[151:].count(0) >= 135
    assert p.info()["plain_step_ms_by_batch"]["8"] < 3.6  # 26 ms / 8 sequences, ±7%
