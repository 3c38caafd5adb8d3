"""SpecEngine on the tiny target: greedy losslessness (random EAGLE-3 draft, oracle drafts), stops, stats."""
from __future__ import annotations

import pytest
import torch

from eagle3_platform.spec.config import PRESETS, SpecConfig
from eagle3_platform.spec.engine import SpecEngine
from eagle3_platform.testing.oracle import OracleDrafter
from eagle3_platform.testing.spec import random_draft as make_random_draft
from eagle3_platform.testing.spec import varied_target


pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["What is the capital of France?", "Write a function that sorts a list of numbers.",
           "Summarize the following article."]
MAX_NEW = 20


def _ids(target, text):
    msgs = [{"role": "user", "content": text}]
    return target.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]


@torch.no_grad()
def hf_greedy(target, ids, max_new, eos_ids):
    """The reference: transformers' own greedy decoding (explicit attention mask: the pad id may
    occur inside a chat prompt, which would otherwise be masked out)."""
    x = torch.tensor([ids])
    out = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                                do_sample=False, eos_token_id=sorted(eos_ids) or None,
                                pad_token_id=target.tokenizer.pad_token_id)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def target(tiny_target):
    """Tiny Llama with the tiny tokenizer whose greedy output varies (see eagle3_platform/testing/spec.py)."""
    return varied_target(tiny_target)


@pytest.fixture(scope="module")
def refs(target):
    eos = SpecEngine(target, None, PRESETS["baseline"]).eos_ids
    # +8 so oracles can see past the end of what is generated
    return {p: hf_greedy(target, _ids(target, p), MAX_NEW + 8, eos) for p in PROMPTS}


@pytest.fixture(scope="module")
def random_draft(target):
    return make_random_draft(target, 64)


def test_baseline_equals_hf_greedy(target, refs):
    engine = SpecEngine(target, None, PRESETS["baseline"])
    for p in PROMPTS:
        out, stats = engine.generate(_ids(target, p), MAX_NEW)
        assert out == refs[p][:MAX_NEW]
        assert stats["acceptance_length"] == 1.0 and stats["verify_steps"] == len(out) - 1


@pytest.mark.parametrize("preset", ["chain", "tree", "tiny"])
def test_random_draft_is_lossless(target, refs, random_draft, preset):
    engine = SpecEngine(target, random_draft, PRESETS[preset])
    for p in PROMPTS:
        out, stats = engine.generate(_ids(target, p), MAX_NEW)
        assert out == refs[p][:MAX_NEW], p
        assert stats["generated_tokens"] == len(out)
        assert sum(k * v for k, v in stats["accept_hist"].items()) >= len(out) - 1


@pytest.mark.parametrize("depth", [1, 3, 5])
def test_oracle_trees_are_lossless_and_accept(target, refs, depth):
    """Trees mixing correct/wrong children at every level: partial, full and zero acceptance."""
    hist_keys = set()
    for i, p in enumerate(PROMPTS):
        oracle = OracleDrafter(refs[p], len(target.tokenizer), depth, seed=i)
        engine = SpecEngine(target, oracle, SpecConfig(depth, 2, 2 * depth + 1))
        out, stats = engine.generate(_ids(target, p), MAX_NEW)
        assert out == refs[p][:MAX_NEW], p
        hist_keys |= set(stats["accept_hist"])
    assert 1 in hist_keys and max(hist_keys) > 1  # rejections and acceptances both happened


def test_full_acceptance_gives_tau_depth_plus_one(target, refs):
    p = PROMPTS[0]
    depth, steps = 4, 4
    assert len(set(refs[p][: 1 + steps * (depth + 1)])) > 1
    oracle = OracleDrafter(refs[p], len(target.tokenizer), depth, siblings=False, always_correct=True)
    engine = SpecEngine(target, oracle, PRESETS["chain"])
    out, stats = engine.generate(_ids(target, p), 1 + steps * (depth + 1))
    if len(refs[p]) < len(out) or refs[p][: len(out)] != out:
        pytest.fail("oracle output diverged from greedy")
    assert stats["finish_reason"] == "length"  # no EOS inside the window
    assert stats["verify_steps"] == steps and stats["acceptance_length"] == depth + 1
    assert stats["accept_hist"] == {depth + 1: steps}


def test_stream_chunks_concatenate_to_generate(target, random_draft):
    engine = SpecEngine(target, random_draft, PRESETS["tree"])
    ids = _ids(target, PROMPTS[1])
    chunks = list(engine.stream(ids, 17))
    assert all(isinstance(c, list) and c for c in chunks)
    out, stats = engine.generate(ids, 17)
    assert sum(chunks, []) == out and len(out) == 17 and stats["finish_reason"] == "length"


def test_max_new_tokens_truncates_an_accepted_chunk(target, refs):
    p = PROMPTS[2]
    oracle = OracleDrafter(refs[p], len(target.tokenizer), 4, siblings=False, always_correct=True)
    engine = SpecEngine(target, oracle, PRESETS["chain"])
    out, stats = engine.generate(_ids(target, p), 3)  # the first verify step yields 5 tokens
    assert out == refs[p][:3] and stats["finish_reason"] in ("length", "stop")


def test_eos_stops_and_is_included(target, refs, random_draft):
    p = PROMPTS[0]
    engine = SpecEngine(target, random_draft, PRESETS["tree"])
    cut = next(i for i in range(4, MAX_NEW) if refs[p][i] not in refs[p][:i])
    engine.eos_ids = {refs[p][cut]}  # pretend this token ends the turn
    out, stats = engine.generate(_ids(target, p), MAX_NEW)
    assert out == refs[p][: cut + 1] and stats["finish_reason"] == "stop"


def test_stop_string_trims_output(target, refs, random_draft):
    p = PROMPTS[2]
    tok = target.tokenizer
    engine = SpecEngine(target, random_draft, PRESETS["chain"])
    full_text = tok.decode(refs[p][:MAX_NEW], skip_special_tokens=True)
    stop = full_text[len(full_text) // 2: len(full_text) // 2 + 3]
    assert stop.strip(), "reference text too short for this test"
    start = full_text.find(stop)
    chunks = list(engine.stream(_ids(target, p), MAX_NEW, stop=[stop]))
    text = tok.decode(sum(chunks, []), skip_special_tokens=True)
    assert stop not in text and full_text.startswith(text) and len(text) <= start
    assert engine.last_stats["finish_reason"] == "stop"
    # held back only what could still become the stop string: nothing beyond a token's worth is lost
    assert len(tok.decode(refs[p][: len(sum(chunks, [])) + 1], skip_special_tokens=True)) > start


def test_bad_arguments(target):
    engine = SpecEngine(target, None, PRESETS["baseline"])
    with pytest.raises(ValueError):
        engine.generate([], 4)
    with pytest.raises(ValueError):
        engine.generate([1, 2], 0)
    with pytest.raises(ValueError):
        SpecConfig(num_steps=2, eagle_topk=1, num_draft_tokens=5)


@pytest.mark.parametrize("cfg", [PRESETS["chain"], SpecConfig(num_steps=4, eagle_topk=1, num_draft_tokens=3),
                                 SpecConfig(num_steps=4, eagle_topk=1, num_draft_tokens=5, min_draft_prob=0.02)])
def test_chain_fast_path_drafts_what_the_tree_code_drafts(target, random_draft, cfg):
    """topk 1 skips the pool and the tree masks; it must propose the same chain as the general code."""
    from eagle3_platform.spec.drafter import EagleDrafter, propose_chains

    g = torch.Generator().manual_seed(0)
    width, vocab = random_draft.fc.in_features, target.model.config.vocab_size
    drafter = EagleDrafter(random_draft, cfg)
    drafter.prefill(torch.randn(1, 9, width, generator=g), torch.randint(0, vocab, (9,), generator=g))
    drafter._append_queued()
    for budget in (cfg.num_draft_tokens - 1, 1):  # the settings' size, and a server's smaller cap
        fast, general = propose_chains([drafter], [5], budget)[0], drafter._propose_tree(5, budget)
        assert len(fast) <= budget + 1 and (cfg.min_draft_prob > 0 or len(fast) == budget + 1)
        assert fast.tokens.tolist() == general.tokens.tolist()
        assert fast.parents.tolist() == general.parents.tolist()


@pytest.mark.parametrize("min_draft_prob", [0.0, 0.02])
def test_batched_chains_equal_each_row_alone(target, random_draft, min_draft_prob):
    """Rows of different lengths and backlogs (a fresh prompt, 1-5 queued entries) drafted together
    propose what each drafts alone."""
    from dataclasses import replace

    from eagle3_platform.spec.drafter import EagleDrafter, propose_all

    cfg = replace(PRESETS["chain"], min_draft_prob=min_draft_prob)
    g = torch.Generator().manual_seed(4)
    width, vocab = random_draft.fc.in_features, target.model.config.vocab_size

    def feed(m):
        return torch.randn(1, m, width, generator=g), torch.randint(0, vocab, (m,), generator=g)

    history = [[feed(p)] + [feed(m) for m in steps] for p, steps in
               ((9, [1, 3]), (4, [5]), (12, []), (6, [2, 1, 1]))]
    together, alone = [], []
    for entries in history:
        for group in (together, alone):
            x = EagleDrafter(random_draft, cfg)
            x.prefill(*entries[0])
            if len(entries) > 1:
                x.propose(3)  # the prompt is in; the rest stays queued
                for aux, toks in entries[1:]:
                    x.commit(aux, toks)
            group.append(x)
    roots = [5, 6, 7, 8]
    for budget in (4, 2):
        got = propose_all(together, roots, budget)
        want = [x.propose(r, budget) for x, r in zip(alone, roots)]
        assert [t.tokens.tolist() for t in got] == [t.tokens.tolist() for t in want]
    for a, b in zip(together, alone):
        assert a.n == b.n
        torch.testing.assert_close(a.k, b.k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a.h_last, b.h_last, atol=1e-4, rtol=1e-4)


def test_lazily_appended_draft_entries_equal_eager_ones(target, random_draft):
    """Entries queued over several steps and appended in one draft forward (a server step with draft
    size 0 does not run the head) give the drafts that appending after every step gives."""
    from eagle3_platform.spec.drafter import EagleDrafter

    g = torch.Generator().manual_seed(3)
    width, vocab = random_draft.fc.in_features, target.model.config.vocab_size
    steps = [(torch.randn(1, m, width, generator=g), torch.randint(0, vocab, (m,), generator=g))
             for m in (9, 1, 3, 1, 2)]  # the prompt, then root + accepted nodes per step
    eager, lazy = EagleDrafter(random_draft, PRESETS["tree"]), EagleDrafter(random_draft, PRESETS["tree"])
    for d in (eager, lazy):
        d.prefill(*steps[0])
    for aux, toks in steps[1:]:
        eager.propose(7)
        eager.commit(aux, toks)
        lazy.commit(aux, toks)
    a, b = eager.propose(7), lazy.propose(7)
    assert eager.n == lazy.n == 16
    assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
    torch.testing.assert_close(eager.h_last, lazy.h_last, atol=1e-4, rtol=1e-4)


def test_min_draft_prob_cuts_the_draft_and_keeps_output(target, refs, random_draft):
    """Nodes the head doubts are not verified: smaller trees, the same greedy output."""
    from dataclasses import replace

    for name in ("chain", "tree"):
        full, cut = (SpecEngine(target, random_draft, replace(PRESETS[name], min_draft_prob=p)) for p in (0.0, 0.05))
        for p in PROMPTS:
            out_full, _ = full.generate(_ids(target, p), MAX_NEW)
            out_cut, stats = cut.generate(_ids(target, p), MAX_NEW)
            assert out_cut == out_full == refs[p][:MAX_NEW]
        drafter = cut.make_drafter()  # the cut happens: the random head is never 5% sure of a path
        g = torch.Generator().manual_seed(0)
        drafter.prefill(torch.randn(1, 9, random_draft.fc.in_features, generator=g), torch.randint(0, 50, (9,)))
        assert len(drafter.propose(5)) < cut.cfg.num_draft_tokens
    with pytest.raises(ValueError, match="min_draft_prob"):
        SpecConfig(min_draft_prob=1.0)


def test_every_platform_preset_deploys_a_known_spec_preset():
    from eagle3_platform.config import PRESET_NAMES, SPEC_FOR_PRESET, preset

    assert set(SPEC_FOR_PRESET) == set(PRESET_NAMES)
    for name in PRESET_NAMES:
        assert preset(name).spec == PRESETS[SPEC_FOR_PRESET[name]]


def test_target_forwards_run_on_target_threads_and_drafting_on_the_callers(target, refs, random_draft,
                                                                          monkeypatch):
    """target_threads=2 in a 1-thread process: every target forward sees 2 threads, and so does the
    head's catch-up over a prompt (prefill-like work); the head's drafting and the count after
    generate() see 1. (Outputs of different thread counts are not compared token for token: a split
    reduction may flip a near-tie.)"""
    from eagle3_platform.spec.drafter import EagleDrafter

    ids = _ids(target, PROMPTS[0])
    in_catch_up = [False]
    catch_up = EagleDrafter.catch_up

    def flagged_catch_up(self):
        in_catch_up[0] = True
        try:
            catch_up(self)
        finally:
            in_catch_up[0] = False

    monkeypatch.setattr(EagleDrafter, "catch_up", flagged_catch_up)

    def run(target_threads):
        engine = SpecEngine(target, random_draft, PRESETS["chain"], target_threads=target_threads)
        seen = {"target": set(), "draft": set(), "catch_up": set()}

        def record(kind):
            def hook(*_):
                seen["catch_up" if kind == "draft" and in_catch_up[0] else kind].add(torch.get_num_threads())
            return hook

        hooks = [m.register_forward_pre_hook(record(k))
                 for k, top in (("target", target.model), ("draft", engine.draft)) for m in top.modules()]
        try:
            return engine.generate(ids, MAX_NEW)[0], seen
        finally:
            for h in hooks:
                h.remove()

    ref, seen = run(None)
    assert seen == {"target": {1}, "draft": {1}, "catch_up": {1}}
    out, seen = run(2)
    assert seen == {"target": {2}, "draft": {1}, "catch_up": {2}}
    assert torch.get_num_threads() == 1
    assert ref == refs[PROMPTS[0]][:MAX_NEW] and len(out) == len(ref)


def test_draft_kv_writes_in_place_commits_rewinds_and_grows():
    """DraftKV: extend writes after the last written entry (a view of everything written comes back),
    rewind drops the uncommitted ones, a full buffer doubles keeping what was written; bf16 entries
    are held exactly in an fp32 buffer."""
    from eagle3_platform.spec.drafter import DraftKV

    g = torch.Generator().manual_seed(0)
    k1, k2, k3 = (torch.randn(1, 2, t, 4, generator=g).to(torch.bfloat16) for t in (2, 3, 1))
    kv = DraftKV.empty(1, 2, 4, cap=3, dtype=torch.float32)
    keys, values = kv.extend(k1, -k1)
    assert keys.shape == (1, 2, 2, 4) and kv.n == 0 and torch.equal(keys, k1.float())
    kv.commit()
    keys, values = kv.extend(k2, -k2)  # past the capacity: the buffer grows
    assert kv.keys.shape[2] >= 5 and torch.equal(keys, torch.cat([k1, k2], 2).float())
    assert torch.equal(values, -keys)
    kv.rewind()
    assert kv.n == kv.end == 2 and torch.equal(kv.k, k1.float()) and torch.equal(kv.v, -k1.float())
    keys, _ = kv.extend(k3, -k3)  # overwrites the rewound slot
    assert torch.equal(keys, torch.cat([k1, k3], 2).float()) and kv.n == 2


def test_drafting_leaves_committed_entries_and_grown_caches_equal_one_append(target, random_draft):
    """Chains and trees write their speculative entries after the committed ones and drop them; a
    drafter's cache grown over many commits (past its first buffer) equals one append of everything."""
    from eagle3_platform.spec.drafter import EagleDrafter

    g = torch.Generator().manual_seed(4)
    width, vocab = random_draft.fc.in_features, target.model.config.vocab_size
    steps = [(torch.randn(1, m, width, generator=g), torch.randint(0, vocab, (m,), generator=g))
             for m in [5] + [3, 1, 2] * 100]  # 5 + 600 entries: past the first buffer's 5 + 256
    for preset in ("chain", "tree"):
        grown = EagleDrafter(random_draft, PRESETS[preset])
        grown.prefill(*steps[0])
        for aux, toks in steps[1:]:
            first = grown.propose(7)
            n, k, h = grown.n, grown.k.clone(), grown.h_last
            again = grown.propose(7)  # drafting again: same committed entries, same draft
            assert grown.n == n and torch.equal(grown.k, k) and grown.h_last is h
            assert again.tokens.tolist() == first.tokens.tolist()
            assert again.parents.tolist() == first.parents.tolist()
            grown.commit(aux, toks)
        grown.propose(7)
        assert grown.kv.keys.shape[2] > 5 + 256  # it grew
        ref = EagleDrafter(random_draft, PRESETS[preset])
        ref.prefill(torch.cat([a for a, _ in steps], 1), torch.cat([t for _, t in steps]))
        ref.propose(7)
        assert grown.n == ref.n == 605
        torch.testing.assert_close(grown.k, ref.k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(grown.v, ref.v, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(grown.h_last, ref.h_last, atol=1e-4, rtol=1e-4)


def test_a_bf16_head_drafts_over_an_fp32_draft_kv(target, random_draft):
    """The engine's drafters keep their KV in the batch cache's dtype: fp32 under a bf16 head (where
    bf16 matmuls are slow) holds the same keys exactly, and drafts what the bf16 KV drafts (random
    head: the logits within bf16 rounding)."""
    import copy

    from eagle3_platform.spec.drafter import EagleDrafter

    head = copy.deepcopy(random_draft).cast_parameters(torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    aux = torch.randn(1, 12, head.fc.in_features, generator=g)
    toks = torch.randint(0, target.model.config.vocab_size, (12,), generator=g)
    plain, wide = EagleDrafter(head, PRESETS["chain"]), EagleDrafter(head, PRESETS["chain"], torch.float32)
    for d in (plain, wide):
        d.prefill(aux, toks)
        d.propose(3)
    assert plain.k.dtype is torch.bfloat16 and wide.k.dtype is torch.float32
    # two forwards of one shape: the same bf16 keys (a one-ulp difference, ~4e-3 relative, fails)
    torch.testing.assert_close(wide.k, plain.k.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(wide.v, plain.v.float(), rtol=1e-6, atol=1e-6)
    a, b = (head.logits(d.h_last).float() for d in (plain, wide))
    assert (a - b).abs().max() <= 0.05 * a.abs().max()


def test_drafting_runs_on_draft_threads_and_the_rest_on_the_callers(target, random_draft, monkeypatch):
    """draft_threads switches the count around the head's drafting only: the caller's count holds
    for the rest of the step and after it."""
    import eagle3_platform.spec.batch as batch_module

    seen = []
    real = batch_module.propose_all
    monkeypatch.setattr(batch_module, "propose_all",
                        lambda *a: seen.append(torch.get_num_threads()) or real(*a))
    engine = SpecEngine(target, random_draft, PRESETS["chain"], draft_threads=2)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        batch = engine.batch()
        r = batch.open(_ids(target, PROMPTS[0]), 8)
        batch.prefill(r, None)
        batch.step()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(prev)
    assert seen == [2]
