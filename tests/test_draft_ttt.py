"""TTT alignment (docs/ARCHITECTURE.md §5) on a hand-made sequence, single-pass attention == naive reference,
and masking of the loss to response positions."""
from __future__ import annotations

import pytest
import torch

from eagle3_platform.draft.model import DraftConfig, build_draft, target_hf_config
from eagle3_platform.draft.ttt import (TTTLoss, batch_targets, blockwise_ttt_attention, collate,
                                       fused_ttt_attention, naive_ttt_attention, soft_cross_entropy,
                                       shift_left, step_masks, step_terms, teacher, ttt_attention,
                                       ttt_forward)

# hand-made sequence: prompt x0..x3 (loss_mask 0), response x4..x9 (loss_mask 1); r = 4
T, R = 10, 4
IDS = torch.tensor([[11, 12, 13, 14, 21, 22, 23, 24, 25, 26]])
LOSS_MASK = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)


@pytest.fixture(scope="module")
def draft(tiny_target_dir):
    cfg = DraftConfig.from_target(target_hf_config(tiny_target_dir), 64, [1, 3, 4])
    torch.manual_seed(0)
    return build_draft(tiny_target_dir, cfg).eval()


@pytest.mark.parametrize("k", range(4))
def test_supervised_positions_per_step(k):
    in_vocab = torch.ones(1, T, dtype=torch.bool)
    in_vocab[0, 6] = False                       # target's top-1 at position 6 not in the draft vocab
    m = step_masks(LOSS_MASK, in_vocab, 4)[k][0]
    # position t predicts x_{t+2+k} with teacher z_{t+1+k}
    want = [t + 2 + k < T and bool(LOSS_MASK[0, t + 2 + k]) and t + 1 + k != 6 for t in range(T)]
    assert m.tolist() == want
    if k == 0:
        # the first draft guess after the target's first response token x_r: t = r-1 reads (g_{r-1}, x_r)
        # and predicts x_{r+1}. Trained here; SpecForge's unshifted mask (loss_mask[t] = 0) skips it.
        assert m[R - 1] and not LOSS_MASK[0, R - 1]
        assert not m[R - 3]                      # would predict x_{r-1}, a prompt token


def test_inputs_and_rope_positions_per_step(draft, monkeypatch):
    seen_ids, seen_pos = [], []
    embed, rope = draft.embed, draft.rope
    monkeypatch.setattr(draft, "embed", lambda ids: (seen_ids.append(ids.clone()), embed(ids))[1])
    monkeypatch.setattr(draft, "rope", lambda x, p: (seen_pos.append(p.clone()), rope(x, p))[1])
    g = torch.randn(1, T, 3 * draft.cfg.hidden_size)
    with torch.no_grad():
        list(ttt_forward(draft, g, IDS, 4))
    for k in range(4):
        want = [int(IDS[0, t + 1 + k]) if t + 1 + k < T else 0 for t in range(T)]   # x_{t+1+k}
        assert seen_ids[k][0].tolist() == want
        assert seen_pos[k][0].tolist() == [t + k for t in range(T)]              # RoPE position t+k


@pytest.mark.parametrize("k", range(4))
def test_teacher_position_per_step(k):
    Vd = 16
    # teacher at position p is peaked on draft token p; draft logits at t peaked on token t+1+k
    tprobs = torch.softmax(20 * torch.eye(Vd)[:T][None], -1)                        # [1,T,Vd]
    logits = 20 * torch.eye(Vd)[[min(t + 1 + k, Vd - 1) for t in range(T)]][None]
    mask = torch.zeros(1, T, dtype=torch.bool)
    mask[0, :T - 1 - k] = True                                                      # teacher exists
    ce, hit = step_terms(k, logits, lambda x: x, tprobs, mask)
    assert hit.shape == (T - 1 - k,) and hit.all() and ce.max() < 1e-3
    mask[0, T - 2 - k] = False
    ce_wrong, hit_wrong = step_terms(k + 1, logits, lambda x: x, tprobs, mask)      # off by one
    assert not hit_wrong.any() and ce_wrong.min() > 1


def test_teacher_is_target_distribution_renormalised_over_draft_vocab():
    torch.manual_seed(0)
    W, s = torch.randn(30, 8), torch.randn(1, 5, 8)
    d2t_ids = torch.tensor([1, 4, 7, 20])
    top2 = (s @ W.T).topk(2, -1).values
    # every top-1 clear of the runner-up by far more than rounding: argmaxes of matmuls of other
    # shapes (below) then agree on any CPU, so the flags may be compared exactly
    assert (top2[..., 0] - top2[..., 1] > 1e-3).all()
    probs, ok = teacher(s, W, d2t_ids)
    full = torch.softmax(s @ W.T, -1)[..., d2t_ids]
    torch.testing.assert_close(probs, full / full.sum(-1, keepdim=True))
    assert ok.tolist() == torch.isin((s @ W.T).argmax(-1), d2t_ids).tolist()
    need = torch.tensor([[True, False, True, True, False]])
    probs2, ok2 = teacher(s, W, d2t_ids, need)
    # a [3,8] @ [8,30] matmul need not round bitwise like the [5,8] one (it differs on some CPUs)
    torch.testing.assert_close(probs2[need], probs[need], atol=1e-6, rtol=1e-5)
    assert torch.equal(ok2[need], ok[need]) and not ok2[~need].any()


def test_teacher_with_cached_top1_equals_the_full_vocab_teacher():
    from eagle3_platform.draft.ttt import TargetTop1

    torch.manual_seed(1)
    W = torch.randn(300, 8)
    d2t_ids = torch.randperm(300)[:40].sort().values
    samples = [{"input_ids": torch.arange(T), "loss_mask": (torch.arange(T) >= 2).long(),
                "aux_hidden": torch.zeros(T, 24), "last_hidden": torch.randn(T, 8) * 3} for T in (9, 6, 7)]
    # a hidden state whose top-1 is in the draft vocab, so both branches of in_vocab are exercised
    samples[0]["last_hidden"][4] = W[d2t_ids[0]] * 5
    cache, in_vocab = TargetTop1(W), []
    for order in ([0, 1], [2, 0], [1, 2]):  # every sample meets the cache in a second, other batch
        batch = collate([samples[i] for i in order])
        need = shift_left(batch.loss_mask, 1, fill=False)
        probs, ok = teacher(batch.last_hidden, W, d2t_ids, need)
        known = cache.batch(batch, order, need)
        cprobs, cok = teacher(batch.last_hidden, W, d2t_ids, need, known)
        torch.testing.assert_close(cprobs, probs, atol=1e-6, rtol=1e-5)
        # in_vocab comes from argmaxes of matmuls of other shapes (per sample vs per batch): compared
        # where the top two logits are apart by more than rounding, not bitwise
        top2 = (batch.last_hidden @ W.T).topk(2, -1).values
        clear = need & (top2[..., 0] - top2[..., 1] > 1e-4)
        assert clear.sum() >= need.sum() - 1 and (cok[clear] == ok[clear]).all()
        assert (known[need] >= 0).all() and (known[~need] == -1).all()
        in_vocab += ok[need].tolist()
    assert sorted(cache.ids) == [0, 1, 2] and True in in_vocab and False in in_vocab
    with pytest.raises(ValueError, match="top-1"):  # a needed row the cache never computed
        teacher(batch.last_hidden, W, d2t_ids, need, torch.full(need.shape, -1))


@pytest.mark.parametrize("attention", [blockwise_ttt_attention, fused_ttt_attention, ttt_attention])
@pytest.mark.parametrize("K", [1, 2, 3, 4])
def test_single_pass_attention_equals_naive_reference(draft, K, attention):
    torch.manual_seed(K)
    B, H = 2, draft.cfg.hidden_size
    ids, g = torch.randint(0, 400, (B, 11)), torch.randn(B, 11, 3 * H)
    fast = [lg for _, lg in ttt_forward(draft, g, ids, K, attention)]
    ref = [lg for _, lg in ttt_forward(draft, g, ids, K, naive_ttt_attention)]
    for a, b in zip(fast, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # gradients agree too (the backward of the single-pass form is what trains)
    ga = torch.autograd.grad(sum(x.square().mean() for x in fast), draft.fc.weight)[0]
    gb = torch.autograd.grad(sum(x.square().mean() for x in ref), draft.fc.weight)[0]
    torch.testing.assert_close(ga, gb, atol=1e-5, rtol=1e-4)


def test_ttt_attention_takes_the_fused_kernel_on_long_sequences(monkeypatch):
    import eagle3_platform.draft.ttt as ttt

    called = []
    monkeypatch.setattr(ttt, "fused_ttt_attention", lambda q, ks, vs: called.append(q.shape[2]) or q)
    monkeypatch.setattr(ttt, "FUSED_MIN_LEN", 8)
    monkeypatch.setattr(ttt, "FUSED_MIN_LEN_CAUSAL", 5)  # step 0: causal, block-skipping in the kernel
    for T in (4, 5, 7, 8):
        q = torch.randn(1, 2, T, 4)
        ttt.ttt_attention(q, [q], [q])
        ttt.ttt_attention(q, [q, q], [q, q])
    assert called == [5, 7, 8, 8]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_soft_cross_entropy_equals_log_softmax_reference(dtype, tol):
    torch.manual_seed(0)
    x = (torch.randn(6, 50) * 4).to(dtype).requires_grad_()
    p = torch.softmax(torch.randn(6, 50) * 3, -1)
    g = torch.rand(6)
    ref = -(p * torch.log_softmax(x.float(), -1)).sum(-1)
    (ref_grad,) = torch.autograd.grad(ref, x, g)
    ce = soft_cross_entropy(x, p)
    (grad,) = torch.autograd.grad(ce, x, g)
    assert ce.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(ce, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=tol, rtol=tol)
    assert x.grad is None and x.detach().abs().max() > 1    # the logits are left untouched


def test_soft_cross_entropy_gradcheck():
    torch.manual_seed(1)
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    p = torch.softmax(torch.randn(3, 7, dtype=torch.float64), -1)
    assert torch.autograd.gradcheck(lambda x: soft_cross_entropy(x, p), (x,))


@pytest.fixture(scope="module")
def lm_head(tiny_target_dir):
    from eagle3_platform.draft.model import target_head_weights

    return target_head_weights(tiny_target_dir)["lm_head"]


def _loss(draft, lm_head, samples, K=3):
    batch = collate(samples)
    tprobs, masks = batch_targets(batch, lm_head, draft, K)
    denom = torch.stack([m.sum() for m in masks])
    with torch.no_grad():
        loss, _, n = TTTLoss(draft, K)(batch.aux_hidden, batch.input_ids, tprobs, masks, denom)
    return loss, n


def _sample(draft, T=16, first_response=6, seed=3):
    g = torch.Generator().manual_seed(seed)
    H = draft.cfg.hidden_size
    mask = torch.zeros(T, dtype=torch.long)
    mask[first_response:] = 1
    return {"input_ids": torch.randint(0, 60, (T,), generator=g), "loss_mask": mask,
            "aux_hidden": torch.randn(T, 3 * H, generator=g), "last_hidden": torch.randn(T, H, generator=g) * 3}


def test_loss_ignores_prompt_teacher_values(draft, lm_head):
    s = _sample(draft)
    base, n = _loss(draft, lm_head, [s])
    assert n.sum() > 0
    # teacher positions p are used only where the predicted token x_{p+1} is a response token
    prompt_pred = [p for p in range(15) if s["loss_mask"][p + 1] == 0]
    s2 = {**s, "last_hidden": s["last_hidden"].clone()}
    s2["last_hidden"][prompt_pred] = torch.randn(len(prompt_pred), draft.cfg.hidden_size) * 5
    torch.testing.assert_close(_loss(draft, lm_head, [s2])[0], base, rtol=1e-6, atol=1e-7)
    s3 = {**s, "last_hidden": s["last_hidden"].clone()}
    s3["last_hidden"][10] += 5                        # a response-predicting teacher: loss must move
    assert not torch.allclose(_loss(draft, lm_head, [s3])[0], base, rtol=1e-6, atol=1e-7)


def test_loss_zero_without_response_tokens(draft, lm_head):
    s = _sample(draft)
    s["loss_mask"] = torch.zeros_like(s["loss_mask"])
    loss, n = _loss(draft, lm_head, [s])
    assert float(loss) == 0.0 and int(n.sum()) == 0


def test_right_padding_is_invisible(draft, lm_head):
    a, b = _sample(draft, T=16), _sample(draft, T=9, first_response=3, seed=4)
    batch = collate([a, b])
    alone = collate([b])
    with torch.no_grad():
        padded = [lg for _, lg in ttt_forward(draft, batch.aux_hidden, batch.input_ids, 3)]
        single = [lg for _, lg in ttt_forward(draft, alone.aux_hidden, alone.input_ids, 3)]
    for k in range(3):   # valid positions of b (whose inputs exist) are unaffected by padding
        torch.testing.assert_close(padded[k][1, :9 - 1 - k], single[k][0, :9 - 1 - k], atol=1e-5, rtol=1e-5)
    for s in (a, b):  # the counts rest on argmaxes of matmuls of other shapes (batch of 2 vs 1):
        # exact only where every top-1 is clear of the runner-up by far more than rounding
        top2 = (s["last_hidden"] @ lm_head.float().T).topk(2, -1).values
        assert (top2[..., 0] - top2[..., 1] > 1e-3).all()
    _, nab = _loss(draft, lm_head, [a, b])
    assert torch.equal(nab, _loss(draft, lm_head, [a])[1] + _loss(draft, lm_head, [b])[1])
