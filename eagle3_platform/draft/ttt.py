"""Training-time test (TTT) for the EAGLE-3 head: alignment, attention pattern, loss
(docs/ARCHITECTURE.md §5).

Alignment (sequence x_0..x_{T-1}, target features g_t, target post-norm state s_t, z_t = lm_head(s_t)):
  step k, position t: hidden = fc(g_t) (k=0) or the draft's own pre-norm output of step k-1 at t;
                      token  = x_{t+1+k};  RoPE position t+k;  predicts x_{t+2+k};
                      teacher = softmax(z_{t+1+k} restricted to the draft vocab)  (renormalised)
  supervised iff loss_mask[t+2+k] == 1 (the predicted token is a response token)
             and argmax_V z_{t+1+k} is in the draft vocab (otherwise the draft can never be right).
Why the shifted mask (loss_mask[t+2+k], not SpecForge's loss_mask[t]): at inference the target emits
the first response token x_r itself; the draft's first guess is then x_{r+1} from (g_{r-1}, x_r) — the
position t = r-1 whose loss_mask[t] is 0 (prompt) but loss_mask[t+2] is 1. The unshifted mask never
trains that guess, which is made on every single request; the shifted one does (tested).

Attention at (step k, position t): step-0 keys at positions ≤ t, plus the key of every step j in 1..k
at the same position t (the draft's own earlier guesses along this chain — exactly what it sees when
drafting at inference). `blockwise_ttt_attention` computes this per step in one pass: a causal [T,T]
block against step-0 keys plus k diagonal scores (elementwise q·k_j), softmaxed together;
`fused_ttt_attention` hands the concatenated keys and the mask to torch's SDPA kernel (faster from
~512 tokens); `ttt_attention` picks one. `naive_ttt_attention` is the reference: all keys of steps
0..k concatenated with an explicit mask.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eagle3_platform.draft.model import Eagle3Draft, repeat_kv
from eagle3_platform.model.sampling import greedy

STEP_WEIGHT_DECAY = 0.8   # loss weight of step k is 0.8**k (EAGLE-3 / SpecForge)
TEACHER_CHUNK = 1024      # rows of last_hidden per full-vocab teacher matmul (bounds memory)


@dataclass
class Batch:
    input_ids: torch.Tensor    # [B,T] int64, right-padded with 0
    loss_mask: torch.Tensor    # [B,T] bool, False on padding
    aux_hidden: torch.Tensor   # [B,T,3H]
    last_hidden: torch.Tensor  # [B,T,H]
    lengths: torch.Tensor      # [B]

    def to(self, device) -> "Batch":
        return Batch(*(x.to(device, non_blocking=True) for x in (self.input_ids, self.loss_mask, self.aux_hidden,
                                                                  self.last_hidden, self.lengths)))


def collate(samples: Sequence[dict], max_len: int | None = None) -> Batch:
    """Right-pad samples (ShardDataset items) into a batch; truncate each to max_len tokens.
    Right padding is invisible to real positions: attention is causal (plus same-position keys)."""
    lens = [min(len(s["input_ids"]), max_len or 1 << 62) for s in samples]
    B, T = len(samples), max(lens)
    H = samples[0]["last_hidden"].shape[-1]
    b = Batch(torch.zeros(B, T, dtype=torch.int64), torch.zeros(B, T, dtype=torch.bool),
              torch.zeros(B, T, 3 * H), torch.zeros(B, T, H), torch.tensor(lens))
    for i, (s, n) in enumerate(zip(samples, lens)):
        b.input_ids[i, :n] = torch.as_tensor(s["input_ids"][:n]).long()
        b.loss_mask[i, :n] = torch.as_tensor(s["loss_mask"][:n]).bool()
        b.aux_hidden[i, :n] = s["aux_hidden"][:n].float()
        b.last_hidden[i, :n] = s["last_hidden"][:n].float()
    return b


def real_positions(batch: Batch) -> torch.Tensor:
    """[B,T] bool: True on every real (unpadded) position — the loss mask that supervises prompt tokens too."""
    return torch.arange(batch.input_ids.shape[1], device=batch.lengths.device)[None, :] < batch.lengths[:, None]


@torch.no_grad()
def target_top1(hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """[n,H] target post-norm states, [V,H] lm_head -> [n] int64: the target's top-1 token (argmax of
    its full-vocab logits), TEACHER_CHUNK rows per matmul so [*,V] logits stay bounded."""
    x = hidden.to(lm_head.dtype)
    return torch.cat([greedy(x[i:i + TEACHER_CHUNK] @ lm_head.T) for i in range(0, x.shape[0], TEACHER_CHUNK)]
                     or [torch.zeros(0, dtype=torch.int64)])


@torch.no_grad()
def teacher(last_hidden: torch.Tensor, target_lm_head: torch.Tensor, draft_to_target: torch.Tensor,
            need: torch.Tensor | None = None, top1: torch.Tensor | None = None):
    """last_hidden [B,T,H] (target post-norm), target_lm_head [V,H] (its dtype is the matmuls'),
    draft_to_target [Vd] -> (teacher probs over the draft vocab [B,T,Vd] fp32, target top-1 in draft
    vocab [B,T] bool).
    need [B,T] bool: compute only these rows (others: probs 0, in_vocab False — never supervised).
    top1 [B,T] int64: the target's top-1 at the needed rows, known already (TargetTop1); then only the
    lm_head's Vd rows are multiplied, not all V (Vd 8192 of SmolLM2's 49152: 1/6 of the work)."""
    B, T, H = last_hidden.shape
    dev = last_hidden.device
    rows = (need.reshape(-1) if need is not None else torch.ones(B * T, dtype=torch.bool, device=dev)).nonzero()[:, 0]
    flat = last_hidden.reshape(-1, H)[rows].to(target_lm_head.dtype)  # [n,H]
    top = target_top1(flat, target_lm_head) if top1 is None else top1.reshape(-1)[rows]  # [n]
    if top.numel() and int(top.min()) < 0:
        raise ValueError("top1 lacks a needed position's target top-1")
    in_vocab = torch.zeros(target_lm_head.shape[0], dtype=torch.bool, device=dev)  # [V]
    in_vocab[draft_to_target] = True
    ok = torch.zeros(B * T, dtype=torch.bool, device=dev)
    ok[rows] = in_vocab[top]
    W = target_lm_head[draft_to_target]                               # [Vd,H]
    probs = torch.zeros(B * T, draft_to_target.numel(), device=dev)
    for i in range(0, flat.shape[0], TEACHER_CHUNK):
        z = flat[i:i + TEACHER_CHUNK] @ W.T                           # [c,Vd]
        probs[rows[i:i + TEACHER_CHUNK]] = torch.softmax(z, -1, dtype=torch.float32)  # renormalised over Vd
    return probs.view(B, T, -1), ok.view(B, T)


class TargetTop1:
    """The target's top-1 token at the positions a teacher needs, per sample, computed once a run.
    It is a pure function of a sample's features, yet the full-vocab matmul behind it was ~20% of a CPU
    training step (SmolLM2, Vd 8192, bf16, 2 threads: teacher 0.44 s of 2.2), paid again every epoch.
    Each sample's rows are multiplied on their own, whatever batch it arrives in, so a resumed run sees
    the top-1s an uninterrupted one saw."""

    def __init__(self, lm_head: torch.Tensor):
        self.lm_head = lm_head                  # [V,H], in the dtype the matmuls run in
        self.ids: dict[int, torch.Tensor] = {}  # sample -> [n] int32, -1 where not computed

    def batch(self, batch: "Batch", samples: Sequence[int], need: torch.Tensor) -> torch.Tensor:
        """batch rows = the given samples, need [B,T] bool -> [B,T] int64 top-1 ids (-1 elsewhere)."""
        out = torch.full(need.shape, -1, dtype=torch.int64, device=need.device)
        for row, s in enumerate(samples):
            n = int(batch.lengths[row])
            top = self.ids.get(s, torch.full((n,), -1, dtype=torch.int32, device=need.device))
            missing = need[row, :n] & (top < 0)
            if missing.any():
                top = top.clone()
                top[missing] = target_top1(batch.last_hidden[row, :n][missing], self.lm_head).int()
                self.ids[s] = top
            out[row, :n] = top
        return out


class SoftCrossEntropy(torch.autograd.Function):
    """ce[i] = -Σ_v p[i,v]·log_softmax(x[i])_v = lse(x[i]) - Σ_v p[i,v]·x[i,v]   (rows of p sum to 1)
    for logits x [n,V] (any float dtype) and teacher probs p [n,V] fp32 → [n] in p's dtype (fp32);
    dce/dx = softmax(x) - p.
    The values of log_softmax → product → sum, in fewer passes over [n,V] fp32: that elementwise
    traffic, with the TTT attention's, was half of a CPU training step. One exp pass in all (the softmax is kept
    for the backward)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        with torch.autocast(logits.device.type, enabled=False):   # einsum would run in bf16
            x = logits.to(probs.dtype, copy=True)                   # [n,V] working buffer (fp32)
            m = x.max(-1, keepdim=True).values                      # [n,1]
            dot = torch.einsum("nv,nv->n", probs, x)                # [n] Σ p·x, no [n,V] product
            soft = x.sub_(m).exp_()                                 # [n,V] exp(x - m), in place
            z = soft.sum(-1, keepdim=True)                          # [n,1]
            soft.div_(z)                                            # softmax(x)
            ce = (m + z.log()).squeeze(-1) - dot                    # lse - Σ p·x
        ctx.save_for_backward(soft, probs)
        ctx.logits_dtype = logits.dtype
        return ce

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        soft, probs = ctx.saved_tensors
        g = torch.sub(soft, probs).mul_(grad[:, None])              # [n,V] (softmax - p)·grad
        return g.to(ctx.logits_dtype), None


def soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """[n,V] logits, [n,V] probs (rows sum to 1) → [n] fp32 soft-label cross-entropy (SoftCrossEntropy)."""
    return SoftCrossEntropy.apply(logits, probs)


def step_masks(loss_mask: torch.Tensor, in_vocab: torch.Tensor, K: int) -> list[torch.Tensor]:
    """[B,T] supervision mask of every step k: m_k[t] = loss_mask[t+2+k] & in_vocab[t+1+k] (0 past T)."""
    B, T = loss_mask.shape
    out = []
    for k in range(K):
        m = torch.zeros(B, T, dtype=torch.bool, device=loss_mask.device)
        n = T - 2 - k
        if n > 0:
            m[:, :n] = loss_mask[:, 2 + k:2 + k + n] & in_vocab[:, 1 + k:1 + k + n]
        out.append(m)
    return out


def shift_left(x: torch.Tensor, s: int, fill=0) -> torch.Tensor:
    """out[:, t] = x[:, t+s] (fill past the end)."""
    out = torch.full_like(x, fill)
    if s < x.shape[1]:
        out[:, :x.shape[1] - s] = x[:, s:]
    return out


def blockwise_ttt_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    """q [B,nh,T,hd]; ks/vs: keys/values of steps 0..k, each [B,nh,T,hd] → [B,nh,T,hd].
    Scores: causal block q·K0ᵀ [T,T] and, for j = 1..k, the diagonal q_t·K_j[t] [T,1]; one softmax."""
    T, scale = q.shape[2], 1.0 / math.sqrt(q.shape[-1])
    s0 = (q @ ks[0].transpose(-1, -2)) * scale                        # [B,nh,T,T]
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    s0 = s0.masked_fill(future, float("-inf"))                        # step-0 keys at positions ≤ t
    diag = [(q * kj).sum(-1, keepdim=True) * scale for kj in ks[1:]]  # k × [B,nh,T,1]
    w = torch.softmax(torch.cat([s0, *diag], dim=-1).float(), dim=-1).to(q.dtype)  # [B,nh,T,T+k]
    out = w[..., :T] @ vs[0]
    for j, vj in enumerate(vs[1:]):
        out = out + w[..., T + j:T + j + 1] * vj                     # same-position value of step j+1
    return out


def fused_ttt_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    """The same attention through torch's fused SDPA kernel: keys of all steps concatenated [(k+1)T]
    under the TTT mask (causal block + one diagonal per later step). It computes (k+1)x the scores of
    the blockwise form, but never materialises [T,T] in memory, which is what costs on long sequences."""
    T, n = q.shape[2], len(ks)
    if n == 1:
        return F.scaled_dot_product_attention(q, ks[0], vs[0], is_causal=True)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=q.device)
    mask = torch.cat([causal, *[eye] * (n - 1)], dim=1)               # [T,(k+1)T] True = attend
    return F.scaled_dot_product_attention(q, torch.cat(ks, 2), torch.cat(vs, 2), attn_mask=mask)


# From these lengths the fused kernel is faster on CPU (fwd+bwd, bf16, 2 threads; below them the
# blockwise one wins). Step 0 is plain causal attention, which the flash kernel computes
# block-causally, so it pays from shorter batches; later steps hand it a mask, so it scores every key.
FUSED_MIN_LEN = 512
FUSED_MIN_LEN_CAUSAL = 256


def ttt_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    """TTT attention of step k = len(ks)-1 (module docstring): blockwise for short batches, the fused
    kernel for long ones and on GPUs. Both equal naive_ttt_attention (tested)."""
    min_len = FUSED_MIN_LEN_CAUSAL if len(ks) == 1 else FUSED_MIN_LEN
    if q.is_cuda or q.shape[2] >= min_len:
        return fused_ttt_attention(q, ks, vs)
    return blockwise_ttt_attention(q, ks, vs)


def naive_ttt_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    """Reference: keys of all steps concatenated [(k+1)T] with an explicit boolean mask."""
    T, n = q.shape[2], len(ks)
    K = torch.cat(ks, dim=2)                                          # [B,nh,(k+1)T,hd]
    Vv = torch.cat(vs, dim=2)
    allowed = torch.zeros(T, n * T, dtype=torch.bool, device=q.device)
    for t in range(T):
        allowed[t, :t + 1] = True                                     # step 0: positions ≤ t
        for j in range(1, n):
            allowed[t, j * T + t] = True                              # step j: only position t
    scores = (q @ K.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    w = torch.softmax(scores.masked_fill(~allowed, float("-inf")).float(), dim=-1).to(q.dtype)
    return w @ Vv


AttentionFn = Callable[[torch.Tensor, list, list], torch.Tensor]


def ttt_hidden(model: Eagle3Draft, aux_hidden: torch.Tensor, input_ids: torch.Tensor, K: int,
               attention: AttentionFn = ttt_attention):
    """Yields (k, h_k [B,T,H]) for k = 0..K-1: the pre-norm output of step k (position t predicts
    x_{t+2+k} through model.logits)."""
    B, T = input_ids.shape
    n_rep = model.cfg.num_attention_heads // model.cfg.num_key_value_heads
    hidden = model.project(aux_hidden)                                # [B,T,H] = fc(g)
    ks, vs = [], []
    for k in range(K):
        emb = model.embed(shift_left(input_ids, 1 + k)).to(hidden.dtype)  # emb(x_{t+1+k})
        pos = (torch.arange(T, device=input_ids.device) + k).expand(B, T)  # RoPE position t+k
        cos, sin = model.rope(hidden, pos)
        q, kk, vv = model.midlayer.qkv(emb, hidden, cos, sin)
        ks.append(repeat_kv(kk, n_rep))
        vs.append(repeat_kv(vv, n_rep))
        hidden = model.midlayer.finish(hidden, attention(q, ks, vs))  # pre-norm output → next step
        yield k, hidden


def ttt_forward(model: Eagle3Draft, aux_hidden: torch.Tensor, input_ids: torch.Tensor, K: int,
                attention: AttentionFn = ttt_attention):
    """Yields (k, logits_k [B,T,Vd]) for k = 0..K-1 (all positions; for tests and analysis)."""
    for k, h in ttt_hidden(model, aux_hidden, input_ids, K, attention):
        yield k, model.logits(h)


def step_terms(k: int, h: torch.Tensor, logits_fn, teacher_probs: torch.Tensor, mask: torch.Tensor):
    """Step k on the supervised positions only (the lm_head over Vd dominates the head's cost, and
    about half the positions are prompt): h [B,T,*] → per supervised position (row-major order)
    soft-label CE [n] (fp32) against the teacher of position t+1+k, and top-1 hits [n]
    (draft argmax == teacher argmax = the target's top-1)."""
    b, t = mask.nonzero(as_tuple=True)                                 # invariant: t+1+k < T where mask
    logits = logits_fn(h[b, t])                                        # [n,Vd]
    tgt = teacher_probs[b, t + 1 + k]                                  # [n,Vd] teacher at t+1+k
    return soft_cross_entropy(logits, tgt), greedy(logits) == greedy(tgt)


class TTTLoss(nn.Module):
    """Wraps the draft so DDP sees one forward: returns (loss, stats) for a batch.

    denominators [K]: number of supervised positions of each step over the GLOBAL batch (all ranks);
    scale: world size (DDP averages gradients over ranks, so loss·world/global_count gives exactly the
    single-process gradient of the global batch)."""

    def __init__(self, draft: Eagle3Draft, K: int, attention: AttentionFn = ttt_attention):
        super().__init__()
        self.draft, self.K, self.attention = draft, K, attention

    def forward(self, aux_hidden, input_ids, teacher_probs, masks, denominators, scale: float = 1.0):
        loss = aux_hidden.new_zeros((), dtype=torch.float32)
        correct, counted = [], []
        for k, h in ttt_hidden(self.draft, aux_hidden, input_ids, self.K, self.attention):
            ce, hit = step_terms(k, h, self.draft.logits, teacher_probs, masks[k])
            loss = loss + STEP_WEIGHT_DECAY ** k * ce.sum() / denominators[k].clamp(min=1)
            correct.append(hit.sum())
            counted.append(masks[k].sum())
        return loss * scale, torch.stack(correct), torch.stack(counted)


def batch_targets(batch: Batch, target_lm_head: torch.Tensor, draft: Eagle3Draft, K: int,
                  top1: tuple[TargetTop1, Sequence[int]] | None = None):
    """Teacher probs [B,T,Vd] and per-step supervision masks for a batch.
    top1: (cache, the batch's sample ids): the target's top-1s from the cache (TargetTop1)."""
    d2t_ids = draft.to_target_ids(torch.arange(draft.cfg.draft_vocab_size, device=draft.d2t.device))
    # the teacher of position p is used only when x_{p+1} is a response token (step_masks)
    need = shift_left(batch.loss_mask, 1, fill=False)
    known = top1[0].batch(batch, top1[1], need) if top1 else None
    tprobs, in_vocab = teacher(batch.last_hidden, target_lm_head, d2t_ids, need, known)
    return tprobs, step_masks(batch.loss_mask, in_vocab, K)


__all__ = ["Batch", "collate", "real_positions", "teacher", "target_top1", "TargetTop1", "step_masks", "ttt_attention", "blockwise_ttt_attention",
           "fused_ttt_attention", "naive_ttt_attention",
           "ttt_hidden", "ttt_forward", "soft_cross_entropy", "step_terms", "shift_left", "TTTLoss", "batch_targets", "STEP_WEIGHT_DECAY"]
