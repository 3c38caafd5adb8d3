"""The server's per-step draft size: tokens per second from measured step cost and acceptance."""
from __future__ import annotations

from eagle3_platform.spec.policy import DraftSizePolicy


def _simulate(policy, batch_size, cost, accept_depth, steps=200):
    """Drive the policy with a synthetic machine: cost(k) seconds per step, every sequence accepts
    `accept_depth` draft tokens when the draft is that long."""
    for _ in range(steps):
        k = policy.choose(batch_size)
        policy.observe(batch_size, k, cost(k), [min(k, accept_depth)] * batch_size)
    return policy.best(batch_size)


def test_tries_every_size_first_then_keeps_the_fastest():
    p = DraftSizePolicy(k_max=4)
    first = [p.choose(2) for _ in range(1)]
    assert first == [4]  # the largest untried size first
    # verification nearly free (a CPU at batch 1) and the head good for 3 tokens: draft 3
    assert _simulate(DraftSizePolicy(4), 1, lambda k: 0.030 + 0.001 * k, accept_depth=3) == 3
    # verification expensive (a big batch) and a weak head: plain decoding
    assert _simulate(DraftSizePolicy(4), 16, lambda k: 0.100 * (1 + k), accept_depth=1) == 0


def test_acceptance_is_learnt_per_depth_and_reported():
    p = DraftSizePolicy(k_max=4)
    p.observe(2, 4, 0.05, [0, 2])  # one sequence accepted nothing, the other 2 tokens
    assert p.depth_accept == {1: 0.5, 2: 0.5, 3: 0.0, 4: 0.0}
    assert p.accepted(2) == 1.0 and p.accepted(4) == 1.0
    info = p.info()
    assert info["draft_size_hist"] == {"4": 1} and info["accept_rate_by_depth"]["1"] == 0.5
    assert info["draft_size_by_batch"] == {"2": 4}


def test_a_neighbour_is_re_measured_so_the_choice_follows_the_machine():
    p = DraftSizePolicy(k_max=4, explore_every=4)
    cost = {k: 0.03 for k in range(5)}
    _simulate(p, 1, cost.get, accept_depth=4, steps=20)
    assert p.best(1) == 4
    cost.update({2: 0.03, 3: 1.0, 4: 1.0})  # the machine got busy: long verifies became dear
    assert _simulate(p, 1, cost.get, accept_depth=4, steps=200) == 2


def test_neighbouring_batch_sizes_share_costs():
    p = DraftSizePolicy(k_max=2)
    for k in (2, 1, 0):
        assert p.choose(3) == k
        p.observe(3, k, 0.03 * (1 + k), [k] * 3)
    assert p.choose(4) == p.best(3)  # 3 and 4 share a bucket: nothing left to explore
    assert p.choose(5) == 2  # 5-8 is a new bucket
