"""The engine's step forward (model/forward.py) computes what transformers' forward computes for the
same step: logits, EAGLE-3 features and the cache it writes (same modules and functions in the same
order, same shapes and threads: equal up to at most last-bit effects; compared with a tight tolerance)."""
from __future__ import annotations

import copy

import pytest
import torch

from eagle3_platform.features.capture import forward_capture
from eagle3_platform.model import forward as fwd
from eagle3_platform.model.kv_cache import GrowingCache
from eagle3_platform.model.ragged import RaggedCache
from eagle3_platform.model.target import load_target
from eagle3_platform.spec.config import PRESETS
from eagle3_platform.spec.engine import SpecEngine
from eagle3_platform.spec.tree import ancestor_matrix, depths
from eagle3_platform.testing.oracle import OracleDrafter

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _caches(model, lengths, gen):
    """Two identical ragged caches holding prompts of these lengths."""
    a, b = RaggedCache(), RaggedCache()
    for n in lengths:
        c = GrowingCache()
        model(input_ids=torch.randint(3, 60, (1, n), generator=gen), past_key_values=c, use_cache=True)
        a.add_row(c, n)
        b.add_row(c, n)
    return a, b


@pytest.mark.parametrize("dtype,pack", [("float32", True), ("bfloat16", True), ("float32", False)])
@pytest.mark.parametrize("rows", [1, 3])
@torch.no_grad()
def test_step_forward_equals_transformers_forward(tiny_target_dir, monkeypatch, dtype, pack, rows):
    """rows 3: a tree verify over rows of different lengths (row groups); rows 1: one decode token
    with no mask, as the engine's batch-1 plain step. pack: the linears fused and packed as
    load_target makes them (one matmul for q/k/v and one for gate/up), or torch's own, called apart."""
    target = load_target(tiny_target_dir, dtype, pack=pack)
    model, layers = target.model, target.layer_ids
    assert fwd.supports(model)
    assert isinstance(model.model.layers[0].self_attn.q_proj, fwd.FusedProjection) == pack
    g = torch.Generator().manual_seed(0)
    ours, theirs = _caches(model, [9, 14, 6][:rows], g)
    monkeypatch.setattr(RaggedCache, "group_overhead", 0)  # every row its own group
    if rows == 1:
        ids, mask, q = torch.randint(3, 60, (1, 1), generator=g), None, 1
        pos = ours.lengths[:, None].clone()
    else:
        parents = torch.tensor([-1, 0, 0, 1, 2])
        q = 5
        ids = torch.randint(3, 60, (rows, q), generator=g)
        anc = ancestor_matrix(parents).repeat(rows, 1, 1)
        pos = ours.lengths[:, None] + depths(parents)
    outs = []
    for cache, run in ((ours, "ours"), (theirs, "theirs")):
        cache.begin(q)
        m = None if rows == 1 else cache.mask(anc)
        if run == "ours":
            outs.append(fwd.step_forward(model, ids, pos, m, cache, layers, row_groups=cache.groups))
        else:
            cap = forward_capture(model, ids, layers, attention_mask=m, position_ids=pos,
                                  past_key_values=cache, use_cache=True, row_groups=cache.groups)
            outs.append((cap.logits, cap.aux_hidden))
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == "float32" else dict(atol=1e-3, rtol=1e-3)  # < 1 bf16 ulp
    (lo, ao), (lt, at) = outs
    assert lo.shape == lt.shape == (rows, q, model.config.vocab_size) and ao.shape == at.shape
    torch.testing.assert_close(lo.float(), lt.float(), **tol)
    torch.testing.assert_close(ao.float(), at.float(), **tol)
    for x, y in zip(ours.keys + ours.values, theirs.keys + theirs.values):
        torch.testing.assert_close(x.float(), y.float(), **tol)
    ours.begin(1)  # no drafter: no features; logits_to_keep as transformers' argument
    m1 = None if rows == 1 else ours.mask(torch.ones(rows, 1, 1, dtype=torch.bool))
    logits, aux = fwd.step_forward(model, ids[:, :1], pos[:, :1], m1, ours, (), logits_to_keep=1)
    assert aux is None and logits.shape == (rows, 1, model.config.vocab_size)


def test_rope_by_roll_equals_transformers_rotate_half():
    """The step's RoPE (sign folded into sin, a roll) gives transformers' apply_rotary_pos_emb."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 6, 3, 16, generator=g), torch.randn(2, 2, 3, 16, generator=g)  # [b,heads,n,hd]
    cos, sin = torch.randn(2, 3, 16, generator=g), torch.randn(2, 3, 16, generator=g)  # [b,n,hd]
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got = fwd.rope(torch.cat([q, k], dim=1), *fwd.rope_factors(cos, sin))
    torch.testing.assert_close(got, torch.cat([want_q, want_k], dim=1), rtol=0, atol=1e-7)


def test_only_llama_style_models_on_the_grouped_kernel_take_it(tiny_target_dir):
    model = load_target(tiny_target_dir, "float32", pack=False).model  # row-major: deepcopy-able
    assert fwd.supports(model)
    other = copy.deepcopy(model)
    other.set_attn_implementation("sdpa")
    assert not fwd.supports(other)
    other = copy.deepcopy(model)
    other.config.model_type = "qwen3"  # q/k norms: not the same layer
    assert not fwd.supports(other)


def test_engine_steps_run_it_and_keep_greedy_output(tiny_target_dir, monkeypatch):
    """The engine's verify steps go through step_forward (prefill through transformers); with it
    switched off the same oracle-drafted greedy output and acceptance come out (fp32)."""
    target = load_target(tiny_target_dir, "float32")
    ids = target.tokenizer("hello there, how are", add_special_tokens=False)["input_ids"]
    plain = SpecEngine(target, None, PRESETS["baseline"])
    ref, _ = plain.generate(ids, 24)
    calls = []
    real = fwd.step_forward
    monkeypatch.setattr("eagle3_platform.spec.engine.step_forward",
                        lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    results = []
    for on in (True, False):
        engine = SpecEngine(target, OracleDrafter(ref, target.model.config.vocab_size, 4), PRESETS["chain"])
        engine.use_step_forward = on
        n = len(calls)
        out, stats = engine.generate(ids, 24)
        assert (len(calls) > n) == on
        results.append((out, stats["verify_steps"], stats["accept_hist"]))
    assert results[0] == results[1] and results[0][0] == ref


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@torch.no_grad()
def test_prompt_chunks_riding_a_step_equal_their_own_prefill_and_leave_the_step_as_it_was(tiny_target_dir,
                                                                                     monkeypatch, dtype):
    """mixed_forward: a 3-row tree verify with two prompt chunks riding along (a prompt's first chunk,
    and a second chunk after 7 cached tokens, longer than the grouped kernel's queries) gives the
    step's logits, features and cache as step_forward alone, and each chunk's last logits, features
    and cache as transformers' prefill of that chunk (tight tolerance: only the matmuls' row counts
    differ)."""
    target = load_target(tiny_target_dir, dtype)
    model, layers = target.model, target.layer_ids
    g = torch.Generator().manual_seed(1)
    ours, theirs = _caches(model, [9, 14, 6], g)
    monkeypatch.setattr(RaggedCache, "group_overhead", 0)
    parents = torch.tensor([-1, 0, 0, 1])
    ids = torch.randint(3, 60, (3, 4), generator=g)
    pos = ours.lengths[:, None] + depths(parents)
    first, rest = torch.randint(3, 60, (1, 11), generator=g), torch.randint(3, 60, (1, 70), generator=g)
    head = torch.randint(3, 60, (1, 7), generator=g)
    mine = [GrowingCache(), GrowingCache()]
    ref = [GrowingCache(), GrowingCache()]
    for c in (mine[1], ref[1]):  # the second prompt has 7 tokens cached
        model(input_ids=head, past_key_values=c, use_cache=True)
    for cache in (ours, theirs):
        cache.begin(4)
    anc = ancestor_matrix(parents).repeat(3, 1, 1)
    lo, ao, chunks = fwd.mixed_forward(model, ids, pos, ours.mask(anc), ours, layers, 0, ours.groups,
                                       [(first, mine[0]), (rest, mine[1])])
    lt, at = fwd.step_forward(model, ids, pos, theirs.mask(anc), theirs, layers, row_groups=theirs.groups)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == "float32" else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lo.float(), lt.float(), **tol)
    torch.testing.assert_close(ao.float(), at.float(), **tol)
    for x, y in zip(ours.keys + ours.values, theirs.keys + theirs.values):
        torch.testing.assert_close(x.float(), y.float(), **tol)
    for (logits, aux), chunk, cache, rcache in zip(chunks, (first, rest), mine, ref):
        want = forward_capture(model, chunk, layers, past_key_values=rcache, use_cache=True)
        assert logits.shape == (1, 1, model.config.vocab_size) and aux.shape == want.aux_hidden.shape
        torch.testing.assert_close(logits.float(), want.logits[:, -1:].float(), **tol)
        torch.testing.assert_close(aux.float(), want.aux_hidden.float(), **tol)
        assert cache.get_seq_length() == rcache.get_seq_length()
        for i in range(model.config.num_hidden_layers):
            torch.testing.assert_close(cache.layers[i].keys.float(), rcache.layers[i].keys.float(), **tol)
            torch.testing.assert_close(cache.layers[i].values.float(), rcache.layers[i].values.float(), **tol)
