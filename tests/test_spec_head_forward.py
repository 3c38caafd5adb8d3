"""The head's drafting forward (spec/head_forward.py) against the module's backbone + logits: the same
outputs and new draft entries for every shape drafting runs (one row, rows with a mask, a prompt's
causal entries), on the head's module weights and its packed and 4-bit copies, in fp32 and bf16."""
from __future__ import annotations

import pytest
import torch

from eagle3_platform.draft.quant import int4_head, packed_head
from eagle3_platform.model.int4_weights import int4_available
from eagle3_platform.model.packed_linear import packing_available
from eagle3_platform.spec import head_forward
from eagle3_platform.spec.drafter import DraftKV
from eagle3_platform.spec.head_forward import head_backbone, head_logits
from eagle3_platform.spec.tree import additive_mask
from eagle3_platform.testing.spec import VariedTargetConfig, random_draft, varied_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAST = 20  # committed draft entries before the forward


def _head(kind: str):
    target = varied_target(None, VariedTargetConfig(vocab_size=96))
    draft = random_draft(target, 64)
    if kind == "packed":
        if not packing_available():
            pytest.skip("no oneDNN")
        return packed_head(draft)
    if kind == "int4":
        if not int4_available():
            pytest.skip("no int4 kernel")
        return int4_head(draft, int4_rows=8)
    return draft


def _inputs(draft, B: int, T: int, masked: bool, start: int = PAST, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    c, dtype = draft.cfg, draft.norm.weight.dtype
    kv = DraftKV.empty(B, c.num_key_value_heads, c.head_dim, PAST + T + 4, dtype)
    kv.extend(*(torch.randn(B, c.num_key_value_heads, PAST, c.head_dim, generator=g).to(dtype) for _ in "kv"))
    kv.commit()
    ids = torch.randint(0, c.vocab_size, (B, T), generator=g)
    hidden = torch.randn(B, T, c.hidden_size, generator=g).to(dtype)
    pos = start + torch.arange(T)[None].expand(B, T)
    mask = None
    if masked:  # each row hides some of its committed entries, sees its new ones causally
        allowed = torch.rand(B, 1, T, PAST, generator=g) < 0.7
        causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(B, 1, T, T)
        mask = additive_mask(torch.cat([allowed, causal], dim=-1), dtype)
    return ids, hidden, pos, mask, kv


def _both(draft, ids, hidden, pos, mask, kv):
    """(module path, lean path), each (h, k, v, logits, the cache's entries after the forward)."""
    out = []
    with torch.no_grad():
        for run in (lambda: draft.backbone(draft.embed(ids), hidden, pos, mask, kv),
                    lambda: head_backbone(draft, ids, hidden, pos, mask, kv)):
            h, (k, v) = run()
            logits = draft.logits(h) if not out else head_logits(draft, h)
            out.append((h, k, v, logits, kv.keys[:, :, :kv.end].clone()))
            kv.rewind()
    return out


@pytest.mark.parametrize("kind", ["module", "packed", "int4"])
@pytest.mark.parametrize("B,T,masked", [(1, 1, False), (1, 3, False), (3, 1, True), (2, 4, True),
                                        (1, 24, False)])  # a chain's depth, a catch-up, a batch, a prompt
def test_the_lean_forward_equals_the_modules_backbone_and_logits(kind, B, T, masked):
    draft = _head(kind)
    module, lean = _both(draft, *_inputs(draft, B, T, masked))
    for got, want in zip(lean, module):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_positions_past_the_rope_table_grow_it():
    draft = _head("module")
    far = head_forward.ROPE_TABLE_MIN + 300
    module, lean = _both(draft, *_inputs(draft, 2, 2, True, start=far))
    for got, want in zip(lean, module):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(head_forward._plan(draft).table) > far + 1


def test_a_bf16_head_matches_and_a_cast_rebuilds_the_plan():
    draft = _head("module")
    _both(draft, *_inputs(draft, 1, 1, False))  # an fp32 plan first
    draft.cast_parameters(torch.bfloat16)
    module, lean = _both(draft, *_inputs(draft, 2, 3, True))
    assert head_forward._plan(draft).dtype == torch.bfloat16
    for got, want in zip(lean, module):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_anything_but_an_eagle3_head_runs_its_own_backbone():
    calls = []

    class Other:
        def embed(self, ids):
            return torch.zeros(*ids.shape, 4)

        def backbone(self, emb, hidden, pos, mask, kv):
            calls.append("backbone")
            return hidden + 1, (None, None)

        def logits(self, h):
            calls.append("logits")
            return h * 2

    h, _ = head_backbone(Other(), torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, 4), None)
    torch.testing.assert_close(head_logits(Other(), h), torch.full((1, 1, 4), 2.0))
    assert calls == ["backbone", "logits"]
