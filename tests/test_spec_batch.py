"""Batched speculative decoding (continuous batching): a request's output does not depend on what
else is in the batch. fp32 on the tiny target: greedy tokens equal HF greedy exactly; logits of a
batched forward equal each row's own forward within tolerance; T > 0 keeps the target's law."""
from __future__ import annotations

import random
import time

import pytest
import torch

from eagle3_platform.model.kv_cache import GrowingCache
from eagle3_platform.model.ragged import RaggedCache, row_groups
from eagle3_platform.spec.config import PRESETS, SpecConfig
from eagle3_platform.spec.engine import SpecEngine
from eagle3_platform.testing.oracle import OracleDrafter
from eagle3_platform.testing.spec import VariedTargetConfig, random_draft, varied_target
from tests.test_spec_engine import MAX_NEW, PROMPTS, _ids, hf_greedy, target  # noqa: F401 (fixture)
from tests.test_spec_sampling import P_MIN, chi_square_pvalue, exact_sequence_probs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LONG = "Explain, step by step and with examples, how a hash map resolves collisions. " * 3


@pytest.fixture(scope="module")
def refs(target):  # noqa: F811 (the imported fixture)
    """HF greedy continuations, the long prompt included."""
    eos = SpecEngine(target, None, PRESETS["baseline"]).eos_ids
    return {p: hf_greedy(target, _ids(target, p), MAX_NEW + 8, eos) for p in PROMPTS + [LONG]}


def _drive(engine, prompts, max_new, seed=0, chunk=7, ride=False, **open_kw):
    """Staggered arrivals: a new request opens every other step and prefills `chunk` tokens per
    step between decode steps (chunked prefill interleaved with decoding); finished rows leave.
    ride: with rows running, the chunk rides along their step (one target forward) instead.
    -> {prompt index: emitted tokens}."""
    rng, batch = random.Random(seed), engine.batch()
    waiting = list(enumerate(prompts))
    prefilling, running, out = [], {}, {}
    while waiting or prefilling or running:
        if waiting and rng.random() < 0.5:
            i, ids = waiting.pop(0)
            prefilling.append((i, batch.open(ids, max_new[i], **open_kw)))
            out[i] = []
        if prefilling and not (ride and running):
            i, r = prefilling[0]
            got = batch.prefill(r, chunk)
            if got is not None:
                prefilling.pop(0)
                out[i] += got
                running[r] = i
                if r.done:
                    batch.close(r)
                    del running[r]
        if running:
            riding = prefilling[:1] if ride else []
            for r, toks in batch.step(None, [(r, chunk) for _, r in riding]):
                if riding and r is riding[0][1]:  # its prompt is done: it runs from the next step
                    i = prefilling.pop(0)[0]
                    out[i] += toks
                    running[r] = i
                else:
                    out[running[r]] += toks
                if r.done:
                    batch.close(r)
                    del running[r]
    return out


def _oracle_engine(target, refs, cfg, order):
    """Each request gets its own oracle drafter (the greedy continuation of its prompt)."""
    engine = SpecEngine(target, OracleDrafter([], 64, 1), cfg)
    conts = iter([refs[p] for p in order])
    engine.make_drafter = lambda: OracleDrafter(next(conts), target.model.config.vocab_size,
                                                cfg.num_steps, seed=len(order))
    return engine


@pytest.mark.parametrize("group_overhead, widen_up_to", [(None, None), (0, None), (None, 100), (0, 100)])
@pytest.mark.parametrize("kind", ["baseline", "chain", "tree", "oracle_chain", "oracle_tree"])
def test_batched_greedy_equals_target_greedy_whatever_the_batch(target, refs, kind, group_overhead,
                                                                 widen_up_to, monkeypatch):
    """group_overhead 0: rows of different lengths attend over their own spans (row groups);
    widen_up_to 100: over their rows' whole buffers (spare slots: rejected drafts, moved rows' leftovers)."""
    if group_overhead is not None:
        monkeypatch.setattr(RaggedCache, "group_overhead", group_overhead)
    if widen_up_to is not None:
        monkeypatch.setattr("eagle3_platform.model.attention.WIDEN_UP_TO", widen_up_to)
    order = PROMPTS + [LONG] + PROMPTS[::-1]
    max_new = [MAX_NEW, 12, MAX_NEW, 5, MAX_NEW, 9, 1]  # rows leave at different steps
    if kind.startswith("oracle"):
        engine = _oracle_engine(target, refs, PRESETS[kind.split("_")[1]], order)
    else:
        draft = random_draft(target, 64) if kind != "baseline" else None
        engine = SpecEngine(target, draft, PRESETS[kind])
    assert engine.grouped_attention
    prompts = [_ids(target, p) for p in order]
    out = _drive(engine, prompts, max_new)
    for i, p in enumerate(order):
        assert out[i] == refs[p][:max_new[i]], (kind, i)


@pytest.mark.parametrize("kind", ["baseline", "chain", "tree", "oracle_chain"])
def test_prompts_riding_the_steps_keep_greedy_output(target, refs, kind):
    """Prompt chunks run in the running rows' step forward (forward.mixed_forward): every request's
    greedy output still equals HF greedy (fp32), the long prompt's over several riding chunks, and
    the head's prompt features come from the riding chunks."""
    order = PROMPTS + [LONG] + PROMPTS[::-1]
    max_new = [MAX_NEW, 12, MAX_NEW, 5, MAX_NEW, 9, 1]
    if kind.startswith("oracle"):
        engine = _oracle_engine(target, refs, PRESETS["chain"], order)
    else:
        engine = SpecEngine(target, random_draft(target, 64) if kind != "baseline" else None, PRESETS[kind])
    assert engine.use_step_forward  # chunks go through forward.mixed_forward, not apart
    calls = []
    real = engine.forward_with_prompts
    engine.forward_with_prompts = lambda *a: calls.append(len(a[-1])) or real(*a)
    out = _drive(engine, [_ids(target, p) for p in order], max_new, ride=True)
    assert sum(calls) > len(_ids(target, LONG)) // 7  # chunks rode along (the long prompt's at least)
    for i, p in enumerate(order):
        assert out[i] == refs[p][:max_new[i]], (kind, i)


@pytest.mark.parametrize("where", ["cache", "drafter"])
def test_a_riding_prompt_that_fails_is_given_up_and_the_rows_decode_on(target, refs, where):
    """cache: the step's forward fails halfway (a rider's cache write at layer 1, after the rows'
    layers 0-1 were written): the rows step again alone. drafter: the rider's own part after the
    forward (its head's prefill) fails. Either way the riders are given up with the error, not
    half-joined, and the rows' greedy output is unchanged (fp32)."""
    engine = SpecEngine(target, random_draft(target, 64), PRESETS["chain"])
    batch = engine.batch()
    first, second, third = (_ids(target, p) for p in PROMPTS[:3])
    r = batch.open(first, MAX_NEW)
    out = batch.prefill(r, None)
    rider, other = batch.open(second, MAX_NEW), batch.open(third, MAX_NEW)
    if where == "cache":
        update = rider.prompt_cache.update
        rider.prompt_cache.update = lambda k, v, i, *a: (_ for _ in ()).throw(RuntimeError("bug")) if i == 1 \
            else update(k, v, i, *a)
    else:
        rider.drafter.prefill = lambda *a: (_ for _ in ()).throw(RuntimeError("bug"))
    stepped = batch.step(None, [(rider, 64), (other, 64)])  # both prompts whole: done in this step
    failed = [rider, other] if where == "cache" else [rider]  # a shared forward fails them all
    assert batch.failed_prompts == failed and isinstance(batch.prompt_error, RuntimeError)
    assert set(batch.rows) == ({r, other} if where == "drafter" else {r})
    assert [x for x, _ in stepped] == [r] + [other] * (where == "drafter")
    out += stepped[0][1]
    while not r.done:
        out += next(toks for x, toks in batch.step() if x is r)
    assert out == refs[PROMPTS[0]][:MAX_NEW] and batch.failed_prompts == []


def _decode_capped(batch, prompts, caps):
    """The prompts prefilled together, then one step per draft-size cap (a server's choices) until
    every request is done -> (requests, {request: emitted tokens})."""
    reqs = [batch.open(ids, MAX_NEW) for ids in prompts]
    out = {r: batch.prefill(r, None) for r in reqs}
    for cap in caps:
        if not batch.rows:
            break
        for r, toks in batch.step(max_draft_tokens=cap):
            out[r] += toks
        for r in [r for r in batch.rows if r.done]:
            batch.close(r)
    return reqs, out


def test_server_cap_on_draft_size_keeps_output(target, refs):
    """A step may verify fewer draft tokens than the settings say (the server's draft-size choice)."""
    engine = _oracle_engine(target, refs, PRESETS["chain"], PROMPTS)
    reqs, out = _decode_capped(engine.batch(), [_ids(target, p) for p in PROMPTS], [0, 1, 3, 0, 2, 4] * 10)
    for r, p in zip(reqs, PROMPTS):
        assert out[r] == refs[p][:MAX_NEW]
        assert max(r.hist) <= 5
    assert r.hist[1] > 0  # cap 0 steps emit the bonus token alone


def test_a_vanishing_temperature_decodes_greedily(target, refs):
    """T = 1e-40 would overflow logits / T to inf and NaN in softmax: below MIN_SAMPLING_TEMPERATURE
    a request is greedy, its output the target's greedy continuation."""
    engine = SpecEngine(target, random_draft(target, target.model.config.vocab_size, seed=3),
                        PRESETS["chain"])
    for p in PROMPTS[:2]:
        out, _ = engine.generate(_ids(target, p), MAX_NEW, temperature=1e-40, seed=0)
        assert out == refs[p][:MAX_NEW]


@torch.no_grad()
def test_drafter_backlog_is_caught_up_apart_and_equals_one_append(target):
    """Steps verified without a draft leave the drafter a backlog (here the prompt + 3 steps). The
    next drafting step appends it first, timed apart (Batch.catch_up_s), and the drafter's cache
    equals one append of everything. A later backlog, of steps decoded plainly between drafts, is also
    reported apart from a prompt's (resume_catch_up_s: what the server's policy reports as the cost of
    a return to drafting)."""
    from eagle3_platform.spec.drafter import EagleDrafter

    engine = SpecEngine(target, random_draft(target, 64), PRESETS["chain"])
    batch = engine.batch()
    r = batch.open(_ids(target, PROMPTS[0]), MAX_NEW)
    batch.prefill(r, None)
    for _ in range(3):
        batch.step(max_draft_tokens=0)
    assert len(r.drafter._queued) == 4 and batch.catch_up_s == 0.0  # nothing drafted: nothing appended
    ref = EagleDrafter(r.drafter.draft, r.drafter.cfg)
    ref._queued = list(r.drafter._queued)
    ref._append_queued()  # all 4 chunks in one forward
    t0 = time.perf_counter()
    batch.step(max_draft_tokens=2)
    assert batch.catch_up_s > 0.0 and 0.0 < batch.step_s < time.perf_counter() - t0 - batch.catch_up_s + 1e-9
    assert r.drafter.n == ref.n  # the last chunk was appended by the step itself, after the backlog
    torch.testing.assert_close(r.drafter.k, ref.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r.drafter.v, ref.v, atol=1e-5, rtol=1e-5)
    assert batch.resume_catch_up_s == 0.0  # the prompt's backlog: the row's first draft
    batch.step(max_draft_tokens=2)
    assert batch.catch_up_s < 0.01 and len(r.drafter._queued) == 1  # steady drafting: no backlog
    for _ in range(3):
        batch.step(max_draft_tokens=0)
    batch.step(max_draft_tokens=2)  # a return to drafting: the plain steps' backlog alone
    assert batch.resume_catch_up_s == batch.catch_up_s > 0.0


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_the_head_holds_the_whole_prefix_through_plain_stretches(target, refs, kind):
    """As SGLang's head: after a prompt and stretches decoded without a draft, every token the target
    committed is an entry of the head's cache or queued for it (nothing left out), at the target's
    positions; and the output is the target's greedy output (fp32), alone and in a batch."""
    batch = SpecEngine(target, random_draft(target, 64), PRESETS[kind]).batch()
    caps = [0, 0, 0, 2, 4, 0, 0, 0, 0, 3, 1] * 10  # plain stretches: returns with a backlog
    reqs, out = _decode_capped(batch, [_ids(target, p) for p in PROMPTS], caps)
    for r, p in zip(reqs, PROMPTS):
        assert out[r] == refs[p][:MAX_NEW]
        queued = sum(t.numel() for _, t in r.drafter._queued)
        assert r.drafter.n + queued == r.n and r.drafter.n > len(r.ids) // 2


@pytest.mark.parametrize("grouped", [False, True])
@torch.no_grad()
def test_ragged_forward_matches_each_row_alone(target, grouped, monkeypatch):
    """Three rows of different lengths, one with a tree verify whose kept path is not a prefix:
    the batched logits equal each row's own forward (fp32, tolerance: other matmul shapes), with
    one attended span for all rows and with every row attending over its own span (row groups)."""
    monkeypatch.setattr(RaggedCache, "group_overhead", 0 if grouped else 10 ** 9)
    model, g = target.model, torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (1, n), generator=g) for n in (5, 11, 8)]
    ragged, alone = RaggedCache(), []
    for ids in prompts:
        c = GrowingCache()
        model(input_ids=ids, past_key_values=c, use_cache=True)
        ragged.add_row(c, ids.shape[1])
        alone.append(c)
    assert ragged.lengths.tolist() == [11, 8, 5]  # longest first
    row = [2, 0, 1]  # prompt -> row
    parents = torch.tensor([-1, 0, 0, 1])  # prompt 1: a tree; prompts 0/2: chains of 4
    anc = torch.eye(4, dtype=torch.bool).repeat(3, 1, 1)
    anc[row[0]] = anc[row[2]] = torch.ones(4, 4, dtype=torch.bool).tril()
    from eagle3_platform.spec.tree import ancestor_matrix, depths
    anc[row[1]] = ancestor_matrix(parents)
    depth = torch.stack([torch.arange(4)] * 3)
    depth[row[1]] = depths(parents)
    new = torch.randint(3, 60, (3, 4), generator=g)
    pos = ragged.lengths[:, None] + depth
    ragged.begin(4)
    assert ragged.groups == ([(0, 1, 0, 15), (1, 2, 0, 12), (2, 3, 0, 9)] if grouped else [(0, 3, 0, 15)])
    kw = {"row_groups": ragged.groups} if grouped else {}
    got = model(input_ids=new, attention_mask=ragged.mask(anc), position_ids=pos,
                past_key_values=ragged, use_cache=True, **kw).logits
    for i, b in enumerate(row):
        n = prompts[i].shape[1]
        mask = torch.zeros(1, 1, 4, n + 4).masked_fill(
            ~torch.cat([torch.ones(4, n, dtype=torch.bool), anc[b]], 1), torch.finfo(torch.float32).min)
        want = model(input_ids=new[b:b + 1], attention_mask=mask, position_ids=pos[b:b + 1],
                     past_key_values=alone[i], use_cache=True).logits
        torch.testing.assert_close(got[b], want[0], atol=1e-4, rtol=1e-4)
    # keep a non-prefix path for prompt 1 and drop prompt 2's row (the last rows move up one):
    # the next decode of prompts 0 and 1 still matches each alone
    ragged.keep(row[1], [0, 2])
    ragged.keep(row[2], [0, 1, 2, 3])
    ragged.keep(row[0], [0, 1])
    ragged.drop_row(row[2])
    assert ragged.lengths.tolist() == [13, 7]  # prompt 1 (11 + 2), prompt 0 (5 + 2)
    for c, n, path in ((alone[1], 11, [0, 2]), (alone[0], 5, [0, 1])):
        for layer in c.layers:  # the single-sequence reference keeps the same path
            layer.keys = torch.cat([layer.keys[:, :, :n], layer.keys[:, :, [n + j for j in path]]], 2)
            layer.values = torch.cat([layer.values[:, :, :n], layer.values[:, :, [n + j for j in path]]], 2)
    nxt = torch.randint(3, 60, (2, 1), generator=g)
    pos = ragged.lengths[:, None].clone()
    ragged.begin(1)
    kw = {"row_groups": ragged.groups} if grouped else {}
    got = model(input_ids=nxt, attention_mask=ragged.mask(torch.ones(2, 1, 1, dtype=torch.bool)),
                position_ids=pos, past_key_values=ragged, use_cache=True, **kw).logits
    for b, c in enumerate((alone[1], alone[0])):
        want = model(input_ids=nxt[b:b + 1], position_ids=pos[b:b + 1], past_key_values=c,
                     use_cache=True).logits
        torch.testing.assert_close(got[b], want[0], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_fp32_batch_cache_under_a_bf16_model(tiny_target_dir):
    """compute.kv_cache_dtype's fp32 cache under a bf16 model: prompts copied in and keys written by a
    verify forward are the bf16 values exactly (fp32 holds every bf16), and the forward's logits are
    what the bf16 cache gives, within bf16 rounding (attention runs in fp32 instead)."""
    from eagle3_platform.model.target import load_target

    model = load_target(tiny_target_dir, "bfloat16").model
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (1, n), generator=g) for n in (5, 11, 8)]
    caches = {dt: RaggedCache(dt) for dt in (None, torch.float32)}
    for ids in prompts:
        c = GrowingCache()
        model(input_ids=ids, past_key_values=c, use_cache=True)
        for cache in caches.values():
            cache.add_row(c, ids.shape[1])
    wide, narrow = caches[torch.float32], caches[None]
    assert wide.keys[0].dtype is torch.float32 and narrow.keys[0].dtype is torch.bfloat16
    for a, b in zip(wide.keys + wide.values, narrow.keys + narrow.values):
        assert torch.equal(a[:3, :, :11], b[:3, :, :11].float())
    new = torch.randint(3, 60, (3, 4), generator=g)
    anc = torch.ones(4, 4, dtype=torch.bool).tril().repeat(3, 1, 1)  # a chain of 4 per row
    logits = {}
    for dt, cache in caches.items():
        pos = cache.lengths[:, None] + torch.arange(4)
        cache.begin(4)
        logits[dt] = model(input_ids=new, attention_mask=cache.mask(anc), position_ids=pos,
                           past_key_values=cache, use_cache=True).logits
    assert logits[torch.float32].dtype is torch.bfloat16
    # layer 0's keys/values, the verify's new ones included (computed by each forward), are the same
    # bf16 values in both caches
    torch.testing.assert_close(wide.keys[0], narrow.keys[0].float(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(wide.values[0], narrow.values[0].float(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(logits[torch.float32].float(), logits[None].float(), atol=0.05, rtol=0.02)


def test_the_last_row_out_frees_the_buffers_sized_for_the_longest_prompt(target):  # noqa: F811
    """A long prompt's row grows the buffers; once every row has left they are freed, so the next
    short request gets buffers sized for itself (attention reads them whole: model/attention.py) and its
    decode still equals its forward alone (fp32, tolerance: other matmul shapes)."""
    from eagle3_platform.model.kv_cache import slot_capacity

    model, g = target.model, torch.Generator().manual_seed(0)
    ragged = RaggedCache()
    for n in (40, 6):
        c = GrowingCache()
        model(input_ids=torch.randint(3, 60, (1, n), generator=g), past_key_values=c, use_cache=True)
        ragged.add_row(c, n)
    assert ragged.keys[0].shape[2] >= 40
    ragged.drop_row(0)
    assert ragged.keys[0].shape[2] >= 40  # a row still runs: the buffers stay
    ragged.drop_row(0)
    assert ragged.rows == 0 and ragged.keys == [] and ragged.values == []
    ids, alone = torch.randint(3, 60, (1, 5), generator=g), GrowingCache()
    model(input_ids=ids, past_key_values=alone, use_cache=True)
    ragged.add_row(alone, 5)
    assert ragged.keys[0].shape[:3] == (1, alone.layers[0].keys.shape[1], slot_capacity(5))
    nxt = torch.randint(3, 60, (1, 1), generator=g)
    ragged.begin(1)
    got = model(input_ids=nxt, position_ids=ragged.lengths[:, None].clone(), past_key_values=ragged,
                use_cache=True).logits
    want = model(input_ids=nxt, position_ids=torch.tensor([[5]]), past_key_values=alone, use_cache=True).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_row_groups_split_where_a_span_would_waste_more_than_a_call():
    """Contiguous groups minimising attended (row, slot) pairs + a cost per group."""
    assert row_groups([1000, 100, 90, 80], 1, overhead=100) == [(0, 1, 1001), (1, 4, 101)]
    assert row_groups([1000, 100, 90, 80], 1, overhead=10 ** 6) == [(0, 4, 1001)]  # a call dearer
    assert row_groups([100, 100, 100], 5, overhead=0) == [(0, 3, 105)]  # equal rows: nothing to gain
    assert row_groups([], 1) == []
    # exhaustive check on small cases: no contiguous split is cheaper than the chosen one
    import itertools
    rng = random.Random(0)
    for _ in range(50):
        lengths = sorted((rng.randint(1, 500) for _ in range(rng.randint(1, 6))), reverse=True)
        overhead = rng.choice([0, 50, 300, 2000])

        def cost(groups):
            return sum((b - a) * span + overhead for a, b, span in groups)

        got = row_groups(lengths, 2, overhead)
        assert [a for a, _, _ in got] == [0] + [b for _, b, _ in got[:-1]] and got[-1][1] == len(lengths)
        for k in range(len(lengths)):
            for cuts in itertools.combinations(range(1, len(lengths)), k):
                bounds = [0, *cuts, len(lengths)]
                groups = [(a, b, max(lengths[a:b]) + 2) for a, b in zip(bounds, bounds[1:])]
                assert cost(got) <= cost(groups)


def test_batched_sampling_keeps_the_target_distribution():
    """T > 0 in a batch: the joint law of the first 3 tokens of every request (random-draft tree,
    V=4) is the target's exact law, with requests of two prompts sharing batches."""
    vocab, length, n, temperature = 4, 3, 600, 0.7
    target = varied_target(None, VariedTargetConfig(num_hidden_layers=3, vocab_size=vocab, seed=1,
                                                    initializer_range=0.08))
    engine = SpecEngine(target, random_draft(target, vocab, seed=2), SpecConfig(3, 2, 6))
    prompt, other = [0, 3, 1, 2, 1], [2, 2, 0, 1, 3, 0, 1]
    counts = torch.zeros(vocab ** length)
    for start in range(0, n, 8):  # batches of 8: 4 of `prompt` interleaved with 4 of `other`
        prompts = [prompt, other] * 4
        seeds = [start + i for i in range(8)]
        batch, reqs = engine.batch(), []
        for ids, s in zip(prompts, seeds):
            reqs.append(batch.open(ids, length, temperature=temperature, seed=s))
        out = {r: batch.prefill(r, None) for r in reqs}
        while batch.rows:
            for r, toks in batch.step():
                out[r] += toks
            for r in [r for r in batch.rows if r.done]:
                batch.close(r)
        for r in reqs[::2]:
            counts[int(sum(t * vocab ** (length - 1 - i) for i, t in enumerate(out[r])))] += 1
    probs = exact_sequence_probs(target.model, prompt, length, vocab, temperature)
    assert counts.sum() == n // 2
    assert chi_square_pvalue(counts, probs) > P_MIN
