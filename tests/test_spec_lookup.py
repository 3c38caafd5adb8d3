"""The prompt-lookup branch beside the EAGLE-3 head: n-gram matching, grafting onto the head's tree,
and greedy losslessness alone and in a continuous batch (fp32, tiny target)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from eagle3_platform.spec.config import PRESETS, SpecConfig
from eagle3_platform.spec.engine import SpecEngine
from eagle3_platform.spec import lookup as lookup_module
from eagle3_platform.spec.lookup import LookupDrafter, graft, lookup, lookup_match
from eagle3_platform.spec.tree import Tree
from eagle3_platform.testing.spec import VariedTargetConfig, random_draft, varied_target
from tests.test_spec_batch import LONG, _drive
from tests.test_spec_engine import MAX_NEW, PROMPTS, _ids, hf_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_lookup_takes_the_latest_occurrence_of_the_longest_ngram():
    #          0  1  2  3  4  5  6  7  8  9 10
    history = [5, 6, 7, 1, 9, 6, 7, 2, 3, 6, 7]
    assert lookup(history, 3, max_ngram=2) == [2, 3]  # "6 7" last seen at 5-6, not at 1-2
    assert lookup(history, 2, max_ngram=3) == [2, 3]  # "3 6 7" never occurred before: "6 7" did
    assert lookup([4, 1, 2, 4], 2, max_ngram=3) == [1]  # falls back to a single token
    assert lookup([1, 2, 3], 4, max_ngram=3) == []  # 3 never occurred before
    assert lookup([7], 4, max_ngram=3) == [] and lookup([7, 7], 0, max_ngram=3) == []
    assert lookup([7, 7], 4, max_ngram=3) == [7]


def test_a_longer_match_earns_a_longer_chain():
    """At most 2^(n-1) tokens for an n-token match, and never more than max_tokens or than is known."""
    seq = list(range(10, 20))
    history = seq + [99] + seq[:4]  # the last 4 tokens occurred before, followed by 14..19, 99, ...
    assert lookup(history, 8, max_ngram=4) == [14, 15, 16, 17, 18, 19, 99, 10]  # 4-gram: up to 8
    assert lookup(history, 8, max_ngram=3) == [14, 15, 16, 17]  # 3-gram: up to 4
    assert lookup(history, 8, max_ngram=2) == [14, 15]
    assert lookup(history, 8, max_ngram=1) == [14]
    assert lookup(history, 3, max_ngram=4) == [14, 15, 16]  # the caller's cap first
    assert lookup([1, 2, 3, 9, 1, 2, 3], 8, max_ngram=4) == [9, 1, 2, 3]  # 3-gram, cut at the end


def test_lookup_match_says_how_long_the_match_was():
    seq = list(range(10, 20))
    history = seq + [99] + seq[:4]
    assert lookup_match(history, 8, max_ngram=4) == ([14, 15, 16, 17, 18, 19, 99, 10], 4)
    assert lookup_match(history, 8, max_ngram=2) == ([14, 15], 2)
    assert lookup_match([1, 2, 3], 4, max_ngram=3) == ([], 0)


def test_graft_shares_the_agreeing_prefix_and_appends_the_rest():
    #   root 10 ── 11 ── 12        (the head's chain)
    tree = Tree(torch.tensor([10, 11, 12]), torch.tensor([-1, 0, 1]))
    g = graft(tree, [11, 13, 14])
    assert g.tokens.tolist() == [10, 11, 12, 13, 14] and g.parents.tolist() == [-1, 0, 1, 1, 3]
    g = graft(tree, [20, 21])  # disagrees at once: a second branch under the root
    assert g.tokens.tolist() == [10, 11, 12, 20, 21] and g.parents.tolist() == [-1, 0, 1, 0, 3]
    g = graft(tree, [11, 12])  # already drafted by the head: nothing added
    assert g.tokens.tolist() == [10, 11, 12] and g.parents.tolist() == [-1, 0, 1]
    g = graft(Tree(torch.tensor([10]), torch.tensor([-1])), [1, 2])  # the head drafted nothing
    assert g.tokens.tolist() == [10, 1, 2] and g.parents.tolist() == [-1, 0, 1]


def test_config_rejects_bad_lookup_settings():
    with pytest.raises(ValueError):
        SpecConfig(lookup_tokens=-1)
    with pytest.raises(ValueError):
        SpecConfig(lookup_ngram=0)
    with pytest.raises(ValueError):
        SpecConfig(answer_tokens=-1)


@pytest.fixture(scope="module")
def target(tiny_target):
    """A tiny Llama whose greedy output falls into short loops and leaves them: a 1-token lookup is
    right for 55 of the 80 tokens these prompts generate, wrong for the rest. Its top-2 logits stay
    >= 2e-3 apart along them (no near-tie for fp32 rounding to flip)."""
    return varied_target(tiny_target, VariedTargetConfig(initializer_range=0.06, seed=1))


@pytest.fixture(scope="module")
def refs(target):
    eos = SpecEngine(target, None, PRESETS["baseline"]).eos_ids
    return {p: hf_greedy(target, _ids(target, p), MAX_NEW, eos) for p in PROMPTS + [LONG]}


class CountingLookup(LookupDrafter):
    """Counts the lookup tokens proposed and keeps the last tree, so a test sees the branch."""
    proposed = 0

    def extend(self, tree, max_tokens=None):
        out = self.last_tree = super().extend(tree, max_tokens)
        CountingLookup.proposed += self.last_lookup
        return out


@pytest.mark.parametrize("preset", ["chain", "chain_adaptive", "tree"])
def test_lookup_branch_is_lossless_alone_and_in_a_batch(target, refs, preset):
    """Greedy output equals target greedy decoding with the branch on, for a request alone and for
    staggered requests in a continuous batch; the branch was proposed and some of it accepted."""
    cfg = replace(PRESETS[preset], lookup_tokens=6)
    engine = SpecEngine(target, random_draft(target, 64), cfg)
    make_head = engine.make_drafter
    engine.make_drafter = lambda: CountingLookup(make_head().head, cfg.lookup_tokens, cfg.lookup_ngram)
    CountingLookup.proposed = 0
    order = PROMPTS + [LONG]
    accepted = 0
    for p in order:
        out, stats = engine.generate(_ids(target, p), MAX_NEW)
        assert out == refs[p], (preset, p)
        accepted += sum((k - 1) * v for k, v in stats["accept_hist"].items())
    assert CountingLookup.proposed > 0 and accepted > 0
    max_new = [MAX_NEW, 7, MAX_NEW, 11]
    out = _drive(engine, [_ids(target, p) for p in order], max_new)
    for i, p in enumerate(order):
        assert out[i] == refs[p][:max_new[i]], (preset, i)


def test_server_cap_limits_the_lookup_branch_too(target, refs):
    """A step capped at k draft tokens drafts at most k deep on either branch (k = 0: plain decoding)."""
    cfg = replace(PRESETS["chain"], lookup_tokens=8)
    engine = SpecEngine(target, random_draft(target, 64), cfg)
    make_head = engine.make_drafter
    engine.make_drafter = lambda: CountingLookup(make_head().head, cfg.lookup_tokens, cfg.lookup_ngram)
    batch = engine.batch()
    reqs = [batch.open(_ids(target, p), MAX_NEW) for p in PROMPTS]
    out = {r: batch.prefill(r, None) for r in reqs}
    for cap in [0, 1, 2, 0, 3] * 20:
        if not batch.rows:
            break
        together = len(batch.rows) > 1  # a row alone verifies its match at cap 0 (the next test)
        for r, toks in batch.step(max_draft_tokens=cap):
            out[r] += toks
            assert r.last_accepted <= cap or not (cap or together)  # a path runs down one branch
            if cap:  # (cap 0 verifies the root alone without asking any drafter)
                assert r.drafter.last_lookup <= cap and len(r.drafter.last_tree) - 1 <= 2 * cap
        for r in [r for r in batch.rows if r.done]:
            batch.close(r)
    for r, p in zip(reqs, PROMPTS):
        assert out[r] == refs[p]


def test_a_plain_step_is_offered_any_match_from_the_shortest_verified(monkeypatch):
    root = Tree(torch.tensor([7]), torch.tensor([-1]))
    d = LookupDrafter(head=None, max_tokens=8, max_ngram=4)
    d.history = [1, 2, 3, 4, 5, 9, 2, 3]  # "2 3" occurred before, "9 2 3" did not: a 2-token match
    t = d.plain_step(root)  # any match (PLAIN_STEP_MATCH 1): up to 2 tokens for a 2-token match
    assert t.tokens.tolist() == [7, 4, 5] and t.parents.tolist() == [-1, 0, 1] and d.last_lookup == 2
    d.history = [1, 2, 3, 4, 5, 6]  # 6 never occurred before: no match, the root alone
    assert d.plain_step(root) is root and d.last_lookup == 0
    monkeypatch.setattr(lookup_module, "PLAIN_STEP_MATCH", 3)  # a stricter rule: 3+ tokens only
    d.history = [1, 2, 3, 4, 5, 9, 2, 3]
    assert d.plain_step(root) is root and d.last_lookup == 0
    d.history = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3]  # "1 2 3": a 3-token match, up to 4 tokens
    t = d.plain_step(root)
    assert t.tokens.tolist() == [7, 4, 5, 6, 9] and t.parents.tolist() == [-1, 0, 1, 2, 3]
    assert d.last_lookup == 4


def test_a_plain_step_of_two_rows_verifies_only_long_matches_in_short_chains():
    """In a pair the verify is padded to the wider row, so only a match of PAIR_STEP_MATCH (3) tokens
    or more is verified, its chain capped at PAIR_STEP_TOKENS (4); alone, any match, up to 8 tokens."""
    root = Tree(torch.tensor([7]), torch.tensor([-1]))
    d = LookupDrafter(head=None, max_tokens=8, max_ngram=4)
    d.history = [1, 2, 3, 4, 5, 9, 2, 3]  # a 2-token match: verified alone, not in a pair
    assert d.plain_step(root, rows=2) is root and d.last_lookup == 0
    assert d.plain_step(root, rows=1).tokens.tolist() == [7, 4, 5]
    d.history = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4]  # a 4-token match: up to 8 tokens alone
    assert d.plain_step(root, rows=2).tokens.tolist() == [7, 5, 6, 7, 8] and d.last_lookup == 4
    assert d.plain_step(root, rows=1).tokens.tolist() == [7, 5, 6, 7, 8, 9, 10, 1, 2]


def test_matches_ride_the_plain_steps_of_two_rows_losslessly(target, refs):
    """Two requests decoded together at draft size 0: while both run, each row's match of 3+ tokens
    is verified (chains of at most 4, padded to the wider row), without a head forward; the output of
    both stays target greedy, and the looping target accepts some of it."""
    cfg = replace(PRESETS["chain"], lookup_tokens=8)
    engine = SpecEngine(target, random_draft(target, 64), cfg)
    accepted = widest = 0
    for p in PROMPTS:
        batch = engine.batch()
        reqs = [batch.open(_ids(target, q), MAX_NEW) for q in (p, LONG)]
        out = {r: batch.prefill(r, None) for r in reqs}
        for r in reqs:
            r.drafter.head.propose = _no_head
        while batch.rows:
            pair = len(batch.rows) == 2
            for r, toks in batch.step(max_draft_tokens=0):
                out[r] += toks
                if pair:
                    accepted += r.last_accepted
                    widest = max(widest, r.drafter.last_lookup)
            for r in [r for r in batch.rows if r.done]:
                batch.close(r)
        assert [out[r] for r in reqs] == [refs[p], refs[LONG]], p
    assert accepted > 0 and 0 < widest <= lookup_module.PAIR_STEP_TOKENS


def _no_head(*_, **__):
    raise AssertionError("the head drafted on a plain step")


def _plain_steps_alone(engine, ids):
    """One request decoded at draft size 0 throughout -> (tokens, lookup tokens accepted, largest
    lookup branch verified); the head must not draft."""
    batch = engine.batch()
    r = batch.open(ids, MAX_NEW)
    out, accepted, widest = batch.prefill(r, None), 0, 0
    r.drafter.head.propose = _no_head
    while batch.rows:
        [(_, toks)] = batch.step(max_draft_tokens=0)
        out += toks
        accepted, widest = accepted + r.last_accepted, max(widest, r.drafter.last_lookup)
        if r.done:
            batch.close(r)
    return out, accepted, widest


def test_a_match_rides_the_plain_steps_of_a_row_alone(target, refs, monkeypatch):
    """Draft size 0 (the server's plain decoding) for a row alone still verifies its prompt-lookup
    match, without a head forward; output stays target greedy, and the looping target accepts some of
    it. A match shorter than PLAIN_STEP_MATCH is not verified."""
    cfg = replace(PRESETS["chain"], lookup_tokens=8)
    engine = SpecEngine(target, random_draft(target, 64), cfg)
    total = 0
    for p in PROMPTS + [LONG]:
        out, accepted, widest = _plain_steps_alone(engine, _ids(target, p))
        assert out == refs[p] and widest <= cfg.lookup_tokens, p
        total += accepted
    assert total > 0
    monkeypatch.setattr(lookup_module, "PLAIN_STEP_MATCH", 2)
    short = SpecEngine(target, random_draft(target, 64), replace(cfg, lookup_ngram=1))
    for p in PROMPTS:  # every match a single token, shorter than PLAIN_STEP_MATCH: plain decoding
        out, accepted, widest = _plain_steps_alone(short, _ids(target, p))
        assert out == refs[p] and accepted == 0 and widest == 0


def test_generate_at_draft_size_0_verifies_the_lookup_branch_alone(target, refs, monkeypatch):
    """engine.generate(max_draft_tokens=0) (bench_decode.py's lookupN_plain row, a server's draft size
    0 at batch 1): target greedy output, the head never drafts nor catches up, and the looping target
    accepts some of the lookup branch (more tokens than verify steps over the prompts)."""
    from eagle3_platform.spec.drafter import EagleDrafter

    def no_head(*_, **__):
        raise AssertionError("the head ran at draft size 0")

    monkeypatch.setattr(EagleDrafter, "propose", no_head)
    monkeypatch.setattr(EagleDrafter, "catch_up", no_head)
    engine = SpecEngine(target, random_draft(target, 64), replace(PRESETS["chain"], lookup_tokens=8))
    decoded = steps = 0
    for p in PROMPTS + [LONG]:
        out, stats = engine.generate(_ids(target, p), MAX_NEW, max_draft_tokens=0)
        assert out == refs[p], p
        decoded, steps = decoded + len(out) - 1, steps + stats["verify_steps"]
    assert decoded > steps


def test_generate_with_a_policy_chooses_every_step_and_tells_it_the_outcome(target, refs):
    """engine.generate(policy=...) (bench_decode.py's `_policy` row, a server's worker at batch 1): the
    policy chooses each step's draft size and observes every step, one policy across requests, and
    greedy output is target greedy decoding whatever it chose."""
    from eagle3_platform.spec.policy import DraftSizePolicy

    engine = SpecEngine(target, random_draft(target, 64), replace(PRESETS["chain"], lookup_tokens=8))
    policy, steps = DraftSizePolicy(k_max=engine.cfg.num_draft_tokens - 1), 0
    for p in PROMPTS + [LONG]:
        out, stats = engine.generate(_ids(target, p), MAX_NEW, policy=policy)
        assert out == refs[p], p
        steps += stats["verify_steps"]
    assert sum(policy.hist.values()) == steps  # every verify step chosen and observed
    assert len(policy.hist) > 1 and 1 in policy.plain  # it explored, plain decoding measured at batch 1


def test_the_worker_counts_plain_steps_that_verified_a_match_and_times_them(target, refs):
    """A plain step that verified a lookup match is still plain decoding (no head forward): the policy
    gets its time and its accepted tokens, as from any plain step (policy.py credits them to draft
    size 0), and /server_info counts such steps."""
    from eagle3_platform.serve.worker import EngineWorker, Job

    class Plain:  # always plain decoding; records what it was told
        def __init__(self):
            self.seconds, self.accepted = [], []

        def choose(self, batch_size):
            return 0

        def observe(self, batch_size, k, seconds, accepted, drafted=None, catch_up_s=0.0,
                    prompt_catch_up_s=0.0):
            self.seconds.append((seconds, drafted[0]))
            self.accepted += accepted

        def info(self):
            return {}

    cfg = replace(PRESETS["chain"], lookup_tokens=8)
    engine = SpecEngine(target, random_draft(target, 64), cfg)
    policy = Plain()
    worker = EngineWorker(engine, max_queue=4, policy=policy)
    batch = engine.batch()
    for p in PROMPTS + [LONG]:
        worker.submit(Job(_ids(target, p), max_new_tokens=MAX_NEW, emit=lambda ev: None))
        worker._pull(block=False)
        worker._prefill(batch)
        while worker._running:
            worker._step(batch)
    lookups = [s for s, m in policy.seconds if m > 0]
    assert lookups and all(s is not None and s > 0 for s, _ in policy.seconds)
    assert worker.info()["lookup_plain_steps"] == len(lookups) and sum(policy.accepted) > 0


def test_sampling_with_the_lookup_branch_keeps_the_target_distribution():
    """T > 0: the joint law of the first 4 tokens (V = 4, so lookups match often, right or wrong) is
    the target's exact law with a random head's tree plus the lookup branch."""
    from tests.test_spec_sampling import P_MIN, chi_square_pvalue, exact_sequence_probs

    vocab, length, n, temperature = 4, 4, 800, 0.7
    target = varied_target(None, VariedTargetConfig(num_hidden_layers=3, vocab_size=vocab, seed=1,
                                                    initializer_range=0.08))
    cfg = SpecConfig(3, 2, 6, lookup_tokens=3, lookup_ngram=2)
    engine = SpecEngine(target, random_draft(target, vocab, seed=2), cfg)
    prompt = [0, 3, 1, 2, 1, 0, 3]
    counts = torch.zeros(vocab ** length)
    for seed in range(n):
        out, _ = engine.generate(prompt, length, temperature=temperature, seed=seed)
        counts[int(sum(t * vocab ** (length - 1 - i) for i, t in enumerate(out)))] += 1
    probs = exact_sequence_probs(target.model, prompt, length, vocab, temperature)
    assert chi_square_pvalue(counts, probs) > P_MIN
